"""bench/long_context_memory.py -- does memory follow the tile or T x d_ff? Peak RSS of one long-context step.

What it is
    For each (seq_len, tile_tokens), a fresh process builds stream.Trainer for a narrow model whose MLP is wide
    (d 64, d_ff 2048, 2 layers, byte vocabulary: the (T, d_ff) tensors dominate the untiled layer) and runs one
    training step of one sequence on the CPU, where the engine's "device" buffers live in host memory too. It
    reports the process's peak RSS (VmHWM), the RSS before the step, their difference (the step's own memory), the
    planner's device bytes for the same run (megatrain_min/plan, local hardware: on the CPU the device buffers are host
    memory) and the step's time.
    The child runs with MALLOC_MMAP_THRESHOLD_=131072: glibc then maps every allocation of 128 KB or more and
    unmaps it on free, so RSS follows the live tensors instead of glibc's arena high-water mark.
What it is not
    Not a test (nothing is asserted) and not a speed benchmark: on the CPU a tiled layer is slower (smaller
    matmuls, part A computed once more in the backward). Results with their date and command: bench/NOTES.md.
Run
    python bench/long_context_memory.py                                  # T 8192 and 16384 x tiles 0, 4096, 1024
    python bench/long_context_memory.py --seq-lens 16384 --tiles 0,1024  # ~1-2 min per run on 2 cores
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
from megatrain_min import engine  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402

NARROW = dict(vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, d_model=64, d_ff=2048)


def rss():
    """(resident, peak resident) bytes of this process (Linux: VmRSS, VmHWM)."""
    s = Path("/proc/self/status").read_text()
    return [int(re.search(rf"{k}:\s+(\d+) kB", s)[1]) << 10 for k in ("VmRSS", "VmHWM")]


def child(T, tile):
    """One step at (T, tile) in this process; prints one JSON line."""
    from megatrain_min.engine.checks import CheckedTrainer
    cfg = model.GPTConfig(max_seq_len=T, **NARROW)
    t = CheckedTrainer(cfg, model.init_weights(cfg, 0), device="cpu", **engine.parts(tile_tokens=tile))
    gen = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (1, T), generator=gen)
    before = rss()[0]
    t0 = time.perf_counter()
    loss = t.step(tok, tok.roll(-1, 1))
    t.wait()
    dt = time.perf_counter() - t0
    now, peak = rss()
    p = planner.plan(cfg, "local", batch_size=1, seq_len=T, dtype="fp32", grad_clip=0.0, tile_tokens=tile)
    print(json.dumps(dict(seq_len=T, tile_tokens=tile, loss=loss, step_s=dt, rss_before_gb=before / 1e9,
                          peak_rss_gb=peak / 1e9, step_peak_gb=(peak - before) / 1e9,
                          planned_device_gb=p["gpu_bytes"] / 1e9,
                          planned_layer_gb=sum(v for k, v in p["gpu"].items()
                                               if k.startswith(("recompute", "whole-sequence", "token-local"))) / 1e9)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", default="8192,16384", help="comma-separated sequence lengths")
    ap.add_argument("--tiles", default="0,4096,1024", help="comma-separated tile_tokens (0 = untiled)")
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(*a.child)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    print(f"narrow model {NARROW}, one step of 1 sequence, fp32 on the CPU, torch {torch.__version__}")
    print(f"{'T':>7} {'tile':>6} {'peak RSS GB':>12} {'step peak GB':>13} {'planned device GB':>18} "
          f"{'of which layer GB':>18} {'step s':>7} {'loss':>8}")
    for T in map(int, a.seq_lens.split(",")):
        for tile in map(int, a.tiles.split(",")):
            r = subprocess.run([sys.executable, __file__, "--child", str(T), str(tile)], env=env, cwd=ROOT,
                               capture_output=True, text=True, check=True)
            res = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"{T:>7} {tile:>6} {res['peak_rss_gb']:>12.3f} {res['step_peak_gb']:>13.3f} "
                  f"{res['planned_device_gb']:>18.3f} {res['planned_layer_gb']:>18.3f} {res['step_s']:>7.1f} "
                  f"{res['loss']:>8.4f}", flush=True)


if __name__ == "__main__":
    main()
