"""report.py -- the plan, printed: the table a person reads, the JSON a program reads, the
one-liners.

What it is
    format_plan(p): memory by component (host per node, GPU per GPU), the time of each layer visit,
    the prediction (step time, tokens/s, MFU), the bottleneck, the tokens per step that hide the
    transfers, the verdict and, when it does not fit, the nearest setting that does (fit.suggest);
    when it fits, alternatives(p): what clipping costs per step, and the other --mode where it is
    faster (each the plan of that setting).
    plan_json(p): every field of the plan as strict JSON, with "fix". describe_run(p): the line
    train.py prints of the run it is about to make; describe_max_context: the line of --plan
    --max-context; profile_line: a line per profile (--hardware all).
What it is not
    No arithmetic: every number is a plan's (megatrain_min/plan/__init__.py); tests compare them.
Try it
    python -m megatrain_min.plan --config 120b --hardware h200 --mode lean --host-mem 1536 \\
        --grad-clip 0 --batch-size 4 --seq-len 4096
"""
import json

import model
from megatrain_min import cli
from megatrain_min.plan import LEAN_FASTER, replan
from megatrain_min.plan.fit import longest_context, suggest
from megatrain_min.plan.hardware import GB
from megatrain_min.plan.memory import HOST_USABLE, count, size


def plan_json(p):
    """One JSON object: params, host_bytes, gpu_bytes, fits, step_time_s, tokens_per_s,
    model_tflops, bottleneck, mode -- and every other field of the plan (components in bytes, times
    in seconds), and "fix": the nearest setting that fits (train.py flags) when it does not."""
    fix = None if p["fits"] else suggest(p)
    return json.dumps(cli.finite_json({**p, "fix": fix})[0], allow_nan=False)


def tiling(p):
    """How the plan runs a layer, in words: 'untiled' or 'in tiles of 8,192 tokens'."""
    return f"in tiles of {p['tile_tokens']:,} tokens" if p["tile_tokens"] else "untiled"


def format_plan(p):
    """The plan as a table a person reads: memory by component, per-visit times, prediction,
    verdicts."""
    hw, N, m, t = p["hardware"], p["params"], p["model"], p["visit_s"]
    cuda, many = hw["gpu_mem_gb"] > 0, p["world"] > 1
    verdict = lambda ok: "fits" if ok else "DOES NOT FIT"  # noqa: E731
    pct = lambda d: ", ".join(f"{k} {v:.0%}" for k, v in d.items())  # noqa: E731
    rows = [f"{p['config']}: {count(N)} params (L={m['n_layer']} d={m['d_model']} "
            f"heads={m['n_head']}/{m['n_kv_head']} ff={m['d_ff']} V={m['vocab_size']}) on "
            f"{hw['name']} ({hw['gpu']})",
            f"--mode {p['mode']}{f' (auto: ' + p['mode_why'] + ')' if p['mode_why'] else ''}, "
            f"{p['dtype']} compute, {p['batch_size']} x {p['seq_len']} = "
            f"{p['tokens_per_step']:,} tokens/step in {p['micro_batches']} micro-batch(es), grad "
            f"clip {p['grad_clip'] or 'off'}, {p['residual_dtype']} residual, boundary activations "
            f"{'offloaded' if p['offload_activations'] else 'on the device'}, layer {tiling(p)}"]
    if many:
        one = p["nodes"] == 1
        rows.append(f"sharded (megatrain_min/engine/sharded.py): {p['nodes']} node(s) x "
                    f"{p['gpus']} GPUs "
                    f"= {p['world']} ranks, each {p['batch_size'] // p['world']} sequences and "
                    f"1/{p['world']} of the host store; collectives over "
                    f"{'NVLink' if one else 'InfiniBand'} at "
                    f"{hw['nvlink_gbs'] if one else min(hw['nvlink_gbs'], hw['ib_gbs']):g} GB/s")
    per = (" per node", " per GPU") if many else ("", "")
    rows += ["", f"{'host memory' + per[0]:<50}{'GB':>10}{'B/param':>10}"]
    rows += [f"  {k:<48}{v / GB:10.2f}{v / N:10.2f}" for k, v in p["host"].items()]
    rows += [f"  {'total':<48}{p['host_bytes'] / GB:10.2f}{p['host_bytes'] / N:10.2f}   "
             f"{verdict(p['fits_host'])} in {size(p['host_limit_bytes'])} "
             f"({HOST_USABLE:.0%} of {size(hw['host_mem_gb'] * GB)})"]
    if cuda:
        rows += [f"  {'of it page-locked (what the copies read, write)':<48}"
                 f"{p['pinned_bytes'] / GB:10.2f}"]
    if p["grad_slabs_asked"] is None and p["grad_slabs"] > p["grad_slabs_fewest"]:
        rows += [f"  (gradient slabs: {p['grad_slabs_fewest']} hide one gradient's trip, "
                 f"{p['grad_slabs'] - p['grad_slabs_fewest']} more hold the optimizer thread's "
                 "backlog: the host's AdamW is slower than the backward)"]
    device = "GPU memory" + per[1] if cuda else "device buffers (CPU run: in host memory)"
    rows += ["", f"{device:<50}{'GB':>10}"]
    rows += [f"  {k:<48}{v / GB:10.2f}" for k, v in p["gpu"].items() if v]
    rows += [f"  {'total':<48}{p['gpu_bytes'] / GB:10.2f}" +
             (f"   {verdict(p['fits_gpu'])} in {size(hw['gpu_mem_gb'] * GB)}" if cuda else ""), "",
             resident_line(p), "",
             f"{'time per layer visit':<50}{'ms':>10}"]
    rule = cli.RULES[p["optimizer"]].__name__           # the update rule: AdamW, Lion
    adam = f"CPU {rule}" + (" + grad-norm pass" if p["defer_updates"] else "")
    rows += [f"  {k:<48}{v * 1e3:10.1f}" for k, v in (
        ("H2D weights", t["load"]), ("forward: 2NT + attention", t["fwd"]),
        ("recompute + backward: 2NT + 4NT + attention", t["bwd"]), ("D2H fp32 gradient", t["grad"]),
        (adam, t["adam"] + t["norm"] * p["defer_updates"]),
        ("head: loss forward + backward, 6 V d T", t["head"]))]
    if p["gpu_updated_units"]:                     # gpu_update.GpuUpdated.update: copies each way
        rows += [f"  {k:<48}{v * 1e3:10.1f}" for k, v in (
            (f"GPU-updated unit: master, state H2D (+ {rule})", t["visit_h2d"] + t["gpu_adam"]),
            ("GPU-updated unit: master, state (+ shadow) D2H", t["visit_d2h"]))]
    if many:
        rows += [f"  {k:<48}{v * 1e3:10.1f}" for k, v in (
            ("all_gather of the weights (comm lane)", t["all_gather"]),
            ("reduce_scatter of the fp32 gradient", t["reduce_scatter"]))]
    peak = f"{(str(p['world']) + ' x ') if many else ''}{hw[p['dtype'] + '_tflops']:g}"
    rows += ["", f"predicted: {p['step_time_s']:.3g} s/step, {p['tokens_per_s']:,.0f} tokens/s, "
                 f"{p['model_tflops']:.3g} model TFLOP/s = {p['mfu']:.0%} of the {peak} peak "
                 f"(6 N T per step: no recompute, no attention)",
             f"bottleneck: {p['bottleneck']} (share of the critical "
             "path: " + pct(p["critical_path"]) +
             "; busy: " + pct(p["utilization"]) + ")",
             f"transfers and AdamW hide behind compute from ~{p['min_tokens_per_step']:,.0f} "
             "tokens/step (" + ", ".join(f"{k} {v:,.0f}" for k, v in p["min_tokens"].items()) + ")",
             f"verdict on {hw['name']}: host RAM {verdict(p['fits_host'])}, GPU memory " +
             (verdict(p["fits_gpu"]) if cuda else "n/a (CPU)") +
             f" -> {'FITS' if p['fits'] else 'does not fit'}"]
    if not p["fits"]:
        fix = suggest(p)
        rows.append(f"nearest setting that fits: {fix}" if fix else
                    "nothing nearby fits: see the breakdown above")
    return "\n".join(rows + alternatives(p))


def alternatives(p):
    """What two settings would change, each planned (replan), for a plan that fits on a GPU: the
    step time clipping costs (every update waits for the global norm), and the other --mode when it
    is faster by --mode auto's margin (plan.LEAN_FASTER; lean: the host's AdamW moves 6 B/param
    less, the link carries fp32)."""
    if not p["fits"] or p["hardware"]["gpu_mem_gb"] <= 0:
        return []
    lines, s = [], p["step_time_s"]
    if p["grad_clip"]:
        q = replan(p, grad_clip=0.0)
        if q["fits"] and q["step_time_s"] < 0.98 * s:
            lines.append(f"clipping costs {s - q['step_time_s']:.3g} s/step here: every update "
                         "waits for the global norm (--grad-clip 0: "
                         f"{q['step_time_s']:.3g} s/step)")
    if p["dtype"] == "bf16":
        other = "lean" if p["mode"] == "fast" else "fast"
        q = replan(p, mode=other)
        if q["fits"] and q["step_time_s"] <= LEAN_FASTER * s:
            why = ("the host's AdamW moves 6 B/param less; the link carries the fp32 master"
                   if other == "lean" else "half the bytes cross the link")
            lines.append(f"faster here: --mode {other}, {q['step_time_s']:.3g} s/step "
                         f"({s / q['step_time_s'] - 1:.0%} faster: {why})")
    return lines


def resident_line(p):
    """What the plan keeps on the GPU and updates there, and why (--resident-units,
    --gpu-updated-units): what was asked beside what is used when they differ."""
    k, g = p["resident_units"], p["gpu_updated_units"]
    n = len(model.units(model.GPTConfig(**p["model"])))
    where = "on the GPU" if p["hardware"]["gpu_mem_gb"] > 0 else "on the device"   # a CPU run's
    if p["resident_asked"] is not None:
        why = "as asked (--resident-units)" if p["resident_asked"] == k else \
            f"--resident-units {p['resident_asked']} asked: all there are"
    elif p["hardware"]["gpu_mem_gb"] > 0 and p["world"] == 1:
        why = "as many as fit beside the step" + (" and the GPU updates" if g else "")
    else:
        why = "none: " + ("each rank holds 1/N of every unit" if p["world"] > 1 else "a CPU run")
    line = (f"resident {where}: {k} of {n} units ({why}; the embedding and layer 0 first): "
            "updated there" if k else f"resident {where}: none ({why}): every unit streams")
    asked = p["gpu_updated_asked"]
    if not g:
        unused = f"; --gpu-updated-units {asked} asked, but no unit streams" if asked else ""
        return line + (f", the host updates the other {n - k}" if k else "") + unused
    why = "the plan's pick: a faster step" if asked is None else "as asked" if asked == g else \
        f"--gpu-updated-units {asked} asked: every streamed unit but the embedding"
    return (f"{line}; of the {n - k} streamed, {g} updated {where} ({why}; their master, m, v "
            f"cross for it, the gradient stays), the host updates {n - k - g}")


def describe_run(p, world=1, gpus=1):
    """The one line train.py prints of the plan of the run it is about to make (world ranks, gpus
    per node)."""
    many = world > 1
    where = "on the GPU" if p["hardware"]["gpu_mem_gb"] > 0 else \
        "on the device (a CPU run: host memory)"
    return (f"plan{f' for {world} ranks ({gpus} per node)' if many else ''}: --mode {p['mode']}, "
            f"host {p['host_bytes'] / GB:.2f} GB{' per node' if many else ''} "
            f"({p['host_bytes_per_param']:.1f} B/param in the store, {p['pinned_bytes'] / GB:.2f} "
            f"GB page-locked), device {p['gpu_bytes'] / GB:.2f} GB{' per GPU' if many else ''}, "
            "boundary activations "
            f"{'offloaded' if p['offload_activations'] else 'on the device'}, layer {tiling(p)}, "
            f"{p['resident_units']} units resident {where}, {p['gpu_updated_units']} "
            f"updated there; predicted {p['tokens_per_s']:,.0f} "
            f"tokens/s, bound by {p['bottleneck']} (--plan for the breakdown)")


def show(p, as_json, max_context, max_seq_len):
    """What train.py --plan, --json and --max-context print: plan p (with --max-context, the plan
    at the longest --seq-len that fits), as text or as JSON."""
    longest, p = longest_context(p) if max_context else (None, p)
    print(plan_json(p) if as_json else format_plan(p))
    if max_context and not as_json:
        print(describe_max_context(p, longest, max_seq_len))


def describe_max_context(p, longest, max_seq_len):
    """The line of train.py --plan --max-context: the longest --seq-len (plan p is the plan at
    it)."""
    return (f"longest context that fits: --seq-len {longest} ({longest:,} tokens) at --batch-size "
            f"{p['batch_size']} on {p['hardware']['name']}, layer {tiling(p)}; GPU "
            f"{p['gpu_bytes'] / GB:.1f} of {p['gpu_limit_bytes'] / GB:.0f} GB, host "
            f"{p['host_bytes'] / GB:.0f} of {p['host_limit_bytes'] / GB:.0f} GB usable" +
            (f"; training at it needs --max-seq-len {longest}" if longest > max_seq_len else ""))


def profile_line(p, name):
    """One line of --hardware all: the verdict and the prediction on profile `name`."""
    return (f"{name:>8}: {'fits' if p['fits'] else 'no  '}  host {size(p['host_bytes'])} of "
            f"{size(p['host_limit_bytes'])}, GPU {size(p['gpu_bytes'])} of "
            f"{size(p['gpu_limit_bytes'])}, {p['tokens_per_s']:,.0f} tokens/s, "
            f"{p['model_tflops']:.0f} TFLOP/s, {p['bottleneck']}-bound")
