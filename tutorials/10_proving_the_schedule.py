# %% [markdown]
# # Lesson 10 -- proving the schedule on a CPU
#
# **What you will learn**
#
# * what "happens before" means, checked by hand on a three-op log (reachability over program order
#   and events), then by the project's checker on the same log: the same verdicts;
# * how to prove the engine's ordering without a GPU: run the real `stream.Trainer` on *checked
#   lanes*, where every aten op knows its stream and every wait is a happens-before edge -- then
#   break one wait and read the checker's report;
# * the **twin**: the same engine at full size on fake tensors, replayed on an H100 profile -- a
#   Llama-2-7B step drawn in ASCII, its step time, what bounds it, and the planner's numbers beside
#   it;
# * (with CUDA) the same picture from a real `torch.profiler` trace.
#
# Lesson 4 built the ping-pong by hand and checked the order of the few ops it logged itself. The
# engine has more on its lanes -- boundary activations offloaded through a device ring, gradient
# slabs, tiles -- and lessons 6-9 scaled it up. Here the same two questions -- is every access
# ordered, and how long does a step take -- are answered for the engine itself, every aten op it
# runs, at any size.
#
# Run it: `python tutorials/10_proving_the_schedule.py` (~7 s on a 2-core CPU).

# %%
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = (Path(__file__).resolve().parents[1] if "__file__" in globals()   # a script, or a notebook
        else Path.cwd().resolve().parent)                                 # run from tutorials/
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
import stream  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402
from megatrain_min.engine.checks import CheckedTrainer  # noqa: E402
from megatrain_min.plan import hardware  # noqa: E402
from megatrain_min.sim import race, record, twin  # noqa: E402

# %% [markdown]
# ## 1. Happens-before by hand: three ops, two lanes
#
# The question the checker answers, on the smallest log that can go wrong: the h2d lane copies a
# layer into weight slot 0, the compute lane computes from it, the h2d lane copies the next layer
# into the same slot. Events order them: `loaded` (h2d -> compute), `free` (compute -> h2d). An op
# happens before another when a chain of edges leads from one to the other -- each lane's program
# order, and each event from its record to its waits. Two ops on different lanes that touch the same
# buffer, one writing, with no chain either way, race. Reachability by depth-first search:

# %%
def races_by_hand(log):
    """log: ("op", lane, name, reads, writes) | ("record", lane, event) | ("wait", lane, event).
    Returns [(buffer, first op, second op)] of the conflicting pairs no chain of edges orders."""
    after, last, recorded = {i: set() for i in range(len(log))}, {}, {}
    for i, (kind, lane, *rest) in enumerate(log):
        if lane in last:
            after[last[lane]].add(i)                  # program order on a lane
        last[lane] = i
        if kind == "record":
            recorded[rest[0]] = i
        elif kind == "wait":
            after[recorded[rest[0]]].add(i)           # the event's record, then its wait

    def reaches(a, b):
        todo, seen = [a], {a}
        while todo:
            x = todo.pop()
            if x == b:
                return True
            for y in after[x] - seen:
                seen.add(y)
                todo.append(y)
        return False

    ops = [(i, e) for i, e in enumerate(log) if e[0] == "op"]
    found = []
    for k, (i, (_, la, na, ra, wa)) in enumerate(ops):
        for j, (_, lb, nb, rb, wb) in ops[k + 1:]:
            shared = set(wa) & (set(rb) | set(wb)) | set(ra) & set(wb)
            if la != lb and shared and not reaches(i, j) and not reaches(j, i):
                found += [(buf, na, nb) for buf in sorted(shared)]
    return found


LOG = [("op", "h2d", "copy layer 1", ["shadow[layer.1]"], ["wslot[0]"]),
       ("record", "h2d", "loaded"), ("wait", "compute", "loaded"),
       ("op", "compute", "block layer 1", ["wslot[0]"], ["x"]),
       ("record", "compute", "free"), ("wait", "h2d", "free"),
       ("op", "h2d", "copy layer 3", ["shadow[layer.3]"], ["wslot[0]"])]
FORGETFUL = [e for e in LOG if e != ("wait", "h2d", "free")]     # h2d forgets to wait
by_hand = {name: races_by_hand(log) for name, log in (("ordered", LOG), ("forgetful", FORGETFUL))}
print("by hand:", by_hand)

# %% [markdown]
# The real checker (`megatrain_min/sim/race.py`) answers the same question with vector clocks, as
# PyTorch's CUDA sanitizer does, over the stream of ops and edges that `megatrain_min/sim/record.py`
# records from the engine. Handed the same seven entries as that stream's objects, it must give the
# same verdicts:

# %%
class Names:                                      # the checker names a buffer through its recorder
    name_of = staticmethod(lambda st: st.name)


def races_by_race_py(log):
    checker, buffers, events = race.Checker(), {}, {}
    checker.attach(Names())
    where = lambda b: "pinned" if b.startswith("shadow") else "device"   # noqa: E731
    storage = lambda b: buffers.setdefault(b, record.Storage(            # noqa: E731
        len(buffers) + 1, None, 1 << 20, where(b), "h2d", "the log", name=b))
    for kind, lane, *rest in log:
        if kind == "op":
            name, reads, writes = rest
            checker.op(record.Op(lane, name, [(storage(b), 0, 1 << 20) for b in reads],
                                 [(storage(b), 0, 1 << 20) for b in writes], f"LOG: {name}",
                                 "h2d" if lane == "h2d" else "compute"))
        elif kind == "record":
            events[rest[0]] = record.SimEvent(len(events) + 1, lane)
            checker.record(lane, events[rest[0]])
        else:
            checker.wait(lane, events[rest[0]])
    return [(r["buffer"], r["first"]["op"], r["second"]["op"]) for r in checker.races]


by_race_py = {name: races_by_race_py(log) for name, log in (("ordered", LOG),
                                                              ("forgetful", FORGETFUL))}
print("race.py:", by_race_py)

# %% [markdown]
# The ordered log has no race; without the h2d lane's wait for `free`, the next copy overwrites
# `wslot[0]` while the compute lane may still read it -- both checkers say so, naming the same pair.
# Now the same checker on the whole engine.
#
# ## 2. Checked lanes: the real engine, every op on a stream
#
# `stream.Trainer` asks its hardware for lanes (`stream.Lanes`: three streams, the host's waits, the
# optimizer thread). `megatrain_min.sim.record` hands it another backend with the same methods: each
# lane has an identity, a TorchDispatchMode attributes every aten op to a lane (or to the main /
# optimizer thread) with the bytes it reads and writes, and every record, wait, host wait, future
# and gradient-slab hand-off is an edge.
# `race.Checker` keeps a vector clock per lane and thread, as lesson 4's checker did for its own log
# (and as PyTorch's CUDA sanitizer does on a GPU): two accesses to the same bytes, one a write, from
# two lanes with no edge between them, is a race. The engine runs unchanged. Two steps of the toy
# model, 2 micro-batches, boundary activations offloaded through the device ring:

# %%
cfg = model.PRESETS["toy"]
clean = race.Checker()
record.run(cfg, [clean], 2, batch=(4, 16), micro_batches=2, offload_activations=True, grad_clip=0.0)
print(clean.summary())

# %% [markdown]
# No races. Per step the main thread syncs with the device once (`host_wait`: the loss) and waits
# for the optimizer thread at each gradient slab it takes; the weight copies are what lesson 4 drew:
# every layer twice (forward, backward) but the last, which is still in its slot when the backward
# starts, and the head once.
#
# ## 3. A deliberately broken engine
#
# The same slip as in lesson 4, now in the engine: an h2d lane that ignores every event it is told
# to wait for.

# %%
class ForgetfulLanes(record.SimLanes):
    def __init__(self, rec):
        super().__init__(rec)
        self.h2d.wait_event = lambda event: None     # the h2d stream waits for nothing


class ForgetfulTrainer(stream.Trainer):
    def __init__(self, cfg, weights, lanes=None, **kw):
        super().__init__(cfg, weights, lanes=ForgetfulLanes(lanes.rec), **kw)


broken = race.Checker()
record.run(cfg, [broken], 1, trainer_cls=ForgetfulTrainer, batch=(4, 16), micro_batches=2,
           offload_activations=True, grad_clip=0.0)
print("\n".join(broken.summary().splitlines()[:9]))

# %% [markdown]
# `wslot[0]` is the first weight slot: the compute lane read it (`model.py`: the first ops of a
# layer) and the h2d lane wrote it (`stream.py`, `load_unit`) with no happens-before edge between
# them -- on a GPU the copy of layer i+2 could overwrite the weights layer i is still computing
# with. Each report names the buffer, both ops, both lanes and both source lines. The test suite
# deletes every event wait of `stream.py` in turn and asserts the checker catches each
# (`tests/sim/test_sim.py`): none is redundant, none can go missing unnoticed.
#
# ## 4. The twin: a Llama-2-7B step on an H100
#
# The same recorder runs the engine under FakeTensorMode: tensors have shapes and dtypes but no
# data, so a 7B layer costs nothing to "allocate". `twin.Twin` replays the op stream on a hardware
# profile from
# `megatrain_min.plan.hardware.HARDWARE`: each lane in issue order, each op at the roofline (FLOPs
# at the achievable FLOP/s, bytes at the HBM bandwidth), copies at the link bandwidth, the host
# issuing every op, the optimizer thread's AdamW at DRAM speed. Four of the 32 layers, at 4 x 4096
# and 8 x 4096 tokens per step:

# %%
C7 = dataclasses.replace(model.PRESETS["7b"], n_layer=4)
H100 = hardware.HARDWARE["h100"]


def predicted(B, T=4096):
    # all streamed
    p = planner.plan(C7, "h100", batch_size=B, seq_len=T, grad_clip=0.0, resident_units=0)
    tw = twin.Twin(dict(H100, name="h100"))
    record.run(C7, [tw], 3, fake=True, sources=False, costs=True, batch=(B, T),
               dtype=torch.bfloat16, grad_clip=0.0, grad_slabs=p["grad_slabs"], skip_nonfinite=True,
               offload_activations=p["offload_activations"])
    return tw, tw.result_of(C7, B * T), p


MARK = {"host": ".", "h2d": ">", "compute": "#", "d2h": "<", "cpu_adam": "a"}


def render(tw, width=96):
    """One step of the replay (between the starts of its last two steps) as ASCII, a row per
    lane."""
    t0, t1 = tw.first_compute[-3].start, tw.first_compute[-2].start
    rows = []
    for lane, mark in MARK.items():
        row = [" "] * width
        for s in tw.spans:
            if s.actor == lane and s.label != "wait" and s.end > t0 and s.start < t1:
                a, b = (int((min(max(t, t0), t1) - t0) / (t1 - t0) * width)
                        for t in (s.start, s.end))
                row[a:max(a + 1, b)] = mark * (max(a + 1, b) - a)
        rows.append(f"  {lane:<8}|" + "".join(row) + "|")
    return "\n".join(rows)


timelines = {}                       # B -> (twin, its result, the plan): make_figures.py draws them
for B in (4, 8):
    tw, r, p = timelines[B] = predicted(B)
    print(f"\n{B} x 4096 tokens: step {r['step_time_s'] * 1e3:.0f} ms (planner: "
          f"{p['step_time_s'] * 1e3:.0f} ms), GPU busy {r['overlap']:.0%}, bottleneck "
          f"{r['bottleneck']}, peak GPU memory {r['peak_gpu_bytes'] / 1e9:.1f} GB")
    print(render(tw))

# %% [markdown]
# `#` compute, `>` h2d, `<` d2h, `a` the CPU's AdamW, `.` the host issuing ops -- lesson 4's
# timeline with real durations:
#
# * **4 x 4096** -- the step opens with the GPU idle: the backward runs L-1 .. 0, so layer 0 is
#   updated last, and the next forward starts with layer 0's copy, which waits for that update
#   (lesson 4's bubble). With four layers that is a fifth of the step; the CPU AdamW (~38 B/param of
#   DRAM traffic) is busy most of it.
# * **8 x 4096** -- twice the tokens per layer visit: every copy hides under a longer compute, the
#   compute row is nearly solid, and each update finishes while the GPU is still working on lower
#   layers.
#
# The planner (`megatrain_min/plan/timing.py`) models the same schedule analytically; the two are
# independent and agree to a few tenths of a percent (`bench/twin_vs_plan.py`). All 32 layers of the
# 7B model, from the planner:

# %%
for B in (1, 4, 8):
    p = planner.plan(model.PRESETS["7b"], "h100", batch_size=B, seq_len=4096, grad_clip=0.0,
                     resident_units=0)
    print(f"{B} x 4096 tokens, 32 layers: step {p['step_time_s']:5.2f} s, "
          f"{p['tokens_per_s']:6,.0f} tokens/s, GPU busy {p['utilization']['compute']:.0%}, bound "
          f"by {p['bottleneck']}")

# %% [markdown]
# At 32 layers the bubble is a small part of the step, and lesson 5's rule -- tokens per layer visit
# >= F * bytes / (2 * BW) -- decides whether the copies hide. `python tutorials/make_figures.py`
# draws the two replays above:
#
# ![twin timeline](figures/timeline.png)
#
# ## 5. On a GPU: the real timeline
#
# With CUDA, profile one step of `stream.Trainer` (after a warm-up step) on a small model and draw
# the same ASCII picture from the trace: every kernel and copy the GPU ran, by stream. The trace is
# written as JSON; open it in https://ui.perfetto.dev (`python train.py --profile` does this for a
# training run).

# %%
def profile_rows(trace_path, width=96):
    """Busy intervals per CUDA stream from a Chrome trace: kernels '#', H2D '>', D2H '<', memset
    '.'."""
    events = [e for e in json.load(open(trace_path))["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        print("  the trace holds no GPU activity (is CUPTI available?); open it "
              "in Perfetto to see why")
        return 0.0, None
    t0, t1 = min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)
    rows, busy = {}, {}
    for e in events:
        sid = e.get("args", {}).get("stream", e.get("tid"))
        row = rows.setdefault(sid, [" "] * (width + 1))
        mark = "#" if e["cat"] == "kernel" else "." if e["cat"] == "gpu_memset" else \
            ">" if "HtoD" in e["name"] else "<" if "DtoH" in e["name"] else "="
        a, b = int((e["ts"] - t0) / (t1 - t0) * width), int(
            (e["ts"] + e["dur"] - t0) / (t1 - t0) * width)
        row[a:max(a + 1, b)] = mark * (max(a + 1, b) - a)
        busy[sid] = busy.get(sid, 0.0) + e["dur"]
    for sid in sorted(rows):
        print("  stream "
              f"{str(sid):<4}" + "".join(rows[sid]).rstrip() + f"   busy {busy[sid] / 1e3:.1f} ms")
    return (t1 - t0) / 1e3, len(rows)


n_streams = None
if torch.cuda.is_available():
    gcfg = dataclasses.replace(model.PRESETS["toy"], n_layer=6, d_model=1024, n_head=8, n_kv_head=8,
                               d_ff=2816)
    # the engine as train.py builds it (CheckedTrainer: its host buffers page-locked exactly)
    gt = CheckedTrainer(gcfg, model.init_weights(gcfg, 0), device="cuda", micro_batches=2)
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 256, (8, 512), generator=gen),
             torch.randint(0, 256, (8, 512), generator=gen))
    gt.step(*batch)                                   # warm-up: allocations, kernel selection
    gt.wait()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        gt.step(*batch)
        gt.wait()
    trace = os.path.join(tempfile.gettempdir(), "megatrain_min_lesson10_trace.json")
    prof.export_chrome_trace(trace)
    print(f"real step on {torch.cuda.get_device_name()} (6 layers, d=1024, 8 x 512 "
          f"tokens): trace {trace}")
    span_ms, n_streams = profile_rows(trace)
    if n_streams:
        print(f"  GPU span {span_ms:.1f} ms on {n_streams} streams")
else:
    print("no CUDA: no real profile (the twin above replays the same op stream)")

# %% [markdown]
# ## Check
#
# * the engine on checked lanes has no race, one device sync per step, and the schedule's weight
#   copies;
# * on the three-op log, the reachability check by hand and `race.Checker` give the same verdicts:
#   no race when ordered, the same pair on `wslot[0]` without the h2d lane's wait;
# * an h2d lane that does not wait is caught, naming the weight slot it races on;
# * the twin and the planner agree on the step time within 10%, overlap pays (the GPU computes most
#   of the 8 x 4096 step), and with CUDA the trace shows work on at least 3 streams.

# %%
assert by_hand == by_race_py and not by_hand["ordered"], (by_hand, by_race_py)
assert by_hand["forgetful"] == [("wslot[0]", "block layer 1", "copy layer 3")], by_hand
assert not clean.races and len(clean.steps) == 3
for s in clean.steps[:2]:
    assert sum(n for where, n in s["syncs"].items() if where.startswith("host_wait")) == 1
    assert s["copies"] == {f"layer.{i}": 2 for i in range(cfg.n_layer - 1)} | {
        f"layer.{cfg.n_layer - 1}": 1, "head": 1}
assert any(r["buffer"].startswith("wslot") for r in broken.races), broken.summary()
for B, (tw, r, p) in timelines.items():
    assert 0.9 <= r["step_time_s"] / p["step_time_s"] <= 1.1, (B, r["step_time_s"],
                                                               p["step_time_s"])
assert timelines[8][1]["overlap"] >= 0.8 and timelines[8][1]["overlap"] > timelines[4][1]["overlap"]
assert n_streams is None or n_streams >= 3, n_streams
print("OK  three-op log: by hand == race.py; clean engine: 0 races; forgetful h2d lane: "
      f"{len(broken.races)} races, first on {broken.races[0]['buffer']}; twin/plan "
      f"{timelines[8][1]['step_time_s'] / timelines[8][2]['step_time_s']:.3f} at 8 x 4096, GPU "
      f"busy {timelines[8][1]['overlap']:.0%}")
