"""A catalogue of careless and hostile inputs: flags, data files, --init-from / --resume directories, output paths,
and the Python API.

Every case has one verdict: clean (the documented outcome: for a refusal, the exit code, one line on stderr, no
traceback; through the API a ValueError/TypeError whose one-line message names the argument), traceback (or a
generic exception from deep inside), silent (a wrong input accepted, or a wrong result), data lost (a file that
existed before the run is gone or changed), other (say, exit 2 with several lines). The test asserts "clean";
a failure message starts with "verdict=<what it was>", so
    python -m pytest tests/run/test_hostile.py -q | grep -o "verdict=[a-z ]*" | sort | uniq -c
counts the rest. The CLI cases run train.py (or `python -m megatrain_min.prepare`, `python -m
megatrain_min.hf export`) through conftest.TrainCLI (a fresh process per run, no torch import per run), each in
its own directory, with files_under() of that directory taken before the run; a refusal must also leave the
run's --out unmade. AT_ONCE runs two commands at the same moment into one output: one wins, the other is
refused, nothing of the winner's is lost.
"""
import contextlib
import gzip
import io
import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import model
from conftest import ROOT, engine, files_under, lost, make_bpe_tokenizer
from megatrain_min import hf
from megatrain_min.checkpoints import checkpoint
from megatrain_min.data import encoding, prepare, prepared
from megatrain_min.engine import checks
from megatrain_min.hf import load as hf_load
from megatrain_min.run import launch, runlock
from megatrain_min.engine.lazy_init import LazyInit
from megatrain_min.engine.reference import ReferenceTrainer

pytestmark = pytest.mark.slow   # the whole module: `python -m pytest -m "not slow"` leaves it out

TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--sample-tokens", "0", "--eval-batches", "1"]
CFG = model.PRESETS["toy"]
EOS = "<|endoftext|>"
CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
PREPARE, HF = "megatrain_min.prepare", "megatrain_min.hf"    # python -m PREPARE ..., python -m HF export ...


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
    # runs on data named by a relative path (a case copies the run and changes the file under the same name),
    # a fine-tune of the Hugging Face model (its checkpoint carries the tokenizer)
    (w / "corpus.txt").write_text("What is two plus two? Four. " * 200)
    r = cli(*TINY, "--save-every", "1", "--data", "corpus.txt", "--out", w / "run-data", cwd=w)
    assert r.returncode == 0, r.stderr
    r = cli(*TINY, "--save-every", "1", "--init-from", w / "hf", "--data", "chat.jsonl", "--seq-len", "64",
            "--out", w / "sft", cwd=w)
    assert r.returncode == 0, r.stderr
    # round 3: prepared directories (bytes, the model's tokenizer, SFT in a chat template) and a run on one
    (w / "lines.txt").write_text("What is two plus two? Four.\n" * 200)
    d = w / "hfc-src"
    d.mkdir()
    tok = make_bpe_tokenizer(d, ["What is two plus two? Four. Yes or no? Yes."] * 4, 300,
                             [EOS, "<|im_start|>", "<|im_end|>"], {"eos_token": "<|im_end|>", "chat_template": CHATML})
    cfg = model.GPTConfig(vocab_size=tok.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128,
                          max_seq_len=128)
    hf.save_hf(cfg, model.init_weights(cfg), w / "hf-chat", dtype=torch.float32, tokenizer_from=d)
    shutil.rmtree(d)
    prepare.prepare([w / "lines.txt"], w / "prep")
    prepare.prepare([w / "lines.txt"], w / "prep-hf", w / "hf")
    prepare.prepare([w / "chat.jsonl"], w / "prep-sft", w / "hf-chat")
    r = cli(*TINY, "--save-every", "1", "--data", "prep", "--out", w / "run-prep", cwd=w)
    assert r.returncode == 0, r.stderr
    for d in (w / "hf", w / "hf-chat"):             # the runs that start from them plan them: traced once
        cli.trace(hf_load.config_from_hf(json.loads((d / "config.json").read_text())))
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
    doc["crc32"] = zlib.crc32(json.dumps(doc, sort_keys=True).encode())   # as ckpt_read.doc_crc computes it
    (ck / "meta.json").write_text(json.dumps(doc))


def npy(path, arr):
    with open(path, "wb") as f:    # np.save(name) would add ".npy" to a name that ends otherwise
        np.save(f, arr)
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


def _in_place(run, data, content):
    """Copy world's `run` and write its data file, named relatively, with new content: (argv, t) for --resume."""
    def setup(t, w):
        copy(w / run, t / run)
        (t / data).write_text(content(w / data)) if content else copy(w / data, t / data)
        return ["--steps", "3", "--resume", "--out", t / run, "--data", data] + (
            ["--init-from", w / "hf", "--seq-len", "64"] if run == "sft" else [])
    return setup


def _resume_data_changed(t, w):
    argv = _in_place("run-data", "corpus.txt", lambda p: p.read_text().replace("Four", "Five"))(t, w)
    return argv, 2, ["data changed"], []


def _resume_data_spelled_otherwise(t, w):
    """The run's data by another path (absolute now, relative then): the same content, so the same run."""
    argv = _in_place("run-data", "corpus.txt", None)(t, w)
    argv[argv.index("corpus.txt")] = t / "corpus.txt"
    return argv, 0, [], [t / "run-data"]


def _out_with_a_file_named_ckpt(t, w):
    """A user's file whose name starts with ckpt- is not a checkpoint: the run trains beside it."""
    (t / "out").mkdir()
    (t / "out" / "ckpt-notes.txt").write_text("mine\n")
    return ["--out", t / "out"], 0, [], []


def _resume_sft_shrunk(t, w):
    argv = _in_place("sft", "chat.jsonl", lambda p: "".join(p.read_text().splitlines(True)[:6]))(t, w)
    return argv, 2, ["data changed"], []


def _resume_other_chat_format(t, w):
    argv = _in_place("sft", "chat.jsonl", None)(t, w)
    return argv + ["--chat-format", "fixed"], 2, ["--chat-format"], []


def _resume_other_init_from(t, w):
    argv = _in_place("sft", "chat.jsonl", None)(t, w)
    other = copy(w / "hf", t / "hf-other")
    return argv[:-4] + ["--init-from", other, "--seq-len", "64"], 2, ["--init-from"], []


def _hf_with(fn, data="chat.jsonl", seq="64"):
    """A copy of world's Hugging Face directory changed by fn(dir, t): --init-from it."""
    def setup(t, w):
        d = copy(w / "hf", t / "hf")
        words = fn(d, t)
        return ["--init-from", d, "--data", w / data if (w / data).exists() else t / data, "--seq-len", seq,
                "--out", t / "o"], 2, words, []
    return setup


def _chat_rows(t, rows, name="c.jsonl"):
    (t / name).write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return t / name


def _resume_newest_meta_gone(t, w):
    run = copy(w / "run", t / "run")
    (run / "ckpt-00000002" / "meta.json").unlink()
    return ["--steps", "3", "--resume", "--out", run], 2, ["ckpt-00000002", "meta.json"], []


def _out_with_empty_ckpt(t, w):
    (t / "o" / "ckpt-00000002").mkdir(parents=True)
    return ["--out", t / "o"], 2, ["ckpt-00000002"], []


def _resume_damaged_newest(t, w):
    run = copy(w / "run", t / "run")
    unit = run / "ckpt-00000002" / "layer.1.bin"
    raw = bytearray(unit.read_bytes())
    raw[100] ^= 0xFF
    unit.write_bytes(bytes(raw))
    return ["--steps", "3", "--resume", "--out", run], 2, ["layer.1.bin", "--resume", "ckpt-00000001"], []


def _record_is_a_directory(name):
    def setup(t, w):
        (t / "o" / name).mkdir(parents=True)
        return ["--out", t / "o"], 2, [name], []
    return setup


def _resume_never_saved(t, w):
    (t / "o").mkdir()
    (t / "o" / "config.json").write_text('{"run": "abc", "args": {}}\n')
    return ["--resume", "--out", t / "o"], 2, ["config.json", "start over"], []


def _dangling_out(t, w):
    (t / "link").symlink_to(t / "nowhere" / "at-all")
    return ["--out", t / "link"], 2, ["symbolic link"], []


def _fifo(t):
    import os
    os.mkfifo(t / "pipe.txt")
    return t / "pipe.txt"


def _other_vocab_tokenizer(d, t):
    """A tokenizer of another, larger vocabulary in the model's directory."""
    (t / "tk").mkdir()
    make_bpe_tokenizer(t / "tk", ["Completely different words, zebra quartz jackdaws vexing."] * 50, 2000, [EOS],
                       {"eos_token": EOS})
    shutil.copyfile(t / "tk" / "tokenizer.json", d / "tokenizer.json")
    (t / "zebra.txt").write_text("Completely different words, zebra quartz jackdaws vexing. " * 300)
    return ["another model's"]


TORCHRUN = dict(LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29598")
CLI = {
    # flags that were ignored or misread
    "eval-every-negative": lambda t, w: (["--eval-every", "-1"], 2, ["--eval-every"], []),
    "keep-zero": lambda t, w: (["--keep", "0"], 2, ["--keep"], []),
    "sample-tokens-negative": lambda t, w: (["--sample-tokens", "-1"], 2, ["--sample-tokens"], []),
    "seed-negative": lambda t, w: (["--seed", "-1"], 2, ["--seed"], []),
    "weight-decay-nan": lambda t, w: (["--weight-decay", "nan"], 2, ["weight_decay"], []),
    "weight-decay-negative": lambda t, w: (["--weight-decay", "-0.5"], 2, ["weight_decay"], []),
    "grad-clip-nan": lambda t, w: (["--grad-clip", "nan"], 2, ["grad_clip"], []),
    "betas-of-one": lambda t, w: (["--optimizer", "lion", "--betas", "0.9", "1"], 2, ["--betas", "[0, 1)"], []),
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

    # ---- round 2: accepted silently before
    "chunk-tokens-negative": lambda t, w: (["--chunk-tokens", "-1"], 2, ["--chunk-tokens"], []),
    "data-utf16-through-a-tokenizer": _hf_with(lambda d, t: (t / "u.txt").write_text(
        "What is two plus two? Four. " * 100, encoding="utf-16") and ["UTF-8", "UTF-16"], data="u.txt"),
    "data-latin1-bytes": lambda t, w: (["--data", (lambda p: p.write_bytes("caf\xe9 ".encode("latin-1") * 900)
                                                   and p)(t / "l.txt")], 2, ["UTF-8", "iconv"], []),
    "data-npz": lambda t, w: (["--data", (np.savez(t / "tok.npz", ids=np.arange(5000) % 256) or t / "tok.npz")],
                              2, [".npz", ".npy"], []),
    "data-npy-upper-case-suffix": lambda t, w: (["--data", npy(t / "tok.NPY", (np.arange(5000) % 256).astype(np.uint16)),
                                                 "--out", t / "o"], 0, [], [t / "o"]),
    "data-json-array": lambda t, w: (["--data", (lambda p: p.write_text(json.dumps([{"prompt": "a", "completion": "b"}]))
                                                 and p)(t / "sft.json")], 2, [".jsonl"], []),
    "tokenizer-config-not-json": _hf_with(lambda d, t: (d / "tokenizer_config.json").write_text("{not json")
                                          and ["tokenizer_config.json"]),
    "resume-other-chat-format": _resume_other_chat_format,
    "resume-other-init-from": _resume_other_init_from,
    "resume-data-changed": _resume_data_changed,
    "max-context-without-plan": lambda t, w: (["--max-context", "--out", t / "o"], 0, [], [],
                                              dict(check=lambda r, t: "longest context" in r.stdout
                                                   and not (t / "o").exists())),
    "reference-with-checkpoint-flags": lambda t, w: (["--engine", "reference", "--save-every", "1", "--keep", "1"],
                                                     2, ["--engine reference"], []),
    "leftover-rank-1": lambda t, w: ([], 2, ["RANK"], [], dict(env=dict(RANK="1"))),
    "plan-host-mem-1e308": lambda t, w: (["--plan", "--json", "--host-mem", "1e308"], 2, ["--host-mem"], []),
    # ---- round 2: tracebacks before
    "data-jsonl-nested-deep": lambda t, w: (["--data", _chat_rows(t, ["[" * 100_000 + "]" * 100_000])], 2,
                                            ["c.jsonl:1", "nested"], []),
    "data-lone-surrogate-through-a-tokenizer": _hf_with(lambda d, t: _chat_rows(t, [
        '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "yo"}]}'])
        and ["surrogate"], data="c.jsonl"),
    "index-weight-map-a-list": _hf_with(lambda d, t: (d / "model.safetensors.index.json").write_text(
        '{"weight_map": []}') and ["weight_map"]),
    "index-null": _hf_with(lambda d, t: (d / "model.safetensors.index.json").write_text("null") and ["index"]),
    "init-from-a-billion-layers": _init_from_config(num_hidden_layers=10 ** 9),
    "n-layer-a-billion": lambda t, w: (["--n-layer", str(10 ** 9)], 2, ["n_layer"], []),
    "n-layer-a-billion-plan": lambda t, w: (["--n-layer", str(10 ** 9), "--plan"], 2, ["n_layer"], []),
    "host-mem-above-this-machine": lambda t, w: (["--host-mem", "100000"], 2, ["--host-mem"], []),
    "out-component-too-long": lambda t, w: (["--out", t / ("x" * 300)], 2, ["--out", "255"], []),
    "out-path-too-long": lambda t, w: (["--out", t / "/".join(["d" * 20] * 250)], 2, ["--out", "bytes long"], []),
    "resume-newest-meta-gone": _resume_newest_meta_gone,
    "out-holds-an-empty-ckpt": _out_with_empty_ckpt,
    "resume-sft-data-shrunk": _resume_sft_shrunk,
    "resume-data-spelled-otherwise": _resume_data_spelled_otherwise,
    "out-holds-a-file-named-ckpt": _out_with_a_file_named_ckpt,
    "sample-prompt-empty": lambda t, w: (["--sample-prompt", ""], 2, ["--sample-prompt", "empty"], []),
    "world-size-without-torchrun": lambda t, w: ([], 2, ["WORLD_SIZE", "torchrun"], [], dict(env=dict(WORLD_SIZE="2"))),
    "rank-not-a-number": lambda t, w: ([], 2, ["RANK"], [], dict(env=dict(RANK="abc"))),
    "rank-1-into-a-finished-run": lambda t, w: (["--out", copy(w / "run", t / "run")], 2, ["RANK"], [],
                                                dict(env=dict(RANK="1"))),
    # ---- round 2: hangs before
    "chat-template-writes-100-mb": _hf_with(lambda d, t: (d / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}") and ["chat_template", "characters"]),
    "batch-size-1e11": lambda t, w: (["--batch-size", str(10 ** 11)], 2, ["--batch-size"], []),
    "plan-batch-size-1e12": lambda t, w: (["--plan", "--batch-size", str(10 ** 12)], 2, ["--batch-size"], []),
    "plan-host-bw-1e-300": lambda t, w: (["--plan", "--host-bw", "1e-300"], 2, ["--host-bw"], []),
    "plan-batch-and-seq-1e18": lambda t, w: (["--plan", "--batch-size", str(10 ** 18), "--seq-len", str(10 ** 18)], 2,
                                             ["--batch-size"], []),
    "plan-huge-but-allowed": lambda t, w: (["--plan", "--json", "--batch-size", str(1 << 24), "--seq-len",
                                            str(1 << 30)], 0, [], []),
    # ---- round 2: messages that misled
    "data-fifo": lambda t, w: (["--data", _fifo(t)], 2, ["pipe.txt", "not a regular file"], []),
    "data-roles-capitalised": lambda t, w: (["--data", _chat_rows(t, [{"messages": [
        {"role": "User", "content": "hi"}, {"role": "Assistant", "content": "yo"}]}])], 2, ["lower-case"], []),
    "data-every-answer-past-seq-len": lambda t, w: (["--data", _chat_rows(t, [{"messages": [
        {"role": "user", "content": "q" * 200}, {"role": "assistant", "content": "yo"}]}] * 4)], 2,
        ["raise --seq-len"], []),
    "architectures-a-string": lambda t, w: (_init_from_config(architectures="LlamaForCausalLM")(t, w)[0], 0, [],
                                            [t / "o"]),
    "tokenizer-of-another-vocabulary": _hf_with(_other_vocab_tokenizer, data="zebra.txt"),
    "chat-template-not-utf8": _hf_with(lambda d, t: (d / "chat_template.jinja").write_bytes(b"{{ '\xff\xfe' }}")
                                       and ["chat_template.jinja", "UTF-8"]),
    "init-from-a-run-directory": lambda t, w: (["--init-from", copy(w / "run", t / "run"), "--out", t / "o"], 2,
                                               ["ckpt-00000002"], []),
    "resume-damaged-newest-checkpoint": _resume_damaged_newest,
    "out-metrics-is-a-directory": _record_is_a_directory("metrics.jsonl"),
    "out-config-is-a-directory": _record_is_a_directory("config.json"),
    "seq-len-a-billion": lambda t, w: (["--seq-len", str(10 ** 9), "--max-seq-len", str(10 ** 9)], 2,
                                       ["Try --seq-len"], []),
    "seed-2-to-the-64": lambda t, w: (["--seed", str(2 ** 64)], 2, ["--seed"], []),
    "save-hf-dot": lambda t, w: (["--save-hf", ".", "--out", t / "o"], 2, ["--save-hf"], []),
    "save-hf-dot-out-elsewhere": lambda t, w: (["--save-hf", ".", "--out", Path(tempfile.mkdtemp()) / "o"], 2,
                                               ["--save-hf", "current directory"], []),
    "out-dangling-symlink": _dangling_out,
    "resume-a-run-that-never-saved": _resume_never_saved,
}


# ---- round 3: prepare, --data DIR, tokenizers in checkpoints, export, the launcher, GPU flags on a CPU machine
def _flip_id(f, value=999):
    """Write token id `value` over the last id of the .npy token file f (sizes unchanged: bit rot)."""
    raw = bytearray(f.read_bytes())
    raw[-2:] = value.to_bytes(2, "little")
    f.write_bytes(bytes(raw))


def _prepared(name, fn=None):
    """A copy of world's prepared directory `name` changed by fn(dir); train on it."""
    def setup(t, w):
        d = copy(w / name, t / name)
        words = fn(d) if fn else []
        return ["--data", d], 2, words, []
    return setup


def _same_size_other_ids(d):
    ids = np.load(d / "train.npy")
    npy(d / "train.npy", np.ascontiguousarray(ids[::-1]))     # another file, the same size and dtype
    return ["train.npy", "sha256"]


def _kind_edited(d):
    edit_json(d / "meta.json", kind="sft")
    return ["meta.json", "kind 'sft'"]


def _prep(t, *args, inputs=None, words=(), code=2, **extra):
    """python -m megatrain_min.prepare INPUTS ARGS (default input: a copy of world's lines.txt)."""
    if inputs is None:
        inputs = [copy(Path(extra.pop("world")) / "lines.txt", t / "lines.txt")]
    return [*inputs, *args], code, list(words), [], dict(module=PREPARE, **extra)


def _ckpt_with(fn, run="sft"):
    """A copy of world's run `run`'s newest checkpoint, changed by fn(ck)."""
    def made(t, w):
        ck = copy(w / run / "ckpt-00000002", t / "ck")
        fn(ck)
        return ck
    return made


def _swap_two_tokens(ck):
    """tokenizer.json of the same vocabulary size but another mapping: two tokens' ids swapped."""
    doc = json.loads((ck / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (ck / "tokenizer.json").write_text(json.dumps(doc))


def _init_from_ckpt(fn, words):
    return lambda t, w: (["--init-from", _ckpt_with(fn)(t, w), "--data", w / "chat.jsonl", "--seq-len", "64"],
                         2, words, [])


def _export(fn, words, run="sft", out="exp"):
    def setup(t, w):
        ck = _ckpt_with(fn, run)(t, w)
        return ["export", ck, t / out], 2, words, [], dict(module=HF, check=lambda r, t: not (t / out).exists())
    return setup


def _export_into_checkpoint(t, w):
    run = copy(w / "run", t / "run")
    ck = run / "ckpt-00000002"
    return ["export", ck, ck / "hf"], 2, ["inside checkpoint", "--keep", "run-hf"], [], dict(module=HF)


def _save_hf_into_checkpoint(t, w):
    run = copy(w / "run", t / "run")
    return ["--steps", "3", "--resume", "--out", run, "--save-hf", run / "ckpt-00000002" / "hf"], 2, \
        ["--save-hf", "inside checkpoint"], []


def _export_damaged(t, w):
    run = copy(w / "run", t / "run")
    unit = run / "ckpt-00000002" / "layer.1.bin"
    raw = bytearray(unit.read_bytes())
    raw[100] ^= 0xFF
    unit.write_bytes(bytes(raw))
    return ["export", run / "ckpt-00000002", t / "exp"], 2, ["layer.1.bin", "ckpt-00000001"], [], dict(module=HF)


def _inode_kept(d, *files):
    """check(r, t): directory d is the same directory as before (not replaced) and holds `files`."""
    ino = d.stat().st_ino
    return lambda r, t: d.stat().st_ino == ino and all((d / f).is_file() for f in files)


def _empty_dir(t, name="empty"):
    (t / name).mkdir()
    return t / name


def _mounted(t):
    """A tmpfs mounted at t/mnt (root only; skipped where mounting is not allowed): (its path, unmount)."""
    m = _empty_dir(t, "mnt")
    if subprocess.run(["mount", "-t", "tmpfs", "none", str(m)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not allowed here")
    return m, lambda: subprocess.run(["umount", "-l", str(m)], check=True)


def _to_mount(kind):
    def setup(t, w):
        m, umount = _mounted(t)
        done = _inode_kept(m, "meta.json" if kind == "prepare" else hf.EXPORT_MARKER)
        if kind == "prepare":
            return _prep(t, "--out", m, world=w, code=0, check=done, after=umount)
        if kind == "export":
            return ["export", w / "run" / "ckpt-00000002", m], 0, [], [], dict(module=HF, check=done, after=umount)
        return ["--save-hf", m], 0, [], [], dict(check=done, after=umount)
    return setup


def _resume_lock_held(t, w):
    """A run still holds --out's lock and has saved no checkpoint yet (the ranks of a launcher that was SIGKILLed,
    say): --resume names the run that holds it, not "remove its config.json and metrics.jsonl"."""
    (t / "o").mkdir()
    (t / "o" / "config.json").write_text('{"run": "abc", "args": {}}\n')
    (t / "o" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5, "lr": 0.001, "tokens_per_s": 100.0}\n')
    held = runlock.lock(t / "o")
    return ["--resume", "--out", t / "o"], 2, ["in use by another run", f"pid {os.getpid()}"], [], \
        dict(after=held.close)


def _resume_after_preparing_again(t, w):
    """The run's data prepared again from the same text (another time, other sources' paths): the same ids."""
    copy(w / "run-prep", t / "run-prep")
    prepare.prepare([copy(w / "lines.txt", t / "text-again.txt")], t / "prep")
    return ["--steps", "3", "--resume", "--out", t / "run-prep", "--data", "prep"], 0, [], [t / "run-prep"]


def _resume_sft_ckpt_tokenizer_corrupt(t, w):
    argv = _in_place("sft", "chat.jsonl", None)(t, w)
    with open(t / "sft" / "ckpt-00000002" / "tokenizer.json", "a") as f:
        f.write(" ")
    return argv, 2, ["ckpt-00000002/tokenizer.json is not the file"], []


def _resume_sft_without_init_from(t, w):
    argv = _in_place("sft", "chat.jsonl", None)(t, w)
    return argv[:-4] + ["--seq-len", "64"], 2, ["--init-from"], []


CLI.update({
    # lost
    "export-into-its-own-checkpoint": _export_into_checkpoint,
    "save-hf-into-a-checkpoint": _save_hf_into_checkpoint,
    # tracebacks
    "prepare-a-60-mb-line": lambda t, w: _prep(t, "--out", t / "p", "--tokenizer", w / "hf", inputs=[
        (lambda f: f.write_bytes(b"x" * 60_000_000 + b"\n") and f)(t / "long.txt")], words=["long.txt", "8 MiB"],
        check=lambda r, t: not (t / "p").exists() and not list(t.glob(".tmp-*"))),
    "prepared-ids-bit-rot": _prepared("prep", lambda d: _flip_id(d / "train.npy") or ["train.npy", "prepare"]),
    "sample-to-an-ascii-stdout": lambda t, w: (["--sample-tokens", "20", "--sample-prompt", "naïve café"], 0, [], [],
                                               dict(env={"PYTHONIOENCODING": "ascii"},
                                                    check=lambda r, t: "\\ufffd" in r.stdout)),
    "prepare-to-an-ascii-stdout": lambda t, w: _prep(t, "--out", t / "données", world=w, code=0,
                                                     env={"PYTHONIOENCODING": "ascii"},
                                                     check=lambda r, t: (t / "données" / "meta.json").is_file()),
    # silent
    "chat-format-fixed-on-a-native-directory": lambda t, w: (
        ["--init-from", w / "hf-chat", "--data", w / "prep-sft", "--seq-len", "64", "--chat-format", "fixed"], 2,
        ["--chat-format fixed", "native"], []),
    "init-from-ckpt-tokenizer-replaced": _init_from_ckpt(_swap_two_tokens, ["tokenizer.json", "sha256"]),
    "init-from-ckpt-without-tokenizer-config": _init_from_ckpt(lambda ck: (ck / "tokenizer_config.json").unlink(),
                                                               ["tokenizer_config.json is missing"]),
    "export-corrupt-tokenizer-json": _export(lambda ck: (ck / "tokenizer.json").write_text('{"model": 17}'),
                                             ["tokenizer.json"]),
    "export-tokenizer-config-not-json": _export(lambda ck: (ck / "tokenizer_config.json").write_text("{not json"),
                                                ["tokenizer_config.json"]),
    "prepare-out-dot": lambda t, w: _prep(t, "--out", ".", world=w, code=0, cwd=_empty_dir(t, "here"),
                                          check=_inode_kept(t / "here", "meta.json", "train.npy")),
    "prepare-val-fraction-1e-9": lambda t, w: _prep(t, "--out", t / "p", "--val-fraction", "1e-9", world=w,
                                                    words=["val split is empty", "--val-fraction"]),
    "prepared-foreign-train-npy-same-size": _prepared("prep", _same_size_other_ids),
    "max-context-on-a-training-run": lambda t, w: (["--max-context", "--save-every", "1"], 0, [], [], dict(
        check=lambda r, t: "--max-context plans the run and trains nothing: --save-every is not used" in r.stderr
        and "longest context" in r.stdout and not (t / "out").exists())),
    # misleading
    "prepare-out-a-mount-point": _to_mount("prepare"),
    "export-to-a-mount-point": _to_mount("export"),
    "save-hf-to-a-mount-point": _to_mount("save-hf"),
    "prepare-out-an-empty-dir": lambda t, w: _prep(t, "--out", _empty_dir(t), world=w, code=0,
                                                   check=_inode_kept(t / "empty", "meta.json")),
    "export-to-dot": lambda t, w: (["export", w / "run" / "ckpt-00000002", "."], 0, [], [],
                                   dict(module=HF, cwd=_empty_dir(t, "here"),
                                        check=_inode_kept(t / "here", hf.EXPORT_MARKER, "config.json"))),
    "save-hf-an-empty-dir": lambda t, w: (["--save-hf", _empty_dir(t)], 0, [], [],
                                          dict(check=_inode_kept(t / "empty", hf.EXPORT_MARKER))),
    "resume-while-another-run-holds-the-lock": _resume_lock_held,
    "resume-after-preparing-the-same-data-again": _resume_after_preparing_again,
    "resume-ckpt-tokenizer-corrupt": _resume_sft_ckpt_tokenizer_corrupt,
    "prepare-one-line-corpus": lambda t, w: _prep(t, "--out", t / "p", inputs=[_file(t, "one.txt")],
                                                  words=["one line", "break the text into lines"]),
    "prepare-tokenizer-is-its-json-file": lambda t, w: _prep(t, "--out", t / "p", "--tokenizer",
                                                             w / "hf" / "tokenizer.json", world=w,
                                                             words=["is a file", f"--tokenizer {w / 'hf'}"]),
    "prepare-tokenizer-a-run-directory": lambda t, w: _prep(t, "--out", t / "p", "--tokenizer", w / "sft", world=w,
                                                            words=["training run", "ckpt-00000002"]),
    "prepare-input-a-directory": lambda t, w: _prep(t, "--out", t / "p", inputs=[_empty_dir(t, "corpus")],
                                                    words=["corpus is a directory"]),
    "prepare-out-empty-string": lambda t, w: _prep(t, "--out", "", world=w, words=["--out is an empty path"]),
    "prepared-with-a-tokenizer-without-init-from": _prepared("prep-hf", lambda d: ["--init-from"]),
    "prepared-kind-edited": _prepared("prep", _kind_edited),
    "resume-sft-without-init-from": _resume_sft_without_init_from,
    "export-damaged-names-the-one-before": _export_damaged,
    "nproc-per-node-a-million": lambda t, w: (["--nproc-per-node", "1000000"], 2, ["--nproc-per-node", "1,024"], []),
    "plan-h200-with-device-cuda": lambda t, w: (["--plan", "--hardware", "h200", "--device", "cuda"], 0, [], [],
                                                dict(check=lambda r, t: "verdict on h200" in r.stdout)),
    "sample-prompt-not-utf8": lambda t, w: (["--sample-prompt", "ab\udcff"], 2, ["--sample-prompt", "0xff"], []),
    "sample-prompt-not-utf8-sft": lambda t, w: (["--init-from", w / "hf", "--data", w / "chat.jsonl", "--seq-len", "64",
                                                 "--sample-prompt", "\udcffhi"], 2, ["--sample-prompt", "UTF-8"], []),
    "host-mem-out-of-range-in-whole-numbers": lambda t, w: (["--plan", "--host-mem", "10000001"], 2,
                                                            ["--host-mem 10,000,001", "at most 10,000,000"], []),
})


# ---- round 4: names read from files we did not write (a crafted list must never remove or read elsewhere)
def _outside(t):
    """A user's files beside the target: what a crafted list names as ../notes.txt and ../mydocs."""
    (t / "notes.txt").write_text("my notes\n")
    (t / "mydocs").mkdir()
    (t / "mydocs" / "a.txt").write_text("a document\n")


def _crafted_prepared(t, w):
    """prepare --force onto a prepared directory whose meta.json lists ../notes.txt and ../mydocs."""
    _outside(t)
    d = copy(w / "prep", t / "p")
    doc = json.loads((d / "meta.json").read_text())
    doc["files"].update({"../notes.txt": 9, "../mydocs": 4096})
    (d / "meta.json").write_text(json.dumps(doc))
    return _prep(t, "--out", d, "--force", world=w, words=["../notes.txt", "nothing was changed"])


def _crafted_marker(t, out, listed):
    """A copy of world's export at t/out whose marker also lists `listed`."""
    _outside(t)
    d = t / out
    doc = json.loads((d / hf.EXPORT_MARKER).read_text())
    doc["files"] += listed
    (d / hf.EXPORT_MARKER).write_text(json.dumps(doc))
    return d


def _export_over_crafted_marker(t, w):
    copy(w / "hf", t / "exp")
    _crafted_marker(t, "exp", ["../notes.txt", "../mydocs"])
    return ["export", w / "run" / "ckpt-00000002", t / "exp"], 2, ["../notes.txt"], [], dict(module=HF)


def _save_hf_over_crafted_marker(t, w):
    copy(w / "hf", t / "exp")
    _crafted_marker(t, "exp", ["../notes.txt"])
    return ["--save-hf", t / "exp"], 2, ["--save-hf", "../notes.txt"], []


def _export_over_a_symlink_out(t, w):
    """The marker lists a name that is a symlink leading out of the export: refused, not followed."""
    copy(w / "hf", t / "exp")
    _crafted_marker(t, "exp", ["notes-link"])
    (t / "exp" / "notes-link").symlink_to(t / "notes.txt")
    return ["export", w / "run" / "ckpt-00000002", t / "exp"], 2, ["notes-link", "outside"], [], dict(module=HF)


def _ckpt_tokenizer_lists_outside(ck):
    """A checkpoint whose meta.json (CRC recomputed) lists a tokenizer file ../notes.txt."""
    (ck.parent / "notes.txt").write_text("my notes\n")
    edit_meta(ck, lambda doc: doc["tokenizer"]["files"].append("../notes.txt"))


CLI.update({
    # lost (a security defect: a received directory was enough)
    "prepare-force-over-a-crafted-file-list": _crafted_prepared,
    "export-over-a-crafted-marker": _export_over_crafted_marker,
    "save-hf-over-a-crafted-marker": _save_hf_over_crafted_marker,
    "export-over-a-marker-listing-a-symlink-out": _export_over_a_symlink_out,
    "init-from-ckpt-listing-a-tokenizer-file-outside": _init_from_ckpt(_ckpt_tokenizer_lists_outside,
                                                                      ["../notes.txt"]),
})

# ---- round 4, the rest: the unit flags, --mode and --host-mem, the moved prepare, the tools (sim, twin_vs_plan,
# trace_extract, lesson 11), environment variables, checkpoints across layouts
SIM, DATA = "megatrain_min.sim", "megatrain_min.data"     # python -m SIM check|timeline ..., python -m DATA ...
BEATS = launch.HEARTBEAT_ENV
RANKS = {"OMP_NUM_THREADS": "1"}                            # --nproc-per-node 2 on a shared CPU


def _unmade(*names):
    """check(r, t): none of `names` (under t) was made -- a refusal that writes nothing."""
    return lambda r, t: not any((t / n).exists() for n in names)


def _sim(*argv, words=(), **extra):
    """python -m megatrain_min.sim ARGV, refused."""
    return [*argv], 2, list(words), [], dict(module=SIM, **extra)


def _trace(name, data=None):
    """bench/trace_extract.py TRACE OUT, the trace holding `data` (None: not there): one line naming it (a bench
    tool's refusal: exit 1), OUT not written."""
    def setup(t, w):
        if data is not None:
            (t / name).write_bytes(data)
        return [t / name, t / "x.json"], 1, [name], [], dict(script="bench/trace_extract.py", check=_unmade("x.json"))
    return setup


def _truncated_trace():
    """A gzipped Chrome trace cut short (a copy that stopped)."""
    events = [{"ph": "X", "cat": "kernel", "name": "k", "pid": 1, "tid": 7, "ts": i, "dur": 1} for i in range(2000)]
    return gzip.compress(json.dumps({"traceEvents": events}).encode())[:-64]


def _results(text):
    """bench/twin_vs_plan.py --measured DIR, DIR/results.json holding `text`: one line naming it, nothing written."""
    def setup(t, w):
        (t / "run").mkdir()
        (t / "run" / "results.json").write_text(text)
        return ["--measured", t / "run"], 1, ["results.json"], [], dict(script="bench/twin_vs_plan.py",
                                                                         check=_unmade("run/twin_vs_plan.md"))
    return setup


def _lesson_11_alone(t, w):
    """Lesson 11 copied out of the repository (to a reader's own folder): its extract is not there."""
    (t / "tutorials").mkdir()
    lesson = copy(ROOT / "tutorials" / "11_a_real_gpu_step.py", t / "tutorials" / "11_a_real_gpu_step.py")
    return [], 1, ["trace_extract.json"], [], dict(script=lesson)


def _beats(value):
    """--nproc-per-node 2 with MEGATRAIN_MIN_HEARTBEAT_S=value: refused before any rank starts."""
    return lambda t, w: (["--nproc-per-node", "2"], 2, [f"{BEATS}={value!r}"], [], dict(env={BEATS: value, **RANKS}))


def _keep_over_a_symlinked_checkpoint(t, w):
    """A checkpoint moved to another disk, a symlink left in its place: --keep 1 removes the link, never what it leads
    to (watched), and leaves no hidden .tmp-del-* behind."""
    run = copy(w / "run", t / "run")
    (t / "disk2").mkdir()
    shutil.move(run / "ckpt-00000001", t / "disk2" / "ckpt-00000001")
    (run / "ckpt-00000001").symlink_to(t / "disk2" / "ckpt-00000001")

    def clean(r, t):
        return sorted(p.name for p in (t / "run").iterdir() if p.name.startswith((".tmp-", "ckpt-"))) == \
            ["ckpt-00000003"] and "a symbolic link" in r.stderr
    return ["--steps", "3", "--resume", "--out", run, "--save-every", "1", "--keep", "1"], 0, [], [run], \
        dict(check=clean)


def _resume_its_meta_json(t, w):
    run = copy(w / "run", t / "run")
    return ["--steps", "3", "--resume", run / "ckpt-00000002" / "meta.json", "--out", run], 2, \
        ["is a file", f"--resume {run / 'ckpt-00000002'}"], []


def _ran(*said, absent=()):
    """check(r, t): the run (or plan) said every line of `said` on stdout/stderr and none of `absent`."""
    return lambda r, t: all(s in r.stdout + r.stderr for s in said) and not any(a in r.stdout for a in absent)


SEVEN = ["--config", "7b", "--plan", "--hardware", "h100"]
CLI.update({
    # tracebacks
    "sim-check-7b-memory-first": lambda t, w: _sim("check", "--config", "7b", "--host-mem", "8",
                                                   words=["--config 7b", "host RAM", "--host-mem 8"],
                                                   memory=8 << 30),   # the old code allocated until it failed
    "sim-timeline-host-speed-zero": lambda t, w: _sim("timeline", "--host-speed", "0", words=["--host-speed"]),
    "sim-timeline-one-step": lambda t, w: _sim("timeline", "--steps", "1", words=["--steps 1", "at least 2"]),
    "sim-timeline-trace-into-a-missing-dir": lambda t, w: _sim("timeline", "--trace", t / "nope" / "t.json",
                                                               words=["--trace", "nope"], check=_unmade("nope")),
    "twin-vs-plan-garbage-results": _results("not json {"),
    "twin-vs-plan-results-not-a-gpu-run": _results("{}"),
    "trace-extract-missing": _trace("nope.json"),
    "trace-extract-garbage": _trace("g.json", b"\x00\xffgarbage"),
    "trace-extract-empty-gz": _trace("e.json.gz", b""),
    "trace-extract-truncated-gz": _trace("t.json.gz", _truncated_trace()),
    "lesson-11-without-its-extract": _lesson_11_alone,
    # silent
    "data-prepare-the-moved-command": lambda t, w: (["prepare", copy(w / "text.txt", t / "text.txt"), "--out", t / "o"],
                                                    2, ["python -m megatrain_min.prepare"], [],
                                                    dict(module=DATA, check=_unmade("o"))),
    "reference-with-unit-flags": lambda t, w: (["--engine", "reference", "--resident-units", "3",
                                                "--gpu-updated-units", "2"], 2, ["--engine reference",
                                                                                 "--resident-units 3"], []),
    "plan-gpus-2-resident-units": lambda t, w: (["--plan", "--gpus", "2", "--resident-units", "3"], 2,
                                                ["--resident-units 3", "sharded"], []),
    "sim-check-steps-negative": lambda t, w: _sim("check", "--steps", "-1", words=["--steps -1"]),
    "sim-timeline-host-speed-negative": lambda t, w: _sim("timeline", "--host-speed", "-1", words=["--host-speed"]),
    "heartbeat-zero": _beats("0"),
    "heartbeat-negative": _beats("-5"),
    "heartbeat-not-a-number": _beats("ten"),
    # misleading
    "plan-gpu-updated-units-1000-on-7b": lambda t, w: (SEVEN + ["--batch-size", "32", "--seq-len", "128",
                                                                "--gpu-updated-units", "1000"], 0, [], [],
                                                       dict(check=_ran("-> FITS", "beside the step and the GPU upd"))),
    "nproc-per-node-2-resident-units": lambda t, w: (["--nproc-per-node", "2", "--resident-units", "2"], 2,
                                                     ["--resident-units 2"], [], dict(env=RANKS)),
    "resident-6-gpu-updated-3-on-the-toy": lambda t, w: (["--resident-units", "6", "--gpu-updated-units", "3", "--out",
                                                          t / "o"], 0, [], [t / "o"], dict(check=_ran(
                                                              "warning: --gpu-updated-units 3: no unit streams"))),
    "max-context-resident-units-1000": lambda t, w: (SEVEN + ["--max-context", "--batch-size", "1", "--resident-units",
                                                              "1000"], 2, ["--max-context", "--resident-units 1000",
                                                                           "Try --resident-units"], []),
    "plan-resident-units-1000-names-fewer": lambda t, w: (SEVEN + ["--batch-size", "1", "--resident-units", "1000"], 0,
                                                          [], [], dict(check=_ran("fits: --resident-units",
                                                                                  absent=["--config 1b"]))),
    "host-mem-half-a-gb": lambda t, w: (["--host-mem", "0.5"], 2, ["--host-mem 0.5 (GB)", "Try --host-mem"], []),
    "prepare-val-fraction-0": lambda t, w: _prep(t, "--out", t / "p", "--val-fraction", "0", world=w,
                                                 words=["--val-fraction 0", "> 0"], check=_unmade("p")),
    # MEGATRAIN_MIN_HEARTBEAT_S=0.001 (a warning, 5 s used): test_nothing_lost.py's frozen rank asks for it
    "keep-1-over-a-symlinked-checkpoint": _keep_over_a_symlinked_checkpoint,
    "resume-its-meta-json": _resume_its_meta_json,
    "resident-units-above-the-units": lambda t, w: (["--resident-units", "100", "--gpu-updated-units", "1000000",
                                                     "--out", t / "o"], 0, [], [t / "o"], dict(check=_ran(
                                                         "warning: --resident-units 100 is more than the 6 units"))),
    "plan-counts-above-the-units": lambda t, w: (["--plan", "--hardware", "h100", "--resident-units", "100"], 0, [], [],
                                                 dict(check=_ran("6 of 6 units (--resident-units 100 asked",
                                                                 "warning: --resident-units 100"))),
    "cpu-run-says-the-device": lambda t, w: (["--device", "cpu", "--out", t / "o"], 0, [], [t / "o"],
                                             dict(check=_ran("resident on the device", absent=["on the GPU"]))),
})


def verdict(r, before, code, words, unmade=None):
    if lost(before):
        return "data lost"
    if "Traceback" in r.stderr:
        return "traceback"
    if r.returncode != code:
        return "silent" if r.returncode == 0 else "other"
    lines = r.stderr.strip().splitlines()
    if code and (len(lines) != 1 or not all(str(w) in lines[0] for w in words)):
        return "other"
    if code and unmade is not None and unmade.exists():   # refused, yet it made its --out
        return "other"
    return "clean"


@pytest.mark.parametrize("name", CLI)
def test_cli(name, world, cli, tmp_path):
    argv, code, words, unwatched, *extra = CLI[name](tmp_path, world)
    extra = extra[0] if extra else {}
    try:
        before = {p: b for p, b in files_under(tmp_path).items() if not any(p.is_relative_to(u) for u in unwatched)}
        tool = "module" in extra or "script" in extra     # not train.py: the command's own flags alone
        out = [] if "--out" in argv or tool else ["--out", tmp_path / "out"]
        r = cli(*([] if tool else TINY), *out, *argv, cwd=extra.get("cwd", tmp_path), env=extra.get("env"),
                module=extra.get("module"), script=extra.get("script", "train.py"), memory=extra.get("memory"))
        v = verdict(r, before, code, words, tmp_path / "out" if out else None)
        if v == "clean" and "check" in extra and not extra["check"](r, tmp_path):
            v = "silent"
    finally:
        extra.get("after", lambda: None)()
    if v == "clean" and name == "resume-torn-metrics-line":   # and the log continues where the checkpoint was
        steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        v = "clean" if steps == [1, 2, 3] else "silent"
    assert v == "clean", f"verdict={v}: exit {r.returncode}\n{r.stderr[-2000:]}"


# ----------------------------------------------------------------------------- two commands into one output at once
def _export_whole(d):
    """d holds one whole export: its marker lists exactly the files there, nothing staged is left anywhere."""
    listed = json.loads((d / hf.EXPORT_MARKER).read_text())["files"]
    return sorted(p.name for p in d.iterdir()) == sorted(listed + [hf.EXPORT_MARKER]) and \
        not list(d.parent.glob(".tmp-*"))


def _hold_while(run, t, pattern, out, timeout=30):
    """SIGSTOP `run` once `pattern` appears in t (its staging directory; its first step), before it made `out`:
    True when it is held so, False when it made out first (it is then left to finish)."""
    deadline = time.time() + timeout
    while not list(t.glob(pattern)) and not out.exists() and time.time() < deadline:
        time.sleep(0.0005)
    os.kill(run.pid, signal.SIGSTOP)
    if list(t.glob(pattern)) and not out.exists():
        return True
    os.kill(run.pid, signal.SIGCONT)
    return False


def _two_prepares(t, w):
    """Two prepares of different text into one --out (through a tokenizer: long enough to overlap)."""
    for name, word in (("a.txt", "alpha"), ("b.txt", "beta")):
        (t / name).write_text(f"What is {word} plus {word}? Four.\n" * 30000)
    argv = [[t / n, "--out", t / "p", "--tokenizer", w / "hf"] for n in ("a.txt", "b.txt")]

    def whole(t):
        return prepared.PreparedTokens(t / "p").meta["sources"][0]["path"] in (str(t / "a.txt"), str(t / "b.txt"))
    return argv, dict(module=PREPARE), whole


AT_ONCE = {  # name: setup(tmp, world) -> ([argv of each], how to run them, whole(tmp): the output is one whole result)
    "two-prepares-into-one-out": _two_prepares,
    # an export takes milliseconds: the first is held (SIGSTOP) while it writes, and the second runs then
    "two-exports-into-one-dir": lambda t, w: ([["export", w / "sft" / f"ckpt-0000000{k}", t / "exp"] for k in (1, 2)],
                                              dict(module=HF, hold=(".tmp-exp-*", t / "exp")),
                                              lambda t: _export_whole(t / "exp")),
    # the first is held while it trains (both checked the new directory at their start), the second exports
    "two-runs-save-hf-into-one-new-dir": lambda t, w: (
        [[*TINY, "--steps", str(s), "--seed", str(k), "--out", t / f"o{k}", "--save-hf", t / "exp"]
         for k, s in ((0, 20), (1, 2))], dict(hold=("o0/metrics.jsonl", t / "exp")),
        lambda t: _export_whole(t / "exp")),
    # round 4: --nproc-per-node's ranks start seconds after its checks; the launcher is held between the two (its
    # checks made --out) while another run exports: the ranks took what --save-hf held then, and replaced it
    "a-2-rank-run-and-another-save-hf-into-one-new-dir": lambda t, w: (
        [[*TINY, "--nproc-per-node", "2", "--out", t / "o0", "--save-hf", t / "exp"],
         [*TINY, "--seed", "1", "--out", t / "o1", "--save-hf", t / "exp"]],
        dict(hold=("o0", t / "exp"), env={"OMP_NUM_THREADS": "1"}), lambda t: _export_whole(t / "exp")),
}


@pytest.mark.parametrize("name", AT_ONCE)
def test_at_once(name, world, cli, tmp_path):
    """Both start at the same moment: one wins (exit 0) and the other is refused (exit 2, one line) -- before it
    writes, or at the end, having replaced nothing; the output is the winner's, whole. Both exiting 0 means one
    result replaced the other: lost."""
    argv, how, whole = AT_ONCE[name](tmp_path, world)
    hold = how.pop("hold", None)
    for attempt in range(3):
        first = cli.start(*argv[0], cwd=tmp_path, **how)
        if hold is None or _hold_while(first, tmp_path, *hold):
            break
        cli.wait(first)                                   # it finished before it could be held: again
        shutil.rmtree(hold[1])
    else:
        pytest.fail("the first command finished before it could be held, three times")
    second = cli.start(*argv[1], cwd=tmp_path, **how)
    if hold is not None:                                  # the first waits, held, until the second is done
        second = cli.wait(second)
        os.kill(first.pid, signal.SIGCONT)
    rs = [cli.wait(first), second if hold is not None else cli.wait(second)]
    codes = sorted(r.returncode for r in rs)
    refused = [r for r in rs if r.returncode]
    v = ("traceback" if any("Traceback" in r.stderr for r in rs) else "data lost" if codes == [0, 0] else
         "other" if codes != [0, 2] or len(refused[0].stderr.strip().splitlines()) != 1 else
         "clean" if whole(tmp_path) else "data lost")
    said = "\n".join(r.stderr[-600:] + r.stdout[-600:] for r in rs)
    assert v == "clean", f"verdict={v}: exits {[r.returncode for r in rs]}\n{said}"


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
    hf_load.load_hf(tmp / "exp")


def _export_appeared_meanwhile(tmp):
    """Two runs export to the same new directory: the one that finishes second replaces nothing."""
    state = hf.export_state(tmp / "exp")                          # a run starts: nothing there
    hf.save_hf(CFG, w0(), tmp / "exp", dtype=torch.float32)        # another run's export lands meanwhile
    theirs = files_under(tmp)
    try:
        hf.save_hf(CFG, w0(), tmp / "exp", dtype=torch.float32, replaces=state)
    finally:
        assert not lost(theirs), "data lost"


def _template_that_loops(tmp):
    from megatrain_min.data import chat
    old, chat.RENDER_S = chat.RENDER_S, 0.5
    try:
        chat.render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                    [{"role": "user", "content": "hi"}], {})
    finally:
        chat.RENDER_S = old


def _data_unreadable(tmp):
    """Mode 000 (root reads anyway: the read itself is made to fail as it would)."""
    from unittest import mock
    from megatrain_min.data import corpus
    (tmp / "d.txt").write_text("hello " * 1000)
    with mock.patch("pathlib.Path.read_bytes", side_effect=PermissionError(13, "Permission denied", str(tmp))):
        corpus.open_data(tmp / "d.txt", CFG, 2, 16)


def _rendezvous_nobody_comes(tmp):
    """WORLD_SIZE=2 RANK=0 by hand, no second rank: gives up after RENDEZVOUS, in one line."""
    import datetime
    import os
    import socket
    from unittest import mock
    from megatrain_min.engine import sharded
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    with mock.patch.dict(os.environ, env), mock.patch.object(sharded, "RENDEZVOUS", datetime.timedelta(seconds=1)):
        sharded.init_from_env("cpu")


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
    # round 2
    "save-hf-export-appeared-meanwhile": (_export_appeared_meanwhile, ValueError, ["another export"]),
    "chat-template-loops": (_template_that_loops, ValueError, ["longer than 0.5 s"]),
    "data-permission-denied": (_data_unreadable, ValueError, ["permission denied"]),
    "rendezvous-nobody-comes": (_rendezvous_nobody_comes, ValueError, ["did not join", "torchrun"]),
}


# round 3
def _bit_rot_found_by_a_batch(tmp):
    """Bit rot beyond what the digests read (a file larger than DIGEST_WHOLE is sampled): a batch that reads
    an id above the split's largest is refused, naming the file."""
    (tmp / "t.txt").write_text("What is two plus two? Four.\n" * 200)
    prepare.prepare([tmp / "t.txt"], tmp / "p")
    ids = np.load(tmp / "p" / "train.npy")
    npy(tmp / "p" / "train.npy", np.full_like(ids, 999))
    prepared.PreparedTokens(tmp / "p", verify=False).batches("train", 2, 16).next()


def _input_moved_midway(tmp):
    """An input moved away while prepare reads it: bad input (one line, exit 2), not a write error (exit 4)."""
    from unittest import mock
    (tmp / "t.txt").write_text("What is two plus two? Four.\n" * 200)
    add = encoding.Corpus.add

    def moving(self, path, *a):      # the first piece is read: the file goes elsewhere
        if path.exists():
            path.rename(tmp / "moved.txt")
        return add(self, path, *a)
    with mock.patch.object(encoding.Corpus, "add", moving):
        prepare.prepare([tmp / "t.txt"], tmp / "p")


def _outcome(codes, passed, want):
    def check(tmp):
        got = launch.outcome(codes, passed)
        assert got == want, got
    return check


def _second_ctrl_c_after_the_stop_save(tmp):
    """A second Ctrl-C that comes after the stop's checkpoint is written changes nothing (no exit 130, 'unsaved');
    before it, it still exits at once. A periodic save during which the first came is not the stop's (the run
    trains one more step): a second Ctrl-C after it still exits at once."""
    from megatrain_min.run import stops
    run = stops.Stops(tmp / "o")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

    def second_exits():
        try:
            handler(signal.SIGINT, None)
        except SystemExit as e:
            return e.code == 130
        return False
    try:
        run.catch()
        handler = signal.getsignal(signal.SIGINT)
        assert not run.agree(None)                            # this step goes on ...
        handler(signal.SIGINT, None)                          # ... the first Ctrl-C comes during its save
        run.saved(tmp / "o" / "ckpt-00000002")               # a periodic save, not the stop's
        assert second_exits(), "a second Ctrl-C after a periodic save did not exit"
        assert run.agree(None)                                # the next step: stop here
        assert second_exits(), "a second Ctrl-C before the stop's save did not exit"
        run.saved(tmp / "o" / "ckpt-00000003")               # the stop's checkpoint is written ...
        handler(signal.SIGINT, None)                          # ... then a second Ctrl-C: nothing
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


API.update({
    "prepared-bit-rot-found-by-a-batch": (_bit_rot_found_by_a_batch, ValueError, ["train.npy", "above the largest"]),
    "prepare-input-moved-midway": (_input_moved_midway, ValueError, ["t.txt", "moved or deleted"]),
    "launcher-two-quick-ctrl-cs": (_outcome({0: 130, 1: -signal.SIGTERM}, [signal.SIGINT] * 2, (130, None)), None, []),
    "launcher-damaged-sharded-resume": (_outcome({0: 2, 1: -signal.SIGTERM}, [], (2, None)), None, []),
    "launcher-rank-killed-elsewhere": (_outcome({0: -signal.SIGTERM, 1: -signal.SIGKILL}, [], (
        137, "rank 1 was killed (signal 9); the other ranks stopped")), None, []),
    "second-ctrl-c-after-the-stop-save": (_second_ctrl_c_after_the_stop_save, None, []),
})


def _publish_with_a_crafted_old_list(tmp):
    """publish.publish handed an old list naming ../notes.txt: refused before anything is removed."""
    from megatrain_min.data import publish
    _outside(tmp)
    (tmp / "out").mkdir()
    (tmp / "out" / "last.json").write_text("{}")
    before = files_under(tmp)
    staged = publish.stage(tmp / "out")
    (staged / "last.json").write_text("{}")
    try:
        publish.publish(staged, tmp / "out", None, lambda out: None, "last.json", ["../notes.txt", "../mydocs"])
    finally:
        assert not lost(before), "data lost"


API.update({
    "publish-old-list-outside": (_publish_with_a_crafted_old_list, ValueError, ["../notes.txt"]),
})


def _export_landing_while_reading(how):
    """An export into a new directory; another one lands there while this one reads its checkpoint (the export took
    what it would replace after the read, and replaced the other): refused, the other export whole. how: "cli"
    (python -m megatrain_min.hf export: its one line as a ValueError) or "api" (hf.export)."""
    def case(tmp):
        from unittest import mock
        from megatrain_min.checkpoints import ckpt_read
        ck = checkpoint.save(trainer(), tmp / "run", 1, {"run": "a"})
        read, theirs = ckpt_read.read_weights, {}

        def reading(path):                                    # meanwhile, another export lands
            hf.save_hf(CFG, w0(), tmp / "exp", dtype=torch.float32)
            theirs.update(files_under(tmp / "exp"))
            return read(path)
        said = io.StringIO()
        try:
            with mock.patch.object(ckpt_read, "read_weights", reading), contextlib.redirect_stderr(said), \
                    contextlib.redirect_stdout(io.StringIO()):
                if how == "api":
                    hf.export(ck, tmp / "exp")
                else:
                    hf.main(["export", str(ck), str(tmp / "exp")])
        except SystemExit as e:
            if e.code:
                raise ValueError(said.getvalue().strip().removeprefix("error: ")) from None
        finally:
            assert theirs and not lost(theirs), "data lost"
    return case


API.update({
    "export-cli-landing-while-reading": (_export_landing_while_reading("cli"), ValueError, ["another export"]),
    "export-api-landing-while-reading": (_export_landing_while_reading("api"), ValueError, ["another export"]),
})

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
