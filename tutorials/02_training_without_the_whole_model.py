# %% [markdown]
# # Lesson 2 -- training without the whole model
#
# **What you will learn**
#
# * what normal training keeps in memory (every intermediate of every layer, for the backward pass);
# * how to train keeping only the **boundary activations** -- the input of each layer -- and
#   **recomputing** one layer at a time during the backward pass;
# * how `torch.autograd.grad` on one layer turns "gradient w.r.t. my output" into "gradient w.r.t.
#   my input and my weights", so the chain rule runs layer by layer with no graph across layers;
# * the proof that this is not an approximation: the gradients equal autograd on the whole model.
#
# Lesson 1 made each layer a pure function of (input, flat buffer). Here only one layer's graph
# exists at any moment, which is what lets lesson 3 keep the weights somewhere else entirely.
#
# Run it: `python tutorials/02_training_without_the_whole_model.py` (~3 s on a 2-core CPU).

# %%
import sys
from pathlib import Path

import torch

ROOT = (Path(__file__).resolve().parents[1] if "__file__" in globals()   # a script, or a notebook
        else Path.cwd().resolve().parent)                                 # run from tutorials/
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
from megatrain_min.engine.reference import ReferenceTrainer  # noqa: E402
from optim import clip_coef  # noqa: E402
from stream import Trainer  # noqa: E402

torch.manual_seed(0)
cfg = model.PRESETS["toy"]
weights = model.init_weights(cfg, seed=0)                  # {HF key: fp32 tensor}
units = model.units(cfg)                                   # [embed, layer.0..3, head], lesson 1
B, T = 4, 64
tokens = torch.randint(0, cfg.vocab_size, (B, T))          # (B, T)
targets = torch.randint(0, cfg.vocab_size, (B, T))         # (B, T)
targets[:, :8] = model.IGNORE                              # e.g. prompt tokens: no loss
n_tok = int((targets != model.IGNORE).sum())               # the loss is sum / n_tok

# one flat fp32 buffer per unit, filled from the weights dict (lesson 1)
flats = []
for u in units:
    buf = torch.empty(u.numel)
    for key, view in u.key_views(buf).items():
        view.copy_(weights[key])
    flats.append(buf)

# %% [markdown]
# ## 1. The oracle: normal training
#
# Every weight is a leaf tensor, one autograd graph spans the whole model, `.backward()` fills
# `.grad`. We also *measure* what autograd keeps for the backward pass, with `saved_tensors_hooks`:
# every tensor a backward formula needs passes through `pack`. Weights themselves are not counted
# (they exist anyway); everything else is activation memory.

# %%
def saved_bytes(fn, exclude):
    """Run fn() and return (its result, bytes of distinct non-weight storages autograd saved)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        p = t.untyped_storage().data_ptr()
        if p not in skip:
            seen[p] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


leaves = {k: v.clone().requires_grad_() for k, v in weights.items()}
loss_ref, graph_bytes = saved_bytes(lambda: model.loss(cfg, leaves, tokens, targets),
                                    leaves.values())
loss_ref.backward()
ref_grad = {k: v.grad for k, v in leaves.items()}
print(f"whole-model loss {loss_ref.item():.6f}; autograd saved "
      f"{graph_bytes / 1e6:.2f} MB of activations")

# %% [markdown]
# ## 2. Forward with no graph: keep only each layer's input
#
# Under `torch.no_grad()` nothing is saved. We keep one tensor per layer -- its input, (B, T, d) --
# the
# *boundary activation* (what activation checkpointing keeps). That is all the backward pass will
# need.

# %%
rope = model.rope_cache(cfg, T)
L = cfg.n_layer
with torch.no_grad():
    x = units[0].views(flats[0])["embed"][tokens]          # (B, T, d) embedding rows
    acts = []
    for i in range(L):
        acts.append(x)                                     # boundary activation of layer i
        x = model.block(cfg, x, units[1 + i].views(flats[1 + i]), rope)
acts_bytes = sum(c.numel() * c.element_size() for c in acts)
print(f"{L} boundary activations: {acts_bytes / 1e6:.2f} MB")

# %% [markdown]
# ## 3. The head: loss and the gradient that starts the chain
#
# The head (final norm + LM head + cross-entropy) is a function too. One small graph for it gives
# the loss, the head's weight gradient, and `dy = dloss/dx_L`, the gradient w.r.t. the last layer's
# output.
#
# A trick used from here on: make the *flat buffer* the leaf and take the views inside the graph.
# `autograd.grad` w.r.t. the flat buffer then returns the whole unit's gradient as one flat tensor,
# in the same layout as the weights (the engine accumulates into views of a flat gradient slot
# instead; same numbers).

# %%
grads = [torch.zeros(u.numel) for u in units]             # one flat fp32 gradient per unit
xL = x.detach().requires_grad_()                           # (B, T, d) output of the last layer
head_flat = flats[-1].detach().requires_grad_()
with torch.enable_grad():
    loss_sum = model.head_loss(cfg, xL.reshape(-1, cfg.d_model), units[-1].views(head_flat),
                               targets.reshape(-1))
    loss = loss_sum / n_tok
    dy, grads[-1] = torch.autograd.grad(loss, [xL, head_flat])   # dy: (B, T, d)
print(f"layer-by-layer loss {loss.item():.6f}")

# %% [markdown]
# ## 4. Backward, one layer at a time
#
# For layer i = L-1 ... 0: rebuild its graph from its boundary activation (the *recompute*: one
# extra forward of one layer), then ask autograd for the gradient of `y . dy` w.r.t. (input,
# weights). The input gradient is the `dy` of the layer below. The graph is dropped at the end of
# each iteration, so at most **one layer's** activations exist at a time -- we measure that too.

# %%
peak_layer_bytes = 0
for i in reversed(range(L)):
    xin = acts[i].detach().requires_grad_()                # (B, T, d) boundary activation
    w_flat = flats[1 + i].detach().requires_grad_()        # this layer's flat buffer as the leaf
    with torch.enable_grad():
        y, nbytes = saved_bytes(lambda: model.block(cfg, xin, units[1 + i].views(w_flat), rope),
                                [w_flat, xin])
        dy, grads[1 + i] = torch.autograd.grad(y, [xin, w_flat], dy)   # vector-Jacobian product
    peak_layer_bytes = max(peak_layer_bytes, nbytes)
    acts[i] = None                                         # this boundary activation is done

# the embedding: dy of layer 0 is the gradient of each gathered row; scatter-add it into the table
V, d = cfg.vocab_size, cfg.d_model
grads[0].view(V, d).index_add_(0, tokens.reshape(-1), dy.reshape(-1, d))
print(f"one layer's recompute graph saved {peak_layer_bytes / 1e6:.2f} MB (+ "
      f"{acts_bytes / 1e6:.2f} MB of boundary activations) vs {graph_bytes / 1e6:.2f} "
      "MB for the whole graph")

# %% [markdown]
# ## 5. Proof: the same gradients as normal training
#
# Compare every weight's gradient with the whole-model autograd of section 1. The operations are the
# same, in the same order, so we expect (nearly) bit-identical numbers; the embedding's scatter-add
# may sum repeated tokens in a different order than `F.embedding`'s backward.

# %%
worst = 0.0
for u, g in zip(units, grads):
    for key, view in u.key_views(g).items():
        scale = ref_grad[key].abs().max().clamp(min=1e-30)
        err = ((view - ref_grad[key]).abs().max() / scale).item()
        worst = max(worst, err)
print(f"layer-by-layer vs whole-model autograd: max rel gradient diff {worst:.1e}, "
      f"loss diff {abs(loss.item() - loss_ref.item()):.1e}")

# %% [markdown]
# ## 6. The project's engine does exactly this
#
# `stream.Trainer` runs sections 2-4 (plus the optimizer, lessons 3-5) over flat buffers in its host
# store. On the CPU its "streams" are no-ops, so the schedule runs in program order. With gradient
# clipping on, the engine needs every gradient before any update (the global norm), so it keeps them
# all in a per-unit fp32 store `t.opt.grad[u]`. The clip factor is applied inside torch's fused
# AdamW kernel, which writes the clipped gradient back into that store: after one step it holds our
# gradients times `clip_coef(norm, max_norm)`, and `t.grad_norm` is the global norm before clipping.
# And step for step the engine matches `megatrain_min.engine.reference.ReferenceTrainer` -- whole
# model, one graph, `torch.optim.AdamW` -- which is the project's central test
# (`tests/core/test_stream.py`).

# %%
t = Trainer(cfg, weights, device="cpu", lr=1e-3, weight_decay=0.1, grad_clip=1.0)
loss_engine = t.step(tokens, targets)
t.weights()                                                # waits for the optimizer worker
ref_norm = sum(float(g.double().pow(2).sum()) for g in ref_grad.values()) ** 0.5
coef = clip_coef(ref_norm, 1.0)
engine_worst = 0.0
for u, g in zip(t.units, t.opt.grad):
    for key, view in u.key_views(g).items():
        want = ref_grad[key] * coef
        err = ((view - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
        engine_worst = max(engine_worst, err)
norm_rel = abs(t.grad_norm - ref_norm) / ref_norm
print(f"stream.Trainer: grad norm {t.grad_norm:.6f} vs autograd {ref_norm:.6f} (rel diff "
      f"{norm_rel:.1e}); clipped gradient store vs autograd x {coef:.4f}: max rel diff "
      f"{engine_worst:.1e}")

ours = Trainer(cfg, weights, device="cpu", lr=1e-3)
ref = ReferenceTrainer(cfg, weights, device="cpu", lr=1e-3)
gen = torch.Generator().manual_seed(1)
loss_worst = 0.0
for step in range(3):
    tok = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    tgt = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    a, b = ours.step(tok, tgt), ref.step(tok, tgt)
    loss_worst = max(loss_worst, abs(a - b) / b)
    print(f"  step {step}: stream {a:.6f}  reference {b:.6f}")
w_ours, w_ref = ours.weights(), ref.weights()
w_worst = max((w_ours[k] - w_ref[k]).abs().max().item() for k in w_ref)

# %% [markdown]
# ## Check

# %%
assert abs(loss.item() - loss_ref.item()) <= 1e-6 * loss_ref.item()
assert worst <= 1e-5, worst
assert engine_worst <= 1e-5 and norm_rel <= 1e-5, (engine_worst, norm_rel)
assert abs(loss_engine - loss_ref.item()) <= 1e-6 * loss_ref.item()
assert loss_worst <= 1e-5 and w_worst <= 1e-5, (loss_worst, w_worst)
assert peak_layer_bytes + acts_bytes < graph_bytes
print(f"OK  gradients max rel diff {worst:.1e} (engine {engine_worst:.1e}); 3 steps vs reference: "
      f"loss rel diff {loss_worst:.1e}, weights max diff {w_worst:.1e}; activation memory "
      f"{(peak_layer_bytes + acts_bytes) / graph_bytes:.0%} of the whole graph")
