"""CPU AdamW speed: optim.HostAdamW (flat buffers, two fused kernel calls per unit) against
torch.optim.AdamW(fused=True) over the same parameters as separate tensors (two param groups),
measured side by side in one run. The target: HostAdamW >= 0.9x torch's speed.

    python bench/adamw_cpu.py                 # toy-to-small sizes, a few seconds
    python bench/adamw_cpu.py --params 2e8    # bigger (needs ~16 B/param of RAM for each optimizer)

Reports ms per step, parameters per second and DRAM GB/s at ~32 B/param of traffic
(read p, g, m, v = 16 B; write p, m, v = 12 B; + the bf16 shadow when asked: 6 B).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import model  # noqa: E402
from optim import HostAdamW  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--params", type=float, default=5e7, help="approximate parameter count (made of small-preset-like layers)")
ap.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
args = ap.parse_args()

# layers of the GPT-2-small shape, as many as make up --params
cfg = model.PRESETS["small"]
layer = model.units(cfg)[0]
n_layers = max(1, int(args.params // layer.numel))
shapes = [e.shape for e in layer.entries]
N = n_layers * layer.numel
print(f"{n_layers} layers x {len(shapes)} tensors = {N:,} params; torch {torch.__version__}, {torch.get_num_threads()} threads")

params = [torch.randn(s) * 0.02 for _ in range(n_layers) for s in shapes]
for p in params:
    p.requires_grad_(True)
    p.grad = torch.randn_like(p) * 1e-3
ref = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-4, fused=True)
ours = HostAdamW([(layer.numel, layer.n_decay)] * n_layers, lr=1e-4)
for u in range(n_layers):
    ours.grad[u].normal_(0, 1e-3)


def timeit(fn):
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        fn()
    return (time.perf_counter() - t0) / args.steps


results = {}
for round_ in range(2):  # interleave, so both see the same machine state
    results.setdefault("torch.optim.AdamW(fused=True)", []).append(timeit(ref.step))
    results.setdefault("HostAdamW (flat, per unit)", []).append(
        timeit(lambda: [ours.step(u) for u in range(n_layers)]))
best = {k: min(v) for k, v in results.items()}
for k, t in best.items():
    print(f"{k:<32} {t * 1e3:8.1f} ms/step  {N / t / 1e9:6.2f} Gparam/s  ~{32 * N / t / 1e9:6.1f} GB/s DRAM")
ratio = best["torch.optim.AdamW(fused=True)"] / best["HostAdamW (flat, per unit)"]
print(f"speed ratio HostAdamW / torch fused AdamW = {ratio:.2f}x (target >= 0.9x)")
