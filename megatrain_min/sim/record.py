"""record.py -- the engine on checked lanes: every op and ordering point it issues, recorded.

What it is
    stream.Trainer runs unchanged on SimLanes (at full size on fake tensors: its host update a
    region at a time, sim/fake.py), a backend of stream.Lanes in which every lane (h2d,
    compute, d2h, comm and the legacy default stream) and every host thread (main, the optimizer
    worker) has an identity. A TorchDispatchMode (Recorder) attributes every aten op to one of them,
    with what it reads and writes (storage and byte range, from the op schema's alias info), and
    every ordering point -- event record and wait, the host's waits, task hand-offs to the worker,
    future results, the gradient-slab pool -- is an event too. Consumers read that stream:
    race.Checker (happens-before: races) and twin.Twin (the same stream at full size under
    FakeTensorMode, replayed on a hardware profile). run() builds a trainer on SimLanes and steps
    it. Which storages are "device": made on a lane (inside `with lane():` on the main thread, or by
    an op on device tensors); host buffers asked for as pinned are made unpinned here and remembered
    as pinned. A storage is named by the trainer attribute that holds it (buffer_names: its public
    attributes).
What it is not
    Not a GPU and not CUDA's memory model in full: the optimizer worker runs each task at once,
    inline, under its own identity (the clocks, not the wall clock, carry the order); the free rule
    is the caching allocator's (a block freed on the host may be handed to the next allocation on
    its stream).
Reference
    torch/cuda/_sanitizer.py (PyTorch's CUDA sanitizer) keeps the same parts apart: what an op reads
    and writes, the synchronisation state, the check.
"""
import contextlib
import dataclasses
import sys
from concurrent.futures import Future
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import model
import stream
from megatrain_min import engine
from megatrain_min.plan import cost
from megatrain_min.sim.fake import NOT_ANSWERED, ZeroWeights, answer, tiles_of, whole_regions

aten = torch.ops.aten
# CUDA streams (default: the legacy default stream; comm: the collectives of sharded.py)
LANES = ("h2d", "compute", "d2h", "comm", "default")
THREADS = ("main", "worker")                       # host threads
BATCH = (4, 16)   # (B, T) of a checked run unless told: the real engine on a CPU, every op recorded
ROOT = Path(__file__).resolve().parents[2]
# the source files ours: a report names their lines (the core, and what the engine is handed)
OURS = {str(ROOT / f) for f in ("stream.py", "model.py", "optim.py")} | \
    {str(ROOT / "megatrain_min" / "engine" / f"{m}.py")
     for m in ("sharded", "resident", "gpu_update", "activations", "tiling")}
@dataclasses.dataclass(eq=False)
class Storage:
    """One storage while it lives: where it is, who made it, who touched it."""
    sid: int
    ref: StorageWeakRef
    nbytes: int
    where: str          # "device", "pinned" or "host"
    made_on: str        # the lane or thread that allocated it
    made_by: str        # "aten.op at file:line"
    name: str = None    # the engine's name for it (wslot[0], shadow[layer.3], ...), when it has one
    kept: set = dataclasses.field(default_factory=set)  # lanes that record_stream'ed it (Lane.keep)
    # made by the op being noted (else an op returned an existing storage: an unmarked view)
    new: bool = False


@dataclasses.dataclass(eq=False)
class Op:
    """One aten op as the recorder saw it."""
    actor: str          # lane or thread
    name: str           # aten overload name
    reads: list         # [(Storage, lo, hi)] byte ranges
    writes: list
    src: str            # file:line in stream.py / model.py / optim.py
    kind: str           # compute, h2d, d2h, dd (device->device copy), host
    nbytes: int = 0     # bytes read + written (costs=True)
    flops: float = 0.0
    low_precision: bool = False   # some operand is bf16 (the GPU's bf16 peak applies)
    # a host<->device copy the host waits for (non_blocking=False or pageable memory)
    blocking: bool = False
    # run by autograd's engine inside torch.autograd.grad (else issued from Python)
    autograd: bool = False
    fresh: list = ()    # storages this op allocated
    count: int = 1      # ops of the engine it stands for (fake.whole_regions: a region's tiles)


class SimEvent:
    """What Lane.record() returns on SimLanes: an id and the lane it marks."""

    def __init__(self, eid, lane):
        self.eid, self.lane = eid, lane


# ------------------------------------------------------------------- the backend the engine runs on
class SimLane:
    def __init__(self, rec, name):
        self.rec, self.name = rec, name

    def __call__(self):
        return self.rec.on_lane(self.name)

    def wait_event(self, event):
        if event is not None:
            self.rec.emit("wait", lane=self.name, event=event)

    def record(self):
        return self.rec.record(self.name)

    def uses(self, t):
        self.rec.uses(self.name, t)


class SimFuture(Future):
    """A finished Future whose result() is a host wait on the task (a happens-before edge)."""

    def __init__(self, rec, tid):
        super().__init__()
        self.rec, self.tid = rec, tid

    def result(self, timeout=None):
        self.rec.emit("result", thread=self.rec.thread, task=self.tid)
        return super().result(timeout)


class SimPool:
    """The gradient-slab pool (queue.Queue's get/put/qsize): a get joins the clock of the put it
    takes."""

    def __init__(self, rec):
        self.rec, self.items = rec, []

    def put(self, item):
        names = self.rec.slab_names
        self.rec.name_later(item, f"slab {names.setdefault(id(item), len(names))}")
        self.rec.emit("put", thread=self.rec.thread, item=id(item))
        self.items.append(item)

    def get(self):
        # inline tasks give every slab back at once: an empty pool is a lost slab
        if not self.items:
            raise RuntimeError("checked engine: the gradient-slab pool is empty (a "
                               "slab was not given back)")
        item = self.items.pop(0)
        self.rec.emit("get", thread=self.rec.thread, item=id(item), src=self.rec.source())
        return item

    def qsize(self):
        return len(self.items)


class SimLanes:
    """stream.Lanes with identities: what the engine asks of the hardware, recorded. pinned(n,
    dtype): a host buffer asked for pinned (the recorder makes it unpinned and remembers)."""
    cuda = True

    @staticmethod
    def pinned(n, dtype):
        return torch.zeros(n, dtype=dtype, pin_memory=True)

    def __init__(self, rec):
        self.rec = rec
        self.h2d, self.comp, self.d2h = SimLane(rec,
                                                "h2d"), SimLane(rec, "compute"), SimLane(rec, "d2h")
        # sharded.ShardedTrainer's collectives (stream.Trainer has none)
        self.comm = SimLane(rec, "comm")
        self.pool = SimPool(rec)           # the gradient slabs (optim.HostStore.lend)

    def host_wait(self, event):
        if event is not None:
            self.rec.emit("host_wait", thread=self.rec.thread, event=event, src=self.rec.source())

    def synchronize(self):
        self.rec.emit("synchronize", thread=self.rec.thread, src=self.rec.source())

    def submit(self, fn, *args, need=0, ready=None):
        return self.rec.submit(fn, args, need, ready)




# ----------------------------------------------------------------------------- the recorder
class Recorder(TorchDispatchMode):
    """Attributes every aten op and ordering point of the engine to a lane or thread and hands them,
    in issue order, to the consumers: objects with a method per event kind (op, record, wait,
    host_wait, synchronize, submit, task_start, task_end, result, put, get, uses, free, step).
    fake=True: FakeTensorMode is below us (the twin); data-dependent scalars (.item()) then read as
    1."""

    def __init__(self, consumers, fake=False, sources=True, costs=False):
        super().__init__()
        self.consumers, self.fake, self.sources, self.costs = consumers, fake, sources, costs
        # the host thread running now; the main thread's lane stack
        self.thread, self.lanes_on = "main", []
        self.live, self.n_sid, self.n_ev, self.n_task = {}, 0, 0, 0   # storage cdata -> Storage
        self.device = {}          # the device storages among them (the sweep looks for frees there)
        self.names, self.slab_names, self.trainer = {}, {}, None
        self.tile = None          # fake.whole_regions: an op counts for its tiles of this many
        for c in consumers:
            if hasattr(c, "attach"):
                c.attach(self)

    # ---- events
    def emit(self, kind, **kw):
        for c in self.consumers:
            getattr(c, kind)(**kw)

    @contextlib.contextmanager
    def on_lane(self, lane):
        self.lanes_on.append(lane)
        try:
            yield
        finally:
            self.lanes_on.pop()

    def record(self, lane):
        self.n_ev += 1
        ev = SimEvent(self.n_ev, lane)
        self.emit("record", lane=lane, event=ev)
        return ev

    def uses(self, lane, t):
        st = self.storage_of(t, create=False)
        if st is not None:
            st.kept.add(lane)

    def submit(self, fn, args, need=0, ready=None):
        """The optimizer thread, inline: the task runs now, as the worker. need, ready: what
        optim.Worker picks its next task by (the consumers order the tasks: race.Checker by no
        more than their edges, twin.Twin as that worker would run them)."""
        self.n_task += 1
        tid, fut = self.n_task, SimFuture(self, self.n_task)
        self.emit("submit", thread=self.thread, task=tid, need=need, ready=ready)
        outer, self.thread = self.thread, "worker"
        self.emit("task_start", task=tid)
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 -- re-raised where the engine asks for the result
            fut.set_exception(e)
        finally:
            self.emit("task_end", task=tid)
            self.thread = outer
        return fut

    def step(self, k):
        self.sweep()
        self.emit("step", k=k)

    # ---- storages
    def storage_of(self, t, create=True, where="host", made_on="main", made_by="?"):
        """The Storage of tensor t; with create, a new one when t's storage is new (then .new is
        True)."""
        s = t.untyped_storage()
        st = self.live.get(s._cdata)
        if st is not None and st.ref.expired():  # the address of a freed storage, reused
            self.free(st)
            st = None
        if st is None and create:
            self.n_sid += 1
            st = Storage(self.n_sid, StorageWeakRef(s), s.nbytes(), where, made_on, made_by)
            st.new = True
            self.live[s._cdata] = st
            if where == "device":
                self.device[s._cdata] = st
        elif st is not None:
            st.new = False
        return st

    def free(self, st):
        self.live.pop(st.ref.cdata, None)
        if self.device.pop(st.ref.cdata, None) is not None:
            self.emit("free", storage=st)

    def sweep(self):
        """Device storages freed since the last look (host ones are noticed when their address comes
        back)."""
        for st in [st for st in self.device.values() if st.ref.expired()]:
            self.free(st)

    def name_later(self, t, name):
        self.names[t.untyped_storage()._cdata] = name

    def name_of(self, st):
        """The engine's name of a storage (its public attributes, walked now), else where it was
        made."""
        if st.name is None and self.trainer is not None:
            for cd, name in buffer_names(self.trainer).items():
                if cd in self.live:
                    self.live[cd].name = name
        if st.name is None and st.ref.cdata in self.names:
            st.name = self.names[st.ref.cdata]
        return st.name or f"a tensor from {st.made_by} on {st.made_on}"

    # ---- ops
    def source(self):
        if not self.sources:
            return ""
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename not in OURS:
            f = f.f_back
        if f is None:
            return "?"
        return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno} ({f.f_code.co_name})"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """func run (fake=True: by the fake tensors, or answered by fake.answer), then noted as
        an op of the lane or thread that issued it."""
        out = answer(func, args) if self.fake else NOT_ANSWERED
        if func.namespace == "prim" and out is not NOT_ANSWERED:
            return out                                  # a metadata query: no op
        kwargs = kwargs or {}
        self.in_autograd = autograd_frame(sys._getframe(1))
        pinned = bool(kwargs.get("pin_memory"))
        if pinned:
            kwargs = dict(kwargs, pin_memory=False)
        if self.fake and func is aten._local_scalar_dense.default:
            out = {torch.bool: True}.get(args[0].dtype, 1)
        elif out is NOT_ANSWERED:
            out = func(*args, **kwargs)
        # prim.device &c.: metadata queries fake tensors dispatch, no work
        if func.namespace != "prim":
            self.note(func, args, kwargs, out, pinned)
        return out

    def note(self, func, args, kwargs, out, pinned):
        # old: existed before the op
        old_reads, old_writes, fresh = cost.accesses(func, args, kwargs, out)
        # a storage first seen here was made outside the dispatcher; on the comm lane that is the
        # collective backend's own buffer (gloo's reduce_scatter copies out of one), which lives
        # where the collective runs
        unseen = "device" if self.thread == "main" and self.lanes_on[-1:] == ["comm"] else "host"
        touched = [self.storage_of(t, where=unseen) for t in old_reads + old_writes]
        device = any(st.where == "device" for st in touched)
        if self.thread != "main":
            actor = self.thread
        elif device or (self.lanes_on and not pinned and not old_reads and not old_writes):
            # a lane op (or an allocation on one)
            actor = self.lanes_on[-1] if self.lanes_on else "default"
        else:
            actor = "main"
        src = self.source()
        where = "pinned" if pinned else "device" if actor in LANES else "host"
        made = [(t, self.storage_of(t, where=where, made_on=actor, made_by=f"{func} at {src}"))
                for t in fresh]
        # an output on an existing storage is an unmarked view
        fresh = [t for t, st in made if st.new]
        new = [st for t, st in made if st.new]
        if new:
            self.sweep()
        kind, blocking = "host" if actor in THREADS else "compute", False
        if actor in LANES and func in cost.COPIES:
            dst_dev = (touched[len(old_reads)] if old_writes else new[0]).where == "device"
            src_st = touched[0] if old_reads else None
            src_dev = src_st is None or src_st.where == "device"
            kind = "dd" if dst_dev and src_dev else "h2d" if dst_dev else "d2h"
            host_side = src_st if kind == "h2d" else (touched[len(old_reads)]
                                                      if old_writes else None)
            blocking = kind != "dd" and (not kwargs.get("non_blocking", len(args) > 2 and args[2])
                                          or (host_side is not None and host_side.where == "host"))
        op = Op(actor, str(func), [span(st, t) for st, t in zip(touched, old_reads)],
                [span(st, t) for st, t in zip(touched[len(old_reads):], old_writes)] +
                ([] if func in cost.EMPTY else [span(st, t) for st, t in zip(new, fresh)]), src,
                kind,
                blocking=blocking, fresh=new)
        op.autograd = self.in_autograd
        if self.costs:
            op.nbytes = cost.traffic(func, old_reads, old_writes, fresh, kwargs)
            op.flops = cost.flops(func, args, kwargs, out)
            op.low_precision = any(t.dtype == torch.bfloat16 for t in old_reads + old_writes)
        if self.tile is not None:
            op.count = tiles_of(out, args, self.tile)
        self.emit("op", op=op)


def autograd_frame(f):
    """Is the innermost Python frame below the dispatch mode (past torch's wrappers) autograd's
    engine?"""
    while f is not None and ("/torch/_dynamo/" in f.f_code.co_filename
                             or "torch/_compile" in f.f_code.co_filename):
        f = f.f_back
    return f is not None and f.f_code.co_name == "_engine_run_backward"


def span(st, t):
    """(storage, first byte, one past the last byte) that t can touch."""
    es, lo = t.element_size(), t.storage_offset() * t.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0
    return st, lo, lo + extent * es


def buffer_names(t):
    """{storage cdata: name} of a trainer's buffers, named by the public attributes that hold them,
    walked now: a tensor (cast), a list or dict of them (wslot[0], rope[16]), the host store per
    unit (master[layer.3]), the pinned buffers (rows (pinned)), the step's targets, what the objects
    the engine is handed hold (ring[1], scratch[0]). A storage with several names keeps the first:
    a tied head's master is the embedding's."""
    names = {}

    def walk(name, v):
        if isinstance(v, torch.Tensor):
            names.setdefault(v.untyped_storage()._cdata, name)
        elif isinstance(v, (list, tuple, dict)):
            for k, x in (v.items() if isinstance(v, dict) else enumerate(v)):
                walk(f"{name}[{k}]", x)
    for name, buf in t.host_buffers.items():
        walk(f"{name} (pinned)", buf)
    for name, v in vars(t).items():
        if not name.startswith("_") and name not in ("opt", "batch", "host_buffers", "home"):
            walk(name, v)
    per_unit = {"master": t.opt.master, **t.opt.state, "grad": t.opt.grad, "shadow": t.opt.shadow}
    for what, bufs in per_unit.items():
        for u, buf in enumerate(bufs):
            if buf is not None:
                walk(f"{what}[{t.units[u].name}]", buf)
    if t.batch is not None:
        walk("targets", t.batch.targets)
    for handed in (t.activations, *set(t.home)):
        for name, buf in getattr(handed, "buffers", dict)().items():
            walk(name, buf)
    return names


def run(cfg, consumers, steps, trainer_cls=None, fake=False, sources=True, costs=False,
        batch=BATCH, between=None, offload_activations=False, skip_nonfinite=False, tile_tokens=0,
        resident_units=0, gpu_updated_units=0, tiles=False, **trainer_kw):
    """Build trainer_cls (stream.Trainer) on SimLanes under a Recorder and run `steps` steps on
    random batches of batch=(B, T); between(trainer) runs after every step but the last (e.g. an
    evaluate()). Returns the trainer. offload_activations, skip_nonfinite, tile_tokens,
    resident_units, gpu_updated_units: the objects the engine is handed (engine.parts); dtype and
    residual_dtype: torch dtypes; everything else as stream.Trainer takes it. fake=True: the host
    update recorded a region at a time (fake.whole_regions) unless tiles=True."""
    rec = Recorder(consumers, fake=fake, sources=sources, costs=costs)
    mode = torch._subclasses.fake_tensor.FakeTensorMode(
        allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    B, T = batch
    gen = torch.Generator().manual_seed(0)
    with mode, rec:
        weights = ZeroWeights(cfg) if fake else model.init_weights(cfg, 0)
        # given ones win
        kw = {**engine.parts(offload_activations, skip_nonfinite, tile_tokens, resident_units,
                             gpu_updated_units),
              **trainer_kw}
        t = (trainer_cls or stream.Trainer)(cfg, weights, device="cpu", lanes=SimLanes(rec), **kw)
        rec.trainer = t
        regions = whole_regions(rec, t.opt) if fake and not tiles else contextlib.nullcontext()
        with regions:
            for k in range(steps):
                rec.step(k)
                tok = torch.randint(0, cfg.vocab_size, (B, T), generator=None if fake else gen)
                t.step(tok, tok.roll(-1, 1))
                if between is not None and k + 1 < steps:
                    between(t, tok)
            rec.step(steps)
            t.weights()          # reads every master weight: after the updates in flight, or a race
    return t
