"""bench/twin_vs_plan.py -- the timeline twin and the planner, against each other and against a measured GPU run.

    python bench/twin_vs_plan.py --measured bench/results/2026-11-27-nvidia-h200   # ~2 min on a 2-core CPU
    python bench/twin_vs_plan.py              # twin vs planner, full depth: 100b/120b and 7b/14b (~15 min)
    python bench/twin_vs_plan.py --quick      # the 7b rows only
    python bench/twin_vs_plan.py --quick-run OUT/quick   # bash bench/gpu_run.sh --quick's rows (~15 s a row)

--measured DIR: DIR holds bench/gpu.py's results.json (the run of ../shared/gpu/2026-11-27-h200 is committed as
bench/results/2026-11-27-nvidia-h200). The twin (the real engine replayed at full size, megatrain_min/sim/twin.py) and
the planner (megatrain_min/plan/timing.py's analytic schedule) predict each measured stream case -- the wide case at
its token counts, clipped and as planned, and the peers' stream runs -- on plan.hardware.HARDWARE["h200"] (made from
that measurement; the host memory the run saw) with the engine as it was measured: in the first run no resident
units and the shadow refreshed in a second pass over the unit (optim.TILE = the whole unit); in later runs the
resident units and grad clip each case names; the optimizer thread's order as the results' meta names it (none:
first come, first served, as optim.Worker ran before it picked the landed unit the next forward needs first). Exit status 1 when either model is more than 10% off a measured step.
After the first run's table the same models predict the engine as it is now on that H200: the issue-33 targets.
Everything after the measured table is a prediction; bench/NOTES.md keeps them beside what a GPU later measures.
Writes bench/results/twin_vs_plan.md (full depth) or DIR/twin_vs_plan.md (--measured).
"""
import argparse
import dataclasses
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
import optim  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402
from megatrain_min.plan import hardware, timing  # noqa: E402
from megatrain_min.sim import record, twin  # noqa: E402

ROWS = [(n, hw, mode, 0.0, 4) for n in ("100b", "120b") for hw in ("h200", "gh200") for mode in ("fast", "lean")] + \
       [(n, "h100", mode, clip, 4) for n in ("7b", "14b") for mode in ("fast", "lean") for clip in (0.0, 1.0)]
WIDE = dict(vocab_size=32000, n_head=32, n_kv_head=32, d_model=4096, d_ff=11008, max_seq_len=4096)  # bench/gpu.py's
SEQ = 4096                          # bench/gpu.py: one sequence of 4096 tokens per micro-batch
TOLERANCE = 0.10


def predict(cfg, hw, B, M, twin_too=True, need_first=True, grad_slabs=None, seq=SEQ, **kw):
    """(twin result or None, plan) of cfg on hardware dict hw at B x seq tokens in M micro-batches; kw: the engine's
    settings (grad_clip, mode, resident_units, offload_activations), as bench/gpu.py runs it (no guard). need_first:
    the optimizer thread's order (False: first come, first served, the engine of the earlier runs); grad_slabs: the
    gradient slabs (None: the plan's; the earlier runs had 3)."""
    timing.NEED_FIRST, was = need_first, timing.NEED_FIRST
    try:
        return predict_as(cfg, hw, B, M, twin_too, need_first, grad_slabs, seq, **kw)
    finally:
        timing.NEED_FIRST = was


def predict_as(cfg, hw, B, M, twin_too, need_first, grad_slabs, seq, **kw):
    kw = dict(dict(grad_clip=0.0, mode="fast", resident_units=0, offload_activations=False), **kw)
    p = planner.plan(cfg, hw, batch_size=B, seq_len=seq, micro_batches=M, dtype="bf16", skip_nonfinite=False,
                     grad_slabs=grad_slabs, **kw)
    if not twin_too:
        return None, p
    tw = twin.Twin(p["hardware"], need_first=need_first)
    record.run(cfg, [tw], 3, fake=True, sources=False, costs=True, batch=(B, seq), dtype=torch.bfloat16,
               micro_batches=M, grad_slabs=p["grad_slabs"] or 3,
               **dict(kw, resident_units=p["resident_units"], gpu_updated_units=p["gpu_updated_units"]))
    return tw.result_of(cfg, B * seq), p


def read_results(d):
    """DIR/results.json as bench/gpu.py writes it, holding what measured() reads first; else SystemExit, one line."""
    path = d / "results.json"
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as e:                      # unreadable, not UTF-8, not JSON
        sys.exit(f"twin_vs_plan: {path} cannot be read as JSON ({e}); give the directory of a bench/gpu.py run")
    for keys in (("meta", "host_available_gb"), ("cases", "wide", "at_min_tokens", "tokens")):
        at = res
        for k in keys:
            if not isinstance(at, dict) or k not in at:
                sys.exit(f"twin_vs_plan: {path} is not bench/gpu.py's results (no {'.'.join(keys)}); give the "
                         "directory of a bench/gpu.py run")
            at = at[k]
    return res


def measured(d):
    res = read_results(d)
    hw = dict(hardware.HARDWARE["h200"], host_mem_gb=res["meta"]["host_available_gb"], name="h200 (measured)")
    wide, peers = res["cases"]["wide"], res["cases"].get("peers", {})
    M = wide["at_min_tokens"]["tokens"] // SEQ                # bench/gpu.py: the trainer's micro-batches
    cases = [(f"wide @ {k.split('_')[1]} tokens", wide[k], M, 0.0) for k in
             ("at_min_tokens", "at_2x_tokens", "at_4x_tokens", "at_8x_tokens") if "step_s" in wide.get(k, {})]
    clip_of = lambda k: float(re.search(r"clip_([0-9.]+)", k).group(1))  # noqa: E731  clip_1, lean_clip_0, clip_1_host
    cases += [(f"wide @ min tokens{', as planned' if k.startswith('planned') else ''}, clip {clip_of(k):g}"
               f"{', lean' if k.startswith('lean') else ''}{', every update on the host' if k.endswith('_host') else ''}",
               wide[k], M, clip_of(k)) for k in sorted(wide)
              if k.startswith(("clip_", "planned_clip_", "lean_clip_")) and "step_s" in wide[k]]
    cases += [(f"peers: {k}", peers[k], peers[k]["tokens"] // SEQ, 0.0) for k in ("stream", "stream_0_resident")
              if "step_s" in peers.get(k, {})]
    two_passes = "resident_units" not in wide["at_min_tokens"]   # the first run: the engine before both
    order = res["meta"].get("update_order", "first come, first served")
    lines = [f"# twin and planner vs the measured run {d.name} ({datetime.date.today()}, "
             f"`python bench/twin_vs_plan.py --measured {d.relative_to(ROOT) if d.is_relative_to(ROOT) else d}`)",
             "", f"Profile: plan.hardware.HARDWARE['h200'], host memory {hw['host_mem_gb']:.0f} GB; the engine as "
             "measured: " + ("no resident units, the shadow in a second pass (optim.TILE = whole unit)" if two_passes
                             else "the resident units each case names, one host pass") +
             f", the grad clip each case names (else 0), 3 gradient slabs, the optimizer thread's order {order}.",
             "",
             "| case | layers | tokens | M | resident | measured s | twin s | twin/measured | planner s | "
             "planner/measured |", "|---|---|---|---|---|---|---|---|---|---|"]
    worst, tile = 0.0, optim.TILE
    optim.TILE = 1 << 40 if two_passes else tile   # the first run: one kernel call per region, then the copy
    try:
        for name, r, M, clip in cases:
            cfg = model.GPTConfig(n_layer=r["n_layer"], **WIDE)
            t0 = time.time()
            k = r.get("resident_units", 0)
            tw, p = predict(cfg, hw, r["tokens"] // SEQ, M, offload_activations=bool(r.get("offload")),
                            resident_units=k, grad_clip=clip, need_first=order == "need-first", mode=r.get("mode", "fast"),
                            grad_slabs=r.get("grad_slabs", 3), gpu_updated_units=r.get("gpu_updated_units", 0))
            a, b = tw["step_time_s"] / r["step_s"], p["step_time_s"] / r["step_s"]
            worst = max(worst, abs(a - 1), abs(b - 1))
            lines.append(f"| {name} | {r['n_layer']} | {r['tokens']:,} | {M} | {k} | {r['step_s']:.3f} | "
                         f"{tw['step_time_s']:.3f} | {a:.3f} | {p['step_time_s']:.3f} | {b:.3f} |")
            print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)
    finally:
        optim.TILE = tile
    verdict = worst <= TOLERANCE
    lines += ["", f"worst |model / measured - 1| = {worst:.3f}: {'within' if verdict else 'OUTSIDE'} "
                  f"{TOLERANCE:.0%}", ""]
    lines += predictions(hw, res, wide) if two_passes else []
    (d / "twin_vs_plan.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[lines.index("") + 1:]))
    print(f"wrote {d / 'twin_vs_plan.md'}")
    return 0 if verdict else 1


def predictions(hw, res, wide):
    """The engine as it is now (one host pass, resident units, streamed units updated on the GPU where the plan
    picks them), on the measured H200: the issue-33 targets."""
    L = wide["n_layer"]
    cfg = model.GPTConfig(n_layer=L, **WIDE)
    units = len(model.units(cfg))
    few = units // 10                              # the streaming regime a 120b run is in: <= 10% resident
    gpu_only = wide["at_min_tokens"]["compute_only_s"]
    out = ["## Predictions: the engine now, on the measured H200 (twin; planner in brackets)", "",
           f"GPU-only time of the wide case (measured, compute_only_s): {gpu_only:.3f} s at 16,384 tokens.", "",
           "| case | tokens | clip | mode | resident units | updated on the GPU | twin s | planner s | GPU-only / step "
           "| bottleneck |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(4, clip, mode, few, g) for clip in (0.0, 1.0) for mode in ("fast", "lean") for g in (0, None)] + \
        [(4, 0.0, "fast", None, None), (4, 1.0, "fast", None, None)]
    for B, clip, mode, k, g in rows:
        tw, p = predict(cfg, hw, B, 4, grad_clip=clip, mode=mode, resident_units=k, gpu_updated_units=g)
        ratio = gpu_only * B / 4 / tw["step_time_s"]
        out.append(f"| wide, {L} layers | {B * SEQ:,} | {clip:g} | {mode} | {p['resident_units']} of {units} | "
                   f"{p['gpu_updated_units']}{' (the plan)' if g is None else ''} | {tw['step_time_s']:.3f} | "
                   f"({p['step_time_s']:.3f}) | {ratio:.2f} | {tw['bottleneck']} |")
        print(out[-1], flush=True)
    sweep = []
    for mode in ("fast", "lean"):
        for clip in (0.0, 1.0):
            for B in (4, 8, 16, 32):
                _, p = predict(cfg, hw, B, 4, twin_too=False, grad_clip=clip, mode=mode, resident_units=few)
                _, g = predict(cfg, hw, B, 4, twin_too=False, grad_clip=clip, mode=mode, resident_units=units)
                sweep.append((mode, clip, B * SEQ, g["step_time_s"] / p["step_time_s"]))
    out += ["", f"Token sweep (planner), {few} of {units} units resident, the plan's units updated on the GPU: step "
                "with every unit resident / step "
                "(the GPU-only share), and the smallest count reaching 0.95:", "",
            "| mode | clip | 16k | 32k | 64k | 128k | smallest >= 0.95 |", "|---|---|---|---|---|---|---|"]
    for mode in ("fast", "lean"):
        for clip in (0.0, 1.0):
            r = [(t, x) for m, c, t, x in sweep if m == mode and c == clip]
            first = next((f"{t:,}" for t, x in r if x >= 0.95), "beyond 128k")
            out.append(f"| {mode} | {clip:g} | " + " | ".join(f"{x:.2f}" for _, x in r) + f" | {first} |")
    peers = res["cases"]["peers"]
    cfg8 = model.GPTConfig(n_layer=peers["n_layer"], **WIDE)
    tw, p = predict(cfg8, hw, 4, 4, resident_units=None)
    out += ["", f"Peers, {peers['n_layer']} layers, 16,384 tokens: the engine with the planner's "
                f"{p['resident_units']} resident units {tw['step_time_s']:.3f} s (planner {p['step_time_s']:.3f}) vs "
                f"the measured resident trainer with per-layer checkpointing {peers['resident']['step_s']:.3f} s: "
                f"{peers['resident']['step_s'] / tw['step_time_s']:.2f}x its speed."]
    big = dict(hw, host_mem_gb=1536, name="h200 + 1.5 TB")
    out += ["", "120b on one H200 with 1.5 TB of host RAM and the measured 16-core host (planner; one sequence of "
                "4096 tokens per micro-batch):", "",
            "| mode | clip | tokens | fits | host TB | step s | model TFLOP/s | overlap | resident units | updated on "
            "the GPU | bottleneck |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for clip in (0.0, 1.0):
        for B in (4, 8, 16):
            p = planner.plan(model.PRESETS["120b"], big, batch_size=B, seq_len=SEQ, micro_batches=B, mode="lean",
                             grad_clip=clip, skip_nonfinite=False)
            out.append(f"| lean | {clip:g} | {B * SEQ:,} | {'yes' if p['fits'] else 'no'} | {p['host_bytes'] / 1e12:.2f} | "
                       f"{p['step_time_s']:.1f} | {p['model_tflops']:.0f} | {p['utilization']['compute']:.2f} | "
                       f"{p['resident_units']} | {p['gpu_updated_units']} | {p['bottleneck']} |")
    return out


def quick_run(d):
    """The twin and the planner beside each measured row of bench/gpu.py --quick's DIR/results.json (the config it
    records; the measured H200's profile with the host memory the run saw): DIR/twin_vs_plan.md. Exit status 1
    when either model is more than TOLERANCE off a measured (steady) step."""
    res = json.loads((d / "results.json").read_text())
    q = res["cases"]["quick"]
    hw = dict(hardware.HARDWARE["h200"], host_mem_gb=res["meta"]["host_available_gb"], name="h200 (measured)")
    cfg = model.GPTConfig(**q["model"])
    lines = [f"# twin and planner vs bench/gpu.py --quick's rows, {d.name} ({datetime.date.today()}, "
             f"`python bench/twin_vs_plan.py --quick-run {d.relative_to(ROOT) if d.is_relative_to(ROOT) else d}`)",
             "", f"Profile: plan.hardware.HARDWARE['h200'], host memory {hw['host_mem_gb']:.0f} GB; "
             f"{q['n_layer']} layers, {q['resident_units']} of {q['units']} units resident, each row's engine as run.",
             "", "| row | tokens (B x T) | measured s (steady) | measured s (synced per step) | twin s | twin / "
             "measured | planner s | planner / measured |", "|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for name, r in q["rows"].items():
        if "step_s" not in r:
            lines.append(f"| {name} | {r['tokens']:,} | skipped: {r.get('skipped')} | | | | | |")
            continue
        tw, p = predict(cfg, hw, r["batch"], r["micro_batches"], seq=r["seq"], grad_clip=r["grad_clip"],
                        mode=r["mode"], resident_units=r["resident_units"], gpu_updated_units=r["gpu_updated_units"],
                        grad_slabs=r["grad_slabs"] or None, offload_activations=r["offload"])
        a, b = tw["step_time_s"] / r["step_s"], p["step_time_s"] / r["step_s"]
        worst = max(worst, abs(a - 1), abs(b - 1))
        lines.append(f"| {name} | {r['tokens']:,} ({r['batch']} x {r['seq']}) | {r['step_s']:.3f} | "
                     f"{r['step_synced_s']:.3f} | {tw['step_time_s']:.3f} | {a:.3f} | {p['step_time_s']:.3f} | "
                     f"{b:.3f} |")
        print(lines[-1], flush=True)
    verdict = worst <= TOLERANCE
    lines += ["", f"worst |model / measured - 1| = {worst:.3f}: {'within' if verdict else 'OUTSIDE'} {TOLERANCE:.0%}"]
    (d / "twin_vs_plan.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {d / 'twin_vs_plan.md'}")
    return 0 if verdict else 1


def full_depth(quick):
    rows = [r for r in ROWS if r[0] == "7b"] if quick else ROWS
    lines = [f"# twin vs planner, full depth ({datetime.date.today()}, `python bench/twin_vs_plan.py`)", "",
             "Both are predictions (plan.hardware.HARDWARE's profiles); 4 x 4096 tokens per step, 1 micro-batch, 1536 GB of "
             "host RAM for the 100b/120b rows, the planner's resident units.", "",
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
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", help="a directory with bench/gpu.py's results.json: hold both models to it")
    ap.add_argument("--quick", action="store_true", help="(full depth) only the 7b rows")
    ap.add_argument("--quick-run", help="a directory with bench/gpu.py --quick's results.json: the twin beside "
                                        "its rows")
    a = ap.parse_args()
    if a.quick_run:
        return quick_run(Path(a.quick_run).resolve())
    if a.measured:
        d = Path(a.measured).resolve()
        if not (d / "results.json").is_file():
            sys.exit(f"twin_vs_plan: {d} holds no results.json (bench/gpu.py's output); give the run's directory")
        return measured(d)
    return full_depth(a.quick)


if __name__ == "__main__":
    sys.exit(main())
