"""train.py as a user runs it: bad input gets one line and exit code 2; the streaming engine and the
reference engine print the same losses; every run leaves config.json and metrics.jsonl."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

FAST = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--eval-every", "3", "--eval-batches", "1",
        "--sample-tokens", "0"]


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def bad(tmp_path, name, content):
    p = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(p, content)
    else:
        p.write_bytes(content)
    return str(p)


@pytest.mark.parametrize("args,msg", [
    (["--config", "tiny"], "unknown preset"),
    (["--n-head", "5"], "does not divide d_model"),
    (["--n-head", "4", "--n-kv-head", "3"], "not a multiple of n_kv_head"),
    (["--seq-len", "4096"], "max_seq_len"),
    (["--batch-size", "6", "--micro-batches", "4"], "not divisible"),
    (["--data", "/nonexistent/file.txt"], "does not exist"),
    (["--steps", "0"], "must be positive"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, msg):
    r = run(*args, "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and msg in err[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()  # nothing half-written


@pytest.mark.parametrize("kind", ["empty", "small", "npy2d", "npyfloat", "vocab"])
def test_bad_data_files(tmp_path, kind):
    path = {"empty": lambda: bad(tmp_path, "e.txt", b""),
            "small": lambda: bad(tmp_path, "s.txt", b"too short" * 3),
            "npy2d": lambda: bad(tmp_path, "a.npy", np.zeros((4, 4), np.uint16)),
            "npyfloat": lambda: bad(tmp_path, "f.npy", np.zeros(1000, np.float32)),
            "vocab": lambda: bad(tmp_path, "v.npy", np.full(1000, 300, np.uint16))}[kind]()
    r = run("--data", path, "--out", str(tmp_path / "o"), *FAST)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_npy_token_data_trains(tmp_path):
    toks = np.frombuffer((ROOT / "data" / "tinyshakespeare.txt").read_bytes()[:20000], np.uint8).astype(np.uint32)
    r = run("--data", bad(tmp_path, "t.npy", toks), "--out", str(tmp_path / "o"), *FAST)
    assert r.returncode == 0, r.stderr


def test_stream_and_reference_engines_print_the_same_losses(tmp_path):
    losses = {}
    for engine in ("stream", "reference"):
        r = run("--engine", engine, "--out", str(tmp_path / engine), "--micro-batches", "2", *FAST)
        assert r.returncode == 0, r.stderr
        recs = [json.loads(line) for line in (tmp_path / engine / "metrics.jsonl").read_text().splitlines()]
        assert [r_["step"] for r_ in recs] == [1, 2, 3]
        assert all({"step", "loss", "lr", "tokens_per_s"} <= set(r_) for r_ in recs) and "val_loss" in recs[-1]
        losses[engine] = [r_["loss"] for r_ in recs] + [recs[-1]["val_loss"]]
        cfg = json.loads((tmp_path / engine / "config.json").read_text())
        assert cfg["model"]["vocab_size"] == 256
    for a, b in zip(losses["stream"], losses["reference"]):
        assert abs(a - b) / b <= 1e-5, losses
