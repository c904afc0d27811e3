"""bench/prepare_throughput.py -- `python -m megatrain_min.prepare` against the tokenizers package's own
Tokenizer.encode_batch on the same text: wall time, MB/s, tokens/s and peak RSS of each, side by side.

The corpus is generated (text-like: words of a 50,000-word vocabulary drawn with a Zipf law, 3-24 words a line,
sentence punctuation, some blank lines; deterministic from --seed) or given (--corpus FILE). The tokenizer is a
byte-level BPE of --vocab ids trained with the tokenizers package on the first 2 MB of the corpus. Each run is a
child process of its own, one after the other, so its peak RSS is its own (ru_maxrss from os.wait4):
  baseline  the file read in the same pieces prepare reads (BATCH_BYTES, cut at line ends), each line with its
            newline through Tokenizer.encode_batch(lines, add_special_tokens=False), nothing kept but a count
  prepare   the command as a user runs it, writing train/val token files (val fraction 0.1) to a temporary
            directory beside the corpus
Both use every usable core (RAYON_NUM_THREADS = len(os.sched_getaffinity(0))). Wall times include starting the
interpreter (~0.3 s each); with --rounds N the runs alternate and each one's best time is reported (a shared
machine's other jobs make single short runs vary by 2x). The token counts must agree: the same lines through
the same tokenizer.
Results and their dates: bench/NOTES.md.

    python bench/prepare_throughput.py [--size 32MB] [--rounds 2] [--corpus FILE] [--vocab 4096] [--dir /tmp]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from megatrain_min.data import encoding  # noqa: E402

BASELINE = r"""
import json, sys, time
from tokenizers import Tokenizer
corpus, tokenizer, piece, method = sys.argv[1:5]
tok, piece = Tokenizer.from_file(tokenizer), int(piece)
encode, t0, n_tok, n_bytes = getattr(tok, method), time.time(), 0, 0
with open(corpus, "rb") as f:
    rest = b""
    while True:
        block = f.read(piece)
        buf = rest + block
        end = len(buf) if not block else buf.rfind(b"\n") + 1
        if end:
            lines = buf[:end].decode("utf-8").split("\n")
            lines = [s + "\n" for s in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
            n_tok += sum(map(len, encode(lines, add_special_tokens=False)))
            n_bytes += end
        rest = buf[end:]
        if not block:
            break
print(json.dumps({"tokens": n_tok, "bytes": n_bytes, "seconds": time.time() - t0}))
"""


def make_corpus(path, n_bytes, seed=0, n_words=50_000):
    """A text-like file of n_bytes: Zipf-distributed words (a frequent few, a long tail), lines of 3-24 words
    ending in '.' or ',', a blank line after some. Deterministic from seed."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
    p_letter = 1 / np.arange(1, 27) ** 0.8                       # letters as unequal as in English, roughly
    lengths = rng.integers(1, 11, size=n_words)
    words = np.array([letters[rng.choice(26, size=n, p=p_letter / p_letter.sum())].tobytes() for n in lengths],
                     dtype=object)
    cdf = np.cumsum(1 / np.arange(1, n_words + 1) ** 1.1)         # Zipf: the word of rank r has weight r^-1.1
    written = 0
    with open(path, "wb") as f:
        while written < n_bytes:
            idx, out, at = np.searchsorted(cdf / cdf[-1], rng.random(200_000)), [], 0
            for n in rng.integers(3, 25, size=20_000):
                if at + n > len(idx):
                    break
                end = (b".\n" if n % 3 else b",\n") + (b"\n" if n == 3 else b"")
                out.append(b" ".join(words[idx[at:at + n]]) + end)
                at += n
            blob = b"".join(out)[:n_bytes - written]
            f.write(blob)
            written += len(blob)


def train_tokenizer(corpus, model_dir, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with open(corpus, "rb") as f:
        sample = f.read(2 << 20).decode("utf-8", errors="ignore").splitlines()
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def child(argv, env):
    """(wall seconds, peak RSS bytes, stdout) of a child process."""
    t0 = time.time()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        sys.exit(f"{argv[:4]} failed ({p.returncode}): {err.strip()[-500:]}")
    return time.time() - t0, usage.ru_maxrss * 1024, out


def size(s):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?B)?", s.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 32MB or 2GB, got {s!r}")
    return int(float(m[1]) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[m[2] or "B"])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=size, default=size("32MB"), help="generated corpus size (default: 32MB)")
    p.add_argument("--corpus", default=None, help="a UTF-8 text file to use instead of a generated one")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (default: 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="runs of each, interleaved; the best time counts (default: 2)")
    p.add_argument("--dir", default=None, help="where the corpus and outputs go (default: a temporary directory)")
    p.add_argument("--baseline", default="encode_batch", choices=["encode_batch", "encode_batch_fast"],
                   help="the Tokenizer method of the baseline (default: encode_batch)")
    a = p.parse_args()
    cpus = len(os.sched_getaffinity(0))
    env = {**os.environ, "RAYON_NUM_THREADS": str(cpus), "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="prepare-bench-") as tmp:
        tmp = Path(tmp)
        corpus = Path(a.corpus) if a.corpus else tmp / "corpus.txt"
        if not a.corpus:
            t = time.time()
            make_corpus(corpus, a.size, a.seed)
            print(f"generated {corpus} ({a.size / 1e9:.2f} GB) in {time.time() - t:.0f} s", flush=True)
        train_tokenizer(corpus, tmp / "tok", a.vocab)
        n_bytes = corpus.stat().st_size
        print(f"corpus {n_bytes / 1e9:.3f} GB, BPE vocab {a.vocab}, {cpus} usable cores, BATCH_BYTES "
              f"{encoding.BATCH_BYTES >> 20} MiB", flush=True)
        base_s = ours_s = float("inf")
        for r in range(a.rounds):                 # interleaved; the best wall time of each, the largest RSS
            s, base_rss, out = child([sys.executable, "-c", BASELINE, str(corpus), str(tmp / "tok" / "tokenizer.json"),
                                      str(encoding.BATCH_BYTES), a.baseline], env)
            base, base_s = json.loads(out), min(base_s, s)
            print(f"round {r + 1}: baseline {s:.1f} s", end="", flush=True)
            s, ours_rss, _ = child([sys.executable, "-m", "megatrain_min.prepare", str(corpus), "--out",
                                    str(tmp / "prepared"), "--tokenizer", str(tmp / "tok")], env)
            meta = json.loads((tmp / "prepared" / "meta.json").read_text())
            ours_tok, ours_s = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"], min(ours_s, s)
            print(f", prepare {s:.1f} s", flush=True)
            shutil.rmtree(tmp / "prepared")
    rows = [(f"Tokenizer.{a.baseline} (baseline)", base_s, base["tokens"], base_rss),
            ("python -m megatrain_min.prepare", ours_s, ours_tok, ours_rss)]
    print("| run | wall s | MB/s | M tokens/s | tokens | peak RSS GB |")
    print("|---|---|---|---|---|---|")
    for name, s, n, rss in rows:
        print(f"| {name} | {s:.1f} | {n_bytes / 1e6 / s:.2f} | {n / 1e6 / s:.3f} | {n:,} | {rss / 1e9:.2f} |")
    print(f"prepare / baseline wall time: {ours_s / base_s:.2f}x (goal <= 2x); same token count: "
          f"{'yes' if ours_tok == base['tokens'] else 'NO'}; prepare's peak RSS {ours_rss / 1e9:.2f} GB for "
          f"{n_bytes / 1e9:.2f} GB of text")
    return 0 if ours_tok == base["tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
