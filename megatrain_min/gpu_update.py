"""gpu_update.py -- streamed units updated on the GPU: their AdamW moved off the host's memory bus.

What it is
    GpuUpdates(n), handed to stream.Trainer(gpu_updates=): n of the streamed units (spread evenly
    over the next forward's order; never the embedding, whose rows are gathered on the host) keep
    their fp32 gradient and step count on the GPU (optim.HostAdamW(gpu_updated=): 4 B/param there).
    Their master, m and v stay in host memory, page-locked. Each update (step) is three copies and a
    kernel, issued where the engine issues a resident unit's (the main thread, the H2D lane):

        H2D   master, m, v -> scratch[k]          (after scratch[k]'s last D2H)
        H2D   torch's fused AdamW on scratch[k], the gradient in place; fast: cast to the shadow
        D2H   master, m, v (+ shadow) -> host     (after the kernel): `landed[u]`, `free[k]`

    The next copy of u into a weight slot waits for landed[u] (Trainer.load_unit). Two scratches
    alternate, so one unit's D2H overlaps the next one's H2D: each direction of the link carries
    12 B/param (14 with the shadow) and the host's DRAM only the DMA. The optimizer thread updates
    the other units meanwhile; the host's AdamW moves 28-34 B/param through DRAM, so where it is
    the bottleneck -- clipping, when every update waits for the global norm -- sharing the updates
    between the two shortens the step (the plan picks n: plan.timing).
What it is not
    Not a resident unit (16 B/param on the GPU, nothing crosses); not sharded (one process). Not a
    new arithmetic: torch's fused AdamW on the same fp32 values -- on the CPU the host-updated
    engine's very bits (tests/test_stream.py); on a GPU the CUDA kernel, and the unit's squared norm
    a cuBLAS dot, equal to the reference within the central test's tolerances (tests/test_gpu.py).
"""
import torch


def chosen(order, resident_units, embed, n):
    """The rule (the engine's and the planner's): of the units of `order` (the next forward's) after
    the first resident_units, the embedding aside, n spread evenly -- the host and the GPU then
    take turns along the forward, each unit the forward waits for done by one of them."""
    streamed = [u for u in order[resident_units:] if u != embed]
    n = min(n, len(streamed))
    return [streamed[i * len(streamed) // n] for i in range(n)]


class GpuUpdates:
    def __init__(self, n):
        """n: how many streamed units are updated on the GPU (0: none)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError("gpu_updated_units must be an integer >= 0 (streamed units updated "
                             f"on the GPU), got {n!r}")
        self.n, self.trainer, self.turn = n, None, 0
        self.landed, self.free = {}, [None, None]   # unit -> its D2H's event; scratch k's
        self.scratch, self.low = [], []              # per scratch: master, m, v; the shadow's

    def place(self, trainer, resident_units, shadow):
        """The units (of trainer.order after the resident ones, the embedding aside), evenly
        spread; their scratches made (master, m, v fp32 + the shadow's dtype). Called by the
        engine before its store exists."""
        if self.trainer is not None and self.trainer is not trainer:
            raise ValueError("a GpuUpdates serves one trainer: hand each Trainer its own")
        self.trainer = t = trainer
        units = chosen(t.order, resident_units, t.embed, self.n)
        n, big = len(units), max((t.units[u].numel for u in units), default=0)
        with t.h2d():   # made on the lane that writes them first (never freed)
            self.scratch = [torch.empty(3 * big, device=t.dev) for _ in range(2 if n else 0)]
            self.low = [torch.empty(big, dtype=shadow, device=t.dev)
                        for _ in range(2 if n and shadow else 0)]
        return units

    def buffers(self):  # {name: GPU buffer}: what the stream checker's reports call them
        return {f"{what}[{k}]": b for what in ("scratch", "low")
                for k, b in enumerate(getattr(self, what))}

    def step(self, u, lr, clip_coef=1.0):
        """Unit u's AdamW: on the GPU if it is one of ours (issued on H2D), else the store's."""
        t = self.trainer
        if u not in t.opt.gpu_updated:
            return t.opt.step(u, lr, clip_coef)
        k, self.turn = self.turn, 1 - self.turn
        n = t.units[u].numel
        host = [t.opt.master[u], t.opt.m[u], t.opt.v[u]]
        gpu = [self.scratch[k][i * n:(i + 1) * n] for i in range(3)]
        with t.h2d():
            t.h2d.wait(self.free[k])   # the scratch's last copies have left (u's own last D2H:
            #                            the forward's copy of u waited for it, earlier here)
            for dst, src in zip(gpu, host):
                dst.copy_(src, non_blocking=True)
            t.opt.step(u, lr, clip_coef, on=gpu)
            if self.low:                         # fast: the bf16 shadow, cast here
                host.append(t.opt.shadow[u])
                gpu.append(self.low[k][:n].copy_(gpu[0]))
            done = t.h2d.record()
        with t.d2h():
            t.d2h.wait(done)
            for dst, src in zip(host, gpu):
                dst.copy_(src, non_blocking=True)
            self.free[k] = self.landed[u] = t.d2h.record()
