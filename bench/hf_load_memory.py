"""bench/hf_load_memory.py -- host memory that megatrain_min.hf.load.load_hf needs beyond the host store.

Writes a freshly initialised Llama-3.2-1B-shaped bf16 checkpoint with save_hf, loads it into a host store, and
prints the peak RSS above the store. Results and their dates: bench/NOTES.md.

    python bench/hf_load_memory.py [--store master|direct|trainer] [--n-layer N] [--tmp DIR]
"""
import argparse
import dataclasses
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megatrain_min.hf import save_hf  # noqa: E402
from megatrain_min.hf.load import load_hf  # noqa: E402
from megatrain_min.engine.checks import CheckedTrainer  # noqa: E402
from megatrain_min.engine.lazy_init import LazyInit  # noqa: E402
from model import NORM, PRESETS, units  # noqa: E402


def _rss():
    """(resident, peak resident since the last reset) bytes of this process (Linux: VmRSS, VmHWM)."""
    s = Path("/proc/self/status").read_text()
    return [int(re.search(rf"{k}:\s+(\d+) kB", s)[1]) << 10 for k in ("VmRSS", "VmHWM")]


class _Watch:
    """weights[key] passed through. The RSS at the first access is the store (allocated and zeroed before
    the copy loop); the peak RSS is noted at every access, so the loop's peaks are all seen (its last key is
    a tiny norm) and what Trainer allocates after the loop (its CPU-side compute slots) is not."""

    def __init__(self, weights):
        self.w, self.base, self.peak = weights, None, 0

    def __getitem__(self, key):
        rss, peak = _rss()
        self.base, self.peak = self.base or rss, max(self.peak, peak)
        return self.w[key]


def measure(n_layer, store, tmp):
    """Write a freshly initialised Llama-3.2-1B-shaped bf16 checkpoint with save_hf, load it into a host store, print the
    peak RSS above the store. store: "trainer" (a CPU stream.Trainer), "master" (fp32 master buffers alone,
    filled by Trainer.__init__'s `view.copy_(weights[key])` loop), "direct" (the same buffers filled by
    HFWeights.read_into, no temporary). RSS also counts the safetensors pages mapped while a tensor is
    read: clean page cache (the kernel can drop it), not allocated memory."""
    cfg = dataclasses.replace(PRESETS["1b"], n_layer=n_layer or PRESETS["1b"].n_layer)
    d, gb, t0 = Path(tmp) / "ckpt", 2 ** 30, time.time()
    save_hf(cfg, LazyInit(cfg), d, dtype=torch.bfloat16)           # init_weights, one unit at a time
    print(f"wrote {sum(u.numel for u in units(cfg)) / 1e9:.2f}B params to {d}: "
          f"{sum(f.stat().st_size for f in d.glob('*.safetensors')) / gb:.2f} GiB bf16 in {time.time() - t0:.0f}s")
    Path("/proc/self/clear_refs").write_text("5")                   # reset VmHWM to the current RSS
    rss0, t0 = _rss()[0], time.time()
    cfg, weights = load_hf(d)
    watch = _Watch(weights)
    if store == "trainer":
        CheckedTrainer(cfg, watch, device="cpu")
    else:
        bufs = [torch.zeros(u.numel) for u in units(cfg)]
        watch.base = _rss()[0]
        for u, lay in enumerate(units(cfg)):
            for key, view in lay.key_views(bufs[u]).items():
                weights.read_into(key, view) if store == "direct" else view.copy_(watch[key])
        watch[NORM]                                                 # one more look at the peak
    largest = 4 * max(math.prod(shape) for _, shape in weights.where.values())
    print(f"{store}: store {(watch.base - rss0) / gb:.2f} GiB filled in {time.time() - t0:.0f}s, peak RSS above "
          f"it {(watch.peak - watch.base) / gb:.2f} GiB; largest tensor in fp32 {largest / gb:.2f} GiB")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Measure the host memory that load_hf needs beyond the store "
                                            "(writes a ~2.3 GiB checkpoint to --tmp).")
    p.add_argument("--store", default="master", choices=["master", "direct", "trainer"], help="see measure()")
    p.add_argument("--n-layer", type=int, default=0, help="layers of the 1b shape (default 16: 1.24B params)")
    p.add_argument("--tmp", default=None, help="directory for the checkpoint (default: the system temp dir)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        measure(a.n_layer, a.store, tmp)
