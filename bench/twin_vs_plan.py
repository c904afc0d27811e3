"""bench/twin_vs_plan.py -- the timeline twin against the planner at full depth: docs/planning.md's 100b/120b table and
7b/14b on an H100 (fast and lean, clipping on and off). Predictions both; the point is that two independent
models of one schedule agree (docs/design.md, section 'Without a GPU'). Writes bench/results/twin_vs_plan.md.

    python bench/twin_vs_plan.py              # ~15 min on a 2-core CPU (each 100b/120b row replays ~100k ops)
    python bench/twin_vs_plan.py --quick      # the 7b rows only
"""
import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = [(n, hw, mode, 0.0, 4) for n in ("100b", "120b") for hw in ("h200", "gh200") for mode in ("fast", "lean")] + \
       [(n, "h100", mode, clip, 4) for n in ("7b", "14b") for mode in ("fast", "lean") for clip in (0.0, 1.0)]

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--quick", action="store_true", help="only the 7b rows")
args = ap.parse_args()
rows = [r for r in ROWS if r[0] == "7b"] if args.quick else ROWS
lines = [f"# twin vs planner, full depth ({datetime.date.today()}, `python bench/twin_vs_plan.py`)", "",
         "Both are predictions (plan.py's HARDWARE profiles); 4 x 4096 tokens per step, 1 micro-batch, 1536 GB of host "
         "RAM for the 100b/120b rows.", "",
         "| model | GPU | mode | clip | plan s/step | twin s/step | twin/plan | plan bottleneck | twin bottleneck "
         "| twin peak GPU GB | replay wall s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
for name, hw, mode, clip, B in rows:
    cmd = [sys.executable, "-m", "megatrain_min.sim", "timeline", "--config", name, "--hardware", hw, "--mode", mode,
           "--grad-clip", str(clip), "--batch-size", str(B), "--seq-len", "4096", "--json"] + \
          (["--host-mem", "1536"] if name in ("100b", "120b") else [])
    t0 = time.time()
    r = json.loads(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    lines.append(f"| {name} | {hw} | {mode} | {clip or 'off'} | {r['plan_step_time_s']:.3g} | {r['step_time_s']:.3g} | "
                 f"{r['step_time_s'] / r['plan_step_time_s']:.3f} | {r['plan_bottleneck']} | {r['bottleneck']} | "
                 f"{r['peak_gpu_bytes'] / 1e9:.1f} | {time.time() - t0:.0f} |")
    print(lines[-1], flush=True)
out = ROOT / "bench" / "results" / "twin_vs_plan.md"
out.parent.mkdir(exist_ok=True)
out.write_text("\n".join(lines) + "\n")
print(f"wrote {out}")
