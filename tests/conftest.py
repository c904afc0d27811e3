"""Make the repository root importable (model.py, stream.py, optim.py live there) and share helpers."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import model  # noqa: E402

# grouped-query attention, Qwen2 qkv bias, Qwen3 q/k norm with an explicit head_dim, tied embeddings
SPECIAL = model.GPTConfig(vocab_size=97, n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=96, head_dim=32,
                          qkv_bias=True, qk_norm=True, tie_embeddings=True, max_seq_len=64)


def random_batch(cfg, B, T, gen, ignore_frac=0.2):
    """tokens, targets (B, T); a fraction of the targets set to -100."""
    tok = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    tgt = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    tgt[torch.rand(B, T, generator=gen) < ignore_frac] = model.IGNORE
    return tok, tgt


def losses_agree(a, b, cfg, gen, steps, B, T, rtol):
    """Step trainers a and b on the same random batches; every step's losses agree to rtol (relative)."""
    for s in range(steps):
        tok, tgt = random_batch(cfg, B, T, gen)
        la, lb = a.step(tok, tgt), b.step(tok, tgt)
        assert abs(la - lb) / abs(lb) <= rtol, f"step {s}: loss {la} vs {lb}"


def update_rel(w0, wa, wb):
    """||(wa - w0) - (wb - w0)|| / ||wb - w0|| over all tensors: how far two updates are apart."""
    num = sum(((wa[k] - wb[k]).double() ** 2).sum() for k in wb) ** 0.5
    den = sum(((wb[k] - w0[k]).double() ** 2).sum() for k in wb) ** 0.5
    return float(num / den)


SPLIT = {  # the split regexes of the published tokenizer.json files (Llama 3 groups up to 3 digits, Qwen2 none)
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def make_bpe_tokenizer(directory, texts, vocab_size, special_tokens, tokenizer_config, style="gpt2",
                       added_tokens=()):
    """A tiny BPE tokenizer trained here on `texts`, saved as directory/tokenizer.json with a
    tokenizer_config.json (nothing is downloaded). Returns the tokenizers.Tokenizer.
    style: the pipeline of a published family, so that transformers 5 (whose Qwen2Tokenizer and
    LlamaTokenizer rebuild it rather than read it from tokenizer.json) tokenizes like the file:
    "gpt2" byte-level; "llama3" and "qwen2" byte-level after the family's split regex (and NFC for Qwen2);
    "sentencepiece" (Llama 2, Mistral) spaces as U+2581, one before the text, unknown characters -> the
    first special token. added_tokens: added, not special (Qwen3's <think>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    if style == "sentencepiece":
        tok = Tokenizer(models.BPE(unk_token=special_tokens[0], fuse_unk=True, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])            # as the published files
        alphabet = sorted(set("".join(texts)))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if style in SPLIT:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(SPLIT[style]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if style == "qwen2":
            tok.normalizer = normalizers.NFC()
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                                       initial_alphabet=alphabet))
    tok.add_tokens(list(added_tokens))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tok


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
