"""cost.py -- what an aten op touches and costs: the bytes it reads and writes, the FLOPs it does.

What it is
    accesses(func, args, kwargs, out): the op's reads, writes and fresh outputs, from its schema's
    alias info (views touch nothing, `Tensor(a!)` arguments are written, non-aliasing returns are
    new tensors).
    traffic(...): the bytes it moves; flops(...): its FLOPs (torch.utils.flop_counter's formulas;
    attention at the causal half its flash kernels compute). The stream recorder (sim.py) uses these
    for every op it sees;
    elementwise_bytes(cfg, ...) runs one layer visit and the loss head at two small sizes under
    FakeTensorMode and returns the bytes that the FLOP-free ops move (norms, casts, RoPE, residual
    adds, SwiGLU's product, the softmax of the loss, the fp32 gradient accumulation) per token and
    per call -- the part of a visit bound by HBM bandwidth, which the planner (plan/timing.py) adds
    to the matmuls' FLOPs so that its schedule and the twin cost a visit alike.
What it is not
    Not a kernel model: an op costs max(FLOPs / achievable FLOP/s, bytes / bandwidth), fused kernels
    not assumed.
"""
import functools
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import model

aten = torch.ops.aten
COPIES = {aten.copy_.default, aten._to_copy.default}
EMPTY = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
         aten.new_empty.default,
         aten.new_empty_strided.default, aten.empty_permuted.default}      # allocate, write nothing
SCALAR_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
WRITE_ONLY = {aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor}        # write, read nothing
INDEXED = {aten.index_select.default, aten.index_select.out, aten.index_add_.default,
           aten.index_put_.default, aten._index_put_impl_.default}   # (the resident scatter)
UNMARKED_VIEWS = {aten._unsafe_view.default, aten.alias.default}    # views the schema does not mark
# torch.distributed's collectives (sharded.py) reach the dispatcher as c10d ops whose schemas mark
# no write: the output (the first argument) is written, the input read; all_reduce reads and writes
# its tensors in place.
c10d = torch.ops.c10d
COLLECTIVES = {c10d._allgather_base_.default: "gather",
               c10d._reduce_scatter_base_.default: "scatter",
               c10d.allreduce_.default: "in place"}
SDPA = {aten._scaled_dot_product_flash_attention_for_cpu.default: 4,  # forward: 4 Tq Tk hd per head
        # backward: 5 matmuls
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 10,
        aten._scaled_dot_product_flash_attention.default: 4,
        aten._scaled_dot_product_flash_attention_backward.default: 10,
        aten._scaled_dot_product_efficient_attention.default: 4,
        aten._scaled_dot_product_efficient_attention_backward.default: 10}


def tensors(val):
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def accesses(func, args, kwargs, out):
    """(reads, writes, fresh): tensors the op reads, tensors it writes in place, and the new tensors
    it returns."""
    if func in COLLECTIVES:
        source = args[0] if COLLECTIVES[func] == "in place" else args[1]
        out_t, in_t = tensors(args[0]), tensors(source)
        return in_t, out_t, []
    schema = func._schema
    given = list(zip(schema.arguments, args)) + [(a, kwargs[a.name]) for a in schema.arguments
                                                 if a.name in kwargs]
    reads, writes = [], []
    for arg, val in given:
        if arg.alias_info is not None and not arg.alias_info.is_write:
            continue                                   # a view of its input: no data access
        (writes if arg.alias_info is not None else reads).extend(tensors(val))
    if func in UNMARKED_VIEWS:
        return [], [], []
    fresh = [t for r, val in zip(schema.returns, out if isinstance(out, (tuple, list)) else [out])
             if r.alias_info is None for t in tensors(val)]
    if not fresh and not writes and func not in SCALAR_READS:
        reads = []                          # metadata (prim.device, sym_size, ...): no data touched
    return reads, writes, fresh


def traffic(func, reads, writes, fresh, kwargs):
    """Bytes an op moves: its inputs, its outputs, and what it updates in place read AND written --
    except a copy's or an out= op's destination (written only), an empty tensor (nothing), and fused
    AdamW's gradients (read; written back only with a grad_scale). AdamW: read p, g, m, v, write p,
    m, v = 28 B/param."""
    def nb(ts):  # the same view twice (dot(g, g)) is read once
        seen = {(t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape),
                 tuple(t.stride())): t for t in ts}
        return sum(t.numel() * t.element_size() for t in seen.values())
    if func in EMPTY:
        return 0
    # only the rows named by the index: read and written (add) or written (select)
    if func in INDEXED:
        floats = [t for t in reads if t.dtype.is_floating_point]
        rows = nb(fresh) if func is aten.index_select.default else \
            nb(writes if "out" in func._overloadname else floats)
        return nb([t for t in reads if not t.dtype.is_floating_point]) + 3 * rows
    if func in COPIES or func in WRITE_ONLY or func._overloadname.startswith("out"):
        rmw = 0
    elif func is aten._fused_adamw_.default:
        # g: 1 of p, g, m, v
        rmw = nb(writes) - (0 if kwargs.get("grad_scale") is not None else nb(writes) // 4)
    else:
        rmw = nb(writes)
    return nb(reads) + nb(writes) + rmw + nb(fresh)


def flops(func, args, kwargs, out):
    if func in SDPA:      # causal: half the Tq x Tk work (flash kernels skip the masked blocks)
        q, k = args[0], args[1]
        return SDPA[func] * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3] * 0.5
    fn = flop_registry.get(func._overloadpacket)
    return float(fn(*args, **kwargs, out_val=out)) if fn else 0.0


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # metadata queries fake tensors dispatch (a real run does not)
            return out
        self.ops += 1
        if flops(func, args, kwargs, out) == 0:
            self.bytes += traffic(func, *accesses(func, args, kwargs, out), kwargs)
        return out


def elementwise_bytes(cfg, dtype=torch.bfloat16, residual_dtype=torch.float32):
    """{"fwd", "bwd", "head"} -> (bytes per token, bytes per call, ops per call): what the FLOP-free
    ops move and how many aten ops the host issues (the planner's host term), for a layer's forward,
    of its recompute + backward (model.block_grad: one call per micro-batch, whose fp32 gradient
    accumulation is the per-call part), and of the loss head forward + backward (model.head_grad; a
    call per loss chunk), as the engine runs them (bf16 autocast on the residual dtype). Measured at
    two sizes under FakeTensorMode: per token they do not depend on T (attention's own work is
    FLOPs), nor on max_seq_len, which is left out of the cache's key: plan.fit.max_context plans one
    config at many lengths, each with its own max_seq_len, and measures once."""
    return _measured(json.dumps(dict(cfg.to_dict(), max_seq_len=None), sort_keys=True), dtype,
                     residual_dtype)


@functools.lru_cache(maxsize=64)
def _measured(cfg_json, dtype, residual_dtype, sizes=(128, 256)):
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = model.GPTConfig(**json.loads(cfg_json))
    lay = next(u for u in model.units(cfg) if u.name.startswith("layer."))
    head = model.units(cfg)[-1]
    got = {}
    with FakeTensorMode(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        w = {k: v.requires_grad_()
             for k, v in lay.views(torch.empty(lay.numel, dtype=dtype)).items()}
        wh = {k: v.requires_grad_()
              for k, v in head.views(torch.empty(head.numel, dtype=dtype)).items()}
        acc, acc_h = lay.views(torch.zeros(lay.numel)), head.views(torch.zeros(head.numel))
        for n in sizes:
            x = torch.empty(1, n, cfg.d_model, dtype=residual_dtype)
            rope = model.rope_cache(cfg, n, dtype=residual_dtype)
            tgt = torch.zeros(n, dtype=torch.int64)
            for name, fn in (("fwd", lambda: model.block(cfg, x, w, rope)),
                             ("bwd", lambda: model.block_grad(cfg, x, w, rope, x, acc)),
                             ("head", lambda: model.head_grad(cfg, x[0], wh, tgt, n, acc_h, n))):
                with _Count() as c, torch.set_grad_enabled(name != "fwd"):
                    fn()
                got[name, n] = c.bytes, c.ops
    (a, b) = sizes
    per_token = {k: (got[k, b][0] - got[k, a][0]) / (b - a) for k in ("fwd", "bwd", "head")}
    return {k: (per_token[k], got[k, a][0] - per_token[k] * a, got[k, a][1]) for k in per_token}
