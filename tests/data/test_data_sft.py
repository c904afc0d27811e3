"""SFT data (megatrain_min/data/__init__.py): a model directory's tokenizer.json, the chat template and its loss mask,
malformed lines, truncation, and the padded batch sampler. The tokenizer is a tiny byte-level BPE trained
here on a few strings (nothing is downloaded)."""
import json

import numpy as np
import pytest
import torch

from conftest import make_bpe_tokenizer
from megatrain_min.data import IGNORE, ByteTokenizer, SFTBatches, load_sft_jsonl, split_examples
from megatrain_min.data.tokenizer import HFTokenizer

tokenizers = pytest.importorskip("tokenizers")

EOS, BOS = "<|endoftext|>", "<s>"
CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "Blue."}]},
    {"prompt": "2 + 2 =", "completion": " 4"},
    {"messages": [{"role": "user", "content": "Say yes"}, {"role": "assistant", "content": "yes"}]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_bpe_tokenizer(d, ["<|user|>\nHi there", "<|assistant|>\nHello! Blue. yes", "Name a colour. Be brief."],
                       400, [EOS, BOS], {"eos_token": EOS, "bos_token": None})
    return d


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_tokenizer_round_trip_and_special_ids(model_dir, tmp_path):
    tok = HFTokenizer(model_dir)
    text = "Hello! <|user|>\n unseen wörds"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == tok.tok.token_to_id(EOS) and tok.bos_id is None
    # other places an eos/bos can be named: special_tokens_map.json (with a dict), config.json ids
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": BOS}}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    tok = HFTokenizer(tmp_path)
    assert (tok.eos_id, tok.bos_id) == (7, tok.tok.token_to_id(BOS))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        HFTokenizer(tmp_path / "nowhere")


def test_loss_only_on_assistant_turns(model_dir, tmp_path):
    tok = HFTokenizer(model_dir)
    ex = load_sft_jsonl(write_jsonl(tmp_path / "d.jsonl", CHATS), tok, seq_len=256)
    assert len(ex) == 3
    (x, y), (x2, y2), _ = ex
    assert x.dtype == y.dtype == np.int32 and len(x) == len(y)
    # the whole sequence is the template: x is every token but the last, y every token but the first
    assert tok.decode(x) + EOS == ("<|system|>\nBe brief." + EOS + "<|user|>\nHi there" + EOS +
                                   "<|assistant|>\nHello!" + EOS + "<|user|>\nName a colour." + EOS +
                                   "<|assistant|>\nBlue." + EOS)
    # supervised: both assistant turns and their eos, nothing else
    assert tok.decode(y[y != IGNORE]) == "Hello!" + EOS + "Blue." + EOS
    assert (y[y != IGNORE] == np.concatenate([x[1:], [tok.eos_id]])[y != IGNORE]).all()  # y is x shifted
    assert tok.decode(x2) == "2 + 2 = 4" and tok.decode(y2[y2 != IGNORE]) == " 4" + EOS


def test_bos_and_byte_tokenizer(model_dir, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", CHATS[2:])
    (x, y), = load_sft_jsonl(path, ByteTokenizer(), seq_len=64)        # no eos: a turn ends with "\n"
    assert bytes(x.tolist()).decode() + "\n" == "<|user|>\nSay yes\n<|assistant|>\nyes\n"
    assert bytes(y[y != IGNORE].tolist()) == b"yes\n"
    tok = HFTokenizer(model_dir)
    tok.bos_id = tok.tok.token_to_id(BOS)
    (x, y), = load_sft_jsonl(path, tok, seq_len=64)
    assert x[0] == tok.bos_id and y[0] == IGNORE


BAD = {
    "not-json": ("{oops", "Expecting property name"),
    "not-object": ("[1, 2]", "expected a JSON object, got list"),
    "messages-not-list": ({"messages": "hi"}, '"messages" must be a non-empty list'),
    "message-no-content": ({"messages": [{"role": "user"}]}, "messages[0] must be an object"),
    "no-assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    "prompt-not-string": ({"prompt": 1, "completion": "x"}, '"prompt" and "completion" must both be strings'),
    "unknown-keys": ({"text": "hi"}, "expected \"messages\" or \"prompt\"/\"completion\""),
}


@pytest.mark.parametrize("bad", BAD)
def test_malformed_line_names_its_number(model_dir, tmp_path, bad):
    row, words = BAD[bad]
    path = write_jsonl(tmp_path / "d.jsonl", [CHATS[1], "", row, CHATS[2]])
    with pytest.raises(ValueError) as e:
        load_sft_jsonl(path, HFTokenizer(model_dir), seq_len=64)
    assert str(e.value).startswith(f"{path}:3: ") and words in str(e.value) and "\n" not in str(e.value)


def test_truncation_and_dropping(model_dir, tmp_path):
    tok = HFTokenizer(model_dir)
    long_prompt = {"prompt": "Hi there " * 40, "completion": "yes"}       # the answer lies past seq_len
    long_answer = {"prompt": "Hi", "completion": " Blue." * 40}           # cut, keeps its first answer tokens
    path = write_jsonl(tmp_path / "d.jsonl", [long_prompt, long_answer, CHATS[2]])
    with pytest.warns(UserWarning, match="2 of 3 examples longer than seq_len=16 were cut, 1 of them dropped"):
        ex = load_sft_jsonl(path, tok, seq_len=16)
    assert len(ex) == 2 and len(ex[0][0]) == 16 and (ex[0][1] != IGNORE).sum() > 0   # long_prompt dropped
    assert tok.decode(ex[0][0]).startswith("Hi Blue.")
    with pytest.raises(ValueError, match="no example with a supervised token"):
        load_sft_jsonl(write_jsonl(tmp_path / "e.jsonl", [long_prompt]), tok, seq_len=16)
    with pytest.raises(ValueError, match="does not exist"):
        load_sft_jsonl(tmp_path / "missing.jsonl", tok, seq_len=16)


def test_batches_pad_cover_epochs_and_resume(model_dir, tmp_path):
    tok = HFTokenizer(model_dir)
    rows = [{"prompt": "Hi " * i, "completion": "yes"} for i in range(1, 6)]   # 5 examples, distinct lengths
    ex = load_sft_jsonl(write_jsonl(tmp_path / "d.jsonl", rows), tok, seq_len=32)
    b = SFTBatches(ex, batch_size=2, seq_len=32, seed=3, pad_id=tok.eos_id)
    seen = []
    for _ in range(5):                                       # 10 rows = exactly two epochs of 5 examples
        x, y = b.next()
        assert x.shape == y.shape == (2, 32) and x.dtype == y.dtype == torch.int64
        for row_x, row_y in zip(x, y):
            n = int((row_x != tok.eos_id).sum())             # the examples hold no eos: the rest is padding
            assert (row_y[n:] == IGNORE).all() and (row_x[n:] == tok.eos_id).all()
            seen.append(n)
    assert sorted(seen) == sorted([len(e[0]) for e in ex] * 2)
    state = json.loads(json.dumps(b.state_dict()))           # survives checkpoint.py's JSON
    want = [b.next() for _ in range(4)]
    b2 = SFTBatches(ex, batch_size=2, seq_len=32, seed=99, pad_id=tok.eos_id)
    b2.load_state_dict(state)
    assert all(torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]) for a, c in zip(want, (b2.next() for _ in range(4))))
    train, val = split_examples(ex, 0.1)
    assert (len(train), len(val)) == (4, 1) and val[0] is ex[-1]
    with pytest.raises(ValueError, match="val split has no SFT examples"):
        SFTBatches([], 2, 32, name="val")
