"""Checkpoints that carry their tokenizer (checkpoint.save(..., tokenizer_from=MODEL_DIR)), their weights read without
a trainer (ckpt_read.read_weights), and `python -m megatrain_min.hf export CKPT OUT_DIR` to a transformers directory.

Oracles: transformers, for the export -- AutoModelForCausalLM's logits equal model.forward on the trained weights
(fp32, 1e-5 relative, as tests/hf/test_finetune.py), AutoTokenizer's apply_chat_template from the export equals the
one from the source model directory; the trainer's own weights(), bit for bit, for what read_weights reads (from one
process's checkpoint and from the parts 2 gloo ranks wrote); data.HFTokenizer of the source model directory for
HFTokenizer of the checkpoint. Refusals run the command as a subprocess: exit 2, one line, nothing written.
"""
import json
import shutil

import pytest
import torch

import model
from conftest import ROOT, engine, make_bpe_tokenizer, random_batch, train_py
import ranks
from megatrain_min import data
from megatrain_min.checkpoints import checkpoint, ckpt_read
from megatrain_min.data import prepare, prepared
from megatrain_min.engine import sharded
from megatrain_min.data.tokenizer import CONFIG_IDS, HFTokenizer
from megatrain_min.hf.load import load_hf

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CONV = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four, zwölf 🕛."}]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama made by transformers, with a BPE tokenizer.json and a ChatML chat template."""
    d = tmp_path_factory.mktemp("llama")
    tok = make_bpe_tokenizer(d, ["user assistant What is two plus two? Four, zwölf 🕛."] * 3, 300, SPECIALS,
                             {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
                              "tokenizer_class": "PreTrainedTokenizerFast"})
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False,
                                   eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def trained(llama_dir, tmp_path_factory):
    """(cfg, weights after 2 steps, the checkpoint holding them and llama_dir's tokenizer files)."""
    cfg, w = load_hf(llama_dir)
    t = engine(cfg, w, device="cpu", lr=1e-2, weight_decay=0.1, micro_batches=2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        t.step(*random_batch(cfg, 4, 16, gen))
    ck = checkpoint.save(t, tmp_path_factory.mktemp("run"), 2, {"run": "a"}, tokenizer_from=llama_dir)
    return cfg, t.weights(), ck


def hf_export(*args, cwd=ROOT):
    """`python -m megatrain_min.hf export *args` in a fresh process (forked from conftest's runner: torch and
    transformers imported once)."""
    return train_py("export", *args, module="megatrain_min.hf", cwd=cwd, timeout=120)


def chat_ids(d, messages, **kw):
    out = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ----------------------------------------------------------------------------- the export
def test_export_round_trip_through_transformers(trained, llama_dir, tmp_path):
    cfg, weights, ck = trained
    r = hf_export(ck, tmp_path / "hf", "--dtype", "fp32")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "tokenizer files: tokenizer.json, tokenizer_config.json" in r.stdout
    out = tmp_path / "hf"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = theirs(x).logits, model.forward(cfg, weights, x)
    diff = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"export -> transformers logits max rel diff {diff:.1e}")
    assert diff <= 1e-5
    cfg2, w2 = load_hf(out)
    assert cfg2 == cfg and all(torch.equal(w2[k], weights[k]) for k in weights)     # fp32: bit for bit
    # the tokenizer came along: transformers renders the conversation as from the source, and as we train on it
    assert chat_ids(out, CONV) == chat_ids(llama_dir, CONV) == data.chat_tokens(HFTokenizer(ck), CONV)[0].tolist()
    prompt = dict(add_generation_prompt=True)
    assert chat_ids(out, CONV[:1], **prompt) == chat_ids(llama_dir, CONV[:1], **prompt)
    src_conf, out_conf = (json.loads((d / "config.json").read_text()) for d in (llama_dir, out))
    assert (out_conf["eos_token_id"], out_conf["pad_token_id"]) == (src_conf["eos_token_id"], src_conf["pad_token_id"])
    # bf16 (the default): the same weights rounded once; an earlier export is replaced
    r = hf_export(ck, out)
    assert r.returncode == 0, r.stderr
    _, w3 = load_hf(out)
    assert all(torch.equal(w3[k], weights[k].bfloat16().float()) for k in weights)


# ----------------------------------------------------------------------------- the checkpoint as a tokenizer source
def test_checkpoint_carries_the_tokenizer(trained, llama_dir, tmp_path):
    cfg, weights, ck = trained
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (ck / f).read_bytes() == (llama_dir / f).read_bytes()
    ours, src = HFTokenizer(ck), HFTokenizer(llama_dir)
    assert (ours.vocab_size, ours.eos_id, ours.bos_id, ours.chat_template, ours.special_tokens) == \
        (src.vocab_size, src.eos_id, src.bos_id, src.chat_template, src.special_tokens)
    src_conf = json.loads((llama_dir / "config.json").read_text())
    assert ckpt_read.read_meta(ck)["tokenizer"]["config_ids"] == {k: src_conf[k] for k in CONFIG_IDS}
    t = engine(cfg, model.init_weights(cfg, 5), device="cpu")                # load() reads it as before
    assert checkpoint.load(t, ck) == {"run": "a", "step": 2}
    assert all(torch.equal(t.weights()[k], weights[k]) for k in weights)
    (tmp_path / "t.txt").write_text("What is two plus two?\n" * 4)             # data prepared with the model's
    prepare.prepare([tmp_path / "t.txt"], tmp_path / "tok", llama_dir)          # tokenizer fits the checkpoint
    prepared.PreparedTokens(tmp_path / "tok").check_model(ck, cfg.vocab_size)


def test_eos_named_only_in_config_json_is_carried(tmp_path):
    """A model whose eos id is in config.json only: the checkpoint records it, HFTokenizer and the export see it."""
    src = tmp_path / "src"
    src.mkdir()
    make_bpe_tokenizer(src, ["hello there"], 280, SPECIALS, {})
    (src / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    cfg = model.PRESETS["toy"]
    t = engine(cfg, model.init_weights(cfg), device="cpu")
    ck = checkpoint.save(t, tmp_path / "run", 0, tokenizer_from=src)
    assert HFTokenizer(ck).eos_id == HFTokenizer(src).eos_id == 2
    assert not (ck / "config.json").exists()                                  # never mistaken for a HF directory
    r = hf_export(ck, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (conf["eos_token_id"], conf["bos_token_id"]) == (2, 1)


# ----------------------------------------------------------------------------- read_weights
def test_read_weights_is_the_trainers_weights(trained, tmp_path):
    cfg, weights, ck = trained
    cfg2, w = ckpt_read.read_weights(ck)
    assert cfg2 == cfg and list(w) == list(weights) and len(w) == len(weights)
    assert all(w[k].dtype == torch.float32 and torch.equal(w[k], weights[k]) for k in weights)
    t = engine(cfg2, w, device="cpu")                                         # fills its store with read_into
    assert all(torch.equal(t.weights()[k], weights[k]) for k in weights)
    key = "model.layers.1.self_attn.k_proj.weight"
    into = torch.zeros(weights[key].shape[::-1]).t()                           # not contiguous: read, then copied
    assert w.read_into(key, into) is into and torch.equal(into, weights[key])
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    unit = bad / "layer.0.bin"
    b = bytearray(unit.read_bytes())
    b[-5] ^= 1                                                                 # a bit of Adam's v, not the master
    unit.write_bytes(bytes(b))
    with pytest.raises(ckpt_read.CheckpointError, match="layer.0.bin fails its CRC-32 check"):
        ckpt_read.read_weights(bad)
    assert ckpt_read.read_weights(bad, verify=False)[1][key].shape == weights[key].shape


def _save_sharded(cfg_dict, out):
    """On each of 2 ranks: 2 steps of ShardedTrainer, then its part of a checkpoint; returns the whole weights."""
    cfg = model.GPTConfig(**cfg_dict)
    t = sharded.ShardedTrainer(cfg, model.init_weights(cfg, 0), device="cpu", lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        t.step(*random_batch(cfg, 4, 8, gen))
    checkpoint.save(t, out, 2, {"run": "sharded"})
    return t.weights()


@pytest.mark.slow                                   # ~7 s on 2 cores: 2 processes importing torch, gloo
def test_read_weights_of_a_sharded_checkpoint(tmp_path):
    """2 gloo ranks save parts (version 2); read_weights stitches each tensor from the parts that hold it, and the
    export loads in transformers."""
    cfg = model.GPTConfig(vocab_size=101, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=32)
    got, _ = ranks.spawn(_save_sharded, 2, cfg.to_dict(), str(tmp_path / "run"))
    ck = ckpt_read.latest(tmp_path / "run")
    assert ckpt_read.read_meta(ck)["version"] == ckpt_read.SHARDED
    cfg2, w = ckpt_read.read_weights(ck)
    assert cfg2 == cfg and all(torch.equal(w[k], got[0][k]) for k in got[0])
    r = hf_export(ck, tmp_path / "hf", "--dtype", "fp32")
    assert r.returncode == 0 and "tokenizer files: none in the checkpoint" in r.stdout, r.stderr
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = theirs(x).logits, model.forward(cfg, got[0], x)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-5


# ----------------------------------------------------------------------------- refusals
def _damaged(ck, tmp):
    bad = tmp / "damaged"
    shutil.copytree(ck, bad)
    with open(bad / "head.bin", "r+b") as f:
        f.truncate(100)
    return bad


REFUSALS = {  # name: (arguments given (ckpt, tmp), words the one line must hold)
    "not-a-checkpoint": (lambda ck, tmp: [tmp, tmp / "o"], "is not a checkpoint directory (no meta.json)"),
    "a-run-directory": (lambda ck, tmp: [ck.parent, tmp / "o"], "it holds checkpoints, the latest is"),
    "missing": (lambda ck, tmp: [tmp / "nope", tmp / "o"], "nope is not a checkpoint directory"),
    "damaged": (lambda ck, tmp: [_damaged(ck, tmp), tmp / "o"], "head.bin has 100 bytes, expected"),
    "out-not-an-export": (lambda ck, tmp: [ck, ck.parent], "is not a model directory written by save_hf"),
    "dtype": (lambda ck, tmp: [ck, tmp / "o", "--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_export_refusals_are_one_line_and_exit_2(trained, tmp_path, case):
    args, words = REFUSALS[case]
    args = args(trained[2], tmp_path)
    before = sorted(p for p in trained[2].parent.rglob("*"))
    r = hf_export(*args)
    err = r.stderr.strip().splitlines()
    print(r.stderr)
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], r.stderr
    assert not (tmp_path / "o").exists() and before == sorted(p for p in trained[2].parent.rglob("*"))
