"""bench/gpu.py -- the GPU benchmark: streaming engine vs resident PyTorch vs FSDP2 CPU offload, one run.

What it is
    Cases (--only picks some): pinned (H2D/D2H copy peak: 1 GB pinned buffer, CUDA events, best of 5),
    sweep (d 2048 stack at 4/8/16/32 layers, checkpoints offloaded: peak GPU memory vs depth),
    peers (a 7B-wide layer x 8, same model, tokens and micro-batches: stream.Trainer vs "resident" = plain
    PyTorch with every weight on the GPU, fp32 params, bf16 autocast, fused AdamW, per-layer checkpointing;
    "resident_no_ckpt" = megatrain_min.engine.reference (keeps every activation, so it skips the recompute);
    "fsdp2_offload" = FSDP2 fully_shard + CPUOffloadPolicy, bf16 mixed precision, fused CPU AdamW (torch's default
    AdamW if the fused kernel fails on its sharded parameters: results say which)),
    wide (Llama-2-7B layers d 4096 / ff 11008 / 32 heads / V 32000 at the
    deepest depth whose planned host store fits in 85% of MemAvailable; tokens per step = the planner's
    min_tokens_per_step rounded up to whole sequences, and twice that).
Definitions
    DEFS below (copied into results.json): step time, N, model and hardware TFLOP/s, overlap, copy rates.
What it is not
    Not a profiler (use --profile: a Chrome trace of 3 steps of the wide case), not a test: it asserts
    nothing. Weights are one initialised layer repeated (SameLayers): values do not change timings and
    the RNG would cost minutes at 7B. No resident run of the deepest 7B-wide stack (16 B/param > GPU memory).
Fairness: every engine runs the same model, shapes and micro-batches, and none syncs the host inside a step
    (the peers accumulate their loss on the device and read it once, as the engine does); compute_only uses
    the engine's own per-visit functions (model.block_grad, model.head_grad) at the trainer's micro-batches.
    Each peer runs in a process of its own (`--peer NAME`): the engine's pinned-allocator settings
    (optim.pin_exact_sizes: big pinned blocks exact-sized, never cached) would make FSDP2's per-step pinned
    copies pay cudaHostAlloc / cudaFreeHost, which synchronise. Every engine's batch comes from pinned memory.
    quick (--quick, alone): the wide case's streaming regime at 16,384 and 12,288 tokens (4 micro-batches of one
    sequence: 4 x 4096, 4 x 3072), clip 1 and 0, lean then fast, the plan's GPU-updated units and none; a trainer per
    (mode, clip, units), each row's step beside the planner's, within --budget-s (quick_case).
Run
    python bench/gpu.py [--out DIR] [--only pinned,sweep,peers,wide] [--profile]   # one GPU, ~5 min
    python bench/gpu.py --quick --budget-s 190 --out DIR   # bench/gpu_run.sh --quick's part: ~3 min on an H200
    python bench/gpu.py --smoke --out /tmp/b   # tiny shapes, any machine, < 1 min (tests/test_bench.py)
"""
import argparse, dataclasses, datetime, gc, gzip, json, math, os, re, socket, subprocess, sys, time  # noqa: E401
from collections.abc import Mapping
from pathlib import Path
from statistics import median

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import model  # noqa: E402
import stream  # noqa: E402
from megatrain_min import engine  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402
from megatrain_min.plan import hardware  # noqa: E402
from megatrain_min.engine.reference import ReferenceTrainer  # noqa: E402
from megatrain_min.engine.checks import CheckedTrainer  # noqa: E402
from model import default_dtype  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = default_dtype(DEV)  # the compute dtype stream.Trainer picks here: bf16 on CUDA, fp32 on the CPU
GB = 1e9
LLAMA7B_LAYER = dict(vocab_size=32000, n_head=32, n_kv_head=32, d_model=4096, d_ff=11008, max_seq_len=4096)
FULL = dict(wide=model.GPTConfig(n_layer=1, **LLAMA7B_LAYER), seq=4096, max_depth=64, peers_depth=8, token_sweep=(2, 4, 8),
            sweep=model.GPTConfig(vocab_size=32000, n_layer=1, n_head=16, n_kv_head=16, d_model=2048, d_ff=5632,
                                  max_seq_len=4096), depths=(4, 8, 16, 32), sweep_batch=4, warmup=2, steps=3, steady=3,
            quick_layers=24, quick_tokens=(16384, 12288), quick_gpu_updated=None)
SMOKE = dict(wide=model.GPTConfig(vocab_size=256, n_layer=1, n_head=4, n_kv_head=4, d_model=64, d_ff=176, max_seq_len=64),
             seq=64, max_depth=3, peers_depth=2, token_sweep=(2,), sweep=model.GPTConfig(vocab_size=256, n_layer=1, n_head=2, n_kv_head=2,
             d_model=32, d_ff=96, max_seq_len=64), depths=(1, 2, 4), sweep_batch=2, warmup=1, steps=2, steady=2,
             tokens=256, quick_layers=3, quick_tokens=(256, 192), quick_gpu_updated=1)   # a CPU's plan picks none
# --quick: each trainer at both token counts in QUICK_M micro-batches of one sequence (16,384 = 4 x 4096, 12,288 =
# 4 x 3072), each count after one lead-in step: QUICK_STEPS synced steps and QUICK_STEADY steady ones (time_steps)
QUICK_M, QUICK_LEAD, QUICK_STEPS, QUICK_STEADY = 4, 1, 1, 2
# what a streamed 24-layer 7B-width trainer costs besides its steps: build (page-locking, filling), first-touch
# page faults, free. Run 3 (bench/results/2026-11-27-nvidia-h200-3): three trainers in 133 s of case wall time,
# of which 37 s were steps and ~29 s the bench's own weight RNG (464M + 333M normals per trainer at the ~80 M/s a
# CPU generator gives; now made once per config): ~22 s each, 25 with a margin. The quick case records build_s
# and free_s per trainer: the next run measures it.
QUICK_TRAINER_S = 25
DEFS = dict(
    step_s="steady state: the mean of timed steps issued back to back, torch.cuda.synchronize before the first and "
           "after the last, whose deferred work (updates on the optimizer thread) is drained inside -- what train.py "
           "sees (runs before 2026-11-28: step_synced_s's form)",
    step_synced_s="median of timed steps with torch.cuda.synchronize before and after each (the deferred updates' "
                  "tail, which the next forward would hide, billed to every step)",
    N="parameters that multiply: every matrix but the embedding gather (= plan.hardware.flops_per_token / 6)",
    model_tflops="6 N tokens / step_s (no recompute, no attention scores: useful work only)",
    hw_tflops="(8 N_layers + 6 N_head) tokens / step_s: the layers' recompute counted, attention scores not",
    megatrain_tflops="6 x all parameters (embedding included) x tokens / step_s: MegaTrain's formula",
    cuda_adamw_gbs="torch._fused_adamw_ on 2^26 fp32 CUDA params, 28 B/param counted, best of 5 (pinned case)",
    compute_only_s="L x (one layer's no-grad forward + recompute-with-grad + backward + fp32 grad accumulation, "
                   "all micro-batches) + the chunked head forward+backward, weights already on the device: "
                   "no copies, no optimizer, no engine",
    overlap="compute_only_s / step_s (1.0 = copies, optimizer and engine overhead fully hidden)",
    h2d_gbs="bytes the engine must move host->device per step (link_bytes: weights at 2 B/param fast, 4 lean, a "
            "GPU-updated unit's master, m, v 12 B/param each way, 14 back with the shadow, no gradient; a resident "
            "unit nothing) / step_s: an average over the step, not the rate during a copy (d2h_gbs likewise); "
            "*_link_share = that / the pinned-copy peak of this run",
    pinned="peak copy rate: 1 GiB pinned bf16 buffer <-> GPU, timed with CUDA events, best of 5",
    peak_gpu_gb="torch.cuda.max_memory_allocated over the timed steps",
    rss_gb="VmRSS of this process after the timed steps (pinned pages included); rss_peak_gb: VmHWM, "
           "the process's peak so far",
    vs_resident="stream tokens/s / resident tokens/s (peers case); vs_resident_no_ckpt, vs_fsdp2_offload likewise",
    gpu_mem_depth_spread="(max - min) / min of peak_gpu_gb across the depth sweep")


class SameLayers(Mapping):
    """A weights dict for cfg in which every layer holds layer 0's initial values (model.init_unit)."""

    def __init__(self, cfg, seed=0):
        us, gen = model.units(cfg), torch.Generator().manual_seed(seed)
        self.keys_ = [e.key for u in us for e in u.entries]
        self.w = {k: v for u in (us[0], us[1], us[-1]) for k, v in model.init_unit(cfg, u, gen).items()}

    def __getitem__(self, key):
        return self.w[re.sub(r"^model\.layers\.\d+\.", "model.layers.0.", key)]

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self):
        return len(self.keys_)


_SAME = {}   # repr(cfg) -> its SameLayers: the RNG of a 7B-width layer, head and embedding takes seconds


def same_layers(cfg):
    """SameLayers(cfg), made once per config (read-only: every trainer of cfg fills its store from it)."""
    if repr(cfg) not in _SAME:
        _SAME.clear()                             # one config's weights held at a time
        _SAME[repr(cfg)] = SameLayers(cfg)
    return _SAME[repr(cfg)]


def sync():
    if CUDA:
        torch.cuda.synchronize()


def free_memory():
    """Give back GPU cache and torch's cached pinned host blocks (framework internal: the pinned caching
    allocator keeps freed blocks; the private call's name changed across versions, hence getattr)."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None) or getattr(torch._C, "_accelerator_emptyHostCache", None)
        if empty_host:
            empty_host()


def rss():
    st = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return {k: int(st[v].split()[0]) * 1024 / GB for k, v in (("rss_gb", "VmRSS"), ("rss_peak_gb", "VmHWM"))}


def batch(cfg, B, T, seed=0):
    """(tokens, targets) (B, T), pinned with CUDA: a non_blocking copy from pageable memory is synchronous."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, cfg.vocab_size, (B, T), generator=g), torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return tuple(t.pin_memory() for t in b) if CUDA else b


def time_steps(step, b, warmup, steps, drain=lambda: None, steady=None):
    """{step_s, step_synced_s, steps_synced_s, loss, peak_gpu_gb, rss...}: `warmup` steps; `steps` steps each
    between two device syncs (step_synced_s: their median, the form of the runs before 2026-11-28); then
    `steady` steps (default `steps`) between one sync and the next, the last step's deferred work drained
    (`drain`) inside (step_s: their mean, what train.py sees -- the updates one step defers overlap the next
    one's forward, and a per-step sync bills their tail to every step)."""
    for _ in range(warmup):
        step(*b)
    sync()                                  # not drained: each timed step finds the last one's deferred work
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    synced, loss = [], None
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = step(*b)
        sync()
        synced.append(time.perf_counter() - t0)
    n = steps if steady is None else steady
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        loss = step(*b)
    drain()
    sync()
    steady_s = (time.perf_counter() - t0) / n
    return dict(step_s=steady_s, step_synced_s=median(synced), steps_synced_s=synced, loss=loss, **rss(),
                peak_gpu_gb=torch.cuda.max_memory_allocated() / GB if CUDA else None)


def link_bytes(t, B, T):
    """(H2D, D2H) bytes trainer t moves per step of B x T tokens, from how it was built: each unit's home
    (which of its buffers live on the GPU, which cross for its update: megatrain_min/engine/homes.py), its store (what
    streams into a slot, the rule's state), where the boundary activations live. Per unit, each way:
      streamed     its weights at the streamed tensor's width -- 2 B/param (fast: the bf16 shadow) or 4
                   (lean: the fp32 master, cast on the GPU) -- once per visit: a layer twice (forward,
                   backward) but the last (still in its slot), the head once; its fp32 gradient back
                   (4 B/param), but the embedding's (its rows are gathered on the host, dy comes back)
      GPU-updated  the same weights in; its master and state in and back for the update there (AdamW:
                   12 B/param each way), the shadow back too (14 fast); its gradient stays on the GPU
      resident     nothing
    Besides: the embedding's rows in and dy back (B x T x d; resident: its token ids in instead), the
    targets in, the boundary activations out and in when offloaded."""
    opt, cfg, L = t.opt, t.cfg, len(t.layer_units)
    act = B * T * cfg.d_model * t.residual_dtype.itemsize     # rows, dy, a boundary activation
    visits = {u: 2 - (i == L - 1) for i, u in enumerate(t.layer_units)} | {t.head: 1}
    h2d = d2h = 0
    for u, lay in enumerate(t.units):
        home = t.home[u]
        if "master" not in home.kept_on_device:                           # streamed into a slot at each visit
            h2d += visits.get(u, 0) * lay.numel * opt.streamed(u).element_size()
        if u in visits and "grad" not in home.kept_on_device:             # its fp32 gradient, to the host
            d2h += lay.numel * 4
        update = sum(x.nbytes for name, x in opt.tensors(u).items()      # master and state, crossing
                     if ("master" if name == "master" else "state") in home.crossing)
        shadow = opt.shadow[u].nbytes if "shadow" in home.crossing and opt.shadow[u] is not None else 0
        h2d, d2h = h2d + update, d2h + update + shadow
    ids = B * T * 8                                                # int64 token ids
    resident_embed = "master" in t.home[t.embed].kept_on_device
    h2d += ids + (ids if resident_embed else act)
    d2h += 0 if resident_embed else act
    if t.activations.offloaded:
        h2d, d2h = h2d + L * act, d2h + L * act
    return h2d, d2h


def rates(cfg, B, T, r, peak=None, compute_s=None, trainer=None):
    """Add tokens/s, TFLOP/s, overlap and (for an engine run: its trainer) the link's bytes and average
    rates (link_bytes) to a timing dict r (see the docstring)."""
    us, tok, L = model.units(cfg), B * T, cfg.n_layer
    lay, head = us[1], us[-1]
    n_layers, n_head = L * lay.n_decay, head.n_decay
    r.update(tokens=tok, tokens_per_s=tok / r["step_s"], N=n_layers + n_head,
             model_tflops=6 * (n_layers + n_head) * tok / r["step_s"] / 1e12,
             hw_tflops=(8 * n_layers + 6 * n_head) * tok / r["step_s"] / 1e12,
             megatrain_tflops=6 * model.n_params(cfg) * tok / r["step_s"] / 1e12)
    if trainer is not None:
        h2d, d2h = link_bytes(trainer, B, T)
        r.update(h2d_gb=h2d / GB, d2h_gb=d2h / GB, h2d_gbs=h2d / GB / r["step_s"],
                 d2h_gbs=d2h / GB / r["step_s"])
        if peak:
            r.update(h2d_link_share=r["h2d_gbs"] / peak["h2d_gbs"],
                     d2h_link_share=r["d2h_gbs"] / peak["d2h_gbs"])
    if compute_s:
        r.update(compute_only_s=compute_s, overlap=compute_s / r["step_s"])
    return r


_COMPUTE = {}   # (repr(cfg), B, T, M) -> compute_only's seconds: every trainer of a shape shares them


def compute_only(cfg, B, T, M, reps=3):
    """compute_only_s (docstring): one layer's and the head's GPU work for a step, weights resident, with the
    engine's own functions (model.block, model.block_grad, model.head_grad), M micro-batches, as the engine
    runs them: bf16 autocast on an fp32 residual. Measured once per shape (layer 0's and the head's
    values of same_layers(cfg))."""
    key = (repr(cfg), B, T, M)
    if key not in _COMPUTE:
        _COMPUTE[key] = measure_compute(cfg, B, T, M, reps)
    return _COMPUTE[key]


def measure_compute(cfg, B, T, M, reps):
    dev, dt = DEV, DTYPE
    us, w0 = model.units(cfg), same_layers(cfg)
    flat = lambda u: torch.cat([w0[e.key].flatten() for e in u.entries]).to(dev, dt)  # noqa: E731
    lay, head = us[1], us[-1]
    w = {k: v.requires_grad_() for k, v in lay.views(flat(lay)).items()}
    wh = {k: v.requires_grad_() for k, v in head.views(flat(head)).items()}
    gacc, gacc_h = lay.views(torch.zeros(lay.numel, device=dev)), head.views(torch.zeros(head.numel, device=dev))
    rope = model.rope_cache(cfg, T, dev, torch.float32)
    xs = [torch.randn(B // M, T, cfg.d_model, device=dev) for _ in range(M)]        # fp32 residual
    tgt = torch.randint(0, cfg.vocab_size, (B // M * T,), device=dev)
    chunk = model.default_chunk_tokens(cfg)                                         # stream.Trainer's default
    autocast = lambda: torch.autocast(dev, dtype=dt, enabled=dt != torch.float32)  # noqa: E731

    def layer():  # forward (no graph), then recompute + backward with fp32 accumulation, per micro-batch
        with autocast(), torch.no_grad():
            [model.block(cfg, x, w, rope) for x in xs]
        with autocast():
            [model.block_grad(cfg, x, w, rope, x, gacc) for x in xs]

    def head_pass():
        with autocast():
            [model.head_grad(cfg, x.reshape(-1, cfg.d_model), wh, tgt, tgt.numel(), gacc_h, chunk) for x in xs]

    def timed(fn):
        fn()
        out = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t0)
        return median(out)
    return cfg.n_layer * timed(layer) + timed(head_pass)


# ----------------------------------------------------------------------------- the peers as nn.Modules
class Layer(nn.Module):
    """One model.block as an nn.Module (FSDP2 shards modules); parameter names with '.' -> '_'."""

    def __init__(self, cfg, w):
        super().__init__()
        self.cfg, self.names = cfg, list(w)
        for s, t in w.items():
            self.register_parameter(s.replace(".", "_"), nn.Parameter(t.clone()))

    def forward(self, x, rope):
        return model.block(self.cfg, x, {s: getattr(self, s.replace(".", "_")) for s in self.names}, rope)


class Model(nn.Module):
    """model.py's maths with nn.Parameters, per-layer activation checkpointing (as the engine recomputes)."""

    def __init__(self, cfg, weights):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(weights[model.EMBED].clone())
        self.layers = nn.ModuleList(Layer(cfg, model.layer_weights(cfg, weights, i)) for i in range(cfg.n_layer))
        self.norm, self.lm_head = nn.Parameter(weights[model.NORM].clone()), nn.Parameter(weights[model.HEAD].clone())

    def forward(self, tok, tgt):  # returns the summed loss of (tok, tgt)
        x = nn.functional.embedding(tok, self.embed)
        rope = model.rope_cache(self.cfg, tok.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = checkpoint(layer, x, rope, use_reentrant=False)
        return model.chunked_loss_sum(self.cfg, x, {"lm_head": self.lm_head, "norm": self.norm}, tgt,
                                      model.default_chunk_tokens(self.cfg))


def module_step(m, M, autocast, **adamw):
    """step(tokens, targets) -> mean loss: M micro-batches of m, then AdamW (decay on >= 2-D tensors)."""
    dev, params = DEV, list(m.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=3e-4, **adamw)

    def step(tokens, targets):
        n, total = targets.numel(), torch.zeros((), device=dev)
        for tok, tgt in zip(tokens.chunk(M), targets.chunk(M)):
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
                ls = m(tok.to(dev, non_blocking=True), tgt.to(dev, non_blocking=True))
            (ls / n).backward()
            total += ls.detach()                   # no host sync per micro-batch: the engine pays none
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item() / n                    # one sync per step, as stream.Trainer.step
    return step


def resident_ckpt_trainer(cfg, weights, M, fused=True):
    """Plain PyTorch, every weight on the GPU: fp32 params, bf16 autocast, fused AdamW, per-layer checkpointing."""
    return module_step(Model(cfg, weights).to(DEV), M, autocast=CUDA, fused=fused)


def fsdp2_trainer(cfg, weights, M, fused=True):
    """FSDP2 on one GPU with CPUOffloadPolicy (bf16 params, fp32 reduce, torch AdamW on the CPU shards).
    Without CUDA: plain FSDP2 on a gloo CPU mesh (a code-path check only, no offload)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sk:  # a free port: other runs on this machine may hold a fixed one
            sk.bind(("localhost", 0))
            os.environ["MASTER_PORT"] = str(sk.getsockname()[1])
    os.environ.update(MASTER_ADDR="localhost", RANK="0", WORLD_SIZE="1")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1)
    if CUDA:
        torch.cuda.set_device(0)
    kw = dict(offload_policy=CPUOffloadPolicy(),
              mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32)) if CUDA else {}
    m = Model(cfg, weights)
    for layer in m.layers:
        fully_shard(layer, **kw)
    fully_shard(m, **kw)
    return module_step(m, M, autocast=False, fused=fused)  # mixed precision by the policy, not autocast


# ----------------------------------------------------------------------------- cases
def stream_case(cfg, B, T, M, S, peak, offload, keep=False, resident=0, grad_clip=0.0, grad_slabs=None, mode="fast",
                gpu_updated=0):
    """The engine on cfg at B x T tokens in M micro-batches, `resident` units on the GPU (the first the forward
    needs), `gpu_updated` streamed units updated there (gpu_update.GpuUpdates), grad_clip, the gradient slabs (None:
    stream.GRAD_SLABS) and the memory mode as given: its timing (and the trainer, keep=True)."""
    slabs = grad_slabs or stream.GRAD_SLABS
    t = trainer(cfg, M, offload, resident=resident, grad_clip=grad_clip, grad_slabs=slabs, mode=mode,
                gpu_updated=gpu_updated)
    r = time_steps(t.step, batch(cfg, B, T), S["warmup"], S["steps"], drain=t.wait, steady=S["steady"])
    r = rates(cfg, B, T, dict(r, engine="stream", n_layer=cfg.n_layer, offload=offload, resident_units=resident,
                              grad_clip=grad_clip, grad_slabs=slabs, mode=mode, gpu_updated_units=gpu_updated),
              peak, compute_only(cfg, B, T, M), t)
    return (r, t) if keep else r


def trainer(cfg, M, offload, resident, grad_clip, grad_slabs, mode, gpu_updated):
    """The engine as bench runs it: checked, no guard (train.py's --skip-nonfinite), every layer the same."""
    return CheckedTrainer(cfg, same_layers(cfg), micro_batches=M, grad_clip=grad_clip, grad_slabs=grad_slabs,
                          mode=mode, **engine.parts(offload, resident_units=resident, gpu_updated_units=gpu_updated))


def pinned_case(S):
    if not CUDA:
        return {"skipped": "no CUDA"}
    host = torch.empty(2**30 // 2, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    out = {}
    for name, dst, src in (("h2d_gbs", dev, host), ("d2h_gbs", host, dev)):
        best = math.inf
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        out[name] = host.numel() * 2 / GB / best
    del host
    # what a unit resident on the GPU costs per step: torch's fused CUDA AdamW (fp32 p g m v) and a D2D copy
    n, step = 2**26, torch.zeros((), device="cuda")
    p, g, m, v = (torch.rand(n, device="cuda") for _ in range(4))
    for name, fn, nbytes in (("cuda_adamw_gbs", lambda: torch._fused_adamw_(
            [p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
            amsgrad=False, maximize=False), 28 * n), ("d2d_gbs", lambda: dev[:n].copy_(p.bfloat16()), 10 * n)):
        best = math.inf
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        out[name] = nbytes / GB / best              # bytes counted: AdamW 28 B/param; cast + copy 4 + 2 + 2 + 2
    out["cuda_adamw_gparams"] = out["cuda_adamw_gbs"] / 28
    return out


def sweep_case(S, peak):
    rows = {}
    for L in S["depths"]:
        cfg = dataclasses.replace(S["sweep"], n_layer=L)
        rows[L] = stream_case(cfg, S["sweep_batch"], S["seq"], S["sweep_batch"], S, peak, offload=True)
        free_memory()
    peaks = [r["peak_gpu_gb"] for r in rows.values() if r["peak_gpu_gb"]]
    return dict(depths=rows, gpu_mem_depth_spread=(max(peaks) - min(peaks)) / min(peaks) if peaks else None)


def tokens_for(cfg, S):
    """(B, T, M): planner's min_tokens_per_step rounded up to whole sequences, one sequence per micro-batch."""
    T = S["seq"]
    tok = S.get("tokens") or planner.plan(cfg, "local", batch_size=1, seq_len=T)["min_tokens_per_step"]
    B = max(1, math.ceil(tok / T))
    return B, T, B


def peers_case(S, peak, smoke, out_dir, peers=("resident", "resident_no_ckpt", "fsdp2_offload")):
    cfg = dataclasses.replace(S["wide"], n_layer=S["peers_depth"])
    B, T, M = tokens_for(cfg, S)
    k = planner.plan(cfg, "local", batch_size=B, seq_len=T, micro_batches=M)["resident_units"]   # the planner's
    out = dict(n_layer=cfg.n_layer, params=model.n_params(cfg),
               stream=stream_case(cfg, B, T, M, S, peak, offload=False, resident=k))
    free_memory()
    out["stream_0_resident"] = stream_case(cfg, B, T, M, S, peak, offload=False)   # every unit streamed
    free_memory()
    runs = [("resident", True), ("resident_no_ckpt", True), ("fsdp2_offload", True), ("fsdp2_offload", False)]
    for name, fused in runs:  # fsdp2 with torch's default AdamW only if the fused CPU kernel failed on it
        if name not in peers:
            out[name] = {"skipped": "not asked for (--peers)"}
            continue
        if name in out and "error" not in out[name]:
            continue
        if name == "resident_no_ckpt" and not CUDA:
            out[name] = {"skipped": "no CUDA"}
            continue
        res = out_dir / f"peer-{name}.json"                    # its own process: the allocator settings it finds
        cmd = [sys.executable, __file__, "--peer", name, "--out", str(res)] + ["--smoke"] * smoke + \
            ["--default-adamw"] * (not fused)
        p = subprocess.run(cmd, capture_output=True, text=True)
        r = json.loads(res.read_text()) if p.returncode == 0 and res.is_file() else \
            {"error": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}
        res.unlink(missing_ok=True)
        if "error" not in r:
            r = rates(cfg, B, T, dict(r, engine=name, n_layer=cfg.n_layer, adamw="fused" if fused else "default",
                                      earlier_error=out.get(name, {}).get("error")))
            out[f"vs_{name}"] = out["stream"]["tokens_per_s"] / r["tokens_per_s"]
        else:
            r["earlier_error"] = out.get(name, {}).get("error")
        out[name] = r
    return out


def peer_main(name, S, fused, path):
    """One peer of the peers case, timed in this (fresh) process; its timing dict written to `path` as JSON."""
    cfg = dataclasses.replace(S["wide"], n_layer=S["peers_depth"])
    B, T, M = tokens_for(cfg, S)
    try:
        if name == "resident_no_ckpt":  # megatrain_min.engine.reference: keeps every activation, no recompute
            step = ReferenceTrainer(cfg, SameLayers(cfg), device="cuda", dtype=torch.bfloat16, micro_batches=M).step
        else:
            step = (resident_ckpt_trainer if name == "resident" else fsdp2_trainer)(cfg, SameLayers(cfg), M, fused)
        r = time_steps(step, batch(cfg, B, T), S["warmup"], S["steps"])
    except Exception as e:  # noqa: BLE001 -- an OOM or an FSDP2 failure is a result, not a crash
        r = {"error": f"{type(e).__name__}: {str(e)[:300]}", "did_not_fit": isinstance(e, torch.OutOfMemoryError)}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # the FSDP2 peer's one-process group
    Path(path).write_text(json.dumps(r, default=str))


def wide_case(S, peak, profile_dir=None, save=lambda out: None, layers=None, clips=(0.0, 1.0), sweep=None):
    """Llama-2-7B-width layers at the deepest depth whose streamed host store fits (or `layers`), run twice: in the
    streaming regime a 120b run is in (the headline: at most 10% of the units resident on the GPU, the embedding and
    layer 0 first) at the planner's minimum tokens, then 2x, 4x, 8x those tokens (the sweep: where the GPU-only
    share reaches 0.95), then clipped; and as the planner chooses (every unit that fits resident: on an H200 with
    a 5.1B model, all of them). Each with the planner's prediction on this machine's profile beside it."""
    base = S["wide"]
    B, T, M = tokens_for(base, S)
    avail = hardware.host_available_bytes()
    few = lambda cfg: len(model.units(cfg)) // 10  # noqa: E731  the streaming regime: <= 10% resident
    kw = lambda clip, k: dict(batch_size=B, seq_len=T, micro_batches=M, grad_clip=clip,  # noqa: E731
                              resident_units=k, skip_nonfinite=False)   # the bench builds no guard
    fits = lambda L, clip=0.0: planner.plan(dataclasses.replace(base, n_layer=L), "local", **kw(  # noqa: E731
        clip, few(dataclasses.replace(base, n_layer=L))))["host_bytes"] <= 0.85 * avail
    L = min(layers or S["max_depth"], next((L for L in range(S["max_depth"], 0, -1) if fits(L)), 1))
    cfg = dataclasses.replace(base, n_layer=L)
    k = few(cfg)
    p = planner.plan(cfg, "local", **kw(0.0, k))  # dtype: the planner's default
    off = p["offload_activations"]
    out = dict(n_layer=L, params=model.n_params(cfg), units=len(model.units(cfg)), streaming_resident_units=k,
               host_available_gb=avail / GB, planned_host_gb=p["host_bytes"] / GB, planned_step_s=p["step_time_s"],
               planned_min_tokens=p["min_tokens_per_step"])
    r, t = stream_case(cfg, B, T, M, S, peak, off, keep=True, resident=k, grad_slabs=p["grad_slabs"],
                       gpu_updated=p["gpu_updated_units"])
    out["at_min_tokens"] = r
    save(out)
    for mult in S["token_sweep"] if sweep is None else sweep:   # the same trainer, more tokens (its M)
        bm = batch(cfg, mult * B, T)
        rm = time_steps(t.step, bm, 1, 2, drain=t.wait)
        out[f"at_{mult}x_tokens"] = rates(cfg, mult * B, T, dict(
            rm, engine="stream", n_layer=L, resident_units=k, gpu_updated_units=p["gpu_updated_units"],
            grad_slabs=p["grad_slabs"], mode="fast"), peak, compute_only(cfg, mult * B, T, M), t)
        out[f"at_{mult}x_tokens"]["planned_step_s"] = planner.plan(cfg, "local", **dict(   # this trainer's
            kw(0.0, k), batch_size=mult * B, gpu_updated_units=p["gpu_updated_units"], grad_slabs=p["grad_slabs"])
        )["step_time_s"]
        save(out)
    if profile_dir:                                # the numbers are on disk before the (slow, optional) trace
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if CUDA else [])
        b = batch(cfg, B, T)
        with torch.profiler.profile(activities=acts,  # all threads: the optimizer's too (framework internal)
                                    experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True)) as prof:
            for _ in range(3):
                t.step(*b)
            t.wait()
        trace = Path(profile_dir) / "trace.json"
        prof.export_chrome_trace(str(trace))  # gzipped: a 7B-wide trace is large; Perfetto opens .json.gz
        with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
            g.write(f.read())
        trace.unlink()
        out["trace"] = f"{trace}.gz"
    t.wait()
    del t
    # clipped (train.py's default: every update waits for the norm) first -- issue 33's target is lean_clip_1 -- each
    # with the plan's count of units updated on the GPU, and once with none (every update on the host)
    runs = [(f"{m}clip_{c:g}", c, k, mode, None) for c in clips if c for m, mode in (("lean_", "lean"), ("", "fast"))] + \
        [(f"clip_{c:g}_host", c, k, "fast", 0) for c in clips if c] + [("lean_clip_0", 0.0, k, "lean", None)] + \
        [(f"planned_clip_{c:g}", c, None, "fast", None) for c in clips]
    for name, clip, resident, mode, gpu_updated in runs:
        gc.collect()
        free_memory()                              # before planning: "local" reads the GPU's free memory now
        pr = planner.plan(cfg, "local", **kw(clip, resident), mode=mode, gpu_updated_units=gpu_updated)
        if not pr["fits"]:
            why = "host" if not pr["fits_host"] else f"GPU, {pr['hardware']['gpu_mem_gb']:.0f} GB free"
            out[name] = {"skipped": f"{L} layers, clip {clip:g}, {pr['resident_units']} resident: the plan does "
                                    f"not fit this machine ({why})"}
            continue
        r = stream_case(cfg, B, T, M, S, peak, pr["offload_activations"], resident=pr["resident_units"],
                        grad_clip=clip, grad_slabs=pr["grad_slabs"], mode=mode, gpu_updated=pr["gpu_updated_units"])
        out[name] = dict(r, planned_step_s=pr["step_time_s"])
        save(out)
    out["at_min_tokens"]["planned_step_s"] = p["step_time_s"]
    return out


def quick_case(S, peak, modes=("lean", "fast"), budget_s=None, save=lambda out: None):
    """The wide case (S["quick_layers"] layers of 7B width) in the streaming regime (<= 10% of the units
    resident) at each of S["quick_tokens"] (QUICK_M sequences, one per micro-batch), grad clip 1 and 0, each
    memory mode of `modes`, with the plan's count of units updated on the GPU (at the first token count) and
    with none: one trainer per (mode, clip, count), timed at every token count, the planner's step beside
    each row. In that order -- the plan's pick beside its baseline, lean first (--mode auto's pick there)
    -- while the planned cost fits in what is left of budget_s: the planned steps and what a trainer costs
    besides (QUICK_TRAINER_S, or more where the trainers so far took more); the rest are listed with their
    prediction, "skipped"."""
    cfg = dataclasses.replace(S["wide"], n_layer=S["quick_layers"])
    M, k = QUICK_M, len(model.units(cfg)) // 10
    shapes = [(M, tokens // M) for tokens in S["quick_tokens"]]                     # (B, T)
    kw = lambda B, T, clip, mode, g: dict(batch_size=B, seq_len=T, micro_batches=M, grad_clip=clip,  # noqa: E731
                                          mode=mode, resident_units=k, gpu_updated_units=g, skip_nonfinite=False)
    out = dict(n_layer=cfg.n_layer, params=model.n_params(cfg), units=len(model.units(cfg)), resident_units=k,
               micro_batches=M, model=cfg.to_dict(), budget_s=budget_s, rows={}, trainers=[])
    start, steps_per_shape = time.time(), QUICK_LEAD + QUICK_STEPS + QUICK_STEADY
    for mode in modes:
        for clip in (1.0, 0.0):
            for asked in (S["quick_gpu_updated"], 0):      # the plan's count (None) or the smoke's, then none
                free_memory()                              # "local" plans read the GPU's free memory now
                pick = planner.plan(cfg, "local", **kw(*shapes[0], clip, mode, asked))
                g, slabs, off = pick["gpu_updated_units"], pick["grad_slabs"], pick["offload_activations"]
                names = [f"{mode}_clip_{clip:g}_gpu_{'plan' if asked is None else asked}_{B * T}" for B, T in shapes]
                plans = [pick] + [planner.plan(cfg, "local", **kw(B, T, clip, mode, g), grad_slabs=slabs or None,
                                               offload_activations=off) for B, T in shapes[1:]]
                picks = [g] + [planner.plan(cfg, "local", **kw(B, T, clip, mode, None))["gpu_updated_units"]
                               if asked is None else g for B, T in shapes[1:]]   # the plan's own, at each count
                steps_s = steps_per_shape * sum(p["step_time_s"] for p in plans)
                extra = max([QUICK_TRAINER_S] + [x["wall_s"] - x["planned_steps_s"] for x in out["trainers"]])
                need = extra + steps_s          # (what the trainers so far cost besides their planned steps)
                left = None if budget_s is None else budget_s - (time.time() - start)
                why = ("the plan picks no GPU-updated unit here: the row with none measures it"
                       if asked is None and g == 0 else
                       "the plan does not fit this machine" if not pick["fits"] else
                       f"the budget: ~{need:.0f} s planned, {left:.0f} s left" if left is not None and need > left
                       else None)
                for name, p, here, (B, T) in zip(names, plans, picks, shapes):
                    out["rows"][name] = dict(tokens=B * T, batch=B, seq=T, micro_batches=M, mode=mode,
                                             grad_clip=clip, resident_units=k, gpu_updated_units=g,
                                             gpu_updated_plan=asked is None, gpu_updated_plan_here=here,
                                             grad_slabs=slabs, offload=off, planned_step_s=p["step_time_s"],
                                             skipped=why)
                if why:
                    continue
                began = t0 = time.time()
                t, built = None, None
                try:   # an OOM or a failure is this trainer's result: the others still run
                    t = trainer(cfg, M, off, resident=k, grad_clip=clip, grad_slabs=slabs or stream.GRAD_SLABS,
                                mode=mode, gpu_updated=g)
                    built = time.time() - t0
                    for name, (B, T) in zip(names, shapes):
                        row = out["rows"][name]
                        r = time_steps(t.step, batch(cfg, B, T), QUICK_LEAD, QUICK_STEPS, drain=t.wait,
                                       steady=QUICK_STEADY)
                        row.update(rates(cfg, B, T, dict(r, engine="stream", n_layer=cfg.n_layer), peak,
                                         compute_only(cfg, B, T, M), t))
                        row.pop("skipped")
                        save(out)
                except Exception as e:  # noqa: BLE001
                    for name in names:
                        if "step_s" not in out["rows"][name]:
                            out["rows"][name]["skipped"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                    save(out)
                t0 = time.time()
                del t
                free_memory()
                out["trainers"].append(dict(rows=names, build_s=built, free_s=time.time() - t0,
                                            wall_s=time.time() - began, planned_steps_s=steps_s))
    out["wall_s"] = time.time() - start
    return out


# ----------------------------------------------------------------------------- report
def meta(args):
    drv = None
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return dict(device=torch.cuda.get_device_name(0) if CUDA else "cpu", driver=drv, cuda=torch.version.cuda,
                torch=torch.__version__, date=datetime.datetime.now().isoformat(timespec="seconds"),
                host=socket.gethostname(), cpus=os.cpu_count(),
                command=" ".join([sys.executable, "bench/gpu.py", *sys.argv[1:]]),
                smoke=args.smoke, quick=args.quick, host_available_gb=hardware.host_available_bytes() / GB,
                update_order="need-first",   # optim.Worker's (runs before this key: first come, first served)
                step_s="steady")   # time_steps: step_s over steps between one sync (runs before: per-step syncs)


def summary(res):
    c = res["cases"]
    get = lambda *ks: _dig(c, ks)  # noqa: E731
    return dict(device=res["meta"]["device"], date=res["meta"]["date"], overlap=get("wide", "at_min_tokens", "overlap"),
                vs_resident=get("peers", "vs_resident"), vs_fsdp2_offload=get("peers", "vs_fsdp2_offload"),
                model_tflops_7b_wide=None if res["meta"]["smoke"] else get("wide", "at_min_tokens", "model_tflops"),
                gpu_mem_depth_spread=get("sweep", "gpu_mem_depth_spread"))


def _dig(d, ks):
    for k in ks:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def markdown(res):
    m, rows = res["meta"], []
    f = lambda v, p=2: "-" if v is None else f"{v:,.{p}f}"  # noqa: E731
    wide = res["cases"].get("wide", {})
    for name, r in [(f"wide @ min tokens, {wide.get('streaming_resident_units')} resident",
                     _dig(res["cases"], ["wide", "at_min_tokens"]))] + \
            [(f"wide @ {m}x tokens", _dig(res["cases"], ["wide", f"at_{m}x_tokens"])) for m in (2, 4, 8)] + \
            [(f"wide @ min tokens, grad clip 1{how}", _dig(res["cases"], ["wide", key])) for key, how in (
                ("lean_clip_1", ", --mode lean"), ("clip_1", ""), ("clip_1_host", ", every update on the host"))] + \
            [("wide @ min tokens, --mode lean", _dig(res["cases"], ["wide", "lean_clip_0"]))] + \
            [(f"wide as planned, clip {c}", _dig(res["cases"], ["wide", f"planned_clip_{c}"])) for c in (0, 1)] + \
            [(f"peers: {k}", _dig(res["cases"], ["peers", k]))
             for k in ("stream", "stream_0_resident", "resident", "resident_no_ckpt", "fsdp2_offload")] + \
            [(f"sweep L={L}", r) for L, r in (_dig(res["cases"], ["sweep", "depths"]) or {}).items()]:
        if isinstance(r, dict) and "step_s" in r:
            name += f" ({r['gpu_updated_units']} updated on the GPU)" if r.get("gpu_updated_units") else ""
            rows.append(f"| {name} | {r.get('n_layer', '')} | {r['tokens']:,} | {f(r['step_s'], 3)} | "
                        f"{f(r.get('planned_step_s'), 3)} | {f(r['tokens_per_s'], 0)} | "
                        f"{f(r['model_tflops'], 1)} | {f(r.get('megatrain_tflops'), 1)} | {f(r.get('overlap'))} | "
                        f"{f(r.get('h2d_gbs'), 1)} | {f(r.get('peak_gpu_gb'))} | {f(r['rss_peak_gb'], 1)} |")
        elif isinstance(r, dict):
            rows.append(f"| {name} | | | {r.get('skipped') or r.get('error', '')[:80]} | | | | | | | | |")
    head = (f"# megatrain-min bench: {m['device']}, {m['date']}\n\n"
            f"torch {m['torch']}, CUDA {m['cuda']}, driver {m['driver']}, "
            f"{m['cpus']} CPUs, {m['host_available_gb']:.0f} GB host available. Command: `{m['command']}`\n\n"
            f"pinned copy peak: {res['cases'].get('pinned')}\n\nsummary: {json.dumps(res['summary'])}\n\n"
            "| case | layers | tokens/step | step s | planned s | tokens/s | model TFLOP/s | MegaTrain TFLOP/s | overlap "
            "| H2D GB/s (avg) | peak GPU GB | peak RSS GB |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(rows) + "\n" + quick_table(res["cases"].get("quick"))


def quick_table(q):
    """The quick case's rows: each measured step (steady; per-step synced) beside the planner's."""
    if not q:
        return ""
    f = lambda v, p=3: "-" if v is None else f"{v:,.{p}f}"  # noqa: E731
    lines = [f"\n## --quick: {q['n_layer']} layers of 7B width, {q['resident_units']} of {q['units']} units "
             f"resident, {q['micro_batches']} micro-batches of one sequence\n",
             "| row | tokens (B x T) | clip | mode | updated on the GPU | slabs | step s (steady) | step s "
             "(synced per step) | planned s | planned / steady | H2D GB/s | D2H GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in q["rows"].items():
        g = f"{r['gpu_updated_units']}" + (" (the plan)" if r["gpu_updated_plan"] else "")
        ratio = r["planned_step_s"] / r["step_s"] if "step_s" in r else None
        steady = f"skipped: {r['skipped']}" if r.get("skipped") else f(r.get("step_s"))
        lines.append(f"| {name} | {r['tokens']:,} ({r['batch']} x {r['seq']}) | {r['grad_clip']:g} | {r['mode']} "
                     f"| {g} | {r['grad_slabs']} | {steady} | {f(r.get('step_synced_s'))} | "
                     f"{f(r['planned_step_s'])} | {f(ratio)} | {f(r.get('h2d_gbs'), 1)} | {f(r.get('d2h_gbs'), 1)} |")
    built = ", ".join("-" if x["build_s"] is None else f"{x['build_s']:.0f}" for x in q["trainers"])
    freed = ", ".join(f"{x['free_s']:.0f}" for x in q["trainers"])
    lines.append(f"\n{len(q['trainers'])} trainers built in {built} s, freed in {freed} s; case wall "
                 f"{f(q.get('wall_s'), 0)} s of a {f(q['budget_s'], 0)} s budget")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes (CPU or GPU, < 1 min): checks the harness, not the speed")
    ap.add_argument("--out", help="output directory (default bench/results/<date>-<device>)")
    ap.add_argument("--only", default="pinned,sweep,peers,wide", help="comma-separated cases: pinned,sweep,peers,wide")
    ap.add_argument("--profile", action="store_true", help="write OUT/trace.json: 3 steps of the wide case (torch.profiler)")
    ap.add_argument("--peer", choices=["resident", "resident_no_ckpt", "fsdp2_offload"],
                    help="(internal) time one peer of the peers case in this process, its JSON to --out")
    ap.add_argument("--default-adamw", action="store_true", help="(internal, with --peer) torch's default AdamW")
    ap.add_argument("--peers", default="resident,resident_no_ckpt,fsdp2_offload",
                    help="the peers case's peers (fsdp2_offload takes ~2 minutes of a GPU session)")
    ap.add_argument("--wide-layers", type=int, help="the wide case's depth (default: the deepest that fits)")
    ap.add_argument("--wide-clips", default="0,1", help="grad_clip values of the wide case at its min tokens")
    ap.add_argument("--wide-sweep", help="the wide case's token multiples (default 2,4,8; 'none': no sweep)")
    ap.add_argument("--quick", action="store_true",
                    help="the pinned peaks and the quick case alone (bench/gpu_run.sh --quick): the wide case's "
                         "streaming regime at 16,384 and 12,288 tokens, clip 1 and 0, lean and fast, the plan's "
                         "GPU-updated units and none, each row beside its plan")
    ap.add_argument("--quick-modes", default="lean,fast", help="the quick case's memory modes, in this order")
    ap.add_argument("--budget-s", type=float,
                    help="seconds for the quick case: a trainer whose planned cost no longer fits is skipped")
    args = ap.parse_args()
    S, only = SMOKE if args.smoke else FULL, ["quick"] if args.quick else args.only.split(",")
    if args.peer:
        return peer_main(args.peer, S, not args.default_adamw, args.out)
    if bad := set(only) - {"pinned", "sweep", "peers", "wide", "quick"}:
        ap.error(f"unknown case(s) {sorted(bad)} in --only; choose from pinned,sweep,peers,wide")
    res = dict(meta=meta(args), definitions=DEFS, cases={})
    slug = re.sub(r"[^a-z0-9]+", "-", res["meta"]["device"].lower()).strip("-")
    out = Path(args.out or f"bench/results/{datetime.date.today()}-{slug}")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    def saver(name):  # the wide and quick cases save each row as it is measured
        def save(case):
            res["cases"][name] = case
            write()
            print(f"bench: {name} saved", flush=True)
        return save

    def write():  # after every case: a crash (host OOM kill) keeps what was measured
        res["summary"] = summary(res)
        (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "summary.json").write_text(json.dumps(res["summary"], indent=1))
        (out / "results.md").write_text(markdown(res))
    print(f"bench: {res['meta']['device']}, torch {torch.__version__}, {res['meta']['host_available_gb']:.0f} GB host "
          f"available, cases {only}, out {out}", flush=True)
    peak = res["cases"]["pinned"] = pinned_case(S)  # always: the copy peak is the yardstick of every case
    peak = peak if peak and "h2d_gbs" in peak else None
    clips = tuple(float(c) for c in args.wide_clips.split(","))
    sweep = None if args.wide_sweep is None else () if args.wide_sweep == "none" else \
        tuple(int(m) for m in args.wide_sweep.split(","))
    for name, fn in (("sweep", lambda: sweep_case(S, peak)),
                     ("peers", lambda: peers_case(S, peak, args.smoke, out, args.peers.split(","))),
                     ("wide", lambda: wide_case(S, peak, out if args.profile else None, saver("wide"),
                                                args.wide_layers, clips, sweep)),
                     ("quick", lambda: quick_case(S, peak, args.quick_modes.split(","), args.budget_s,
                                                  saver("quick")))):
        if name in only:
            t0 = time.time()
            print(f"bench: {name} ...", flush=True)
            res["cases"][name] = fn()
            res["cases"][name]["case_wall_s"] = time.time() - t0
            free_memory()
            write()
            print(f"bench: {name} done in {time.time() - t0:.0f}s", flush=True)
    write()
    print(markdown(res))
    print(f"bench: wrote {out}/results.json, results.md, summary.json")


if __name__ == "__main__":
    main()
