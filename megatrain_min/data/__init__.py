"""data/ -- tokens in, batches out: bytes, corpora, tokenizers, chat templates, token files.

The package
    this file (the byte tokenizer, text and .npy corpora, the train/val split, the samplers),
    tokenizer.py (a model directory's tokenizer.json), chat.py (its chat template, the supervised
    tokens), prepare.py + encoding.py (`python -m megatrain_min.prepare`: a corpus tokenized once),
    prepared.py (those files read back), corpus.py (what --data names, opened), publish.py (a
    directory of outputs put in place whole: a prepared corpus, an export). Not here: checkpoints
    (checkpoints/), the model's weights (hf/).
This file

    A byte-level tokenizer (vocab 256: every file is valid input, nothing to train or download), the
    shipped corpus (data/tinyshakespeare.txt, public domain), pre-tokenized .npy arrays (uint16,
    uint32 or int64, memory-mapped so a corpus larger than RAM works), a train/val split, and a
    seeded random batch sampler whose position can be saved and restored.
    The SFT section at the end: chat or prompt/completion .jsonl files with the loss on the answers
    only, and a padded batch sampler. Conversations are rendered in the model's own chat_template by
    chat.py (chat_tokens), or in a fixed format when the directory has none.
    A model directory's tokenizer.json and chat template: tokenizer.py (HFTokenizer). A corpus
    tokenized once into token files: prepare.py (`python -m megatrain_min.prepare`; the streaming
    through the tokenizer: encoding.py), read back by prepared.py. What --data names, opened:
    corpus.py.
What it is not
    No BPE training (fine-tuning uses the model directory's tokenizer.json through the `tokenizers`
    package), no multi-process loading: a pretraining batch is B random windows of T+1 tokens, which
    costs microseconds.
Try it
    python -m megatrain_min.data      # prints corpus size and one decoded batch
    python -m pytest tests/data/test_data_sft.py
"""
import json
import warnings
from pathlib import Path

import numpy as np

from megatrain_min.data.chat import chat_tokens, check_messages

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = ROOT / "data" / "tinyshakespeare.txt"
NPY_DTYPES = (np.uint16, np.uint32, np.int64)


def encode(text):
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(ids):
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_tokens(path):
    """A 1-D integer array of token ids: bytes of a text file, or the contents of a .npy file.
    Raises ValueError with a one-line reason for a missing, empty or unreadable file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist; pass --data with a .txt or .npy file")
    if path.suffix.lower() == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except Exception as e:  # a corrupt header is a user error, not a crash
            raise ValueError(f"cannot read {path} as .npy ({e})") from None
        if arr.ndim != 1 or arr.dtype.type not in NPY_DTYPES:
            raise ValueError(f"{path}: expected a 1-D uint16/uint32/int64 token array, got "
                             f"{arr.dtype} {arr.shape}")
    else:
        arr = np.fromfile(path, dtype=np.uint8)
    if arr.size == 0:
        raise ValueError(f"data file {path} is empty")
    return arr


def split(tokens, val_fraction=0.1):
    """Last val_fraction of the stream is validation (contiguous, so no window straddles both)."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]


class Batches:
    """Random windows: x = tokens[s:s+T], y = tokens[s+1:s+T+1], for B random starts s per batch."""

    def __init__(self, tokens, batch_size, seq_len, seed=0, name="train"):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{name} split has {len(tokens):,} tokens, fewer than "
                             f"seq_len+1={seq_len + 1}; use more data or a smaller --seq-len")
        self.tokens, self.B, self.T = tokens, batch_size, seq_len
        self.rng = np.random.default_rng(seed)

    def next(self):
        starts = self.rng.integers(0, len(self.tokens) - self.T, size=self.B)
        # (B, T+1): each window and the token after it
        win = np.stack([np.asarray(self.tokens[s:s + self.T + 1], dtype=np.int64) for s in starts])
        # imported here, not at the top: the prepare command (prepare.py) runs without torch
        # (1.3 s to import)
        import torch
        win = torch.from_numpy(win)
        return win[:, :-1], win[:, 1:].contiguous()  # (B, T) tokens, (B, T) targets

    def state_dict(self):
        return self.rng.bit_generator.state

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state


# ================================================================= SFT: supervised fine-tuning data
# A line of the .jsonl file is one example, in either of two shapes:
#   a conversation: {"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}
#   a raw pair:     {"prompt": "...", "completion": "..."}
# Loss only on what the model should learn to write: every assistant turn of a conversation
# (multi-turn conversations supervise all of them), or the completion; the targets of everything
# else are IGNORE.
#
# chat_format "native" (the default when the model directory has a chat_template): the conversation
# in the model's own template, token for token what transformers' apply_chat_template gives, with
# each assistant answer and its end-of-turn marker supervised (chat.py says exactly what, and how it
# is found). chat_format "fixed" (a directory without a template, the byte tokenizer): [bos] then
# per message "<|{role}|>\n" + content + <eos> (a newline without an eos); the assistant's content
# and its <eos> are supervised. Each piece is tokenized on its own, so no token straddles a mask
# boundary. A prompt/completion pair is used verbatim in both: [bos] + prompt + completion + <eos>,
# the loss on completion + <eos>; a prompt that already starts with bos (a rendered chat template)
# gets no second one, and a completion that already ends with eos no second eos.
#
# Padding, not packing: each row of a batch is one example, cut to seq_len tokens and padded after
# its end (pad tokens have IGNORE targets, and causal attention keeps them from touching the tokens
# before them). Packing several examples into a row would need a block-diagonal attention mask and
# restarted positions, which model.block does not have; without them packed examples would attend
# to each other. The price is the compute spent on padding: pick --seq-len near the long examples.
# Fixed (B, seq_len) batches keep one shape for the engine and the memory plan.
IGNORE = -100   # = model.IGNORE (data.py imports nothing of the model)


class ByteTokenizer:
    """encode/decode above with tokenizer.HFTokenizer's surface. No eos or bos: a turn ends with a
    newline instead. No chat template: conversations take the fixed format."""
    vocab_size, eos_id, bos_id, chat_template = 256, None, None, None

    def encode(self, text):
        return encode(text).tolist()

    def decode(self, ids):
        return decode(ids)


def _fixed_pieces(msgs, tok, end):
    """[(token ids, supervised)] of a conversation in the fixed format."""
    out = []
    for m in msgs:
        ours = m["role"] == "assistant"
        out += [(tok.encode(f"<|{m['role']}|>\n"), False), (tok.encode(m["content"]), ours),
                (end, ours)]
    return out


def example_tokens(obj, tok, chat_format="fixed"):
    """(ids, supervised) of one .jsonl example: int64 and bool arrays of one length. ValueError says
    what is wrong."""
    end = [tok.eos_id] if tok.eos_id is not None else tok.encode("\n")
    bos = [tok.bos_id] if tok.bos_id is not None else []
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        check_messages(obj["messages"])
        if chat_format == "native":
            return chat_tokens(tok, obj["messages"])
        pieces = [(bos, False)] + _fixed_pieces(obj["messages"], tok, end)
    elif "prompt" in obj or "completion" in obj:
        if not (isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str)):
            raise ValueError('"prompt" and "completion" must both be strings')
        prompt, completion = tok.encode(obj["prompt"]), tok.encode(obj["completion"])
        if (prompt + completion)[:1] == bos:     # already there: a rendered template starts with it
            bos = []
        if tok.eos_id is not None and completion[-1:] == end:
            end = []
        pieces = [(bos, False), (prompt, False), (completion, True), (end, True)]
    else:
        raise ValueError('expected "messages" or "prompt"/"completion", got keys '
                         f'{sorted(obj)[:5]}')
    ids = np.array([t for p, _ in pieces for t in p], dtype=np.int64)
    return ids, np.array([s for p, s in pieces for _ in p], dtype=bool)


def example_xy(ids, supervised, seq_len):
    """(x, y) int32 of one example's (ids, supervised) cut to seq_len: y[i] = ids[i+1] if
    supervised, else IGNORE."""
    ids = np.asarray(ids).astype(np.int32)
    return ids[:-1][:seq_len], np.where(supervised[1:], ids[1:], IGNORE)[:seq_len].astype(np.int32)


def load_sft_jsonl(path, tokenizer, seq_len, chat_format=None):
    """[(x, y)] per example: int32 arrays of equal length <= seq_len, y[i] = the token after x[i]
    where that token is supervised, IGNORE elsewhere. Longer examples are cut to seq_len (a warning
    counts them); an example with no supervised target left is dropped. ValueError names the line of
    a malformed one. chat_format: "native" (the tokenizer's chat_template), "fixed", or None: native
    when there is a template."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"SFT data file {path} does not exist")
    chat_format = chat_format or ("native" if tokenizer.chat_template is not None else "fixed")
    if chat_format == "native" and tokenizer.chat_template is None:
        raise ValueError("chat format native: the tokenizer has no chat_template "
                         "(use the fixed format)")
    examples, cut, dropped = [], 0, 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                 f"{e.start + 1})") from None
            if not line.strip():
                continue
            try:
                ids, sup = example_tokens(json.loads(line), tokenizer, chat_format)
            except ValueError as e:
                # json.JSONDecodeError and chat.ChatTemplateError are ValueErrors too
                raise ValueError(f"{path}:{n}: {e}") from None
            except RecursionError:
                raise ValueError(f"{path}:{n}: JSON nested too deeply to be an example") from None
            x, y = example_xy(ids, sup, seq_len)
            cut += len(ids) - 1 > seq_len
            if (y == IGNORE).all():
                dropped += 1
                continue
            examples.append((x, y))
    if not examples and cut:
        raise ValueError(f"{path}: no example with a supervised token within seq_len={seq_len}: "
                         f"every answer lies beyond it ({cut} examples cut); raise --seq-len")
    if not examples:
        raise ValueError(f"{path}: no example with a supervised token within seq_len={seq_len}")
    if cut:
        warnings.warn(f"{path}: {cut} of {len(examples) + dropped} examples longer "
                      f"than seq_len={seq_len} were cut, {dropped} of them dropped "
                      "(no answer token left)")
    return examples


def split_examples(examples, val_fraction=0.1):
    """(train, val): the last val_fraction of the examples (at least one when there are two or
    more)."""
    n_val = max(int(len(examples) * val_fraction), 1 if len(examples) > 1 else 0)
    return examples[:len(examples) - n_val], examples[len(examples) - n_val:]


class SFTBatches:
    """(B, seq_len) int64 (tokens, targets) of whole examples, padded; like Batches: next(),
    state_dict().

    Epochs: every example once per epoch, in a seeded random order. The state is the epoch's
    generator state (the order is redrawn from it) and the position in the epoch: plain JSON for
    checkpoint.py.
    """

    def __init__(self, examples, batch_size, seq_len, seed=0, name="train", pad_id=0):
        if not examples:
            raise ValueError(f"{name} split has no SFT examples; add lines to the .jsonl file")
        self.examples, self.B, self.T, self.pad = examples, batch_size, seq_len, pad_id
        self.rng = np.random.default_rng(seed)
        self._new_epoch()

    def _new_epoch(self):
        self.epoch_state = self.rng.bit_generator.state
        self.order, self.pos = self.rng.permutation(len(self.examples)), 0

    def next(self):
        import torch   # (see Batches.next)
        x = torch.full((self.B, self.T), self.pad, dtype=torch.int64)
        y = torch.full((self.B, self.T), IGNORE, dtype=torch.int64)
        for b in range(self.B):
            if self.pos == len(self.order):
                self._new_epoch()
            ex, ey = self.examples[self.order[self.pos]]
            self.pos += 1
            n = min(len(ex), self.T)
            x[b, :n], y[b, :n] = torch.from_numpy(ex[:n]), torch.from_numpy(ey[:n])
        return x, y

    def state_dict(self):
        return {"epoch_rng": self.epoch_state, "pos": self.pos}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["epoch_rng"]
        self._new_epoch()
        self.pos = state["pos"]
