"""The guard's report: what train.py writes to metrics.jsonl and prints for a step that skipped something."""
import torch

from megatrain_min.engine.guard import Guard


def test_the_report_names_what_the_step_skipped():
    g = Guard()
    assert g.report(1, 2.5) == (None, None)                       # nothing skipped: nothing to say
    g.ok(torch.tensor([1.0, float("nan")]), "layer.1")              # one unit's gradient, on the host
    g.found_inf(torch.tensor([float("inf")]), "head")               # one taken where it lives (a device flag)
    g.found_inf(torch.tensor([1.0]), "layer.0")                     # finite: not named
    skipped, line = g.report(7, 2.5)
    assert skipped == ["layer.1", "head"], skipped
    assert line == "step 7: non-finite gradient in layer.1, head: those units kept their weights, the others " \
                   "were updated", line
    g.ok(float("nan"))                                              # the loss: the whole step
    skipped, line = g.report(7, float("nan"))
    assert skipped is True and line.startswith("step 7: non-finite loss or gradient norm (loss nan)"), line
    g.reset()
    assert g.report(8, 2.0) == (None, None)
