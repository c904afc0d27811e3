"""homes.py -- where each unit lives and where its update runs: the homes the engine is handed.

What it is
    A unit's home answers the engine's few questions about it (stream.Streamed has the list): what
    to copy into a weight slot and after which event, where its work runs and its update, and -- for
    the embedding's home -- where its rows are gathered and its gradient scattered. Three kinds:

        stream.Streamed          state in host memory, weights streamed, gradient to the host,
                                 the update on the optimizer thread (the paper's engine)
        resident.Resident        the whole unit on the GPU: updated there, nothing crosses
        gpu_update.GpuUpdated    streamed, its gradient kept on the GPU, its master and state
                                 crossing for the update there

    Homes(resident_units, gpu_updated_units) assigns them: the first resident_units of the order
    the next forward needs the units in (the embedding -- tied: the head --, layer 0, 1, ...)
    resident, then gpu_updated_units of the others spread evenly (gpu_update.chosen), the rest
    streamed. stream.Trainer(homes=Homes(...)) asks it once, at construction (assign).
What it is not
    No decision: the plan (megatrain_min/plan) picks the counts; megatrain_min/engine/__init__.py
    hands them.
Try it
    python train.py --resident-units 2 --gpu-updated-units 2 --steps 5
"""
import stream
from megatrain_min.engine.gpu_update import GpuUpdated, chosen
from megatrain_min.engine.resident import Resident


class Homes:
    kinds = dict(resident=Resident, gpu_updated=GpuUpdated)   # what it hands out besides Streamed

    def __init__(self, resident_units=0, gpu_updated_units=0):
        for name, n in (("resident_units", resident_units),
                        ("gpu_updated_units", gpu_updated_units)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {n!r}")
        self.resident_units = resident_units
        self.gpu_updated_units = gpu_updated_units

    def assign(self, trainer):
        """[the home of each unit of trainer.units] (see the module docstring)."""
        t = trainer
        resident = t.order[:self.resident_units]
        gpu = chosen(t.order, len(resident), t.embed, self.gpu_updated_units)
        homes = stream.Streamed.assign(t)
        if gpu:
            shared = self.kinds["gpu_updated"](t, gpu)   # one: its units share its two scratches
            for u in gpu:
                homes[u] = shared
        for u in resident:
            homes[u] = self.kinds["resident"](t)
        return homes

    def __repr__(self):
        return (f"Homes(resident_units={self.resident_units}, "
                f"gpu_updated_units={self.gpu_updated_units})")
