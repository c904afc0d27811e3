# %% [markdown]
# # Lesson 3 -- weights in host memory
#
# **What you will learn**
#
# * what *pinned* (page-locked) host memory is and why every buffer the GPU copies from must be
#   pinned;
# * why each unit (embedding, layer, head) crosses to the GPU as **one** contiguous copy;
# * what the host keeps per parameter: fp32 master, Adam m and v, fp32 gradient (+ a bf16 shadow):
#   16-18 bytes per parameter -- the number that decides how big a model fits (lesson 6);
# * AdamW written out from scratch, checked against `torch.optim.AdamW`, then the project's
#   `optim.HostStore`, which updates one unit's flat buffer with two calls of torch's fused CPU
#   kernel;
# * why that fused kernel matters: we time it against the plain for-loop and foreach
#   implementations;
# * that the update rule is handed in: a third one (SGD with momentum) in a dozen lines, checked
#   through the engine against `torch.optim.SGD`.
#
# Lesson 2 showed that only one layer's graph is ever needed. So the weights need not live on the
# GPU at all: they live in host RAM, next to the optimizer that updates them, and visit the GPU.
#
# Run it: `python tutorials/03_weights_in_host_memory.py` (~3 s on a 2-core CPU). With CUDA it also
# measures pageable vs pinned copy bandwidth.

# %%
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = (Path(__file__).resolve().parents[1] if "__file__" in globals()   # a script, or a notebook
        else Path.cwd().resolve().parent)                                 # run from tutorials/
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
from megatrain_min.engine.reference import ReferenceTrainer  # noqa: E402
from megatrain_min.engine.pinned import page_locked  # noqa: E402
from optim import AdamW, HostStore  # noqa: E402
from stream import Trainer  # noqa: E402

CUDA = torch.cuda.is_available()
torch.manual_seed(0)

# %% [markdown]
# ## 1. Pinned memory
#
# A GPU copies host memory by DMA: the copy engine reads physical pages while the CPU does something
# else. Ordinary ("pageable") memory may be swapped or moved by the OS, so CUDA first copies it into
# a pinned bounce buffer, synchronously. Memory allocated with `pin_memory=True` is page-locked up
# front: the copy goes straight from it, at full PCIe speed, and `non_blocking=True` really is
# asynchronous. That is why `optim.HostStore` page-locks every buffer a copy engine reads or writes
# (the gradients and the streamed shadow; never Adam's m and v) when CUDA is present: the engine
# hands it `pinned=`, torch's pinned allocator (`optim.pinned_zeros`) unless it is given another.
# train.py's engine is given `megatrain_min.engine.pinned.page_locked`, used here too: it registers
# ordinary host pages with CUDA (`cudaHostRegister`), exactly as many as the buffer needs, where
# torch's pinned allocator rounds every block up to a power of two (+31% on a 7b store).
#
# Without CUDA there is no pinned allocator (`torch.empty(n, pin_memory=True)` raises), and there is
# nothing to copy to: the same code runs with ordinary memory.

# %%
def h2d_gbps(src, dst, non_blocking, reps=5):
    dst.copy_(src, non_blocking=non_blocking)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=non_blocking)
    torch.cuda.synchronize()
    return reps * src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9


if CUDA:
    n = (256 << 20) // 4                                         # 256 MB of fp32
    dst = torch.empty(n, device="cuda")
    pageable, pinned = torch.randn(n), torch.randn(n).pin_memory()
    print(f"H2D pageable {h2d_gbps(pageable, dst, False):6.1f} GB/s   pinned "
          f"{h2d_gbps(pinned, dst, True):6.1f} GB/s")
    del dst, pageable, pinned
else:
    print("no CUDA: skipping the bandwidth measurement (on an H100 host expect ~10-25 GB/s "
          "pageable, ~50-55 GB/s pinned over PCIe Gen5 x16)")

# %% [markdown]
# ## 2. One copy per unit
#
# Lesson 1 put each layer in one flat buffer. The engine keeps two *weight slots* on the GPU, each
# big enough for the largest unit, and moves a layer with ONE `slot[:n].copy_(flat,
# non_blocking=True)`: one DMA, one event to wait on, no per-tensor launch overhead, no allocation.
# The views of lesson 1 then give the layer its weights inside the slot. Here we compare one copy
# with one copy per tensor for a GPT-2-small-sized layer (on the CPU the two are just memcpys, so we
# only count them).

# %%
lay = model.units(model.PRESETS["small"])[0]               # layer.0 of the 124M preset: 7.1M params
print(f"{lay.name} of 'small': {lay.numel:,} params in {len(lay.entries)} tensors")
if CUDA:
    flat = torch.randn(lay.numel, dtype=torch.bfloat16).pin_memory()
    slot = torch.empty(lay.numel, dtype=torch.bfloat16, device="cuda")
    pairs = list(zip(lay.views(slot).values(), lay.views(flat).values()))

    def per_tensor():
        for d, s in pairs:
            d.copy_(s, non_blocking=True)

    def one_flat_copy():
        slot.copy_(flat, non_blocking=True)

    for name, fn in (("one flat copy", one_flat_copy), ("per tensor", per_tensor)):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        print(f"  {name:<14} {(time.perf_counter() - t0) / 20 * 1e3:7.3f} ms per layer")
else:
    print(f"  one flat copy: 1 transfer per layer visit; per tensor: {len(lay.entries)} transfers")

# %% [markdown]
# ## 3. What the host keeps, per parameter
#
# For every unit, `optim.HostStore` holds flat fp32 buffers of the unit's size (with the AdamW
# update rule, `optim.AdamW`; the rule declares its state, `optim.AdamW.state`):
#
# | buffer | bytes/param | why |
# |---|---|---|
# | master | 4 | the weights, in full precision, the only copy |
# | m, v   | 4 + 4 | Adam's moments |
# | grad   | 4 | where the GPU's fp32 gradient lands (D2H); per unit only with clipping |
# | shadow | 2 | a bf16 copy of the master, refreshed by each update: what "fast" streams |
#
# With clipping every gradient must be on the host before the global norm is known, so the store
# keeps one per unit (`grad_store=True`). Without it each unit is updated as soon as its gradient
# lands, and the engine passes gradients through a few unit-sized gradient slabs instead
# (`grad_store=False`: 4 B/param less). The GPU holds only two weight slots and two gradient slots:
# independent of the number of layers.

# %%
cfg = model.PRESETS["toy"]
units = model.units(cfg)
sizes = [(u.numel, u.n_decay) for u in units]                  # (numel, decayed prefix) per unit
N = model.n_params(cfg)
for shadow in (torch.bfloat16, None):
    for grad_store in (True, False):
        opt = HostStore(sizes, shadow_dtype=shadow, grad_store=grad_store,
                        pinned=page_locked if CUDA else None)
        print(f"shadow {str(shadow):<15} grad_store {str(grad_store):<5}: host store "
              f"{opt.nbytes() / 1e6:6.2f} MB = {opt.nbytes() / N:.0f} B/param")
assert HostStore(sizes, shadow_dtype=torch.bfloat16).nbytes() == 18 * N
assert HostStore(sizes, grad_store=False).nbytes() == 12 * N

# %% [markdown]
# ## 4. AdamW from scratch
#
# The update for one tensor `p` with gradient `g` at step `t` (decoupled weight decay, as
# `torch.optim.AdamW` does it):
#
# ```
# p <- p * (1 - lr * wd)
# m <- b1 m + (1 - b1) g                 v <- b2 v + (1 - b2) g^2
# p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
# ```
#
# Matrices get `wd`, 1-D tensors (norm weights, biases) get 0.

# %%
def adamw_scratch(params, grads, ms, vs, t, lr, betas, eps, wds):
    """One AdamW step over lists of tensors, one tensor at a time, with plain tensor ops."""
    b1, b2 = betas
    for p, g, m, v, wd in zip(params, grads, ms, vs, wds):
        p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / (1 - b2 ** t) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))


HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
WD = 0.1
lay = units[1]                                                 # toy layer.0: 7 matrices, 2 vectors
shapes = [e.shape for e in lay.entries]
init = [torch.randn(s) * 0.02 for s in shapes]
wds = [WD if len(s) >= 2 else 0.0 for s in shapes]

ours = [p.clone() for p in init]
ms, vs = [torch.zeros_like(p) for p in init], [torch.zeros_like(p) for p in init]
leaves = [p.clone().requires_grad_() for p in init]
ref = torch.optim.AdamW([{"params": [p for p in leaves if p.dim() >= 2], "weight_decay": WD},
                         {"params": [p for p in leaves if p.dim() < 2], "weight_decay": 0.0}], **HP,
                        fused=True)
RULE = AdamW(HP["betas"], HP["eps"])                 # the update rule: torch's fused AdamW kernel
# one unit: the whole layer
host = HostStore([(lay.numel, lay.n_decay)], RULE, lr=HP["lr"], weight_decay=WD)
host.master[0].copy_(torch.cat([p.flatten() for p in init]))   # layout order = [matrices | vectors]
gen = torch.Generator().manual_seed(0)
for t in range(1, 6):
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    adamw_scratch(ours, grads, ms, vs, t, wds=wds, **HP)
    for p, g in zip(leaves, grads):
        p.grad = g.clone()
    ref.step()
    host.grad[0].copy_(torch.cat([g.flatten() for g in grads]))     # what the D2H copy does
    host.step(0)                                                     # two fused kernel calls
ref_flat = torch.cat([p.detach().flatten() for p in leaves])
diff_scratch = (torch.cat([p.flatten() for p in ours]) - ref_flat).abs().max().item()
diff_host = (host.master[0] - ref_flat).abs().max().item()
print(f"after 5 steps, max |diff| vs torch.optim.AdamW(fused=True): scratch {diff_scratch:.1e}, "
      f"HostStore {diff_host:.1e}")

# %% [markdown]
# ## 5. Why the fused kernel matters
#
# AdamW does almost no arithmetic per byte: it is **memory-bound**. The minimum traffic is reading
# p, g, m, v (16 B) and writing p, m, v (12 B) -- ~28 B/param, +6 B for the bf16 shadow. The scratch
# loop above makes ~8 separate passes over memory per tensor (each op reads and writes whole
# tensors) and allocates temporaries; `foreach` batches the launches but still makes the passes; the
# fused kernel makes ONE pass. For a 120B model the optimizer touches ~4 TB per step, so this is the
# difference between the CPU keeping up with the GPU or not (the time per step is lesson 5's
# business).
#
# Time all of them on the same ~2.7M parameters (one layer of a d=512 model). The GB/s column is
# the *useful* traffic (28 B/param per step divided by the time); the unfused versions really move
# several times more bytes than that.

# %%
big = dataclasses.replace(cfg, d_model=512, n_head=8, n_kv_head=8, d_ff=1408, n_layer=1)
lays = model.units(big)[1:-1]
shapes = [e.shape for lay in lays for e in lay.entries]
n_big = sum(lay.numel for lay in lays)
params = [torch.randn(s) * 0.02 for s in shapes]
grads = [torch.randn(s) * 1e-3 for s in shapes]


def torch_adamw(**kw):
    ps = [p.clone().requires_grad_() for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    return torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": WD},
                              {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                             **HP, **kw).step


scratch_state = ([p.clone() for p in params], [torch.zeros_like(p) for p in params],   # p, m, v
                 [torch.zeros_like(p) for p in params])
scratch_wds = [WD if len(s) >= 2 else 0.0 for s in shapes]
host = HostStore([(lay.numel, lay.n_decay) for lay in lays], RULE, lr=HP["lr"], weight_decay=WD)
for u in range(len(lays)):
    host.grad[u].normal_(0, 1e-3)
contenders = {
    "scratch loop (section 4)": lambda: adamw_scratch(scratch_state[0], grads, scratch_state[1],
                                                      scratch_state[2], 1, wds=scratch_wds, **HP),
    "torch AdamW(foreach=False)": torch_adamw(foreach=False),
    "torch AdamW(foreach=True)": torch_adamw(foreach=True),
    "torch AdamW(fused=True)": torch_adamw(fused=True),
    "optim.HostStore (fused, flat)": lambda: [host.step(u) for u in range(len(lays))],
}
for fn in contenders.values():
    fn()                                                   # warm-up (allocates the optimizer state)
ms_per_step = {name: float("inf") for name in contenders}
for _ in range(3):                         # interleaved rounds, best of 3: all see the same machine
    for name, fn in contenders.items():
        t0 = time.perf_counter()
        fn()
        ms_per_step[name] = min(ms_per_step[name], (time.perf_counter() - t0) * 1e3)
print(f"{n_big / 1e6:.1f}M params, {torch.get_num_threads()} threads (times on a "
      "shared machine are noisy):")
for name, ms in ms_per_step.items():
    print(f"  {name:<30} {ms:7.1f} ms/step   ~{28 * n_big / ms / 1e6:5.1f} "
          "GB/s useful (28 B/param)")
speedup = ms_per_step["scratch loop (section 4)"] / ms_per_step["optim.HostStore (fused, flat)"]
print(f"fused HostStore is {speedup:.1f}x the scratch loop (bench/adamw_cpu.py compares it with "
      "torch's fused at 50M)")

# %% [markdown]
# ## 6. A third update rule, in one place
#
# The store does not know AdamW: it runs the **update rule** it is handed (`optim.AdamW` by
# default; `megatrain_min/engine/lion.py` is a second one). A rule is two things: the names of its
# per-parameter state (`state`, fp32, allocated by the store, saved by checkpoints, counted by the
# planner) and `update(p, g, state, step, lr, weight_decay, grad_scale, found_inf)`, which updates
# one region of a unit's flat buffers in place. SGD with momentum (decoupled decay, as AdamW's):
#
# ```
# p <- p * (1 - lr * wd);    buf <- mu buf + g;    p <- p - lr buf
# ```
#
# Handed to the engine it trains a model exactly as `torch.optim.SGD(momentum=mu)` does in plain
# PyTorch (`megatrain_min.engine.reference.ReferenceTrainer(optimizer=...)`, the whole model in
# memory).

# %%
class SGDMomentum:
    state = ("buf",)                                   # one fp32 buffer per parameter

    def __init__(self, momentum=0.9):
        self.momentum = momentum

    def update(self, p, g, state, step, lr, weight_decay, grad_scale=None, found_inf=None):
        if grad_scale is not None:                     # clipping: the gradient divided by it
            g.div_(grad_scale)
        buf = state["buf"]
        buf.mul_(self.momentum).add_(g)
        p.mul_(1 - lr * weight_decay).add_(buf, alpha=-lr)


w0 = model.init_weights(cfg, seed=0)
sgd = dict(lr=0.05, weight_decay=0.0, grad_clip=1.0, micro_batches=2, device="cpu")
ours = Trainer(cfg, w0, rule=SGDMomentum(0.9), **sgd)
ref = ReferenceTrainer(cfg, w0, optimizer=lambda groups, lr: torch.optim.SGD(groups, lr=lr,
                                                                          momentum=0.9), **sgd)
gen = torch.Generator().manual_seed(0)
for _ in range(4):
    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=gen)
    loss_ours = ours.step(tokens[:, :-1], tokens[:, 1:])
    loss_ref = ref.step(tokens[:, :-1], tokens[:, 1:])
got, want = ours.weights(), ref.weights()
diff_sgd = max(float((got[k] - want[k]).abs().max()) for k in want)
print(f"SGD with momentum through the engine vs torch.optim.SGD after 4 steps: loss "
      f"{loss_ours:.5f} vs {loss_ref:.5f}, max |weight diff| {diff_sgd:.1e}; the store holds "
      f"{list(ours.opt.tensors(0))} per unit")

# %% [markdown]
# ## Check
#
# The scratch AdamW and `optim.HostStore` give the same weights as `torch.optim.AdamW` after 5
# steps, and the store really costs 18 B/param with a bf16 shadow and a gradient store, 12 with
# neither. (Speed is printed, not asserted: a shared machine makes timings noisy. Expect the fused
# kernel to be several times faster than the loop.)

# %%
assert diff_scratch < 1e-6, diff_scratch
assert diff_host < 1e-6, diff_host
assert diff_sgd < 1e-5, diff_sgd                                        # measured 1.5e-8
assert abs(loss_ours - loss_ref) / loss_ref < 1e-5, (loss_ours, loss_ref)
print(f"OK  scratch AdamW max diff {diff_scratch:.1e}, HostStore max diff {diff_host:.1e}, "
      f"fused vs loop {speedup:.1f}x")
