"""data.py -- tokens in, batches out.

What it is
    A byte-level tokenizer (vocab 256: every file is valid input, nothing to train or download), the
    shipped corpus (data/tinyshakespeare.txt, public domain), pre-tokenized .npy arrays (uint16,
    uint32 or int64, memory-mapped so a corpus larger than RAM works), a train/val split, and a seeded
    random batch sampler whose position can be saved and restored.
What it is not
    No BPE here (fine-tuning uses the model directory's tokenizer.json, see hf.py), no shuffling epochs,
    no multi-process loading: a batch is B random windows of T+1 tokens, which costs microseconds.
Try it
    python -m megatrain_min.data      # prints corpus size and one decoded batch
"""
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
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
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except Exception as e:  # a corrupt header is a user error, not a crash
            raise ValueError(f"cannot read {path} as .npy ({e})") from None
        if arr.ndim != 1 or arr.dtype.type not in NPY_DTYPES:
            raise ValueError(f"{path}: expected a 1-D uint16/uint32/int64 token array, got {arr.dtype} {arr.shape}")
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
            raise ValueError(f"{name} split has {len(tokens):,} tokens, fewer than seq_len+1={seq_len + 1}; "
                             f"use more data or a smaller --seq-len")
        self.tokens, self.B, self.T = tokens, batch_size, seq_len
        self.rng = np.random.default_rng(seed)

    def next(self):
        starts = self.rng.integers(0, len(self.tokens) - self.T, size=self.B)
        win = np.stack([np.asarray(self.tokens[s:s + self.T + 1], dtype=np.int64) for s in starts])  # (B, T+1)
        win = torch.from_numpy(win)
        return win[:, :-1], win[:, 1:].contiguous()  # (B, T) tokens, (B, T) targets

    def state_dict(self):
        return self.rng.bit_generator.state

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state


if __name__ == "__main__":
    toks = load_tokens(DEFAULT_DATA)
    tr, va = split(toks)
    print(f"{DEFAULT_DATA.name}: {len(toks):,} bytes -> train {len(tr):,}, val {len(va):,}")
    x, y = Batches(tr, 2, 64).next()
    print(repr(decode(x[0])))
