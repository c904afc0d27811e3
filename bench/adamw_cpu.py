"""CPU AdamW speed on buffers far larger than the last-level cache: the host bytes one update moves per parameter,
measured side by side in one run, against the host's own memory bandwidth measured the same way.

Variants (each on the same units, best of interleaved rounds; the bytes counted are the algorithm's, not measured):
  one pass   optim.HostStore.step: the fused kernel in tiles of optim.TILE elements, each tile's bf16 shadow
             written while the tile is in cache -- read p g m v (16 B), write p m v (12 B), write the shadow (2 B)
  two passes the kernel over the whole unit, then the shadow from the master (the engine before 2026-11-27):
             the 30 B above + reading the master back from DRAM (4 B) = 34 B
  lean       no shadow (--mode lean streams the fp32 master and casts it on the GPU): 28 B
  triad      a = b + s * c over fp32 arrays as large (STREAM's triad, 12 B per element): the host's bandwidth
  torch      torch.optim.AdamW(fused=True) over the same parameters as separate tensors, no shadow (28 B)
Reports ms per unit, Gparam/s, GB/s at the counted bytes, and each variant's share of the triad bandwidth.
With CUDA, also what the host's DRAM gives when both copy engines stream at once (gpu_update.GpuUpdates moves a
unit's master, m and v over PCIe both ways while the optimizer thread runs AdamW on the others): the lean AdamW
alone and under pinned H2D + D2H copies of a unit's 12 B/param, and the copies alone and under the AdamW -- the
models (megatrain_min/sim/twin.py, plan/timing.py) assume neither slows the other beyond the measured 101 GB/s.

    python bench/adamw_cpu.py                       # >= 4x the L3 in all, units of up to a 7B-width layer
    python bench/adamw_cpu.py --params 8e8 --unit 202383360   # 4 Llama-2-7B-width layers (gpu_run.sh: ~40 GB)
    python bench/adamw_cpu.py --json OUT.json
    python bench/adamw_cpu.py --dma-only --params 4.05e8 --unit 202383360   # gpu_run.sh --quick: ~10 s
--dma-only: the lean AdamW alone (its yardstick) and the DMA part, nothing else; the values are filled, not drawn
(AdamW's speed does not depend on them, and drawing 2 x 400M normals takes seconds).
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import optim  # noqa: E402
from megatrain_min.engine.pinned import page_locked  # noqa: E402
from optim import HostStore  # noqa: E402

LAYER_7B = 202_383_360   # parameters of one Llama-2-7B-width layer (d 4096, ff 11008): the wide case's unit


def l3_bytes():
    try:
        sizes = [p.read_text().strip() for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
        return max(int(s[:-1]) * {"K": 2**10, "M": 2**20}[s[-1]] for s in sizes if s[-1] in "KM")
    except (OSError, ValueError):
        return 32 * 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, help="parameters in all (default: >= 4x the L3 at 18 B/param, "
                                                 "at least 2 units)")
    ap.add_argument("--unit", type=float, help="parameters per unit (default: a 7B-width layer, or half of --params)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each is reported")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the harness, not the speed")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dma-only", action="store_true",
                    help="the lean AdamW alone and under both copy engines (dma_contention), nothing else")
    args = ap.parse_args()
    total = 2e5 if args.smoke else args.params or 4 * l3_bytes() / 18     # >= 4x the L3 at 18 B/param
    unit = int(args.unit or min(LAYER_7B, max(total / 2, 2 * optim.TILE)))   # >= 2 tiles: one pass differs
    n_units = max(2, math.ceil(total / unit))
    N, n_triad = n_units * unit, max(unit, l3_bytes())                    # the triad: 3 arrays of >= the L3
    need = N * (18 + 16) + n_triad * 12 + 24 * unit   # the store + shadow, torch's copy, the triad's arrays,
    #                                                   the DMA part's two page-locked units (12 B/param each)
    if not args.smoke and hasattr(os, "sysconf") and need > 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_AVPHYS_PAGES"):
        sys.exit(f"adamw_cpu: {N:,} params need ~{need / 1e9:.0f} GB of free RAM; pass a smaller --params")
    n_decay = unit * 99 // 100                    # [matrices | vectors], as a layer
    if args.dma_only:
        return dma_only(unit, n_decay, n_units, args)
    print(f"{n_units} units x {unit:,} params = {N:,} ({N * 18 / 1e9:.1f} GB with the shadow; L3 "
          f"{l3_bytes() / 2**20:.0f} MiB); torch {torch.__version__}, {torch.get_num_threads()} threads")

    opt = HostStore([(unit, n_decay)] * n_units, lr=1e-4, shadow_dtype=torch.bfloat16)
    lean = HostStore([(unit, n_decay)] * n_units, lr=1e-4)
    for o in (opt, lean):
        for u in range(n_units):
            o.master[u].normal_(0, 0.02), o.grad[u].normal_(0, 1e-3)
    params = [torch.nn.Parameter(torch.randn(n) * 0.02) for u in range(n_units) for n in (n_decay, unit - n_decay)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    ref = torch.optim.AdamW([{"params": params[0::2], "weight_decay": 0.1},
                             {"params": params[1::2], "weight_decay": 0.0}], lr=1e-4, fused=True)
    a, b, c = (torch.rand(n_triad) for _ in range(3))

    def two_passes():
        tile = optim.TILE
        optim.TILE = unit                          # one kernel call per region, then the shadow copy
        try:
            for u in range(n_units):
                opt.step(u)
        finally:
            optim.TILE = tile

    variants = {  # name: (fn, bytes per parameter counted, elements per call)
        "one pass (HostStore)": (lambda: [opt.step(u) for u in range(n_units)], 30, N),
        "two passes (whole-unit kernel, then shadow)": (two_passes, 34, N),
        "lean (no shadow)": (lambda: [lean.step(u) for u in range(n_units)], 28, N),
        "torch.optim.AdamW(fused=True)": (ref.step, 28, N),
        "triad a = b + s c (STREAM)": (lambda: [torch.add(b, c, alpha=3.0, out=a) for _ in range(3)], 12, 3 * n_triad),
    }
    best = dict.fromkeys(variants, math.inf)
    for _ in range(args.rounds):                   # interleaved: every variant sees the same machine state
        for name, (fn, _, _) in variants.items():
            fn()                                   # warm (first touch, caches)
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    triad_gbs = 12 * 3 * n_triad / best["triad a = b + s c (STREAM)"] / 1e9
    rows = {}
    for name, (_, bpp, n) in variants.items():
        t = best[name]
        rows[name] = dict(ms_per_unit=t / n * unit * 1e3, gparams_per_s=n / t / 1e9, bytes_per_param=bpp,
                          gbs=bpp * n / t / 1e9, of_triad=bpp * n / t / 1e9 / triad_gbs)
        r = rows[name]
        print(f"{name:<46} {r['ms_per_unit']:8.1f} ms/unit  {r['gparams_per_s']:6.2f} Gparam/s  {bpp:2d} B/param "
              f"{r['gbs']:7.1f} GB/s  {r['of_triad']:5.2f} of triad")
    one, two = rows["one pass (HostStore)"], rows["two passes (whole-unit kernel, then shadow)"]
    print(f"one pass / two passes: {two['ms_per_unit'] / one['ms_per_unit']:.2f}x faster; "
          f"HostStore lean / torch fused: {rows['torch.optim.AdamW(fused=True)']['ms_per_unit'] / rows['lean (no shadow)']['ms_per_unit']:.2f}x")
    result = dict(params=N, unit=unit, units=n_units, l3_bytes=l3_bytes(), threads=torch.get_num_threads(),
                  torch=torch.__version__, tile=optim.TILE, rows=rows)
    if args.json:                                  # written before the DMA part: that one needs a GPU
        Path(args.json).write_text(json.dumps(result, indent=1))
    if torch.cuda.is_available():
        result["dma_contention"] = contention(lambda: [lean.step(u) for u in range(n_units)],
                                              best["lean (no shadow)"], unit, 28 * N, args.rounds)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


def dma_only(unit, n_decay, n_units, args):
    """--dma-only: the lean AdamW over n_units units alone (best of args.rounds), then under both copy engines."""
    lean = HostStore([(unit, n_decay)] * n_units, lr=1e-4)
    for u in range(n_units):
        lean.master[u].fill_(0.02)
        lean.grad[u].fill_(1e-3)
    adamw, best = (lambda: [lean.step(u) for u in range(n_units)]), math.inf
    for _ in range(args.rounds):
        adamw()                                    # warm (first touch, caches)
        t0 = time.perf_counter()
        adamw()
        best = min(best, time.perf_counter() - t0)
    N = n_units * unit
    result = dict(params=N, unit=unit, units=n_units, threads=torch.get_num_threads(), torch=torch.__version__,
                  tile=optim.TILE, rows={"lean (no shadow)": dict(ms_per_unit=best / n_units * 1e3,
                                                                 gbs=28 * N / best / 1e9, bytes_per_param=28)})
    print(f"lean AdamW: {best / n_units * 1e3:.1f} ms per unit of {unit:,}, {28 * N / best / 1e9:.0f} GB/s")
    if torch.cuda.is_available():
        result["dma_contention"] = contention(adamw, best, unit, 28 * N, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def contention(adamw, adamw_alone_s, unit, adamw_bytes, rounds):
    """GB/s of the host AdamW (`adamw`: adamw_bytes of DRAM traffic, adamw_alone_s alone) while both copy engines
    stream a unit's master, m, v (12 B/param, page-locked) to and from the GPU, and of the copies alone and while
    the AdamW runs (as many trips each way as last about as long as the AdamW alone)."""
    n = 3 * unit                                               # a unit's master, m, v: fp32
    host_in, host_out = page_locked(n), page_locked(n)
    dev_in, dev_out = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    lanes = [(torch.cuda.Stream(), dev_in, host_in), (torch.cuda.Stream(), host_out, dev_out)]   # H2D, D2H

    def copies(k):                                             # k trips each way, queued: their GB/s, once synced
        marks = []
        for stream, dst, src in lanes:
            with torch.cuda.stream(stream):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(k):
                    dst.copy_(src, non_blocking=True)
                end.record()
            marks.append((start, end))
        return lambda: [k * 4 * n / (a.elapsed_time(b) / 1e3) / 1e9 for a, b in marks]

    alone = [0.0, 0.0]
    for _ in range(rounds):
        rates = copies(2)
        torch.cuda.synchronize()
        alone = [max(x, y) for x, y in zip(alone, rates())]
    k = max(2, round(adamw_alone_s / (4 * n / (min(alone) * 1e9))))
    best, under = math.inf, [0.0, 0.0]
    for _ in range(rounds):
        torch.cuda.synchronize()
        rates = copies(k)
        t0 = time.perf_counter()
        adamw()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
        under = [max(x, y) for x, y in zip(under, rates())]
    out = dict(adamw_alone_gbs=adamw_bytes / adamw_alone_s / 1e9, adamw_under_dma_gbs=adamw_bytes / best / 1e9,
               h2d_alone_gbs=alone[0], d2h_alone_gbs=alone[1], h2d_under_adamw_gbs=under[0],
               d2h_under_adamw_gbs=under[1], trips=k)
    print(f"DRAM shared: lean AdamW {out['adamw_alone_gbs']:.0f} GB/s alone, {out['adamw_under_dma_gbs']:.0f} under "
          f"both copy engines ({k} trips of {4 * n / 1e9:.1f} GB each way); H2D {alone[0]:.1f} / D2H {alone[1]:.1f} "
          f"GB/s alone, {under[0]:.1f} / {under[1]:.1f} GB/s under the AdamW")
    return out


if __name__ == "__main__":
    main()
