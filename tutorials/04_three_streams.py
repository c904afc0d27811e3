# %% [markdown]
# # Lesson 4 -- three streams, proven without a GPU
#
# **What you will learn**
#
# * how a GPU overlaps copies with compute: **streams** (queues that run concurrently) and **events**
#   (a marker one queue records and another waits for), and the engine's double buffer built on them;
# * how to prove the ordering on a laptop: run the real engine on *checked lanes*, where every op knows its
#   stream and every wait is a happens-before edge -- then break one wait and read the checker's report;
# * the **twin**: the same engine at full size on fake tensors, replayed on an H100 profile -- a timeline of a
#   Llama-2-7B step drawn in ASCII, the step time, and what bounds it;
# * (with CUDA) the same picture from a real `torch.profiler` trace.
#
# Lessons 2-3 gave us a schedule (forward, head, backward with recompute) and weights in host memory.
# Done naively -- copy, wait, compute, copy, wait, ... -- the GPU would idle during every copy.
#
# Run it: `python tutorials/04_three_streams.py` (half a minute on a CPU).

# %%
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1] if "__file__" in globals() else Path.cwd().resolve().parent
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
import stream  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402
from megatrain_min import race, sim, twin  # noqa: E402

# %% [markdown]
# ## 1. Streams, events, slots
#
# The engine (`stream.py`) issues work on three CUDA streams -- its *lanes*:
#
# * **H2D** copies a unit's flat buffer (lesson 1) from pinned host memory (lesson 3) into a weight slot;
# * **compute** runs `block` forward, the head, and the recompute + backward;
# * **D2H** copies each finished fp32 layer gradient back into the host store, where a CPU worker thread
#   runs AdamW on it (lesson 3) while the GPU moves on.
#
# Each stream runs its own work in order; different streams run concurrently. Correctness comes from events,
# each one line in `stream.py` (its docstring lists them all):
#
# | event | recorded on | waited on by | guarantees |
# |---|---|---|---|
# | `slot_loaded[s]` | H2D, after the copy into slot s | compute, before using slot s | never compute on half-copied weights |
# | `slot_free[s]` | compute, after the last use of slot s | H2D, before refilling slot s | never overwrite weights still in use |
# | `gslot_free[g]` | D2H, after the gradient copy out of grad slot g | compute, before zeroing grad slot g | never zero a gradient not yet saved |
# | `ring_ready` / `ring_free` | the writer / the reader of a checkpoint ring slot | the other | offloaded checkpoints pass through 2 device slots |
# | grad landed | D2H | the CPU worker (it waits on the host) | AdamW reads a complete gradient |
# | `loss_ready` | compute, after the loss reached pinned memory | the host | the loss is read after it is written |
#
# Without clipping, gradients land in one of a few pinned staging slabs; the worker hands a slab back after
# that unit's update and the engine's host thread waits for a free one before it queues the next gradient
# copy. Without CUDA, `stream.Lane` is a no-op and every copy is synchronous: the same code, in program
# order. So a laptop runs the *order* but not the *concurrency* -- a missing wait would pass every CPU test.

# %% [markdown]
# ## 2. Checked lanes: the real engine, every op on a stream
#
# `megatrain_min.sim` gives `stream.Trainer` another backend of its `Lanes`: each lane has an identity, a
# TorchDispatchMode attributes every aten op to a lane (or to the main / optimizer thread) with the bytes it
# reads and writes, and every record, wait, host wait, future and slab hand-off is an edge. `race.Checker`
# keeps a vector clock per lane and thread (PyTorch's CUDA sanitizer does the same on a GPU): two accesses to
# the same bytes, one a write, from two lanes with no edge between them, is a race. The engine runs
# unchanged. Two steps of the toy model, 2 micro-batches, checkpoints offloaded:

# %%
cfg = model.PRESETS["toy"]
clean = race.Checker()
sim.run(cfg, [clean], 2, batch=(4, 16), micro_batches=2, offload_checkpoints=True, grad_clip=0.0)
print(clean.summary())

# %% [markdown]
# No races. Per step the main thread syncs with the device once (`host_wait`: the loss) and waits for the
# optimizer thread at each staging slab it takes (without clipping, a gradient needs a free slab); the weight
# copies are what the schedule says: every layer twice (forward, backward) but the last, which is still in its
# slot when the backward starts, and the head once.
#
# ## 3. A deliberately broken engine
#
# Now an H2D lane that forgets its waits -- what a refactoring slip would do. `SimLanes` is the checked
# backend; we make one whose H2D lane ignores every event it is told to wait for:

# %%
class ForgetfulLanes(sim.SimLanes):
    def __init__(self, rec, device_bytes=None):
        super().__init__(rec, device_bytes)
        self.h2d.wait = lambda event: None           # the H2D stream no longer waits for anything


class ForgetfulTrainer(stream.Trainer):
    def __init__(self, cfg, weights, lanes=None, **kw):
        super().__init__(cfg, weights, lanes=ForgetfulLanes(lanes.rec), **kw)


broken = race.Checker()
sim.run(cfg, [broken], 2, trainer_cls=ForgetfulTrainer, batch=(4, 16), micro_batches=2, offload_checkpoints=True,
        grad_clip=0.0)
print("\n".join(broken.summary().splitlines()[:9]))

# %% [markdown]
# Read the report. `wslot[0]` is the first weight slot: the compute lane read it (`model.py`: the first ops of
# a layer, its norm and projections) and the H2D lane wrote it (`stream.py`, `_load`) with no happens-before
# edge between the two -- on a GPU the copy of layer i+2 could overwrite the weights layer i is still
# computing with. Each report names the buffer, both ops, both lanes and both source lines. The
# test suite deletes every event wait of `stream.py` in turn and asserts the checker catches each
# (`tests/test_sim.py`): none of them is redundant, and none can go missing unnoticed.
#
# ## 4. The twin: a Llama-2-7B step on an H100
#
# The same recorder runs the engine under FakeTensorMode: tensors have shapes and dtypes but no data, so a
# 7B layer costs nothing to "allocate". `twin.Twin` replays the op stream on a hardware profile from
# `megatrain_min.plan.HARDWARE`: each stream in issue order, each op at the roofline (FLOPs at the achievable
# FLOP/s, bytes at the HBM bandwidth), copies at the link bandwidth, the host issuing every op (~10 us each on
# the CPU it was measured on: lesson 5's host lane), the optimizer thread's AdamW at DRAM speed. Four of the
# 32 layers, at 4 x 4096 and 8 x 4096 tokens per step:

# %%
C7 = dataclasses.replace(model.PRESETS["7b"], n_layer=4)
H100 = planner.HARDWARE["h100"]


def predicted(B, T=4096):
    p = planner.plan(C7, "h100", batch_size=B, seq_len=T, grad_clip=0.0)
    tw = twin.Twin(dict(H100, name="h100"))
    sim.run(C7, [tw], 3, fake=True, sources=False, costs=True, batch=(B, T), dtype=torch.bfloat16, grad_clip=0.0,
            staging_slabs=p["staging_slabs"], skip_nonfinite=True, offload_checkpoints=p["offload_checkpoints"])
    return tw, tw.result_of(C7, B * T), p


MARK = {"host": ".", "h2d": ">", "compute": "#", "d2h": "<", "cpu_adam": "a"}


def render(tw, width=96):
    """One step of the replay (between the starts of its last two steps) as ASCII, a row per lane."""
    t0, t1 = tw.first_compute[-3].start, tw.first_compute[-2].start
    rows = []
    for lane, mark in MARK.items():
        row = [" "] * width
        for s in tw.spans:
            if s.actor == lane and s.label != "wait" and s.end > t0 and s.start < t1:
                a, b = int((max(s.start, t0) - t0) / (t1 - t0) * width), int((min(s.end, t1) - t0) / (t1 - t0) * width)
                row[a:max(a + 1, b)] = mark * (max(a + 1, b) - a)
        rows.append(f"  {lane:<8}|" + "".join(row) + "|")
    return "\n".join(rows)


timelines = {}
for B in (4, 8):
    tw, r, p = predicted(B)
    timelines[B] = (tw, r, p)
    print(f"\n{B} x 4096 tokens: step {r['step_time_s'] * 1e3:.0f} ms (plan.py: {p['step_time_s'] * 1e3:.0f} ms), GPU busy "
          f"{r['overlap']:.0%}, bottleneck {r['bottleneck']}, peak GPU memory {r['peak_gpu_bytes'] / 1e9:.1f} GB")
    print(render(tw))

# %% [markdown]
# Read the two pictures (`#` compute, `>` H2D, `<` D2H, `a` the CPU's AdamW, `.` the host issuing ops):
#
# * **4 x 4096** -- the step opens with the GPU idle: without clipping, layer 0 is updated last (the backward
#   runs L-1 .. 0), and the next forward starts with layer 0's copy, which waits for that update. With four
#   layers that bubble is a fifth of the step; the CPU AdamW (~38 B/param of DRAM traffic) is busy most of it.
# * **8 x 4096** -- twice the tokens per layer visit: every copy hides under a longer compute, the compute
#   row is nearly solid, and each update finishes while the GPU is still working on lower layers.
#
# The planner (`plan.py`) models the same schedule analytically; the two are independent and agree to a few
# tenths of a percent (`bench/twin_vs_plan.py`: every row of the README's 100b/120b table). All 32 layers of
# the 7B model, from the planner, which answers in milliseconds:

# %%
for B in (1, 4, 8):
    p = planner.plan(model.PRESETS["7b"], "h100", batch_size=B, seq_len=4096, grad_clip=0.0)
    print(f"{B} x 4096 tokens, 32 layers: step {p['step_time_s']:5.2f} s, {p['tokens_per_s']:6,.0f} tokens/s, "
          f"GPU busy {p['utilization']['compute']:.0%}, bound by {p['bottleneck']}")

# %% [markdown]
# Lesson 5 turns this into the rule "tokens per layer visit >= F * bytes / (2 * BW)".
#
# ![twin timeline](figures/timeline.png)
#
# (`python tutorials/make_figures.py` draws these two replays.)
#
# ## 5. On a GPU: the real timeline
#
# With CUDA, profile one step of `stream.Trainer` (after a warm-up step) on a small model and draw the
# same ASCII picture from the trace: every kernel and copy the GPU ran, by stream. The full trace is
# written as JSON; open it in https://ui.perfetto.dev to see the same rows (`python train.py --profile`
# does this for a training run, the optimizer thread included).

# %%
def profile_rows(trace_path, width=96):
    """Busy intervals per CUDA stream from a Chrome trace: kernels '#', H2D '>', D2H '<', memset '.'."""
    events = [e for e in json.load(open(trace_path))["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        print("  the trace holds no GPU activity (is CUPTI available?); open it in Perfetto to see why")
        return 0.0, None
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    rows, busy = {}, {}
    for e in events:
        sid = e.get("args", {}).get("stream", e.get("tid"))
        row = rows.setdefault(sid, [" "] * (width + 1))
        mark = "#" if e["cat"] == "kernel" else "." if e["cat"] == "gpu_memset" else \
            ">" if "HtoD" in e["name"] else "<" if "DtoH" in e["name"] else "="
        a, b = int((e["ts"] - t0) / (t1 - t0) * width), int((e["ts"] + e["dur"] - t0) / (t1 - t0) * width)
        for c in range(a, max(a + 1, b)):
            row[c] = mark
        busy[sid] = busy.get(sid, 0.0) + e["dur"]
    for sid in sorted(rows):
        print(f"  stream {str(sid):<4}" + "".join(rows[sid]).rstrip() + f"   busy {busy[sid] / 1e3:.1f} ms")
    return (t1 - t0) / 1e3, len(rows)


if torch.cuda.is_available():
    gcfg = dataclasses.replace(model.PRESETS["toy"], n_layer=6, d_model=1024, n_head=8, n_kv_head=8, d_ff=2816)
    gt = stream.Trainer(gcfg, model.init_weights(gcfg, 0), device="cuda", micro_batches=2)
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 256, (8, 512), generator=gen), torch.randint(0, 256, (8, 512), generator=gen))
    gt.step(*batch)                                   # warm-up: allocations, kernel selection
    gt.weights()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        gt.step(*batch)
        gt.weights()
        torch.cuda.synchronize()
    trace = os.path.join(tempfile.gettempdir(), "megatrain_min_lesson04_trace.json")
    prof.export_chrome_trace(trace)
    print(f"real step on {torch.cuda.get_device_name()} (6 layers, d=1024, 8 x 512 tokens): trace {trace}")
    span_ms, n_streams = profile_rows(trace)
    if n_streams:
        print(f"  GPU span {span_ms:.1f} ms on {n_streams} streams")
else:
    n_streams = None
    print("no CUDA: skipping the real profile (the twin above replays the same op stream)")

# %% [markdown]
# ## Check
#
# * the engine on checked lanes has no race, one device sync per step, and the schedule's weight copies;
# * an H2D lane that does not wait is caught, naming the weight slot it races on;
# * the twin and the planner agree on the step time within 10%, overlap pays (the GPU computes most of the
#   8 x 4096 step), and with CUDA the trace shows work on at least 3 streams.

# %%
assert not clean.races and len(clean.steps) == 3
for s in clean.steps[:2]:
    assert sum(n for where, n in s["syncs"].items() if where.startswith("host_wait")) == 1
    assert s["copies"] == {f"layer.{i}": 2 for i in range(cfg.n_layer - 1)} | {f"layer.{cfg.n_layer - 1}": 1, "head": 1}
assert any(r["buffer"].startswith("wslot") for r in broken.races), broken.summary()
for B, (tw, r, p) in timelines.items():
    assert 0.9 <= r["step_time_s"] / p["step_time_s"] <= 1.1, (B, r["step_time_s"], p["step_time_s"])
assert timelines[8][1]["overlap"] >= 0.8 and timelines[8][1]["overlap"] > timelines[4][1]["overlap"]
if n_streams is not None:
    assert n_streams >= 3, n_streams
print(f"OK  clean engine: 0 races; forgetful H2D lane: {len(broken.races)} races, first on {broken.races[0]['buffer']}; "
      f"twin/plan {timelines[8][1]['step_time_s'] / timelines[8][2]['step_time_s']:.3f} at 8 x 4096, GPU busy "
      f"{timelines[8][1]['overlap']:.0%}")
