# %% [markdown]
# # Lesson 1 -- a transformer layer as a pure function of (input, weights)
#
# **What you will learn**
#
# * how every parameter of one layer can live in ONE flat fp32 buffer, with each weight a *view*
#   (an offset and a shape) into it -- so moving a layer is one copy, not nine;
# * why the buffer is laid out `[2-D matrices | 1-D vectors]`;
# * how `model.Layout` and `model.units` describe the whole model as a list of such buffers;
# * that a Llama layer is a pure function `block(x, w)`: nothing about it lives in a module object,
#   so the same function can run on weights that just arrived on the GPU, in whatever buffer.
#
# This is the foundation of everything that follows: lesson 2 trains one layer at a time, lesson 3
# keeps the flat buffers in host memory, lesson 4 streams them to the GPU.
#
# Run it: `python tutorials/01_layer_as_function.py` (1-2 s on a 2-core CPU). It is also a
# notebook in "percent" format (`jupytext --to notebook`, or open it in VS Code / PyCharm).

# %%
import math
import sys
from pathlib import Path

import torch

# the repository root holds model.py; works as a script and as a notebook opened in tutorials/
ROOT = (Path(__file__).resolve().parents[1] if "__file__" in globals()   # a script, or a notebook
        else Path.cwd().resolve().parent)                                 # run from tutorials/
sys.path.insert(0, str(ROOT))
import model  # noqa: E402

torch.manual_seed(0)

# %% [markdown]
# ## 1. Two tensors, one buffer
#
# Start with the smallest possible example: a weight matrix `W` (3, 4) and a bias `b` (3,). Instead
# of two allocations we make one flat buffer of 3*4 + 3 = 15 numbers and carve both out of it. A
# *view* (`flat[off:off+n].view(shape)`) allocates nothing: it is a pointer, an offset and a shape.

# %%
shapes = {"W": (3, 4), "b": (3,)}
offsets, off = {}, 0
for name, shape in shapes.items():
    offsets[name] = off
    off += math.prod(shape)
flat = torch.zeros(off)                                   # (15,) the only allocation
views = {n: flat[offsets[n]:offsets[n] + math.prod(s)].view(s) for n, s in shapes.items()}
print("offsets:", offsets, " total elements:", flat.numel())

views["W"].copy_(torch.arange(12.0).view(3, 4))           # writing through a view ...
views["b"].fill_(-1.0)
print("flat after writing through the views:", flat.tolist())  # ... writes the buffer
assert views["W"].data_ptr() == flat.data_ptr()           # same storage: W starts at element 0
assert views["b"].data_ptr() == flat.data_ptr() + 12 * flat.element_size()

# One copy of `flat` moves every weight at once -- the property the streaming engine lives on.
# (On a GPU this is one DMA transfer per layer instead of one per tensor.)
moved = flat.clone()                                      # stands in for flat.to("cuda")
moved_views = {n: moved[offsets[n]:offsets[n] + math.prod(s)].view(s) for n, s in shapes.items()}
assert torch.equal(moved_views["W"], views["W"]) and torch.equal(moved_views["b"], views["b"])

# %% [markdown]
# ## 2. The layout of a real layer
#
# `model.Layout` is exactly the dictionary above, written once: a list of (short name, Hugging Face
# key, shape, offset). The project orders every layer as **matrices first, then vectors**. AdamW
# decays the matrices and not the norm weights / biases (lesson 3), so "decay" is the contiguous
# region
# `[0, n_decay)` and "no decay" is `[n_decay, numel)`: two optimizer calls per layer, no masks.

# %%
cfg = model.PRESETS["toy"]            # 4 layers, d_model 128, 4 heads, SwiGLU 352, byte vocabulary
lay = model.units(cfg)[1]             # units: [embed, layer.0, ..., layer.3, head]
print(lay.table())
print(f"\n{lay.n_decay:,} of {lay.numel:,} elements are decayed (the matrices); the "
      "rest are norm weights")

# %% [markdown]
# The whole model is a list of such *units*: the embedding, each layer, and the head (final norm +
# LM head). Each unit is one flat buffer. Their sizes add up to the parameter count.

# %%
all_units = model.units(cfg)
for u in all_units:
    print(f"  {u.name:<8} {u.numel:>9,} elements")
print(f"  total    {sum(u.numel for u in all_units):>9,} = model.n_params(cfg) = "
      f"{model.n_params(cfg):,}")
assert sum(u.numel for u in all_units) == model.n_params(cfg)

# %% [markdown]
# Fill one flat buffer per unit from a weights dict (`model.init_weights` returns the project's
# interchange format: `{Hugging Face key: fp32 tensor}`). `key_views` gives the views by full key.

# %%
weights = model.init_weights(cfg, seed=0)
flats = []
for u in all_units:
    buf = torch.empty(u.numel)                            # one fp32 buffer per unit
    for key, view in u.key_views(buf).items():
        view.copy_(weights[key])
    flats.append(buf)
print("layer.0 flat buffer:", tuple(flats[1].shape), flats[1].dtype)

# %% [markdown]
# ## 3. The layer as a pure function, from scratch
#
# A Llama layer, written with nothing but tensor arithmetic (no `torch.nn`, no fused attention):
#
# ```
# h = RMSNorm(x);  q, k, v = h Wq^T, h Wk^T, h Wv^T;  rotate q, k (RoPE)
# x = x + softmax(q k^T / sqrt(hd) + causal mask) v Wo^T
# h = RMSNorm(x);  x = x + (silu(h Wgate^T) * (h Wup^T)) Wdown^T
# ```
#
# Its only inputs are `x` and the dict of views `w`: it can run on any buffer that holds the
# numbers.

# %%
def rmsnorm_scratch(x, weight, eps):
    return weight * (x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt())


def rope_scratch(x, theta):
    """x: (B, h, T, hd). Rotate pairs (i, i + hd/2) by angle t * theta^(-2i/hd)."""
    T, hd = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, hd, 2).float() / hd)                 # (hd/2,)
    ang = torch.arange(T).float()[:, None] * inv_freq[None, :]                 # (T, hd/2)
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)                  # (T, hd)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def block_scratch(cfg, x, w):
    """x: (B, T, d); w: {short name: view}. The same maths as model.block, spelled out."""
    B, T, d = x.shape
    nh, nkv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    h = rmsnorm_scratch(x, w["input_layernorm.weight"], cfg.norm_eps)
    q = (h @ w["self_attn.q_proj.weight"].T).view(B, T, nh, hd).transpose(1, 2)   # (B, nh, T, hd)
    k = (h @ w["self_attn.k_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
    v = (h @ w["self_attn.v_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
    # GQA: share k/v heads
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    q, k = rope_scratch(q, cfg.rope_theta), rope_scratch(k, cfg.rope_theta)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)                            # (B, nh, T, T)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))  # causal
    y = scores.softmax(-1) @ v                                                  # (B, nh, T, hd)
    x = x + y.transpose(1, 2).reshape(B, T, nh * hd) @ w["self_attn.o_proj.weight"].T
    h = rmsnorm_scratch(x, w["post_attention_layernorm.weight"], cfg.norm_eps)
    gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T   # (B, T, ff)
    act = gate * torch.sigmoid(gate)                  # SiLU: the toy's activation, cfg.hidden_act
    return x + (act * up) @ w["mlp.down_proj.weight"].T


B, T = 2, 32
x = torch.randn(B, T, cfg.d_model)                                     # (B, T, d) a layer input
w = lay.views(flats[1])                                                # views into layer.0's buffer
rope = model.rope_cache(cfg, T)                                        # (cos, sin), (T, hd) each
ours, theirs = block_scratch(cfg, x, w), model.block(cfg, x, w, rope)
diff_block = (ours - theirs).abs().max().item()
print(f"block_scratch vs model.block: max |diff| = {diff_block:.2e}  (fused "
      "attention rounds differently)")

# %% [markdown]
# ## 4. The model is a chain of unit functions
#
# Embedding = gather rows of the embedding unit; then `block` once per layer unit, each on its own
# flat buffer; then the head unit (final RMSNorm + LM head). No object holds the model -- only a
# list of buffers and a loop. Compare with `model.forward`, the project's plain reference forward
# over the weights dict.

# %%
tokens = torch.randint(0, cfg.vocab_size, (B, T))                             # (B, T) byte ids
h = all_units[0].views(flats[0])["embed"][tokens]                             # (B, T, d) row gather
for i in range(cfg.n_layer):
    h = model.block(cfg, h, all_units[1 + i].views(flats[1 + i]), rope)      # layer i on its buffer
head = all_units[-1].views(flats[-1])                                        # {"lm_head", "norm"}
logits_units = model.rms_norm(h, head["norm"], cfg.norm_eps) @ head["lm_head"].T  # (B, T, V)
logits_ref = model.forward(cfg, weights, tokens)
diff_model = (logits_units - logits_ref).abs().max().item()
print(f"unit-by-unit forward vs model.forward: max |diff| = {diff_model:.2e}")

# %% [markdown]
# ## Check
#
# * the hand-written layer equals `model.block` to float32 rounding (it spells out SiLU, the toy's
#   `cfg.hidden_act`: should model.py's toy compute another activation, this check says so);
# * the unit-by-unit forward over flat buffers equals `model.forward` over the weights dict (same
#   ops, same order: expect exactly 0);
# * the views really are views: writing the flat buffer changes what `block` computes.

# %%
assert cfg.hidden_act == "silu", f"block_scratch spells out SiLU; the toy computes {cfg.hidden_act}"
assert diff_block < 3e-6, diff_block          # measured 2.4e-7; another activation: 1.9e-3
assert diff_model < 1e-5, diff_model
flats[1].mul_(0.0)                                                    # zero every weight of layer.0
y0 = model.block(cfg, x, lay.views(flats[1]), rope)
assert torch.equal(y0, x), \
    "a layer with all-zero weights must be the identity (both residual branches vanish)"
print(f"OK  block max diff {diff_block:.1e}, model max diff {diff_model:.1e}, "
      "views share the buffer")
