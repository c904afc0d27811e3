"""bench/host_overhead.py -- the host's time per layer visit: what the main thread spends issuing the work.

A deep model with negligible tensors (d=16, T=8: compute ~ 0) run by stream.Trainer on the CPU, so a step's wall
time is the engine's issue cost: Python, the dispatcher, autograd's engine, the view building. Measured side by
side in one run, rounds interleaved, one OpenMP thread (tiny tensors; no spin-waiting teams):
  before   stream.py as of the issue's reference commit (427dd33), loaded from git history;
  after    stream.py now.
Reported: host microseconds per layer visit (2 visits per layer per step) at M = 1 and 4, and the ratio.
Also --calibrate: the per-op issue cost that the twin and the planner use (plan.hardware.HOST_OP_S), from the same run, on
the CPU backend or (--device cuda) with CUDA eager ops, which add cudaLaunchKernel and autograd's device thread;
--json FILE writes the fit (bench/gpu_run.sh does this on a GPU).

    python bench/host_overhead.py              # ~1 min
    python bench/host_overhead.py --calibrate  # + the issue cost per aten op of the engine's op stream
    python bench/host_overhead.py --calibrate --device cuda --json host_op.json
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
import stream  # noqa: E402
from megatrain_min.engine.pinned import page_locked  # noqa: E402

BEFORE = "427dd33"
CFG = model.GPTConfig(vocab_size=256, n_layer=64, n_head=2, n_kv_head=2, d_model=16, d_ff=32, max_seq_len=64)


def engine_at(commit):
    src = subprocess.run(["git", "show", f"{commit}:stream.py"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    mod = types.ModuleType(f"stream_{commit}")
    exec(compile(src, f"stream.py@{commit}", "exec"), mod.__dict__)
    return mod


def per_visit_us(trainer_cls, M, steps, cfg=CFG, device="cpu"):
    # on CUDA the host buffers train.py's engine has (exact-size page-locked: engine/pinned.py)
    lanes = dict(lanes=stream.Lanes(device, pinned=page_locked)) if device == "cuda" else {}
    t = trainer_cls(cfg, model.init_weights(cfg, 0), device=device, micro_batches=M, grad_clip=0.0, **lanes)
    tok = torch.randint(0, cfg.vocab_size, (M, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        t.step(tok, tok.roll(-1, 1))
    t.weights(copy=False)
    t0 = time.perf_counter()
    for _ in range(steps):
        t.step(tok, tok.roll(-1, 1))
    t.weights(copy=False)
    return (time.perf_counter() - t0) / steps / (2 * cfg.n_layer) * 1e6


class OpCount:
    """A consumer of megatrain_min.sim's recorder: the ops the main thread issues, from Python or by autograd."""

    def __init__(self):
        self.py = self.autograd = 0

    def op(self, op):
        if op.actor != "worker":
            self.py += not op.autograd
            self.autograd += op.autograd

    def __getattr__(self, name):          # every other event: nothing to count
        return lambda *a, **kw: None


def calibrate(rounds, steps, device="cpu"):
    """Host seconds per step = c_py x (ops issued from Python) + c_autograd x (ops autograd's engine runs) + c0,
    least squares over deep tiny models (compute ~ 0) at several depths and micro-batch counts; and the one cost
    per op (c_op, with c0) that plan.hardware.HOST_OP_S holds. The ops are counted on the CPU by megatrain_min.sim.record's
    recorder (the same op stream runs on `device`); the time per step is taken on `device`."""
    import dataclasses
    import numpy as np
    from megatrain_min.sim import record
    rows, times = [], []
    for L, M in ((16, 1), (32, 2), (64, 1), (64, 4), (32, 8)):
        cfg = dataclasses.replace(CFG, n_layer=L)
        counts = OpCount()
        record.run(cfg, [counts], 2, batch=(M, 8), micro_batches=M, grad_clip=0.0)
        n_py, n_ag = counts.py / 2, counts.autograd / 2                      # per step
        t = min(per_visit_us(stream.Trainer, M, steps, cfg, device) for _ in range(rounds)) * 2 * L / 1e6
        rows.append((n_py, n_ag, 1.0))
        times.append(t)
        print(f"  L={L:>2} M={M}: {t * 1e3:7.1f} ms/step, {n_py:6.0f} Python-issued + {n_ag:6.0f} autograd ops")
    (c_py, c_ag, c0), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    fit = np.array(rows) @ np.array([c_py, c_ag, c0])
    print(f"c_py = {c_py * 1e6:.2f} us, c_autograd = {c_ag * 1e6:.2f} us per op, c0 = {c0 * 1e3:.2f} ms per step; "
          f"worst fit error {max(abs(fit - times) / times):.1%}")
    one = np.array([(n_py + n_ag, 1.0) for n_py, n_ag, _ in rows])
    (c_op, c1), *_ = np.linalg.lstsq(one, np.array(times), rcond=None)
    print(f"one cost per op (plan.hardware.HOST_OP_S): {c_op * 1e6:.2f} us, c0 = {c1 * 1e3:.2f} ms per step")
    return dict(device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu", torch=torch.__version__,
                host_op_s=float(c_op), c0_s=float(c1), c_py_s=float(c_py), c_autograd_s=float(c_ag),
                worst_fit_error=float(max(abs(fit - times) / times)),
                rows=[dict(ops_python=r[0], ops_autograd=r[1], step_s=t) for r, t in zip(rows, times)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--calibrate", action="store_true", help="fit the per-op issue cost plan.hardware.HOST_OP_S holds")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where --calibrate times the steps")
    ap.add_argument("--json", default=None, help="with --calibrate: write the fit to this file")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.calibrate:
        fit = calibrate(a.rounds, a.steps, a.device)
        if a.json:
            Path(a.json).write_text(json.dumps(fit, indent=1) + "\n")
        return
    engines = {"before": engine_at(BEFORE).Trainer, "after": stream.Trainer}
    print(f"{CFG.n_layer} layers, d={CFG.d_model}, T=8, one thread; host us per layer visit, best of {a.rounds} "
          f"interleaved rounds")
    for M in (1, 4):
        got = {k: [] for k in engines}
        for _ in range(a.rounds):
            for name, cls in engines.items():
                got[name].append(per_visit_us(cls, M, a.steps))
        best = {k: min(v) for k, v in got.items()}
        print(f"  M={M}: before {best['before']:7.0f} us, after {best['after']:7.0f} us, "
              f"{best['before'] / best['after']:.2f}x less host time (medians {statistics.median(got['before']):.0f} "
              f"/ {statistics.median(got['after']):.0f})")


if __name__ == "__main__":
    main()
