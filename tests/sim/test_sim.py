"""The stream checker (megatrain_min/sim/record.py + race.py, the command megatrain_min/sim/__init__.py) over the real engine, on
the CPU.

- The engine is clean: 2 steps with an evaluate() between them (at another length), over a pairwise covering of
  {toy, GQA + qkv-bias + qk-norm + tied} x M {1, 4} x clipping x activation offload x fast/lean x the guard.
- Seeded defects are reported, naming the right buffer: each of the engine's event waits deleted in turn (every
  one is needed: none is implied by another), the one record_stream (Lane.uses), a grad slot zeroed on the
  legacy default stream, the loss read before its event.
- The sharded engine (megatrain_min/engine/sharded.py, one gloo rank): clean, and each of its event waits deleted in turn
  is reported -- the collectives on the comm lane are covered like the copies.
- The CLI: `check --config toy --micro-batches 2` exits 0, lists the host syncs per step and counts the weight
  copies the schedule makes (every layer twice but the last, the head once).
"""
import re
import types

import pytest
import torch

import model
from conftest import ROOT, SPECIAL, train_py
from megatrain_min.sim import race, record
from megatrain_min.engine.homes import Homes

SOURCES = {name: (ROOT / name).read_text() for name in (
    "stream.py", "megatrain_min/engine/activations.py", "megatrain_min/engine/resident.py", "megatrain_min/engine/gpu_update.py")}
STREAM = SOURCES["stream.py"]
TOY = model.PRESETS["toy"]


def between(t, tok):  # an evaluation between the steps, at another sequence length (a new RoPE cache)
    t.evaluate(tok[:, :8], tok[:, 1:9])


def checked(cfg=TOY, trainer_cls=None, **kw):
    checker = race.Checker()
    record.run(cfg, [checker], 2, trainer_cls=trainer_cls, batch=(4, 16), between=between, **kw)
    return checker


# pairwise covering of (model, M, clip, offload, lean, guard): every pair of values appears in some row
COVER = [(0, 0, 0, 0, 0, 0), (1, 1, 1, 1, 1, 1), (0, 0, 1, 1, 1, 0), (1, 1, 0, 0, 0, 1), (0, 1, 0, 1, 1, 1),
         (1, 0, 1, 0, 0, 0), (0, 0, 0, 0, 1, 1), (0, 1, 0, 1, 0, 0)]


@pytest.mark.parametrize("row", [pytest.param(r, marks=[pytest.mark.slow] if k else [], id="".join(map(str, r)))
                                 for k, r in enumerate(COVER)])   # the first row in the fast tier
def test_engine_is_race_free(row):
    cfg, M, clip, offload, lean, guard = row
    lean_kw = dict(mode="lean", dtype=torch.bfloat16) if lean else {}   # lean streams fp32, casts on the device
    c = checked([TOY, SPECIAL][cfg], micro_batches=[1, 4][M], grad_clip=[0.0, 1.0][clip],
                offload_activations=bool(offload), skip_nonfinite=bool(guard), **lean_kw)
    assert not c.races, c.summary()
    assert len(c.steps) == 3 and all(s["copies"] for s in c.steps[:2])


RESIDENT = [dict(cfg=TOY, micro_batches=2, grad_clip=0.0, offload_activations=True, resident_units=2),
            dict(cfg=SPECIAL, micro_batches=1, grad_clip=1.0, skip_nonfinite=True, resident_units=99),
            dict(cfg=TOY, micro_batches=2, grad_clip=0.0, skip_nonfinite=True, mode="lean", dtype=torch.bfloat16,
                 resident_units=1)]


@pytest.mark.parametrize("kw", [pytest.param(kw, marks=[pytest.mark.slow] if k else [], id=f"resident-{k}")
                                for k, kw in enumerate(RESIDENT)])
def test_resident_units_are_race_free(kw):
    """Units resident on the GPU: their state made on compute, each gradient copied D2D on the D2H lane, their
    AdamW (or norm) issued on the H2D lane, the embedding's rows gathered and its dy scattered on the GPU."""
    c = checked(**kw)
    assert not c.races, c.summary()


GPU_UPDATED = [dict(cfg=TOY, micro_batches=2, grad_clip=1.0, offload_activations=True, gpu_updated_units=99),
               dict(cfg=SPECIAL, micro_batches=1, grad_clip=0.0, skip_nonfinite=True, resident_units=1,
                    gpu_updated_units=2, mode="lean", dtype=torch.bfloat16),
               dict(cfg=TOY, micro_batches=2, grad_clip=0.0, dtype=torch.bfloat16, gpu_updated_units=3)]


@pytest.mark.parametrize("kw", [pytest.param(kw, marks=[pytest.mark.slow] if k else [], id=f"gpu-updated-{k}")
                                for k, kw in enumerate(GPU_UPDATED)])
def test_gpu_updated_units_are_race_free(kw):
    """Streamed units updated on the GPU (gpu_update.GpuUpdated): the gradient copied D2D on the D2H lane, the
    update issued on H2D (master, m, v into one of two scratches, the kernel, the shadow's cast), copied back on
    D2H after it, the next copy of the unit into a slot after that; a scratch refilled after its last D2H."""
    c = checked(**kw)
    assert not c.races, c.summary()
    assert all(s["copies"] for s in c.steps[:2])


def test_the_guard_takes_no_host_sync_for_a_unit_updated_on_the_gpu():
    """The non-finite guard without clipping asks each unit's gradient before its update. A unit updated on the
    GPU (resident, or streamed and updated there) has its update issued by the main thread in the backward: its
    verdict is a device flag the update skips itself on (guard.Guard.found_inf), never a read of the gradient on
    the host, which would block the main thread until the GPU drained and leave it idle before the next layer.
    The step's host syncs: the loss (twice: the guard's check, the step's result) and the gradient slabs."""
    c = race.Checker()
    record.run(TOY, [c], 2, batch=(4, 16), grad_clip=0.0, skip_nonfinite=True, resident_units=2,
               gpu_updated_units=2)
    assert not c.races, c.summary()
    for s in c.steps[:2]:
        waits = {**s["syncs"], **s["worker_waits"]}
        assert not [w for w in waits if "device tensor" in w], waits
        assert sum(n for w, n in s["syncs"].items() if "host_wait" in w) == 2, s["syncs"]


@pytest.mark.slow
@pytest.mark.parametrize("old,buffer,what", [
    ("t.comp.wait_event(t.h2d.record())", "master[", "write on h2d / read on compute"),   # rows before the update
    ("t.d2h.wait_event(t.comp.record())", "dy_out", "write on compute / read on h2d"),    # scatter before dy
    ("t.h2d.uses(dy)", "dy_out", "freed on the host while h2d"),                         # dy's block reused
])
def test_resident_defects_are_reported(old, buffer, what):
    mutated = mutant(old, name="megatrain_min/engine/resident.py")
    found = [r for kw in RESIDENT[:2] for r in checked(**{**kw, **mutated(kw["resident_units"], 0)}).races]
    assert any(buffer in r["buffer"] and what in r["what"] for r in found), [(r["buffer"], r["what"]) for r in found]


def test_the_optimizer_threads_tasks_are_ordered_by_their_edges_alone():
    """optim.Worker runs its tasks most-needed first, not in the order they came: two tasks that write one buffer are
    a race unless an edge orders them (here: the host waits for the first task's result before it submits the
    second), however they came in."""
    def races(edge):
        c, buf = race.Checker(), record.Storage(1, None, 64, "host", "main", "a test")

        def task(tid):
            c.submit("main", tid, need=tid, ready=None)
            c.task_start(tid)
            c.op(record.Op("worker", "aten.add_.Tensor", [], [(buf, 0, 64)], "optim.py:1 (step)", "host"))
            c.task_end(tid)
        c.step(0)
        task(1)
        if edge:
            c.result("main", 1)
        task(2)
        return [(r["buffer"], r["what"]) for r in c.races]
    assert races(edge=True) == []
    assert races(edge=False) == [("storage 1", "write on worker task 1 / write on worker task 2 without a "
                                               "happens-before edge")]


def test_back_to_back_steps_without_clipping_offloaded_and_tiled():
    """Three steps with nothing between them: without clipping step() returns while the backward still runs, and
    the next step's input (targets, embedding rows, the activations' ring) is allocated while it does. Offload
    on, the layer in tiles of 8 tokens."""
    checker = race.Checker()
    record.run(TOY, [checker], 3, batch=(4, 16), grad_clip=0.0, micro_batches=2, offload_activations=True, tile_tokens=8)
    assert not checker.races, checker.summary()
    assert len(checker.steps) == 4 and all(s["copies"] for s in checker.steps[:3])


def mutant(old, new=None, nth=0, name="stream.py"):
    """The engine with the nth line of `name` (stream.py, the activations' ring, a home) that contains `old`
    replaced (by `pass`, keeping the indent): checked()'s arguments that run it -- for a home, a function of the
    resident and GPU-updated counts that gives them."""
    lines = SOURCES[name].splitlines(keepends=True)
    i = [i for i, line in enumerate(lines) if old in line][nth]
    lines[i] = new if new is not None else re.match(r"\s*", lines[i]).group(0) + "pass  # deleted by the test\n"
    mod = types.ModuleType("mutant")
    exec(compile("".join(lines), str(ROOT / name), "exec"), mod.__dict__)
    if name == "stream.py":
        return dict(trainer_cls=mod.Trainer)
    if "activations" in name:
        return dict(activations=mod.HostRing)
    kind = "resident" if "resident" in name else "gpu_updated"

    class MutantHomes(Homes):
        kinds = {**Homes.kinds, kind: mod.Resident if kind == "resident" else mod.GpuUpdated}

    def handed(resident, gpu_updated):
        return dict(homes=MutantHomes(resident, gpu_updated), resident_units=0, gpu_updated_units=0)
    handed.kind = kind
    return handed


# in the order that finds each deleted wait of test_every_event_wait_is_needed_and_caught in the fewest runs (23;
# 31 in the order of the engine's features)
CONFIGS = [dict(micro_batches=1, grad_clip=0.0, skip_nonfinite=True),
           dict(micro_batches=2, grad_clip=1.0, gpu_updated_units=99),     # every streamed unit updated on the GPU
           dict(micro_batches=2, grad_clip=0.0, offload_activations=True),
           dict(micro_batches=1, grad_clip=1.0, offload_activations=True),
           dict(micro_batches=2, grad_clip=0.0, mode="lean", dtype=torch.bfloat16),
           dict(micro_batches=2, grad_clip=0.0, resident_units=2),     # the embedding and layer 0 on the GPU
           dict(micro_batches=1, grad_clip=1.0, resident_units=99),    # every unit: resident training
           dict(micro_batches=1, grad_clip=0.0, gpu_updated_units=3, mode="lean", dtype=torch.bfloat16)]


def races_of(mutated, wanted=lambda race: True):
    """The races a mutant engine shows in the first of CONFIGS that shows a `wanted` one (a home's: those that hold
    it)."""
    for kw in CONFIGS:
        if callable(mutated):   # a home: the configurations with its units
            counts = kw.get("resident_units", 0), kw.get("gpu_updated_units", 0)
            if not counts[0 if mutated.kind == "resident" else 1]:
                continue
            made = mutated(*counts)
        elif "activations" in mutated:
            made = dict(mutated, activations=mutated["activations"]())
        else:
            made = mutated
        c = checked(**{**kw, **made})
        if any(map(wanted, c.races)):
            return c.races
    return []


@pytest.mark.slow
@pytest.mark.parametrize("kw", CONFIGS, ids=[f"config-{k}" for k in range(len(CONFIGS))])
def test_the_mutants_configurations_are_race_free(kw):
    """A race races_of finds in a mutant is the mutant's: the engine as it is shows none in any of CONFIGS."""
    c = checked(**kw)
    assert not c.races, c.summary()


WAITS = [(name, line.strip()) for name, src in SOURCES.items() for line in src.splitlines()
         if re.search(r"\.wait_event\(|host_wait\(", line) and "def " not in line
         and "self.stream." not in line]   # Lane's own call of CUDA's: what every wait above runs


@pytest.mark.slow
def test_every_event_wait_is_needed_and_caught():
    """Delete each event wait of stream.py and of the activations' ring in turn: the checker must report a race
    naming a buffer."""
    assert len(WAITS) >= 12, WAITS
    missed = []
    for k, (name, line) in enumerate(WAITS):
        found = races_of(mutant(line, nth=WAITS[:k].count((name, line)), name=name))
        print(f"{name}: {line:<50} -> {sorted({r['buffer'][:40] for r in found})[:3]}")
        if not found:
            missed.append(line)
    assert not missed, f"deleting these waits went unnoticed: {missed}"


@pytest.mark.slow
@pytest.mark.parametrize("old,nth,new,buffer,what", [
    ("self.h2d.wait_event(self.slot_free[slot])", 0, None, "wslot", "write on h2d"),   # refill a slot in use
    ("self.comp.wait_event(self.slot_loaded[s])", 0, None, "wslot", "read on compute"),  # half-copied weights
    ("self.comp.wait_event(self.gslot_free[gs])", 0, None, "gslot", "on compute"),   # a slot zeroed before its D2H
    ("t.lanes.host_wait(ready)", 0, None, "grad[", "on worker"),               # AdamW before the gradient landed
    ("t.h2d.wait_event(self.free[r])", 0, None, "activations (pinned)", "on h2d"),   # reload before it landed
    ("t.d2h.uses(x)", 0, None, "block_grad", "freed on the host while d2h"),   # a record_stream dropped (dy)
    ("with self.comp():", 0, "        if True:\n", "gslot", "made outside any lane"),  # __init__'s slots zeroed on the default stream
    ("self.lanes.host_wait(loss_ready)", 0, None, "loss", "on main"),            # the loss read before its event
    ("out = torch.empty(host.shape", 0,                                          # an upload allocated on compute,
     "            with self.comp(): out = torch.empty(host.shape, dtype=host.dtype, device=self.dev)  # noqa\n",
     "upload", "first touch on h2d of a block allocated on compute"),           # written on H2D
])
def test_seeded_defect_is_reported_with_its_buffer(old, nth, new, buffer, what):
    name = next(n for n, src in SOURCES.items() if old in src)   # StopIteration: the engine changed, update this
    found = races_of(mutant(old, new, nth, name), wanted=lambda r: buffer in r["buffer"] and what in r["what"])
    assert found, (f"no configuration shows a race of {buffer} ({what}); the first that shows any: "
                   f"{[(r['buffer'], r['what']) for r in races_of(mutant(old, new, nth, name))]}")


@pytest.mark.slow
def test_cli_clean_run_lists_syncs_and_counts_copies():
    r = train_py("check", "--config", "toy", "--micro-batches", "2", module="megatrain_min.sim")
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "races: 0" in r.stdout and "host syncs on the main thread" in r.stdout
    L = TOY.n_layer
    copies = ", ".join([f"layer.{i} x2" for i in range(L - 1)] + [f"layer.{L - 1} x1", "head x1"])
    assert r.stdout.count(f"weight copies: {copies}") == 2, "every layer twice but the last, the head once, per step"
    assert "main   1 x host_wait(event) at stream.py" in r.stdout   # the step's one host sync: its loss


@pytest.mark.slow
def test_cli_exit_code_and_bad_input():
    r = train_py("check", "--config", "nope", module="megatrain_min.sim")
    assert r.returncode == 2 and "unknown preset" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- the sharded engine's comm lane
SHARDED = (ROOT / "megatrain_min" / "engine" / "sharded.py").read_text()
SHARDED_CONFIGS = [dict(micro_batches=2, grad_clip=1.0), dict(micro_batches=1, grad_clip=0.0, skip_nonfinite=True),
                   dict(micro_batches=2, grad_clip=0.0, mode="lean", dtype=torch.bfloat16)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A gloo process group of one rank in this process: ShardedTrainer's collectives run (trivially) and the
    checker sees them as ops of the comm lane (cost.COLLECTIVES: what each writes)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/init", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_races(cls):
    for kw in SHARDED_CONFIGS:
        c = race.Checker()
        record.run(SPECIAL, [c], 2, trainer_cls=cls, batch=(4, 16), between=between, **kw)
        if c.races:
            return c.races
    return []


@pytest.mark.slow
def test_sharded_engine_is_race_free_and_every_comm_wait_is_needed(one_rank):
    """sharded.ShardedTrainer on checked lanes (one rank: the schedule and its events are those of N): clean in
    three settings; each event wait of sharded.py deleted in turn is reported as a race. (Its Lane.uses calls are
    not needed by this schedule: the host's wait at the end of a step orders the next allocation after them.)"""
    from megatrain_min.engine import sharded
    assert sharded_races(sharded.ShardedTrainer) == []
    waits = [line.strip() for line in SHARDED.splitlines()
             if re.search(r"\.wait_event\(|host_wait\(", line) and "def " not in line]
    assert len(waits) >= 12, waits
    missed, lines = [], SHARDED.splitlines(keepends=True)
    for k, line in enumerate(waits):
        nth = waits[:k].count(line)
        i = [i for i, text in enumerate(lines) if text.strip() == line][nth]
        mut = lines[:i] + [re.match(r"\s*", lines[i]).group(0) + "pass  # deleted by the test\n"] + lines[i + 1:]
        mod = types.ModuleType("sharded_mutant")
        exec(compile("".join(mut), str(ROOT / "megatrain_min" / "engine" / "sharded.py"), "exec"), mod.__dict__)
        found = sharded_races(mod.ShardedTrainer)
        print(f"{line[:50]:<50} -> {sorted({r['buffer'][:30] for r in found})[:3]}")
        if not found:
            missed.append(line)
    assert not missed, f"deleting these waits went unnoticed: {missed}"
