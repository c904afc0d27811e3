"""activations.py -- where the boundary activations live: in pinned host memory, through a device
ring.

What it is
    The forward keeps every layer's input -- the boundary activations, L x (B, T, d) -- for the
    backward's recompute. stream.OnDevice keeps them on the device. HostRing sends each one to
    pinned host memory as it is made and brings it back just before its layer's backward, through
    RING device slots: the device holds two layers' worth, whatever the depth. The planner decides
    which (plan/memory.py: offload_needed); the engine is handed the store
    (stream.Trainer(activations=)).
The ring, on the lanes
    forward   compute copies layer i's inputs into ring slot i % 2 once that slot's last D2H is done
              (free), then D2H copies the slot to host row i (ready -> D2H, then free again)
    backward  H2D brings row i back into slot i % 2 once compute is done reading the slot (free),
              and compute waits for it (ready); row i-1 comes in while layer i computes
    Every wait is one line below; the stream checker (python -m megatrain_min.sim check
    --offload-activations on) proves the order, and each deleted wait is reported
    (tests/sim/test_sim.py).
Try it
    python train.py --offload-activations on --steps 20
"""
import torch

RING = 2   # device slots the boundary activations pass through on their way to and from the host


class HostRing:
    offloaded = True

    def __init__(self):
        self.ring, self.ready, self.free = None, [None] * RING, [None] * RING   # events per slot

    def prepare(self, trainer, n_layers, shape):
        """The host rows and the device ring for a step of `shape` (B, T, d), made before its first
        op."""
        self.t, self.loaded = trainer, set()
        self.host = trainer.host_buffer("activations", (n_layers, *shape), trainer.residual_dtype)
        if self.ring is None or self.ring[0].shape != shape:
            with trainer.comp():   # compute writes them first
                self.ring = [torch.empty(shape, dtype=trainer.residual_dtype, device=trainer.dev)
                             for _ in range(RING)]

    def keep(self, i, x):
        """Forward (on compute): layer i's inputs x, M x (B/M, T, d), to host row i via a ring
        slot."""
        t, r = self.t, i % RING
        t.comp.wait_event(self.free[r])                  # the slot's last D2H is done
        for dst, x_j in zip(self.ring[r].chunk(t.M), x):
            dst.copy_(x_j)
        self.ready[r] = t.comp.record()
        with t.d2h():
            t.d2h.wait_event(self.ready[r])
            self.host[i].copy_(self.ring[r], non_blocking=True)
            self.free[r] = t.d2h.record()

    def take(self, i):
        """Backward: layer i's inputs back on the device (row i-1 set on its way), for compute."""
        for j in (i, i - 1):
            if j >= 0 and j not in self.loaded:
                self._load(j)
        self.t.comp.wait_event(self.ready[i % RING])
        return self.ring[i % RING].chunk(self.t.M)

    def _load(self, i):
        """H2D of host row i into its slot once the slot's last reader is done: compute, in the
        backward; for the first two rows, the forward's D2H of this very row (its copy landed)."""
        t, r = self.t, i % RING
        with t.h2d():
            t.h2d.wait_event(self.free[r])
            self.ring[r].copy_(self.host[i], non_blocking=True)
            self.ready[r] = t.h2d.record()
        self.loaded.add(i)

    def release(self, i):
        """Compute is done reading layer i's slot."""
        self.free[i % RING] = self.t.comp.record()

    def buffers(self):
        return {f"ring[{r}]": slot for r, slot in enumerate(self.ring or [])}

