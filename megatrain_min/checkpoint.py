"""checkpoint.py -- save and resume training: streamed from the host store, atomic, verified.

What it is
    save() writes what stream.Trainer keeps in host memory: per unit (embedding, each layer, head) one
    file holding fp32 master | Adam m | Adam v, taken straight from the store's own tensors in 16 MiB
    chunks with a CRC-32 computed on the way -- no second copy of the model is ever made. meta.json holds
    the format version, the config, the step, each unit's Adam step count, file sizes and CRCs, and the
    caller's dict (schedule position, rng_state(), the data sampler's state). All of it goes into a hidden
    .tmp-* directory, is fsynced, and is renamed into place: a crash at any moment leaves every earlier
    checkpoint whole. load() checks everything (format version, config, layout, every file's size and
    CRC, streamed a chunk at a time) before it touches the trainer, then reads straight into the store.
What it is not
    Not torch.save of a state dict (pickle: a second copy of the model in memory, and loading runs code);
    not a Hugging Face export (hf.py: weights only). Gradients and the bf16 shadow are not saved -- they do
    not outlive a step, or are rebuilt from the master -- so a bf16 run can resume in fp32 and vice versa.
Why CRC-32
    On the 2-core dev machine: zlib.crc32 3.4-4.0 GB/s, sha256 1.5 (SHA-NI), blake2b 0.8, against fsynced
    disk writes of 0.7-1.7 GB/s. A cryptographic hash would be the bottleneck of a save; CRC-32 catches
    truncated, torn and bit-flipped files (every burst up to 32 bits). It is no defence against tampering.
On disk
    out/ckpt-00000100/meta.json     {"format", "version", "step", "config", "units": [{"name", "numel",
                                      "step", "file", "bytes", "crc32"}, ...], "meta": {...}, "crc32"}
    out/ckpt-00000100/layer.0.bin   master | m | v, numel fp32 each, in the recorded byte order
Try it
    python -m pytest tests/test_checkpoint.py
    python bench/checkpoint_io.py                # save/load GB/s of a ~1B-param store vs the raw disk
"""
import base64
import json
import os
import random
import re
import shutil
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

FORMAT, VERSION = "megatrain-min checkpoint", 1
STATES = ("master", "m", "v")   # the fp32 tensors of every unit, in the order they sit in its file
CHUNK = 16 << 20                # bytes per CRC/write call: big enough that Python's per-call cost vanishes


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this trainer. The message is one line, for a human."""


def checkpoints(out_dir):
    """[(step, path)] of the finished checkpoints in out_dir, oldest first."""
    out = Path(out_dir)
    found = [(int(m[1]), p) for p in (out.iterdir() if out.is_dir() else [])
             if (m := re.fullmatch(r"ckpt-(\d+)", p.name)) and (p / "meta.json").is_file()]
    return sorted(found)


def latest(out_dir):
    """The newest finished checkpoint in out_dir (a Path), or None."""
    found = checkpoints(out_dir)
    return found[-1][1] if found else None


# ----------------------------------------------------------------------------- save
def save(trainer, out_dir, step, meta=None, keep=None):
    """Write trainer's host store to out_dir/ckpt-{step:08d}/ and return that path. meta: a JSON-able dict
    that load() gives back. keep: then delete all but the newest `keep` checkpoints (None/0: keep all).
    Call it between steps; it waits for the optimizer updates still in flight."""
    out = Path(out_dir)
    meta = json.loads(json.dumps(meta or {}))    # not JSON-able: TypeError now, before anything is written
    trainer.wait()                               # no update or copy in flight
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".tmp-*"):             # what a killed save or delete left behind
        shutil.rmtree(stale, ignore_errors=True)
    final = out / f"ckpt-{step:08d}"
    tmp = out / f".tmp-{final.name}-{os.getpid()}"
    opt, units = trainer.opt, []
    try:
        tmp.mkdir()
        with ThreadPoolExecutor(max_workers=1) as flusher:  # fsync file u while file u+1 is being written
            synced = []
            for u, lay in enumerate(trainer.units):
                state = opt.state(u)
                f, crc = _write(tmp / f"{lay.name}.bin", [state[s] for s in STATES])
                synced.append(flusher.submit(_fsync_close, f))
                units.append({"name": lay.name, "numel": lay.numel, "step": opt.step_count(u),
                              "file": f"{lay.name}.bin", "bytes": 4 * len(STATES) * lay.numel, "crc32": crc})
            for s in synced:
                s.result()                       # an fsync error (disk full, I/O) surfaces here
        doc = {"format": FORMAT, "version": VERSION, "step": step, "config": trainer.cfg.to_dict(),
               "dtype": "float32", "byteorder": sys.byteorder, "states": list(STATES), "units": units, "meta": meta}
        f = open(tmp / "meta.json", "w")
        json.dump({**doc, "crc32": _doc_crc(doc)}, f, indent=1)
        _fsync_close(f)
        _fsync_dir(tmp)
        if final.exists():                       # the same step saved again: the new one replaces it
            _remove(final)
        os.rename(tmp, final)                    # atomic: the checkpoint appears whole, or not at all
        _fsync_dir(out)
    except BaseException:                        # disk full, Ctrl-C, ...: earlier checkpoints stay as they are
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in checkpoints(out)[:-keep] if keep else []:
        _remove(old)
    return final


def _write(path, tensors):
    """Write the raw bytes of `tensors` to a new file; return (the open file, CRC-32 of what was written)."""
    f, crc = open(path, "wb"), 0
    for t in tensors:
        mv = bytes_of(t)
        for i in range(0, len(mv), CHUNK):
            crc = zlib.crc32(mv[i:i + CHUNK], crc)   # the chunk is still in cache for the write
            f.write(mv[i:i + CHUNK])                 # a large write goes from our memory to the kernel
    return f, crc


def bytes_of(t):
    """The bytes of a contiguous CPU tensor as a memoryview of its own memory (no copy)."""
    return memoryview(t.numpy()).cast("B")


def _fsync_close(f):
    f.flush()
    os.fsync(f.fileno())
    f.close()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path):
    """Delete a checkpoint, renaming it to .tmp-* first so a half-deleted one never looks like a checkpoint."""
    doomed = path.with_name(f".tmp-del-{path.name}-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def _doc_crc(doc):
    return zlib.crc32(json.dumps(doc, sort_keys=True).encode())


# ----------------------------------------------------------------------------- load
def read_meta(path):
    """The contents of path/meta.json with format, version and its own CRC checked (else CheckpointError)."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        hint = f"; it holds checkpoints, the latest is {latest(path)}" if latest(path) else ""
        raise CheckpointError(f"{path} is not a checkpoint directory (no meta.json){hint}")
    try:
        doc = json.loads((path / "meta.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}/meta.json is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a megatrain-min checkpoint (meta.json has no format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {doc.get('version')!r}; this code reads "
                              f"version {VERSION}")
    if doc.pop("crc32", None) != _doc_crc(doc):
        raise CheckpointError(f"{path}/meta.json fails its CRC-32 check; the checkpoint is damaged")
    return doc


def verify_files(path, doc, crc=True):
    """Check that every unit file is there with its size, then (crc=True) each file's CRC-32, reading
    one chunk at a time."""
    files = [(Path(path) / unit["file"], unit) for unit in doc["units"]]
    for f_path, unit in files:
        if not f_path.is_file():
            raise CheckpointError(f"{f_path} is missing; the checkpoint is incomplete")
        if (size := f_path.stat().st_size) != unit["bytes"]:
            raise CheckpointError(f"{f_path} has {size:,} bytes, expected {unit['bytes']:,}; it is truncated or damaged")
    buf = bytearray(CHUNK)
    for f_path, unit in files if crc else []:
        c = 0
        with open(f_path, "rb") as f:
            while n := f.readinto(buf):
                c = zlib.crc32(memoryview(buf)[:n], c)
        if c != unit["crc32"]:
            raise CheckpointError(f"{f_path} fails its CRC-32 check; the file is damaged")


def load(trainer, path, verify_first=True):
    """Load checkpoint `path` into trainer; return the meta dict given to save() plus "step".
    Raises CheckpointError, with the trainer untouched, for anything that does not match or check out.
    verify_first=False reads every byte once instead of twice (about 2x faster from a cold disk) and
    checks the CRCs on the way: a damaged file still raises CheckpointError, but the trainer then holds a
    partial state -- fine for a fresh trainer that is thrown away on error (train.py --resume)."""
    path = Path(path)
    doc = read_meta(path)
    if doc["byteorder"] != sys.byteorder:
        raise CheckpointError(f"{path} was written on a {doc['byteorder']}-endian machine; this one is {sys.byteorder}")
    here, there = trainer.cfg.to_dict(), doc["config"]
    for k in list(here) + [k for k in there if k not in here]:
        if there.get(k) != here.get(k):
            raise CheckpointError(f"{path} is for another model: {k}={there.get(k)!r} in the checkpoint, "
                                  f"{here.get(k)!r} in this run (first differing config field)")
    ours = [(lay.name, lay.numel) for lay in trainer.units]
    theirs = [(u["name"], u["numel"]) for u in doc["units"]]
    if ours != theirs:
        a, b = next((a, b) for a, b in zip(theirs + [None], ours + [None]) if a != b)
        raise CheckpointError(f"{path} has another parameter layout: unit {a} in the checkpoint, {b} in this model")
    verify_files(path, doc, crc=verify_first)    # nothing has been touched so far
    trainer.wait()
    opt = trainer.opt
    for u, unit in enumerate(doc["units"]):      # straight into the store (from the page cache, if it fits)
        crc = 0
        state = opt.state(u)
        with open(path / unit["file"], "rb") as f:
            for s in STATES:
                mv = bytes_of(state[s])
                if f.readinto(mv) != len(mv):
                    raise CheckpointError(f"{path / unit['file']} shrank while loading; the trainer is now partial")
                crc = crc if verify_first else zlib.crc32(mv, crc)
        if not verify_first and crc != unit["crc32"]:
            raise CheckpointError(f"{path / unit['file']} fails its CRC-32 check; the trainer is now partial")
        opt.set_step_count(u, unit["step"])
        opt.refresh_shadow(u)
    return {**doc["meta"], "step": doc["step"]}


# ----------------------------------------------------------------------------- RNG states for meta
def rng_state():
    """The global generators (python random, numpy, torch CPU and CUDA) as JSON-able data."""
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    py, npy = random.getstate(), np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]], "torch": b64(torch.get_rng_state()),
            "numpy": [npy[0], npy[1].tolist(), int(npy[2]), int(npy[3]), float(npy[4])],
            "cuda": [b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []}


def set_rng_state(state):
    """Restore what rng_state() returned (the CUDA states only where as many GPUs are present)."""
    unb64 = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    np.random.set_state((state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:]))
    torch.set_rng_state(unb64(state["torch"]))
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([unb64(s) for s in state["cuda"]])
