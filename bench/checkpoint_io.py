"""bench/checkpoint_io.py -- checkpoint save/load GB/s of a ~1B-parameter store against the raw disk.

Saves and loads (megatrain_min/checkpoints/checkpoint.py) a host store shaped like Llama-3.2-1B with n of its 16 layers,
beside plain writes/reads of the same tensors to the same disk (a file per unit, each fsynced). Reads are cold:
the files are dropped from the page cache first. Results and their dates: bench/NOTES.md.

    python bench/checkpoint_io.py [--layers 12] [--rounds 2] [--dir /fast/disk]
"""
import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import model  # noqa: E402
from megatrain_min.checkpoints import checkpoint, ckpt_read  # noqa: E402
from optim import HostStore  # noqa: E402

GB = 1e9


def bench(n_layer, where, rounds):
    """Save/load GB/s of a store shaped like Llama-3.2-1B with n_layer of its 16 layers, beside plain
    writes/reads of the same tensors to the same disk (a file per unit, each fsynced). Reads are cold:
    the files are dropped from the page cache first (posix_fadvise DONTNEED)."""
    cfg = dataclasses.replace(model.PRESETS["1b"], n_layer=n_layer)
    units, nbytes = model.units(cfg), 12 * model.n_params(cfg)
    opt = HostStore([(lay.numel, lay.n_decay) for lay in units], grad_store=False)
    for u in range(len(units)):
        for t in opt.tensors(u).values():
            t.fill_(u + 0.5)
    trainer = SimpleNamespace(cfg=cfg, units=units, opt=opt, wait=lambda: None)
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=where))
    print(f"1b preset with {n_layer} layers: {model.n_params(cfg) / 1e9:.2f}B params, {nbytes / 1e9:.1f} GB "
          f"of fp32 master + m + v; writing to {root}")

    def timed(what, fn):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        print(f"  {what:34s} {nbytes / dt / 1e9:5.2f} GB/s  {dt:5.1f} s", flush=True)

    def raw(mode):  # plain writes (+ fsync) or reads of the same bytes, one file per unit
        for u in range(len(units)):
            with open(root / f"raw-{u}.bin", mode) as f:
                for s in opt.tensors(u):
                    (f.write if mode == "wb" else f.readinto)(ckpt_read.bytes_of(opt.tensors(u)[s]))
                if mode == "wb":
                    f.flush()
                    os.fsync(f.fileno())

    def drop_cache():
        for p in root.rglob("*.bin"):
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    try:
        timed("crc32 in memory", lambda: [zlib.crc32(ckpt_read.bytes_of(opt.tensors(u)[s])) for u in range(len(units)) for s in opt.tensors(u)])
        for r in range(rounds):
            print(f"round {r + 1}")
            timed("raw write + fsync", lambda: raw("wb"))
            timed("save (crc32, fsync, rename)", lambda: checkpoint.save(trainer, root, r, keep=1))
            drop_cache()
            timed("raw read, cold", lambda: raw("rb"))
            drop_cache()
            timed("load, cold (verify, then read)", lambda: checkpoint.load(trainer, ckpt_read.latest(root)))
            drop_cache()
            timed("load, cold, verify_first=False", lambda: checkpoint.load(trainer, ckpt_read.latest(root), verify_first=False))
        assert all(bool((opt.tensors(u)[s] == u + 0.5).all()) for u in range(len(units)) for s in opt.tensors(u))
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Benchmark checkpoint save/load against the raw disk (writes ~24 GB).")
    p.add_argument("--layers", type=int, default=12, help="layers of the 1b preset (12: 0.99B params, 11.9 GB of RAM)")
    p.add_argument("--rounds", type=int, default=2, help="repeat the measurements (shared disks vary)")
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    args = p.parse_args()
    bench(args.layers, args.dir, args.rounds)
