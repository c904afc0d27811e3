# %% [markdown]
# # Lesson 11 -- a real GPU step, measured: where 2.3 seconds go
#
# **What you will learn**
#
# * how to read one training step of the engine from a profiler trace, as five lanes: the GPU's
#   compute, H2D and D2H streams, the host thread that issues the work, and the CPU AdamW thread;
# * where the project's first measured step goes -- an H200 with 16 host cores, 24 layers of
#   Llama-2-7B width (5.1B parameters), 16,384 tokens per step: the GPU computes 1.57 s of 2.33 s,
#   the copies hide completely, and the rest is the GPU waiting for the CPU AdamW;
# * what one layer costs on each lane, the host memory bandwidth the CPU AdamW reached, and the rule
#   that follows: **a streamed unit's host update must fit under its backward**.
#
# Every step time in lessons 5, 6 and 10 was arithmetic or a prediction. This one was measured:
# `bench/gpu.py --profile` traced three steps with `torch.profiler`, and
# `bench/trace_extract.py` cut the second (the first steady-state step) out of the 10 MB trace
# into a small JSON of intervals, committed in `bench/results/2026-11-27-nvidia-h200/` beside the
# benchmark's own results. Everything below is recomputed from those intervals.
#
# Run it: `python tutorials/11_a_real_gpu_step.py` (a few seconds on a 2-core CPU; no GPU).

# %%
import json
import statistics
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent if "__file__" in globals() else Path.cwd().resolve()
ROOT = HERE.parent
RUN = ROOT / "bench" / "results" / "2026-11-27-nvidia-h200"
MISSING = [name for name in ("trace_extract.json", "results.json") if not (RUN / name).is_file()]
if MISSING:   # the lesson copied away from the repository, or a checkout without bench/results
    raise SystemExit(f"error: lesson 11 reads {RUN / MISSING[0]}, committed with the repository; "
                     "run it from a clone that has bench/results/ (git checkout -- bench/results)")
X = json.loads((RUN / "trace_extract.json").read_text())
meta, cfg, lanes, STEP = X["meta"], X["config"], X["lanes"], X["step"]["end"]
print(f"{meta['device']}, {meta['cpus']} host cores, torch {meta['torch']}; {cfg['layers']} layers "
      f"of {cfg['layer_params']:,} parameters, {cfg['tokens']:,} tokens per step in "
      f"{cfg['micro_batches']} micro-batches; step {X['step']['index'] + 1} of the "
      f"{meta['trace']['steps']} traced: {STEP:.3f} s (the benchmark's median untraced step: "
      f"{meta['timed']['at_min_tokens']['step_s']:.3f} s)")
print("intervals per lane: " + ", ".join(f"{k} {len(v)}" for k, v in lanes.items()))

# %% [markdown]
# ## 1. The step as lanes
#
# Each interval has a start and an end (seconds from the step's start: the moment the main thread
# gathers the embedding rows), a unit (`embed`, a layer index, `head`) and a kind. On the compute
# stream: `forward`, `head` (forward and backward at once, lesson 2), then per layer `recompute`,
# `backward` and `accumulate` (the fp32 gradient slot). On the copy streams one interval per copy.
# On the optimizer thread per unit: `wait` (for its gradient's D2H), `adamw` (the fused kernel),
# `shadow_copy` (the bf16 copy the next forward streams). The main lane is the host issuing work --
# or waiting, `on` a free gradient slab or on a unit's update. Drawn like lesson 10's twin:

# %%
MARK = {"compute": {"forward": "f", "head": "H", "recompute": "b", "backward": "b",
                    "accumulate": "b"},
        "h2d": {"h2d": ">"}, "d2h": {"d2h": "<"},
        "main": {"wait": " ", "gather": "g"},
        "adamw": {"adamw": "A", "shadow_copy": "s", "scatter": "e", "wait": " "}}


def render(width=96):
    rows = []
    for lane, marks in MARK.items():
        row = [" "] * width
        for c in lanes[lane]:
            mark = marks.get(c["kind"], ".")
            a, b = int(c["start"] / STEP * width), int(c["end"] / STEP * width)
            if mark != " ":
                row[a:max(a + 1, b)] = mark * (max(a + 1, b) - a)
        rows.append(f"  {lane:<8}|" + "".join(row) + "|")
    return "\n".join(rows)


print(render())
print(f"  {'':8} 0 s{'':>88}{STEP:.2f} s")

# %% [markdown]
# `f` forward, `H` head, `b` recompute + backward + accumulate, `>` H2D, `<` D2H, `.` the host
# issuing, `A` AdamW, `s` the shadow copy. The forward is solid; the backward is striped with holes;
# after the last backward the GPU stands still while the optimizer thread finishes layers 3..0
# and the embedding -- the next step cannot start before the embedding's update. The picture is
# `tutorials/figures/11_measured_step.png`:
#
# ![measured step](figures/11_measured_step.png)
#
# ## 2. Where the time goes
#
# The compute stream is busy or idle. Busy: the sum of its intervals' `busy`. Idle, classified by
# who the stream waited for:
#
# * before its first op: the host gathers the embedding rows (`index_select`) and copies them in;
# * after its last op: the **tail** -- the optimizer thread still updating the last units;
# * between ops, when the next op had not been launched yet (`launched` after the previous op's
#   end): the host was behind -- waiting for a **free gradient slab** (`optim.HostStore.lend`:
#   three slabs, each given back only when its unit's update is done) when the main lane waits `on`
#   a slab then, else plain launch overhead;
# * between ops already launched (and inside an interval): the GPU's own gaps between kernels --
#   or a wait for a copy, when one ended just then.

# %%
comp = lanes["compute"]
busy = sum(c["busy"] for c in comp)
waits = [w for w in lanes["main"] if w["kind"] == "wait"]
copy_ends = [c["end"] for k in ("h2d", "d2h") for c in lanes[k]]
idle = Counter(gather=comp[0]["start"], tail=STEP - comp[-1]["end"],
               gpu=sum(c["end"] - c["start"] - c["busy"] for c in comp))    # inside: queued ops
for a, b in zip(comp, comp[1:]):
    lo, hi = a["end"], b["start"]
    if hi <= lo:
        continue
    if b["launched"] >= lo:                         # nothing queued: the host had not launched it
        why = next((w["on"] for w in waits if w["start"] < hi and lo < w["end"]
                    and w["on"] != "host"), "launch")
    else:                                           # queued, and the stream did not run it yet
        why = "copy" if any(lo <= e <= hi and hi - e <= 20e-6 for e in copy_ends) else "gpu"
    idle[why] += hi - lo

ROWS = [("busy", "GPU compute busy (kernels, memsets, on-device copies)"),
        ("slab", "idle: the host waits for a free gradient slab"),
        ("tail", "idle: the step boundary, the AdamW tail"),
        ("gather", "idle: embedding gather + rows H2D"),
        ("launch", "idle: launch gaps (the host behind, no slab wait)"),
        ("gpu", "idle: GPU-side gaps between queued kernels"),
        ("copy", "idle: waiting for an H2D or D2H copy")]
# the same table in the H200 run's README (../shared/gpu/2026-11-27-h200, the numbers)
README = dict(busy=1.566, slab=0.348, tail=0.310, gather=0.031, launch=0.026, gpu=0.049, copy=0.0)
ours = Counter(idle, busy=busy)
summary = dict(X["summary"]["compute_idle_s"], busy=X["summary"]["compute_busy_s"])
print(f"{'':56}{'here':>8}{'extract':>9}{'README':>8}")
for key, label in ROWS:
    print(f"{label:<56}{ours[key]:8.3f}{summary[key]:9.3f}{README[key]:8.3f}")
print(f"{'the step':<56}{sum(ours.values()):8.3f}{X['summary']['step_s']:9.3f}{2.33:8.3f}")
print(f"GPU busy {busy:.2f} s of a {STEP:.2f} s step: {busy / STEP:.0%}")

# %% [markdown]
# "here" is this lesson's arithmetic on the intervals; "extract" the same classification done by
# `bench/trace_extract.py` on the raw events, before merging; "README" the hand analysis of the
# trace in the run's notes. They agree; the README counted one 2.9 ms pause of the main thread (in
# layer 1's recompute: no slab, no update -- the thread simply did not run) with the slab waits,
# this lesson with the launch gaps. The copies cost the GPU nothing: 48 weight copies and 25
# gradient copies per step, every one hidden under compute.
#
# ## 3. One layer on each lane
#
# Per layer: the busy time of its forward and of its recompute + backward + accumulate (all four
# micro-batches), the span of its AdamW and shadow copy on the optimizer thread, and its weight
# copy. The forward's copies run alone on the link; the backward's share the host's memory with
# AdamW.

# %%
def per_layer(lane, kinds, span=False):
    out = Counter()
    for c in lanes[lane]:
        if c["kind"] in kinds and isinstance(c["unit"], int):
            out[c["unit"]] += c["end"] - c["start"] if span or "busy" not in c else c["busy"]
    return out


head_t = next(c["launched"] for c in lanes["h2d"] if c["unit"] == "head")
wcopy = [c for c in lanes["h2d"] if c["what"] == "weights" and isinstance(c["unit"], int)]
fwd_copies = [c["end"] - c["start"] for c in wcopy if c["launched"] < head_t]
bwd_copies = [c["end"] - c["start"] for c in wcopy if head_t < c["launched"] < comp[-1]["end"]]
LAYER = {"forward": per_layer("compute", ("forward",)),
         "recompute + backward": per_layer("compute", ("recompute", "backward", "accumulate")),
         "  of which recompute": per_layer("compute", ("recompute",)),
         "AdamW (_fused_adamw_)": per_layer("adamw", ("adamw",)),
         "shadow copy (fp32 -> bf16)": per_layer("adamw", ("shadow_copy",), span=True),
         "update = AdamW + shadow copy": per_layer("adamw", ("adamw", "shadow_copy"), span=True),
         "H2D of its weights, forward": dict(enumerate(fwd_copies)),
         "H2D of its weights, backward": dict(enumerate(bwd_copies))}
med = {k: statistics.median(v.values()) for k, v in LAYER.items()}
head = sum(c["busy"] for c in comp if c["kind"] == "head")
wbytes = cfg["layer_params"] * cfg["weight_bytes_per_param"]
print(f"{'per 7B-width layer':<32}{'median ms':>10}{'min':>8}{'max':>8}")
for k, v in LAYER.items():
    print(f"{k:<32}{med[k] * 1e3:10.1f}{min(v.values()) * 1e3:8.1f}{max(v.values()) * 1e3:8.1f}")
print(f"head (forward + backward, all micro-batches): {head * 1e3:.1f} ms; a layer's weight "
      f"copy: {wbytes / 1e6:.0f} MB at "
      f"{wbytes / med['H2D of its weights, forward'] / 1e9:.1f} GB/s in the forward, "
      f"{wbytes / med['H2D of its weights, backward'] / 1e9:.1f} GB/s in the backward")

# %% [markdown]
# ## 4. The host bandwidth AdamW reached
#
# AdamW reads a parameter, its gradient and both moments (4 x 4 = 16 B) and writes the parameter and
# the moments back (12 B): 28 B per parameter, one pass over the unit's memory. The run then made a
# second pass for the shadow (read fp32, write bf16: 6 B per parameter).

# %%
P = cfg["layer_params"]
adamw_bw = 28 * P / med["AdamW (_fused_adamw_)"]
shadow_bw = 6 * P / med["shadow copy (fp32 -> bf16)"]
print(f"AdamW: 28 B x {P:,} parameters in {med['AdamW (_fused_adamw_)'] * 1e3:.1f} ms = "
      f"{adamw_bw / 1e9:.0f} GB/s of host memory ({P / med['AdamW (_fused_adamw_)'] / 1e9:.2f} "
      f"Gparam/s); the shadow copy: 6 B in {med['shadow copy (fp32 -> bf16)'] * 1e3:.1f} ms = "
      f"{shadow_bw / 1e9:.0f} GB/s")

# %% [markdown]
# About 100 GB/s from the optimizer thread's 14 OpenMP threads: half the 200 GB/s that the
# planner's h200 profile assumes for AdamW (`megatrain_min/plan/hardware.py`, `host_bw_gbs`), one
# reason its 1.62 s became 2.29 s. And while AdamW streams, the backward's weight copies slow from
# 55 to ~35 GB/s (section 3): both draw on the host's memory. The CPU does not get faster by asking;
# what the schedule can change is how much it is asked to do, and when.
#
# ## 5. The rule that follows
#
# The optimizer thread updates a unit when its gradient lands, in landing order: the head, layers
# 23..0, the embedding. The GPU's backward of a layer takes ~48 ms; the host's update of it ~73 ms.
# So the thread falls 25 ms further behind with every layer, the GPU runs ahead until all three
# gradient slabs are lent out, and then waits for a slab at every layer: the slab waits. When the
# last backward is done, the thread still has the last layers to update -- and the next forward
# needs exactly those first (the embedding, layer 0): the tail.

# %%
upd, bwd = LAYER["update = AdamW + shadow copy"], LAYER["recompute + backward"]
adam = lanes["adamw"]
first = next(a for a in adam if a["kind"] != "wait")       # the head's update starts
chain = adam[-1]["end"] - first["start"]
worked = sum(a["end"] - a["start"] for a in adam if a["kind"] != "wait")   # all 26 units
excess = worked - sum(bwd.values())
print(f"per layer: update {med['update = AdamW + shadow copy'] * 1e3:.0f} ms > backward "
      f"{med['recompute + backward'] * 1e3:.0f} ms, in every one of the {len(upd)} layers")
print(f"from the head's update ({first['start']:.2f} s) to the step's end the optimizer "
      f"thread worked {worked:.2f} of {chain:.2f} s: the step is the forward and head, "
      "then the host's updates")
print(f"the updates (head, layers, embedding: {worked:.2f} s) outlast the GPU's backward "
      f"({sum(bwd.values()):.2f} s) by {excess:.2f} s; the GPU waited for slabs "
      f"{idle['slab']:.2f} s and at the boundary {idle['tail']:.2f} s: "
      f"{idle['slab'] + idle['tail']:.2f} s")
need = cfg["tokens"] * med["update = AdamW + shadow copy"] / med["recompute + backward"]
x2 = meta["timed"]["at_2x_tokens"]
print(f"a layer's backward grows with the tokens, its update does not: they break even at "
      f"~{need:,.0f} tokens per step. Measured at {x2['tokens']:,}: GPU busy "
      f"{x2['overlap']:.0%} of the step (at {cfg['tokens']:,}: "
      f"{meta['timed']['at_min_tokens']['overlap']:.0%})")

# %% [markdown]
# The rule: **a streamed unit's host update must fit under its backward** -- else the host sets the
# pace, and the GPU waits twice: for slabs during the backward, and at the step boundary for the
# units the next forward needs first. The ways out: more tokens per step (the backward grows, the
# update does not: at 2x tokens this run's GPU was busy 92% of the step); fewer bytes per update
# (lean mode: no shadow); and fewer units on the host at all -- the first units of the forward kept
# resident on the GPU, updated there by torch's fused CUDA AdamW, never crossing PCIe.
#
# ## 6. What the models say resident units and lean mode change
#
# `hardware.HARDWARE["h200"]` is made from this run: the achieved compute rate (frac 0.56 of the
# bf16 peak: the forward, backward and head above), the measured links and AdamW's 101 GB/s. On
# it, `bench/twin_vs_plan.py --measured` replays this very step
# with the engine as it was measured -- no resident units, the shadow written in a second pass --
# through both models: the twin (the real engine's op stream, `megatrain_min/sim/twin.py`) and the
# planner (an analytic schedule, `megatrain_min/plan/timing.py`); both land within 5% of the
# measured step (`bench/results/2026-11-27-nvidia-h200/twin_vs_plan.md`). The planner is instant, so
# this lesson asks it what the engine as it is now would do on the same GPU and host -- predictions,
# until a GPU measures them (`bench/gpu_run.sh`):

# %%
def twin_says(x):
    """The planner on the measured profile: the engine as measured, then units
    resident on the GPU (stream.Trainer(resident_units=)), the first the forward needs first."""
    import sys
    sys.path.insert(0, str(ROOT))
    import model
    import optim
    from megatrain_min import plan
    from megatrain_min.plan import hardware, timing
    c = x["config"]
    cfg = model.GPTConfig(n_layer=c["layers"], vocab_size=32000, n_head=32, n_kv_head=32,
                          d_model=4096,
                          d_ff=11008, max_seq_len=4096)
    host = json.loads((RUN / "results.json").read_text())["meta"]["host_available_gb"]
    hw = dict(hardware.HARDWARE["h200"], host_mem_gb=host)       # the run's host memory, not 1.5 TB
    n = len(model.units(cfg))

    def step(resident, mode="fast", as_measured=False, gpu_updated=0):
        tile, order = optim.TILE, timing.NEED_FIRST
        optim.TILE = 1 << 40 if as_measured else tile    # a whole unit: the shadow in a second pass
        timing.NEED_FIRST = not as_measured              # then: updates in the order they landed
        try:
            return plan.plan(cfg, hw, batch_size=c["tokens"] // 4096, seq_len=4096,
                             micro_batches=c["micro_batches"], mode=mode, grad_clip=0.0,
                             skip_nonfinite=False, grad_slabs=3 if as_measured else None,
                             resident_units=resident, gpu_updated_units=gpu_updated)
        finally:
            optim.TILE, timing.NEED_FIRST = tile, order
    rows = [("the engine as measured (two host passes, nothing "
             "resident)", step(0, as_measured=True)),
            ("one pass, the landed unit the next forward needs first", step(0)),
            (f"{n // 10} units resident (<= 10%: a 120b run's regime)", step(n // 10)),
            (f"  in lean mode (28 B/param on the host, fp32 over PCIe)", step(n // 10, "lean")),
            (f"  + streamed units updated on the GPU (the plan's count)",
             step(n // 10, "lean", gpu_updated=None)),
            (f"every unit resident ({n}: the 5.1B model fits the H200)", step(n))]
    gpu_only = x["meta"]["timed"]["at_min_tokens"]["compute_only_s"]
    print(f"{'engine':<60}{'step s':>8}{'GPU-only/step':>15}  bound by")
    for name, p in rows:
        print(f"{name:<60}{p['step_time_s']:>8.3f}{gpu_only / p['step_time_s']:>15.2f}  "
              f"{p['bottleneck']}")
    return {name: p["step_time_s"] for name, p in rows}, gpu_only


said, gpu_only = twin_says(X)

# %% [markdown] The engine now runs the landed update the next forward needs first (`optim.Worker`),
# not the oldest: the thread's backlog at the end of the backward is then the units needed last, and
# the next forward starts on the ones needed first; the plan keeps a gradient slab for each unit of
# that backlog, so the backward no longer waits for slabs either. Resident units take the units the
# next forward needs first off the host entirely, so the step boundary waits for nothing and the
# host has the whole backward for what is left; lean mode cuts the host's bytes from 34 to 28 per
# parameter (measured on that host: 50 instead of 60 ms per layer). One host pass -- the shadow
# written from cache -- saved nothing there: 59.8 against 60.3 ms per layer
# (`bench/results/2026-11-27-nvidia-h200-2/adamw_cpu.json`): the fp32 -> bf16 copy costs the same
# from cache, so the models count it as before. At this run's 16,384 tokens the host still sets the
# pace unless most units are resident; with twice the tokens (or everything resident, as a 5.1B
# model can be on an H200) the GPU computes the whole step. A streamed unit can also be updated on
# the GPU (`megatrain_min/engine/gpu_update.py`): its gradient stays there, its master, m and v
# cross the link for the update and back -- 24 B/param of DMA instead of 28 of the host's AdamW --
# while the host updates the others; the plan picks how many (here few: without clipping the host
# keeps up nearly; with clipping, where every update follows the backward, about half of them,
# bench/NOTES.md).
#
# %% [markdown]
# ## Check
#
# * the lesson's busy and idle seconds add up to the step and equal the extractor's (computed from
#   the raw events) within 1 ms each; GPU busy 1.57 s of a 2.33 s step, within 2% of the issue's
#   figures; the other rows within 5 ms of the run's README;
# * per layer, within 5% of the README: forward 15.5 ms, recompute + backward 48 ms, head 31 ms,
#   AdamW 55.5 ms, shadow copy 18 ms, the forward's weight copy 7.3 ms at 55 GB/s; AdamW at
#   ~101 GB/s of host memory; the update (73-76 ms) longer than the backward;
# * every layer's update outlasts its backward; the slab waits and the tail are the updates'
#   excess over the backward (within 10%); the optimizer thread is busy 95% of the time from the
#   head's update on; the break-even token count lies between the two measured batch sizes;
# * the planner on the measured profile replays the engine as measured within 10% of this step;
#   each change predicts a faster step than the one before; every unit resident: the GPU-only time.

# %%
assert abs(sum(ours.values()) - STEP) < 1e-4, (sum(ours.values()), STEP)
for key, _ in ROWS:
    assert abs(ours[key] - summary[key]) < 1e-3, (key, ours[key], summary[key])
    assert abs(ours[key] - README[key]) < (0.02 * README[key] if key == "busy" else 5e-3), key
assert abs(busy - 1.57) / 1.57 < 0.02 and abs(STEP - 2.33) / 2.33 < 0.02, (busy, STEP)
for got, want in ((med["forward"], 15.5e-3), (med["recompute + backward"], 48e-3), (head, 31e-3),
                  (med["AdamW (_fused_adamw_)"], 55.5e-3),
                  (med["shadow copy (fp32 -> bf16)"], 18e-3),
                  (med["H2D of its weights, forward"], 7.3e-3), (adamw_bw, 101e9)):
    assert abs(got - want) / want < 0.05, (got, want)
assert abs(wbytes / med["H2D of its weights, forward"] - 55e9) / 55e9 < 0.05
assert 73e-3 * 0.97 <= med["update = AdamW + shadow copy"] <= 76e-3 * 1.03
assert all(upd[i] > bwd[i] for i in upd), "a layer's update fit under its backward"
assert abs(excess - (idle["slab"] + idle["tail"])) / excess < 0.1, (excess, idle)
assert worked / chain > 0.95 and cfg["tokens"] < need < x2["tokens"] and x2["overlap"] > 0.9
times = list(said.values())
measured = meta["timed"]["at_min_tokens"]["step_s"]
assert abs(times[0] - measured) / measured < 0.1
assert all(a > b for a, b in zip(times, times[1:]))
assert gpu_only / times[-1] > 0.95, (gpu_only, times)
print(f"OK  GPU busy {busy:.3f} s of a {STEP:.3f} s step ({busy / STEP:.0%}); waits: slab "
      f"{idle['slab']:.3f} s, tail {idle['tail']:.3f} s; per layer update "
      f"{med['update = AdamW + shadow copy'] * 1e3:.0f} ms > backward "
      f"{med['recompute + backward'] * 1e3:.0f} ms; AdamW at {adamw_bw / 1e9:.0f} GB/s")
