"""model.py against plain PyTorch: the flat layout, attention against an explicit softmax oracle,
the chunked loss against one big cross-entropy, init and config checks.
(The Hugging Face oracle for the whole model lives in tests/test_hf.py.)"""
import math

import pytest
import torch
import torch.nn.functional as F

import model
from conftest import SPECIAL
from megatrain_min import checks, tiling
from megatrain_min.lazy_init import LazyInit


def test_preset_param_counts_match_layouts_and_init():
    for name in ("toy",):
        cfg = model.PRESETS[name]
        w = model.init_weights(cfg, seed=0)
        assert sum(t.numel() for t in w.values()) == model.n_params(cfg)
    w = model.init_weights(SPECIAL, seed=0)
    assert "lm_head.weight" not in w  # tied: one entry, no duplicate
    assert sum(t.numel() for t in w.values()) == model.n_params(SPECIAL)


def test_layout_is_contiguous_matrices_first_and_views_share_storage():
    for cfg in (model.PRESETS["toy"], SPECIAL):
        for lay in model.units(cfg):
            off = 0
            for e in lay.entries:
                assert e.offset == off
                off += math.prod(e.shape)
            assert off == lay.numel
            dims = [len(e.shape) for e in lay.entries]
            assert dims == sorted(dims, reverse=True)
            assert lay.n_decay == sum(math.prod(e.shape) for e in lay.entries if len(e.shape) >= 2)
            flat = torch.arange(lay.numel, dtype=torch.float32)
            for v in lay.views(flat).values():
                assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_init_is_seeded_and_scaled():
    cfg = model.PRESETS["toy"]
    a, b, c = model.init_weights(cfg, 0), model.init_weights(cfg, 0), model.init_weights(cfg, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[model.EMBED], c[model.EMBED])
    assert torch.all(a["model.layers.0.input_layernorm.weight"] == 1)
    o = a["model.layers.0.self_attn.o_proj.weight"].std().item()
    q = a["model.layers.0.self_attn.q_proj.weight"].std().item()
    assert abs(o / q - 1 / math.sqrt(2 * cfg.n_layer)) < 0.05


def naive_block(cfg, x, w, T):
    """The same layer written the long way: repeat_kv, explicit masked softmax, no SDPA."""
    B, _, d = x.shape
    nh, nkv, hd, eps = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.norm_eps

    def norm(t, g):
        return g * (t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    h = norm(x, w["input_layernorm.weight"])
    q = h @ w["self_attn.q_proj.weight"].T + w.get("self_attn.q_proj.bias", 0)
    k = h @ w["self_attn.k_proj.weight"].T + w.get("self_attn.k_proj.bias", 0)
    v = h @ w["self_attn.v_proj.weight"].T + w.get("self_attn.v_proj.bias", 0)
    q, k, v = q.view(B, T, nh, hd), k.view(B, T, nkv, hd), v.view(B, T, nkv, hd)
    if cfg.qk_norm:
        q, k = norm(q, w["self_attn.q_norm.weight"]), norm(k, w["self_attn.k_norm.weight"])
    pos = torch.arange(T, dtype=torch.float64)[:, None]
    inv = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos * inv                                              # (T, hd/2)
    cos, sin = ang.cos().float(), ang.sin().float()

    def rot(t):  # rotate pairs (i, i + hd/2)
        a, b = t[..., :hd // 2], t[..., hd // 2:]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([a * c - b * s, a * s + b * c], -1)

    q, k = rot(q), rot(k)
    rep = nh // nkv
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    y = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, nh * hd)
    x = x + y @ w["self_attn.o_proj.weight"].T
    h = norm(x, w["post_attention_layernorm.weight"])
    return x + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


@pytest.mark.parametrize("cfg", [model.PRESETS["toy"], SPECIAL], ids=["toy", "gqa-bias-qknorm-tied"])
def test_block_matches_naive_attention(cfg, gen):
    w = model.init_weights(cfg, 0)
    lw = model.layer_weights(cfg, w, 0)
    for k in lw:  # make biases and norm gains non-trivial so they are really tested
        if lw[k].dim() == 1:
            lw[k] = lw[k] + 0.1 * torch.randn(lw[k].shape, generator=gen)
    T = 16
    x = torch.randn(2, T, cfg.d_model, generator=gen)
    ours = model.block(cfg, x, lw, model.rope_cache(cfg, T))
    ref = naive_block(cfg, x, lw, T)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"block vs naive: max rel diff {err:.2e}")
    assert err < 1e-5


def test_chunked_loss_equals_one_big_cross_entropy(gen):
    cfg = SPECIAL
    w = {k: v.requires_grad_() for k, v in model.init_weights(cfg, 0).items()}
    tok = torch.randint(0, cfg.vocab_size, (3, 20), generator=gen)
    tgt = torch.randint(0, cfg.vocab_size, (3, 20), generator=gen)
    tgt[:, :5] = model.IGNORE
    big = F.cross_entropy(model.forward(cfg, w, tok).flatten(0, 1), tgt.flatten(), ignore_index=model.IGNORE)
    g_big = torch.autograd.grad(big, list(w.values()))
    small = model.loss(cfg, w, tok, tgt, chunk_tokens=7)  # 60 tokens in chunks of 7: a ragged last chunk
    g_small = torch.autograd.grad(small, list(w.values()))
    assert abs(big.item() - small.item()) / big.item() < 1e-6
    for a, b in zip(g_big, g_small):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_forward_is_causal(gen):
    cfg = model.PRESETS["toy"]
    w = model.init_weights(cfg, 0)
    tok = torch.randint(0, 256, (1, 12), generator=gen)
    a = model.forward(cfg, w, tok)
    tok2 = tok.clone()
    tok2[0, 8:] = (tok2[0, 8:] + 1) % 256
    b = model.forward(cfg, w, tok2)
    assert torch.equal(a[0, :8], b[0, :8]) and not torch.allclose(a[0, 8:], b[0, 8:])


@pytest.mark.parametrize("kw,msg", [(dict(n_head=5), "does not divide d_model"),
                                    (dict(n_head=4, n_kv_head=3), "not a multiple of n_kv_head"),
                                    (dict(n_layer=0), "n_layer must be positive")])
def test_config_check_messages(kw, msg):
    with pytest.raises(ValueError, match=msg):
        checks.check_config(model.GPTConfig(**kw))


def test_lazy_init_equals_init_weights_in_any_order():
    cfg = SPECIAL
    w = model.init_weights(cfg, seed=3)
    lazy = LazyInit(cfg, seed=3)
    assert set(lazy) == set(w)
    keys = list(w)
    for k in keys + keys[::-1]:  # sequential, then backwards (regenerates)
        assert torch.equal(lazy[k], w[k]), k


def test_llama3_rope_bands():
    """llama3_inv_freq keeps short wavelengths, slows long ones by `factor`, blends in between."""
    inv = torch.tensor([1.0, 0.1, 0.01, 0.001])            # periods in a 64-token context: 10.2, 1.02, 0.10, 0.01
    out = model.llama3_inv_freq(inv, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=64)
    assert out[0] == inv[0] and torch.equal(out[2:], inv[2:] / 8)
    assert inv[1] / 8 < out[1] < inv[1]


# ----------------------------------------------------------------------------- sequence tiling
def layer(tile):
    """The layer the engine is handed: the untiled model.block (the oracle), or tiling.Tiled."""
    return tiling.Tiled(tile) if tile else model


def tiled_vs_untiled(cfg, dtype, tiles, B=2, T=48, seed=0):
    """block and block_grad of one layer untiled (the oracle: one autograd graph) and in each of tiles,
    on the same input, weights and output gradient. Returns {tile: (out, dx, {name: fp32 weight grad})}."""
    g = torch.Generator().manual_seed(seed)
    lay = model.units(cfg)[1]
    flat = torch.randn(lay.numel, generator=g) * 0.05      # norm gains and biases non-trivial too
    x, dy = torch.randn(B, T, cfg.d_model, generator=g), torch.randn(B, T, cfg.d_model, generator=g)
    rope = model.rope_cache(cfg, T)
    w = {k: v.to(dtype).detach().requires_grad_() for k, v in lay.views(flat).items()}
    out = {}
    for tile in (0, *tiles):
        acc = {k: torch.zeros(v.shape) for k, v in w.items()}
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            with torch.no_grad():
                y = layer(tile).block(cfg, x, w, rope)
            dx = layer(tile).block_grad(cfg, x, w, rope, dy, acc)
        out[tile] = (y, dx, acc)
    return out


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("cfg", [model.PRESETS["toy"], SPECIAL], ids=["toy", "gqa-bias-qknorm-tied"])
def test_tiled_block_equals_untiled_fp32(cfg):
    """A tiled layer is the untiled layer: output, dx and every weight gradient to <= 1e-6 relative in fp32, for
    a tile that divides T (16), one that does not (7: a short last tile) and one longer than T (100)."""
    runs = tiled_vs_untiled(cfg, torch.float32, (16, 7, 100))
    y0, dx0, acc0 = runs[0]
    for tile, (y, dx, acc) in runs.items():
        errs = {"out": rel(y, y0), "dx": rel(dx, dx0), **{k: rel(acc[k], acc0[k]) for k in acc}}
        worst = max(errs, key=errs.get)
        print(f"tile {tile:>3}: out {errs['out']:.1e}, dx {errs['dx']:.1e}, worst {worst} {errs[worst]:.1e}")
        assert max(errs.values()) <= 1e-6, errs
        assert all(acc[k].abs().max() > 0 for k in acc)            # every weight really got a gradient


def test_tiled_block_under_bf16_autocast():
    """Under bf16 autocast (the engine's bf16 compute) the tiled layer computes every token as the untiled one
    does (output and dx to 1e-6), and its weight gradients, summed tile by tile in fp32, are as close to the
    fp32 gradients as the untiled layer's (one bf16 rounding of the whole sum)."""
    cfg = SPECIAL
    fp32 = tiled_vs_untiled(cfg, torch.float32, (), T=256)[0][2]
    runs = tiled_vs_untiled(cfg, torch.bfloat16, (64, 37), T=256)
    y0, dx0, acc0 = runs[0]
    def dist(acc):  # relative distance of all weight gradients from the fp32 ones
        return (sum(((acc[k] - fp32[k]) ** 2).sum() for k in acc) / sum((fp32[k] ** 2).sum() for k in acc)) ** 0.5
    for tile in (64, 37):
        y, dx, acc = runs[tile]
        print(f"bf16 tile {tile}: out {rel(y, y0):.1e}, dx {rel(dx, dx0):.1e}; weight grads vs fp32: tiled "
              f"{dist(acc):.2e}, untiled {dist(acc0):.2e}")
        assert rel(y, y0) <= 1e-6 and rel(dx, dx0) <= 1e-6
        assert dist(acc) <= 1.1 * dist(acc0) and dist(acc0) < 2e-2


def test_tiled_layer_never_makes_a_seq_by_ff_tensor():
    """The point of tiling: no (T, d_ff) tensor exists, in the forward or the backward. Every tensor an op makes
    is recorded (a TorchDispatchMode sees the backward's ops too): untiled the largest is T x d_ff, tiled it is
    O(T x d) or one tile x d_ff."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        numel, where = 0, None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                    self.numel, self.where = t.numel(), (str(func), tuple(t.shape))
            return out

    cfg = model.GPTConfig(vocab_size=256, n_layer=1, n_head=4, n_kv_head=2, d_model=64, d_ff=1024, max_seq_len=512)
    T, tile = 512, 32
    lay = model.units(cfg)[1]
    w = {k: v.detach().requires_grad_() for k, v in lay.views(torch.randn(lay.numel) * 0.02).items()}
    acc = {k: torch.zeros(v.shape) for k, v in w.items()}
    x = torch.randn(1, T, cfg.d_model)
    rope = model.rope_cache(cfg, T)
    largest = {}
    for t in (0, tile):
        with Largest() as m:
            with torch.no_grad():
                layer(t).block(cfg, x, w, rope)
            layer(t).block_grad(cfg, x, w, rope, torch.randn_like(x), acc)
        largest[t] = m.numel
        print(f"tile {t}: largest tensor {m.numel:,} elements, {m.where}")
    assert largest[0] >= T * cfg.d_ff
    assert largest[tile] <= max(tile * cfg.d_ff, T * cfg.d_model, cfg.d_model * cfg.d_ff) < T * cfg.d_ff  # (a weight)


def test_tiles_cover_the_sequence_once():
    for T, n in ((48, 16), (48, 7), (5, 100), (5, 0)):
        s = tiling.tiles(T, n)
        assert [i for t in s for i in range(T)[t]] == list(range(T))
        assert all(t.stop - t.start == (n or T) for t in s[:-1])
