"""python -m megatrain_min.plan -- the plan of a run for the flags train.py takes; nothing is
allocated.

The table (report.format_plan) and the verdict (fit.check), one JSON object (--json), or one line
per profile (--hardware all). Exit 0 with a verdict, fitting or not; 2 for flags no run can have.
"""
import argparse
import dataclasses
import sys

import model
from megatrain_min import cli
from megatrain_min.plan import PlanError, from_flags
from megatrain_min.plan.fit import check
from megatrain_min.plan.hardware import HARDWARE
from megatrain_min.plan.report import format_plan, plan_json, profile_line


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m megatrain_min.plan",
                                 description="Memory and throughput plan; nothing is allocated.")
    cli.add_model(ap)
    cli.add_step(ap)
    cli.add_hardware(ap)
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object instead of the table")
    a = ap.parse_args(argv)
    cli.survive_closed_pipe()
    cli.warn_in_one_line()
    try:
        cli.check(a)
        if a.config not in model.PRESETS:
            raise ValueError(f"unknown preset --config {a.config!r}; choose one of: "
                             f"{', '.join(model.PRESETS)}")
        cfg = cli.config_of(a)
        cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, a.seq_len))   # any length
        for hw_name in (list(HARDWARE) if a.hardware == "all" else [a.hardware]):
            p = from_flags(a, cfg, hw_name, name=a.config)
            if a.json:
                print(plan_json(p))
            elif a.hardware == "all":
                print(profile_line(p, hw_name))
            else:
                print(format_plan(p))
                try:
                    check(p)
                except PlanError as e:   # the plan says why; a verdict, not a usage error
                    print(f"error: {e}")
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
