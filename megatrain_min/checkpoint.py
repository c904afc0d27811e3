"""checkpoint.py -- save and resume training: streamed from the host store, atomic, verified.

What it is
    save() writes what stream.Trainer keeps in host memory: per unit (embedding, each layer, head)
    one file holding fp32 master | Adam m | Adam v, taken straight from the store's own tensors in
    16 MiB chunks with a CRC-32 computed on the way -- no second copy of the model is ever made.
    meta.json holds the format version, the config, the step, each unit's Adam step count, file
    sizes and CRCs, and the caller's dict (schedule position, rng_state(), the data sampler's
    state). All of it goes into a hidden .tmp-* directory, is fsynced, and is renamed into place: a
    crash at any moment leaves every earlier checkpoint whole. load() checks everything (format
    version, config, layout, every file's size and CRC, streamed a chunk at a time) before it
    touches the trainer, then reads straight into the store.
    save(..., tokenizer_from=MODEL_DIR) puts the model's tokenizer files beside the units
    (tokenizer.TOKENIZER_FILES, and its config.json's bos/eos/pad ids and each file's sha256 into
    meta.json): the checkpoint is then a tokenizer source itself (tokenizer.HFTokenizer(ckpt)) and
    `python -m megatrain_min.hf export` takes them along. read_meta verifies them: a file missing,
    replaced (another tokenizer of the same size) or damaged is a CheckpointError naming it, never
    silently another tokenizer than the one the model was trained with.
    read_weights(path) -> (cfg, weights): the fp32 master weights as a lazy mapping, read tensor by
    tensor from the unit files (verified first, as load() does) without a trainer: what hf.export
    and --init-from need.
Sharded (megatrain_min/sharded.py: N ranks, each holding [lo, hi) of every unit)
    Every rank writes its part of every unit, name.partR.bin = master | m | v of [lo, hi), into the
    one .tmp-* directory rank 0 made (every rank must see --out: one filesystem, shared between
    nodes); rank 0 writes meta.json (version 2: each unit lists its parts) only once every rank
    reported its parts fsynced, then renames: the checkpoint is complete only when all parts and the
    meta are. Any rank's error is every rank's (trainer.placement.gather_object). load() reads, for
    this trainer's [lo, hi) of each unit, the overlapping ranges of whichever parts hold them: a
    checkpoint loads at any world size (1 -> N, N -> 1, N -> M), resharded on load. One process
    writes version 1, one file per unit, exactly as before.
Nothing lost
    save() never writes master weights holding a NaN or an infinity (NonFiniteError; checked chunk
    by chunk on the way, ~9 GB/s, beside the CRC), and load() refuses them, naming the tensor. A
    write error (disk full, file too large, no permission) raises SaveError with the temporary
    directory removed. `keep` prunes only checkpoints of the same run (meta["run"]), never another
    run's, and a step saved again replaces only its own run's checkpoint. Debris of a killed save is
    removed only when the process that wrote it is gone.
    lock(out_dir) is the run lock: one run per directory (flock, dropped by the kernel even on
    SIGKILL); lock_holder(out_dir) asks who holds it without taking it (a refusal writes nothing).
What it is not
    Not torch.save of a state dict (pickle: a second copy of the model in memory, and loading runs
    code); not a Hugging Face export (hf.py: weights only). Gradients and the bf16 shadow are not
    saved -- they do not outlive a step, or are rebuilt from the master -- so a bf16 run can resume
    in fp32 and vice versa.
Why CRC-32
    On the 2-core dev machine: zlib.crc32 3.4-4.0 GB/s, sha256 1.5 (SHA-NI), blake2b 0.8, against
    fsynced disk writes of 0.7-1.7 GB/s. A cryptographic hash would be the bottleneck of a save;
    CRC-32 catches truncated, torn and bit-flipped files (every burst up to 32 bits). It is no
    defence against tampering.
On disk
    out/ckpt-00000100/meta.json     {"format", "version", "step", "config",
                                     "units": [{"name", "numel", "step", "file", "bytes", "crc32"},
                                               ...],
                                     "meta": {...}, "crc32"}
    out/ckpt-00000100/layer.0.bin   master | m | v, numel fp32 each, in the recorded byte order
    out/ckpt-00000100/tokenizer.json ...   with tokenizer_from: meta.json's "tokenizer"
                                           {"files", "config_ids"}
    sharded (version 2): units [{"name", "numel", "step",
                                 "parts": [{"file": "layer.0.part1.bin", "lo", "hi", "bytes",
                                            "crc32"}, ...]}];
                         layer.0.part1.bin = master | m | v of elements [lo, hi) of the unit
Try it
    python -m pytest tests/test_checkpoint.py
    python bench/checkpoint_io.py   # save/load GB/s of a ~1B-param store vs the raw disk
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
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import model
from megatrain_min.checks import all_finite, check_config
from megatrain_min.publish import alive
from megatrain_min.tokenizer import copy_tokenizer_files, file_sha256

FORMAT, VERSION = "megatrain-min checkpoint", 1
SHARDED = 2                     # the version of a checkpoint written by N > 1 ranks: parts per unit
STATES = ("master", "m", "v")   # the fp32 tensors of every unit, in the order they sit in its file
CHUNK = 16 << 20   # bytes per CRC/write call: big enough that Python's per-call cost vanishes
LOCK = ".lock"                  # the run lock of an output directory (an empty file; see lock())


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this trainer (or saved there). The message is one
    line, for a human."""


class NonFiniteError(CheckpointError):
    """The master weights hold a NaN or an infinity: such a checkpoint is never written."""


class LockError(CheckpointError):
    """Another process holds the run lock of the directory."""


class SaveError(OSError):
    """A checkpoint could not be written (disk full, file too large, no permission, ...). The
    temporary directory is removed and every earlier checkpoint is whole. The message is one
    line."""


# a checkpoint's directory: ckpt-STEP (8 digits when this code names it)
NAME = re.compile(r"ckpt-(\d+)")


def checkpoints(out_dir):
    """[(step, path)] of the finished checkpoints in out_dir, oldest first."""
    out = Path(out_dir)
    found = [(int(m[1]), p) for p in (out.iterdir() if out.is_dir() else [])
             if (m := NAME.fullmatch(p.name)) and (p / "meta.json").is_file()]
    return sorted(found)


def latest(out_dir):
    """The newest finished checkpoint in out_dir (a Path), or None."""
    found = checkpoints(out_dir)
    return found[-1][1] if found else None


def lock(out_dir):
    """Take the run lock of out_dir (made if missing): an exclusive flock on out_dir/.lock, held
    until the returned file is closed or the process ends -- the kernel drops it even after a
    SIGKILL, so no stale lock survives a crash. Raises LockError naming the PID that holds it (from
    /proc/locks: the file itself is never written, so a refused run changes no byte in the
    directory). The file stays: deleting it would let two runs lock two different files."""
    path = Path(out_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(os.open(path, os.O_RDONLY | os.O_CREAT, 0o644))
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(f)
        f.close()
        raise LockError(f"{path.parent} is in use by another run (pid {holder}, "
                        f"holding {path})") from None
    return f


def lock_holder(out_dir):
    """The PID holding out_dir's run lock, or None (no lock file, or nobody holds it): a probe that
    creates, takes and changes nothing."""
    try:
        f = open(Path(out_dir) / LOCK, "rb")
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _lock_holder(f)
    return None   # closing the file dropped the lock this probe took


def is_checkpoint(path):
    """Whether `path` is a checkpoint directory: ckpt-STEP holding a meta.json of this format."""
    path = Path(path)
    if not (NAME.fullmatch(path.name) and (path / "meta.json").is_file()):
        return False
    try:
        return json.loads((path / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def before(path):
    """The checkpoint of the same directory just before checkpoint `path` (often intact when `path`
    is not), or None."""
    path = Path(path)
    found = [p for _, p in checkpoints(path.parent) if p.name < path.name]
    return found[-1] if found else None


def _lock_holder(f):
    """The PID holding a flock on the open file f, read from /proc/locks (Linux), or "unknown"."""
    st = os.fstat(f.fileno())
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:   # "1: FLOCK  ADVISORY  WRITE 13995 fe:00:2146902 0 EOF"
            for fields in map(str.split, locks):
                # "->": a process waiting for the lock, not holding it
                if ident in fields and "->" not in fields:
                    return fields[fields.index(ident) - 1]
    except OSError:
        pass
    return "unknown"


# ----------------------------------------------------------------------------- save
def save(trainer, out_dir, step, meta=None, keep=None, tokenizer_from=None):
    """Write trainer's host store to out_dir/ckpt-{step:08d}/ and return that path. meta: a
    JSON-able dict that load() gives back; meta["run"] names the run (train.py: a random id kept
    across resumes). keep: then delete all but the newest `keep` (>= 1) checkpoints of the same run;
    None: keep all. A checkpoint of the same step is replaced only when it is the same run's (else
    CheckpointError, nothing written). tokenizer_from: a model directory (or checkpoint) whose
    tokenizer files go into the checkpoint too. Raises NonFiniteError for master weights with a NaN
    or an infinity, SaveError for a write error. Call it between steps; it waits for the optimizer
    updates still in flight. A sharded trainer: every rank calls it (collectives); each writes its
    parts, rank 0 the meta; every rank returns or raises the same."""
    out = Path(out_dir)
    # not JSON-able: TypeError now, before anything is written
    meta = json.loads(json.dumps(meta or {}))
    if keep is not None and not (isinstance(keep, int)
                                 and not isinstance(keep, bool) and keep >= 1):
        raise ValueError(f"keep must be None (keep all) or an integer >= 1, got {keep!r}")
    rank, world = ranks(trainer)
    final, lead, sharded = out / f"ckpt-{step:08d}", rank == 0, world > 1
    trainer.wait()                               # no update or copy in flight
    tmp, error = None, None
    if lead:
        try:
            if final.exists() and _run_of(final) != meta.get("run"):
                raise CheckpointError(f"{final} exists and is not this run's "
                                      "checkpoint; not replacing it")
            tmp = out / f".tmp-{final.name}-{os.getpid()}"
            out.mkdir(parents=True, exist_ok=True)
            # what a killed save or delete left behind, never a live run's
            for stale in out.glob(".tmp-*"):
                if not alive(stale.name.rsplit("-", 1)[-1]):
                    shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except BaseException as e:
            error = _failed(e, final, tmp)
    tmp = _agree(trainer, (str(tmp) if tmp else None, error))[0][0]
    tmp, units = Path(tmp), []
    try:                                         # every rank: its parts of every unit
        opt = trainer.opt
        # fsync file u while file u+1 is being written
        with ThreadPoolExecutor(max_workers=1) as flusher:
            synced = []
            for u, lay in enumerate(trainer.units):
                lo, hi = trainer.placement.part(lay)
                name = f"{lay.name}.part{rank}.bin" if sharded else f"{lay.name}.bin"
                state = opt.state(u)
                # (a unit resident on the GPU: D2H first)
                f, crc = _write(tmp / name, [state[s][:hi - lo].cpu() for s in STATES], lay, lo)
                synced.append(flusher.submit(_fsync_close, f))
                units.append({"name": lay.name, "numel": lay.numel, "step": opt.step_count(u),
                              "file": name, "lo": lo, "hi": hi,
                              "bytes": 4 * len(STATES) * (hi - lo), "crc32": crc})
            for s in synced:
                s.result()                       # an fsync error (disk full, I/O) surfaces here
        error = None
    except BaseException as e:
        error = _failed(e, final, tmp)
    every = [parts for parts, _ in _agree(trainer, (units, error))]
    if lead:
        try:
            if sharded:                          # version 2: each unit lists every rank's part
                units = [{"name": u["name"], "numel": u["numel"], "step": u["step"],
                          "parts": [{k: r[i][k] for k in ("file", "lo", "hi", "bytes",
                                                          "crc32")} for r in every]}
                         for i, u in enumerate(every[0])]
            else:
                units = [{k: u[k] for k in ("name", "numel", "step", "file", "bytes",
                                            "crc32")} for u in units]
            doc = {"format": FORMAT, "version": SHARDED if sharded else VERSION, "step": step,
                   "config": trainer.cfg.to_dict(), "dtype": "float32", "byteorder": sys.byteorder,
                   "states": list(STATES), "units": units, "meta": meta}
            # {"files", "config_ids"}: written before meta.json, renamed with it
            if tokenizer_from is not None:
                doc["tokenizer"] = copy_tokenizer_files(tokenizer_from, tmp)
            f = open(tmp / "meta.json", "w")
            json.dump({**doc, "crc32": _doc_crc(doc)}, f, indent=1)
            _fsync_close(f)
            _fsync_dir(tmp)
            if final.exists():                  # the same step saved again: the new one replaces it
                _remove(final)
            os.rename(tmp, final)              # atomic: the checkpoint appears whole, or not at all
            _fsync_dir(out)
            error = None
        except BaseException as e:
            error = _failed(e, final, tmp)
    _agree(trainer, error if lead else None)
    if keep and lead:
        mine = [p for _, p in checkpoints(out) if _run_of(p) == meta.get("run")]
        for old in mine[:-keep]:
            try:
                _remove(old)
            except OSError as e:                # the new checkpoint is whole; an old one just stays
                warnings.warn(f"could not delete the old checkpoint {old}: {e}")
    return final


def _failed(e, final, tmp):
    """The exception save() raises for e (disk full, Ctrl-C, ...), the temporary directory removed:
    earlier checkpoints stay as they are."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(e, NonFiniteError):
        return NonFiniteError(f"not saving {final}: {e}")
    if isinstance(e, OSError) and not isinstance(e, SaveError):
        where = f": {e.filename}" if e.filename else ""
        return SaveError(e.errno, f"could not write checkpoint {final} "
                                  f"({e.strerror or e}{where}); the temporary directory is "
                                  "removed, earlier checkpoints are whole")
    return e


def _agree(trainer, obj):
    """obj of every rank (trainer.placement.gather_object; one process: [obj]). An obj, or its
    second item, that is an exception on any rank is raised on every rank (the lowest rank's), so
    that all stop together."""
    found = trainer.placement.gather_object(obj)
    for o in found:
        e = o[1] if isinstance(o, tuple) else o
        if isinstance(e, BaseException):
            raise e
    return found


def key_at(layout, i):
    """The key of the tensor that holds element i of a unit's flat buffer."""
    return next(e.key for e in layout.entries if e.offset <= i < e.offset + e.numel)


def ranks(trainer):
    """(rank, world) of the trainer's process group (stream.Whole: one process, rank 0 of 1)."""
    group = trainer.placement.group
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _run_of(path):
    """meta["run"] of checkpoint `path`; a value equal to no run's when it cannot be read (never
    ours to delete)."""
    try:
        return read_meta(path, tokenizer=False)["meta"].get("run")
    except (CheckpointError, OSError):
        return object()


def _write(path, tensors, layout, lo=0):
    """Write the raw bytes of `tensors` (master first: elements lo.. of the unit) to a new file;
    return (the open file, CRC-32 of what was written). Each chunk of the master is checked to be
    finite on the way (NonFiniteError naming the tensor)."""
    f, crc = open(path, "wb"), 0
    for k, t in enumerate(tensors):
        mv = bytes_of(t)
        for i in range(0, len(mv), CHUNK):
            if k == 0:                               # the master: finite, or no checkpoint
                chunk = t[i // 4:(i + CHUNK) // 4]
                if not all_finite(chunk):
                    f.close()
                    j = lo + i // 4 + int((~torch.isfinite(chunk)).nonzero()[0])
                    raise NonFiniteError(f"the master weights of {key_at(layout, j)} "
                                         "hold a NaN or an infinity")
            crc = zlib.crc32(mv[i:i + CHUNK], crc)   # the chunk is still in cache for the write
            f.write(mv[i:i + CHUNK])   # a large write goes from our memory to the kernel
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
    """Delete a checkpoint, renaming it to .tmp-* first so a half-deleted one never looks like a
    checkpoint."""
    doomed = path.with_name(f".tmp-del-{path.name}-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def _doc_crc(doc):
    return zlib.crc32(json.dumps(doc, sort_keys=True).encode())


# ----------------------------------------------------------------------------- load
def read_meta(path, tokenizer=True):
    """The contents of path/meta.json with format, version and its own CRC checked (else
    CheckpointError); tokenizer: and the tokenizer files it was saved with, each there and the same
    (check_tokenizer)."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        hint = f"; it holds checkpoints, the latest is {latest(path)}" if latest(path) else ""
        raise CheckpointError(f"{path} is not a checkpoint directory (no meta.json){hint}")
    try:
        doc = json.loads((path / "meta.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}/meta.json is not valid JSON ({e}); the "
                              "checkpoint is damaged") from None
    except OSError as e:
        raise CheckpointError(f"{path}/meta.json cannot be read ({e.strerror})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a megatrain-min checkpoint (meta.json has "
                              f"no format {FORMAT!r})")
    if doc.get("version") not in (VERSION, SHARDED):
        raise CheckpointError(f"{path} has checkpoint format version {doc.get('version')!r}; this "
                              f"code reads versions {VERSION} and {SHARDED} (sharded)")
    if doc.pop("crc32", None) != _doc_crc(doc):
        raise CheckpointError(f"{path}/meta.json fails its CRC-32 check; the checkpoint is damaged")
    _check_fields(path, doc)
    if tokenizer:
        check_tokenizer(path, doc)
    return doc


def check_tokenizer(path, doc):
    """CheckpointError unless every tokenizer file checkpoint `path` was saved with
    (doc["tokenizer"]) is there and, where its sha256 was recorded, the same: a tokenizer.json of
    another model with the same vocabulary size, a lost tokenizer_config.json (its chat template,
    its eos) would train and export silently."""
    tok = doc.get("tokenizer")
    if tok is None:
        return
    if not (isinstance(tok, dict) and isinstance(tok.get("files", []), list)
            and isinstance(tok.get("sha256", {}), dict)):
        raise CheckpointError(f"{path}/meta.json: its tokenizer entry is malformed; the "
                              "checkpoint was edited")
    args = doc["meta"].get("args")
    src = args.get("init_from") if isinstance(args, dict) else None
    fix = f"copy it back from {src or 'the model directory the run started from'}"
    for name in tok.get("files", []):
        f = Path(path) / name
        if not f.exists():
            raise CheckpointError(f"{f} is missing: {Path(path).name} was saved with it (its "
                                  f"tokenizer's files); {fix}")
        want = tok.get("sha256", {}).get(name)
        if want is not None and (not f.is_file() or file_sha256(f) != want):
            raise CheckpointError(f"{f} is not the file {Path(path).name} was saved with (sha256 "
                                  f"differs): replaced or damaged; {fix}")


def _check_fields(path, doc):
    """The fields load() and train.py rely on, with their types: a meta.json edited by hand, with
    its CRC recomputed, fails here with one line instead of deep inside."""
    def bad(problem):
        raise CheckpointError(f"{path}/meta.json: {problem}; the checkpoint "
                              "was edited or is damaged")

    count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if not count(doc.get("step")):
        bad(f"step {doc.get('step')!r} is not a step count")
    if not (isinstance(doc.get("config"), dict) and isinstance(doc.get("meta"), dict)):
        bad("config or meta is not an object")
    if (doc.get("dtype"), doc.get("states")) != (
        "float32", list(STATES)) or doc.get("byteorder") not in ("little", "big"):
        bad("dtype, states or byteorder are not this format's")
    if not isinstance(doc.get("units"), list):
        bad("units is not a list")
    # a unit file is its name + .bin, inside the checkpoint: no path goes elsewhere
    for u in doc["units"]:
        if not (isinstance(u, dict) and isinstance(u.get("name"), str)
                and re.fullmatch(r"\w[\w.]*", u["name"])
                and all(count(u.get(k)) for k in ("numel", "step"))
                and _parts_ok(u, doc["version"], count)):
            bad(f"the unit entry {json.dumps(u)[:80]} is malformed")


def _parts_ok(u, version, count):
    """Version 1: one file, name.bin, the whole unit. Version 2: parts name.partR.bin that tile
    [0, numel)."""
    if version == VERSION:
        return (u.get("file") == u["name"] + ".bin" and count(u.get("bytes"))
                and count(u.get("crc32"))
                and u["bytes"] == 4 * len(STATES) * u["numel"])
    parts, at = u.get("parts"), 0
    if not (isinstance(parts, list) and parts):
        return False
    for r, p in enumerate(parts):
        if not (isinstance(p, dict) and p.get("file") == f"{u['name']}.part{r}.bin"
                and p.get("lo") == at
                and all(count(p.get(k)) for k in ("hi", "bytes", "crc32")) and p["hi"] >= at
                and p["bytes"] == 4 * len(STATES) * (p["hi"] - at)):
            return False
        at = p["hi"]
    return at == u["numel"]


def parts(unit):
    """The files of a unit entry of meta.json as [{"file", "lo", "hi", "bytes", "crc32"}]: each
    holds master | m | v of the unit's elements [lo, hi). Version 1: one part, the whole unit."""
    if "parts" in unit:
        return unit["parts"]
    return [{"file": unit["file"], "lo": 0, "hi": unit["numel"], "bytes": unit["bytes"],
             "crc32": unit["crc32"]}]


def verify_files(path, doc, crc=True, layouts=None, want=None):
    """Check that every unit file is there with its size, then (crc=True) each file's CRC-32,
    reading one chunk at a time, and that its master weights (the first floats of the file) are all
    finite: a NaN is refused naming the tensor (layouts: model.units of the config) -- it would
    train silently. want: per unit the [lo, hi) a trainer will read (its placement.part): only the
    parts overlapping it are read (sizes: all)."""
    files = [(u, Path(path) / p["file"], p) for u, unit in enumerate(doc["units"])
             for p in parts(unit)]
    for _, f_path, p in files:
        if not f_path.is_file():
            raise CheckpointError(f"{f_path} is missing; the checkpoint is incomplete")
        if (size := f_path.stat().st_size) != p["bytes"]:
            raise CheckpointError(f"{f_path} has {size:,} bytes, expected {p['bytes']:,}; it is "
                                  "truncated or damaged")
    buf = bytearray(CHUNK)
    for u, f_path, p in files if crc else []:
        a, b = _overlap(p, *want[u]) if want is not None else (0, 1)
        if a >= b:
            continue
        c, pos, bad, n_master = 0, 0, None, p["hi"] - p["lo"]
        with open(f_path, "rb") as f:
            while n := f.readinto(buf):
                c = zlib.crc32(memoryview(buf)[:n], c)
                if pos < 4 * n_master and bad is None:      # the master comes first in the file
                    chunk = torch.frombuffer(buf, dtype=torch.float32,
                                             count=min(n, 4 * n_master - pos) // 4)
                    if not all_finite(chunk):
                        bad = p["lo"] + pos // 4 + int((~torch.isfinite(chunk)).nonzero()[0])
                pos += n
        if c != p["crc32"]:
            raise CheckpointError(f"{f_path} fails its CRC-32 check; the file is damaged")
        if bad is not None:
            what = key_at(layouts[u], bad) if layouts else f"unit {doc['units'][u]['name']}"
            raise CheckpointError(f"{path}: the master weights of {what} hold a NaN or an "
                                  "infinity; refusing them")


def _overlap(part, lo, hi):
    """The elements [a, b) of [lo, hi) that `part` holds (a >= b: none)."""
    return max(lo, part["lo"]), min(hi, part["hi"])


def check_model(path, doc, cfg):
    """CheckpointError unless checkpoint `path` (doc: its read_meta) holds model cfg: same byte
    order, same config, same parameter layout. Reads nothing but meta.json: train.py asks before
    allocating a trainer."""
    if doc["byteorder"] != sys.byteorder:
        raise CheckpointError(f"{path} was written on a {doc['byteorder']}-endian machine; this "
                              f"one is {sys.byteorder}")
    here, there = cfg.to_dict(), doc["config"]
    for k in list(here) + [k for k in there if k not in here]:
        if there.get(k) != here.get(k):
            raise CheckpointError(f"{path} is for another model: {k}={there.get(k)!r} in "
                                  f"the checkpoint, {here.get(k)!r} in this run (first "
                                  "differing config field)")
    ours = [(lay.name, lay.numel) for lay in model.units(cfg)]
    theirs = [(u["name"], u["numel"]) for u in doc["units"]]
    if ours != theirs:
        a, b = next((a, b) for a, b in zip(theirs + [None], ours + [None]) if a != b)
        raise CheckpointError(f"{path} has another parameter layout: unit {a} in the checkpoint, "
                              f"{b} in this model")


def load(trainer, path, verify_first=True):
    """Load checkpoint `path` into trainer; return the meta dict given to save() plus "step".
    Raises CheckpointError, with the trainer untouched, for anything that does not match or check
    out. verify_first=False reads every byte once instead of twice (about 2x faster from a cold
    disk) and checks the CRCs on the way: a damaged file still raises CheckpointError, but the
    trainer then holds a partial state -- fine for a fresh trainer that is thrown away on error
    (train.py --resume). A sharded trainer (every rank calls it) reads its [lo, hi) of each unit
    from whichever parts hold it, at any world size it was saved at; a part it reads only a piece of
    is verified first whatever verify_first says."""
    path = Path(path)
    doc = read_meta(path)
    check_model(path, doc, trainer.cfg)
    want = [trainer.placement.part(lay) for lay in trainer.units]

    def whole(p, u):   # the part is exactly what this trainer holds
        return (p["lo"], p["hi"]) == want[u]

    def read(p, u):    # it holds some of it
        lo, hi = _overlap(p, *want[u])
        return lo < hi
    check = [want[u] if verify_first
             or any(read(p, u) and not whole(p, u) for p in parts(unit)) else (0, 0)
             for u, unit in enumerate(doc["units"])]
    verify_files(path, doc, layouts=trainer.units, want=check)     # nothing has been touched so far
    trainer.wait()
    opt = trainer.opt
    # straight into the store (from the page cache, if it fits)
    for u, unit in enumerate(doc["units"]):
        lo, hi = want[u]
        state = opt.state(u)
        for p in parts(unit):
            a, b = _overlap(p, lo, hi)
            if a >= b:
                continue
            crc, n = 0, p["hi"] - p["lo"]
            with open(path / p["file"], "rb") as f:
                for k, s in enumerate(STATES):
                    f.seek(4 * (k * n + a - p["lo"]))
                    dst = state[s][a - lo:b - lo]     # a unit resident on the GPU: through the host
                    host = dst if dst.device.type == "cpu" else \
                        torch.empty(dst.shape, dtype=dst.dtype)
                    mv = bytes_of(host)
                    if f.readinto(mv) != len(mv):
                        raise CheckpointError(f"{path / p['file']} shrank while loading; the "
                                              "trainer is now partial")
                    crc = crc if verify_first else zlib.crc32(mv, crc)
                    if host is not dst:
                        dst.copy_(host)
            if not verify_first and whole(p, u) and crc != p["crc32"]:
                raise CheckpointError(f"{path / p['file']} fails its CRC-32 check; the "
                                      "trainer is now partial")
        if not verify_first and not all_finite(state["master"][:hi - lo]):
            raise CheckpointError(f"{path}: the master weights of unit {unit['name']} hold a NaN "
                                  "or an infinity; the trainer is now partial")
        opt.set_step_count(u, unit["step"])
        opt.refresh_shadow(u)
    return {**doc["meta"], "step": doc["step"]}


# -------------------------------------------------------------------- the weights alone, no trainer
class CheckpointWeights(Mapping):
    """{key: fp32 CPU tensor} of a checkpoint's master weights, read from the unit files on every
    access (nothing is cached), like hf.HFWeights: iterates in forward order, and read_into(key,
    view) fills a store view directly."""

    def __init__(self, path, doc, layouts):
        self.path, self.parts = Path(path), [parts(unit) for unit in doc["units"]]
        self.where = {e.key: (u, e) for u, lay in enumerate(layouts) for e in lay.entries}

    def __getitem__(self, key):
        return self.read_into(key, torch.empty(self.where[key][1].shape, dtype=torch.float32))

    def read_into(self, key, out):
        """Copy tensor `key` -- elements [offset, offset + numel) of its unit's master -- into out,
        from whichever parts (one per rank that saved it) hold them. Returns out."""
        u, e = self.where[key]
        direct = out.dtype == torch.float32 and out.is_contiguous()
        flat = (out if direct else torch.empty(e.shape, dtype=torch.float32)).view(-1)
        lo, hi = e.offset, e.offset + e.numel
        for p in self.parts[u]:
            a, b = _overlap(p, lo, hi)
            if a >= b:
                continue
            with open(self.path / p["file"], "rb") as f:
                f.seek(4 * (a - p["lo"]))                # the part's master comes first in its file
                mv = bytes_of(flat[a - lo:b - lo])
                if f.readinto(mv) != len(mv):
                    raise CheckpointError(f"{self.path / p['file']} shrank while it was read; the "
                                          "checkpoint changed")
        return out if direct else out.copy_(flat.view(e.shape))

    def __contains__(self, key):  # Mapping's default would read the tensor
        return key in self.where

    def __iter__(self):
        return iter(self.where)

    def __len__(self):
        return len(self.where)


def read_weights(path, verify=True):
    """(GPTConfig, CheckpointWeights) of checkpoint `path` (one process's or sharded parts): its
    model and fp32 master weights, without a trainer. verify: first check every file's size, CRC-32
    and finite master weights, as
    load() does (CheckpointError naming what is wrong); then each tensor is read when it is asked
    for."""
    path = Path(path)
    doc = read_meta(path)
    try:
        cfg = check_config(model.GPTConfig(**doc["config"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/meta.json: its config is not a model config ({e})") from None
    check_model(path, doc, cfg)                  # byte order, and units that match the config
    layouts = model.units(cfg)
    verify_files(path, doc, crc=verify, layouts=layouts)
    return cfg, CheckpointWeights(path, doc, layouts)


# ----------------------------------------------------------------------------- RNG states for meta
def rng_state():
    """The global generators (python random, numpy, torch CPU and CUDA) as JSON-able data."""
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    py, npy = random.getstate(), np.random.get_state()
    return {"python": [py[0], list(py[1]), py[2]], "torch": b64(torch.get_rng_state()),
            "numpy": [npy[0], npy[1].tolist(), int(npy[2]), int(npy[3]), float(npy[4])],
            "cuda": [b64(s) for s in torch.cuda.get_rng_state_all()]
            if torch.cuda.is_available() else []}


def set_rng_state(state):
    """Restore what rng_state() returned (the CUDA states only where as many GPUs are present)."""
    def unb64(s):
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    np.random.set_state(
        (state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:]))
    torch.set_rng_state(unb64(state["torch"]))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if state["cuda"] and len(state["cuda"]) == gpus:
        torch.cuda.set_rng_state_all([unb64(s) for s in state["cuda"]])
