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
import tempfile
import zlib
from pathlib import Path

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
    # runs on data named by a relative path (a case copies the run and changes the file under the same name),
    # a fine-tune of the Hugging Face model (its checkpoint carries the tokenizer)
    (w / "corpus.txt").write_text("What is two plus two? Four. " * 200)
    r = cli(*TINY, "--save-every", "1", "--data", "corpus.txt", "--out", w / "run-data", cwd=w)
    assert r.returncode == 0, r.stderr
    r = cli(*TINY, "--save-every", "1", "--init-from", w / "hf", "--data", "chat.jsonl", "--seq-len", "64",
            "--out", w / "sft", cwd=w)
    assert r.returncode == 0, r.stderr
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
    argv, code, words, unwatched, *extra = CLI[name](tmp_path, world)
    extra = extra[0] if extra else {}
    before = {p: b for p, b in files_under(tmp_path).items() if not any(p.is_relative_to(u) for u in unwatched)}
    out = [] if "--out" in argv else ["--out", tmp_path / "out"]
    r = cli(*TINY, *out, *argv, cwd=tmp_path, env=extra.get("env"))
    v = verdict(r, before, code, words)
    if v == "clean" and "check" in extra and not extra["check"](r, tmp_path):
        v = "silent"
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
    from megatrain_min import chat
    old, chat.RENDER_S = chat.RENDER_S, 0.5
    try:
        chat.render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                    [{"role": "user", "content": "hi"}], {})
    finally:
        chat.RENDER_S = old


def _data_unreadable(tmp):
    """Mode 000 (root reads anyway: the read itself is made to fail as it would)."""
    from unittest import mock
    from megatrain_min import corpus
    (tmp / "d.txt").write_text("hello " * 1000)
    with mock.patch("pathlib.Path.read_bytes", side_effect=PermissionError(13, "Permission denied", str(tmp))):
        corpus.open_data(tmp / "d.txt", CFG, 2, 16)


def _rendezvous_nobody_comes(tmp):
    """WORLD_SIZE=2 RANK=0 by hand, no second rank: gives up after RENDEZVOUS, in one line."""
    import datetime
    import os
    import socket
    from unittest import mock
    from megatrain_min import sharded
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    with mock.patch.dict(os.environ, env), mock.patch.object(sharded, "RENDEZVOUS", datetime.timedelta(seconds=2)):
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
