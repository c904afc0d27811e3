"""make_figures.py -- the pictures of the tutorials, drawn from the same numbers the lessons print.

    pip install -r requirements-docs.txt     # matplotlib: a docs-only dependency
    python tutorials/make_figures.py         # rewrites tutorials/figures/*.png (a few seconds)
    python tutorials/make_figures.py 11_measured_step     # only the figures named

timeline.png    lesson 10's twin replay (4 layers of Llama-2-7B on the h100 profile) at 4 x 4096 and
                8 x 4096 tokens per step: the lanes host, H2D, compute, D2H, CPU AdamW. The spans
                come from running lesson 10 itself (its `timelines`), so picture and lesson cannot
                drift apart.
throughput.png  lesson 5: megatrain_min.plan's tokens/s for 7b against tokens per step on h100 and
                gh200, with the thresholds T >= F b / (2 BW) etc. marked.
memory.png      lesson 6: host memory of 120b by component (planner), fast/lean x clipping, against
                1.5 TB.
11_measured_step.png
                lesson 11: one measured step on an H200 (24 layers of 7B width, 16,384 tokens) as
                lanes, from the committed extract of its profiler trace (bench/results/
                2026-11-27-nvidia-h200/trace_extract.json); below it, once twin_step() returns its
                spans, the same step as the twin predicts it.

Not run by the tests (matplotlib is not a test dependency); the PNGs are committed.
"""
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import model  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402
from megatrain_min.plan import hardware  # noqa: E402
from megatrain_min.plan.memory import HOST_USABLE  # noqa: E402

OUT = HERE / "figures"
OUT.mkdir(exist_ok=True)
COLORS = {"host": "#937860", "h2d": "#4c72b0", "compute": "#55a868", "d2h": "#dd8452",
          "cpu_adam": "#c44e52"}


# --------------------------------------------------------------------------- timeline (lesson 10)
def timeline():
    with contextlib.redirect_stdout(io.StringIO()):
        lesson10 = runpy.run_path(str(HERE / "10_proving_the_schedule.py"))
    lanes, n = list(COLORS), len(lesson10["timelines"])
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.4 * n), constrained_layout=True)
    for ax, (B, (tw, r, p)) in zip(axes, lesson10["timelines"].items()):
        t0, t1 = tw.first_compute[-3].start, tw.first_compute[-2].start
        for s_ in tw.spans:
            if s_.label != "wait" and s_.end > t0 and s_.start < t1 and s_.end > s_.start:
                y = len(lanes) - 1 - lanes.index(s_.actor)
                a, b = max(s_.start, t0) - t0, min(s_.end, t1) - t0
                ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (y - 0.4, 0.8),
                               facecolors=COLORS[s_.actor])
        ax.set_yticks(range(len(lanes)), lanes[::-1])
        ax.set_xlim(0, (t1 - t0) * 1e3)
        ax.set_title(f"{B} x 4096 tokens per step: {r['step_time_s'] * 1e3:.0f} ms (planner "
                     f"{p['step_time_s'] * 1e3:.0f} ms), GPU busy {r['overlap']:.0%}, bound by "
                     f"{r['bottleneck']}", fontsize=10, loc="left")
    axes[-1].set_xlabel("ms: one step of 4 Llama-2-7B layers replayed on the h100 "
                        "profile (a prediction)")
    fig.savefig(OUT / "timeline.png", dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------- throughput (lesson 5)
def throughput():
    C7 = model.PRESETS["7b"]
    fig, ax = plt.subplots(figsize=(7, 3.6), constrained_layout=True)
    for hw, color in (("h100", "#4c72b0"), ("gh200", "#c44e52")):
        pts = [planner.plan(C7, hw, batch_size=b, seq_len=1024, grad_clip=0.0)
               for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)]
        ax.plot([p["tokens_per_step"] for p in pts], [p["tokens_per_s"] for p in pts], "o-",
                color=color, label=hw, ms=3)
        for what, style in (("h2d", "--"), ("cpu_adam", ":")):
            ax.axvline(pts[0]["min_tokens"][what], color=color, ls=style, lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step = tokens per layer visit (layer-major)")
    ax.set_ylabel("predicted tokens/s")
    ax.set_title("7b, bf16, seq 1024: dashed = weights hidden (F b / 2BW), dotted = CPU "
                 "AdamW hidden", fontsize=9)
    ax.legend()
    fig.savefig(OUT / "throughput.png", dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------ host memory (lesson 6)
def memory():
    C120 = model.PRESETS["120b"]
    fig, ax = plt.subplots(figsize=(9, 3.6), constrained_layout=True)
    names = []
    palette = ["#4c72b0", "#55a868", "#8172b2", "#dd8452", "#c44e52", "#937860", "#da8bc3",
               "#8c8c8c"]
    component_color = {}
    for y, (mode, clip) in enumerate([("fast", True), ("fast", False), ("lean", True),
                                      ("lean", False)]):
        p = planner.plan(C120, "h200", batch_size=4, seq_len=4096, mode=mode,
                         grad_clip=float(clip), host_mem_gb=1536)
        left = 0.0
        for comp, b in p["host"].items():
            key = comp.split(":")[0].split(" (")[0]
            color = component_color.setdefault(key, palette[len(component_color) % len(palette)])
            ax.barh(y, b / 1e12, left=left, color=color, label=key if key not in names else None)
            names.append(key)
            left += b / 1e12
        ax.text(max(left, 1.5) + 0.02, y, f"{left:.2f} TB, {p['host_bytes_per_param']:.0f} B/param",
                va="center", fontsize=8)
    usable = 1536e9 * HOST_USABLE / 1e12
    ax.axvline(usable, color="k", ls="--", lw=1)
    ax.text(usable, -0.55, " 1.5 TB host (97% usable)", fontsize=8, va="bottom")
    ax.set_yticks(range(4), ["fast + clip", "fast", "lean + clip", "lean"])
    ax.set_ylim(3.6, -0.8)                                         # first bar on top
    ax.set_xlim(0, 2.7)
    ax.set_xlabel("host memory, TB (120b on h200, 4 x 4096 tokens/step, megatrain_min.plan)")
    ax.legend(fontsize=7, ncol=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    fig.savefig(OUT / "memory.png", dpi=100)
    plt.close(fig)


# -------------------------------------------------------------------- a measured step (lesson 11)
EXTRACT = HERE.parent / "bench" / "results" / "2026-11-27-nvidia-h200" / "trace_extract.json"
LANES = ("main", "h2d", "compute", "d2h", "adamw")                  # top to bottom
KIND_COLORS = {"forward": "#55a868", "head": "#8172b2", "recompute": "#8fbf9a",
               "backward": "#2d6e3e", "accumulate": "#b0b0b0", "h2d": "#4c72b0", "d2h": "#dd8452",
               "gather": "#937860", "adamw": "#c44e52", "shadow_copy": "#e8a0a0",
               "scatter": "#da8bc3"}
ISSUE = "#d9d9d9"                 # the host issuing work (the main lane's forward, backward, ...)


def measured_step(x):
    """[(lane, start, end, kind)] of the extract's step; the main lane's waits left out (white)."""
    return [(lane, c["start"], c["end"], c["kind"]) for lane in LANES for c in x["lanes"][lane]
            if c["kind"] != "wait"]


def twin_step(x):
    """The same step as the twin predicts it on this run's profile (plan.hardware.HARDWARE["h200"],
    made from it), the engine as measured (nothing resident, the shadow in a second pass): the real
    engine's op stream at full size replayed (megatrain_min/sim/twin.py; ~20 s), as
    [(lane, start, end, kind)]."""
    import optim
    import torch
    from megatrain_min.sim import record, twin
    c = x["config"]
    cfg = model.GPTConfig(n_layer=c["layers"], vocab_size=32000, n_head=32, n_kv_head=32,
                          d_model=4096,
                          d_ff=11008, max_seq_len=4096)
    host = json.loads((EXTRACT.parent / "results.json").read_text())["meta"]["host_available_gb"]
    lane = {"host": "main", "cpu_adam": "adamw", "h2d": "h2d", "compute": "compute", "d2h": "d2h"}

    class Tagged(twin.Twin):         # each span tagged with its op's kind, in the extract's words
        def op(self, op):
            n = len(self.spans)
            super().op(op)
            if op.actor == "worker":
                kind = "adamw" if "adamw" in op.name else \
                    "shadow_copy" if "copy_" in op.name else "scatter"
            elif op.kind in ("h2d", "d2h"):
                kind = op.kind
            elif "cross_entropy" in op.name or "log_softmax" in op.name:
                kind = "head"
            else:
                kind = "backward" if op.autograd else "forward"
            for s_ in self.spans[n:]:
                s_.kind = kind
    tw, tile = Tagged(dict(hardware.HARDWARE["h200"], host_mem_gb=host)), optim.TILE
    optim.TILE = 1 << 40                 # the engine as measured: the shadow in a second pass
    try:
        record.run(cfg, [tw], 3, fake=True, sources=False, costs=True,
                   batch=(c["tokens"] // 4096, 4096),
                   dtype=torch.bfloat16, micro_batches=c["micro_batches"], grad_clip=0.0,
                   grad_slabs=3,
                   resident_units=0)
    finally:
        optim.TILE = tile
    t0, t1 = tw.first_compute[-3].start, tw.first_compute[-2].start
    spans = sorted(
        (lane[s_.actor], max(s_.start, t0) - t0, min(s_.end, t1) - t0, getattr(s_, "kind", ""))
                   for s_ in tw.spans if s_.label != "wait" and s_.end > t0 and s_.start < t1
                   and s_.actor in lane)
    merged = []                     # ~100k ops: one bar per run of a kind on a lane (gaps < 0.5 ms)
    for sp in spans:
        last = merged[-1] if merged else None
        if last and last[0] == sp[0] and last[3] == sp[3] and sp[1] - last[2] < 5e-4:
            merged[-1] = (sp[0], merged[-1][1], max(merged[-1][2], sp[2]), sp[3])
        else:
            merged.append(sp)
    return merged


def draw_lanes(ax, spans, title, length, notes=()):
    """spans: [(lane, start, end, kind)]; notes: [(lane, time, text)] written above a lane."""
    for lane, a, b, kind in spans:
        y = len(LANES) - 1 - LANES.index(lane)
        color = KIND_COLORS.get(kind, ISSUE) if lane != "main" or kind == "gather" else ISSUE
        ax.broken_barh([(a, max(b - a, 2e-4))], (y - 0.3, 0.6), facecolors=color, linewidth=0)
    for lane, t, text in notes:
        ax.text(t, len(LANES) - 1 - LANES.index(lane) + 0.32, text, fontsize=7, va="bottom")
    ax.set_yticks(range(len(LANES)), [f"{lane}" for lane in LANES[::-1]])
    ax.set_ylim(-0.6, len(LANES) - 0.1)
    ax.set_xlim(0, length)
    ax.set_title(title, fontsize=10, loc="left")


def unit_notes(x):
    """Where the compute lane starts the forward, the head, the backward; where the optimizer thread
    starts the head, layer 0 and the embedding; and the GPU's idle tail."""
    comp, adam, notes = x["lanes"]["compute"], x["lanes"]["adamw"], []
    first = lambda lane, unit, kinds: next(c["start"] for c in lane    # noqa: E731
                                           if c["unit"] == unit and c["kind"] in kinds)
    last, tail = x["config"]["layers"] - 1, x["summary"]["compute_idle_s"]["tail"]
    notes += [("compute", first(comp, 0, ("forward",)), "forward: layer 0 ..."),
              ("compute", first(comp, "head", ("head",)), "head"),
              ("compute", first(comp, last, ("recompute",)) + 0.03, f"backward: {last} ... 0"),
              ("compute", comp[-1]["end"] + 0.01, f"idle: AdamW tail {tail:.2f} s")]
    notes += [("adamw", first(adam, u, ("adamw",)), name)
              for u, name in (("head", "head"), (0, "layer 0"), ("embed", "emb"))]
    return notes


def measured():
    x = json.loads(EXTRACT.read_text())
    s, m, step = x["summary"], x["meta"], x["step"]["end"]
    idle = s["compute_idle_s"]
    panels = [(measured_step(x), f"measured on an {m['device']} (torch {m['torch']}): "
               f"{x['config']['layers']} layers of Llama-2-7B width, {x['config']['tokens']:,} "
               f"tokens per step, {step:.2f} s\nGPU busy {s['compute_busy_s']:.2f} s; the GPU "
               f"waits for a gradient slab {idle['slab']:.2f} s, for the AdamW tail "
               f"{idle['tail']:.2f} s", unit_notes(x))]
    twin = twin_step(x)
    if twin is not None:
        end = max(b for _, _, b, _ in twin)
        panels.append((twin, "the same step as the twin predicts it on the profile made from this "
                       f"run (plan.hardware.HARDWARE['h200']): {end:.2f} s", ()))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.0 * len(panels) + 0.6),
                             constrained_layout=True, squeeze=False)
    for ax, (spans, title, notes) in zip(axes[:, 0], panels):
        draw_lanes(ax, spans, title, step, notes)
    axes[-1, 0].set_xlabel("seconds from the step's start (main: the host issuing; white: waiting)")
    shown = ["forward", "head", "recompute", "backward", "accumulate", "h2d", "d2h", "gather",
             "adamw", "shadow_copy", "scatter"]
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in shown]
    handles.append(Patch(color=ISSUE, label="issue"))
    fig.legend(handles=handles, loc="outside lower center", ncol=12, fontsize=8, frameon=False)
    fig.savefig(OUT / "11_measured_step.png", dpi=100)
    plt.close(fig)


FIGURES = {"timeline": timeline, "throughput": throughput, "memory": memory,
           "11_measured_step": measured}

if __name__ == "__main__":
    names = sys.argv[1:] or list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        sys.exit(f"unknown figure {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    for name in names:
        FIGURES[name]()
    print("wrote", ", ".join(f"tutorials/figures/{n}.png" for n in names))
