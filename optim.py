"""optim.py -- the pinned host store, a per-unit CPU AdamW and the thread it runs on.

What it is
    HostAdamW keeps, for every unit (the embedding, each layer, the head), flat buffers in host
    memory: fp32 master weights, Adam m and v, gradients (per unit, or slabs lent to one unit at a
    time) and -- with bf16 compute -- a bf16 shadow of the master for the engine to stream; what
    crosses the link page-locked (page_locked: DMA). step(u) updates one unit with torch's fused
    CPU AdamW kernel, so the optimizer thread (worker) updates layer i while the GPU works on layer
    i-1. Also: the CPUs' split between that thread and the main one, clipping, the lr schedule.
What it is not
    Not a torch.optim.Optimizer: a unit's [matrices | vectors] layout makes "decay" and "no decay"
    two contiguous regions, so a step is two kernel calls. It imports nothing of this project;
    megatrain_min/checks.py says what a hyper-parameter may be.
Reference
    torch.optim.AdamW(fused=True), two parameter groups (decay on tensors with >= 2 dims):
    tests/test_optim.py checks equality over 10 steps; bench/adamw_cpu.py compares speed.
Framework internal: torch._fused_adamw_ (AdamW(fused=True)'s kernel) updates params, m and v in
place, reads the step tensor; its grad_scale divides the gradient: 1/clip_coef clips in the pass.
"""
import math
import mmap
import os
import queue
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1   # the library's defaults (one home)
TILE = 1 << 23   # elements per AdamW call: a tile's p g m v and shadow (144 MB) stay in a big L3


class HostAdamW:
    def __init__(self, sizes, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                 pinned=None, shadow_dtype=None, grad_store=True, slabs=0, pool=None):
        """sizes: [(numel, n_decay)] per unit -- the first n_decay elements are decayed.
        shadow_dtype: keep a copy of the master in this dtype (the one the GPU computes in),
        refreshed after every step; None when the engine streams the fp32 master itself.
        grad_store: an fp32 gradient buffer per unit (4 B/param). Without it grad[u] is None but
        while a slab is lent to it (lend): `slabs` buffers of the largest unit, in `pool`.
        pinned(n, dtype): n page-locked zeros (stream.Lanes.pinned), for the buffers that cross the
        link: gradients, the shadow, else the master; m and v never do. None: nothing pinned."""
        self.sizes, self.lr, self.betas, self.eps, self.wd = [*sizes], lr, betas, eps, weight_decay
        self.pinned_bytes, zeros = 0, lambda n, dtype=torch.float32: torch.zeros(n, dtype=dtype)

        def link(n, dtype=torch.float32):  # a buffer a copy engine reads or writes
            self.pinned_bytes += n * dtype.itemsize if pinned else 0
            return (pinned or zeros)(n, dtype)
        self.master = [(zeros if shadow_dtype else link)(n) for n, _ in self.sizes]   # fp32 master
        self.m = [zeros(n) for n, _ in self.sizes]      # fp32 Adam first moment
        self.v = [zeros(n) for n, _ in self.sizes]      # fp32 Adam second moment
        self.grad = [link(n) if grad_store else None for n, _ in self.sizes]   # fp32, from the D2H
        self.shadow = [link(n, shadow_dtype) for n, _ in self.sizes] if shadow_dtype else None
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in self.sizes]   # as torch does
        self.pool, self.lent = pool if pool is not None else queue.Queue(), {}   # unit -> its slab
        for _ in range(0 if grad_store else slabs):
            self.pool.put(link(max(n for n, _ in self.sizes)))

    def lend(self, u):  # point grad[u] at a free slab, waiting until one is given back
        self.lent[u] = self.pool.get()
        self.grad[u] = self.lent[u][:self.sizes[u][0]]

    def give_back(self, u):
        self.grad[u] = None
        self.pool.put(self.lent.pop(u))

    def nbytes(self):  # host bytes the store holds: master, m, v, per-unit gradients, shadow
        held = self.master + self.m + self.v + [g for g in self.grad if g is not None]
        return sum(t.numel() * t.element_size() for t in held + (self.shadow or []))

    def state(self, u):
        """{"master", "m", "v"} of unit u: the store's tensors (no copy): a checkpoint."""
        return {"master": self.master[u], "m": self.m[u], "v": self.v[u]}

    def step_count(self, u): return int(self.steps[u])
    def set_step_count(self, u, n): self.steps[u].fill_(n)

    def reset(self):
        """Forget the optimizer's history (m, v and the step counts); the master weights stay."""
        for u in range(len(self.sizes)):
            self.m[u].zero_(), self.v[u].zero_(), self.steps[u].zero_()

    def refresh_shadow(self, u):
        if self.shadow is not None:
            self.shadow[u].copy_(self.master[u])

    def step(self, u, lr=None, clip_coef=1.0):
        """AdamW on unit u with the gradient in grad[u] multiplied by clip_coef, in tiles of TILE
        elements, each tile's shadow written while the tile is in cache: one pass over the unit's
        memory. The kernel writes the scaled gradient back: grad[u] then holds the clipped one."""
        n, n_decay = self.sizes[u]
        p, g, m, v, step = self.master[u], self.grad[u], self.m[u], self.v[u], self.steps[u]
        step += 1
        scale = None if clip_coef == 1.0 else torch.tensor(1.0 / clip_coef, dtype=torch.float32)
        for lo, hi, wd in ((0, n_decay, self.wd), (n_decay, n, 0.0)):  # [matrices | vectors]
            for a, b in ((a, min(a + TILE, hi)) for a in range(lo, hi, TILE)):
                torch._fused_adamw_([pt := p[a:b]], [g[a:b]], [m[a:b]], [v[a:b]], [], [step],
                                    lr=self.lr if lr is None else lr, beta1=self.betas[0],
                                    beta2=self.betas[1], weight_decay=wd, eps=self.eps,
                                    amsgrad=False, maximize=False, grad_scale=scale)
                if self.shadow is not None:  # the bf16 copy the GPU streams, from cache
                    self.shadow[u][a:b].copy_(pt)

    def grad_sq(self, u):  # squared L2 norm of unit u's gradient; the global norm: sqrt of the sum
        return float(torch.dot(self.grad[u], self.grad[u]))


def page_locked(n, dtype=torch.float32):
    """n zeros of dtype in host memory page-locked with CUDA (copies to and from it are DMA):
    pages of its own, cudaHostRegister'ed, unregistered just before they are freed: its size, where
    pin_memory=True rounds each block up to a power of two (torch 2.11: a 7b store 1.31x)."""
    size = max(1, -(-n * dtype.itemsize // mmap.PAGESIZE)) * mmap.PAGESIZE
    raw = np.zeros(size + mmap.PAGESIZE, dtype=np.uint8)           # numpy owns (and frees) it
    mem = raw[-raw.ctypes.data % mmap.PAGESIZE:][:size]            # page-aligned: no page shared
    err = int((cudart := torch.cuda.cudart()).cudaHostRegister(mem.ctypes.data, size, 0))
    if err:
        raise MemoryError(f"CUDA could not page-lock {size / 1e9:.2f} GB of host memory (cudaError "
                          f"{err}); free host memory, raise `ulimit -l`, or plan a smaller run")
    weakref.finalize(raw, cudart.cudaHostUnregister, mem.ctypes.data).atexit = False   # numpy
    return torch.from_numpy(mem).view(dtype)[:n]   # runs finalizers before it frees the memory


def cpu_threads(cuda, procs=1):
    """(main, optimizer): OpenMP threads of the thread running the steps and of the optimizer
    thread, adding up to this process's share of its CPUs (affinity mask / `procs` on the host):
    two teams each spanning every core spin in each other's way, 10x slower. With CUDA the main
    thread keeps two (it issues kernels), AdamW the rest; on the CPU AdamW gets a quarter."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (usable or 1) // procs)                     # (macOS has no affinity mask)
    worker = max(1, share - 2) if cuda else max(1, share // 4)
    return max(1, share - worker), worker


def worker(threads, device=None):
    """The optimizer thread: one thread with an OpenMP team of `threads` and `device` current (per
    thread: else its first CUDA call, an event wait, would make a context on GPU 0). device: an
    indexed torch.device (stream.resolve_device): torch.cuda.set_device refuses "cuda" alone."""
    def init():
        torch.set_num_threads(threads)
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
    return ThreadPoolExecutor(1, "adamw", initializer=init)


def clip_coef(total_norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1; 0 = off."""
    return 1.0 if not max_norm or max_norm <= 0 else min(1.0, max_norm / (total_norm + 1e-6))


def lr_at(step, max_lr, total_steps, warmup=0, min_ratio=0.1):
    """Linear warmup to max_lr over `warmup` steps, then cosine decay to min_ratio * max_lr at
    total_steps. step counts from 0 (the first update uses lr_at(0))."""
    if warmup and step < warmup:
        return max_lr * (step + 1) / warmup
    if total_steps <= warmup:
        return max_lr
    t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return max_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
