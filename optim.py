"""optim.py -- the pinned host store and a per-unit CPU AdamW.

What it is
    HostAdamW keeps, for every unit of the model (the embedding, each layer, the head), flat buffers
    in host memory: the fp32 master weights, fp32 Adam m and v, an fp32 gradient buffer, and -- when
    the GPU computes in bf16 -- a bf16 shadow of the master that the engine streams to the GPU. The
    buffers are pinned when CUDA is present, so copies to and from the GPU are DMA, not staged.
    step(u) updates one unit with torch's fused CPU AdamW kernel, so a worker thread can update
    layer i while the GPU is still busy with layer i-1. Also here: global grad-norm clipping and the
    warmup + cosine learning-rate schedule, and check_hyper: the one home of what a hyper-parameter may be.
What it is not
    Not a torch.optim.Optimizer (no param groups, no state_dict of dicts): units are flat buffers and a
    unit's [matrices | vectors] layout makes "decay" and "no decay" two contiguous regions, so a step
    is exactly two kernel calls. It imports nothing of this project; any list of (numel, n_decay) works.
Reference
    torch.optim.AdamW(fused=True) with two parameter groups (decay on tensors with >= 2 dims).
    tests/test_optim.py checks equality over 10 steps; bench/adamw_cpu.py compares speed.

Framework internals: torch._fused_adamw_ is the private kernel behind AdamW(fused=True). It updates
params, m and v in place and reads (does not increment) the step tensor; torch.optim increments it
first, and so do we. Its grad_scale argument divides the gradient inside the kernel: we pass
1/clip_coef there, which applies clipping without an extra pass over the gradients.
"""
import math
import numbers

import torch


class HyperParameterError(ValueError):
    """A hyper-parameter no step can use; .name is the argument's name (train.py turns it into a flag)."""

    def __init__(self, name, msg):
        super().__init__(msg)
        self.name = name


def check_hyper(**hp):
    """Raise HyperParameterError naming the first of the given hyper-parameters that cannot train. Only those
    given are checked (set_lr checks lr alone). lr, weight_decay, grad_clip (0 = off): finite and >= 0 (a
    negative lr is gradient ascent, a negative grad_clip would silently turn clipping off); eps: finite and
    > 0 (with eps = 0 a gradient that is exactly zero, an unused embedding row, gives 0/0 = NaN); betas: two
    numbers in [0, 1) (beta2 = 1 divides by 1 - beta2**t = 0); micro_batches: a positive integer."""
    real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    for name, v in hp.items():
        if name in ("lr", "weight_decay", "grad_clip"):
            ok, want = real(v) and v >= 0, "a finite number >= 0"
        elif name == "eps":
            ok, want = real(v) and v > 0, "a finite number > 0"
        elif name == "betas":
            ok, want = isinstance(v, (tuple, list)) and len(v) == 2 and all(real(b) and 0 <= b < 1 for b in v), \
                "two numbers in [0, 1)"
        elif name == "micro_batches":
            ok, want = isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer"
        else:
            raise TypeError(f"check_hyper() got an unknown hyper-parameter {name!r}")
        if not ok:
            raise HyperParameterError(name, f"{name} must be {want}, got {v!r}")


class HostAdamW:
    def __init__(self, sizes, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 pin=False, shadow_dtype=None, grad_store=True):
        """sizes: [(numel, n_decay)] per unit -- the first n_decay elements are decayed.
        shadow_dtype: keep a copy of the master in this dtype (the one the GPU computes in), refreshed
        after every step; None when the engine streams the fp32 master itself.
        grad_store: keep an fp32 gradient buffer per unit (4 B/param). Without it grad[u] is None until
        the engine points it at a staging slab for the duration of one unit's update."""
        self.sizes, self.lr, self.betas, self.eps, self.wd = list(sizes), lr, betas, eps, weight_decay

        if pin:
            pin_exact_sizes()
        def buf(n, dtype=torch.float32):  # zeros: a fresh pinned page must not leak old data into m/v
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        self.master = [buf(n) for n, _ in self.sizes]   # fp32 master weights
        self.m = [buf(n) for n, _ in self.sizes]        # fp32 Adam first moment
        self.v = [buf(n) for n, _ in self.sizes]        # fp32 Adam second moment
        self.grad = [buf(n) if grad_store else None for n, _ in self.sizes]  # fp32, written by the engine's D2H
        self.shadow = [buf(n, shadow_dtype) for n, _ in self.sizes] if shadow_dtype else None
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in self.sizes]  # per unit, as torch keeps it

    def nbytes(self):
        """Host bytes the store holds: master, m, v, the per-unit gradients if kept, the shadow."""
        held = self.master + self.m + self.v + [g for g in self.grad if g is not None] + (self.shadow or [])
        return sum(t.numel() * t.element_size() for t in held)

    def state(self, u):
        """{"master", "m", "v": fp32 host tensor} of unit u: the store itself (no copy), what a checkpoint holds."""
        return {"master": self.master[u], "m": self.m[u], "v": self.v[u]}

    def step_count(self, u):
        return int(self.steps[u])

    def set_step_count(self, u, n):
        self.steps[u].fill_(n)

    def reset(self):
        """Forget the optimizer's history (m, v and the step counts); the master weights stay."""
        for u in range(len(self.sizes)):
            self.m[u].zero_(), self.v[u].zero_(), self.steps[u].zero_()

    def refresh_shadow(self, u):
        if self.shadow is not None:
            self.shadow[u].copy_(self.master[u])

    def step(self, u, lr=None, clip_coef=1.0, finite_only=False):
        """AdamW on unit u with the gradient in self.grad[u] multiplied by clip_coef. The kernel writes the
        scaled gradient back: after a clipped step, grad[u] holds the clipped gradient.
        finite_only: first check the gradient (one read pass, a sum: finite whenever every value is; only a
        non-finite sum is looked at element by element) and, when it holds a NaN or an infinity, change
        nothing -- master, m, v, step count -- and return False. With finite gradients and hyper-parameters
        (check_hyper) the update is finite: m/(sqrt(v)+eps) is bounded (short of gradients near the fp32 limit,
        where m itself overflows; checkpoint.save refuses non-finite master weights whatever the cause)."""
        lr = self.lr if lr is None else lr
        n, n_decay = self.sizes[u]
        p, g, m, v = self.master[u], self.grad[u], self.m[u], self.v[u]
        if finite_only and not math.isfinite(float(g.sum())) and not bool(torch.isfinite(g).all()):
            return False
        step = self.steps[u]
        step += 1
        scale = None if clip_coef == 1.0 else torch.tensor(1.0 / clip_coef, dtype=torch.float32)
        for lo, hi, wd in ((0, n_decay, self.wd), (n_decay, n, 0.0)):  # [matrices | vectors]
            if hi > lo:
                torch._fused_adamw_([p[lo:hi]], [g[lo:hi]], [m[lo:hi]], [v[lo:hi]], [], [step],
                                    lr=lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=wd,
                                    eps=self.eps, amsgrad=False, maximize=False, grad_scale=scale)
        self.refresh_shadow(u)
        return True

    def grad_sq(self, u):
        """Squared L2 norm of unit u's gradient (fp32); the global norm is sqrt of the sum over units."""
        g = self.grad[u]
        return float(torch.dot(g, g))


def pin_exact_sizes(threshold_mb=64):
    """Framework internal (ATen/core/CachingHostAllocator.h, torch 2.13): the pinned-memory allocator rounds
    every allocation up to a power of two, so a 5 GB unit would pin 8 GB and a 120B store would not fit in
    1.5 TB. Two settings keep buffers at their real size, safely:
    * pinned_max_round_threshold_mb: allocations above it are not rounded up;
    * pinned_max_cached_size_mb: allocations above it are given back to the OS when freed, not cached. The
      cache's free lists are log2 buckets and get_free_block hands out a bucket's last block without comparing
      sizes, so an unrounded 72 MiB block, once cached, could be handed to a 96 MiB request and overrun
      (upstream PR #192722). With both at the same value every cached block is an exact power of two.
    The setter replaces the whole allocator configuration, so ours is appended to what is set already
    (PYTORCH_ALLOC_CONF, or the user's own calls). tests/test_optim.py pins both behaviours."""
    ours = f"pinned_max_round_threshold_mb:{threshold_mb},pinned_max_cached_size_mb:{threshold_mb}"
    current = torch._C._accelerator_getAllocatorSettings()
    if not current.endswith(ours):
        torch._C._accelerator_setAllocatorSettings(f"{current},{ours}" if current else ours)


def clip_coef(total_norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1. max_norm 0 = off."""
    if not max_norm or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def lr_at(step, max_lr, total_steps, warmup=0, min_ratio=0.1):
    """Linear warmup to max_lr over `warmup` steps, then cosine decay to min_ratio * max_lr at total_steps.
    step counts from 0 (the first update uses lr_at(0))."""
    if warmup and step < warmup:
        return max_lr * (step + 1) / warmup
    if total_steps <= warmup:
        return max_lr
    t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return max_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
