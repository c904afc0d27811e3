"""bench/cpu_threads.py -- how the CPUs are split between the main thread and the optimizer thread on a CPU run.

On the CPU the main thread computes the whole step (forward, head, backward) while the optimizer thread runs the update
rule on the units whose gradients landed. optim.thread_split decides each thread's OpenMP team. Candidates, for a share
of P CPUs (main, optimizer):
  quarter   (P - P//4, P//4)   the teams add up to P: no oversubscription (the rule until 2026-11-28)
  all+4th   (P, P//4)          the main thread keeps every CPU; the optimizer's team runs beside it
  all+1     (P, 1)             the same with a one-thread optimizer
  all+all   (P, P)             both teams on every CPU
Two cases, each in a fresh process per candidate, rounds interleaved, the median of the timed steps:
  toy    train.py's default run: the toy preset, 32 x 128 tokens, clip 1.0: the update rule's work is tiny
  wide   4 layers of d_model 1024, 2 x 64 tokens, clip 0: the update rule's work is near the step's compute
Printed: seconds per step and each candidate's time over the current rule's (optim.thread_split), side by side.

    python bench/cpu_threads.py            # ~2 min on 2 cores
    python bench/cpu_threads.py --rounds 5
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CANDIDATES = {
    "quarter": "lambda P, cuda: (max(1, P - max(1, P // 4)), max(1, P // 4))",
    "all+4th": "lambda P, cuda: (P, max(1, P // 4))",
    "all+1": "lambda P, cuda: (P, 1)",
    "all+all": "lambda P, cuda: (P, P)",
    "current": None,                      # optim.thread_split as it is
}
CASES = {
    "toy": dict(cfg="toy", B=32, T=128, clip=1.0, steps=12),
    "wide": dict(cfg=dict(vocab_size=256, n_layer=4, n_head=8, n_kv_head=8, d_model=1024, d_ff=2816,
                          max_seq_len=64), B=2, T=64, clip=0.0, steps=8),
}

CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, model, optim, stream
rule, case = sys.argv[2], json.loads(sys.argv[3])
if rule != "None":
    optim.thread_split = eval(rule)
cfg = model.PRESETS[case["cfg"]] if isinstance(case["cfg"], str) else model.GPTConfig(**case["cfg"])
t = stream.Trainer(cfg, model.init_weights(cfg, 0), device="cpu", lr=1e-3, grad_clip=case["clip"])
g = torch.Generator().manual_seed(0)
batches = [torch.randint(0, cfg.vocab_size, (case["B"], case["T"] + 1), generator=g) for _ in range(3)]
times = []
for k in range(case["steps"] + 2):
    b = batches[k % 3]
    t0 = time.perf_counter()
    t.step(b[:, :-1], b[:, 1:])
    t.wait()
    times.append(time.perf_counter() - t0)
print(json.dumps({"threads": t.lanes.threads, "step_s": sorted(times[2:])[len(times[2:]) // 2]}))
"""


def run(rule, case):
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(rule), json.dumps(case)], capture_output=True,
                       text=True, timeout=600)
    if r.returncode:
        sys.exit(f"cpu_threads: a run failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per candidate (default 3)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    if a.rounds < 1:
        sys.exit("cpu_threads: --rounds must be >= 1")
    print(f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} usable CPUs")
    out = {}
    for name, case in CASES.items():
        got = {c: [] for c in CANDIDATES}
        threads = {}
        for _ in range(a.rounds):
            for c, rule in CANDIDATES.items():
                r = run(rule, case)
                got[c].append(r["step_s"])
                threads[c] = r["threads"]
        med = {c: statistics.median(v) for c, v in got.items()}
        out[name] = {c: dict(threads=threads[c], step_s=med[c], vs_current=med[c] / med["current"]) for c in med}
        print(f"\n{name}: {case}")
        for c in CANDIDATES:
            print(f"  {c:<8} threads (main, optimizer) {str(tuple(threads[c])):<8}  {med[c]:.3f} s/step  "
                  f"x{med[c] / med['current']:.2f} of current")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
