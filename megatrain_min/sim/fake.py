"""fake.py -- the engine at full size on fake tensors: shapes, no data.

What it is
    record.run(fake=True) runs stream.Trainer under torch's FakeTensorMode, which allocates
    nothing: the twin replays a 120B model's step recorded in seconds. ZeroWeights reads every
    weight as zeros of its shape. answer() returns what an op returns when a fake tensor has no
    work for it and no check to make (a device query; AdamW's fused kernel), so that the recorder
    need not send it through FakeTensorMode's dispatch (~0.1 ms an op; a host update issues
    thousands: each tile of optim.TILE elements is a few ops). whole_regions(rec, store): the
    host update run one call per region ([matrices | vectors]) instead of one per tile, each op
    it issues counted (Op.count) for the tiles the engine runs -- the same bytes and the same
    issue cost in the twin, a few ops a region to record (a 3-layer 120b replay: 6.8 s -> 1.75 s).
What it is not
    Not a check of the ops it answers: a fake tensor holds no data, these make no tensor, and a
    dispatched one would check nothing more.
"""
import contextlib
from collections.abc import Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensor

import model
import optim

# in place on its arguments, nothing to compute on fakes, and nothing a fake would check: AdamW's
# fused kernel (a fake accepts mismatched shapes, dtypes and list lengths whether dispatched or not;
# copy_ is dispatched: a fake checks that its shapes broadcast). What each returns.
IN_PLACE = {torch.ops.aten._fused_adamw_.default: lambda args: None}
NOT_ANSWERED = object()


def answer(func, args):
    """What func(*args) returns when every tensor among args is fake and func has no work for
    them: a device query, or an op of IN_PLACE; else NOT_ANSWERED."""
    tensors = tensors_in(args)
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


def tensors_in(args):
    return [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
            if isinstance(t, torch.Tensor)]


def tiles_of(out, args, tile):
    """How many tiles of `tile` elements an op of the host update's loop stands for: its output's
    elements (a view of the region), else its largest operand's (a kernel in place). An op on
    scalars alone counts once, as the step count's increment and the clip scale run once a call;
    a rule that made a scalar per tile on the host would be undercounted (none does: found_inf,
    whose per-tile cast Lion makes, reaches only updates on the GPU, which are not tiled)."""
    n = out.numel() if isinstance(out, torch.Tensor) else max(
        (t.numel() for t in tensors_in(args)), default=1)
    return max(1, -(-n // tile))


@contextlib.contextmanager
def whole_regions(rec, store):
    """store.step (optim.HostStore) one call per region, not per tile of optim.TILE elements;
    while it runs for a unit the host updates, rec.tile tells the recorder to count each op for
    the tiles it stands for (an update on the GPU is one call per region anyway)."""
    tile, step, own = optim.TILE, store.step, store.__dict__.get("step")

    def stepped(u, lr=None, coef=1.0, on=None, found_inf=None):   # HostStore.step's arguments
        rec.tile = tile if on is None and store.where[u]["master"] != "gpu" else None
        try:
            return step(u, lr, coef, on, found_inf)
        finally:
            rec.tile = None

    store.step, optim.TILE = stepped, 1 << 62
    try:
        yield
    finally:
        if own is None:
            del store.step           # the method again
        else:
            store.step = own
        optim.TILE = tile
