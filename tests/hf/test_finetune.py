"""The fine-tuning path end to end, as a user runs it: a (tiny, random) Hugging Face Llama directory with
its tokenizer.json -> python train.py --init-from DIR --data chat.jsonl --save-hf OUT -> OUT loads in
transformers and gives our logits; --init-from also takes one of our checkpoints."""
import json

import numpy as np
import pytest
import torch

import model
from conftest import make_bpe_tokenizer, train_py
from megatrain_min.hf.load import load_hf

pytestmark = pytest.mark.slow   # the whole module: `python -m pytest -m "not slow"` leaves it out

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    tok = make_bpe_tokenizer(d, ["<|user|>\nWhat is two plus two?", "<|assistant|>\nFour. Yes."], 300, [EOS],
                             {"eos_token": EOS})
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def test_init_from_hf_sft_and_export(llama_dir, tmp_path):
    chat = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "What is two plus two?"},
                          {"role": "assistant", "content": "Four."}]},
            {"prompt": "Yes or no?", "completion": " Yes."}] * 4
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "hf-out"
    r = train_py("--init-from", llama_dir, "--data", chat, "--save-hf", out, "--save-hf-dtype", "fp32", "--steps", 3,
                 "--batch-size", 2, "--seq-len", 32, "--eval-every", 3, "--eval-batches", 1, "--lr", 1e-3,
                 "--out", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(l == l for l in losses)
    cfg, w = load_hf(out)
    w = {k: w[k] for k in w}
    w0 = load_hf(llama_dir)[1]
    assert any(not torch.equal(w[k], w0[k]) for k in w)               # it trained
    assert (out / "tokenizer.json").is_file()                           # and kept the tokenizer
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(tok).logits
    ours = model.forward(cfg, w, tok)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-5

    # --init-from one of our checkpoints: the same weights, a fresh optimizer, the tokenizer it carries
    ck = sorted((tmp_path / "run").glob("ckpt-*"))[-1]
    r = train_py("--init-from", ck, "--data", chat, "--steps", 1, "--batch-size", 2, "--seq-len", 32,
                 "--eval-batches", 1, "--save-hf", tmp_path / "again", "--save-hf-dtype", "fp32", "--lr", 0,
                 "--weight-decay", 0, "--out", tmp_path / "run2")
    assert r.returncode == 0, r.stderr
    assert f"{ck} has no chat_template" in r.stdout       # the text went through the checkpoint's tokenizer
    again = load_hf(tmp_path / "again")[1]
    assert all(torch.equal(again[k], w[k]) for k in w)  # lr 0: the checkpoint's weights came through unchanged
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (llama_dir / "tokenizer.json").read_bytes()


def test_a_fine_tune_replies_resumes_and_keeps_its_tokenizer(llama_dir, tmp_path):
    """The end of a fine-tune shows the model's reply to the first held-out conversation, decoded with the model's
    tokenizer and cut at its end-of-turn token; --resume continues with the model directory's tokenizer and
    refuses a model directory whose tokenizer.json is no longer the one the run trained with."""
    src = tmp_path / "llama"
    src.mkdir()
    for f in llama_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "What is two plus two?"},
                                                     {"role": "assistant", "content": "Four."}]}) + "\n"
                            for _ in range(10)))
    common = ["--init-from", src, "--data", chat, "--batch-size", 2, "--seq-len", 32, "--eval-batches", 1,
              "--save-every", 2, "--out", tmp_path / "run"]
    r = train_py(*common, "--steps", 2, "--sample-tokens", 20)
    assert r.returncode == 0, r.stderr
    reply = r.stdout.split("reply to the first held-out conversation")[1].split("\n", 1)[1].split("-" * 40)[0]
    assert len(reply.strip()) > 0 and len(reply) < 400, r.stdout      # decoded text, at most 20 tokens
    r = train_py(*common, "--steps", 3, "--sample-tokens", 0, "--resume")
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr
    (tmp_path / "other").mkdir()          # the same texts, a smaller vocabulary: another tokenizer.json
    make_bpe_tokenizer(tmp_path / "other", ["<|user|>\nWhat is two plus two?", "<|assistant|>\nFour. Yes."], 280,
                       [EOS], {"eos_token": EOS})
    (src / "tokenizer.json").write_bytes((tmp_path / "other" / "tokenizer.json").read_bytes())
    r = train_py(*common, "--steps", 4, "--sample-tokens", 0, "--resume")
    assert r.returncode == 2 and "tokenizer.json is not the tokenizer" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_init_from_bad_directory_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    r = train_py("--init-from", tmp_path / "empty")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_seq_len_above_the_sliding_window_is_refused(llama_dir, tmp_path):
    """The same weights as a Mistral with a window of 16: --seq-len 32 would need banded attention."""
    d = tmp_path / "mistral"
    d.mkdir()
    for f in llama_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    c = json.loads((d / "config.json").read_text())
    c.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16)
    (d / "config.json").write_text(json.dumps(c))
    np.save(tmp_path / "t.npy", np.arange(2000, dtype=np.uint16) % 100)
    r = train_py("--init-from", d, "--data", tmp_path / "t.npy", "--seq-len", 32, "--steps", 1,
                 "--out", tmp_path / "run")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--seq-len 32: a sequence of 32 tokens is longer than this model's sliding window of 16" in r.stderr
    assert not (tmp_path / "run").exists()
