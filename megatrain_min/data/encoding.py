"""encoding.py -- text and JSON lines through a tokenizer into token files, a batch at a time.

What it is
    The tokenizing half of the prepare command (prepare.py checks, splits and publishes; prepared.py
    holds the format and reads it back). sources(INPUTS): each input a readable, non-empty .txt or
    .jsonl file, with its size and mtime (an input that changes while it is read is refused).
    Corpus(DIR, tokenizer, dtype, chat_format, cut).run(INPUTS, sources, bar) reads the inputs in
    the order given and appends the ids of the lines and records before byte `cut` of all inputs to
    DIR/train.npy, the rest to val.npy (for SFT data also *.mask.npy and *.examples.npy): .npy
    files written front to back, the header's shape filled in and the file fsynced at the end.
    It returns per split the files' sizes and the counts that meta.json keeps.
    What an input becomes:
    * .txt: the text line by line -- each line with its newline encoded on its own, the ids
      concatenated, as transformers' run_clm.py does with keep_linebreaks. A tokenizer that merges
      across a line end (Llama 3 makes one token of "\\n\\n") gives a few other ids there than one
      encode() of the whole file would. Nothing is put between files.
    * .jsonl lines {"text": ...}: one document per line, encoded whole, then eos (a newline for a
      tokenizer without one, as data.example_tokens ends a turn): documents never run together.
    * .jsonl lines {"messages": [...]} or {"prompt", "completion"} (whatever else they hold, "text"
      too): SFT examples through data.example_tokens -- the model's own chat template (chat.py) and
      its supervised mask, what data.load_sft_jsonl trains on -- stored one after the other with
      their boundaries, so that each batch row holds one example (SFTBatches). One directory holds
      one kind: mixing them is refused.
    Memory is bounded by a batch, never by the corpus: input is read BATCH_BYTES at a time cut at a
    line end, encoded by the tokenizers package's encode_batch on all usable cores
    (RAYON_NUM_THREADS = the CPUs this process may run on), and appended to the output files. A
    line (or record) is one sequence, which costs the tokenizers package ~200 bytes of memory per
    byte of it (measured: 1.6 GB for 8 MiB): a line is at most TOKENIZED_LINE_MAX through a
    tokenizer (LINE_MAX as bytes). Measured: bench/prepare_throughput.py, bench/NOTES.md.
What it is not
    Not the command: the val rule (which byte is `cut`), the checks of the tokenizer and of --out,
    meta.json and putting DIR in place are prepare.py's. SFT examples are rendered one at a time in
    Python (a chat template is a jinja program); text goes through encode_batch. No shuffling,
    deduplication or packing.
Reference
    transformers' examples/pytorch/language-modeling/run_clm.py (text line by line,
    keep_linebreaks); Megatron-LM's tools/preprocess_data.py (documents encoded in batches by worker
    processes, an end-of-document token); the tokenizers package's Tokenizer.encode_batch.
Try it
    python -m megatrain_min.prepare data/tinyshakespeare.txt --out /tmp/shakespeare   # runs it
    python -m pytest tests/data/test_prepare.py
    python bench/prepare_throughput.py    # against Tokenizer.encode_batch, with peak RSS of each
"""
import json
import os
import time
from itertools import chain
from pathlib import Path

import numpy as np

from megatrain_min import data
from megatrain_min.data.prepared import SPLITS, PrepareError

# input per encode_batch call: ~1M tokens, ~100 MB of the package's Encodings in flight
BATCH_BYTES = 4 << 20
# a line is never cut: a longer one would make a batch that large, and is refused
LINE_MAX = 64 << 20
TOKENIZED_LINE_MAX = 8 << 20   # ... through a tokenizer: ~200 B of memory per byte of a sequence


class _Npy:
    """A .npy file written front to back: the header of an empty array first, rows appended, the
    real shape written over it at the end (numpy leaves room in the header for the length to grow:
    its size stays)."""

    def __init__(self, path, dtype, row=()):
        self.f, self.dtype, self.row, self.n = open(path, "wb",
                                                    buffering=1 << 20), np.dtype(dtype), row, 0
        self._header()
        self.start = self.f.tell()

    def _header(self):
        np.lib.format.write_array_header_1_0(self.f,
                                             {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                              "fortran_order": False,
                                              "shape": (self.n, *self.row)})

    def append(self, a):
        a = np.ascontiguousarray(a, dtype=self.dtype)
        self.f.write(memoryview(a.reshape(-1).view(np.uint8)))
        self.n += len(a)

    def close(self):
        """Final header, fsync, close; returns the file's size in bytes."""
        end = self.f.tell()
        self.f.seek(0)
        self._header()
        assert self.f.tell() == self.start, "the .npy header changed size"
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return end


class _Split:
    """The files of one split in the temporary directory: ids, and for SFT data the mask and the
    example index."""

    def __init__(self, d, name, dtype, sft):
        self.ids = _Npy(d / f"{name}.npy", dtype)
        self.mask = _Npy(d / f"{name}.mask.npy", bool) if sft else None
        self.index = _Npy(d / f"{name}.examples.npy", np.int64, (3,)) if sft else None
        self.name, self.limit = name, np.iinfo(dtype).max
        self.max_id, self.examples, self.supervised = -1, 0, 0

    def add_tokens(self, ids, documents=0):
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))
            # the tokenizer made an id beyond the vocabulary it declared
            if self.max_id > self.limit:
                raise PrepareError(f"token id {self.max_id} does not fit {self.ids.dtype}; the "
                                   "tokenizer's vocabulary size understates its ids")
        self.ids.append(ids)
        self.examples += documents

    def add_example(self, ids, supervised):
        """One SFT example: its ids, its mask, and (start, end, first target) -- the first i with
        supervised[i + 1], the position of its first supervised target in data.example_xy's y, or
        -1."""
        start, targets = self.ids.n, np.flatnonzero(supervised[1:])
        self.add_tokens(ids, documents=1)
        self.mask.append(supervised)
        self.index.append(np.array([[start, self.ids.n, targets[0] if len(targets) else -1]]))
        self.supervised += int(supervised.sum())

    def close(self):
        files = {f"{self.name}.npy": self.ids.close()}
        if self.mask is not None:
            files.update({f"{self.name}.mask.npy": self.mask.close(),
                          f"{self.name}.examples.npy": self.index.close()})
        stats = {"tokens": self.ids.n, "examples": self.examples, "max_id": self.max_id}
        return files, stats if self.mask is None else {**stats, "supervised": self.supervised}



def sources(inputs):
    """[{"path", "bytes", "mtime_ns"}] of the inputs, each a readable non-empty .txt or .jsonl
    file."""
    out = []
    for name in inputs:
        p = Path(name)
        if p.is_dir():
            raise PrepareError(f"{p} is a directory; pass the files in it, e.g. {p / '*.txt'}")
        if p.suffix not in (".txt", ".jsonl"):
            raise PrepareError(f"{p}: expected a .txt (text) or .jsonl (one JSON "
                               "object per line) file")
        if not p.is_file():
            raise PrepareError(f"{p} {'is not a file' if p.exists() else 'does not exist'}")
        try:
            open(p, "rb").close()
        except OSError as e:
            raise PrepareError(f"{p}: cannot read it ({e.strerror})") from None
        st = p.stat()
        if st.st_size == 0:
            raise PrepareError(f"{p} is empty")
        out.append({"path": str(p.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def _chunks(path, line_max=LINE_MAX):
    """(offset, bytes) of the file in pieces of about BATCH_BYTES, each ending at a line end (or the
    file's end); a line longer than line_max (> BATCH_BYTES) is refused. A read error is a
    PrepareError (an error of the caller's, between the pieces, is not caught here)."""
    def read(f):
        try:
            return f.read(BATCH_BYTES)
        except OSError as e:
            raise PrepareError(f"{path}: cannot read it ({e.strerror})") from None

    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise PrepareError(f"{path} was moved or deleted while the inputs were being prepared; put "
                           f"it back (or leave it out), then run again") from None
    with f:
        rest, at = b"", 0
        while block := read(f):
            buf = rest + block
            end = buf.rfind(b"\n") + 1
            first = buf.find(b"\n") + 1 or len(buf)  # only the first line can outgrow a block
            if first > line_max:
                why = ("a line is encoded as one sequence, ~200 bytes of memory per byte"
                       if line_max < LINE_MAX else "text is read line by line")
                raise PrepareError(f"{path}: a line of more than {line_max >> 20} MiB at byte "
                                   f"{at:,} ({why}); break it into lines (or records) of at most "
                                   f"{line_max >> 20} MiB")
            if end:
                yield at, buf[:end]
                at, rest = at + end, buf[end:]
            else:
                rest = buf
        if rest:
            yield at, rest


def _decode(piece, path, line, at):
    """piece as text, or PrepareError naming the line and byte of the first byte that is not
    UTF-8."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError as e:
        n = line + piece.count(b"\n", 0, e.start) + 1
        raise PrepareError(f"{path}:{n}: not UTF-8 text (byte {piece[e.start]:#04x} at offset "
                           f"{at + e.start:,}); convert the file to UTF-8 (nothing is "
                           "replaced silently)") from None


class Corpus:
    """The loop over the inputs: kind ("tokens" or "sft", fixed by the first record), the two
    splits, the cut."""

    def __init__(self, tmp, tok, dtype, chat_format, cut):
        self.tmp, self.tok, self.dtype = tmp, tok, dtype
        self.chat_format, self.cut = chat_format, cut
        self.t0, self.lines = time.time(), 0
        # the tokenizers package runs encode_batch on a thread pool sized when it is first used
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        os.environ.setdefault("RAYON_NUM_THREADS", str(cpus))
        self.kind, self.first, self.splits = None, None, None
        # after each "text" document
        self.end = [tok.eos_id] if tok.eos_id is not None else tok.encode("\n")
        # the same ids, no offsets
        fast = getattr(getattr(tok, "tok", None), "encode_batch_fast", None)
        self.encode_batch = fast or getattr(getattr(tok, "tok", None), "encode_batch", None)
        self.line_max = LINE_MAX if self.encode_batch is None else TOKENIZED_LINE_MAX

    def _split(self, kind, where):
        if self.kind is None:
            self.kind, self.first = kind, where
            self.splits = {s: _Split(self.tmp, s, self.dtype, kind == "sft") for s in SPLITS}
        elif kind != self.kind:
            what = {"tokens": "pretraining text", "sft": "SFT examples"}
            raise PrepareError(f"{where}: {what[kind]} in a corpus of {what[self.kind]} (from "
                               f"{self.first}); prepare them into separate directories")
        return self.splits

    def _encode(self, texts, end=()):
        """Token ids (int64) of texts, each followed by `end`: encode_batch on all cores, or
        bytes."""
        if self.encode_batch is None:                                  # the byte tokenizer
            return np.frombuffer(b"".join(t.encode() + bytes(end) for t in texts), dtype=np.uint8)
        encs = self.encode_batch(texts, add_special_tokens=False)
        ids = chain.from_iterable(
            chain(e.ids, end) for e in encs) if end else chain.from_iterable(e.ids for e in encs)
        return np.fromiter(ids, dtype=np.int64, count=sum(map(len, encs)) + len(end) * len(encs))

    def add(self, path, start, piece, line, split):
        """Tokenize piece (whole lines of path, from byte `start`, after `line` lines) into
        split."""
        text = _decode(piece, path, line, start)
        if path.suffix == ".txt":
            splits = self._split("tokens", f"{path}:{line + 1}")
            if self.encode_batch is None:                              # bytes are their own ids
                splits[split].add_tokens(np.frombuffer(piece, dtype=np.uint8))
            else:
                lines = text.split("\n")
                lines = [s + "\n" for s in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
                splits[split].add_tokens(self._encode(lines))
            return
        docs = []
        for n, record in enumerate(text.split("\n"), line + 1):
            if not record.strip():
                continue
            try:
                obj = json.loads(record)
                if isinstance(obj, dict) and not (
                    {"messages", "prompt", "completion"} & set(obj)) and "text" in obj:
                    if not isinstance(obj["text"], str):
                        raise ValueError('"text" must be a string, got '
                                         f'{type(obj["text"]).__name__}')
                    self._split("tokens", f"{path}:{n}")
                    docs.append(obj["text"])
                else:
                    ids, supervised = data.example_tokens(obj, self.tok, self.chat_format)
                    self._split("sft", f"{path}:{n}")[split].add_example(ids, supervised)
            except PrepareError:
                raise
            except ValueError as e:
                # JSON, a malformed example, a chat template that fails: one line
                raise PrepareError(f"{path}:{n}: "
                                   f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
        if docs:
            self.splits[split].add_tokens(self._encode(docs, self.end), documents=len(docs))

    def run(self, inputs, sources, bar):
        """Tokenize the files `inputs` (sources: what sources() found them to be) into the two
        splits, bar (tqdm) following the bytes read; returns {split: (its files' sizes, its
        counts)}."""
        base = 0
        for path, src in zip(map(Path, inputs), sources):     # messages name a file as it was given
            line = 0
            for at, chunk in _chunks(path, self.line_max):
                # the split point: lines whose last byte lies before self.cut go to train, the rest
                # to val
                lo = base + at
                p = (len(chunk) if lo + len(chunk) <= self.cut else 0 if lo >= self.cut
                     else chunk.rfind(b"\n", 0, self.cut - lo) + 1)
                for split, a, b in (("train", 0, p), ("val", p, len(chunk))):
                    if b > a:
                        self.add(path, lo + a, chunk[a:b], line + chunk.count(b"\n", 0, a), split)
                line += chunk.count(b"\n") + (not chunk.endswith(b"\n"))
                bar.update(len(chunk))
                n_tok = sum(s.ids.n for s in (self.splits or {}).values())
                bar.set_postfix_str(f"{n_tok / max(time.time() - self.t0, 1e-9) / 1e6:.2f}M "
                                    "tokens/s", refresh=False)
            try:
                st = path.stat()
            except FileNotFoundError:
                raise PrepareError(f"{path} was moved or deleted while it was being prepared; put "
                                   f"it back, then run again") from None
            if (st.st_size, st.st_mtime_ns) != (src["bytes"], src["mtime_ns"]):
                raise PrepareError(f"{path} changed while it was being prepared; run "
                                   "again when it is written")
            base, self.lines = base + src["bytes"], self.lines + line
        if self.kind is None:
            raise PrepareError(f"{', '.join(map(str, inputs))}: no records, only blank lines")
        return {s: self.splits[s].close() for s in SPLITS}
