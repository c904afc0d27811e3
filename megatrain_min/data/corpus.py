"""corpus.py -- what a run trains on: --data resolved into train and val samplers, checked before
anything runs.

What it is
    open_data(path, cfg, ...) takes what train.py's --data names and returns a Source: the train and
    val samplers (data.Batches or data.SFTBatches, or the same over a prepared directory's token
    files, read with os.pread as batches ask: prepared.TokenFile), the lines train.py prints of
    them, a fingerprint of the data (a checkpoint keeps it; --resume refuses other data), and what
    the run's closing sample needs (a prompt, the token that ends a reply, a decoder).
      None         the shipped corpus, bytes
      FILE.txt     UTF-8 text: bytes (byte presets) or the model's tokenizer; larger than RAW_LIMIT:
                   refused, naming the prepare command (a whole-file encode needs the corpus several
                   times in RAM)
      FILE.npy     token ids (uint16, uint32, int64), memory-mapped
      FILE.jsonl   SFT examples, loss on the answers only (data.py: the formats)
      DIR          made by `python -m megatrain_min.prepare` (prepare.py), read by prepared.py:
                   its files' digests verified, read as batches ask (every id checked), its
                   tokenizer, chat format and vocabulary checked against the model's and the flags
    Any other input (a .npz, a .json array, a binary file, a FIFO, a directory prepare did not make)
    is refused with one line that says what would be accepted.
What it is not
    No streaming from a hub and no mixing of corpora: one source per run.
"""
import dataclasses
import os
import stat
from pathlib import Path

import numpy as np

from megatrain_min import data
from megatrain_min.data import prepared
from megatrain_min.engine.checks import check_token_ids

RAW_LIMIT = 512 << 20        # bytes of .txt or .jsonl read whole; beyond: the prepare command
REFUSED = {".npz": "a NumPy archive (.npz) holds several arrays; save the token ids "
           "alone with np.save as .npy",
           ".json": "SFT data is JSON lines (.jsonl): one example per line; convert with jq -c "
           "'.[]' FILE > FILE.jsonl",
           ".parquet": "convert it to .jsonl or .txt, or tokenize it with python -m "
           "megatrain_min.prepare",
           ".gz": "decompress it first", ".zip": "unpack it first",
           ".pt": "save the token ids with np.save as .npy",
           ".safetensors": "that is a model's weights; pass the model with --init-from"}


@dataclasses.dataclass
class Source:
    train: object                 # .next() -> (tokens, targets); .state_dict(), .load_state_dict()
    val: object
    lines: list                   # what train.py prints about the data
    fingerprint: dict             # what a checkpoint keeps of the data (--resume compares it)
    prompt: list = None           # the ids the closing sample continues (None: no sample)
    stop: int = None              # the token that ends a reply (SFT), else None
    decode: object = None         # ids -> text
    what: str = "sample"          # "sample", or the held-out conversation's reply


def fingerprint(path):
    """{"bytes", "sha256"} of a data file (prepared.digest: whole up to prepared.DIGEST_WHOLE, else
    sampled), or of a prepared directory's ids (PreparedTokens.fingerprint: the same ids prepared
    again are the same data)."""
    path = Path(path)
    if path.is_dir():
        return prepared.PreparedTokens(path, verify=False).fingerprint()
    return prepared.digest(path)


def _check_path(path):
    """ValueError unless path is a regular file of an accepted kind or a prepared directory."""
    if not path.exists():
        raise ValueError(f"data file {path} does not exist; pass --data with a .txt, .npy or "
                         ".jsonl file, or a directory made by python -m megatrain_min.prepare")
    if path.is_dir():
        if not (path / prepared.META).is_file():
            raise ValueError(f"--data {path} is a directory without {prepared.META}: not one made "
                             "by python -m megatrain_min.prepare (or that preparation did not "
                             "finish); pass a file, or prepare the directory")
        return
    if not stat.S_ISREG(path.stat().st_mode):
        raise ValueError(f"--data {path} is not a regular file (a FIFO or a device?); pass a .txt, "
                         ".npy or .jsonl file")
    suffix = path.suffix.lower()
    if suffix in REFUSED:
        raise ValueError(f"--data {path}: {REFUSED[suffix]}")
    if suffix != ".npy":   # text, read whole
        if path.stat().st_size > RAW_LIMIT:
            raise ValueError(f"--data {path} is {path.stat().st_size / 1e9:.1f} GB; text this "
                             "large is tokenized once into token files: python -m "
                             f"megatrain_min.prepare {path} --out DIR [--tokenizer "
                             "MODEL_DIR], then --data DIR")
    if not os.access(path, os.R_OK):
        raise ValueError(f"--data {path} is not readable by this user (permission denied)")


def _utf8(path):
    """The file's text; ValueError naming the first byte that is not UTF-8."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
        raise ValueError(f"--data {path} is not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                         f"{e.start:,}{': a UTF-16 file' if utf16 else ''}); convert it, e.g. "
                         f"iconv -f {'UTF-16' if utf16 else 'LATIN1'} -t UTF-8 {path.name} > "
                         f"{path.stem}.utf8.txt") from None


def _held_out_prompt(examples):
    """(prompt ids, stop id) of the first held-out example: its ids up to its first supervised
    token, and the last token of that first answer (the end-of-turn marker chat.py supervises, or
    eos)."""
    x, y = examples[0]
    sup = np.flatnonzero(np.asarray(y) != data.IGNORE)
    if not len(sup):
        return None, None
    end = sup[0]
    while end + 1 < len(y) and y[end + 1] != data.IGNORE:
        end += 1
    return [int(t) for t in x[:sup[0] + 1]], int(y[end])


def _asked_prompt(text, tok, chat_format):
    """(prompt ids, stop id) of --sample-prompt TEXT as a user turn in the chat format, the answer
    to follow."""
    ids, sup = data.example_tokens({"messages": [{"role": "user", "content": text},
                                                 {"role": "assistant", "content": "."}]}, tok,
                                   chat_format)
    first = int(np.flatnonzero(sup)[0])
    last = first
    while last + 1 < len(sup) and sup[last + 1]:
        last += 1
    return [int(t) for t in ids[:first]], int(ids[last])


def open_data(path, cfg, batch_size, seq_len, seed=0, tokenizer=None, source=None, chat_format=None,
              needs_tokenizer=False, sample_prompt=None):
    """The Source of a run on `path` (None: the shipped corpus) for model cfg. tokenizer: the model
    directory's (HFTokenizer, `source` names the directory) or None for bytes; needs_tokenizer: the
    model is not a byte model, so text needs its tokenizer. chat_format: SFT conversations
    ("native", "fixed", None: native when there is a chat template). sample_prompt: the text the
    closing sample answers (SFT) or continues. ValueError with one line for anything that cannot
    train."""
    path = Path(path or data.DEFAULT_DATA)
    try:
        _check_path(path)
        if path.is_dir():
            return _prepared(path, cfg, batch_size, seq_len, seed, tokenizer, source, sample_prompt,
                             chat_format)
        suffix = path.suffix.lower()
        if needs_tokenizer and tokenizer is None and suffix != ".npy":
            raise ValueError(f"{source} has no tokenizer.json, and {path.name} needs the model's "
                             "own tokenizer (bytes are token ids only for the byte-vocabulary "
                             "presets); add it, or pass --data tokens.npy")
        tok = tokenizer or data.ByteTokenizer()
        seeds, lines = (seed, 10_000 + seed), []
        decode = tok.decode if tokenizer is not None or cfg.vocab_size == 256 else None
        # SFT: loss only on assistant / completion tokens, one example per row
        if suffix == ".jsonl":
            where = source if tokenizer is not None else "the byte tokenizer"
            asked, chat_format = chat_format, chat_format or ("native"
                                                              if tok.chat_template else "fixed")
            if chat_format == "native" and not tok.chat_template:
                raise ValueError(f"--chat-format native: {where} has no chat_template; use "
                                 "--chat-format fixed")
            end = "eos" if tok.eos_id is not None else "newline"
            lines.append("chat format: native (the chat_template of "
                         f"{where})" if chat_format == "native" else
                         f"chat format: fixed ('<|role|>\\n' + content + {end} per message; "
                         f"{'asked for' if asked else f'{where} has no chat_template'})")
            train, val = data.split_examples(data.load_sft_jsonl(path, tok, seq_len, chat_format))
            _check_ids(np.concatenate([x for x, _ in train + val]), cfg, path, tokenizer, source)
            samplers = [data.SFTBatches(ex, batch_size, seq_len, seed=s, name=n)
                        for ex, s, n in ((train, seeds[0], "train"), (val, seeds[1], "val"))]
            lines.append(f"data {path}: {len(train):,} train / {len(val):,} val examples")
            prompt, stop = (_asked_prompt(sample_prompt, tok, chat_format)
                            if sample_prompt is not None else
                            _held_out_prompt(val))
            return Source(*samplers, lines, fingerprint(path), prompt, stop, decode,
                          "reply to --sample-prompt" if sample_prompt is not None else
                          "reply to the first held-out conversation")
        if suffix == ".npy":
            tokens = data.load_tokens(path)
        else:
            text = _utf8(path)
            tokens = (np.array(tokenizer.encode(text), dtype=np.int64) if tokenizer is not None else
                      np.frombuffer(text.encode("utf-8"), dtype=np.uint8))
        _check_ids(tokens, cfg, path, tokenizer, source)
        train, val = data.split(tokens)
        samplers = [data.Batches(t, batch_size, seq_len, seed=s, name=n)
                    for t, s, n in ((train, seeds[0], "train"), (val, seeds[1], "val"))]
        lines.append(f"data {path}: {len(train):,} train / {len(val):,} val tokens")
        return Source(*samplers, lines, fingerprint(path), _text_prompt(tok, sample_prompt), None,
                      decode)
    except PermissionError as e:
        raise ValueError(f"--data {path}: cannot read {e.filename or path} "
                         "(permission denied)") from None
    except OSError as e:
        raise ValueError(f"--data {path}: cannot read {e.filename or 'it'} "
                         f"({e.strerror or e})") from None


def _check_ids(ids, cfg, path, tokenizer, source):
    """Every id below the model's vocab_size; when not, and the tokenizer is larger than the model,
    say so."""
    try:
        check_token_ids(ids, cfg.vocab_size, f"data {path}")     # one pass each for min and max
    except ValueError:
        if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"{source}/tokenizer.json has {tokenizer.vocab_size:,} tokens, more "
                             f"than the model's vocab_size {cfg.vocab_size:,}, and {path.name} "
                             "uses ids beyond it: the tokenizer is another model's") from None
        raise


def _text_prompt(tok, text):
    """What a pretraining sample continues: --sample-prompt's ids, else bos or a newline."""
    if text is not None:
        return tok.encode(text)
    return [tok.bos_id] if tok.bos_id is not None else tok.encode("\n")


def _prepared(path, cfg, batch_size, seq_len, seed, tokenizer, source, sample_prompt, chat_format):
    """A Source over a prepared directory: its tokenizer is the model's (or both are bytes), its ids
    fit, its chat format is the one asked for (it was fixed when it was prepared)."""
    try:
        d = prepared.PreparedTokens(path)
        if tokenizer is None and d.tokenizer_hash != "bytes":
            made = d.meta.get("tokenizer_dir") or "MODEL_DIR"
            raise ValueError(f"{path} was tokenized with a model's tokenizer.json ({made}); "
                             f"train that model (--init-from {made}), or prepare the data "
                             "again without --tokenizer")
        d.check_model(source if tokenizer is not None else None, cfg.vocab_size)
        if chat_format is not None and chat_format != d.meta["chat_format"]:
            raise ValueError(
                f"--chat-format {chat_format}: {path} holds pretraining text, not conversations; "
                f"drop --chat-format" if d.kind != "sft" else
                f"--chat-format {chat_format}: {path} was prepared in the {d.meta['chat_format']} "
                f"format (fixed when it is prepared); drop --chat-format, or prepare the data "
                f"again with --chat-format {chat_format}")
        tok = tokenizer or data.ByteTokenizer()
        decode = tok.decode if tokenizer is not None or cfg.vocab_size == 256 else None
        seeds = (seed, 10_000 + seed)
        if d.kind == "sft":
            train, val = (d.sft_batches(s, batch_size, seq_len, seed=k)
                          for s, k in zip(prepared.SPLITS, seeds))
            lines = [f"data {path}: prepared SFT examples, {len(train.examples):,} train / "
                     f"{len(val.examples):,} val (read as batches ask)"]
            prompt, stop = (_asked_prompt(sample_prompt, tok, d.meta["chat_format"])
                            if sample_prompt is not None
                            else _held_out_prompt(val.examples))
            return Source(train, val, lines, d.fingerprint(), prompt, stop, decode, "reply")
        train, val = (d.batches(s, batch_size, seq_len, seed=k)
                      for s, k in zip(prepared.SPLITS, seeds))
        lines = [f"data {path}: prepared, {len(train.tokens):,} train / {len(val.tokens):,} val "
                 "tokens (read as batches ask)"]
        prompt = _text_prompt(tok, sample_prompt)
        return Source(train, val, lines, d.fingerprint(), prompt, None, decode)
    except prepared.PrepareError as e:
        raise ValueError(str(e)) from None
