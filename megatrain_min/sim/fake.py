"""fake.py -- the engine at full size on fake tensors: shapes, no data.

What it is
    record.run(fake=True) runs stream.Trainer under torch's FakeTensorMode, which allocates
    nothing: the twin replays a 120B model's step recorded in seconds. ZeroWeights reads every
    weight as zeros of its shape. answer() returns what an op returns when a fake tensor has no
    work for it and no check to make (a device query; AdamW's fused kernel), so that the recorder
    need not send it through FakeTensorMode's dispatch (~0.1 ms an op; a host update issues
    thousands: each tile of optim.TILE elements is a few ops).
What it is not
    Not a check of the ops it answers: a fake tensor holds no data, these make no tensor, and a
    dispatched one would check nothing more.
"""
from collections.abc import Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensor

import model

# in place on its arguments, nothing to compute on fakes, and nothing a fake would check: AdamW's
# fused kernel (a fake accepts mismatched shapes, dtypes and list lengths whether dispatched or not;
# copy_ is dispatched: a fake checks that its shapes broadcast). What each returns.
IN_PLACE = {torch.ops.aten._fused_adamw_.default: lambda args: None}
NOT_ANSWERED = object()


def answer(func, args):
    """What func(*args) returns when every tensor among args is fake and func has no work for
    them: a device query, or an op of IN_PLACE; else NOT_ANSWERED."""
    tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
               if isinstance(t, torch.Tensor)]
    if not tensors or not all(isinstance(t, FakeTensor) for t in tensors):
        return NOT_ANSWERED
    if func is torch.ops.prim.device.default:
        return args[0].fake_device
    if func in IN_PLACE:
        return IN_PLACE[func](args)
    return NOT_ANSWERED


class ZeroWeights(Mapping):
    """weights for the twin: every key reads as zeros of its shape (under FakeTensorMode: nothing
    allocated)."""

    def __init__(self, cfg):
        self.shapes = {e.key: e.shape for u in model.units(cfg) for e in u.entries}

    def __getitem__(self, key):
        return torch.zeros(self.shapes[key])

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)
