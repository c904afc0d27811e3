"""lion.py -- the Lion update rule: one moment instead of AdamW's two (4 B/param less host memory).

What it is
    Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023, Algorithm 2), as an
    update rule the store runs (optim.HostStore(rule=Lion()); train.py --optimizer lion): per
    parameter one fp32 moment m; for a gradient g,
        c = beta1 * m + (1 - beta1) * g          the interpolation whose sign is the update
        p = p - lr * (sign(c) + weight_decay * p)
        m = beta2 * m + (1 - beta2) * g
    Every update has the same size per element (lr), so the paper advises a learning rate 3-10x
    below AdamW's and a weight decay 3-10x above it (the same lr * weight_decay).
    A rule is this much: the names of its per-parameter state, and update() on one region of a
    unit's flat buffers, in place, on whatever device they are on. The store, the engine, the
    checkpoints and the GPU-updated units follow from `state`; the planner counts 4 B/param of
    state per name.
What it is not
    Not torch.optim (there is no Lion in torch); tests/core/test_optim.py checks it against a plain
    PyTorch Lion written from the paper, and the engine against that in a whole-model reference.
"""
import torch

BETAS = (0.9, 0.99)   # the paper's defaults


class Lion:
    state = ("m",)

    def __init__(self, betas=BETAS):
        self.betas = betas

    def update(self, p, g, state, step, lr, weight_decay, grad_scale=None, found_inf=None):
        """One region in place (optim.AdamW.update's arguments; step unused). found_inf: a device
        flag, 1.0 leaves p and m as they were (on a GPU, without a host sync)."""
        m = state["m"]
        beta1, beta2 = self.betas
        if grad_scale is not None:      # the clip factor, as torch's fused kernels take it
            g.div_(grad_scale)
        before = (p.clone(), m.clone()) if found_inf is not None else None
        c = m.mul(beta1).add_(g, alpha=1 - beta1).sign_()
        p.mul_(1 - lr * weight_decay).sub_(c.mul_(lr))
        m.mul_(beta2).add_(g, alpha=1 - beta2)
        if before is not None:          # a gradient not finite: both put back as they were
            skip = found_inf.bool()
            p.copy_(torch.where(skip, before[0], p))
            m.copy_(torch.where(skip, before[1], m))
