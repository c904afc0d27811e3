"""meter.py -- what each training step measures, for metrics.jsonl and the progress bar.

What it is
    Meter(cfg, pl, tokens_per_step, trainer, world): start() just before a step, record(step, loss,
    lr) once it is done (train.py waits for the updates in flight where the guard needs them): the
    step's record -- loss, learning rate, tokens/s, model TFLOP/s (6 N per token), MFU against the
    peak of a profiled GPU (every rank's, the tokens being global), and under torchrun the bytes
    rank 0 moved over each wire during the step. postfix(rec): what the bar shows of it.
What it is not
    No printing and no files: train.py shows the record, rundir.Run writes it.
"""
import time

from megatrain_min.plan import hardware


class Meter:
    def __init__(self, cfg, pl, tokens_per_step, trainer, world):
        self.cfg = cfg
        self.tokens = tokens_per_step
        self.trainer = trainer
        self.world = world
        peak = hardware.peak_tflops(pl["hardware"], pl["dtype"])   # None: no profiled GPU
        self.peak = peak * world if peak else None
        self.started = time.time()   # the first step's start: how long the run took
        self.t0 = self.moved = None

    def start(self):
        """A step begins: its clock, and the wires' byte counts (sharded.py) so far."""
        self.moved = self.trainer.traffic.copy() if self.world > 1 else None
        self.t0 = time.time()

    def record(self, step, loss, lr):
        """The record of step `step` (1-based), started by start()."""
        dt = time.time() - self.t0
        rec = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": self.tokens / dt,
               "model_tflops": hardware.model_tflops(self.cfg, self.tokens, dt)}
        if self.peak:
            rec["mfu"] = rec["model_tflops"] / self.peak
        if self.moved is not None:   # torchrun: rank 0's bytes over PCIe (h2d, d2h), between GPUs
            rec["traffic"] = dict(self.trainer.traffic - self.moved)
        return rec

    def postfix(self, rec):
        """The progress bar's numbers: loss and tokens/s; TFLOP/s and MFU on a profiled GPU."""
        shown = {"loss": f"{rec['loss']:.3f}", "tok_s": f"{rec['tokens_per_s']:,.0f}"}
        if self.peak:
            shown.update(tflops=f"{rec['model_tflops']:.1f}", mfu=f"{rec['mfu']:.0%}")
        return shown
