"""megatrain_min/data/prepare.py: a corpus tokenized once into token files (the streaming: megatrain_min/data/encoding.py);
megatrain_min/data/prepared.py: read back.

Oracles: the tokenizer's own encode() of each line (text) or document (.jsonl "text", + eos); data.py's in-memory
path for SFT (load_sft_jsonl's (x, y) per example, example_tokens' masks, SFTBatches over its list); data.Batches
over the same ids held in memory; the split rule recomputed here from byte offsets. Tiny BPE tokenizers are
trained here (conftest.make_bpe_tokenizer); BATCH_BYTES is cut to a few bytes so that a corpus of a few KB crosses
many batch edges. Refusals run the command as a user does (`python -m megatrain_min.prepare`, a subprocess):
exit code 2 and one line, nothing written.
"""
import json
import os
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from conftest import ROOT, make_bpe_tokenizer
from megatrain_min import data
from megatrain_min.data import encoding, prepare, prepared
from megatrain_min.data.prepared import PreparedTokens, PrepareError
from megatrain_min.data.tokenizer import HFTokenizer

tokenizers = pytest.importorskip("tokenizers")

EOS = "<|endoftext|>"
CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# trailing spaces before newlines, runs of blank lines, CRLF, tabs, non-ASCII: where line-by-line tokenizing shows
TEXT = ("Hello wörld, this is line one.  \n\n\nSecond  line\twith tabs\r\n東京 and 서울 🕛\n" * 12
        + "the last line has no newline")
CONVS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capitale du Japon ?"},
                  {"role": "assistant", "content": "Tōkyō."}, {"role": "user", "content": "Et de la Corée ?"},
                  {"role": "assistant", "content": "Séoul, 서울, a much longer answer than the others."}]},
    {"prompt": "2 + 2 =", "completion": " 4"},
    {"messages": [{"role": "user", "content": "Say yes"}, {"role": "assistant", "content": "yes"}]},
    {"messages": [{"role": "user", "content": "A long question " * 8}, {"role": "assistant", "content": "No."}]},
]


def bpe(d, style="gpt2", template=CHATML):
    conf = {"eos_token": "<|im_end|>", "pad_token": EOS, "chat_template": template}
    make_bpe_tokenizer(d, [TEXT, "Be brief. Capitale du Japon Tōkyō Séoul yes No"] * 3, 400,
                       [EOS, "<|im_start|>", "<|im_end|>"], conf, style=style)
    return d


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    return {style: bpe(tmp_path_factory.mktemp(style), style) for style in ("gpt2", "llama3")}


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(encoding, "BATCH_BYTES", 61)   # many batches, lines across their edges


def lines_of(b):
    """The lines of bytes b, each with its newline (the last one may have none)."""
    parts = b.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def expected_split(files, ids_of, val_fraction):
    """(train ids, val ids) by the documented rule, from byte offsets: a unit (line) goes to val when its last
    byte is among the last floor(val_fraction * total) bytes of all files. ids_of(line bytes) -> list of ids."""
    units, at = [], 0
    for f in files:
        for line in lines_of(f.read_bytes()):
            at += len(line)
            units.append((at - 1, ids_of(line)))
    cut = at - int(val_fraction * at)
    pick = lambda val: [i for last, ids in units if (last >= cut) == val for i in ids]  # noqa: E731
    return pick(False), pick(True)


def ids_of(d, split):
    return np.asarray(PreparedTokens(d).tokens(split)).tolist()


# ----------------------------------------------------------------------------- text: the ids
@pytest.mark.parametrize("style", ["bytes", "gpt2", "llama3"])
def test_text_ids_are_encode_of_each_line(tmp_path, tok_dirs, small_batches, style):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT, encoding="utf-8")
    b.write_text("another file\n" * 9 + "Hello wörld\n", encoding="utf-8")
    tok_dir = None if style == "bytes" else tok_dirs[style]
    enc = (lambda line: list(line)) if tok_dir is None else (   # noqa: E731
        lambda line: HFTokenizer(tok_dir).encode(line.decode("utf-8")))
    meta = prepare.prepare([a, b], tmp_path / "out", tok_dir, val_fraction=0.25)
    train, val = expected_split([a, b], enc, 0.25)
    assert ids_of(tmp_path / "out", "train") == train and ids_of(tmp_path / "out", "val") == val
    assert len(val) > 0 and len(train) > 3 * len(val) - 200       # about a quarter, in whole lines
    p = PreparedTokens(tmp_path / "out")
    assert p.kind == "tokens" and p.dtype == np.uint16 and isinstance(p.tokens("train"), prepared.TokenFile)
    assert meta["splits"]["train"]["tokens"] == len(train) and meta["splits"]["val"]["max_id"] == max(val)
    assert p.tokenizer_hash == ("bytes" if tok_dir is None else prepared.tokenizer_hash(tok_dir))
    assert [s["path"] for s in meta["sources"]] == [str(a.resolve()), str(b.resolve())]
    if style == "llama3":                     # why "line by line" is said: Llama 3 merges newlines across lines
        whole = HFTokenizer(tok_dir).encode(a.read_text(encoding="utf-8") + b.read_text(encoding="utf-8"))
        assert whole != train + val


def test_jsonl_text_documents_end_with_eos(tmp_path, tok_dirs, small_batches):
    docs = ["Hello wörld", "", "Second  line\nwith a newline inside", "東京 and 서울 🕛 " * 5]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(docs)) + "\n\n  \n", "utf-8")
    tok = HFTokenizer(tok_dirs["gpt2"])
    prepare.prepare([path], tmp_path / "out", tok_dirs["gpt2"], val_fraction=0)
    assert ids_of(tmp_path / "out", "train") == [i for t in docs for i in tok.encode(t) + [tok.eos_id]]
    assert PreparedTokens(tmp_path / "out").meta["splits"]["train"]["examples"] == 4
    prepare.prepare([path], tmp_path / "bytes", val_fraction=0)     # no eos: a newline ends a document
    assert bytes(ids_of(tmp_path / "bytes", "train")).decode() == "".join(t + "\n" for t in docs)


def test_uint16_or_uint32(tmp_path):
    assert prepare.id_dtype(256) == prepare.id_dtype(65536) == np.uint16
    assert prepare.id_dtype(65537) == prepare.id_dtype(1 << 32) == np.uint32
    with pytest.raises(PrepareError, match="does not fit uint32"):
        prepare.id_dtype((1 << 32) + 1)
    from tokenizers import Tokenizer, models, pre_tokenizers   # 70,000 words: ids beyond uint16
    words = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "big").mkdir()
    tok.save(str(tmp_path / "big" / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("w1 w65535 w65536 w69999 nope\n" * 3)
    prepare.prepare([tmp_path / "t.txt"], tmp_path / "out", tmp_path / "big", val_fraction=0)
    p = PreparedTokens(tmp_path / "out")
    assert p.dtype == np.uint32 and p.tokens("train").dtype == np.uint32 and p.vocab_size == 70_001
    assert ids_of(tmp_path / "out", "train") == [2, 65536, 65537, 70000, 0] * 3


# ----------------------------------------------------------------------------- SFT: masks and examples
@pytest.mark.filterwarnings("ignore:.*were cut")
@pytest.mark.parametrize("native", [True, False], ids=["chat-template", "bytes-fixed"])
def test_sft_equals_load_sft_jsonl(tmp_path, tok_dirs, small_batches, native):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CONVS * 3) + "\n")
    tok_dir = tok_dirs["gpt2"] if native else None
    tok = HFTokenizer(tok_dir) if native else data.ByteTokenizer()
    meta = prepare.prepare([path], tmp_path / "out", tok_dir, val_fraction=0)
    assert meta["kind"] == "sft" and meta["chat_format"] == ("native" if native else "fixed")
    p = PreparedTokens(tmp_path / "out")
    ids, sup, index = p.tokens("train"), p.supervised("train"), np.load(tmp_path / "out" / "train.examples.npy")
    for row, obj in zip(index, CONVS * 3):                          # per example: ids and mask of example_tokens
        want_ids, want_sup = data.example_tokens(obj, tok, meta["chat_format"])
        assert ids[row[0]:row[1]].tolist() == want_ids.tolist() and sup[row[0]:row[1]].tolist() == want_sup.tolist()
    assert len(index) == meta["splits"]["train"]["examples"] == 12
    for seq_len in (512, 24 if native else 60):                     # the short one cuts some, drops some
        with warnings.catch_warnings(record=True) as theirs:
            warnings.simplefilter("always")
            want = data.load_sft_jsonl(path, tok, seq_len)
        with warnings.catch_warnings(record=True) as ours:
            warnings.simplefilter("always")
            got = p.examples("train", seq_len)
        assert len(got) == len(want) and all((gx == wx).all() and (gy == wy).all() and gx.dtype == wx.dtype
                                             for (gx, gy), (wx, wy) in zip(got, want))
        assert [str(w.message).split(": ", 1)[1] for w in ours] == [str(w.message).split(": ", 1)[1] for w in theirs]
        a, b = p.sft_batches("train", 3, seq_len, seed=7), data.SFTBatches(want, 3, seq_len, seed=7)
        for _ in range(6):                                          # past an epoch: the order is redrawn alike
            assert all(torch.equal(u, v) for u, v in zip(a.next(), b.next()))
    assert len(p.examples("train", 24 if native else 60)) < 12     # (the short seq_len did drop some)


@pytest.mark.filterwarnings("ignore:.*were cut")
def test_sft_cut_and_drop_at_every_seq_len(tmp_path, tok_dirs):
    """An example is dropped exactly when its first supervised target lies at or beyond seq_len, as in data.py."""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CONVS))
    tok = HFTokenizer(tok_dirs["gpt2"])
    prepare.prepare([path], tmp_path / "out", tok_dirs["gpt2"], val_fraction=0)
    p, kept = PreparedTokens(tmp_path / "out"), set()

    def outcome(examples):
        try:
            return [(x.tolist(), y.tolist()) for x, y in examples()]
        except ValueError as e:                    # both refuse a seq_len that leaves no example
            assert "no example with a supervised token within seq_len=" in str(e)
            return []

    for seq_len in range(1, 64):
        want = outcome(lambda: data.load_sft_jsonl(path, tok, seq_len))
        assert outcome(lambda: p.examples("train", seq_len)) == want, seq_len
        kept.add(len(want))
    assert len(kept) >= 4                          # the range crosses the first target of every example


def test_sft_val_split_is_the_tail(tmp_path, tok_dirs):
    path = tmp_path / "chat.jsonl"
    lines = [json.dumps(r) + "\n" for r in CONVS * 2]
    path.write_text("".join(lines))
    tok = HFTokenizer(tok_dirs["gpt2"])
    prepare.prepare([path], tmp_path / "out", tok_dirs["gpt2"], val_fraction=0.3)
    total = sum(len(x.encode()) for x in lines)
    ends = np.cumsum([len(x.encode()) for x in lines]) - 1                       # last byte of each record
    n_train = int((ends < total - int(0.3 * total)).sum())
    want = data.load_sft_jsonl(path, tok, 512)
    p = PreparedTokens(tmp_path / "out")
    for split, part in (("train", want[:n_train]), ("val", want[n_train:])):
        got = p.examples(split, 512)
        assert len(got) == len(part) > 0 and all((g[1] == w[1]).all() for g, w in zip(got, part))


# ----------------------------------------------------------------------------- the reader
def test_batches_equal_batches_over_the_same_ids_in_memory(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT * 5, encoding="utf-8")
    prepare.prepare([tmp_path / "t.txt"], tmp_path / "out")
    p = PreparedTokens(tmp_path / "out")
    for split in ("train", "val"):
        ours = p.batches(split, 4, 16, seed=3)
        theirs = data.Batches(np.array(p.tokens(split)), 4, 16, seed=3)
        for step in range(5):
            if step == 3:                                           # a sampler's position survives a save/restore
                ours.load_state_dict(json.loads(json.dumps(ours.state_dict())))
            assert all(torch.equal(u, v) for u, v in zip(ours.next(), theirs.next()))
    with pytest.raises(PrepareError, match="holds pretraining text: examples needs SFT examples"):
        p.examples("train", 16)


@pytest.mark.slow
def test_train_py_on_a_prepared_directory_trains_as_on_its_ids(tmp_path):
    """python train.py --data DIR reads the prepared ids: the same training losses as --data ids.npy holding
    DIR's train split followed by a tail that train.py's own split takes for validation."""
    from conftest import train_py
    prepare.prepare([ROOT / "data" / "tinyshakespeare.txt"], tmp_path / "prep")
    ids = np.asarray(PreparedTokens(tmp_path / "prep").tokens("train"))
    pad = next(p for p in range(len(ids) // 9, len(ids)) if int((len(ids) + p) * 0.1) == p)   # data.split's cut
    np.save(tmp_path / "ids.npy", np.concatenate([ids, ids[:pad]]).astype(np.uint16))
    flags = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1", "--sample-tokens", "0"]
    runs, said = {}, {}
    for name, src in (("dir", tmp_path / "prep"), ("npy", tmp_path / "ids.npy")):
        r = train_py(*flags, "--data", src, "--out", tmp_path / name)
        assert r.returncode == 0, r.stderr
        runs[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        said[name] = r.stdout
    assert runs["dir"] == runs["npy"] and len(runs["dir"]) == 3
    assert f"prepared, {len(ids):,} train" in said["dir"] and "(read as batches ask)" in said["dir"]


def test_check_model(tmp_path, tok_dirs):
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    prepare.prepare([tmp_path / "t.txt"], tmp_path / "bpe", tok_dirs["gpt2"])
    prepare.prepare([tmp_path / "t.txt"], tmp_path / "bytes")
    bpe_, bytes_ = PreparedTokens(tmp_path / "bpe"), PreparedTokens(tmp_path / "bytes")
    bpe_.check_model(tok_dirs["gpt2"], vocab_size=bpe_.vocab_size)
    bytes_.check_model(None, vocab_size=256)
    bpe_.check_model(None, vocab_size=bpe_.vocab_size)              # a preset trained from scratch on these ids
    for directory, args, words in [
            (bpe_, (tok_dirs["llama3"],), "was tokenized with a tokenizer.json, sha256"),
            (bytes_, (tok_dirs["gpt2"],), "was tokenized with the byte tokenizer"),
            (bytes_, (None, 100), f"holds token id {max(TEXT.encode())}, beyond the model's vocabulary of 100"),
            (bytes_, (tmp_path,), "has no tokenizer.json")]:
        with pytest.raises(PrepareError) as e:
            directory.check_model(*args)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    # SFT in the native format: the chat template is part of what must match
    (tmp_path / "c.jsonl").write_text(json.dumps(CONVS[2]) + "\n")
    prepare.prepare([tmp_path / "c.jsonl"], tmp_path / "sft", tok_dirs["gpt2"], val_fraction=0)
    (tmp_path / "other").mkdir()
    other = bpe(tmp_path / "other", template=CHATML.replace("'\\n' + m.content", "':\\n' + m.content"))
    (other / "tokenizer.json").write_bytes((tok_dirs["gpt2"] / "tokenizer.json").read_bytes())
    PreparedTokens(tmp_path / "sft").check_model(tok_dirs["gpt2"])
    with pytest.raises(PrepareError, match="rendered with another chat template"):
        PreparedTokens(tmp_path / "sft").check_model(other)


# ----------------------------------------------------------------------------- interrupted, rerun
def test_an_error_midway_leaves_nothing(tmp_path, small_batches):
    good = TEXT.encode() * 3 + b"fine\nbad "
    (tmp_path / "t.txt").write_bytes(good + b"\xff byte\n")
    line, at = good.count(b"\n") + 1, len(good)
    with pytest.raises(PrepareError, match=rf"t.txt:{line}: not UTF-8 text \(byte 0xff at offset {at:,}\)"):
        prepare.prepare([tmp_path / "t.txt"], tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]      # no out, no temporary directory
    with pytest.raises(PrepareError, match="is not a prepared directory .no meta.json"):
        PreparedTokens(tmp_path / "out")


KILLED = """
import os, signal, sys
sys.path.insert(0, {root!r})
from megatrain_min.data import encoding, prepare
encoding.BATCH_BYTES, seen, add = 61, [], encoding.Corpus.add
def dying_add(self, *a):
    seen.append(1)
    if len(seen) == 20:
        for s in self.splits.values():
            s.ids.f.flush()                  # what was written so far is on disk: a half-written output
        os.kill(os.getpid(), signal.SIGKILL)
    return add(self, *a)
encoding.Corpus.add = dying_add
prepare.prepare([{src!r}], {out!r})
"""


def test_a_killed_prepare_is_never_taken_for_finished_and_a_rerun_works(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT * 3, encoding="utf-8")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", KILLED.format(root=str(ROOT), src=str(tmp_path / "t.txt"), out=str(out))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    debris, = tmp_path.glob(".tmp-out-*")
    assert (debris / "train.npy").stat().st_size > 128 and not (debris / "meta.json").exists()
    assert not out.exists()
    for d in (out, debris):
        with pytest.raises(PrepareError, match="no meta.json"):
            PreparedTokens(d)
    meta = prepare.prepare([tmp_path / "t.txt"], out)                # the rerun: whole, and the debris is gone
    assert not meta["up_to_date"] and not debris.exists()
    assert ids_of(out, "train") + ids_of(out, "val") == list((TEXT * 3).encode())


def test_rerun_rules(tmp_path):
    src, out = tmp_path / "t.txt", tmp_path / "out"
    src.write_text(TEXT, encoding="utf-8")
    prepare.prepare([src], out)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    assert prepare.prepare([src], out)["up_to_date"]                                # same everything: nothing done
    assert before == {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    with pytest.raises(PrepareError, match=r"with val_fraction 0.1 \(now 0.2\); pass --force"):
        prepare.prepare([src], out, val_fraction=0.2)
    src.write_text(TEXT + "more\n", encoding="utf-8")
    with pytest.raises(PrepareError, match=r"with other sources \(a file added, removed or changed since\)"):
        prepare.prepare([src], out)
    assert before == {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}   # refused: untouched
    assert not prepare.prepare([src], out, force=True)["up_to_date"]
    assert ids_of(out, "train") + ids_of(out, "val") == list((TEXT + "more\n").encode())
    (out / "notes.txt").write_text("mine")                          # a file prepare did not write: never replaced
    with pytest.raises(PrepareError, match="holds files that prepare did not write"):
        prepare.prepare([src], out, force=True)
    (out / "notes.txt").unlink()
    with open(out / "val.npy", "ab") as f:                          # a damaged file: the reader refuses it
        f.write(b"\0\0")
    with pytest.raises(PrepareError, match="val.npy is of another size than meta.json says"):
        PreparedTokens(out)
    with pytest.raises(PrepareError, match="with a damaged file"):
        prepare.prepare([src], out)
    prepare.prepare([src], out, force=True)
    PreparedTokens(out)


# ----------------------------------------------------------------------------- the command, as a user runs it
def run(*args, cwd=ROOT, **kw):
    return subprocess.run([sys.executable, "-m", "megatrain_min.prepare", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)}, **kw)


def test_command_prepares_and_reruns(tmp_path, tok_dirs):
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    r = run(tmp_path / "t.txt", "--out", tmp_path / "out", "--tokenizer", tok_dirs["gpt2"], "--val-fraction", "0.2")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    p = PreparedTokens(tmp_path / "out")
    assert f"{tmp_path / 'out'}: {p.meta['splits']['train']['tokens']:,} train / " in r.stdout
    r = run(tmp_path / "t.txt", "--out", tmp_path / "out", "--tokenizer", tok_dirs["gpt2"], "--val-fraction", "0.2")
    assert r.returncode == 0 and "is up to date" in r.stdout, r.stderr


def _refusal_setup(tmp):
    """Inputs and outputs for the refusal cases."""
    (tmp / "ok.txt").write_text("fine\n")
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "dir.txt").mkdir()
    (tmp / "latin1.txt").write_bytes("ok\nna\xefve\n".encode("latin-1"))
    (tmp / "bad.jsonl").write_text('{"text": "a"}\n{"text": oops}\n')
    (tmp / "mixed.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps(CONVS[2]) + "\n")
    (tmp / "blank.jsonl").write_text("\n  \n")
    (tmp / "notext.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    (tmp / "noassistant.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp / "corpus.csv").write_text("a,b\n")
    (tmp / "no-tokenizer").mkdir()
    (tmp / "a-file").write_text("x")
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "keep.me").write_text("x")
    prepare.prepare([tmp / "ok.txt"], tmp / "done", val_fraction=0)


REFUSALS = {  # name: (arguments, words the one line must hold)
    "missing-input": (["nope.txt", "--out", "o"], "nope.txt does not exist"),
    "input-is-a-directory": (["dir.txt", "--out", "o"], "dir.txt is a directory; pass the files in it"),
    "suffix": (["corpus.csv", "--out", "o"], "expected a .txt (text) or .jsonl"),
    "empty": (["empty.txt", "--out", "o"], "empty.txt is empty"),
    "not-utf8": (["latin1.txt", "--out", "o"], "latin1.txt:2: not UTF-8 text (byte 0xef at offset 5)"),
    "bad-json": (["bad.jsonl", "--out", "o"], "bad.jsonl:2: Expecting value"),
    "mixed": (["mixed.jsonl", "--out", "o"], "mixed.jsonl:2: SFT examples in a corpus of pretraining text"),
    "only-blank-lines": (["blank.jsonl", "--out", "o"], "no records, only blank lines"),
    "text-not-a-string": (["notext.jsonl", "--out", "o"], 'notext.jsonl:1: "text" must be a string, got int'),
    "no-assistant": (["noassistant.jsonl", "--out", "o"], "noassistant.jsonl:1: no assistant message"),
    "val-fraction": (["ok.txt", "--out", "o", "--val-fraction", "1"], "--val-fraction 1: it must be > 0 and < 1"),
    "all-in-val": (["ok.txt", "--out", "o", "--val-fraction", "0.5"], "the train split is empty"),
    "no-tokenizer-json": (["ok.txt", "--out", "o", "--tokenizer", "no-tokenizer"], "no tokenizer.json"),
    "native-without-template": (["ok.txt", "--out", "o", "--chat-format", "native"],
                                "--chat-format native: the byte tokenizer has no chat_template"),
    "out-is-a-file": (["ok.txt", "--out", "a-file"], "--out a-file exists and is not a directory"),
    "out-is-foreign": (["ok.txt", "--out", "foreign", "--force"], "holds files that prepare did not write"),
    "out-holds-another": (["ok.txt", "--out", "done", "--val-fraction", "0.2"], "pass --force to replace it"),
    "flag": (["ok.txt"], "the following arguments are required: --out"),
}


@pytest.fixture(scope="module")
def refusal_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("refusals")
    _refusal_setup(tmp)
    return tmp


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_are_one_line_and_exit_2(refusal_dir, case):
    args, words = REFUSALS[case]
    before = sorted((p.relative_to(refusal_dir), p.stat().st_mtime_ns) for p in refusal_dir.rglob("*"))
    r = run(*args, cwd=refusal_dir)
    err = r.stderr.strip().splitlines()
    print(r.stderr)
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], r.stderr
    assert before == sorted((p.relative_to(refusal_dir), p.stat().st_mtime_ns) for p in refusal_dir.rglob("*"))


def _without_root_file_access():
    """In the child before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (capability bits 1, 2) from the
    bounding set, so that file modes apply even to root (the tests run as root in containers)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0):                             # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_unreadable_input_is_one_line(tmp_path):
    (tmp_path / "secret.txt").write_text("x\n")
    (tmp_path / "secret.txt").chmod(0)
    r = run("secret.txt", "--out", "o", cwd=tmp_path, preexec_fn=_without_root_file_access)
    assert r.returncode == 2 and r.stderr == "error: secret.txt: cannot read it (Permission denied)\n", r.stderr
    assert not (tmp_path / "o").exists()
