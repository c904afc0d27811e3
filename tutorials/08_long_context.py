# %% [markdown]
# # Lesson 8 -- long context on one GPU: 7B at 512k tokens
#
# **What you will learn**
#
# * which tensors grow with the sequence length T, and which of them grow with T x d_ff;
# * **sequence tiling**: the token-local parts of a layer (norms, projections, MLP) computed a tile
#   of tokens at a time -- in the forward, the recompute and the backward -- while attention sees
#   the whole sequence; why it is exact, and how the backward of a tiled layer goes;
# * what each technique buys in context length: tiling, activation offload, the chunked loss, flash
#   attention -- with the planner's numbers for Llama-2-7B on one GH200;
# * the longest context per model and GPU, next to the published ones (MegaTrain: 7B at 512k on one
#   GH200; Arctic Long Sequence Training: Llama-8B at 500k on one H100). Predictions: no GPU ran
#   them.
#
# Lessons 2 and 6 kept the weights and the optimizer off the GPU; what is left on it at long T is
# activations. Nothing big is allocated here: the layer runs on a narrow model, the rest is
# arithmetic.
#
# Run it: `python tutorials/08_long_context.py` (~9-10 s on a 2-core CPU).

# %%
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = (Path(__file__).resolve().parents[1] if "__file__" in globals()   # a script, or a notebook
        else Path.cwd().resolve().parent)                                 # run from tutorials/
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402
from megatrain_min.engine import tiling  # noqa: E402
from megatrain_min.plan import fit, memory, report  # noqa: E402

GB = 1e9

# %% [markdown]
# ## 1. What grows with T
#
# One Llama-2-7B layer (d 4096, 32 heads, d_ff 11008) at T = 524,288 tokens, bf16. The layer input
# and its gradient are (T, d); q, k, v and the attention output are (T, d) each; the MLP makes three
# (T, d_ff) tensors (gate, up, their product) and its backward as many gradients. A flash-attention
# kernel never makes the (T, T) scores: it keeps one fp32 log-sum-exp per head and token instead.

# %%
C7 = model.PRESETS["7b"]
T = 524288
print(f"7b, T = {T:,}, bf16:")
print(f"  q, k or v        (T, d)    {T * C7.d_model * 2 / GB:6.1f} GB each")
print(f"  MLP intermediate (T, d_ff) {T * C7.d_ff * 2 / GB:6.1f} GB each, and the untiled layer "
      "saves ~6 of them")
print(f"  attention scores (h, T, T) {C7.n_head * T * T * 2 / GB:8,.0f} GB -- never "
      "made by flash attention")
untiled = memory.block_activation_bytes(C7, T, 2, 4)   # the planner's formula
                                                       # (megatrain_min/plan/memory.py)
print(f"  the untiled layer's backward: ~{untiled / GB:.0f} GB of activations; a GH200 has 96 GB")

# %% [markdown]
# ## 2. Sequence tiling, from scratch
#
# Everything in a layer except attention is **token-local**: token t's output depends on token t's
# input only. So the MLP of T tokens is the MLP of each tile of tokens, side by side -- the same
# arithmetic per token, only fewer rows at a time. (This is ALST's TiledMLP.)

# %%
cfg = model.GPTConfig(vocab_size=256, n_layer=1, n_head=4, n_kv_head=2, d_model=64, d_ff=512,
                      max_seq_len=4096)
lay = model.units(cfg)[1]
torch.manual_seed(0)
w = {k: v.detach().requires_grad_() for k, v in lay.views(torch.randn(lay.numel) * 0.05).items()}
Tc = 1024
x = torch.randn(1, Tc, cfg.d_model)                                   # (1, T, d)


def mlp(h):
    """(B, t, d) -> (B, t, d): SwiGLU, with a (B, t, d_ff) intermediate: model.mlp written out (its
    activation is cfg.hidden_act, SiLU here; the check below holds the two equal)."""
    return F.linear(
        F.silu(F.linear(h, w["mlp.gate_proj.weight"])) * F.linear(h, w["mlp.up_proj.weight"]),
                    w["mlp.down_proj.weight"])


with torch.no_grad():
    whole = mlp(x)                                                   # a (1, 1024, 512) intermediate
    # (1, 256, 512) at a time
    tiled = torch.cat([mlp(x[:, s:s + 256]) for s in range(0, Tc, 256)], dim=1)
    same_as_model = torch.equal(whole, model.mlp(cfg, x, w))          # the same ops, the same bits
print(f"MLP whole vs in tiles of 256: max |diff| = {(whole - tiled).abs().max():.1e}; equal to "
      f"model.mlp: {same_as_model}")

# %% [markdown] `tiling.Tiled(tile_tokens)` does this for the whole layer: its `block` and
# `block_grad` are what the engine is handed for long sequences (`stream.Trainer(layer=Tiled(n))`;
# `megatrain_min/engine/tiling.py`). The layer is written in model.py as two token-local parts
# around the one global operation:
#
#     A  (per tile)  norm -> q, k, v projections -> RoPE              model.attn_in
#        (whole T)   causal SDPA on q, k, v of all T tokens           model.attention
#     C  (per tile)  x + o_proj(y) -> norm -> MLP -> + residual        model.attn_out_mlp
#
# and one loop, `tiling.over_tiles`, runs a part over the tiles. The backward (`Tiled.block_grad`)
# goes the same way in reverse, recomputing as it goes:
#
#     C  per tile: recompute from (x, y) with grad; dout -> dx (part), dy_att, dW_C added to fp32
#        grads
#     attention:   SDPA's backward on the whole sequence: dy_att -> dq, dk, dv
#     A  per tile: recompute q, k, v with grad; (dq, dk, dv) -> dx (added), dW_A added to fp32 grads
#
# Each tile's weight gradient is added into the engine's fp32 gradient buffer as soon as it exists,
# so the sum over tiles is an fp32 sum (as the sum over micro-batches already was), never a bf16
# one. The only difference from the untiled layer is that summation order.

# %%
rope = model.rope_cache(cfg, Tc)
dy = torch.randn_like(x)
res = {}
for tile in (0, 256, 300):                                             # 300 does not divide 1024
    acc = {k: torch.zeros(v.shape) for k, v in w.items()}             # fp32 gradient accumulators
    layer = tiling.Tiled(tile) if tile else model                    # 0: model's own, untiled layer
    with torch.no_grad():
        out = layer.block(cfg, x, w, rope)
    dx = layer.block_grad(cfg, x, w, rope, dy, acc)
    res[tile] = (out, dx, acc)
rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()      # noqa: E731
errs = {}
for tile in (256, 300):
    out, dx, acc = res[tile]
    errs[tile] = max(
        [rel(out, res[0][0]), rel(dx, res[0][1])] + [rel(acc[k], res[0][2][k]) for k in acc])
    print(f"tile {tile}: layer output, dx and every weight gradient within {errs[tile]:.1e} "
          "(relative) of untiled")

# %% [markdown]
# How big does anything get? A `TorchDispatchMode` sees every tensor every op makes, the backward's
# too:

# %%
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402


class Largest(TorchDispatchMode):
    """The largest tensor any op made while active (elements)."""
    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max(
            [self.numel] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


largest = {}
for tile in (0, 256):
    with Largest() as m:
        layer = tiling.Tiled(tile) if tile else model
        layer.block_grad(cfg, x, w, rope, dy, {k: torch.zeros(v.shape) for k, v in w.items()})
    largest[tile] = m.numel
    print(f"tile {tile:>3}: largest tensor of the layer's recompute + backward {m.numel:>9,} "
          f"elements (T x d_ff = {Tc * cfg.d_ff:,}, T x d = {Tc * cfg.d_model:,})")

# %% [markdown]
# ## 3. What each technique buys
#
# The planner (`megatrain_min/plan/memory.py`) counts what the engine holds on the GPU at long T:
# the residual x and its gradient dy (fp32 by default), the whole sequence's attention tensors (q,
# k, v, the output, their gradients, the flash backward's fp32 workspace: all O(T)), one tile's
# token-local activations, the loss chunk, the RoPE tables, and the boundary activations --
# offloaded to pinned host memory through a ring of two device slots when they do not fit.
# `max_context` searches the longest T that fits. Take 7b on a GH200 (96 GB HBM, its 480 GB of
# LPDDR5X) at batch 1 with train.py's defaults, and switch one technique off at a time:

# %%
def gh200(**change):
    """The plan of 7b at T tokens on a GH200 (batch 1, clipping on: train.py's defaults), with one
    change."""
    return planner.plan(dataclasses.replace(C7, max_seq_len=T), "gh200", batch_size=1, seq_len=T,
                        grad_clip=1.0,
                        name="7b", **change)


base = gh200()
longest = {"all of them": fit.max_context(base)[0],
           "no tiling (--tile-tokens 0)": fit.max_context(gh200(tile_tokens=0))[0],
           "no activation offload": fit.max_context(gh200(offload_activations=False))[0],
           "no chunked loss (one chunk of T)": fit.max_context(gh200(chunk_tokens=1 << 30))[0]}
# flash attention off: the math kernel keeps (h, T, T) scores; softmax output and its gradient,
# bf16, ~2 x 2 B
math_T = int((96 * GB / (C7.n_head * 2 * 2)) ** 0.5)
longest["no flash attention (math kernel, by hand)"] = math_T
longest["+ bf16 residual (--residual-dtype "
        "bf16)"] = fit.max_context(gh200(residual_dtype="bf16"))[0]
for k, v in longest.items():
    print(f"  {k:<48} {v:>9,} tokens")
print(report.format_plan(base))

# %% [markdown]
# Read it from the bottom of the plan up: at 512k the fp32 boundary activations of 32 layers are 275
# GB -- only the host can hold them, and they cost no time (a layer's compute at 512k takes seconds,
# their copy milliseconds). Without tiling the MLP's (T, d_ff) tensors alone exceed the GPU long
# before 512k. The chunked loss saves the (T, V) logits (67 GB in fp32 at 512k with Llama-2's 32k
# vocabulary, more with Llama 3's 128k). And without a flash kernel the (T, T) scores end the story
# at a few ten thousand tokens. What is left is O(T) with a large constant: x, dy, the activation
# ring and attention's tensors. A bf16 residual halves three of those, at the accuracy cost
# docs/design.md's numerics table measures.
#
# ## 4. How long, per model and GPU
#
# The host memory of each profile (H100: 1 TB, H200: 1.5 TB, GH200: its 480 GB), batch 1, train.py's
# defaults; `python train.py --config 7b --plan --hardware gh200 --batch-size 1 --max-context`
# prints one.

# %%
table = {}
for name in ("1b", "7b", "14b", "32b"):
    for hw in ("h100", "h200", "gh200"):
        p = planner.plan(model.PRESETS[name], hw, batch_size=1, seq_len=4096, grad_clip=1.0)
        table[name, hw] = fit.max_context(p)[0]
print(f"{'':>5}" + "".join(f"{hw:>10}" for hw in ("h100", "h200", "gh200")))
for name in ("1b", "7b", "14b", "32b"):
    print(f"{name:>5}" + "".join(f"{table[name, hw] / 1024:>9,.0f}k"
                                 if table[name, hw] else f"{'-':>10}"
                                 for hw in ("h100", "h200", "gh200")))
print("published: MegaTrain 7B at 512k on one GH200; ALST Llama-8B at 500k on one "
      "H100 (bf16 throughout)")

# %% [markdown]
# ## Check
#
# * the tiled layer equals the untiled one (forward, dx, every weight gradient) to <= 1e-6 in fp32,
#   for a tile that divides T and one that does not; the tiled MLP equals the whole one, and the
#   MLP written out here equals model.mlp bit for bit (so the two cannot drift apart);
# * with tiles, no tensor of T x d_ff elements is ever made;
# * 7b at 524,288 tokens fits a GH200 with 480 GB of host memory, and each technique switched off
#   shortens the longest context.

# %%
assert (whole - tiled).abs().max() < 1e-5
assert same_as_model, "mlp() above is no longer model.py's MLP (model.mlp, cfg.hidden_act)"
assert max(errs.values()) <= 1e-6, errs
assert largest[0] >= Tc * cfg.d_ff > largest[256]
assert base["fits"] and base["tile_tokens"] and base["offload_activations"]
assert longest["all of them"] >= T
assert all(v < longest["all of them"] for k, v in longest.items() if k.startswith("no "))
assert longest["+ bf16 residual (--residual-dtype bf16)"] > longest["all of them"]
print(f"OK  tiled == untiled (<= {max(errs.values()):.0e}); no (T, d_ff) tensor with tiles; 7b at "
      f"{T:,} tokens fits a GH200 with 480 GB (longest: {longest['all of them']:,}); each "
      "technique off shortens it")
