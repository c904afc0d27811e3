"""checkpoint.py -- save and resume training: streamed from the host store, atomic, verified.

What it is
    save() writes what stream.Trainer keeps in host memory: per unit (embedding, each layer, head)
    one file holding the fp32 master and the update rule's state (AdamW: m, v), taken straight from
    the store's own tensors in 16 MiB chunks with a CRC-32 computed on the way -- no second copy of
    the model is ever made.
    meta.json holds the format version, the config, the step, each unit's Adam step count, file
    sizes and CRCs, and the caller's dict (schedule position, rng_state(), the data sampler's
    state). All of it goes into a hidden .tmp-* directory, is fsynced, and is renamed into place: a
    crash at any moment leaves every earlier checkpoint whole. load() checks everything (format
    version, config, layout, every file's size and CRC, streamed a chunk at a time) before it
    touches the trainer, then reads straight into the store.
    save(..., tokenizer_from=MODEL_DIR) puts the model's tokenizer files beside the units
    (tokenizer.TOKENIZER_FILES, and its config.json's bos/eos/pad ids and each file's sha256 into
    meta.json): the checkpoint is then a tokenizer source itself (tokenizer.HFTokenizer(ckpt)) and
    `python -m megatrain_min.hf export` takes them along; ckpt_read.read_meta verifies them.
    The format (on disk, why CRC-32) and every read that needs no trainer -- finding a run's
    checkpoints (latest), meta.json, the files' checks, read_weights -- live in ckpt_read.py.
Sharded (megatrain_min/engine/sharded.py: N ranks, each holding [lo, hi) of every unit)
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
    run's (a symbolic link: the link, never what it leads to), and a step saved again replaces only
    its own run's checkpoint. Debris of a killed save is
    removed only when the process that wrote it is gone. One run per directory: runlock.py.
What it is not
    Not torch.save of a state dict (pickle: a second copy of the model in memory, and loading runs
    code); not a Hugging Face export (hf.py: weights only). Gradients and the bf16 shadow are not
    saved -- they do not outlive a step, or are rebuilt from the master -- so a bf16 run can resume
    in fp32 and vice versa.
Try it
    python -m pytest tests/checkpoints/test_checkpoint.py
    python bench/checkpoint_io.py   # save/load GB/s of a ~1B-param store vs the raw disk
"""
import base64
import json
import os
import random
import shutil
import sys
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatrain_min.engine.checks import all_finite
from megatrain_min.checkpoints.ckpt_read import (CHUNK, FORMAT, SHARDED, VERSION, CheckpointError,
                                                 bytes_of, check_model, check_states, checkpoints,
                                                 doc_crc, key_at, overlap, parts, read_meta,
                                                 verify_files)
from megatrain_min.data.publish import alive, fsync_dir
from megatrain_min.data.tokenizer import copy_tokenizer_files


class NonFiniteError(CheckpointError):
    """The master weights hold a NaN or an infinity: such a checkpoint is never written."""


class SaveError(OSError):
    """A checkpoint could not be written (disk full, file too large, no permission, ...). The
    temporary directory is removed and every earlier checkpoint is whole. The message is one
    line."""


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
                # the master and the rule's state (a unit resident on the GPU: D2H first)
                tensors = [t[:hi - lo].cpu() for t in opt.tensors(u).values()]
                f, crc = _write(tmp / name, tensors, lay, lo)
                synced.append(flusher.submit(_fsync_close, f))
                units.append({"name": lay.name, "numel": lay.numel, "step": int(opt.steps[u]),
                              "file": name, "lo": lo, "hi": hi,
                              "bytes": 4 * len(tensors) * (hi - lo), "crc32": crc})
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
                   "states": list(opt.tensors(0)), "units": units, "meta": meta}
            # {"files", "config_ids"}: written before meta.json, renamed with it
            if tokenizer_from is not None:
                doc["tokenizer"] = copy_tokenizer_files(tokenizer_from, tmp)
            f = open(tmp / "meta.json", "w")
            json.dump({**doc, "crc32": doc_crc(doc)}, f, indent=1)
            _fsync_close(f)
            fsync_dir(tmp)
            if final.exists():                  # the same step saved again: the new one replaces it
                _remove(final)
            os.rename(tmp, final)              # atomic: the checkpoint appears whole, or not at all
            fsync_dir(out)
            error = None
        except BaseException as e:
            error = _failed(e, final, tmp)
    _agree(trainer, error if lead else None)
    if keep and lead:
        mine = [p for _, p in checkpoints(out) if _run_of(p) == meta.get("run")]
        for old in mine[:-keep]:
            link = os.readlink(old) if old.is_symlink() else None
            try:
                _remove(old)
            except OSError as e:                # the new checkpoint is whole; an old one just stays
                warnings.warn(f"could not delete the old checkpoint {old}: {e}")
            if link is not None and not old.is_symlink():
                warnings.warn(f"--keep: the old checkpoint {old} was a symbolic link: the link is "
                              f"removed, {link} (what it leads to) is left as it is")
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


def _fsync_close(f):
    f.flush()
    os.fsync(f.fileno())
    f.close()


def _remove(path):
    """Delete a checkpoint, renaming it to .tmp-* first so a half-deleted one never looks like a
    checkpoint. A symbolic link (a checkpoint moved to another disk, say) is unlinked, never
    followed: what it leads to is not in --out, and stays."""
    if path.is_symlink():
        os.unlink(path)
        return
    doomed = path.with_name(f".tmp-del-{path.name}-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed)


# ----------------------------------------------------------------------------- load
def load(trainer, path, verify_first=True, weights_only=False):
    """Load checkpoint `path` into trainer; return the meta dict given to save() plus "step".
    Raises CheckpointError, with the trainer untouched, for anything that does not match or check
    out. verify_first=False reads every byte once instead of twice (about 2x faster from a cold
    disk) and checks the CRCs on the way: a damaged file still raises CheckpointError, but the
    trainer then holds a partial state -- fine for a fresh trainer that is thrown away on error
    (train.py --resume). A sharded trainer (every rank calls it) reads its [lo, hi) of each unit
    from whichever parts hold it, at any world size it was saved at; a part it reads only a piece of
    is verified first whatever verify_first says. weights_only: the master weights alone (train.py
    --init-from: whichever update rule saved the rest); the trainer's state and step counts stay."""
    path = Path(path)
    doc = read_meta(path)
    check_model(path, doc, trainer.cfg)
    if not weights_only:
        check_states(path, doc, trainer.opt.tensors(0))
    want = [trainer.placement.part(lay) for lay in trainer.units]

    def whole(p, u):   # the part is exactly what this trainer holds
        return (p["lo"], p["hi"]) == want[u]

    def read(p, u):    # it holds some of it
        lo, hi = overlap(p, *want[u])
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
        state = opt.tensors(u)
        for p in parts(unit):
            a, b = overlap(p, lo, hi)
            if a >= b:
                continue
            crc, n = 0, p["hi"] - p["lo"]
            with open(path / p["file"], "rb") as f:
                for k, s in enumerate(doc["states"][:1] if weights_only else doc["states"]):
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
        if not weights_only:
            opt.steps[u].fill_(unit["step"])
        opt.refresh_shadow(u)
    trainer.lanes.synchronize()   # what was written on the GPU (default stream): before any lane
    return {**doc["meta"], "step": doc["step"]}


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
