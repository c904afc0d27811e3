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


def make_bpe_tokenizer(directory, texts, vocab_size, special_tokens, tokenizer_config):
    """A tiny byte-level BPE tokenizer trained here on `texts`, saved as directory/tokenizer.json with a
    tokenizer_config.json (nothing is downloaded). Returns the tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tok


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
