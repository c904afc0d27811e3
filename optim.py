"""optim.py -- the pinned host store, a per-unit CPU AdamW and the thread it runs on.

What it is
    HostAdamW keeps, for every unit (the embedding, each layer, the head), flat buffers in host
    memory: fp32 master, Adam m and v, gradients (per unit, or slabs lent to one unit at a time),
    with bf16 compute a bf16 shadow to stream; what crosses the link page-locked (page_locked).
    step(u) updates one unit by torch's fused AdamW on Worker, the optimizer thread, while the GPU
    works on (a unit whose gradient stays on the GPU: there). Also: the CPUs' threads, clipping.
What it is not
    A torch.optim.Optimizer ([matrices | vectors]: two regions, two calls). Imports nothing of ours.
Reference
    torch.optim.AdamW(fused=True), its kernel: equal (tests/test_optim.py); bench/adamw_cpu.py.
"""
import mmap
import os
import queue
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch


LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1   # the library's defaults (one home)
TILE = 1 << 22   # elements per AdamW call: a tile's p g m v and shadow (72 MB) stay in the L3


class HostAdamW:
    def __init__(self, sizes, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                 pinned=None, shadow_dtype=None, grad_store=True, slabs=0, pool=None,
                 resident=(), on_device=None, gpu_updated=()):
        """sizes: [(numel, n_decay)] per unit, the first n_decay elements decayed. shadow_dtype: a
        copy of the master in the GPU's dtype, written by every step (None: stream the master).
        grad_store: an fp32 gradient per unit; else grad[u] is None but while a slab (of `slabs` in
        `pool`) is lent to it. pinned(n, dtype): page-locked zeros, for what crosses the link. On
        the GPU (on_device(n, dtype)): resident units whole (master, m, v, gradient); gpu_updated
        units' gradient and step count (their master, m, v cross for step's `on`)."""
        self.sizes, self.lr, self.betas, self.eps, self.wd = [*sizes], lr, betas, eps, weight_decay
        self.resident, self.gpu_updated = set(resident), set(gpu_updated or ())
        self.pinned_bytes, self.on_gpu = 0, self.resident | self.gpu_updated   # their grads there

        def buf(u, n, dtype=torch.float32, crosses=False, gpu=False):  # crosses: a copy engine
            if u in self.resident or gpu:
                return on_device(n, dtype)
            self.pinned_bytes += n * dtype.itemsize if pinned and crosses else 0
            return (pinned if pinned and crosses else torch.zeros)(n, dtype=dtype)
        us = [(u, n) for u, (n, _) in enumerate(self.sizes)]
        self.master = [buf(u, n, crosses=not shadow_dtype or u in self.gpu_updated) for u, n in us]
        self.m, self.v = ([buf(u, n, crosses=u in self.gpu_updated) for u, n in us] for _ in "mv")
        self.grad = [buf(u, n, crosses=True, gpu=u in self.gpu_updated) if grad_store or
                     u in self.on_gpu else None for u, n in us]    # fp32, from the D2H
        self.shadow = [None if u in self.resident else buf(u, n, shadow_dtype, True)
                       for u, n in us] if shadow_dtype else None
        self.steps = [buf(u, 1, gpu=u in self.gpu_updated)[0] for u, _ in us]   # as torch.optim's
        self.pool, self.lent = pool if pool is not None else queue.Queue(), {}   # unit -> its slab
        big = max((n for u, n in us if u not in self.on_gpu), default=1)   # host-updated units'
        for _ in range(0 if grad_store else slabs):
            self.pool.put(buf(-1, big, crosses=True))

    def lend(self, u):  # point grad[u] at a free slab, waiting until one is given back
        self.lent[u] = self.pool.get()
        self.grad[u] = self.lent[u][:self.sizes[u][0]]

    def give_back(self, u):
        self.grad[u] = None
        self.pool.put(self.lent.pop(u))

    def nbytes(self, resident=False):  # the units' state on the host (resident=True: the GPU's)
        held = zip(self.master, self.m, self.v, self.grad, self.shadow or [None] * len(self.sizes))
        return sum(t.nbytes for u, ts in enumerate(held) for i, t in enumerate(ts) if t is not None
                   and (u in self.resident or i == 3 and u in self.gpu_updated) == resident)

    def streamed(self, u):  # what the engine copies into a slot: the shadow, else the master
        return self.master[u] if self.shadow is None or self.shadow[u] is None else self.shadow[u]

    def state(self, u):  # {"master", "m", "v"} of unit u, the store's own tensors: a checkpoint
        return {"master": self.master[u], "m": self.m[u], "v": self.v[u]}

    def reset(self):  # forget the optimizer's history (m, v, the step counts); the master stays
        torch._foreach_zero_(self.m + self.v + self.steps)

    def refresh_shadow(self, u):  # the shadow from the master (after it was written otherwise)
        self.shadow and self.shadow[u] is not None and self.shadow[u].copy_(self.master[u])

    def step(self, u, lr=None, clip_coef=1.0, on=None):
        """AdamW on unit u, its gradient grad[u] times clip_coef (written back so), in tiles of TILE
        (each one's shadow written from cache: one pass). on: GPU (master, m, v): one call."""
        (n, n_decay), g, step = self.sizes[u], self.grad[u], self.steps[u]
        p, m, v = on or (self.master[u], self.m[u], self.v[u])
        step += 1
        scale = None if clip_coef == 1.0 else torch.full((), 1.0 / clip_coef, device=p.device)
        tile = n if u in self.on_gpu else TILE   # on the GPU: one call per region
        for lo, hi, wd in ((0, n_decay, self.wd), (n_decay, n, 0.0)):  # [matrices | vectors]
            for a, b in ((a, min(a + tile, hi)) for a in range(lo, hi, tile)):
                torch._fused_adamw_([pt := p[a:b]], [g[a:b]], [m[a:b]], [v[a:b]], [], [step],
                                    lr=self.lr if lr is None else lr, beta1=self.betas[0],
                                    beta2=self.betas[1], weight_decay=wd, eps=self.eps,
                                    amsgrad=False, maximize=False, grad_scale=scale)
                if on is None and self.shadow is not None and self.shadow[u] is not None:
                    self.shadow[u][a:b].copy_(pt)

    def grad_sq(self, u):  # unit u's squared gradient norm (one on the GPU: a GPU scalar)
        sq = torch.dot(self.grad[u], self.grad[u])
        return sq if u in self.on_gpu else float(sq)


def page_locked(n, dtype=torch.float32):
    """n zeros of dtype page-locked with CUDA (DMA copies), its own pages cudaHostRegister'ed: its
    size, where pin_memory=True rounds each block up to a power of two (a 7b store: 1.31x)."""
    size = max(1, -(-n * dtype.itemsize // mmap.PAGESIZE)) * mmap.PAGESIZE
    raw = np.zeros(size + mmap.PAGESIZE, dtype=np.uint8)           # numpy owns (and frees) it
    mem = raw[-raw.ctypes.data % mmap.PAGESIZE:][:size]            # page-aligned: no page shared
    err = int((cudart := torch.cuda.cudart()).cudaHostRegister(mem.ctypes.data, size, 0))
    if err:
        raise MemoryError(f"CUDA could not page-lock {size / 1e9:.2f} GB of host memory (cudaError"
                          f" {err}); free host memory, raise `ulimit -l`, or plan a smaller run")
    weakref.finalize(raw, cudart.cudaHostUnregister, mem.ctypes.data).atexit = False   # numpy
    return torch.from_numpy(mem).view(dtype)[:n]   # runs finalizers before it frees the memory


def resolve_device(device=None):  # the device to train on, indexed: "cuda" -> the current cuda:N
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return torch.device("cuda", torch.cuda.current_device()) if dev == torch.device("cuda") else dev


class Worker(ThreadPoolExecutor):
    """The optimizer thread, `device` current. threads: OpenMP teams (the main thread's, its own)
    adding up to this process's share of its CPUs (affinity mask / `procs`; two teams on all cores
    spin in each other's way): with CUDA the main thread keeps two, on the CPU AdamW a quarter. Of
    the tasks whose input landed (event `ready`) it runs the one the next forward needs first."""
    def __init__(self, device, procs=1):
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None  # macOS
        share, cuda = max(1, (usable or os.cpu_count() or 1) // procs), device.type == "cuda"
        n = max(1, share - 2) if cuda else max(1, share // 4)
        self.threads, self.todo = (max(1, share - n), n), []   # todo: the tasks, oldest first
        super().__init__(1, "adamw", lambda: (torch.set_num_threads(n),
                                              cuda and torch.cuda.set_device(device)))

    def submit(self, fn, *args, need=0, ready=None):   # a Future of fn(*args)
        self.todo.append((fut := Future(), need, ready, fn, args))   # (a list's ops are atomic)
        super().submit(self.run_best)                  # one run per task: the best one then
        return fut

    def run_best(self):  # fn waits for its own input: `ready` only ranks the tasks
        tasks = list(self.todo)                     # [(Future, need, ready, fn, args)]
        try:   # of the landed, the first of the least need; none landed: the oldest
            landed = [t for t in tasks if t[2] is None or t[2].query()] or tasks[:1]
        except RuntimeError:   # a CUDA error: the oldest runs, and its own wait raises it
            landed = tasks[:1]
        self.todo.remove(task := min(landed, key=lambda t: t[1]))   # (Futures compare by identity)
        fut, _, _, fn, args = task
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 -- raised where its result is asked for
            fut.set_exception(e)


def clip_coef(total_norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1; 0 = off."""
    return 1.0 if not max_norm or max_norm <= 0 else min(1.0, max_norm / (total_norm + 1e-6))
