# %% [markdown]
# # Lesson 4 -- three streams and a double buffer
#
# **What you will learn**
#
# * how a GPU overlaps copies with compute: **streams** (queues that run concurrently) and **events**
#   (a marker one queue records and another waits for);
# * the engine's double buffer: two weight slots on the GPU, layer i computing from one while layer
#   i+1 is copied into the other -- and the two events per slot that make this safe;
# * the timeline of one training step, built from the engine's own rules by a small simulator and
#   printed as ASCII, for a PCIe-bound and a compute-bound setting;
# * (with CUDA) the same picture from a real `torch.profiler` trace of `stream.Trainer`.
#
# Lessons 2-3 gave us a schedule (forward, head, backward with recompute) and weights in host memory.
# Done naively -- copy, wait, compute, copy, wait, ... -- the GPU would idle during every copy.
#
# Run it: `python tutorials/04_three_streams.py` (a few seconds on a CPU).

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

# %% [markdown]
# ## 1. Streams, events, slots
#
# The engine (`stream.py`) issues work on three CUDA streams:
#
# * **H2D** copies a unit's flat buffer (lesson 1) from pinned host memory (lesson 3) into a weight slot;
# * **compute** runs `block` forward, the head, and the recompute + backward;
# * **D2H** copies each finished fp32 layer gradient back into the host store, where a CPU worker thread
#   runs AdamW on it (lesson 3) while the GPU moves on.
#
# Each stream runs its own work in order; different streams run concurrently. Correctness comes from
# four kinds of event, each one line in `stream.py`:
#
# | event | recorded on | waited on by | guarantees |
# |---|---|---|---|
# | `slot_loaded[s]` | H2D, after the copy into slot s | compute, before using slot s | never compute on half-copied weights |
# | `slot_free[s]` | compute, after the last use of slot s | H2D, before refilling slot s | never overwrite weights still in use |
# | `gslot_free[g]` | D2H, after the gradient copy out of grad slot g | compute, before zeroing grad slot g | never zero a gradient not yet saved |
# | D2H done | D2H | the CPU worker (`event.synchronize()`) | AdamW reads a complete gradient |
#
# Without clipping, gradients land in one of 3 pinned staging slabs (lesson 3); the worker hands a slab
# back after that unit's update (a `queue.Queue`), and the engine's host thread waits for a free one
# before it queues the next gradient copy -- the fifth ordering rule, and the only one on the host.
#
# Without CUDA, `stream.Lane` is a no-op and every copy is synchronous: the same code, in program order.
# So the *order* of operations is the same on a laptop -- we record it below -- only the overlap is
# missing. We recover the overlap with a simulator that follows the engine's rules.

# %% [markdown]
# ## 2. A simulator of one training step
#
# Each operation has a stream ("lane"), a duration and the operations it waits for. A lane runs its
# operations in issue order, each starting when the lane is free *and* its events have fired. That is
# all a CUDA stream does. The CPU optimizer worker is a fourth lane.

# %%
def simulate(ops):
    """ops: list of dicts(lane, label, dur, deps=[indices]) in issue order. Adds start/end in place."""
    lane_free = {}
    for o in ops:
        o["start"] = max([lane_free.get(o["lane"], 0.0)] + [ops[d]["end"] for d in o["deps"]])
        o["end"] = o["start"] + o["dur"]
        lane_free[o["lane"]] = o["end"]
    return max(o["end"] for o in ops)


SLABS = 3                                            # stream.Trainer's pinned gradient staging slabs


def one_step(L, copy, fwd, bwd, d2h, adam, head_copy, head, head_d2h, slabs=SLABS):
    """The ops of one engine step (stream.Trainer.step, no clipping) for L layers. Durations in ms.

    Forward: layer i computes from slot i%2; the copy of the next unit goes into the other slot once the
    compute that last used it (layer i-1) is done. Head: forward + backward at once. Backward: layer L-1
    is still resident (no copy); layer i-1 is copied into the slot the previous visit freed. Grad slots
    alternate too: grad slot k%2 is zeroed only after the D2H of visit k-2 finished. Without clipping a
    gradient lands in one of `slabs` pinned staging slabs, which the worker frees after that unit's AdamW:
    gradient k needs the slab of update k-slabs. The engine waits for it on the host thread, so nothing
    issued after that point can start before it either (the `host` dependency below)."""
    ops, host = [], [None]                           # host[0]: the last host-side wait, gates all later ops

    def op(lane, label, dur, *deps):
        ops.append(dict(lane=lane, label=label, dur=dur, deps=[d for d in deps + (host[0],) if d is not None]))
        return len(ops) - 1

    user = [None, None]                              # last compute op that used each weight slot
    load = {0: op("H2D", "0", copy)}
    for i in range(L):                               # ---- forward
        s = i % 2
        f = op("compute", f"{i}", fwd, load[i])
        user[s] = f
        nxt, dur = (i + 1, copy) if i + 1 < L else ("H", head_copy)
        load[nxt] = op("H2D", f"{nxt}", dur, user[1 - s])
    s = L % 2                                        # ---- head, forward and backward
    h = op("compute", "H+H'", head, load["H"])
    user[s] = h
    drained = [op("D2H", "gH", head_d2h, h)]         # grad visit k = 0
    updated = [op("CPU", "AH", adam * head_copy / copy, drained[0])]
    loaded = load[L - 1]
    for k, i in enumerate(reversed(range(L)), start=1):   # ---- backward, visit k = 1..L
        s = i % 2
        nxt_load = op("H2D", f"{i - 1}", copy, user[1 - s]) if i > 0 else None
        gfree = drained[k - 2] if k >= 2 else None
        b = op("compute", f"{i}'", bwd, loaded, gfree)
        user[s] = b
        if k >= slabs:                               # Trainer._host_grad: wait for a free staging slab
            host[0] = updated[k - slabs]
        drained.append(op("D2H", f"g{i}", d2h, b))
        updated.append(op("CPU", f"A{i}", adam, drained[-1]))
        loaded = nxt_load
    return ops


def render(ops, total, width=96, lanes=("H2D", "compute", "D2H", "CPU")):
    """ASCII timeline: one row per lane, each op as |label...| scaled to `width` characters."""
    rows = []
    for lane in lanes:
        row = [" "] * (width + 1)
        for o in ops:
            if o["lane"] != lane:
                continue
            a, b = round(o["start"] / total * width), round(o["end"] / total * width)
            cell = ("|" + o["label"] + "-" * width)[:max(1, b - a)]
            row[a:a + len(cell)] = cell
        rows.append(f"  {lane:<8}" + "".join(row).rstrip())
    return "\n".join(rows)

# %% [markdown]
# ## 3. Durations from first principles
#
# Take a Llama-2-7B layer (202M parameters; `model.units(PRESETS["7b"])`), a GPU sustaining 400 TFLOP/s
# in bf16, PCIe Gen5 at 55 GB/s each way, and a CPU whose AdamW streams 200 GB/s of DRAM traffic:
#
# * copy in: 2 bytes/param (the bf16 shadow)                   = P * 2 / 55 GB/s
# * forward: 2 FLOP per param per token                        = 2 P T / 400 TFLOP/s
# * backward: recompute (2 P T) + backward proper (4 P T)      = 3x the forward
# * gradient out: 4 bytes/param (fp32)                         = P * 4 / 55 GB/s
# * AdamW: ~32 bytes of DRAM traffic per param                 = P * 32 / 200 GB/s
#
# T is the number of tokens that pass through the layer during one visit: all micro-batches of the
# step (lesson 5). (Attention's T^2 FLOPs are left out: a small correction at these lengths.)

# %%
C7 = model.PRESETS["7b"]
P_layer, P_head = model.units(C7)[1].numel, model.units(C7)[-1].numel
FLOPS, PCIE, DRAM = 400e12, 55e9, 200e9


def durations(tokens):
    ms = 1e3
    return dict(copy=P_layer * 2 / PCIE * ms, fwd=2 * P_layer * tokens / FLOPS * ms,
                bwd=6 * P_layer * tokens / FLOPS * ms, d2h=P_layer * 4 / PCIE * ms, adam=P_layer * 32 / DRAM * ms,
                head_copy=P_head * 2 / PCIE * ms, head=6 * P_head * tokens / FLOPS * ms,
                head_d2h=P_head * 4 / PCIE * ms)


L_SHOW = 4                                           # 4 of the 32 layers: enough to see the pattern
results = {}
for tokens in (4096, 32768):
    d = durations(tokens)
    ops = one_step(L_SHOW, **d)
    total = simulate(ops)
    serial = sum(o["dur"] for o in ops)              # everything one after the other, nothing overlapped
    busy = sum(o["dur"] for o in ops if o["lane"] == "compute")
    results[tokens] = dict(ops=ops, total=total, serial=serial, busy=busy)
    print(f"\nT = {tokens} tokens per layer visit: copy {d['copy']:.1f} ms, forward {d['fwd']:.1f} ms, "
          f"backward {d['bwd']:.1f} ms, grad out {d['d2h']:.1f} ms, AdamW {d['adam']:.1f} ms per layer")
    print(render(ops, total))
    print(f"  step {total:.0f} ms (serial {serial:.0f} ms); the GPU computes {busy / total:.0%} of the time")

# %% [markdown]
# Read the two pictures:
#
# * **T = 4096** -- each forward (4 ms) is shorter than the copy of the next layer (7 ms): the compute row
#   has gaps, the H2D row is solid. The gradient (fp32: twice the bytes) takes longer to leave than the
#   backward takes to make it, and the CPU's AdamW (32 ms per layer) finishes long after the GPU. With
#   only 3 staging slabs the optimizer even pushes back: `g0` waits for a slab until `A3` is done. The
#   step is bound by PCIe and the host, not by the GPU.
# * **T = 32768** -- every copy hides under a longer compute, the compute row is nearly solid, and each
#   update finishes while the GPU is still working on lower layers. Only the first copy and the last
#   gradient + update stick out -- and they do not grow with depth.
#
# Four layers hide how the host's lag adds up. All 32 layers of the 7B model:

# %%
for tokens in (4096, 32768):
    ops = one_step(C7.n_layer, **durations(tokens))
    total = simulate(ops)
    gpu_end = max(o["end"] for o in ops if o["lane"] == "compute")
    busy = sum(o["dur"] for o in ops if o["lane"] == "compute")
    print(f"T = {tokens:>5}, {C7.n_layer} layers: step {total:5.0f} ms, GPU busy {busy:5.0f} ms ({busy / total:.0%}), "
          f"its last backward ends at {gpu_end:5.0f} ms")

# %% [markdown]
# At 4k tokens the step is ~32 x 32 ms of CPU AdamW, and the staging slabs make the GPU wait for the
# optimizer (its work would end near 0.7 s if it never had to). At 32k tokens every copy and every update
# hides behind the compute.
#
# Lesson 5 turns this into the rule "tokens per layer visit >= F * bytes / (2 * BW)".
#
# The same two steps as a picture (`python tutorials/make_figures.py` draws it from this lesson's numbers):
#
# ![simulated timeline](figures/timeline.png)

# %% [markdown]
# ## 4. The simulator follows the engine's order
#
# A simulator is only worth something if it models the real code. On the CPU the engine runs its
# operations synchronously in issue order -- so we can record that order from a real `stream.Trainer`
# step (by wrapping three of its functions) and compare it with the simulator's op order per lane.

# %%
cfg = dataclasses.replace(model.PRESETS["toy"], n_layer=L_SHOW)
t = stream.Trainer(cfg, model.init_weights(cfg, 0), device="cpu", micro_batches=2)
record = {"H2D": [], "compute": [], "D2H": []}
real_load, real_drain, real_block, real_head = t._load, t._drain, model.block, model.head_loss
names = {u: lay.name.replace("layer.", "").replace("head", "H") for u, lay in enumerate(t.units)}


def load(u, slot):
    record["H2D"].append(names[u])
    return real_load(u, slot)


def drain(u, gs):
    record["D2H"].append("g" + names[u])
    return real_drain(u, gs)


def block(cfg_, x, w, rope, tile_tokens=0):
    # which slot do these weights live in, and which unit is resident there?
    ptr = w["input_layernorm.weight"].untyped_storage().data_ptr()
    s = [k for k in (0, 1) if t.wslot[k].untyped_storage().data_ptr() == ptr][0]
    unit = [u for u, slot in t.resident.items() if slot == s][0]
    label = names[unit] + ("'" if x.requires_grad else "")  # an input that needs grad: the recompute
    if not record["compute"] or record["compute"][-1] != label:       # one entry per visit, not per micro-batch
        record["compute"].append(label)
    return real_block(cfg_, x, w, rope, tile_tokens)


def head_loss(*a):
    if not record["compute"] or record["compute"][-1] != "H+H'":
        record["compute"].append("H+H'")
    return real_head(*a)


t._load, t._drain, model.block, model.head_loss = load, drain, block, head_loss
try:
    gen = torch.Generator().manual_seed(0)
    t.step(torch.randint(0, 256, (4, 32), generator=gen), torch.randint(0, 256, (4, 32), generator=gen))
    t.weights()
finally:
    model.block, model.head_loss = real_block, real_head
sim_ops = results[4096]["ops"]
for lane in record:
    sim = [o["label"] for o in sim_ops if o["lane"] == lane]
    print(f"  {lane:<8} engine    {' '.join(record[lane])}\n  {'':<8} simulator {' '.join(sim)}")

# %% [markdown]
# ## 5. On a GPU: the real timeline
#
# With CUDA, profile one step of `stream.Trainer` (after a warm-up step) on a small model and draw the
# same ASCII picture from the trace: every kernel and copy the GPU ran, by stream. The full trace is
# written as JSON; open it in https://ui.perfetto.dev to see the same rows (`python train.py --profile`
# does this for a training run).

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
    print("no CUDA: skipping the real profile (the simulated timeline above follows the same rules)")

# %% [markdown]
# ## Check
#
# * the simulator issues copies, computes and gradient drains in exactly the engine's order, with the
#   engine's number of staging slabs;
# * overlap pays: both simulated steps are shorter than the serial sum, and with enough tokens per
#   visit the GPU computes at least 80% of the step;
# * with CUDA, the trace shows work on at least 3 streams (H2D, compute, D2H).

# %%
for lane in record:
    assert record[lane] == [o["label"] for o in sim_ops if o["lane"] == lane], lane
assert t.slabs.qsize() == SLABS, "the simulator assumes the engine's number of staging slabs"
for tokens, r in results.items():
    assert r["total"] < r["serial"], tokens
assert results[32768]["busy"] / results[32768]["total"] >= 0.8
assert results[4096]["busy"] / results[4096]["total"] < 0.5          # the PCIe-bound case really is
if n_streams is not None:
    assert n_streams >= 3, n_streams
gain = {tk: r["serial"] / r["total"] for tk, r in results.items()}
print(f"OK  engine order == simulator order on all 3 streams; overlap speed-up "
      f"{gain[4096]:.2f}x (T=4096), {gain[32768]:.2f}x (T=32768); GPU busy "
      f"{results[32768]['busy'] / results[32768]['total']:.0%} at T=32768")
