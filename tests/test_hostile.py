"""A catalogue of careless and hostile inputs: flags, data files, --init-from / --resume directories, output paths,
and the Python API.

Every case has one verdict: clean (the documented outcome: for a refusal, the exit code, one line on stderr, no
traceback; through the API a ValueError/TypeError whose one-line message names the argument), traceback (or a
generic exception from deep inside), silent (a wrong input accepted, or a wrong result), data lost (a file that
existed before the run is gone or changed), other (say, exit 2 with several lines). The test asserts "clean";
a failure message starts with "verdict=<what it was>", so
    python -m pytest tests/test_hostile.py -q | grep -o "verdict=[a-z ]*" | sort | uniq -c
counts the rest. The CLI cases run train.py through conftest.TrainCLI (a fresh process per run, no torch import
per run), each in its own directory, with files_under() of that directory taken before the run.
"""
import json
import math
import shutil
import zlib

import numpy as np
import pytest
import torch

import model
from conftest import engine, files_under, lost, make_bpe_tokenizer
from megatrain_min import checkpoint, checks, hf
from megatrain_min.lazy_init import LazyInit
from megatrain_min.reference import ReferenceTrainer

pytestmark = pytest.mark.slow   # the whole module: `python -m pytest -m "not slow"` leaves it out

TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--sample-tokens", "0", "--eval-batches", "1"]
CFG = model.PRESETS["toy"]
EOS = "<|endoftext|>"


# ----------------------------------------------------------------------------- shared inputs, made once
@pytest.fixture(scope="module")
def world(tmp_path_factory, cli):
    """A finished tiny run (checkpoints at steps 1 and 2), a Hugging Face directory with a tokenizer (our own
    export of a tiny model), a chat .jsonl and a short text; each case copies what it changes."""
    w = tmp_path_factory.mktemp("world")
    r = cli(*TINY, "--save-every", "1", "--out", w / "run", cwd=w)
    assert r.returncode == 0, r.stderr
    d = w / "hf-src"
    d.mkdir()
    tok = make_bpe_tokenizer(d, ["What is two plus two? Four. Yes or no? Yes."] * 4, 300, [EOS], {"eos_token": EOS})
    cfg = model.GPTConfig(vocab_size=tok.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128,
                          max_seq_len=128)
    hf.save_hf(cfg, model.init_weights(cfg), w / "hf", dtype=torch.float32, tokenizer_from=d)
    shutil.rmtree(d)
    rows = [{"messages": [{"role": "user", "content": "What is two plus two?"},
                          {"role": "assistant", "content": "Four."}]}, {"prompt": "Yes or no?", "completion": " Yes."}]
    (w / "chat.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows * 8))
    (w / "text.txt").write_text("What is two plus two? Four. " * 200)
    return w


def copy(src, dst):
    (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dst)
    return dst


def edit_json(path, **kv):
    doc = json.loads(path.read_text())
    doc.update(kv)
    path.write_text(json.dumps(doc))


def edit_meta(ck, fn):
    """Change a checkpoint's meta.json with fn(doc) and recompute its CRC (a deliberate, 'valid' edit)."""
    doc = json.loads((ck / "meta.json").read_text())
    doc.pop("crc32")
    fn(doc)
    doc["crc32"] = zlib.crc32(json.dumps(doc, sort_keys=True).encode())   # as checkpoint.py computes it
    (ck / "meta.json").write_text(json.dumps(doc))


def npy(path, arr):
    np.save(path, arr)
    return path


# ----------------------------------------------------------------------------- the CLI cases
# name: setup(tmp, world) -> (argv, expected exit code, words the one line must hold, files NOT to watch)
def _save_hf_into_user_dir(t, w):
    copy(w / "hf", t / "export")
    (t / "export" / "NOTES.md").write_text("my notes on this export\n")
    return ["--save-hf", t / "export"], 2, ["--save-hf"], []


def _resume_torn_metrics(t, w):
    run = copy(w / "run", t / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')                       # a SIGKILL in the middle of a line
    return ["--steps", "3", "--resume", "--out", run], 0, [], [run]


def _resume_meta(fn):
    def setup(t, w):
        run = copy(w / "run", t / "run")
        edit_meta(run / "ckpt-00000002", fn)
        return ["--steps", "3", "--resume", "--out", run], 2, ["ckpt-00000002"], []
    return setup


def _init_from_config(**kv):
    def setup(t, w):
        d = copy(w / "hf", t / "hf")
        edit_json(d / "config.json", **kv)
        return ["--init-from", d, "--data", w / "chat.jsonl", "--seq-len", "64", "--out", t / "o"], 2, ["config.json"], []
    return setup


def _truncated_safetensors(t, w):
    d = copy(w / "hf", t / "hf")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4096])
    return ["--init-from", d, "--data", w / "chat.jsonl", "--seq-len", "64", "--out", t / "o"], 2, ["model.safetensors"], []


def _reference_run_dir(t, w):
    (t / "o").mkdir()
    (t / "o" / "config.json").write_text('{"args": {}}\n')
    (t / "o" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5, "lr": 0.001, "tokens_per_s": 100.0}\n')
    return ["--out", t / "o"], 2, ["--resume", "--out"], []


def _file(t, name="file.txt"):
    (t / name).write_text("not a directory\n")
    return t / name


CLI = {
    # flags that were ignored or misread
    "eval-every-negative": lambda t, w: (["--eval-every", "-1"], 2, ["--eval-every"], []),
    "keep-zero": lambda t, w: (["--keep", "0"], 2, ["--keep"], []),
    "sample-tokens-negative": lambda t, w: (["--sample-tokens", "-1"], 2, ["--sample-tokens"], []),
    "seed-negative": lambda t, w: (["--seed", "-1"], 2, ["--seed"], []),
    "weight-decay-nan": lambda t, w: (["--weight-decay", "nan"], 2, ["weight_decay"], []),
    "weight-decay-negative": lambda t, w: (["--weight-decay", "-0.5"], 2, ["weight_decay"], []),
    "grad-clip-nan": lambda t, w: (["--grad-clip", "nan"], 2, ["grad_clip"], []),
    "grad-clip-inf": lambda t, w: (["--grad-clip", "inf"], 2, ["grad_clip"], []),
    "n-head-zero": lambda t, w: (["--n-head", "0"], 2, ["n_head"], []),
    "d-model-zero": lambda t, w: (["--d-model", "0"], 2, ["d_model"], []),
    "host-bw-zero": lambda t, w: (["--host-bw", "0"], 2, ["host", "bw"], []),
    "host-mem-negative": lambda t, w: (["--host-mem", "-1"], 2, ["host", "mem"], []),
    "steps-not-a-number": lambda t, w: (["--steps", "abc"], 2, ["--steps"], []),
    "engine-unknown": lambda t, w: (["--engine", "fast"], 2, ["--engine"], []),
    "micro-batches-indivisible": lambda t, w: (["--batch-size", "2", "--micro-batches", "3"], 2, ["--micro-batches"], []),
    # output paths
    "out-empty-string": lambda t, w: (["--out", ""], 2, ["--out"], []),
    "out-dev-null": lambda t, w: (["--out", "/dev/null"], 2, ["--out"], []),
    "out-below-a-file": lambda t, w: (["--out", _file(t) / "sub"], 2, ["--out"], []),
    "out-is-a-model-dir": lambda t, w: (["--out", copy(w / "hf", t / "hf")], 2, ["--out"], []),
    "out-holds-a-reference-run": _reference_run_dir,
    "save-hf-empty-string": lambda t, w: (["--save-hf", ""], 2, ["--save-hf"], []),
    "save-hf-is-a-file": lambda t, w: (["--save-hf", _file(t)], 2, ["--save-hf"], []),
    "save-hf-non-model-dir": lambda t, w: (["--save-hf", copy(w / "run", t / "run")], 2, ["--save-hf"], []),
    "save-hf-is-init-from": lambda t, w: (["--init-from", copy(w / "hf", t / "hf"), "--data", w / "chat.jsonl", "--seq-len",
                                           "64", "--save-hf", t / "hf", "--out", t / "o"], 2, ["--save-hf"], []),
    "save-hf-holds-out": lambda t, w: (["--out", t / "exp" / "run", "--save-hf", t / "exp"], 2, ["--save-hf"], []),
    "save-hf-export-with-user-file": _save_hf_into_user_dir,
    # --resume and --init-from directories
    "resume-torn-metrics-line": _resume_torn_metrics,
    "resume-meta-path-traversal": _resume_meta(lambda d: d["units"][0].update(file="../../escape.bin")),
    "resume-meta-negative-step": _resume_meta(lambda d: d.update(step=-3)),
    "resume-meta-step-string": _resume_meta(lambda d: d.update(step="two")),
    "resume-meta-config-extra-field": _resume_meta(lambda d: d["config"].update(n_experts=8)),
    "resume-a-file": lambda t, w: (["--resume", _file(t), "--out", t / "o"], 2, ["file.txt"], []),
    "init-from-ckpt-reference-engine": lambda t, w: (["--init-from", copy(w / "run", t / "run") / "ckpt-00000002",
                                                      "--engine", "reference", "--out", t / "o"], 2, ["--engine"], []),
    "init-from-rope-scaling-string": _init_from_config(rope_scaling="linear"),
    "init-from-norm-eps-string": _init_from_config(rms_norm_eps="tiny"),
    "init-from-layers-float": _init_from_config(num_hidden_layers=2.5),
    "init-from-null-config": lambda t, w: (lambda d: (d / "config.json").write_text("null") and
                                           (["--init-from", d, "--out", t / "o"], 2, ["config.json"], []))(copy(w / "hf", t / "hf")),
    "init-from-truncated-safetensors": _truncated_safetensors,
    # data files
    "data-directory": lambda t, w: (["--data", t], 2, ["--data"], []),
    "data-dev-zero": lambda t, w: (["--data", "/dev/zero"], 2, ["/dev/zero"], []),
    "data-jsonl-blank": lambda t, w: (["--data", _file(t, "b.jsonl").write_text("\n\n") and t / "b.jsonl"], 2, ["b.jsonl"], []),
    "data-npy-int64-huge-id": lambda t, w: (["--data", npy(t / "h.npy", np.full(1000, 2 ** 40, np.int64))], 2, ["1099511627776"], []),
    "data-npy-object": lambda t, w: (["--data", npy(t / "o.npy", np.array([1, "a"] * 500, dtype=object))], 2, ["o.npy"], []),
    "data-npy-truncated": lambda t, w: (["--data", (lambda p: p.write_bytes(p.read_bytes()[:200]) and p)(
        npy(t / "c.npy", np.arange(1000, dtype=np.uint16) % 256))], 2, ["c.npy"], []),
    "data-text-too-short": lambda t, w: (["--data", _file(t, "s.txt")], 2, ["--seq-len"], []),
    # a control: a valid run with every checkpoint flag at its edge
    "keep-one-save-every-step": lambda t, w: (["--save-every", "1", "--keep", "1", "--out", t / "o"], 0, [], [t / "o"]),
}


def verdict(r, before, code, words):
    if lost(before):
        return "data lost"
    if "Traceback" in r.stderr:
        return "traceback"
    if r.returncode != code:
        return "silent" if r.returncode == 0 else "other"
    lines = r.stderr.strip().splitlines()
    if code and (len(lines) != 1 or not all(str(w) in lines[0] for w in words)):
        return "other"
    return "clean"


@pytest.mark.parametrize("name", CLI)
def test_cli(name, world, cli, tmp_path):
    argv, code, words, unwatched = CLI[name](tmp_path, world)
    before = {p: b for p, b in files_under(tmp_path).items() if not any(p.is_relative_to(u) for u in unwatched)}
    out = [] if "--out" in argv else ["--out", tmp_path / "out"]
    r = cli(*TINY, *out, *argv, cwd=tmp_path)
    v = verdict(r, before, code, words)
    if v == "clean" and name == "resume-torn-metrics-line":   # and the log continues where the checkpoint was
        steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        v = "clean" if steps == [1, 2, 3] else "silent"
    assert v == "clean", f"verdict={v}: exit {r.returncode}\n{r.stderr[-2000:]}"


# ----------------------------------------------------------------------------- the API cases
def w0():
    return model.init_weights(CFG, 0)


def batch(T=16, B=2):
    return [torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0)) for _ in range(2)]


def trainer(**kw):
    return engine(CFG, kw.pop("weights", None) or w0(), device=kw.pop("device", "cpu"), **kw)


def with_key(key, value):
    w = w0()
    w[key] = value
    return w


def _requires_grad_weights():
    w = {k: v.requires_grad_() for k, v in w0().items()}
    t = trainer(weights=w)
    t.step(*batch())
    assert not any(m.requires_grad for m in t.opt.master) and not t.weights()[model.EMBED].requires_grad


def _bf16_weights():
    w = {k: v.to(torch.bfloat16) for k, v in w0().items()}
    t = trainer(weights=w)
    assert torch.equal(t.weights()[model.EMBED], w[model.EMBED].float())


def _same_step_of_another_run(tmp):
    a, b = trainer(), trainer(weights=model.init_weights(CFG, 1))
    checkpoint.save(a, tmp, 5, {"run": "a"})
    before = files_under(tmp)
    try:
        checkpoint.save(b, tmp, 5, {"run": "b"})
    finally:
        assert not lost(before), "data lost"


def _save_hf_over_dir_with_user_file(tmp):
    hf.save_hf(CFG, w0(), tmp / "exp")
    (tmp / "exp" / "train_log.txt").write_text("three days of notes\n")
    before = files_under(tmp)
    try:
        hf.save_hf(CFG, w0(), tmp / "exp")
    finally:
        assert not lost(before), "data lost"


def _load_hf_null_config(tmp):
    hf.save_hf(CFG, w0(), tmp / "exp")
    (tmp / "exp" / "config.json").write_text("null")
    hf.load_hf(tmp / "exp")


API = {  # name: (fn(tmp), expected exception type or None for "works", words the message must hold)
    "micro-batches-zero": (lambda tmp: trainer(micro_batches=0).step(*batch()), ValueError, ["micro_batches"]),
    "beta2-one": (lambda tmp: trainer(betas=(0.9, 1.0)), ValueError, ["betas"]),
    "eps-zero": (lambda tmp: trainer(eps=0.0), ValueError, ["eps"]),
    "weight-decay-negative": (lambda tmp: trainer(weight_decay=-0.1), ValueError, ["weight_decay"]),
    "grad-clip-inf": (lambda tmp: trainer(grad_clip=math.inf), ValueError, ["grad_clip"]),
    "set-lr-nan": (lambda tmp: trainer().set_lr(math.nan), ValueError, ["lr"]),
    "set-lr-negative": (lambda tmp: trainer().set_lr(-1e-3), ValueError, ["lr"]),
    "weights-extra-key": (lambda tmp: trainer(weights=with_key("model.layers.9.mlp.up_proj.weight", torch.zeros(3))),
                          ValueError, ["model.layers.9.mlp.up_proj.weight"]),
    "weights-int64-tensor": (lambda tmp: trainer(weights=with_key(model.NORM, torch.ones(128, dtype=torch.int64))),
                             TypeError, [model.NORM]),
    "weights-a-list": (lambda tmp: trainer(weights=list(w0().values())), TypeError, ["weights"]),
    "weights-require-grad": (lambda tmp: _requires_grad_weights(), None, []),
    "weights-bf16": (lambda tmp: _bf16_weights(), None, []),
    "device-tpu": (lambda tmp: trainer(device="tpu"), ValueError, ["tpu"]),
    "device-cuda-1": (lambda tmp: trainer(device="cuda:1"), ValueError, ["cuda:1"]),
    "tokens-float": (lambda tmp: trainer().step(batch()[0].float(), batch()[1]), TypeError, ["tokens"]),
    "tokens-1d": (lambda tmp: trainer().step(batch()[0][0], batch()[1][0]), ValueError, ["tokens"]),
    "targets-other-shape": (lambda tmp: trainer().step(batch()[0], batch()[1][:, :15]), ValueError, ["targets"]),
    "targets-minus-one": (lambda tmp: trainer().step(batch()[0], batch()[1] * 0 - 1), ValueError, ["targets"]),
    "sequence-empty": (lambda tmp: trainer().step(*batch(T=0)), ValueError, ["tokens"]),
    "evaluate-out-of-vocab": (lambda tmp: trainer().evaluate(batch()[0] + 256, batch()[1]), ValueError, ["tokens"]),
    "reference-too-long": (lambda tmp: ReferenceTrainer(CFG, w0()).step(*batch(T=300)), ValueError, ["max_seq_len"]),
    "reference-missing-key": (lambda tmp: ReferenceTrainer(CFG, {k: v for k, v in w0().items() if k != model.NORM}),
                              ValueError, [model.NORM]),
    "reference-nan-weight": (lambda tmp: ReferenceTrainer(CFG, with_key(model.NORM, torch.full((128,), math.nan))),
                             ValueError, [model.NORM]),
    "config-vocab-string": (lambda tmp: checks.check_config(model.GPTConfig(vocab_size="256")), ValueError,
                            ["vocab_size"]),
    "lazy-init-of-a-name": (lambda tmp: LazyInit("toy"), TypeError, ["cfg"]),
    "save-keep-negative": (lambda tmp: checkpoint.save(trainer(), tmp, 1, keep=-1), ValueError, ["keep"]),
    "save-same-step-of-another-run": (_same_step_of_another_run, ValueError, ["ckpt-00000005"]),
    "save-hf-over-user-file": (_save_hf_over_dir_with_user_file, ValueError, ["train_log.txt"]),
    "load-hf-null-config": (_load_hf_null_config, ValueError, ["config.json"]),
}


@pytest.mark.parametrize("name", API)
def test_api(name, tmp_path):
    fn, exc, words = API[name]
    try:
        fn(tmp_path)
        v = "clean" if exc is None else "silent"
    except AssertionError as e:
        v = "data lost" if "data lost" in str(e) else "silent"
    except Exception as e:  # noqa: BLE001 -- the verdict is the point
        msg = str(e)
        named = exc is not None and isinstance(e, exc) and "\n" not in msg and all(w in msg for w in words)
        v = "clean" if named else "traceback"
        print(f"{type(e).__name__}: {msg}")
    assert v == "clean", f"verdict={v}"
