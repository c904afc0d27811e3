"""multi_gpu.py -- train.py on N GPUs (torchrun, megatrain_min/engine/sharded.py) against train.py on one: same losses?
how much faster? Writes OUT/multi_gpu.json after every case (a timeout keeps what was measured).

What it measures
    exact: the acceptance run of issue 16 in fp32 (TF32 off), N ranks against one process with the same flags
        (the same global batch): the worst per-step relative loss difference.
    scaling: the small preset in bf16, one GPU at B sequences per step against N GPUs at N x B (B each): tokens/s
        of each (the median step, warm-up dropped), the speed-up and the efficiency speed-up / N.
    Numbers: what train.py writes to metrics.jsonl (tokens_per_s: the step's tokens / its wall time on rank 0).
What it is not
    No GPU run of it is committed yet. --smoke runs the same on the CPU (gloo, 2 ranks, toy sizes) to check the
    harness on any machine.
Try it
    python bench/multi_gpu.py --out out-gpu/multi            # bench/gpu_run.sh runs it when there are >= 2 GPUs
    python bench/multi_gpu.py --smoke --out /tmp/multi        # CPU, 2 ranks, ~1 minute
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EXACT = ["--config", "toy", "--n-kv-head", "2", "--batch-size", "8", "--seq-len", "64", "--micro-batches", "2",
         "--grad-clip", "1.0", "--steps", "8", "--save-every", "4", "--sample-tokens", "0"]


def run(out, flags, world):
    """train.py with flags, in one process (world 1) or under torchrun --standalone; returns its metrics records."""
    launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc-per-node", str(world)]
    cmd = [*launch, str(ROOT / "train.py"), *flags, "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (out.parent / f"{out.name}.log").write_text(" ".join(cmd) + "\n" + p.stdout + p.stderr)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], " ".join(cmd)


def main():
    ap = argparse.ArgumentParser(description="N GPUs (torchrun) against one: losses and tokens/s.")
    ap.add_argument("--out", required=True, help="directory for multi_gpu.json and the runs")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count(), help="ranks (default: every GPU)")
    ap.add_argument("--smoke", action="store_true", help="CPU, 2 gloo ranks, toy sizes: checks the harness")
    a = ap.parse_args()
    world = 2 if a.smoke else a.gpus
    if world < 2:
        ap.exit(2, f"error: {world} GPU(s) here; this bench needs 2 or more (or --smoke)\n")
    device = ["--device", "cpu"] if a.smoke else ["--device", "cuda"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("exact-*"), *out.glob("scaling-*")]:    # this bench's own runs of an earlier call: a
        shutil.rmtree(old) if old.is_dir() else old.unlink()      # rerun into the same --out starts them afresh
    res = dict(meta=dict(date=datetime.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
                         world=world, device=torch.cuda.get_device_name(0) if not a.smoke else "cpu (smoke)"),
               definitions=dict(worst_loss_rel="max over steps of |loss_N - loss_1| / loss_1, same flags",
                                tokens_per_s="median over the steps after the first 2 of train.py's tokens_per_s",
                                efficiency="tokens_per_s(N GPUs, N x B) / (N x tokens_per_s(1 GPU, B))"),
               cases={})

    def save():
        (out / "multi_gpu.json").write_text(json.dumps(res, indent=1) + "\n")

    flags = [*EXACT, *device, "--dtype", "fp32"]
    one, cmd1 = run(out / "exact-1", flags, 1)
    many, cmdn = run(out / f"exact-{world}", flags, world)
    res["cases"]["exact"] = dict(commands=[cmd1, cmdn], losses_1=[r["loss"] for r in one],
                                 losses_n=[r["loss"] for r in many],
                                 worst_loss_rel=max(abs(x["loss"] - y["loss"]) / y["loss"] for x, y in zip(many, one)))
    save()
    B, steps = (2, 6) if a.smoke else (8, 20)
    size = ["--config", "toy", "--seq-len", "64"] if a.smoke else ["--config", "small", "--seq-len", "1024"]
    tps = {}
    for n in (1, world):
        flags = [*size, *device, "--batch-size", str(n * B), "--steps", str(steps), "--grad-clip", "0",
                 "--eval-batches", "1", "--sample-tokens", "0"]
        recs, cmd = run(out / f"scaling-{n}", flags, n)
        tps[n] = statistics.median(r["tokens_per_s"] for r in recs[2:])
        res["cases"].setdefault("scaling", {"commands": []})["commands"].append(cmd)
    res["cases"]["scaling"].update(tokens_per_s_1=tps[1], tokens_per_s_n=tps[world], speedup=tps[world] / tps[1],
                                   efficiency=tps[world] / tps[1] / world)
    save()
    print(json.dumps(res["cases"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
