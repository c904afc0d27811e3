"""ckpt_read.py -- a checkpoint on disk: its format, where a run keeps them, and reading one back,
verified, without a trainer.

What it is
    The format checkpoint.save writes (FORMAT, VERSION, SHARDED, CHUNK; "On disk" below)
    and everything that reads it:
      checkpoints(out_dir), latest(out_dir), before(path), is_checkpoint(path)
                      the finished checkpoints of a run's output directory: ckpt-STEP holding a
                      meta.json (a name alone, or a half-copied directory, is none)
      read_meta(path) meta.json with its format, version, fields and own CRC checked
      config_of(path, doc)
                      the model config it was saved with: a field added to model.GPTConfig since
                      (missing from its meta.json) takes the default
      check_model(path, doc, cfg)
                      the same byte order, config and parameter layout as model cfg (meta.json
                      alone: train.py asks before allocating a trainer)
      verify_files(path, doc)
                      every unit file there with its size, its CRC-32 (streamed a chunk at a time)
                      and finite master weights: a NaN is refused naming the tensor
    read_meta verifies the tokenizer files a checkpoint was saved with (check_tokenizer; save(...,
    tokenizer_from=MODEL_DIR) puts them there, their sha256 into meta.json): a file missing,
    replaced (another tokenizer of the same size) or damaged is a CheckpointError naming it, never
    silently another tokenizer than the one the model was trained with.
    read_weights(path) -> (cfg, weights): the fp32 master weights as a lazy mapping
    (CheckpointWeights), read tensor by tensor from the unit files (verified first, as load() does)
    without a trainer: what hf.export and --init-from need. A sharded checkpoint's parts are
    stitched back into whole tensors, whatever the world size that saved it.
What it is not
    Not the writer, nor the restore of a trainer: checkpoint.py (save, load, the RNG states) uses
    this file's format and checks. Not a Hugging Face directory (hf_load.py reads those).
Why CRC-32
    On the 2-core dev machine: zlib.crc32 3.4-4.0 GB/s, sha256 1.5 (SHA-NI), blake2b 0.8, against
    fsynced disk writes of 0.7-1.7 GB/s. A cryptographic hash would be the bottleneck of a save;
    CRC-32 catches truncated, torn and bit-flipped files (every burst up to 32 bits). It is no
    defence against tampering.
On disk
    out/ckpt-00000100/meta.json     {"format", "version", "step", "config", "states",
                                     "units": [{"name", "numel", "step", "file", "bytes", "crc32"},
                                               ...],
                                     "meta": {...}, "crc32"}
    out/ckpt-00000100/layer.0.bin   the states: master | m | v (AdamW; Lion: master | m), numel
                                    fp32 each, in the recorded byte order
    out/ckpt-00000100/tokenizer.json ...   with tokenizer_from: meta.json's "tokenizer"
                                           {"files", "config_ids"}
    sharded (version 2): units [{"name", "numel", "step",
                                 "parts": [{"file": "layer.0.part1.bin", "lo", "hi", "bytes",
                                            "crc32"}, ...]}];
                         layer.0.part1.bin = master | m | v of elements [lo, hi) of the unit
Try it
    python -m pytest tests/checkpoints/test_checkpoint.py tests/hf/test_export.py   # damaged too
"""
import dataclasses
import json
import re
import sys
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

import model
from megatrain_min.data import publish
from megatrain_min.engine.checks import all_finite, check_config
from megatrain_min.data.tokenizer import file_sha256

FORMAT, VERSION = "megatrain-min checkpoint", 1
SHARDED = 2                     # the version of a checkpoint written by N > 1 ranks: parts per unit
CHUNK = 16 << 20   # bytes per CRC/write call: big enough that Python's per-call cost vanishes


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this trainer (or saved there). The message is one
    line, for a human."""


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


def key_at(layout, i):
    """The key of the tensor that holds element i of a unit's flat buffer."""
    return next(e.key for e in layout.entries if e.offset <= i < e.offset + e.numel)


def bytes_of(t):
    """The bytes of a contiguous CPU tensor as a memoryview of its own memory (no copy)."""
    return memoryview(t.numpy()).cast("B")


def doc_crc(doc):
    """The CRC-32 that meta.json records of its own contents (doc: all of it but "crc32")."""
    return zlib.crc32(json.dumps(doc, sort_keys=True).encode())


# ----------------------------------------------------------------------------- meta.json
def read_meta(path, tokenizer=True):
    """The contents of path/meta.json with format, version and its own CRC checked (else
    CheckpointError); tokenizer: and the tokenizer files it was saved with, each there and the same
    (check_tokenizer)."""
    path = Path(path)
    if path.is_file():                        # ckpt-00000002/meta.json, say: offer its directory
        hint = f"; the checkpoint is its directory, {path.parent}" \
            if is_checkpoint(path.parent) else ""
        raise CheckpointError(f"{path} is a file, not a checkpoint directory{hint}")
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
    if doc.pop("crc32", None) != doc_crc(doc):
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
        try:                       # a name from meta.json: a file of this checkpoint, no other
            f = publish.inside(path, name)
        except publish.Unsafe as e:
            raise CheckpointError(f"{e}; the checkpoint was edited") from None
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
    states = doc.get("states")
    named = isinstance(states, list) and all(isinstance(s, str) and s.isidentifier()
                                             for s in states)
    if not named or states[:1] != ["master"] or len(set(states)) != len(states):
        bad(f"states {states!r} is not the master followed by the update rule's state")
    if doc.get("dtype") != "float32" or doc.get("byteorder") not in ("little", "big"):
        bad("dtype or byteorder are not this format's")
    if not isinstance(doc.get("units"), list):
        bad("units is not a list")
    # a unit file is its name + .bin, inside the checkpoint: no path goes elsewhere
    for u in doc["units"]:
        if not (isinstance(u, dict) and isinstance(u.get("name"), str)
                and re.fullmatch(r"\w[\w.]*", u["name"])
                and all(count(u.get(k)) for k in ("numel", "step"))
                and _parts_ok(u, doc["version"], count, len(states))):
            bad(f"the unit entry {json.dumps(u)[:80]} is malformed")


def _parts_ok(u, version, count, n_states):
    """Version 1: one file, name.bin, the whole unit. Version 2: parts name.partR.bin that tile
    [0, numel)."""
    if version == VERSION:
        return (u.get("file") == u["name"] + ".bin" and count(u.get("bytes"))
                and count(u.get("crc32"))
                and u["bytes"] == 4 * n_states * u["numel"])
    parts, at = u.get("parts"), 0
    if not (isinstance(parts, list) and parts):
        return False
    for r, p in enumerate(parts):
        if not (isinstance(p, dict) and p.get("file") == f"{u['name']}.part{r}.bin"
                and p.get("lo") == at
                and all(count(p.get(k)) for k in ("hi", "bytes", "crc32")) and p["hi"] >= at
                and p["bytes"] == 4 * n_states * (p["hi"] - at)):
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


# ----------------------------------------------------------------------------- the unit files
def verify_files(path, doc, crc=True, layouts=None, want=None):
    """Check that every unit file is there with its size, then (crc=True) each file's CRC-32,
    reading one chunk at a time, and that its master weights (the first floats of the file) are all
    finite: a NaN is refused naming the tensor (layouts: model.units of the config) -- it would
    train silently. want: per unit the [lo, hi) a trainer will read (its placement.part): only the
    parts overlapping it are read (sizes: all)."""
    files = [(u, Path(path) / p["file"], p) for u, unit in enumerate(doc["units"])
             for p in parts(unit)]
    for _, f_path, p in files:
        try:                       # a plain name (_check_fields), but a symlink may lead away
            publish.inside(path, p["file"])
        except publish.Unsafe as e:
            raise CheckpointError(f"{e}; the checkpoint was edited") from None
        if not f_path.is_file():
            raise CheckpointError(f"{f_path} is missing; the checkpoint is incomplete")
        if (size := f_path.stat().st_size) != p["bytes"]:
            raise CheckpointError(f"{f_path} has {size:,} bytes, expected {p['bytes']:,}; it is "
                                  "truncated or damaged")
    buf = bytearray(CHUNK)
    for u, f_path, p in files if crc else []:
        a, b = overlap(p, *want[u]) if want is not None else (0, 1)
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


def overlap(part, lo, hi):
    """The elements [a, b) of [lo, hi) that `part` holds (a >= b: none)."""
    return max(lo, part["lo"]), min(hi, part["hi"])


def config_of(path, doc):
    """The model config checkpoint `path` (doc: its read_meta) was saved with. A field its meta.json
    does not hold -- one added to model.GPTConfig since -- takes the dataclass default, which by the
    rule of a default computes what the model computed before the field existed. CheckpointError
    for a field this code does not have, or values that make no config."""
    there = doc["config"]
    known = {f.name for f in dataclasses.fields(model.GPTConfig)}
    unknown = [k for k in there if k not in known]
    if unknown:
        k = unknown[0]
        raise CheckpointError(f"{path} is for another model: {k}={there[k]!r} in the checkpoint, a "
                              "config field this code does not have")
    try:
        return check_config(model.GPTConfig(**there))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/meta.json: its config is not a model config ({e})") from None


def check_model(path, doc, cfg):
    """CheckpointError unless checkpoint `path` (doc: its read_meta) holds model cfg: same byte
    order, same config (config_of: a field missing from its meta.json is the default), same
    parameter layout. Reads nothing but meta.json: train.py asks before allocating a trainer."""
    if doc["byteorder"] != sys.byteorder:
        raise CheckpointError(f"{path} was written on a {doc['byteorder']}-endian machine; this "
                              f"one is {sys.byteorder}")
    here = cfg.to_dict()
    there = config_of(path, doc).to_dict()
    for k in here:
        if there[k] != here[k]:
            raise CheckpointError(f"{path} is for another model: {k}={there[k]!r} in "
                                  f"the checkpoint, {here[k]!r} in this run (first "
                                  "differing config field)")
    ours = [(lay.name, lay.numel) for lay in model.units(cfg)]
    theirs = [(u["name"], u["numel"]) for u in doc["units"]]
    if ours != theirs:
        a, b = next((a, b) for a, b in zip(theirs + [None], ours + [None]) if a != b)
        raise CheckpointError(f"{path} has another parameter layout: unit {a} in the checkpoint, "
                              f"{b} in this model")


def check_states(path, doc, states):
    """CheckpointError unless checkpoint `path` holds the tensors `states` per unit: the master and
    the state of this run's update rule (another rule's state cannot be resumed; its weights can,
    --init-from)."""
    if doc["states"] != list(states):
        was = (doc.get("meta", {}).get("args") or {}).get("optimizer") or "adamw"
        raise CheckpointError(f"{path} was saved by the {was} optimizer, whose state is "
                              f"{', '.join(doc['states'][1:]) or 'none'}; this run's keeps "
                              f"{', '.join(states[1:]) or 'none'}: resume with --optimizer {was}, "
                              f"or start from its weights with --init-from {path}")


# -------------------------------------------------------------------- the weights alone, no trainer
class CheckpointWeights(Mapping):
    """{key: fp32 CPU tensor} of a checkpoint's master weights, read from the unit files on every
    access (nothing is cached), like hf_load.HFWeights: iterates in forward order, and
    read_into(key, view) fills a store view directly."""

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
            a, b = overlap(p, lo, hi)
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
    cfg = config_of(path, doc)
    check_model(path, doc, cfg)                  # byte order, and units that match the config
    layouts = model.units(cfg)
    verify_files(path, doc, crc=verify, layouts=layouts)
    return cfg, CheckpointWeights(path, doc, layouts)
