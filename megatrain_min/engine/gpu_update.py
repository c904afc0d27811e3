"""gpu_update.py -- streamed units updated on the GPU: their update moved off the host's memory bus.

What it is
    GpuUpdated is the home (stream.Streamed's questions, other answers) of a streamed unit whose
    fp32 gradient and step count stay on the GPU (4 B/param there); its master and the rule's state
    stay in host memory, page-locked. Its weights stream as any unit's. Its update (update) is three
    copies and a kernel, issued where a resident unit's is (resident.run_on_h2d: the main thread,
    the H2D lane, once its gradient is in its buffer):

        H2D   master, state -> scratch[k]          (after scratch[k]'s last D2H: free[k])
        H2D   the rule on scratch[k], the gradient in place; fast: cast to the shadow
        D2H   master, state (+ shadow) -> host     (after the kernel): landed[u], free[k]

    The next copy of u into a weight slot waits for landed[u] (source_ready). Two scratches
    alternate, so one unit's D2H overlaps the next one's H2D: each direction of the link carries
    12 B/param with AdamW (14 with the shadow) and the host's DRAM only the DMA. The optimizer
    thread updates the other units meanwhile; the host's AdamW moves 28-34 B/param through DRAM, so
    where it is the bottleneck -- clipping, when every update waits for the global norm -- sharing
    the updates between the two shortens the step (the plan picks how many: plan.timing).
    Which units: chosen(), the one home of the rule, shared with the planner.
What it is not
    Not a resident unit (16 B/param on the GPU, nothing crosses); not sharded (one process). Not a
    new arithmetic: the same rule on the same fp32 values -- on the CPU the host-updated engine's
    very bits (tests/core/test_stream.py); on a GPU the CUDA kernel, and the unit's squared norm a
    cuBLAS dot, equal to the reference within the central test's tolerances
    (tests/engine/test_gpu.py).
"""
import torch

import stream
from megatrain_min.engine.resident import run_on_h2d


def chosen(order, resident_units, embed, n):
    """The rule (the engine's and the planner's): of the units of `order` (the next forward's) after
    the first resident_units, the embedding aside (its rows are gathered on the host), n spread
    evenly -- the host and the GPU then take turns along the forward, each unit the forward waits
    for done by one of them."""
    streamed = [u for u in order[resident_units:] if u != embed]
    n = min(n, len(streamed))
    return [streamed[i * len(streamed) // n] for i in range(n)]


class GpuUpdated(stream.Streamed):
    """Streamed as any unit (source, the embedding's methods: never this home's); updated on the
    GPU. One per trainer: it holds the two scratches its units share."""
    kept_on_device = ("grad", "step")
    crossing = ("master", "state", "shadow")   # to the scratch and back, page-locked

    def __init__(self, trainer, units):
        """units: the trainer's units it is the home of (their scratches sized for the largest)."""
        super().__init__(trainer)
        t = trainer
        big = max(t.units[u].numel for u in units)
        self.turn = 0
        self.landed = {}               # unit -> its D2H's event: its state is back on the host
        self.free = [None, None]       # scratch k -> its last D2H's event
        with t.h2d():                  # made on the lane that writes them first (never freed)
            n = (1 + len(t.rule.state)) * big          # the master and the rule's state
            self.scratch = [torch.empty(n, device=t.dev) for _ in range(2)]
            shadow = t.shadow_dtype is not None
            self.low = [torch.empty(big, dtype=t.dtype, device=t.dev) for _ in range(2 * shadow)]

    def buffers(self):
        """{name: GPU buffer}: what the stream checker's reports call them."""
        return {f"{what}[{k}]": b for what in ("scratch", "low")
                for k, b in enumerate(getattr(self, what))}

    def source_ready(self, u):
        return self.landed.get(u)      # its master (shadow) back from the last update

    def run(self, u, fn, *args, ready=None):
        return run_on_h2d(self.t, fn, args, ready)

    def update(self, u, lr, coef=1.0, guard=None):
        """Unit u's update on the GPU (see the module docstring); issued on H2D."""
        t = self.t
        k = self.turn
        self.turn = 1 - k
        n = t.units[u].numel
        host = t.opt.tensors(u)        # {"master", *the rule's state}: page-locked, host
        gpu = {what: self.scratch[k][i * n:(i + 1) * n] for i, what in enumerate(host)}
        found_inf = None if guard is None else guard.found_inf(t.opt.grad[u], t.units[u].name)
        with t.h2d():
            t.h2d.wait_event(self.free[k])   # the scratch's last copies have left (u's own last
            #                                  D2H: the forward's copy of u waited for it, earlier)
            for what, dst in gpu.items():
                dst.copy_(host[what], non_blocking=True)
            t.opt.step(u, lr, coef, on=gpu, found_inf=found_inf)
            if t.opt.shadow[u] is not None:          # fast: the shadow, cast here
                host["shadow"] = t.opt.shadow[u]
                gpu["shadow"] = self.low[k][:n].copy_(gpu["master"])
            done = t.h2d.record()
        with t.d2h():
            t.d2h.wait_event(done)
            for what, dst in host.items():
                dst.copy_(gpu[what], non_blocking=True)
            self.free[k] = self.landed[u] = t.d2h.record()
