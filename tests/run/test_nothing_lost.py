"""Nothing lost: every way a run writes, stops or refuses, as a user meets it.

The house rule: bad input gets one line on stderr and exit code 2, never a traceback, and every file that existed
before is still there byte for byte; a run that fails later exits with a documented code (README: Troubleshooting):
3 diverged, 4 an output could not be written. CLI cases run train.py through conftest.TrainCLI (a fresh process
per run); conftest.assert_refused checks exit code, one line, no traceback and files_under() before and after.
API cases expect a ValueError/TypeError whose one-line message names the argument. Reference for "decay and
momentum on an all-ignored batch": torch.optim.AdamW through the reference trainer.
"""
import json
import math
import os
import shutil
import signal
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import model
from conftest import assert_refused, engine, files_under, lost, make_bpe_tokenizer, update_rel, wait_for_training
from megatrain_min import hf
from megatrain_min.checkpoints import checkpoint, ckpt_read
from megatrain_min.engine import checks
from megatrain_min.hf import load as hf_load
from megatrain_min.checkpoints.checkpoint import NonFiniteError, SaveError
from megatrain_min.checkpoints.ckpt_read import CheckpointError
from megatrain_min.engine.reference import ReferenceTrainer

pytestmark = pytest.mark.slow   # the whole module: `python -m pytest -m "not slow"` leaves it out

TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--sample-tokens", "0", "--eval-batches", "1"]
LONG = ["--steps", "100000", "--batch-size", "2", "--seq-len", "16", "--sample-tokens", "0", "--eval-every", "100000"]
CFG = model.PRESETS["toy"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cli):
    """A finished tiny run: checkpoints at steps 1 and 2 and their metrics (copy it before changing it)."""
    d = tmp_path_factory.mktemp("finished")
    r = cli(*TINY, "--save-every", "1", "--out", d / "run", cwd=d)
    assert r.returncode == 0, r.stderr
    return d / "run"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Hugging Face directory (our own export) with a tokenizer.json, and a chat .jsonl for it."""
    d = tmp_path_factory.mktemp("hf")
    (d / "tok").mkdir()
    tok = make_bpe_tokenizer(d / "tok", ["What is two plus two? Four. Yes or no? Yes."] * 4, 300, ["</s>"],
                             {"eos_token": "</s>"})
    cfg = model.GPTConfig(vocab_size=tok.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128,
                          max_seq_len=128)
    hf.save_hf(cfg, model.init_weights(cfg), d / "model", dtype=torch.float32, tokenizer_from=d / "tok")
    row = {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]}
    (d / "chat.jsonl").write_text((json.dumps(row) + "\n") * 16)
    return d


def copy_run(src, tmp_path, name="run"):
    return shutil.copytree(src, tmp_path / name)


def recrc(ck, fn=None):
    """Edit meta.json of checkpoint ck with fn(doc) (or edit nothing, with fn None: the unit files were edited)
    and recompute its CRCs: a deliberate edit then passes every integrity check."""
    doc = json.loads((ck / "meta.json").read_text())
    doc.pop("crc32")
    for u in doc["units"] if fn is None else []:
        u["crc32"] = zlib.crc32((ck / u["file"]).read_bytes())
    if fn is not None:
        fn(doc)
    doc["crc32"] = zlib.crc32(json.dumps(doc, sort_keys=True).encode())   # as ckpt_read.doc_crc computes it
    (ck / "meta.json").write_text(json.dumps(doc))


def nan_into(ck, unit="layer.1", element=5):
    """Write a NaN into the master weights of a checkpoint's unit, CRCs recomputed."""
    f = ck / f"{unit}.bin"
    raw = bytearray(f.read_bytes())
    raw[4 * element:4 * element + 4] = np.float32("nan").tobytes()
    f.write_bytes(bytes(raw))
    recrc(ck)


# ============================================================================= data loss (fix first)
def test_save_hf_replaces_only_its_own_export(cli, tmp_path, finished):
    """--save-hf replaces only an earlier export of save_hf's: never --out itself, never a directory of the user's
    that merely holds a config.json."""
    r = cli(*TINY, "--save-every", "1", "--out", tmp_path / "a", "--save-hf", tmp_path / "a", cwd=tmp_path)
    assert_refused(r, {}, words=["--save-hf"])
    assert not (tmp_path / "a").exists()                          # refused before anything was written
    proj = tmp_path / "project"
    proj.mkdir()
    (proj / "config.json").write_text('{"mine": true}\n')
    (proj / "notes.txt").write_text("months of work\n")
    run = copy_run(finished, tmp_path)
    before = files_under(tmp_path)
    for target in (proj, run):
        r = cli(*TINY, "--out", tmp_path / "b", "--save-hf", target, cwd=tmp_path)
        assert_refused(r, before, words=["--save-hf"])
        assert not (tmp_path / "b").exists()
    # an earlier export of save_hf's, and nothing else, is replaced
    assert cli(*TINY, "--out", tmp_path / "c", "--save-hf", tmp_path / "exp", cwd=tmp_path).returncode == 0
    first = (tmp_path / "exp" / "model.safetensors").read_bytes()
    r = cli(*TINY, "--seed", "1", "--out", tmp_path / "d", "--save-hf", tmp_path / "exp", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "exp" / "model.safetensors").read_bytes() != first
    (tmp_path / "exp" / "README.md").write_text("my model card\n")  # now it is not only ours any more
    before = files_under(tmp_path)
    r = cli(*TINY, "--out", tmp_path / "e", "--save-hf", tmp_path / "exp", cwd=tmp_path)
    assert_refused(r, before, words=["README.md"])


@pytest.mark.parametrize("keep", ["-1", "0"])
def test_keep_below_one_is_refused(cli, tmp_path, keep):
    """--keep below 1 is refused (it would delete every checkpoint)."""
    r = cli(*TINY, "--keep", keep, "--out", tmp_path / "o", cwd=tmp_path)
    assert_refused(r, {}, words=["--keep"])
    assert not (tmp_path / "o").exists()


def test_new_run_into_a_used_out_is_refused(cli, tmp_path, finished):
    """A new run into another run's --out is refused before it writes: the two ways on are --resume and a fresh
    --out."""
    run = copy_run(finished, tmp_path)
    before = files_under(tmp_path)
    r = cli(*TINY, "--save-every", "1", "--steps", "12", "--out", run, cwd=tmp_path)
    assert_refused(r, before, words=["--resume", "fresh --out"])


def test_pruning_touches_only_the_same_runs_checkpoints(tmp_path):
    """keep=K deletes only this run's older checkpoints (meta["run"]); another run's stay, a step saved
    again replaces only its own run's checkpoint, and the temporary directory of a live process is left alone."""
    t = engine(CFG, model.init_weights(CFG), device="cpu")
    for step in (1, 2):
        checkpoint.save(t, tmp_path, step, {"run": "a"})
    live = tmp_path / f".tmp-ckpt-00000009-{os.getppid()}"    # a save still being written by a live process
    live.mkdir()
    (live / "head.bin").write_bytes(b"half of it")
    before = files_under(tmp_path)
    for step in (3, 4, 5):
        checkpoint.save(t, tmp_path, step, {"run": "b"}, keep=1)
    assert [s for s, _ in ckpt_read.checkpoints(tmp_path)] == [1, 2, 5] and not lost(before)
    with pytest.raises(CheckpointError, match="ckpt-00000002 exists and is not this run's"):
        checkpoint.save(t, tmp_path, 2, {"run": "b"})
    assert not lost(before)
    for keep in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="keep must be"):
            checkpoint.save(t, tmp_path, 6, {"run": "b"}, keep=keep)
    assert not (tmp_path / "ckpt-00000006").exists()


def test_one_run_per_out_and_sigkill_leaves_no_stale_lock(cli, tmp_path):
    """One run per --out: a second run is refused within seconds, naming the PID that holds the lock, and writes
    nothing; after a SIGKILL of the first, a run takes the lock again (--resume)."""
    out = tmp_path / "o"
    first = cli.start(*LONG, "--save-every", "1", "--out", out, cwd=tmp_path)
    wait_for_training(out)
    record, t0 = (out / "config.json").read_bytes(), time.time()
    r = cli(*TINY, "--out", out, cwd=tmp_path)                        # the same flags but --steps: a new run
    dt = time.time() - t0
    os.kill(first.pid, signal.SIGKILL)
    assert cli.wait(first).returncode == -signal.SIGKILL
    print(f"second run refused in {dt:.2f} s: {r.stderr.strip()}")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"pid {first.pid}" in r.stderr and record == (out / "config.json").read_bytes() and dt < 30
    step = ckpt_read.checkpoints(out)[-1][0]
    r = cli(*LONG[:1], str(step + 1), *LONG[2:], "--save-every", "1", "--resume", "--out", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert ckpt_read.checkpoints(out)[-1][0] == step + 1


def test_outputs_are_checked_writable_before_training(cli, tmp_path, finished):
    """An unwritable --out or a bad --save-hf target is refused before the first step (not after the training,
    whose steps would be lost)."""
    (tmp_path / "file").write_text("a file\n")
    run = copy_run(finished, tmp_path)
    (tmp_path / "ro").mkdir()
    before = files_under(tmp_path)
    for args in (["--out", tmp_path / "file"], ["--out", tmp_path / "file" / "sub"],
                 ["--out", tmp_path / "o", "--save-hf", tmp_path / "file" / "hf"]):
        assert_refused(cli(*TINY, *args, cwd=tmp_path), before, words=[args[-2]])
    for d in (run, tmp_path / "ro"):
        d.chmod(0o555)
    try:  # modes=True: file modes apply although the tests run as root
        r = cli(*TINY[:1], "4", *TINY[2:], "--save-every", "1", "--resume", "--out", run, cwd=tmp_path, modes=True)
        assert_refused(r, before, words=["--out", "Permission denied"])
        r = cli(*TINY, "--out", tmp_path / "ro", cwd=tmp_path, modes=True)
        assert_refused(r, before, words=["--out"])
    finally:
        for d in (run, tmp_path / "ro"):
            d.chmod(0o755)


def test_write_error_during_a_save_exits_4_with_the_previous_checkpoint_whole(cli, tmp_path, finished):
    """A write error during a save (here EFBIG: `ulimit -f` of 100 kB, a unit file is bigger) ends with one
    line and exit code 4; the previous checkpoint is intact and the temporary directory removed."""
    run = copy_run(finished, tmp_path)
    ckpts = files_under(*(p for _, p in ckpt_read.checkpoints(run)))
    r = cli(*TINY[:1], "3", *TINY[2:], "--save-every", "1", "--resume", "--out", run, cwd=tmp_path, fsize=100_000)
    assert_refused(r, ckpts, code=4, words=["could not write checkpoint", "File too large", "--resume"])
    assert not list(run.glob(".tmp-*")) and ckpt_read.latest(run).name == "ckpt-00000002"


def test_save_error_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Through the API: a failing fsync (ENOSPC, as on a full disk) raises SaveError (an OSError), removes
    the temporary directory and leaves the earlier checkpoint as it was."""
    import errno
    t = engine(CFG, model.init_weights(CFG), device="cpu")
    checkpoint.save(t, tmp_path, 1)
    before = files_under(tmp_path)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(SaveError) as e:
        checkpoint.save(t, tmp_path, 2)
    assert e.value.errno == errno.ENOSPC and "No space left" in str(e.value) and "\n" not in str(e.value)
    assert not lost(before) and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001"]


def test_metrics_are_rewritten_atomically_on_resume(cli, tmp_path, finished):
    """--resume cuts metrics.jsonl to the checkpoint's step by writing a new file and renaming it over the old
    one: whenever a SIGKILL comes, it holds the records up to the checkpoint (a line torn by an earlier kill is
    dropped), and each step appends one flushed line."""
    run = copy_run(finished, tmp_path)
    shutil.rmtree(run / "ckpt-00000002")                      # resume at step 1: record 2 goes, record 1 stays
    kept = (run / "metrics.jsonl").read_text().splitlines()[0] + "\n"
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')                              # torn by an earlier kill
    seen, deadline = [], time.time() + 120
    resumed = cli.start(*LONG, "--save-every", "1", "--resume", "--out", run, cwd=tmp_path)
    while time.time() < deadline and not any(line.startswith('{"step": 3,') and line.endswith("}")
                                             for line in seen[-1:] and seen[-1].splitlines()):
        seen.append((run / "metrics.jsonl").read_text())     # over and over, until step 3 is logged: then kill
    os.kill(resumed.pid, signal.SIGKILL)
    assert cli.wait(resumed).returncode == -signal.SIGKILL and seen
    assert all(text.startswith(kept) for text in seen), [t for t in seen if not t.startswith(kept)][:1]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3


@pytest.mark.parametrize("args", [["--lr", "nan"], ["--lr", "inf"], ["--lr", "-0.003"], ["--weight-decay", "inf"],
                                  ["--grad-clip", "nan"]], ids=lambda a: " ".join(a))
def test_nonfinite_or_negative_hyper_parameters_are_refused(cli, tmp_path, args):
    """A non-finite hyper-parameter (which would make the weights NaN at step 1) or a negative one (a negative lr
    is gradient ascent) is refused, naming the flag."""
    r = cli(*TINY, *args, "--out", tmp_path / "o", cwd=tmp_path)
    assert_refused(r, {}, words=[args[0]])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("homes", [{}, dict(resident_units=3), dict(gpu_updated_units=99)],
                         ids=["streamed", "resident", "gpu-updated"])
def test_nonfinite_gradient_skips_that_units_update(homes):
    """The guard looks at every unit's gradient, not only the loss: without deferral a unit whose gradient holds a
    NaN keeps its weights, its optimizer state and step count while the other units update; guard.units says
    which -- whether the unit is updated on the host (its verdict read there) or on the GPU, resident or streamed
    (its verdict a device flag the update skips itself on, read at the step's end: no host sync)."""
    t = engine(CFG, model.init_weights(CFG), device="cpu", skip_nonfinite=True, lr=1e-2, **homes)
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(2)]
    t.step(*batch)
    t.wait()

    def state(u):  # what a unit's update changes, copied: master, state and its step count
        return [s.clone() for s in t.opt.tensors(u).values()] + [t.opt.steps[u].item()]

    before = [state(u) for u in range(len(t.units))]
    for home in set(t.home):          # the gradient of layer.1 lands with a NaN in it
        def poisoned(u, lr, coef=1.0, guard=None, real=home.update):
            if t.units[u].name == "layer.1":
                t.opt.grad[u][7] = float("nan")
            return real(u, lr, coef, guard)
        home.update = poisoned
    loss = t.step(*batch)
    t.wait()
    assert math.isfinite(loss) and not t.guard.skipped and t.guard.units == ["layer.1"]
    for u, old in enumerate(before):
        same = all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(old, state(u)))
        assert same == (t.units[u].name == "layer.1"), t.units[u].name
        assert checks.all_finite(t.opt.master[u])


def test_nonfinite_master_weights_are_never_saved_nor_loaded(tmp_path):
    """A checkpoint whose master weights hold a NaN is never written (checked chunk by chunk on the way:
    NonFiniteError, no temporary directory left) and never loaded (CheckpointError naming the tensor)."""
    t = engine(CFG, model.init_weights(CFG), device="cpu")
    good = checkpoint.save(t, tmp_path, 1)
    before = files_under(tmp_path)
    t.opt.master[2][5] = float("inf")
    with pytest.raises(NonFiniteError, match="model.layers.1.self_attn.q_proj.weight"):
        checkpoint.save(t, tmp_path, 2)
    assert not lost(before) and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001"]
    nan_into(good)
    fresh = engine(CFG, model.init_weights(CFG, 1), device="cpu")
    was = fresh.weights()
    for verify_first in (True, False):
        with pytest.raises(CheckpointError, match="hold a NaN or an infinity"):
            checkpoint.load(fresh, good, verify_first=verify_first)
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.q_proj.weight hold a NaN"):
        checkpoint.load(fresh, good)
    fresh = engine(CFG, model.init_weights(CFG, 1), device="cpu")
    with pytest.raises(CheckpointError):
        checkpoint.load(fresh, good)
    assert all(torch.equal(v, was[k]) for k, v in fresh.weights().items())   # verify first: the trainer untouched


def test_save_hf_refuses_nonfinite_weights(tmp_path):
    w = model.init_weights(CFG)
    w[model.NORM][3] = float("nan")
    with pytest.raises(hf_load.HFError, match="model.norm.weight"):
        hf.save_hf(CFG, w, tmp_path / "exp")
    assert not list(tmp_path.iterdir())


def test_save_hf_of_a_model_no_architecture_represents_is_refused_before_training(cli, tmp_path):
    """--save-hf of a model transformers cannot represent (a qkv bias with q/k norm: --init-from one of our
    checkpoints of such a model) is refused before step 1 -- one line, exit 2, no run directory, no export --
    never after the run (hf.architecture, asked by rundir.Run.check and by save_hf)."""
    cfg = model.GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, max_seq_len=64,
                          qkv_bias=True, qk_norm=True)
    ck = checkpoint.save(engine(cfg, model.init_weights(cfg), device="cpu"), tmp_path / "src", 0, {})
    before = files_under(tmp_path)
    r = cli(*TINY, "--init-from", ck, "--save-hf", tmp_path / "hf", "--out", tmp_path / "run", cwd=tmp_path)
    assert_refused(r, before, words=["--save-hf", "qkv bias AND q/k norm"])
    assert not (tmp_path / "hf").exists() and not (tmp_path / "run").exists() and "step 1" not in r.stdout


# ============================================================================= tracebacks and silent wrong behaviour
FLAGS = {  # flag cases: argv, a word the one line must hold
    "eval-every-0": (["--eval-every", "0"], "--eval-every"),
    "device-tpu": (["--device", "tpu"], "tpu"),
    "device-cuda-without-cuda": (["--device", "cuda"], "CUDA"),
    "host-mem-nan": (["--host-mem", "nan"], "--host-mem"),
    "host-bw-nan": (["--host-bw", "nan"], "--host-bw"),
    "json-host-mem-inf": (["--json", "--host-mem", "inf"], "--host-mem"),
    "hardware-without-plan": (["--hardware", "tpu"], "--plan"),
    "save-every-negative": (["--save-every", "-1"], "--save-every"),
    "warmup-negative": (["--warmup", "-5"], "--warmup"),
    "grad-clip-negative": (["--grad-clip", "-1"], "--grad-clip"),
    "n-layer-0": (["--n-layer", "0"], "n_layer"),
    "max-skips-0": (["--max-skips", "0"], "--max-skips"),
    "config-with-init-from": (["--config", "toy", "--init-from", "INIT"], "--config"),
}


@pytest.mark.parametrize("name", FLAGS)
def test_flags(cli, tmp_path, finished, name):
    args, word = FLAGS[name]
    if name == "device-cuda-without-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = [str(finished / "ckpt-00000002") if a == "INIT" else a for a in args]
    assert_refused(cli(*TINY, *args, "--out", tmp_path / "o", cwd=tmp_path), {}, words=[word])
    assert not (tmp_path / "o").exists()


def test_a_second_ctrl_c_exits_at_once_without_a_traceback(cli, tmp_path):
    """The first SIGINT asks for a save at the end of the step; a second one before that save is done exits at once:
    one line, exit code 130, no temporary directory left behind. Every step ends with a long evaluation, so the
    first signal lands inside a step; where it came in the few microseconds between that evaluation and the save
    (the run then saves and exits 0 before the second one could come), the run is tried again."""
    for attempt in range(3):
        out = tmp_path / f"o{attempt}"
        run = cli.start(*LONG[:-1], "1", "--eval-batches", "1000", "--out", out, cwd=tmp_path)
        wait_for_training(out)                                  # step 1 is logged: step 2 and its evaluation run
        os.kill(run.pid, signal.SIGINT)
        deadline = time.time() + 60
        while "saving at the end of this step" not in run.out.read_text() and time.time() < deadline:
            time.sleep(0.01)                                    # the first signal is taken
        if "stopped at step" in run.out.read_text():            # ... at a step's very end: it saved and left
            assert cli.wait(run).returncode == 0
            continue
        os.kill(run.pid, signal.SIGINT)
        r = cli.wait(run)
        assert r.returncode == 130 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, \
            r.stderr
        assert "interrupted twice" in r.stderr and not list(out.glob(".tmp-*"))
        return
    pytest.fail("the first SIGINT came at the end of a step three times in a row")


@pytest.mark.parametrize("ids,word", [([7] * 999 + [-1], "-1"), ([-5] * 1000, "-5"), ([3] * 500 + [-100] * 500, "-100")],
                         ids=["one-negative", "many-negative", "minus-100"])
def test_npy_with_negative_ids(cli, tmp_path, ids, word):
    np.save(tmp_path / "t.npy", np.array(ids, dtype=np.int64))
    before = files_under(tmp_path)
    assert_refused(cli(*TINY, "--data", tmp_path / "t.npy", "--out", tmp_path / "o", cwd=tmp_path), before,
                   words=["t.npy", word])


def test_non_utf8_jsonl_names_file_and_line(cli, tmp_path):
    good = json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n"
    (tmp_path / "chat.jsonl").write_bytes((good * 3 + '{"prompt": "caf\xe9", "completion": "x"}\n').encode("latin-1"))
    before = files_under(tmp_path)
    r = cli(*TINY, "--data", tmp_path / "chat.jsonl", "--out", tmp_path / "o", cwd=tmp_path)
    assert_refused(r, before, words=["chat.jsonl:4", "UTF-8"])


def _nan_safetensors(d):
    from safetensors.torch import load_file, save_file
    w = load_file(d / "model.safetensors")
    w["model.layers.1.mlp.up_proj.weight"][2, 3] = float("nan")
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})


INIT_FROM = {  # --init-from cases: how to spoil a copy of the HF directory, a word of the one line
    "config-is-a-list": (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json"),
    "zero-heads": (lambda d: _edit_config(d, num_attention_heads=0), "n_head"),
    "vocab-size-string": (lambda d: _edit_config(d, vocab_size="300"), "vocab_size"),
    "corrupt-tokenizer": (lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": 17}'), "tokenizer.json"),
    "nan-weight": (_nan_safetensors, "model.layers.1.mlp.up_proj.weight"),
}


def _edit_config(d, **kv):
    c = json.loads((d / "config.json").read_text())
    c.update(kv)
    (d / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("name", INIT_FROM)
def test_init_from_bad_directory(cli, tmp_path, hf_dir, name):
    spoil, word = INIT_FROM[name]
    d = copy_run(hf_dir / "model", tmp_path, "model")
    spoil(d)
    before = files_under(tmp_path)
    r = cli(*TINY, "--seq-len", "64", "--init-from", d, "--data", hf_dir / "chat.jsonl", "--out", tmp_path / "o",
            cwd=tmp_path)
    assert_refused(r, before, words=[word])


def test_init_from_our_checkpoint_with_a_nan(cli, tmp_path, finished):
    ck = copy_run(finished / "ckpt-00000002", tmp_path, "ck")
    nan_into(ck)
    before = files_under(tmp_path)
    r = cli(*TINY, "--init-from", ck, "--out", tmp_path / "o", cwd=tmp_path)
    assert_refused(r, before, words=["model.layers.1.self_attn.q_proj.weight", "NaN"])


@pytest.mark.parametrize("edit", [lambda d: d["meta"].pop("args"), lambda d: d["meta"].update(rng={"python": 3}),
                                  lambda d: d["meta"].update(data="position 7"), lambda d: d.update(step="ten"),
                                  lambda d: d["units"][1].update(file="../../outside.bin")],
                         ids=["no-args", "rng-garbage", "data-garbage", "step-string", "path-outside"])
def test_resume_meta_edited_with_its_crc_recomputed(cli, tmp_path, finished, edit):
    """--resume of a meta.json edited by hand with a valid CRC gave a traceback."""
    run = copy_run(finished, tmp_path)
    recrc(run / "ckpt-00000002", edit)
    before = files_under(tmp_path)
    r = cli(*TINY[:1], "3", *TINY[2:], "--save-every", "1", "--resume", "--out", run, cwd=tmp_path)
    assert_refused(r, before, words=["meta.json"])


# The fields of model.GPTConfig at 9d80d23 (main before hidden_act): the "config" of a checkpoint written then.
FIELDS_9D80D23 = ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "head_dim", "max_seq_len",
                  "rope_theta", "norm_eps", "qkv_bias", "qk_norm", "tie_embeddings", "rope_scaling", "sliding_window")


def test_resume_of_a_checkpoint_older_than_a_config_field(cli, tmp_path, finished):
    """--resume of a checkpoint whose meta.json lacks a config field added since (its config as 9d80d23 wrote it:
    no hidden_act) continues, the field taking its default: the same losses as resuming the unedited checkpoint.
    A SAME_RUN setting missing from its flags is its default (cli.DEFAULTS); one with no default there is refused,
    naming the flag -- never a KeyError."""
    runs = {}
    for name, edit in (("as-saved", None), ("9d80d23", lambda d: [d["config"].pop(k) for k in list(d["config"])
                                                                 if k not in FIELDS_9D80D23]),
                       ("no-grad-clip", lambda d: d["meta"]["args"].pop("grad_clip"))):
        run = copy_run(finished, tmp_path, name)
        if edit is not None:
            recrc(run / "ckpt-00000002", edit)
        r = cli(*TINY[:1], "3", *TINY[2:], "--resume", "--out", run, cwd=tmp_path)
        assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr
        runs[name] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert runs["9d80d23"] == runs["no-grad-clip"] == runs["as-saved"] and len(runs["as-saved"]) == 3
    run = copy_run(finished, tmp_path, "no-warmup")
    recrc(run / "ckpt-00000002", lambda d: d["meta"]["args"].pop("warmup"))
    before = files_under(tmp_path)
    r = cli(*TINY[:1], "3", *TINY[2:], "--resume", "--out", run, cwd=tmp_path)
    assert_refused(r, before, words=["--resume", "--warmup (not recorded)"])


# ----------------------------------------------------------------------------- the API
def _w(**change):
    w = model.init_weights(CFG)
    for k, v in change.items():
        key = {"norm": model.NORM, "gate": "model.layers.0.mlp.gate_proj.weight", "embed": model.EMBED}[k]
        if v is None:
            del w[key]
        else:
            w[key] = v(w[key])
    return w


def _batch(T=16, top=256):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, top, (2, T), generator=g), torch.randint(0, 256, (2, T), generator=g)


ENGINES = {"stream": lambda w=None, **kw: engine(CFG, w if w is not None else _w(), device=kw.pop("device", "cpu"), **kw),
           "reference": lambda w=None, **kw: ReferenceTrainer(CFG, w if w is not None else _w(),
                                                              device=kw.pop("device", "cpu"), **kw)}
API = {  # API cases: call(engine), exception, words of the one-line message
    "init-weights-of-a-name": (lambda e: model.init_weights("toy"), TypeError, ["cfg", "GPTConfig"]),
    "missing-weight": (lambda e: ENGINES[e](_w(norm=None)), ValueError, [model.NORM]),
    "transposed-weight": (lambda e: ENGINES[e](_w(gate=lambda t: t.T)), ValueError, ["gate_proj", "transposed"]),
    "broadcastable-1xd-weight": (lambda e: ENGINES[e](_w(norm=lambda t: t[None])), ValueError, [model.NORM, "[1, 128]"]),
    "numpy-weights": (lambda e: ENGINES[e](_w(embed=lambda t: t.numpy())), TypeError, [model.EMBED, "ndarray"]),
    "cuda-without-cuda": (lambda e: ENGINES[e](device="cuda"), ValueError, ["cuda", "no CUDA"]),
    "out-of-vocab-tokens": (lambda e: ENGINES[e]().step(*_batch(top=300)), ValueError, ["tokens", "vocab_size"]),
    "longer-than-max-seq-len": (lambda e: ENGINES[e]().step(*_batch(T=300)), ValueError, ["max_seq_len=256"]),
    "lr-nan": (lambda e: ENGINES[e](lr=math.nan), ValueError, ["lr", "nan"]),
    "negative-grad-clip": (lambda e: ENGINES[e](grad_clip=-1.0), ValueError, ["grad_clip"]),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", API)
def test_api_checks_its_arguments(name, engine):
    if name == "cuda-without-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    fn, exc, words = API[name]
    with pytest.raises(exc) as e:
        fn(engine)
    msg = str(e.value)
    print(f"{type(e.value).__name__}: {msg}")
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_all_ignored_targets_still_decay_and_move_with_momentum(clip):
    """Kept on purpose and documented (docs/design.md, 'Numerics contract'): a batch whose targets are all -100 has loss 0 and zero
    gradients, and an AdamW step still applies weight decay and the momentum of the earlier steps, exactly as
    torch.optim.AdamW does. The streaming engine equals the reference (torch.optim.AdamW) on it."""
    w0 = model.init_weights(CFG)
    hp = dict(lr=1e-2, weight_decay=0.1, grad_clip=clip)
    ours, ref = engine(CFG, w0, device="cpu", skip_nonfinite=True, **hp), ReferenceTrainer(CFG, w0, device="cpu", **hp)
    tok, tgt = _batch()
    for t in (ours, ref):
        t.step(tok, tgt)
    w1 = ours.weights()
    losses = [t.step(tok, torch.full_like(tgt, model.IGNORE)) for t in (ours, ref)]
    wa, wb = ours.weights(), ref.weights()
    assert losses == [0.0, 0.0] and not ours.guard.skipped
    moved = sum(float((wa[k] - w1[k]).abs().max()) for k in w1)
    rel = update_rel(w1, wa, wb)
    print(f"all-ignored step: weights moved (sum of max |change| {moved:.2e}); stream vs torch AdamW update rel diff {rel:.1e}")
    assert moved > 0 and rel <= 1e-3


def test_readme_and_train_py_name_the_same_exit_codes():
    """README Troubleshooting and docs/troubleshooting.md have a row per exit code, train.py's docstring names
    each, and train.py, rundir.py (its run directory), stops.py (its signals), exits.py and launch.py
    (--nproc-per-node) use no other: every code given to fail / exit / SystemExit is a number or a name of
    exits.EXIT, the codes' one home."""
    import ast, re
    from conftest import ROOT
    from megatrain_min.run import exits
    readme = (ROOT / "README.md").read_text().split("## Troubleshooting")[1]
    table = {int(c) for c in re.findall(r"^\| (\d+) \|", readme, re.M)}
    doc = (ROOT / "train.py").read_text().split('"""')[1].split("Exit codes")[1]
    used = {2}                                          # fail(msg) defaults to 2
    mods = ("rundir", "stops", "exits", "launch")
    for path in (ROOT / "train.py", *(ROOT / "megatrain_min" / "run" / f"{m}.py" for m in mods)):
        for call in ast.walk(ast.parse(path.read_text())):   # every fail(msg, N), sys.exit(N), SystemExit(N)
            if isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", None)) in (
                    "fail", "exit", "_exit", "SystemExit"):
                for a in call.args:
                    if isinstance(a, ast.Constant) and isinstance(a.value, int):
                        used.add(a.value)
                    elif isinstance(a, ast.Subscript) and "EXIT" in (getattr(a.value, "id", None),
                                                                      getattr(a.value, "attr", None)):
                        used.add(exits.EXIT[a.slice.value])
    assert table == used == set(exits.EXIT.values()) == {0, 2, 3, 4, 5, 130}, (table, used)
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert {int(c) for c in re.findall(r"^\| (\d+) \|", page, re.M)} == table, page
    assert all(re.search(rf"\b{c} ", doc) for c in table), doc


# ============================================================================= a data file, a rank, under a run
def test_a_data_file_truncated_under_a_run_ends_it_in_one_line(cli, tmp_path):
    """A prepared train.npy truncated in place while a run reads it: one line naming it and the last checkpoint,
    exit 2 -- never a SIGBUS (the reader reads with pread, not a memory map) -- and every checkpoint whole."""
    from megatrain_min.data import prepare
    (tmp_path / "t.txt").write_text("What is two plus two? Four.\n" * 2000)
    prepare.prepare([tmp_path / "t.txt"], tmp_path / "prep")
    out = tmp_path / "o"
    run = cli.start(*LONG, "--save-every", "1", "--data", tmp_path / "prep", "--out", out, cwd=tmp_path)
    deadline = time.time() + 120
    while ckpt_read.latest(out) is None and time.time() < deadline:
        time.sleep(0.01)
    os.truncate(tmp_path / "prep" / "train.npy", 128)             # the header and a few ids are left
    r = cli.wait(run)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "train.npy shrank" in err[0] and "--resume" in err[0] and str(ckpt_read.latest(out)) in err[0], err
    for _, ck in ckpt_read.checkpoints(out):
        ckpt_read.read_weights(ck)                               # every file there, every CRC right


def test_a_heartbeat_below_the_least_is_raised_to_it_with_a_warning(monkeypatch):
    """The least itself is taken as asked, without a word; anything shorter is raised to it, with a warning."""
    from megatrain_min.run import launch
    least = launch.HEARTBEAT_LEAST
    for asked, used, warned in ((str(least), least, False), ("0.001", least, True), (str(2 * least), 2 * least, False)):
        monkeypatch.setenv(launch.HEARTBEAT_ENV, asked)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            launch.check_heartbeat()
        assert launch.heartbeat_s() == used and bool(said) == warned, (asked, [str(w.message) for w in said])


def test_a_frozen_rank_is_named_within_the_heartbeat_bound(cli, tmp_path):
    """--nproc-per-node 2, a rank frozen (SIGSTOP: a paused VM, a stopped process): the launcher names it once it
    has been silent for the heartbeat bound (MEGATRAIN_MIN_HEARTBEAT_S: 60 s by default, here its least, 5 s), ends
    the run in one line with exit 5, and every checkpoint is whole (without it: ten minutes of silence, then
    'killed'). The bound is asked as a millisecond: raised to the least, with a warning (a careless input of
    test_hostile.py's catalogue, checked here, where a run of 2 ranks is made anyway)."""
    from megatrain_min.run import launch
    out, bound = tmp_path / "o", launch.HEARTBEAT_LEAST
    run = cli.start("--nproc-per-node", "2", *LONG, "--save-every", "1", "--out", out, cwd=tmp_path,
                    env={launch.HEARTBEAT_ENV: "0.001", "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while ckpt_read.latest(out) is None and time.time() < deadline:
        time.sleep(0.05)
    pids = [int(p) for f in (Path("/proc") / str(run.pid) / "task").glob("*/children") for p in f.read_text().split()]
    env = {pid: dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
           for pid in pids}
    ranks = {int(e["RANK"]): pid for pid, e in env.items()}
    os.kill(ranks[1], signal.SIGSTOP)
    t0 = time.time()
    r = cli.wait(run)
    took = time.time() - t0
    # (a torch warning line, should one appear, is not an error line: sharded.py calls the *_single collectives
    # where torch has them, so 2.13 no longer warns of deprecated names)
    err = [line for line in r.stderr.strip().splitlines() if not line.startswith("warning: `torch.distributed.")]
    print(f"rank 1 frozen: the run ended after {took:.1f} s (bound {bound} s): {err}")
    assert r.returncode == 5 and len(err) == 2 and "Traceback" not in r.stderr, r.stderr
    assert err[0].startswith(f"warning: {launch.HEARTBEAT_ENV}=0.001") and f"{bound} s is used" in err[0], err[0]
    assert "rank 1" in err[1] and "stopped answering" in err[1] and "--resume" in err[1] and took < bound + 20
    stat = Path(f"/proc/{ranks[1]}/stat")
    state = stat.read_text().split(")")[1].split()[0] if stat.exists() else "gone"
    assert state in ("Z", "gone"), state       # the frozen rank was ended too
    for _, ck in ckpt_read.checkpoints(out):
        ckpt_read.read_weights(ck)
