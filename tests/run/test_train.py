"""train.py as a user runs it: bad input gets one line and exit code 2; the streaming engine and the
reference engine print the same losses; every run leaves config.json and metrics.jsonl."""
import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import model
from conftest import ROOT, runner, train_py, wait_for_training
from megatrain_min.checkpoints import ckpt_read
from megatrain_min.plan import hardware

pytestmark = pytest.mark.slow   # the whole module: `python -m pytest -m "not slow"` leaves it out

FAST = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--eval-every", "3", "--eval-batches", "1",
        "--sample-tokens", "0"]


def run(*args, cwd=ROOT, **kw):
    """`python train.py *args` in a fresh process (forked from conftest's runner: torch is imported once)."""
    return train_py(*args, cwd=cwd, **kw)


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
    (["--seq-len", "4096"], "allow it with --max-seq-len 4096"),
    (["--tile-tokens", "-1"], "--tile-tokens must be >= 0"),
    (["--gpu-updated-units", "-1"], "--gpu-updated-units must be >= 0"),
    (["--max-seq-len", "0"], "--max-seq-len must be positive"),
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
        check_model_tflops(recs, cfg)
    for a, b in zip(losses["stream"], losses["reference"]):
        assert abs(a - b) / b <= 1e-5, losses


def check_model_tflops(recs, config):
    """model_tflops = 6 x (the weights that multiply: every matrix but the embedding's gather) x tokens/s, counted
    here from the weights themselves; no mfu on a CPU (its peak is a guess)."""
    cfg = model.GPTConfig(**config["model"])
    w = model.init_weights(cfg, 0)
    mult = sum(t.numel() for k, t in w.items() if t.dim() == 2 and ("embed_tokens" not in k or cfg.tie_embeddings))
    assert 6 * mult == hardware.flops_per_token(cfg)
    for r in recs:
        assert r["model_tflops"] == pytest.approx(6 * mult * r["tokens_per_s"] / 1e12, rel=1e-12)
        assert "mfu" not in r


def metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_resume_is_bit_exact(tmp_path):
    """8 steps straight equal 4 steps, stop, resume, 4 more: every logged loss and the final weights."""
    common = ["--steps", "8", "--batch-size", "4", "--seq-len", "32", "--eval-every", "4", "--eval-batches", "1",
              "--sample-tokens", "0", "--micro-batches", "2"]
    assert run(*common, "--out", str(tmp_path / "a")).returncode == 0
    assert run(*common, "--save-every", "4", "--keep", "5", "--out", str(tmp_path / "b")).returncode == 0
    import shutil
    shutil.rmtree(tmp_path / "b" / "ckpt-00000008")
    r = run(*common, "--save-every", "4", "--keep", "5", "--out", str(tmp_path / "b"), "--resume")
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [(x["step"], x["loss"], x.get("val_loss")) for x in a] == [(x["step"], x["loss"], x.get("val_loss")) for x in b]
    for f in ("layer.0.bin", "head.bin", "embed.bin"):
        assert (tmp_path / "a" / "ckpt-00000008" / f).read_bytes() == (tmp_path / "b" / "ckpt-00000008" / f).read_bytes()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_saves_at_step_boundary_and_resume_continues(tmp_path, sig):
    """SIGTERM while training (or SIGHUP: the terminal or ssh session went away): the step finishes, a checkpoint of
    it is saved, exit 0; --resume continues from it."""
    common = ["--batch-size", "4", "--seq-len", "32", "--eval-every", "100000", "--sample-tokens", "0",
              "--out", tmp_path / "o"]
    proc = runner().start("--steps", "100000", *common)
    wait_for_training(tmp_path / "o")
    os.kill(proc.pid, sig)
    r = runner().wait(proc)
    assert r.returncode == 0, r.stderr
    assert "stopped at step" in r.stdout
    steps = [m["step"] for m in metrics(tmp_path / "o")]
    ck = sorted((tmp_path / "o").glob("ckpt-*"))
    assert ck and ck[-1].name == f"ckpt-{steps[-1]:08d}"
    r = run("--steps", str(steps[-1] + 2), *common, "--resume")
    assert r.returncode == 0, r.stderr
    assert [m["step"] for m in metrics(tmp_path / "o")][-3:] == [steps[-1], steps[-1] + 1, steps[-1] + 2]


@pytest.mark.parametrize("cmd", [["--plan", "--json"], ["-m", "megatrain_min.plan", "--config", "70b", "--json"],
                                 ["--config", "70b", "--plan"]], ids=["train", "plan", "table"])
def test_output_survives_a_closed_pipe(tmp_path, cmd):
    """`python train.py --plan --json | head -c 100`: the reader leaves early (here: before the first line is
    printed); no BrokenPipeError, no "Exception ignored" at exit, exit 0 -- as `head` users expect. The first case
    is a fresh interpreter, whose own shutdown flushes stdout ("Exception ignored" comes from there); the others
    run forked from the runner (a forked child ends with os._exit: the write itself is what they check)."""
    if cmd == ["--plan", "--json"]:
        read, write = os.pipe()
        p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *cmd], cwd=ROOT, stdout=write,
                             stderr=subprocess.PIPE)
        os.close(write)
        os.close(read)                              # the reader is gone before the first line is printed
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 0 and err == "", err
        return
    module = cmd[1] if cmd[0] == "-m" else None
    r = run(*(cmd[2:] if module else cmd), module=module, closed_stdout=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_resume_refuses_bad_checkpoint_and_other_settings(tmp_path):
    common = ["--steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "4", "--eval-batches", "1",
              "--sample-tokens", "0", "--out", str(tmp_path / "o")]
    assert run(*common).returncode == 0
    r = run(*common[:1], "8", *common[2:], "--lr", "1e-4", "--resume")
    assert r.returncode == 2 and "--lr" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    f = tmp_path / "o" / "ckpt-00000004" / "layer.1.bin"
    raw = bytearray(f.read_bytes())
    raw[1000] ^= 0x10
    f.write_bytes(bytes(raw))
    r = run(*common[:1], "8", *common[2:], "--resume")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    r = run(*common[:1], "8", *common[2:], "--resume", str(tmp_path / "nowhere"))
    assert r.returncode == 2, r.stderr


def test_consecutive_nonfinite_steps_stop_training(tmp_path):
    """The contract of --max-skips, whatever shows the divergence first (the loss, or a unit's gradient -- which
    one depends on the machine): exit 3 after 3 consecutive steps with a non-finite loss or gradient, each of them
    recorded in metrics.jsonl as skipped (true: the whole step; or the names of the units that kept their weights),
    and the one line names the last good checkpoint. lr 1e6 diverges at once; no weight decay, so the updated
    weights stay finite (each step moves a weight by ~lr) and every step saves (--save-every 1)."""
    out = tmp_path / "o"
    r = run("--steps", "30", "--lr", "1e6", "--weight-decay", "0", "--grad-clip", "0", "--max-skips", "3",
            "--batch-size", "4", "--seq-len", "32", "--eval-every", "1000", "--sample-tokens", "0",
            "--save-every", "1", "--out", out)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 3 and len(err) == 1 and "3 consecutive steps had a non-finite" in err[0], r.stderr
    recs = metrics(out)
    units = {lay.name for lay in model.units(model.PRESETS["toy"])}
    skipped = [m.get("skipped") for m in recs]
    assert all(s is True or (isinstance(s, list) and s and set(s) <= units) for s in skipped[-3:]), skipped
    assert len(recs) == 3 or not skipped[-4], skipped          # the run stops at the third in a row
    latest = ckpt_read.latest(out)                             # saved after every step but the one that stops
    assert latest is not None and latest.name == f"ckpt-{recs[-2]['step']:08d}", (latest, recs[-2:])
    assert f"Last good checkpoint: {latest}." in err[0], err[0]
    assert all(math.isfinite(m["loss"]) for m in recs[:-3] if not m.get("skipped"))


def test_profile_trace_holds_the_optimizer_thread(tmp_path):
    """--profile records every thread (profile_all_threads): the worker's fused AdamW ops are in the trace, on
    a thread of their own -- the overlap the trace exists to show."""
    r = run("--out", str(tmp_path / "o"), "--profile", *FAST[:1], "5", *FAST[2:])
    assert r.returncode == 0, r.stderr
    events = json.loads((tmp_path / "o" / "trace.json").read_text())["traceEvents"]
    tids = lambda name: {e["tid"] for e in events if e.get("ph") == "X" and e["name"] == name}  # noqa: E731
    adamw, blocks = tids("aten::_fused_adamw_"), tids("aten::scaled_dot_product_attention")
    names = sorted({(e["tid"], e["name"]) for e in events if e.get("ph") == "X" and e["name"].startswith("aten::")})
    assert adamw and blocks and not adamw & blocks, (adamw, blocks, names[:60], r.stdout[-2000:])


def test_long_context_tiled_equals_untiled(tmp_path):
    """--seq-len past the preset's max with --max-seq-len; --tile-tokens 1000 (8192 is no multiple) gives
    the losses of --tile-tokens 0 (<= 1e-5): the step's loss and the validation loss after its update. One step of
    a narrowed toy (2 layers, d 64: attention at 8192 tokens is most of the time; the full toy takes ~30 s of CPU
    per run, and gives equal losses too, bench/NOTES.md)."""
    common = ["--config", "toy", "--seq-len", "8192", "--max-seq-len", "8192", "--batch-size", "1", "--steps", "1",
              "--eval-batches", "1", "--sample-tokens", "0", "--n-layer", "2", "--d-model", "64", "--n-head", "2"]
    losses = {}
    for tile in ("0", "1000"):
        r = run(*common, "--tile-tokens", tile, "--out", str(tmp_path / tile))
        assert r.returncode == 0, r.stderr
        assert ("in tiles of 1,000 tokens" if tile == "1000" else "layer untiled") in r.stdout
        (rec,) = metrics(tmp_path / tile)
        losses[tile] = (rec["loss"], rec["val_loss"])
    print(losses)
    for a, b in zip(losses["1000"], losses["0"]):
        assert abs(a - b) / b <= 1e-5, losses


def test_plan_7b_at_512k_on_a_gh200_fits():
    """7b at 512k tokens on a GH200 with 480 GB, as typed (planning takes any --seq-len; training past 4096 needs --max-seq-len)."""
    r = run("--config", "7b", "--plan", "--hardware", "gh200", "--host-mem", "480", "--seq-len", "524288",
            "--batch-size", "1")
    assert r.returncode == 0, r.stderr
    assert "-> FITS" in r.stdout and "layer in tiles of 8,192 tokens" in r.stdout and "--max-seq-len 524288" in r.stdout


def test_samplers_give_long_windows(tmp_path):
    """Long context needs long windows from both samplers: a memory-mapped .npy (uint32) and a text file's bytes
    give (B, T) int64 windows of T = 300,000 consecutive tokens, the targets shifted by one."""
    from megatrain_min import data
    raw = np.random.default_rng(0).integers(0, 256, 400_000, dtype=np.uint8).tobytes()
    (tmp_path / "t.txt").write_bytes(raw)
    np.save(tmp_path / "t.npy", np.arange(400_000, dtype=np.uint32))       # token i at position i
    T = 300_000
    for name in ("t.npy", "t.txt"):
        tokens = data.load_tokens(tmp_path / name)
        x, y = data.Batches(tokens, 2, T, seed=0).next()
        assert x.shape == y.shape == (2, T) and x.dtype == y.dtype == torch.int64
        for row_x, row_y in zip(x, y):
            s = int(row_x[0]) if name == "t.npy" else raw.find(bytes(row_x[:32].tolist()))   # where it starts
            assert torch.equal(row_x, torch.from_numpy(np.asarray(tokens[s:s + T], dtype=np.int64)))
            assert torch.equal(row_y[:-1], row_x[1:]) and int(row_y[-1]) == int(tokens[s + T])


def test_help_names_each_default_once_and_train_py_stays_within_120_columns():
    """--help: each option names its default at most once (argparse's %(default)s or words, never both), never a
    bare "(default: None)"; every option with a real default shows it. train.py's lines: <= 120 columns."""
    r = run("--help", env={"COLUMNS": "1000"})                               # each help string on one line
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "(default: None)" not in r.stdout and "(default: False)" not in r.stdout
    assert all(line.count("default:") <= 1 for line in lines), [x for x in lines if x.count("default:") > 1]
    for flag, value in (("--steps", 400), ("--lr", 0.003), ("--out", "out"), ("--hardware", "local"),
                        ("--device", "cuda if available"), ("--dtype", "bf16 on cuda, fp32 on cpu"),
                        ("--batch-size", 32), ("--sample-tokens", 300)):
        i = next(i for i, x in enumerate(lines) if x.lstrip().startswith(flag + " "))
        text = lines[i] if "(default" in lines[i] else lines[i + 1]   # a long flag's help starts on the next line
        assert text.rstrip().endswith(f"(default: {value})"), (lines[i], lines[i + 1])
    long = [(i, len(x)) for i, x in enumerate((ROOT / "train.py").read_text().splitlines(), 1) if len(x) > 120]
    assert not long, f"train.py lines over 120 columns (line, length): {long}"


SAMPLE_CONTEXT = r"""
import runpy, sys
sys.path.insert(0, sys.argv[1])
import model
seen, forward = [], model.forward
def recording_forward(cfg, weights, tokens):   # the sampler's only model call: note its context length
    seen.append(tokens.shape[1])
    return forward(cfg, weights, tokens)
model.forward = recording_forward
sys.argv = [sys.argv[1] + "/train.py", *sys.argv[2:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("contexts", min(seen, default=0), max(seen, default=0), len(seen))
"""


def test_sample_context_is_cropped_to_the_trained_seq_len(tmp_path):
    """The end-of-run sample crops its context to the --seq-len the model trained at (RoPE positions past it were
    never seen, and the text degenerates there), not to max_seq_len: every context that model.forward receives
    while sampling is at most --seq-len tokens, and the sample reaches it."""
    seq_len, n = 16, 40
    (tmp_path / "sample_context.py").write_text(SAMPLE_CONTEXT)
    r = run(ROOT, "--steps", "1", "--batch-size", "2", "--seq-len", seq_len, "--eval-every", "1", "--eval-batches", "1",
            "--sample-tokens", n, "--out", tmp_path / "o", cwd=tmp_path, script=tmp_path / "sample_context.py")
    assert r.returncode == 0, r.stderr
    lo, hi, calls = map(int, r.stdout.strip().splitlines()[-1].split()[1:])
    assert calls == n and lo == 1 and hi == seq_len, r.stdout[-500:]


def test_lion_with_its_betas_trains_saves_and_resumes_as_the_same_run(tmp_path):
    """--optimizer lion --betas: the betas reach the rule (another pair, another third step: Lion's first update is
    sign(g) whatever its betas), the checkpoint holds
    the master and Lion's one moment, config.json the betas -- without the flag, the rule's own; a resume with
    other betas is refused naming them as typed (exit 2), the same ones continue."""
    out, own = tmp_path / "o", tmp_path / "own"
    lion = ["--optimizer", "lion", "--lr", "1e-3", "--weight-decay", "0.3"]
    r = run(*FAST[:1], "2", *FAST[2:], *lion, "--betas", "0.8", "0.9", "--out", out)
    assert r.returncode == 0, r.stderr
    r = run(*FAST[:1], "3", *FAST[2:], *lion, "--out", own)
    assert r.returncode == 0, r.stderr
    assert json.loads((own / "config.json").read_text())["args"]["betas"] == [0.9, 0.99]   # Lion's own
    meta = ckpt_read.read_meta(ckpt_read.latest(out))
    assert meta["states"] == ["master", "m"] and meta["meta"]["args"]["betas"] == [0.8, 0.9], meta
    assert json.loads((out / "config.json").read_text())["args"]["betas"] == [0.8, 0.9]
    common = ["--optimizer", "lion", "--lr", "1e-3", "--weight-decay", "0.3", "--resume", ckpt_read.latest(out),
              "--out", out]
    r = run(*FAST[:1], "3", *FAST[2:], *common, "--betas", "0.9", "0.99")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "was made with other settings (--betas 0.8 0.9)" in r.stderr, r.stderr
    r = run(*FAST[:1], "3", *FAST[2:], *common, "--betas", "0.8", "0.9")
    assert r.returncode == 0 and [m["step"] for m in metrics(out)] == [1, 2, 3], r.stderr
    ours, theirs = ([m["loss"] for m in metrics(d)] for d in (out, own))
    assert ours[:2] == theirs[:2] and ours[2] != theirs[2], (ours, theirs)   # the same until m matters
