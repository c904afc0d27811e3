"""prepare.py -- a corpus tokenized once, into token files that a run opens in no time.

What it is
    python -m megatrain_min.prepare INPUT... --out DIR [--tokenizer MODEL_DIR]
                                         [--val-fraction 0.1]
    streams text (.txt) or JSON lines (.jsonl) through a tokenizer (MODEL_DIR's tokenizer.json -- a
    Hugging Face model directory or one of our checkpoints that carries it -- else bytes) into DIR:
    token ids (uint16 when the vocabulary fits, else uint32: id_dtype), for SFT data a mask and an
    index of the examples, and meta.json last. encoding.py does the streaming: what a .txt or .jsonl
    input becomes (text line by line, "text" documents each ending in eos, SFT examples with their
    mask), memory bounded by a batch, the line limits. prepared.py lists the files, holds the
    format both halves share (META, FORMAT, digest, ...) and reads them back (PreparedTokens).
    The validation split is the tail of the input: the last floor(F * total) bytes of all inputs
    (in the order given), widened to whole lines and records -- a line goes to val when its last
    byte lies there. The same contiguous tail that data.split takes of a token array, fixed before
    anything is tokenized, so it streams. A --val-fraction that leaves it empty is refused, 0
    included (train.py evaluates on it; prepare(val_fraction=0) makes the train split alone).
    Nothing half-written is ever taken for finished: everything is written aside (publish.stage),
    fsynced, meta.json last, and put in place whole (publish.publish: a new DIR renamed into place,
    an existing one -- empty, a mount point, the working directory -- filled, never replaced); the
    reader (prepared.PreparedTokens) refuses a directory without a complete meta.json, and a rerun
    removes what a killed one left. Two prepares into one DIR at once: the second is refused (or,
    when both got past their checks, the one that finishes second replaces nothing). A rerun into a
    finished DIR does nothing when the sources, tokenizer and settings are the same (like make);
    otherwise it refuses unless --force, which replaces only a directory that prepare wrote.
What it is not
    No shuffling, deduplication or filtering; no packing of SFT examples (data.py says why). No
    tokenizing here: encoding.py. No reading back: prepared.py.
Reference
    nanoGPT's data/openwebtext/prepare.py (flat uint16 ids, np.memmap to read them); Megatron-LM's
    tools/preprocess_data.py (documents with an index, a tokenized corpus beside its metadata).
Try it
    python -m megatrain_min.prepare data/tinyshakespeare.txt --out /tmp/shakespeare   # ~1 s
    python -m pytest tests/data/test_prepare.py
    python bench/prepare_throughput.py    # against Tokenizer.encode_batch, with peak RSS of each
"""
import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from megatrain_min import data
from megatrain_min.data import encoding, publish
from megatrain_min.data.prepared import (FORMAT, META, SPLITS, VERSION, PreparedTokens,
                                         PrepareError, chat_template_hash, digest, read_meta,
                                         tokenizer_hash)
from megatrain_min.data.tokenizer import HFTokenizer


def id_dtype(n_ids):
    """The dtype of token ids below n_ids: uint16 up to 65,536 of them, else uint32; PrepareError
    beyond."""
    if n_ids <= 1 << 16:
        return np.dtype(np.uint16)
    if n_ids <= 1 << 32:
        return np.dtype(np.uint32)
    raise PrepareError(f"a vocabulary of {n_ids:,} ids does not fit uint32 token files")


def check_tokenizer_dir(model_dir, flag="--tokenizer"):
    """PrepareError (one line, what to pass instead) unless model_dir is a directory holding
    tokenizer.json: the file itself, a training run's directory (its checkpoints carry the
    tokenizer) and a directory without one are named as what they are."""
    d = Path(model_dir)
    if d.is_file():
        raise PrepareError(f"{flag} {d} is a file; pass the directory that holds it: "
                           f"{flag} {d.parent}")
    ckpts = sorted(p.parent for p in d.glob("ckpt-*/meta.json"))
    if not (d / "tokenizer.json").is_file() and ckpts:
        carried = [p for p in ckpts if (p / "tokenizer.json").is_file()]
        raise PrepareError(f"{flag} {d} is a training run's directory; pass one of its "
                           f"checkpoints, e.g. {flag} {carried[-1]}" if carried else
                           f"{flag} {d} is a training run's directory whose checkpoints carry no "
                           f"tokenizer.json (a byte-vocabulary run): prepare without {flag}")
    if not (d / "tokenizer.json").is_file():
        raise PrepareError(f"{flag} {d}: no tokenizer.json there (a directory is a tokenizer only "
                           f"when it holds one); pass a model directory or one of our checkpoints"
                           if d.is_dir() else f"{flag} {d} does not exist")


def _existing(out, given, differs, force):
    """True when out already holds this preparation (nothing to do); False when prepare may write
    it; else PrepareError. differs(meta): what differs between that meta.json's preparation and this
    one, or None."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise PrepareError(f"--out {given} exists and is not a directory; pick a "
                           "new or empty directory")
    if busy := publish.writers(out):
        raise PrepareError(f"--out {given} is being written by another prepare (pid {busy[0]}); "
                           f"wait for it to finish, or pick another --out")
    names = {p.name for p in out.iterdir() if not publish.is_staging(p)}
    if not names:
        return False
    try:                                         # ours: our meta.json, and no file it does not list
        meta = json.loads((out / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    if not (isinstance(meta, dict) and meta.get("format") == FORMAT
            and isinstance(meta.get("files"), dict)
            and names <= set(meta["files"]) | {META}):
        raise PrepareError(f"--out {given} exists and holds files that prepare did not write; "
                           "nothing there is replaced: pick a new or empty directory")
    try:                                         # the names --force would remove: inside out
        for name in meta["files"]:
            publish.inside(out, name)
    except publish.Unsafe as e:
        raise PrepareError(f"--out {given}: {e}; pick a new or empty directory") from None
    try:
        PreparedTokens(out)
        complete = True
    except PrepareError:
        complete = False
    what = differs(meta) if complete else "a damaged file or another format version"
    if what is None and not force:
        return True
    if not force:
        raise PrepareError(f"--out {given} holds an earlier preparation with {what}; pass --force "
                           "to replace it, or pick another --out")
    return False


def prepare(inputs, out, tokenizer=None, val_fraction=0.1, chat_format=None, force=False,
            progress=None):
    """Tokenize the files `inputs` into directory `out` (see the module docstring); returns its
    meta.json as a dict, with "up_to_date": True when out already held this preparation. tokenizer:
    a directory with tokenizer.json, or None for bytes. chat_format: "native", "fixed" or None
    (native when the tokenizer has a chat template), for SFT records. progress: a tqdm bar on stderr
    (None: when stderr is a terminal). Raises PrepareError (a ValueError; HFTokenizer's own for an
    unreadable tokenizer) with one line before anything is written, or while reading; OSError when
    an output cannot be written. Either way out is unchanged."""
    from tqdm import tqdm
    if str(out) == "":
        raise PrepareError("--out is an empty path; name the directory to write, e.g. --out tokens")
    # messages name out as given
    sources, given, out = encoding.sources(inputs), out, Path(out).resolve()
    if not (isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1):
        raise PrepareError(f"--val-fraction must be >= 0 and < 1, got {val_fraction}")
    if chat_format not in (None, "native", "fixed"):
        raise PrepareError(f"chat_format must be 'native', 'fixed' or None, got {chat_format!r}")
    if tokenizer is not None:
        check_tokenizer_dir(tokenizer)
    tok = HFTokenizer(tokenizer) if tokenizer is not None else data.ByteTokenizer()
    if chat_format == "native" and tok.chat_template is None:
        raise PrepareError("--chat-format native: "
                           f"{tokenizer or 'the byte tokenizer'} has no chat_template")
    n_ids = tok.vocab_size                            # ids below it (an added token may lie beyond)
    if tokenizer is not None:
        n_ids = max(n_ids, max(tok.tok.get_vocab(with_added_tokens=True).values()) + 1)
    dtype = id_dtype(n_ids)
    settings = {"version": VERSION, "sources": sources, "val_fraction": val_fraction,
                "tokenizer": {"sha256": tokenizer_hash(tokenizer), "vocab_size": n_ids,
                              "chat_template_sha256": chat_template_hash(tok.chat_template)}}
    chat_format = chat_format or ("native" if tok.chat_template is not None else "fixed")

    def differs(m):
        was, now = m.get("tokenizer", {}), settings["tokenizer"]
        return ("other sources (a file added, removed or changed "
                "since)" if m.get("sources") != sources else
                f"another tokenizer ({was.get('sha256', '?')[:12]}, now "
                f"{now['sha256'][:12]})" if was != now else
                f"val_fraction {m.get('val_fraction')} (now "
                f"{val_fraction})" if m.get("val_fraction") != val_fraction
                else f"chat format {m.get('chat_format')} (now "
                     f"{chat_format})" if m.get("kind") == "sft" and
                m.get("chat_format") != chat_format else None)

    if _existing(out, given, differs, force):
        return {**read_meta(out), "up_to_date": True}
    was = _state(out)                               # what out holds now: only that is replaced
    old = list(read_meta(out)["files"]) + [META] if was else []
    total = sum(s["bytes"] for s in sources)
    tmp, t0 = publish.stage(out), time.time()
    try:
        cut = total - int(val_fraction * total)    # the first byte of the val split
        corpus = encoding.Corpus(tmp, tok, dtype, chat_format, cut=cut)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"prepare {out.name}",
                  disable=None if progress is None else not progress, dynamic_ncols=True) as bar:
            done = corpus.run(inputs, sources, bar)
        if done["train"][1]["tokens"] == 0:
            raise PrepareError(
                "the train split is empty: the input is one line (or record), and the split is "
                "made at line ends; break the text into lines" if corpus.lines < 2 else
                f"the train split is empty: every line holds some of the last {val_fraction:.0%} "
                f"of the input bytes (--val-fraction {val_fraction}); lower --val-fraction")
        if done["val"][1]["tokens"] == 0 and val_fraction > 0:
            least = max(1 / total, 1e-4)
            raise PrepareError(
                f"the val split is empty: --val-fraction {val_fraction} of {total:,} input "
                f"bytes is {int(val_fraction * total)} bytes, less than the last line or "
                f"record, and train.py evaluates on it; pass --val-fraction {least:.2g} or "
                "more")
        files = {name: size for s in SPLITS for name, size in done[s][0].items()}
        meta = {"format": FORMAT, **settings, "kind": corpus.kind, "dtype": dtype.name,
                "chat_format": chat_format if corpus.kind == "sft" else None,
                "tokenizer_dir": str(Path(tokenizer).resolve()) if tokenizer is not None else None,
                "splits": {s: done[s][1] for s in SPLITS},
                "val_rule": "the lines/records holding the last floor(val_fraction * "
                "bytes) bytes of the inputs",
                "files": files, "sha256": {name: digest(tmp / name)["sha256"] for name in files},
                "seconds": round(time.time() - t0, 3)}
        with open(tmp / META, "w") as f:                # last: its presence means the rest is whole
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        publish.fsync_dir(tmp)
        publish.publish(tmp, out, was, _state, META, old)    # DIR appears whole or not at all
    except publish.Conflict:
        raise PrepareError(f"--out {given} was written by another prepare while this one ran; "
                           f"nothing there was replaced (this preparation is discarded)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**meta, "up_to_date": False}


def _state(out):
    """What a prepare would replace at out: None (nothing, or an empty directory), else its
    meta.json's text."""
    try:
        return (Path(out) / META).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "unreadable"


# ----------------------------------------------------------------------------- the command
def main(argv=None):
    """`python -m megatrain_min.prepare ...`: exit 0 done (or up to date), 2 bad input (one line;
    nothing written), 4 an output could not be written (nothing at --out replaced), 130 interrupted
    (nothing written)."""
    def fail(msg, code=2):
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(code)

    p = argparse.ArgumentParser(prog="python -m megatrain_min.prepare",
                                description="Tokenize text or JSON lines once into token files.")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help=".txt or .jsonl files, tokenized in this order")
    p.add_argument("--out", required=True,
                   help="the directory to write (made; refused if it holds other data)")
    p.add_argument("--tokenizer", default=None, metavar="MODEL_DIR",
                   help="a directory with tokenizer.json: a Hugging Face model or one of our "
                        "checkpoints (default: bytes, the toy presets' vocabulary of 256)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="the tail of the input bytes, in whole lines, that becomes the "
                        "val split: > 0 and < 1 (default: 0.1)")
    p.add_argument("--chat-format", choices=["native", "fixed"], default=None,
                   help="SFT records: the tokenizer's chat template (default when it has one) or "
                        "the fixed format")
    p.add_argument("--force", action="store_true",
                   help="replace --out when it holds an earlier preparation")
    p.error = fail                       # argparse's complaints: one line and exit code 2 too
    # a stdout that cannot encode a path (PYTHONIOENCODING=ascii) escapes it, as train.py's does
    # (cli.survive_closed_pipe; prepare runs without torch, which cli imports)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    a = p.parse_args(argv)
    if not 0 < a.val_fraction < 1:   # 0: prepare() makes the train split alone; no run reads it
        fail(f"--val-fraction {a.val_fraction:g}: it must be > 0 and < 1 -- the val split "
             "train.py --data evaluates on (it refuses a directory without one); e.g. 0.1")
    try:
        meta = prepare(a.inputs, a.out, a.tokenizer, a.val_fraction, a.chat_format, a.force)
    except ValueError as e:      # PrepareError, an unreadable tokenizer, a chat template that fails
        fail(str(e))
    except OSError as e:
        fail(f"could not write {a.out} "
             f"({e.strerror or e}{': ' + str(e.filename) if e.filename else ''}); nothing "
             "there was replaced", 4)
    except KeyboardInterrupt:
        fail(f"interrupted; nothing was written to {a.out}", 130)
    if meta["up_to_date"]:
        print(f"{a.out} is up to date (same sources, tokenizer and settings); nothing to do "
              "(--force redoes it)")
        return 0
    tr, va, s = meta["splits"]["train"], meta["splits"]["val"], meta["seconds"]
    n_bytes, n_tok = sum(x["bytes"] for x in meta["sources"]), tr["tokens"] + va["tokens"]
    what = f"{tr['examples'] + va['examples']:,} examples, " if meta["kind"] == "sft" else ""
    print(f"{a.out}: {tr['tokens']:,} train / {va['tokens']:,} val tokens ({meta['kind']}, "
          f"{what}{meta['dtype']}, tokenizer {meta['tokenizer']['sha256'][:12]}) from "
          f"{n_bytes / 1e6:,.1f} MB in {s:.1f} s: {n_bytes / 1e6 / max(s, 1e-9):.1f} MB/s, "
          f"{n_tok / 1e6 / max(s, 1e-9):.2f}M tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
