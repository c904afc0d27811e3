"""make_figures.py -- the pictures of the tutorials, drawn from the same numbers the lessons print.

    pip install -r requirements-docs.txt     # matplotlib: a docs-only dependency
    python tutorials/make_figures.py         # rewrites tutorials/figures/*.png (a few seconds)

timeline.png    lesson 10's twin replay (4 layers of Llama-2-7B on the h100 profile) at 4 x 4096 and 8 x 4096
                tokens per step: the lanes host, H2D, compute, D2H, CPU AdamW. The spans come from running
                lesson 10 itself (its `timelines`), so picture and lesson cannot drift apart.
throughput.png  lesson 5: megatrain_min.plan's tokens/s for 7b against tokens per step on h100 and gh200,
                with the thresholds T >= F b / (2 BW) etc. marked.
memory.png      lesson 6: host memory of 120b by component (planner), fast/lean x clipping, against 1.5 TB.

Not run by the tests (matplotlib is not a test dependency); the PNGs are committed.
"""
import contextlib
import io
import runpy
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import model  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402

OUT = HERE / "figures"
OUT.mkdir(exist_ok=True)
COLORS = {"host": "#937860", "h2d": "#4c72b0", "compute": "#55a868", "d2h": "#dd8452", "cpu_adam": "#c44e52"}

# ----------------------------------------------------------------------------- timeline (lesson 10)
with contextlib.redirect_stdout(io.StringIO()):
    lesson10 = runpy.run_path(str(HERE / "10_proving_the_schedule.py"))
lanes = list(COLORS)
fig, axes = plt.subplots(len(lesson10["timelines"]), 1, figsize=(10, 2.4 * len(lesson10["timelines"])),
                         constrained_layout=True)
for ax, (B, (tw, r, p)) in zip(axes, lesson10["timelines"].items()):
    t0, t1 = tw.first_compute[-3].start, tw.first_compute[-2].start
    for s_ in tw.spans:
        if s_.label != "wait" and s_.end > t0 and s_.start < t1 and s_.end > s_.start:
            y = len(lanes) - 1 - lanes.index(s_.actor)
            a, b = max(s_.start, t0) - t0, min(s_.end, t1) - t0
            ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (y - 0.4, 0.8), facecolors=COLORS[s_.actor])
    ax.set_yticks(range(len(lanes)), lanes[::-1])
    ax.set_xlim(0, (t1 - t0) * 1e3)
    ax.set_title(f"{B} x 4096 tokens per step: {r['step_time_s'] * 1e3:.0f} ms (plan.py {p['step_time_s'] * 1e3:.0f} ms), "
                 f"GPU busy {r['overlap']:.0%}, bound by {r['bottleneck']}", fontsize=10, loc="left")
axes[-1].set_xlabel("ms: one step of 4 Llama-2-7B layers replayed on the h100 profile (a prediction)")
fig.savefig(OUT / "timeline.png", dpi=100)
plt.close(fig)

# ----------------------------------------------------------------------------- throughput (lesson 5)
C7 = model.PRESETS["7b"]
fig, ax = plt.subplots(figsize=(7, 3.6), constrained_layout=True)
for hw, color in (("h100", "#4c72b0"), ("gh200", "#c44e52")):
    pts = [planner.plan(C7, hw, batch_size=b, seq_len=1024, grad_clip=0.0)
           for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)]
    ax.plot([p["tokens_per_step"] for p in pts], [p["tokens_per_s"] for p in pts], "o-", color=color, label=hw, ms=3)
    for what, style in (("h2d", "--"), ("cpu_adam", ":")):
        ax.axvline(pts[0]["min_tokens"][what], color=color, ls=style, lw=1)
ax.set_xscale("log", base=2)
ax.set_xlabel("tokens per step = tokens per layer visit (layer-major)")
ax.set_ylabel("predicted tokens/s")
ax.set_title("7b, bf16, seq 1024: dashed = weights hidden (F b / 2BW), dotted = CPU AdamW hidden", fontsize=9)
ax.legend()
fig.savefig(OUT / "throughput.png", dpi=100)
plt.close(fig)

# ----------------------------------------------------------------------------- host memory (lesson 6)
C120 = model.PRESETS["120b"]
fig, ax = plt.subplots(figsize=(9, 3.6), constrained_layout=True)
names, palette = [], ["#4c72b0", "#55a868", "#8172b2", "#dd8452", "#c44e52", "#937860", "#da8bc3", "#8c8c8c"]
component_color = {}
for y, (mode, clip) in enumerate([("fast", True), ("fast", False), ("lean", True), ("lean", False)]):
    p = planner.plan(C120, "h200", batch_size=4, seq_len=4096, mode=mode, grad_clip=float(clip), host_mem_gb=1536)
    left = 0.0
    for comp, b in p["host"].items():
        key = comp.split(":")[0].split(" (")[0]
        color = component_color.setdefault(key, palette[len(component_color) % len(palette)])
        ax.barh(y, b / 1e12, left=left, color=color, label=key if key not in names else None)
        names.append(key)
        left += b / 1e12
    ax.text(max(left, 1.5) + 0.02, y, f"{left:.2f} TB, {p['host_bytes_per_param']:.0f} B/param",
            va="center", fontsize=8)
ax.axvline(1536e9 * planner.HOST_USABLE / 1e12, color="k", ls="--", lw=1)
ax.text(1536e9 * planner.HOST_USABLE / 1e12, -0.55, " 1.5 TB host (97% usable)", fontsize=8, va="bottom")
ax.set_yticks(range(4), ["fast + clip", "fast", "lean + clip", "lean"])
ax.set_ylim(3.6, -0.8)                                         # first bar on top
ax.set_xlim(0, 2.7)
ax.set_xlabel("host memory, TB (120b on h200, 4 x 4096 tokens/step, megatrain_min.plan)")
ax.legend(fontsize=7, ncol=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
fig.savefig(OUT / "memory.png", dpi=100)
plt.close(fig)
print("wrote", ", ".join(str(p.relative_to(HERE.parent)) for p in sorted(OUT.glob("*.png"))))
