"""model.py against plain PyTorch: the flat layout, attention against an explicit softmax oracle,
the chunked loss against one big cross-entropy, init and config checks.
(The Hugging Face oracle for the whole model lives in tests/hf/test_hf.py.)"""
import math

import pytest
import torch
import torch.nn.functional as F

import model
from conftest import SPECIAL, check_close
from megatrain_min.engine import checks, tiling
from megatrain_min.engine.lazy_init import LazyInit


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


# ----------------------------------------------------------------------------- initial values, declared in the layout
# The tensors a layout held at 52eb41c: the suffix rule below is the oracle for these (a tensor a reader adds is
# initialised as its own entry declares, and not compared).
TODAY = {"embed", "lm_head", "norm", "input_layernorm.weight", "post_attention_layernorm.weight",
         *(f"self_attn.{p}_proj.{t}" for p in "qkvo" for t in ("weight", "bias")),
         *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
         "self_attn.q_norm.weight", "self_attn.k_norm.weight"}


def init_by_suffix(cfg, layout, gen):
    """model.init_unit as it was before each layout entry declared its initial values (52eb41c), frozen here as the
    oracle: chosen by the name's suffix -- matrices N(0, 0.02), o_proj and down_proj scaled by 1/sqrt(2 n_layer),
    norm gains 1, every other vector 0."""
    out = {}
    for e in (e for e in layout.entries if e.short in TODAY):
        if len(e.shape) == 1:
            norm = e.short.endswith("norm.weight") or e.short == "norm"
            out[e.key] = torch.ones(e.shape) if norm else torch.zeros(e.shape)
        else:
            residual = e.short.endswith(("o_proj.weight", "down_proj.weight"))
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02
            out[e.key] = torch.empty(e.shape).normal_(0.0, std, generator=gen)
    return out


@pytest.mark.parametrize("name", list(model.PRESETS) + ["gqa-bias-qknorm-tied"])
def test_every_presets_declared_init_is_the_suffix_rule(name):
    """Every entry of every preset's layout declares what the suffix rule chose (7b and up are too big to make)."""
    cfg = SPECIAL if name == "gqa-bias-qknorm-tied" else model.PRESETS[name]
    for lay in model.units(cfg):
        for e in (e for e in lay.entries if e.short in TODAY):
            if len(e.shape) == 1:
                want = model.ONES if e.short.endswith("norm.weight") or e.short == "norm" else model.ZEROS
            elif e.short.endswith(("o_proj.weight", "down_proj.weight")):
                want = model.normal(0.02 / math.sqrt(2 * cfg.n_layer))
            else:
                want = model.normal(0.02)
            assert e.init == want, f"{name}: {e.key} starts as {e.init}, the suffix rule gave {want}"


@pytest.mark.parametrize("cfg", [model.PRESETS["toy"], SPECIAL], ids=["toy", "gqa-bias-qknorm-tied"])
@pytest.mark.parametrize("seed", [0, 3])
def test_init_weights_and_lazy_init_are_todays_bit_for_bit(cfg, seed):
    """init_weights and LazyInit make today's tensors, bit for bit (a tensor added since that draws from the
    generator before them changes them: this test then says which)."""
    gen = torch.Generator().manual_seed(seed)
    want = {}
    for lay in model.units(cfg):
        want.update(init_by_suffix(cfg, lay, gen))
    got, lazy = model.init_weights(cfg, seed), LazyInit(cfg, seed)
    assert list(got) == list(lazy) and set(want) <= set(got)
    for k in want:
        assert torch.equal(got[k], want[k]) and torch.equal(lazy[k], want[k]), f"{k}: not 52eb41c's initial values"


def test_an_entry_without_initial_values_is_refused_at_construction(monkeypatch):
    """A reader who adds a tensor to the layout and forgets its initial values is told at once (model.units), not
    left with a silent zero that the engine-vs-reference tests cannot see (both run the same layout)."""
    with pytest.raises(ValueError, match="'gate' declares no initial values"):
        model.Layout("layer.0", [("gate", "model.layers.0.gate", (4,))])
    entries = model.layer_entries
    monkeypatch.setattr(model, "layer_entries", lambda cfg: entries(cfg) + [("gate", (cfg.d_model,))])
    with pytest.raises(ValueError, match="layer.0: entry 'gate' declares no initial values"):
        model.units(model.PRESETS["toy"])
    monkeypatch.setattr(model, "layer_entries", lambda cfg: entries(cfg) + [("gate", (1,), model.ONES)])
    w = model.init_weights(model.PRESETS["toy"])                       # declared: made as declared
    assert torch.equal(w["model.layers.3.gate"], torch.ones(1))


# ----------------------------------------------------------------------------- the maths, from the formulas
# An oracle independent of model.py: each piece written from its formula, in float64 (model.py computes in fp32), so
# a moved eps, a wrong RoPE band, another attention scale or activation shows far above the rounding. The
# reference engine and tests/core/test_stream.py call model.block itself, so they cannot see such a bug.
def norm64(t, g, eps):
    """RMSNorm: g * t / sqrt(mean(t^2) + eps), eps inside the root (Llama's LlamaRMSNorm)."""
    return g * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)


def inv_freq64(cfg):
    """RoPE's frequencies theta^(-2i/hd), and with rope_scaling Llama 3.1's rule as Meta's reference code writes it
    (apply_scaling): wavelengths below original / high_freq_factor kept, above original / low_freq_factor divided by
    factor, smoothly blended between."""
    hd = cfg.head_dim
    inv = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    if not cfg.rope_scaling:
        return inv
    rs = cfg.rope_scaling
    orig = rs["original_max_position_embeddings"]
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < orig / rs["high_freq_factor"]:
            out.append(f)
        elif wavelen > orig / rs["low_freq_factor"]:
            out.append(f / rs["factor"])
        else:
            smooth = (orig / wavelen - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
            out.append((1 - smooth) * f / rs["factor"] + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


ACT64 = {  # the activations by their formulas (transformers' ACT2FN names)
    "silu": lambda x: x / (1 + torch.exp(-x)),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu_pytorch_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
}


def naive_block(cfg, x, w, T):
    """The layer written the long way, in float64: repeat_kv, explicit masked softmax with scale 1/sqrt(hd), RoPE
    from inv_freq64, the gated MLP from ACT64. No SDPA, nothing of model.py's but the config."""
    B, _, d = x.shape
    nh, nkv, hd, eps = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.norm_eps
    x = x.double()
    w = {k: v.double() for k, v in w.items()}
    h = norm64(x, w["input_layernorm.weight"], eps)
    q = h @ w["self_attn.q_proj.weight"].T + w.get("self_attn.q_proj.bias", 0)
    k = h @ w["self_attn.k_proj.weight"].T + w.get("self_attn.k_proj.bias", 0)
    v = h @ w["self_attn.v_proj.weight"].T + w.get("self_attn.v_proj.bias", 0)
    q, k, v = q.view(B, T, nh, hd), k.view(B, T, nkv, hd), v.view(B, T, nkv, hd)
    if cfg.qk_norm:
        q = norm64(q, w["self_attn.q_norm.weight"], eps)
        k = norm64(k, w["self_attn.k_norm.weight"], eps)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq64(cfg)      # (T, hd/2)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]

    def rot(t):  # rotate pairs (i, i + hd/2)
        a, b = t[..., :hd // 2], t[..., hd // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    q, k = rot(q), rot(k)
    rep = nh // nkv
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    y = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, nh * hd)
    x = x + y @ w["self_attn.o_proj.weight"].T
    h = norm64(x, w["post_attention_layernorm.weight"], eps)
    gate = ACT64[cfg.hidden_act](h @ w["mlp.gate_proj.weight"].T)
    return x + (gate * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


LLAMA3 = model.GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, max_seq_len=64,
                         rope_theta=10000.0, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                               original_max_position_embeddings=16))
GELU = model.GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=4, d_model=64, d_ff=96, max_seq_len=64,
                       hidden_act="gelu_pytorch_tanh", norm_eps=1e-6)
FORMULA_CFGS = {"toy": model.PRESETS["toy"], "gqa-bias-qknorm-tied": SPECIAL, "llama3-rope": LLAMA3,
                "gelu-tanh": GELU}
# model.block (fp32) vs naive_block (float64), max|a - b| / max|b|, per input scale: measured 5.2e-8..7.2e-8 at
# x ~ 1 and 2.3e-7..4.2e-7 at x ~ 1e-3 over these configs (-s prints them); about 10x
BLOCK = {1.0: 7e-7, 1e-3: 4e-6}


@pytest.mark.parametrize("scale", [1.0, 1e-3], ids=["x~1", "x~1e-3"])   # at 1e-3 the norms' eps matters (x^2 ~ eps)
@pytest.mark.parametrize("name", FORMULA_CFGS)
def test_block_matches_the_formulas(name, scale, gen):
    cfg = FORMULA_CFGS[name]
    w = model.init_weights(cfg, 0)
    lw = model.layer_weights(cfg, w, 0)
    for k in lw:  # make biases and norm gains non-trivial so they are really tested
        if lw[k].dim() == 1:
            lw[k] = lw[k] + 0.1 * torch.randn(lw[k].shape, generator=gen)
    T = 16
    x = scale * torch.randn(2, T, cfg.d_model, generator=gen)
    ours = model.block(cfg, x, lw, model.rope_cache(cfg, T))
    check_close(f"{name}, x ~ {scale}: block vs the formulas", ours, naive_block(cfg, x, lw, T), BLOCK[scale])


def test_rms_norm_matches_its_formula_where_eps_matters(gen):
    """Rows whose root mean square runs from 1e-4 (its square far below eps) to 10: eps inside the square root,
    and no more than model.rms_norm's fp32 rounding (measured 1.1e-7 in the worst row; 10x)."""
    scales = torch.logspace(-4, 1, 11, dtype=torch.float64)[:, None]
    x = (torch.randn(11, 64, generator=gen, dtype=torch.float64) * scales).float()
    g = 1 + 0.1 * torch.randn(64, generator=gen)
    for eps in (1e-5, 1e-6):
        ours = model.rms_norm(x, g, eps)
        want = norm64(x.double(), g.double(), eps)
        for i in range(len(x)):   # row by row: each row's own scale
            rms = float(x[i].double().pow(2).mean()) ** 0.5
            check_close(f"rms_norm, eps {eps}, row {i} (rms {rms:.0e})", ours[i], want[i], 1.1e-6)


@pytest.mark.parametrize("name", ["toy", "llama3-rope"])
def test_rope_tables_match_the_formulas(name):
    """cos and sin of model.rope_cache vs float64 angles t * inv_freq64: plain RoPE and Llama 3.1's bands. fp32
    angles up to 63 rad round to ~4e-6 (measured 3.8e-6 absolute; 10x)."""
    cfg = FORMULA_CFGS[name]
    T = 64
    cos, sin = model.rope_cache(cfg, T)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq64(cfg)
    ang = torch.cat([ang, ang], -1)
    for what, ours, want in (("cos", cos, ang.cos()), ("sin", sin, ang.sin())):
        err = float((ours.double() - want).abs().max())
        print(f"measured {name} rope {what}: {err:.2e} absolute")
        assert err <= 4e-5, f"{name}: rope {what} differs from the formula by {err:.2e} (bound 4e-5)"


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
