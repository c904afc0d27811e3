"""optim.py -- the host store, the update rule (AdamW) and the thread the host's updates run on.

What it is
    HostStore keeps, for every unit (the embedding, each layer, the head), flat buffers: the fp32
    master, the rule's state (AdamW: m and v, fp32), the fp32 gradient (per unit, or slabs lent to
    one unit at a time), and with bf16 compute a bf16 shadow of the master, which is what crosses
    the link. What a copy engine reads or writes is page-locked (pinned_zeros; exact-size:
    megatrain_min/engine/pinned.py, handed in through stream.Lanes(pinned=)). A unit's home (the
    object the engine keeps for it: stream.Streamed, megatrain_min's resident and gpu_update) says
    which of its buffers live on the GPU and which cross the link; the store allocates accordingly.
    step(u) runs the rule on one unit, a region at a time ([matrices | vectors]: decayed or not),
    in tiles, on Worker, the optimizer thread, while the GPU works on.
    The rule is handed in: AdamW here (torch's fused kernel); megatrain_min/engine/lion.py is a
    second one. A rule names its per-parameter state and updates one region's flat buffers in place.
The shadow is never stale
    Every write of a master rewrites its shadow: step() (each tile's shadow from the cache),
    refresh_shadow() after any other write (filling the store, loading a checkpoint), and
    gpu_update.py's copy back. Nothing else writes a master: Trainer.weights() hands out copies,
    and code that writes master[u] itself (a checkpoint's load) calls refresh_shadow(u) after it.
What it is not
    A torch.optim.Optimizer ([matrices | vectors]: two regions, two calls). Imports nothing of ours.
Reference
    torch.optim.AdamW(fused=True), its kernel: equal (tests/core/test_optim.py); bench/adamw_cpu.py.
"""
import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor

import torch

# the library's defaults (one home)
LR = 3e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
TILE = 1 << 22   # elements per update call: a tile's p, g, m, v and shadow (72 MB) stay in the L3


class AdamW:
    """The update rule: torch's fused AdamW kernel (what torch.optim.AdamW(fused=True) runs)."""
    state = ("m", "v")   # per parameter, fp32: the first and second moments

    def __init__(self, betas=BETAS, eps=EPS):
        self.betas, self.eps = betas, eps

    def update(self, p, g, state, step, lr, weight_decay, grad_scale=None, found_inf=None):
        """One region in place. p, g and each state tensor: views of one device's fp32 buffers;
        step: the unit's step count, already counted; grad_scale: g is divided by it (and written
        back so); found_inf: a device flag, 1.0 skips the update (no host sync)."""
        torch._fused_adamw_([p], [g], [state["m"]], [state["v"]], [], [step], lr=lr,
                            beta1=self.betas[0], beta2=self.betas[1], weight_decay=weight_decay,
                            eps=self.eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
                            found_inf=found_inf)


class HostStore:
    def __init__(self, sizes, rule=None, lr=LR, weight_decay=WEIGHT_DECAY, pinned=None,
                 shadow_dtype=None, grad_store=True, slabs=0, pool=None, homes=None,
                 on_device=None):
        """sizes: [(numel, n_decay)] per unit, the first n_decay elements decayed. rule: AdamW()
        unless given. shadow_dtype: a copy of the master in the GPU's dtype, streamed instead of
        the master (None: the master is streamed). grad_store: an fp32 gradient per unit; else
        grad[u] is None but while one of `slabs` slabs (waiting in `pool`) is lent to it.
        pinned(n, dtype): page-locked zeros, for what a copy engine reads or writes. homes: per
        unit, its home: kept_on_device, the names of the buffers it keeps on the GPU (made by
        on_device(n, dtype)), and crossing, those the link copies besides the gradient and what
        streams. None: every unit streamed and updated on the host (stream.Streamed)."""
        self.sizes = list(sizes)
        self.rule = rule if rule is not None else AdamW()
        self.lr, self.wd = lr, weight_decay
        self.pinned_bytes = 0
        streamed = "master" if shadow_dtype is None else "shadow"

        def place(u, what):   # where unit u's buffer `what` lives: "gpu", "pinned" or "host"
            home = homes[u] if homes is not None else None
            if home is not None and what in home.kept_on_device:
                return "gpu"
            crossing = {"grad", streamed, *(home.crossing if home is not None else ())}
            return "pinned" if pinned is not None and what in crossing else "host"

        def buf(where, n, dtype=torch.float32):
            if where == "gpu":
                return on_device(n, dtype)
            if where == "pinned":
                self.pinned_bytes += n * dtype.itemsize
                return pinned(n, dtype=dtype)
            return torch.zeros(n, dtype=dtype)

        units = range(len(self.sizes))
        self.where = [{what: place(u, what) for what in ("master", "state", "shadow", "grad",
                                                         "step")} for u in units]
        self.master = [buf(self.where[u]["master"], self.sizes[u][0]) for u in units]
        # the rule's state: {name: [one buffer per unit]}, e.g. state["m"][u]
        self.state = {s: [buf(self.where[u]["state"], self.sizes[u][0]) for u in units]
                      for s in self.rule.state}
        # the shadow: of the units whose master stays off the GPU (a resident one's is cast there)
        self.shadow = [None] * len(self.sizes)
        for u in units:
            if shadow_dtype is not None and self.where[u]["master"] != "gpu":
                self.shadow[u] = buf(self.where[u]["shadow"], self.sizes[u][0], shadow_dtype)
        # fp32 gradients, the D2H's destination: a store, kept on the GPU, or slabs (lend)
        kept = [grad_store or self.where[u]["grad"] == "gpu" for u in units]
        self.grad = [buf(self.where[u]["grad"], self.sizes[u][0]) if kept[u] else None
                     for u in units]
        # each unit's step count, a tensor as torch.optim keeps it
        self.steps = [buf(self.where[u]["step"], 1)[0] for u in units]
        self.pool = pool if pool is not None else queue.Queue()
        self.lent = {}   # unit -> the slab its gradient is in
        slab = max((self.sizes[u][0] for u in units if not kept[u]), default=1)
        for _ in range(0 if grad_store else slabs):
            self.pool.put(buf("pinned" if pinned is not None else "host", slab))

    def lend(self, u):
        """Point grad[u] at a free slab, waiting until one is given back."""
        self.lent[u] = self.pool.get()
        self.grad[u] = self.lent[u][:self.sizes[u][0]]

    def give_back(self, u):
        self.grad[u] = None
        self.pool.put(self.lent.pop(u))

    def nbytes(self, gpu=False):
        """The units' buffers in host memory (gpu=True: on the GPU); lent slabs not counted."""
        bufs = [("master", self.master), ("shadow", self.shadow), ("grad", self.grad),
                *(("state", b) for b in self.state.values())]
        return sum(t.nbytes for what, per_unit in bufs for u, t in enumerate(per_unit)
                   if t is not None and u not in self.lent and
                   (self.where[u][what] == "gpu") == gpu)

    def streamed(self, u):
        """What the engine copies into a weight slot: the shadow, else the master."""
        return self.master[u] if self.shadow[u] is None else self.shadow[u]

    def tensors(self, u):
        """{"master", *the rule's state}: unit u's tensors as the store holds them (checkpoints)."""
        return {"master": self.master[u], **{s: self.state[s][u] for s in self.rule.state}}

    def reset(self):
        """Forget the optimizer's history (its state, the step counts); the master stays."""
        torch._foreach_zero_([t for per_unit in self.state.values() for t in per_unit])
        torch._foreach_zero_(self.steps)

    def refresh_shadow(self, u):
        """The shadow from the master, after the master was written otherwise than by step()."""
        if self.shadow[u] is not None:
            self.shadow[u].copy_(self.master[u])

    def step(self, u, lr=None, coef=1.0, on=None, found_inf=None):
        """The rule on unit u, its gradient grad[u] times coef, a region at a time ([matrices
        | vectors]) in tiles of TILE (each tile's shadow written from the cache: one pass). on:
        copies of tensors(u) on the GPU to update there instead (gpu_update.py), one call per
        region; found_inf: a device flag that skips the update (the step count too)."""
        n, n_decay = self.sizes[u]
        g, step = self.grad[u], self.steps[u]
        tensors = on or self.tensors(u)
        p = tensors["master"]
        step += 1
        scale = None
        if coef != 1.0:   # the fused kernel divides the gradient by it
            scale = torch.full((), 1.0 / coef, device=p.device)
        on_gpu = on is not None or self.where[u]["master"] == "gpu"
        tile = n if on_gpu else TILE   # on the GPU: one call per region
        for lo, hi, wd in ((0, n_decay, self.wd), (n_decay, n, 0.0)):
            for a in range(lo, hi, tile):
                b = min(a + tile, hi)
                tile_state = {s: tensors[s][a:b] for s in self.rule.state}
                self.rule.update(p[a:b], g[a:b], tile_state, step, self.lr if lr is None else lr,
                                 wd, grad_scale=scale, found_inf=found_inf)
                if on is None and self.shadow[u] is not None:
                    self.shadow[u][a:b].copy_(p[a:b])
        if found_inf is not None:   # as torch.optim does: a skipped step is not counted
            step -= found_inf

    def grad_sq(self, u):
        """Unit u's squared gradient norm: a float, or -- its gradient on the GPU -- a 0-d tensor
        there (read once its lane got there: no host sync now)."""
        sq = torch.dot(self.grad[u], self.grad[u])
        return sq if self.where[u]["grad"] == "gpu" else float(sq)


def pinned_zeros(n, dtype=torch.float32):
    """n zeros in page-locked host memory (DMA copies), from torch's pinned allocator, which rounds
    each block up to a power of two (megatrain_min.engine.pinned.page_locked: exactly n)."""
    return torch.zeros(n, dtype=dtype, pin_memory=True)


def resolve_device(device=None):
    """The device to train on, indexed: "cuda" -> the current cuda:N."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev == torch.device("cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def thread_split(share, cuda):
    """(the main thread's OpenMP team, the optimizer thread's), of `share` CPUs. With CUDA the main
    thread only issues work: it keeps two, the update rule gets the rest. On the CPU the main thread
    computes the step: it keeps every CPU, and the optimizer thread, whose work is small next to the
    step's (bench/cpu_threads.py measures both cases), runs a quarter of them beside it."""
    if cuda:
        n = max(1, share - 2)
        return max(1, share - n), n
    return share, max(1, share // 4)


class Worker(ThreadPoolExecutor):
    """The optimizer thread, `device` current, its OpenMP team and the main thread's (threads) split
    from this process's share of its CPUs (affinity mask / `procs`) by thread_split. Of the tasks
    whose input landed (event `ready`) it runs the one the next forward needs first."""
    def __init__(self, device, procs=1):
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None  # macOS
        share = max(1, (usable or os.cpu_count() or 1) // procs)
        cuda = device.type == "cuda"
        self.threads = thread_split(share, cuda)
        self.todo = []   # the tasks, oldest first: (Future, need, ready, fn, args)

        def start():
            torch.set_num_threads(self.threads[1])
            if cuda:
                torch.cuda.set_device(device)
        super().__init__(1, "optimizer", start)

    def submit(self, fn, *args, need=0, ready=None):
        """A Future of fn(*args): run when its turn comes (run_best)."""
        fut = Future()
        self.todo.append((fut, need, ready, fn, args))   # a list's append is atomic
        super().submit(self.run_best)                    # one run per task: the best one then
        return fut

    def run_best(self):
        """Run one task: of those whose input landed, the first of the least need; none landed:
        the oldest. `ready` only ranks them: each task waits for its own input."""
        tasks = list(self.todo)
        try:
            landed = [t for t in tasks if t[2] is None or t[2].query()] or tasks[:1]
        except RuntimeError:   # a CUDA error: the oldest runs, and its own wait raises it
            landed = tasks[:1]
        task = min(landed, key=lambda t: t[1])
        self.todo.remove(task)   # (Futures compare by identity)
        fut, _, _, fn, args = task
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 -- raised where its result is asked for
            fut.set_exception(e)


def clip_coef(total_norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1; 0 = off."""
    if not max_norm or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
