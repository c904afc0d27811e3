"""sim/ -- proving the GPU schedule on the CPU: record.py (the engine on checked lanes, every op and
ordering point recorded), fake.py (the engine at full size on fake tensors), race.py (the race
checker), twin.py (the timeline twin) and this file, their command line (`python -m
megatrain_min.sim check|timeline`; __main__.py). Not here: what an op costs (plan/cost.py), the
planner's analytic model (plan/).

What it is
    The command line of megatrain_min/sim/record.py (the engine on checked lanes) and its two
    consumers:
      check      the real engine for a few steps on checked lanes: every conflicting pair of
                 accesses from two lanes or threads without a happens-before edge is a race
                 (race.Checker), reported with the buffer's name, both ops and both source lines;
                 per step, the host syncs and the bytes and weight copies each lane moves. Exit 1
                 when there is a race.
      timeline   the engine at full size under FakeTensorMode, replayed on a hardware profile
                 (twin.Twin): step time, tokens/s, overlap, busy and critical-path shares per lane,
                 peak device memory -- predictions, beside the planner's.
    It takes train.py's model and step flags with the same defaults (megatrain_min/cli.py); check
    runs a 4 x 16 batch unless told otherwise. Bad input is one line and exit 2 before anything
    runs: sim's own flags (check_flags), and for check the memory the real engine would take on
    this CPU (check_memory, as train.py checks a run's: a 7B check is refused, not attempted).
Try it
    python -m megatrain_min.sim check --config toy --micro-batches 2
    python -m megatrain_min.sim timeline --config 7b --hardware h100 --batch-size 4 --seq-len 4096
    python -m pytest tests/sim/test_sim.py tests/sim/test_twin.py
"""
import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch

import model
from megatrain_min import cli, engine, plan
from megatrain_min.sim import race, record, twin
from megatrain_min.engine.checks import check_config
from megatrain_min.cli import DTYPES, FlagError
from megatrain_min.plan.hardware import host_available_bytes
from megatrain_min.plan.memory import size

GB = 1e9
STEPS = {"check": 2, "timeline": 3}    # the default --steps of each command
LEAST_STEPS = {"check": 1, "timeline": 2}   # timeline: its steady state spans the last two steps


def check_flags(a):
    """FlagError naming the first of sim's own flags that no run can use: --steps below what the
    command needs, a --host-speed that is not a finite number > 0, a --trace whose directory is
    not there (before the replay, not after it)."""
    least = LEAST_STEPS[a.command]
    if a.steps is not None and a.steps < least:
        why = " (its steady state is the last of them, measured from the one before)" \
            if a.command == "timeline" else ""
        raise FlagError(f"--steps {a.steps}: {a.command} runs at least {least} step(s){why}; "
                        f"pass --steps {max(least, STEPS[a.command])}, or leave it out")
    if a.command != "timeline":
        return
    if not (math.isfinite(a.host_speed) and a.host_speed > 0):
        raise FlagError(f"--host-speed must be a finite number > 0 (how many times faster this "
                        f"host issues ops than the measured CPU; 1 = as fast), got {a.host_speed}")
    if a.trace is None:
        return
    trace = Path(a.trace)
    if a.trace == "" or trace.is_dir():
        raise FlagError(f"--trace {a.trace!r} is not a file name; name the file to write, e.g. "
                        "--trace timeline.json")
    if not trace.parent.is_dir():
        raise FlagError(f"--trace {a.trace}: {trace.parent} is not a directory; make it first, or "
                        "name a file in one that exists")
    if not os.access(trace.parent, os.W_OK | os.X_OK):
        raise FlagError(f"--trace {a.trace}: {trace.parent} is not writable by this user")


def check_memory(a, cfg):
    """The plan of `check` on this CPU: the engine's host store and buffers (plan.plan for
    --hardware local, in the dtype it runs), and the initial weights record.run makes beside them,
    against the memory this machine has (--host-mem may lower it): FlagError when they do not fit,
    before anything is allocated."""
    have = host_available_bytes()
    mem = have / GB if a.host_mem is None else min(a.host_mem, have / GB)
    with warnings.catch_warnings():    # a count capped: the plan of the run's hardware says it
        warnings.simplefilter("ignore")
        p = plan.from_flags(a, cfg, "local", guarded=bool(a.skip_nonfinite),
                            device=torch.device("cpu"), dtype=a.dtype or "fp32", host_mem_gb=mem,
                            resident_units=a.resident_units or 0,
                            gpu_updated_units=a.gpu_updated_units or 0)
    weights = 4 * p["params"]                        # model.init_weights: fp32, kept by record.run
    need = p["host_bytes"] + weights
    if need > p["host_limit_bytes"]:
        given = f", --host-mem {a.host_mem:g} (GB) gives it {size(mem * GB)}" \
            if a.host_mem is not None else ""
        raise FlagError(f"check builds the real engine on this CPU: --config {a.config} needs "
                        f"~{size(need)} of host RAM (the engine's store and buffers "
                        f"{size(p['host_bytes'])}, its initial weights {size(weights)}); this "
                        f"machine has {size(have)} available{given}. Try a smaller --config "
                        "(toy, small) or fewer layers (--n-layer 2: the schedule is the same at "
                        "any depth); timeline allocates nothing")
    return p


def check_main(a, cfg, p, held):
    """The engine on checked lanes for the plan's settings, in fp32 unless --dtype says otherwise
    (bf16 matmuls are slow on a CPU), streaming every unit and updating it on the host unless
    --resident-units or --gpu-updated-units asks (held: check_memory's plan, whose counts are
    those asked, capped at the units there are)."""
    checker = race.Checker()
    homes = engine.parts(resident_units=held["resident_units"],
                         gpu_updated_units=held["gpu_updated_units"])["homes"]
    kw = dict(engine.arguments(p), dtype=DTYPES[a.dtype or "fp32"], homes=homes)
    record.run(cfg, [checker], a.steps or STEPS["check"], batch=(a.batch_size, a.seq_len), **kw)
    print(checker.summary())
    return 1 if checker.races else 0


def write_trace(tw, path):
    """The twin's Perfetto trace at path, whole or not at all: written aside, then renamed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tw.trace(tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise FlagError(f"--trace {path}: could not write it ({e.strerror}); nothing was "
                        "written") from None


def timeline_main(a, cfg, p):
    hw, tw = p["hardware"], twin.Twin(p["hardware"], host_speed=a.host_speed)
    record.run(cfg, [tw], a.steps or STEPS["timeline"], fake=True, sources=False, costs=True,
               batch=(a.batch_size, a.seq_len),
               **engine.arguments(p))
    r = tw.result_of(cfg, a.batch_size * a.seq_len)
    r.update(config=a.config, hardware=a.hardware, plan_step_time_s=p["step_time_s"],
             plan_bottleneck=p["bottleneck"],
             host_speed=a.host_speed, host_issue_s=tw.issue, resident_units=p["resident_units"],
             gpu_updated_units=p["gpu_updated_units"])
    if a.trace:
        write_trace(tw, a.trace)
    if a.json:
        print(json.dumps(r))
        return 0
    pct = lambda d: ", ".join(f"{k} {v:.0%}" for k, v in d.items() if v)  # noqa: E731
    print(f"PREDICTION for {a.config} on {hw['name']} ({hw['gpu']}), {a.batch_size} x {a.seq_len} "
          f"tokens, {a.micro_batches} micro-batch(es), --mode {p['mode']}, grad clip "
          f"{a.grad_clip or 'off'}, {p['resident_units']} of {len(model.units(cfg))} units "
          f"resident on the GPU, {p['gpu_updated_units']} updated there")
    print(f"  step {r['step_time_s']:.3g} s (planner: {p['step_time_s']:.3g} s), "
          f"{r['tokens_per_s']:,.0f} tokens/s, {r['model_tflops']:.3g} model TFLOP/s, overlap "
          f"{r['overlap']:.0%}")
    print(f"  busy: {pct(r['busy'])}  (host: issuing ops at {tw.issue * 1e6:.1f} us each, "
          f"--host-speed {a.host_speed:g} x the CPU hardware.HOST_OP_S was measured on)")
    print(f"  critical path: {pct(r['critical_path'])} -> bottleneck {r['bottleneck']} (planner: "
          f"{p['bottleneck']})")
    print(f"  peak device memory {r['peak_gpu_bytes'] / GB:.1f} GB (planner: "
          f"{p['gpu_bytes'] / GB:.1f} GB)")
    if a.trace:
        print(f"  trace: {a.trace} (open in https://ui.perfetto.dev)")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m megatrain_min.sim",
                                 description="Prove the GPU schedule on the CPU: check races, or "
                                             "predict the timeline.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, what in (
        ("check", "run the engine on checked lanes: races, host syncs, bytes and copies per step"),
                       ("timeline",
                        "the engine at full size, replayed on a hardware profile (predictions)")):
        c = sub.add_parser(name, help=what)
        cli.add_model(c)
        cli.add_step(c)
        cli.add_hardware(c, default="h100")
        c.add_argument("--skip-nonfinite", type=int, default=1, choices=[0, 1],
                       help="the non-finite guard (train.py: on) (default: %(default)s)")
        c.add_argument("--steps", type=int, default=None,
                       help=f"engine steps to run, at least {LEAST_STEPS[name]} (default: "
                            f"{STEPS[name]})")
        if name == "check":
            c.set_defaults(batch_size=record.BATCH[0], seq_len=record.BATCH[1])
        else:
            c.add_argument("--json", action="store_true", help="print one JSON object")
            c.add_argument("--trace", default=None,
                           help="write a Chrome/Perfetto trace of the simulated steps")
            c.add_argument("--host-speed", type=float, default=1.0,
                           help="the host issues work this many times faster than the CPU the "
                                "issue costs were measured on (default: %(default)s)")
    a = ap.parse_args(argv)
    cli.survive_closed_pipe()
    cli.warn_in_one_line()
    if a.config not in model.PRESETS:
        ap.exit(2, f"error: unknown preset --config {a.config!r}; choose one of: "
                   f"{', '.join(model.PRESETS)}\n")
    try:
        cli.check(a)
        check_flags(a)
        cfg = check_config(cli.config_of(a))
        held = check_memory(a, cfg) if a.command == "check" else None   # before anything else
        p = plan.from_flags(a, cfg, dtype=a.dtype or "bf16", guarded=bool(a.skip_nonfinite),
                               host_speed=getattr(a, "host_speed", 1.0))
        if a.command == "check":
            return check_main(a, cfg, p, held)
        return timeline_main(a, cfg, p)
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")
