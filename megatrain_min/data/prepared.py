"""prepared.py -- a prepared directory read back: token files that a run opens in no time.

What it is
    The reading half of prepare, and the on-disk format both halves share: prepare.py writes the
    directory (`python -m megatrain_min.prepare`; encoding.py the token arrays in it) and takes the
    format from here, never the other way round. A prepared DIR holds:
        train.npy, val.npy              token ids, uint16 when the vocabulary fits, else uint32
        train.mask.npy, val.mask.npy    SFT only: bool per token, True where it is supervised
        train.examples.npy, val.examples.npy    SFT only: int64 (n, 3): start, end, first target
        meta.json                       written last: format version, tokenizer sha256 ("bytes"
                                        without --tokenizer), vocabulary size, dtype, per split the
                                        tokens, the .jsonl records (documents or examples) and the
                                        largest id, the sources with sizes and mtimes, the settings,
                                        per file its size and sha256 (digest(): whole up to
                                        DIGEST_WHOLE, else sampled)
    PreparedTokens(DIR): each file's size and digest checked against meta.json (a foreign or
    bit-rotten file is refused); the arrays read as batches ask (TokenFile: os.pread, nothing in RAM
    before, and a file truncated under a run is an error naming it, never a SIGBUS as from a memory
    map), every id read checked against the split's largest; vocab_size and tokenizer_hash,
    data.Batches over the ids, data.SFTBatches over the examples; check_model(MODEL_DIR,
    vocab_size): the same tokenizer (and chat template) as the model that will train on them;
    fingerprint(): what a checkpoint keeps of the data -- the digests of the ids, not when or from
    which paths they were prepared.
    Shared with prepare.py (and encoding.py: SPLITS, PrepareError): FORMAT and VERSION, META,
    SPLITS, PrepareError (the one error of both halves), digest, tokenizer_hash, chat_template_hash,
    read_meta (a directory without a complete meta.json of this format and version is refused).
What it is not
    No writing: prepare.py makes the directory (written aside, meta.json last, put in place whole).
    No memory map (TokenFile says why); no CRC of the token files beyond the digests above.
Reference
    nanoGPT's train.py get_batch (np.memmap over the flat uint16 ids, made anew for each batch);
    Megatron-LM's megatron/core/datasets/indexed_dataset.py (the ids beside an index of where each
    sequence and document starts).
Try it
    python -m megatrain_min.prepare data/tinyshakespeare.txt --out /tmp/shakespeare
    python -c "from megatrain_min.data import prepared as p; print(p.read_meta('/tmp/shakespeare'))"
    python train.py --data /tmp/shakespeare --steps 20     # a run reads it as batches ask
    python -m pytest tests/data/test_prepare.py
"""
import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatrain_min import data
from megatrain_min.data import publish
from megatrain_min.data.tokenizer import HFTokenizer

FORMAT, VERSION = "megatrain-min prepared tokens", 1
META = "meta.json"
DIGEST_WHOLE = 256 << 20       # files up to this size are hashed whole; larger: 64 spread-out MiB
SPLITS = ("train", "val")


class PrepareError(ValueError):
    """Input, tokenizer or output that prepare refuses, or a directory that the reader refuses. One
    line."""


def tokenizer_hash(model_dir):
    """sha256 (hex) of model_dir/tokenizer.json's bytes; "bytes" for the byte tokenizer (model_dir
    None)."""
    if model_dir is None:
        return "bytes"
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise PrepareError(f"{model_dir} has no tokenizer.json")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def chat_template_hash(template):
    """sha256 (hex) of a chat template's text, None for none: what meta.json keeps of the template
    SFT examples were rendered with (check_model compares the model's)."""
    return hashlib.sha256(template.encode()).hexdigest() if template is not None else None


def digest(path):
    """{"bytes", "sha256"} of a file: hashed whole up to DIGEST_WHOLE, else 64 spread-out 1 MiB
    blocks ("sampled": true) -- a file of other content but the same size is told apart (but for
    blocks it shares)."""
    size, h = os.stat(path).st_size, hashlib.sha256()
    with open(path, "rb") as f:
        if size <= DIGEST_WHOLE:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            for k in range(64):
                f.seek(k * (size - (1 << 20)) // 63)
                h.update(f.read(1 << 20))
    sampled = {"sampled": True} if size > DIGEST_WHOLE else {}
    return {"bytes": size, "sha256": h.hexdigest(), **sampled}


def read_meta(path):
    """DIR/meta.json of a finished prepare (format and version checked), else PrepareError."""
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PrepareError(f"{path} is not a prepared directory (no {META}; a prepare that did "
                           "not finish leaves none): run `python -m megatrain_min.prepare ... "
                           f"--out {path}`") from None
    except (OSError, ValueError) as e:
        raise PrepareError(f"{path}/{META} cannot be read ({e}); prepare the data again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PrepareError(f"{path}/{META} is not a prepared-tokens meta.json "
                           f"(no format {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise PrepareError(f"{path} has prepared-tokens format version {meta.get('version')!r}; "
                           f"this code reads version {VERSION}: prepare the data again")
    return meta


class TokenFile:
    """A 1-D array in a .npy file, read with os.pread as it is sliced (f[a:b] -> a new ndarray;
    np.asarray(f): all of it): as with a memory map nothing is in RAM before it is asked for, but a
    file truncated under a run is a PrepareError naming it, where touching a memory map past a
    file's new end kills the process (SIGBUS). top: the largest value the file may hold (meta.json's
    max_id); a larger one read is bit rot, refused."""

    def __init__(self, path, n, dtype, top=None):
        self.path, self.n, self.dtype, self.top = Path(path), n, np.dtype(dtype), top
        with open(self.path, "rb") as f:
            try:
                version = np.lib.format.read_magic(f)
                read = {(1, 0): np.lib.format.read_array_header_1_0,
                        (2, 0): np.lib.format.read_array_header_2_0}[version]
                shape, _, dt = read(f)
            except (ValueError, KeyError, OSError) as e:
                raise PrepareError(f"{self.path}: not a .npy file ({e}); prepare "
                                   "the data again") from None
            self.offset = f.tell()
        if dt != self.dtype or shape != (n,):
            raise PrepareError(f"{self.path} holds {dt} {shape}, meta.json "
                               f"says {n} of {self.dtype}")
        self.fd = os.open(self.path, os.O_RDONLY)

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)

    def __len__(self):
        return self.n

    def __getitem__(self, s):
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("a TokenFile is read in slices [a:b]")
        a, b, _ = s.indices(self.n)
        k, size = max(b - a, 0), self.dtype.itemsize
        buf = bytearray(k * size)
        got = 0
        while got < len(buf):                    # pread returns at most ~2 GB per call
            piece = os.pread(self.fd, min(len(buf) - got, 1 << 30), self.offset + a * size + got)
            if not piece:
                now = os.fstat(self.fd).st_size
                raise PrepareError(f"{self.path} shrank while this run read it ({now:,} bytes "
                                   f"now, {self.offset + self.n * size:,} when it was opened): it "
                                   f"was truncated or rewritten; prepare the data again")
            buf[got:got + len(piece)] = piece
            got += len(piece)
        ids = np.frombuffer(buf, self.dtype)
        if self.top is not None and k and int(ids.max()) > self.top:
            i = int(np.argmax(ids > self.top))
            raise PrepareError(f"{self.path} holds id {int(ids[i])} at index {a + i:,}, above the "
                               f"largest id meta.json records ({self.top}): the file is damaged; "
                               f"prepare the data again")
        return ids

    def __array__(self, dtype=None, copy=None):
        ids = self[0:self.n]
        return ids if dtype is None else ids.astype(dtype)


class PreparedTokens:
    """A prepared directory: nothing of the corpus is read into RAM until a batch asks for it.

    kind: "tokens" (pretraining) or "sft"; vocab_size: ids below it (the tokenizer's);
    tokenizer_hash: sha256 of its tokenizer.json or "bytes"; meta: all of meta.json. Refuses
    (PrepareError) a directory without a complete meta.json of this format, whose files do not have
    the sizes it records, or (verify) not the digests: a file replaced by another one of the same
    size, bit rot (sampled beyond DIGEST_WHOLE)."""

    def __init__(self, path, verify=True):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        try:
            meta, tok = self.meta, self.meta["tokenizer"]
            self.kind, self.dtype = meta["kind"], np.dtype(meta["dtype"])
            self.vocab_size, self.tokenizer_hash = tok["vocab_size"], tok["sha256"]
            kinds = {"tokens": (".npy",), "sft": (".npy", ".mask.npy", ".examples.npy")}
            want = sorted(f"{s}{x}" for s in SPLITS for x in kinds.get(self.kind, ()))
            if self.kind not in kinds or sorted(meta["files"]) != want:
                raise PrepareError(f"{self.path}/{META}: kind {self.kind!r} with files "
                                   f"{sorted(meta['files'])} is not what prepare writes (it was "
                                   f"edited); prepare the data again")
            for name, size in self.meta["files"].items():
                try:                                # a name from meta.json: here, nowhere else
                    f = publish.inside(self.path, name)
                except publish.Unsafe as e:
                    raise PrepareError(f"{e}; prepare the data again") from None
                if not f.is_file() or f.stat().st_size != size:
                    what = "missing" if not f.is_file() else "of another size than meta.json says"
                    raise PrepareError(f"{f} is {what}; the directory is damaged: prepare it again")
                sha = self.meta.get("sha256", {}).get(name)
                if verify and sha is not None and digest(f)["sha256"] != sha:
                    raise PrepareError(f"{f} is not the file prepare wrote (its sha256 "
                                       "differs from meta.json's): replaced or damaged since; "
                                       "prepare the data again")
        except (KeyError, TypeError, AttributeError) as e:
            raise PrepareError(f"{self.path}/{META} lacks {e}; prepare the data again") from None

    def _array(self, name, n, dtype, top=None):
        return TokenFile(self.path / name, n, dtype, top) if n else np.zeros((0,), dtype)

    def fingerprint(self):
        """{"bytes", "sha256"}: what a checkpoint keeps of this data (--resume compares it). The
        digests of the token files -- the ids themselves, not when or from which paths they were
        prepared (a directory from before digests were recorded: its meta.json but the time)."""
        what = self.meta.get("sha256") or {k: v for k, v in self.meta.items() if k != "seconds"}
        return {"bytes": sum(self.meta["files"].values()),
                "sha256": hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()}

    def tokens(self, split="train"):
        """The split's token ids: a TokenFile of uint16 or uint32, every id read checked against
        the split's largest."""
        s = self.meta["splits"][split]
        return self._array(f"{split}.npy", s["tokens"], self.dtype, s["max_id"])

    def supervised(self, split="train"):
        """SFT: per token, whether it is supervised (a TokenFile of bool)."""
        self._want("sft", "supervised")
        return self._array(f"{split}.mask.npy", self.meta["splits"][split]["tokens"],
                           np.dtype(bool))

    def _want(self, kind, what):
        if self.kind != kind:
            raise PrepareError(f"{self.path} holds "
                               f"{'SFT examples' if self.kind == 'sft' else 'pretraining text'}: "
                               f"{what} needs "
                               f"{'SFT examples' if kind == 'sft' else 'pretraining text'}")

    def _nonempty(self, split):
        if not self.meta["splits"][split]["tokens"]:
            raise PrepareError(f"{self.path}: the {split} split is empty (val_fraction "
                               f"{self.meta['val_fraction']}), and a run evaluates on it; prepare "
                               f"the data again with --val-fraction 0.1")

    def batches(self, split, batch_size, seq_len, seed=0):
        """data.Batches over the split's ids: random windows, exactly as over the same ids in
        memory."""
        self._want("tokens", "batches")
        self._nonempty(split)
        return data.Batches(self.tokens(split), batch_size, seq_len, seed=seed, name=split)

    def examples(self, split, seq_len):
        """The split's SFT examples as data.load_sft_jsonl gives them: Examples, a sequence of (x,
        y)."""
        self._want("sft", "examples")
        self._nonempty(split)
        n, f = self.meta["splits"][split]["examples"], self.path / f"{split}.examples.npy"
        index = np.load(f) if n else np.zeros((0, 3), np.int64)   # O(examples): read whole, once
        if index.dtype != np.int64 or index.shape != (n, 3):
            raise PrepareError(f"{f} holds {index.dtype} {index.shape}, meta.json "
                               f"says ({n}, 3) of int64")
        return Examples(self.tokens(split), self.supervised(split), index, seq_len, f"{self.path} "
                                                                                    f"{split}")

    def sft_batches(self, split, batch_size, seq_len, seed=0, pad_id=0):
        """data.SFTBatches over the split's examples: one example per row, padded."""
        return data.SFTBatches(self.examples(split, seq_len), batch_size, seq_len, seed=seed,
                               name=split,
                               pad_id=pad_id)

    def check_model(self, model_dir=None, vocab_size=None):
        """PrepareError (one line) unless a model may train on these ids: model_dir (a directory
        with the model's tokenizer.json, or None to skip this) has the tokenizer they were made with
        -- and, for SFT examples in the native format, the same chat template; vocab_size (the
        model's) exceeds every id here."""
        if model_dir is not None:
            theirs = tokenizer_hash(model_dir)
            if theirs != self.tokenizer_hash:

                def name(h):
                    return "the byte tokenizer" if h == "bytes" else \
                        f"a tokenizer.json, sha256 {h[:12]}"
                raise PrepareError(f"{self.path} was tokenized with {name(self.tokenizer_hash)}, "
                                   f"{model_dir} has {name(theirs)}; prepare it again with "
                                   f"--tokenizer {model_dir}")
            if self.kind == "sft" and self.meta["chat_format"] == "native":
                rendered = self.meta["tokenizer"]["chat_template_sha256"]
                if chat_template_hash(HFTokenizer(model_dir).chat_template) != rendered:
                    raise PrepareError(f"{self.path} was rendered with another chat template "
                                       f"than {model_dir}'s; prepare it again with "
                                       f"--tokenizer {model_dir}")
        top = max(self.meta["splits"][s]["max_id"] for s in SPLITS)
        if vocab_size is not None and top >= vocab_size:
            raise PrepareError(f"{self.path} holds token id {top}, beyond the model's vocabulary "
                               f"of {vocab_size}")


class Examples(Sequence):
    """(x, y) int32 of each SFT example with a supervised target within seq_len (data.example_xy),
    read from the files as asked for: the sequence data.load_sft_jsonl returns, for data.SFTBatches.
    The same warning for examples cut to seq_len, the same dropping of those left with no answer
    token."""

    def __init__(self, ids, supervised, index, seq_len, where):
        self.ids, self.sup, self.index, self.T = ids, supervised, index, seq_len
        # O(examples), not tokens
        first, length = np.asarray(index[:, 2]), np.asarray(index[:, 1] - index[:, 0])
        self.keep = np.flatnonzero((first >= 0) & (first < seq_len))
        cut, dropped = int((length - 1 > seq_len).sum()), len(index) - len(self.keep)
        if not len(self.keep):
            raise PrepareError(f"{where}: no example with a supervised token within "
                               f"seq_len={seq_len}")
        if cut:
            warnings.warn(f"{where}: {cut} of {len(index)} examples longer than seq_len={seq_len} "
                          f"were cut, {dropped} of them dropped (no answer token left)")

    def __len__(self):
        return len(self.keep)

    def __getitem__(self, i):
        start, end, _ = self.index[self.keep[i]]
        return data.example_xy(self.ids[start:end], np.asarray(self.sup[start:end]), self.T)
