"""memory.py -- the memory arithmetic of a plan: host and GPU bytes by component.

What it is
    The plan's memory steps, each from a Setting (setting.py): tile (the sequence tile, the
    planner's choice unless asked), gpu (the weight and gradient slots, the step's working set, the
    boundary activations on the device or through a ring to the host, the units kept resident), host
    (the store: fp32 master, the rule's state, the bf16 shadow, the fp32 gradient store or slabs;
    pinned buffers; the runtime) and what of it is page-locked. Below them, what one step holds on
    the device: block_activation_bytes (one layer's backward, untiled or in tiles:
    megatrain_min/engine/tiling.py), attention_bytes (the whole sequence's attention at the peak of
    the tiled backward), step_device_bytes (everything beside the slots and the boundary
    activations) and offload_needed (the rule that sends the boundary activations to host memory).
    Estimates from the ops, checked against autograd in tests/plan/test_plan.py; flash / efficient
    SDPA kernels assumed (no T x T scores).
What it is not
    Not an allocator trace: stream.py and optim.py allocate; tests/plan/test_plan.py holds these
    counts to the bytes they allocate.
"""
from megatrain_min.engine import gpu_update
from megatrain_min.engine.activations import RING
from megatrain_min.cli import DTYPES
from megatrain_min.plan.hardware import GB

HOST_USABLE = 0.97         # the share of host RAM a run may plan for; the rest is the OS's
RUNTIME = 4 * 10**9        # host RSS of Python + torch + the CUDA libraries (1 GB without CUDA)
CUDA_CONTEXT = 2 * 10**9   # GPU: CUDA context, cuBLAS workspaces, caching-allocator slack
# Sequence tiling (model.block): the planner tiles when the untiled layer does not fit comfortably,
# i.e. when the untiled plan's device memory exceeds TILE_HEADROOM of the device; then tiles of
# TILE_TOKENS tokens: matmuls of 8192 rows still run near full speed, and a tile of a 7B layer's
# token-local activations is ~2 GB (~140 GB untiled at 512k tokens).
TILE_HEADROOM = 0.9
TILE_TOKENS = 8192
# Resident units (megatrain_min/engine/resident.py): the plan fills the GPU memory the step leaves,
# up to RESIDENT_HEADROOM of it, with whole units in the order the forward needs them
# (resident_bytes: fp32 master, the rule's state, gradient; 16 B/param with AdamW).
RESIDENT_HEADROOM = 0.9


def resident_bytes(s):
    """A resident unit's GPU bytes per parameter: its fp32 master, state and gradient."""
    return 4 * (2 + s.states)


def state_names(s):
    """The host components of the update rule's state: "AdamW m (fp32)", ...: no copy engine reads
    or writes them (but of a unit updated on the GPU: host(on_gpu))."""
    return [f"{s.rule.__name__} {name} (fp32)" for name in s.rule.state]


def count(n):
    """n elements, as the plan writes them: 1.23B, 4.56M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def size(b):
    """b bytes, as the plan writes them: 1.46 TB, 111 GB, 2.5 GB, 300 MB."""
    return f"{b / 1e12:.2f} TB" if b >= 1e12 else f"{b / GB:.{0 if b >= 10 * GB else 1}f} GB" \
        if b >= GB else f"{b / 1e6:.0f} MB"


def host_limit(s):
    """The host bytes a run may plan for on s's hardware (per node)."""
    return s.hw["host_mem_gb"] * GB * HOST_USABLE


def tile_for(untiled_bytes, device_bytes):
    """The default tile_tokens (the one home of this rule): 0 -- no tiling, the fastest layer --
    while the plan with the untiled layer needs at most TILE_HEADROOM of the device's memory (on the
    CPU: of the host's share); else TILE_TOKENS."""
    return 0 if untiled_bytes <= TILE_HEADROOM * device_bytes else TILE_TOKENS


def tile(s, asked, offload=None):
    """The layer's sequence tile: `asked` (0 = untiled), or None: the planner's choice (tile_for)
    for the untiled layer beside the boundary activations where `offload` puts them (None: memory
    decides)."""
    if asked is not None:
        return asked
    untiled = sum(device(s, 0, offload)[0].values())
    return tile_for(untiled, s.hw["gpu_mem_gb"] * GB if s.cuda else host_limit(s))


def gpu(s, tile_tokens, offload=None, resident=None):
    """The GPU's bytes by component (per GPU), where the boundary activations live and the units
    kept resident: (gpu, offloaded, resident units as indices into s.units). offload None: memory
    decides (offload_needed); resident None: as many as fit in what the step leaves (one rank,
    CUDA)."""
    gpu, offloaded = device(s, tile_tokens, offload)
    held = residents(s, resident, sum(gpu.values()))
    if held:
        gpu[f"resident units: {len(held)} of {len(s.units)}, 16 B/param"] = \
            resident_bytes(s) * sum(s.units[u].numel for u in held)
    return gpu, offloaded, held


def device(s, tile_tokens, offload):
    """What a step holds on the device (stream.Trainer.__init__ and the step's working set),
    independent of depth, and whether the boundary activations are offloaded."""
    cfg, n_slot, cb = s.cfg, s.n_slot, s.cb
    gpu = {f"weight slots: 2 x {count(n_slot)} {s.dtype}": 2 * n_slot * cb,
           "fp32 grad slots: 2": 2 * n_slot * 4}
    if s.mode == "lean" and s.dtype == "bf16":
        gpu["lean cast buffer: fp32 unit, cast on GPU"] = n_slot * 4
    gpu["CUDA context, workspaces, slack"] = CUDA_CONTEXT if s.cuda else 0
    # sharded.py: H2D lands in a weight shard, reduce_scatter writes a grad shard (2
    if s.world > 1:
        # each); the embedding's rows of the whole step cross PCIe before their reduce_scatter, dy
        # is all_gathered whole (made on the H2D and comm lanes: blocks of their own pools, which
        # compute's allocations cannot reuse)
        gpu[f"shards: 2 weight + 2 fp32 grad of {count(s.shard(n_slot))}"] = \
            2 * s.shard(n_slot) * (cb + 4)
        gpu["embedding rows and dy of the whole "
            "step"] = s.tokens_step * cfg.d_model * (s.row_b + s.rb)
    gpu.update(step_device_bytes(cfg, s.tokens, s.micro_batches, DTYPES[s.dtype],
                                 DTYPES[s.residual_dtype], s.chunk, n_slot, seq_len=s.seq_len,
                                 tile_tokens=tile_tokens))
    # SDPA on CUDA: GQA in fp32 has
    if s.cuda and s.dtype == "fp32" and cfg.n_kv_head != cfg.n_head:
        # no fused kernel (flash needs bf16), so the math kernel runs: T x T scores, softmax and
        # their gradient, fp32
        gpu["attention scores: math kernel (fp32 + GQA)"] = \
            3 * 4 * cfg.n_head * s.seq_len * s.tokens // s.micro_batches
    # boundary activations (every layer's input, for the recompute) stay on the GPU when all fits
    # there, else they go to pinned host memory through a ring of activations.RING device slots
    off = offload if offload is not None else \
        s.cuda and offload_needed(s.L * s.act, sum(gpu.values()), s.hw["gpu_mem_gb"] * GB)
    gpu[f"boundary activations: device ring of {RING}" if off else
        f"boundary activations: {s.L} layers"] = RING * s.act if off else s.L * s.act
    return gpu, off


def residents(s, asked, gpu_bytes):
    """The units kept whole on the GPU, in the order the forward needs them (stream.Trainer.order):
    the first `asked`, or None: as many as fit in RESIDENT_HEADROOM of the GPU beside gpu_bytes (one
    rank on CUDA; else none)."""
    k = asked or 0
    if asked is None and s.cuda and s.world == 1:      # as many as fit in what the step leaves
        room = RESIDENT_HEADROOM * s.hw["gpu_mem_gb"] * GB - gpu_bytes
        while k < len(s.order) and resident_bytes(s) * s.units[s.order[k]].numel <= room:
            room, k = room - resident_bytes(s) * s.units[s.order[k]].numel, k + 1
    return set(s.order[:k])


def gpu_updated(s, resident, n, gpu):
    """The streamed units updated on the GPU (gpu_update.chosen: n, spread evenly), their bytes
    added to gpu (the GPU's components): each one's fp32 gradient, 4 B/param, and two scratches of
    the largest one's master, m, v (+ its bf16 shadow in fast mode)."""
    units = gpu_update.chosen(s.order, len(resident), s.embed, n)
    if units:
        grads, scratch = gpu_parts_of(s, units)
        gpu[f"GPU-updated units: {len(units)}, fp32 grads 4 B/param"] = grads
        gpu["GPU update scratch: 2 x master, state" + (", shadow" if s.shadow else "")] = scratch
    return set(units)


def gpu_parts_of(s, units):
    """(gradients, scratches): the GPU bytes of updating `units` there (gpu_update.GpuUpdated)."""
    big = max((s.units[u].numel for u in units), default=0)
    return 4 * sum(s.units[u].numel for u in units), 2 * big * (4 * (1 + s.states) + 2 * s.shadow)


def gpu_bytes_of(s, units):
    """The GPU bytes of updating `units` there, in all."""
    return sum(gpu_parts_of(s, units))


def gpu_updatable(s, resident, gpu_bytes):
    """How many streamed units can be updated on the GPU: as many as fit in RESIDENT_HEADROOM of it
    beside gpu_bytes (one rank on CUDA; else none)."""
    if not s.cuda or s.world > 1:
        return 0
    room = RESIDENT_HEADROOM * s.hw["gpu_mem_gb"] * GB - gpu_bytes
    streamed = len(gpu_update.chosen(s.order, len(resident), s.embed, len(s.units)))
    n = 0
    while n < streamed and gpu_bytes_of(s, gpu_update.chosen(s.order, len(resident), s.embed,
                                                             n + 1)) <= room:
        n += 1
    return n


def host(s, resident, slabs, offloaded, gpu_bytes, on_gpu=frozenset()):
    """The host's bytes by component, of one node (its gpus ranks, each with 1/N of the store:
    optim.HostStore and stream.py's pinned buffers): (host, the per-parameter store's bytes, the
    bytes page-locked -- engine/pinned.py's page_locked, what a copy engine reads or writes: not
    the rule's state, nor the fp32 master when a bf16 shadow is what crosses -- but of a unit
    updated on the GPU (on_gpu) master and state cross, and its gradient stays there)."""
    cfg, gpus = s.cfg, s.gpus

    def per_unit(bytes_per_param):   # of every unit the host keeps (not the resident ones)
        return gpus * sum(s.shard(u.numel) * bytes_per_param
                          for i, u in enumerate(s.units) if i not in resident)
    host = {"fp32 master": per_unit(4), **{name: per_unit(4) for name in state_names(s)}}
    if s.shadow:
        host["bf16 shadow (streamed)"] = per_unit(2)
    if s.defer:
        host["fp32 grad store (global norm first)"] = per_unit(4) - gpus * sum(
            s.shard(s.units[u].numel) * 4 for u in on_gpu)
    store = sum(host.values())                         # the per-parameter part: 12 to 18 B/param
    streamed = [u.numel for i, u in enumerate(s.units) if i not in resident and i not in on_gpu]
    if slabs and streamed:  # D2H lands in a slab, the worker updates from it
        host[f"fp32 grad slabs: {slabs}"] = gpus * slabs * s.shard(max(streamed)) * 4
    if offloaded:
        host[f"offloaded boundary activations: {s.L} layers"] = gpus * s.L * s.act
    if s.embed in resident:  # the rows gathered on the GPU from the tokens, dy stays there
        host["pinned buffers: targets, tokens"] = gpus * s.tokens * 16
    else:
        host["pinned buffers: embedding rows, dy, targets"] = \
            gpus * (s.tokens_step * cfg.d_model * s.row_b + s.act_step + s.tokens * 8)
    unpinned = set(state_names(s)) | ({"fp32 master"} if s.shadow else set())
    pinned = sum(v for k, v in host.items() if s.cuda and k not in unpinned) + s.cuda * gpus * \
        sum(s.shard(s.units[u].numel) * 4 * (s.states + s.shadow) for u in on_gpu)  # (+ master)
    host["runtime: Python, torch" + (", CUDA" if s.cuda else "")] = \
        gpus * (RUNTIME if s.cuda else 10**9)
    if not s.cuda:
        host["device buffers (below)"] = gpus * gpu_bytes
    return host, store, pinned


# ---- what one step holds on the device
def block_activation_bytes(cfg, n_tok, cb, rb=None, tile_tokens=0, seq_len=None):
    """Bytes of one layer's backward for n_tok tokens (one micro-batch, in sequences of seq_len
    tokens; default: one sequence). cb: bytes of the compute dtype, rb: of the residual (default cb;
    4 with 2 is bf16 autocast on an fp32 residual, the engine's default). The layer input (a
    boundary activation) and dy / dx are counted apart (step_device_bytes).
    Untiled: what autograd saves when model.block is recomputed with grad, plus the backward's
    largest transients. Tiled (tiling.Tiled.block_grad's three phases): the whole sequence's
    attention (attention_bytes) plus the untiled estimate for one tile of n_tok / seq_len rows x
    tile_tokens tokens, which bounds part A or part C of one tile with its gradients."""
    rb = rb or cb
    if tile_tokens:
        seq_len = seq_len or n_tok
        tile = n_tok // seq_len * min(tile_tokens, seq_len)
        return attention_bytes(cfg, n_tok, cb) + block_activation_bytes(cfg, tile, cb, rb)
    d, ff = cfg.d_model, cfg.d_ff
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    # 2 rms_norms: fp32 normalised x (+ the fp32 copy of a bf16 x), the 2nd one's input; the
    # linears' inputs: shared by q/k/v and by gate/up, or -- autocast on an fp32 residual -- a bf16
    # cast per linear (5)
    norms = 12 * d + (5 if cb != rb else 2) * cb * d
    # SDPA's q, k, v, its output + the copy o_proj reads; lse
    attn = cb * (3 * q + 2 * kv) + 4 * cfg.n_head
    if cfg.qk_norm:
        attn += (cb + 4) * (q + kv)
    mlp = 4 * cb * ff                           # gate (silu's input), silu(gate), up, their product
    transient = 2 * cb * ff + 8 * d             # two (n, ff) grads alive at once, fp32 norm grads
    return n_tok * (norms + attn + mlp + transient)


def attention_bytes(cfg, n_tok, cb):
    """Bytes the whole-sequence attention holds at the peak of the tiled backward (SDPA's backward),
    n_tok tokens: what SDPA saves (q, k, v, its output, the fp32 log-sum-exp per head), the gradient
    w.r.t. its output, dq, dk, dv, and a flash-attention-2 backward's workspace (an fp32 dq
    accumulator and an fp32 row statistic; with grouped-query attention dk and dv are made for all
    n_head heads before the sum over each group). O(n_tok): flash / efficient kernels keep no T x T
    scores."""
    q, kv, nh = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_head
    saved = cb * (2 * q + 2 * kv) + 4 * nh
    grads = cb * q + cb * (q + 2 * kv)
    workspace = 4 * q + 4 * nh + (2 * cb * q if cfg.n_kv_head != cfg.n_head else 0)
    return n_tok * (saved + grads + workspace)


def step_device_bytes(cfg, tokens, micro_batches, dtype, residual_dtype, chunk_tokens, n_slot,
                      seq_len=None,
                      tile_tokens=0):
    """What a step holds on the device beside the weight/grad slots and the boundary activations, by
    component: plan.py prints it, offload_needed weighs it. tokens: per step; n_slot: elements of a
    slot; seq_len: tokens per sequence (default: one sequence per micro-batch); tile_tokens: the
    layer's tile (0 = untiled)."""
    cb, rb, per_mb = dtype.itemsize, residual_dtype.itemsize, tokens // micro_batches
    seq_len = seq_len or per_mb
    chunk = min(chunk_tokens, per_mb)
    layer = block_activation_bytes(cfg, per_mb, cb, rb, tile_tokens, seq_len)
    if tile_tokens:  # the whole sequence's attention, and one tile of the token-local parts
        attn = attention_bytes(cfg, per_mb, cb)
        layer = {f"whole-sequence attention: {per_mb:,} "
                 "tok": attn,     # q, k, v, out, grads, kernel workspace
                 "token-local activations: tiles of "
                 f"{min(tile_tokens, seq_len):,} tok": layer - attn}
    else:
        layer = {f"recompute activations: 1 layer, {per_mb:,} tok": layer}
    return {"residual x and its grad dy": 2 * tokens * cfg.d_model * rb, **layer,
            f"weight grads from autograd ({str(dtype)[6:]}, one unit)": n_slot * cb,
            f"loss chunk: {chunk:,} tokens x {cfg.vocab_size:,} "
            "logits":  # logits, fp32 copy, log-softmax, grads
                chunk * cfg.vocab_size * (12 + (2 * cb if cb == 2 else 0)),
            f"RoPE cos, sin: {seq_len:,} positions": 2 * seq_len * cfg.head_dim * rb,
            "targets": tokens * 8}


def offload_needed(activation_bytes, working_bytes, free_bytes):
    """Offload the boundary activations to host memory when, with one layer's working set beside
    them, they would not fit in the free device memory (the planner decides by it)."""
    return activation_bytes + working_bytes > free_bytes
