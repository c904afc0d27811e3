"""guard.py -- the non-finite guard: a step that would make the weights NaN updates nothing.

What it is
    Guard is handed to the engine (stream.Trainer(guard=Guard())), which asks it at three points:
      no clipping   after the head, the loss (one host sync per step): not finite -> nothing of the
                    step leaves the GPU, no unit is updated (skipped = True);
                    then, on the optimizer thread, each unit's gradient before its AdamW: not finite
                    -> that unit keeps its weights, m, v and step count while the others update (its
                    name in units) -- a NaN in one layer's gradient does not spread into the others;
                    a unit updated on the GPU is checked there (found_inf): its update skips itself
                    and the verdict is read at the end of the step, no host sync in the backward;
      clipping      once every gradient is on the host, the global norm and the loss: not finite ->
                    no unit is updated (skipped = True).
    train.py counts the steps in a row that skipped anything (--max-skips) and stops before a NaN is
    saved. A unit's check is one read pass of its gradient (a sum: checks.all_finite).
What it is not
    Not loss scaling (bf16 needs none) and not a fix: it keeps the weights as they were, nothing
    more.
"""
import math

from megatrain_min.engine.checks import all_finite


class Guard:
    def __init__(self):
        self.reset()

    def reset(self):
        """A new step: nothing skipped yet."""
        self.skipped = False
        self.host_units = []     # the names of the units found not finite on the host
        self.flags = []          # (name, device flag): verdicts taken on the GPU, read later

    def ok(self, x, unit=None):
        """Is x finite? x: a number (the loss, the norm), a tensor (a unit's gradient) or a verdict
        taken elsewhere (a bool: sharded.py's, agreed by every rank). When not, the whole step is
        skipped (unit None) or the unit named is. A tensor is read: on a GPU, a host sync."""
        if isinstance(x, bool):
            finite = x
        else:
            finite = math.isfinite(x) if isinstance(x, (int, float)) else all_finite(x)
        if not finite and unit is None:
            self.skipped = True
        elif not finite:
            self.host_units.append(unit)
        return finite

    def found_inf(self, grad, unit):
        """The verdict on a unit's gradient taken where it is, without a host sync: a 0-d float
        tensor on its device, 1.0 when not finite -- the update rule's found_inf, which skips the
        update there (a unit kept on the GPU, megatrain_min/engine/resident.py). Read by `units`."""
        flag = grad.sum().isfinite().logical_not().float()
        self.flags.append((unit, flag))
        return flag

    @property
    def units(self):
        """The names of this step's units whose gradient was not finite (reads the device flags:
        after Trainer.wait)."""
        return self.host_units + [name for name, flag in self.flags if flag.item()]

    def report(self, step, loss):
        """What step `step` skipped, for metrics.jsonl (True: all of it; else the units' names),
        and the line that says so; (None, None) when it skipped nothing."""
        if self.skipped:
            return True, (f"step {step}: non-finite loss or gradient norm (loss {loss}): step "
                          f"skipped, weights untouched")
        units = self.units
        if units:
            return units, (f"step {step}: non-finite gradient in {', '.join(units)}: those units "
                           f"kept their weights, the others were updated")
        return None, None
