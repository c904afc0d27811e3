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
Nothing lost
    save() never writes master weights holding a NaN or an infinity (NonFiniteError; checked chunk by chunk
    on the way, ~9 GB/s, beside the CRC), and load() refuses them, naming the tensor. A write error (disk
    full, file too large, no permission) raises SaveError with the temporary directory removed. `keep` prunes
    only checkpoints of the same run (meta["run"]), never another run's, and a step saved again replaces only
    its own run's checkpoint. Debris of a killed save is removed only when the process that wrote it is gone.
    lock(out_dir) is the run lock: one run per directory (flock, dropped by the kernel even on SIGKILL).
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
import fcntl
import json
import os
import random
import re
import shutil
import sys
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

import model

FORMAT, VERSION = "megatrain-min checkpoint", 1
STATES = ("master", "m", "v")   # the fp32 tensors of every unit, in the order they sit in its file
CHUNK = 16 << 20                # bytes per CRC/write call: big enough that Python's per-call cost vanishes
LOCK = ".lock"                  # the run lock of an output directory (an empty file; see lock())


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this trainer (or saved there). The message is one line, for a human."""


class NonFiniteError(CheckpointError):
    """The master weights hold a NaN or an infinity: such a checkpoint is never written."""


class LockError(CheckpointError):
    """Another process holds the run lock of the directory."""


class SaveError(OSError):
    """A checkpoint could not be written (disk full, file too large, no permission, ...). The temporary
    directory is removed and every earlier checkpoint is whole. The message is one line."""


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


def lock(out_dir):
    """Take the run lock of out_dir (made if missing): an exclusive flock on out_dir/.lock, held until the
    returned file is closed or the process ends -- the kernel drops it even after a SIGKILL, so no stale lock
    survives a crash. Raises LockError naming the PID that holds it (from /proc/locks: the file itself is never
    written, so a refused run changes no byte in the directory). The file stays: deleting it would let two
    runs lock two different files."""
    path = Path(out_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(os.open(path, os.O_RDONLY | os.O_CREAT, 0o644))
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(f)
        f.close()
        raise LockError(f"{path.parent} is in use by another run (pid {holder}, holding {path})") from None
    return f


def _lock_holder(f):
    """The PID holding a flock on the open file f, read from /proc/locks (Linux), or "unknown"."""
    st = os.fstat(f.fileno())
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:   # "1: FLOCK  ADVISORY  WRITE 13995 fe:00:2146902 0 EOF"
            for fields in map(str.split, locks):
                if ident in fields and "->" not in fields:   # "->": a process waiting for the lock, not holding it
                    return fields[fields.index(ident) - 1]
    except OSError:
        pass
    return "unknown"


# ----------------------------------------------------------------------------- save
def save(trainer, out_dir, step, meta=None, keep=None):
    """Write trainer's host store to out_dir/ckpt-{step:08d}/ and return that path. meta: a JSON-able dict
    that load() gives back; meta["run"] names the run (train.py: a random id kept across resumes). keep: then
    delete all but the newest `keep` (>= 1) checkpoints of the same run; None: keep all. A checkpoint of the
    same step is replaced only when it is the same run's (else CheckpointError, nothing written).
    Raises NonFiniteError for master weights with a NaN or an infinity, SaveError for a write error.
    Call it between steps; it waits for the optimizer updates still in flight."""
    out = Path(out_dir)
    meta = json.loads(json.dumps(meta or {}))    # not JSON-able: TypeError now, before anything is written
    if keep is not None and not (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1):
        raise ValueError(f"keep must be None (keep all) or an integer >= 1, got {keep!r}")
    final = out / f"ckpt-{step:08d}"
    if final.exists() and _run_of(final) != meta.get("run"):
        raise CheckpointError(f"{final} exists and is not this run's checkpoint; not replacing it")
    trainer.wait()                               # no update or copy in flight
    tmp = out / f".tmp-{final.name}-{os.getpid()}"
    opt, units = trainer.opt, []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob(".tmp-*"):         # what a killed save or delete left behind, never a live run's
            if not _alive(stale.name.rsplit("-", 1)[-1]):
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        with ThreadPoolExecutor(max_workers=1) as flusher:  # fsync file u while file u+1 is being written
            synced = []
            for u, lay in enumerate(trainer.units):
                state = opt.state(u)
                f, crc = _write(tmp / f"{lay.name}.bin", [state[s] for s in STATES], lay)
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
    except BaseException as e:                   # disk full, Ctrl-C, ...: earlier checkpoints stay as they are
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, NonFiniteError):
            raise NonFiniteError(f"not saving {final}: {e}") from None
        if isinstance(e, OSError):
            raise SaveError(e.errno, f"could not write checkpoint {final} ({e.strerror or e}"
                                     f"{': ' + str(e.filename) if e.filename else ''}); the temporary directory is "
                                     f"removed, earlier checkpoints are whole") from None
        raise
    if keep:
        mine = [p for _, p in checkpoints(out) if _run_of(p) == meta.get("run")]
        for old in mine[:-keep]:
            try:
                _remove(old)
            except OSError as e:                 # the new checkpoint is whole; an old one just stays
                warnings.warn(f"could not delete the old checkpoint {old}: {e}")
    return final


def _run_of(path):
    """meta["run"] of checkpoint `path`; a value equal to no run's when it cannot be read (never ours to delete)."""
    try:
        return read_meta(path)["meta"].get("run")
    except (CheckpointError, OSError):
        return object()


def _alive(pid):
    """Is `pid` (the tail of a .tmp-* name) another process that is still running? A tail that is no PID
    counts as alive: whatever it is, it is left alone."""
    if not pid.isdigit():
        return True
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:                      # someone else's process
        return True
    return True


def _write(path, tensors, layout):
    """Write the raw bytes of `tensors` (master first) to a new file; return (the open file, CRC-32 of what was
    written). Each chunk of the master is checked to be finite on the way (NonFiniteError naming the tensor)."""
    f, crc = open(path, "wb"), 0
    for k, t in enumerate(tensors):
        mv = bytes_of(t)
        for i in range(0, len(mv), CHUNK):
            if k == 0:                               # the master: finite, or no checkpoint
                chunk = t[i // 4:(i + CHUNK) // 4]
                if not model.all_finite(chunk):
                    f.close()
                    j = i // 4 + int((~torch.isfinite(chunk)).nonzero()[0])
                    raise NonFiniteError(f"the master weights of {layout.key_at(j)} hold a NaN or an infinity")
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
    except OSError as e:
        raise CheckpointError(f"{path}/meta.json cannot be read ({e.strerror})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a megatrain-min checkpoint (meta.json has no format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {doc.get('version')!r}; this code reads "
                              f"version {VERSION}")
    if doc.pop("crc32", None) != _doc_crc(doc):
        raise CheckpointError(f"{path}/meta.json fails its CRC-32 check; the checkpoint is damaged")
    _check_fields(path, doc)
    return doc


def _check_fields(path, doc):
    """The fields load() and train.py rely on, with their types: a meta.json edited by hand, with its CRC
    recomputed, fails here with one line instead of deep inside."""
    def bad(problem):
        raise CheckpointError(f"{path}/meta.json: {problem}; the checkpoint was edited or is damaged")

    count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if not count(doc.get("step")):
        bad(f"step {doc.get('step')!r} is not a step count")
    if not (isinstance(doc.get("config"), dict) and isinstance(doc.get("meta"), dict)):
        bad("config or meta is not an object")
    if (doc.get("dtype"), doc.get("states")) != ("float32", list(STATES)) or doc.get("byteorder") not in ("little", "big"):
        bad("dtype, states or byteorder are not this format's")
    if not isinstance(doc.get("units"), list):
        bad("units is not a list")
    for u in doc["units"]:   # a unit file is its name + .bin, inside the checkpoint: no path goes elsewhere
        if not (isinstance(u, dict) and isinstance(u.get("name"), str) and re.fullmatch(r"\w[\w.]*", u["name"])
                and u.get("file") == u["name"] + ".bin" and all(count(u.get(k)) for k in ("numel", "step", "bytes", "crc32"))
                and u["bytes"] == 4 * len(STATES) * u["numel"]):
            bad(f"the unit entry {json.dumps(u)[:80]} is malformed")


def verify_files(path, doc, crc=True, layouts=None):
    """Check that every unit file is there with its size, then (crc=True) each file's CRC-32, reading
    one chunk at a time, and that its master weights (the first numel floats) are all finite: a NaN is
    refused naming the tensor (layouts: model.units of the config) -- it would train silently."""
    files = [(Path(path) / unit["file"], unit) for unit in doc["units"]]
    for f_path, unit in files:
        if not f_path.is_file():
            raise CheckpointError(f"{f_path} is missing; the checkpoint is incomplete")
        if (size := f_path.stat().st_size) != unit["bytes"]:
            raise CheckpointError(f"{f_path} has {size:,} bytes, expected {unit['bytes']:,}; it is truncated or damaged")
    buf = bytearray(CHUNK)
    for u, (f_path, unit) in enumerate(files if crc else []):
        c, pos, bad = 0, 0, None
        with open(f_path, "rb") as f:
            while n := f.readinto(buf):
                c = zlib.crc32(memoryview(buf)[:n], c)
                if pos < 4 * unit["numel"] and bad is None:      # the master comes first in the file
                    chunk = torch.frombuffer(buf, dtype=torch.float32, count=min(n, 4 * unit["numel"] - pos) // 4)
                    if not model.all_finite(chunk):
                        bad = pos // 4 + int((~torch.isfinite(chunk)).nonzero()[0])
                pos += n
        if c != unit["crc32"]:
            raise CheckpointError(f"{f_path} fails its CRC-32 check; the file is damaged")
        if bad is not None:
            what = layouts[u].key_at(bad) if layouts else f"unit {unit['name']}"
            raise CheckpointError(f"{path}: the master weights of {what} hold a NaN or an infinity; refusing them")


def check_model(path, doc, cfg):
    """CheckpointError unless checkpoint `path` (doc: its read_meta) holds model cfg: same byte order, same
    config, same parameter layout. Reads nothing but meta.json: train.py asks before allocating a trainer."""
    if doc["byteorder"] != sys.byteorder:
        raise CheckpointError(f"{path} was written on a {doc['byteorder']}-endian machine; this one is {sys.byteorder}")
    here, there = cfg.to_dict(), doc["config"]
    for k in list(here) + [k for k in there if k not in here]:
        if there.get(k) != here.get(k):
            raise CheckpointError(f"{path} is for another model: {k}={there.get(k)!r} in the checkpoint, "
                                  f"{here.get(k)!r} in this run (first differing config field)")
    ours = [(lay.name, lay.numel) for lay in model.units(cfg)]
    theirs = [(u["name"], u["numel"]) for u in doc["units"]]
    if ours != theirs:
        a, b = next((a, b) for a, b in zip(theirs + [None], ours + [None]) if a != b)
        raise CheckpointError(f"{path} has another parameter layout: unit {a} in the checkpoint, {b} in this model")


def load(trainer, path, verify_first=True):
    """Load checkpoint `path` into trainer; return the meta dict given to save() plus "step".
    Raises CheckpointError, with the trainer untouched, for anything that does not match or check out.
    verify_first=False reads every byte once instead of twice (about 2x faster from a cold disk) and
    checks the CRCs on the way: a damaged file still raises CheckpointError, but the trainer then holds a
    partial state -- fine for a fresh trainer that is thrown away on error (train.py --resume)."""
    path = Path(path)
    doc = read_meta(path)
    check_model(path, doc, trainer.cfg)
    verify_files(path, doc, crc=verify_first, layouts=trainer.units)    # nothing has been touched so far
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
        if not verify_first and not model.all_finite(state["master"]):
            raise CheckpointError(f"{path}: the master weights of unit {unit['name']} hold a NaN or an infinity; "
                                  f"the trainer is now partial")
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
