# %% [markdown]
# # Lesson 5 -- layer-major micro-batching: tokens per layer visit decide everything
#
# **What you will learn**
#
# * two ways to accumulate gradients over M micro-batches, and why the usual one (micro-batch-major)
#   would copy every layer M times per step, while the engine's (layer-major) copies it once;
# * that both give the same gradient -- checked on the engine;
# * the rule that decides whether PCIe is hidden: **tokens per layer visit T >= F * bytes / (2 *
#   BW)**, derived from a layer's FLOPs and bytes, and its two siblings for the gradient and the CPU
#   optimizer;
# * how `megatrain_min.plan` turns those rules into a step-time prediction, and what micro-batches
#   buy (GPU memory), and what they do not (time).
#
# Lesson 4 built the ping-pong: the copy of layer i+1 runs beside the compute of layer i. It is
# hidden only when that compute takes longer than the copy. Here we find how many tokens that takes.
#
# Run it: `python tutorials/05_layer_major_microbatching.py` (~3 s on a 2-core CPU).

# %%
import sys
from pathlib import Path

import torch

ROOT = (Path(__file__).resolve().parents[1] if "__file__" in globals()   # a script, or a notebook
        else Path.cwd().resolve().parent)                                 # run from tutorials/
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402
from megatrain_min.plan import hardware  # noqa: E402
from stream import Trainer  # noqa: E402

# %% [markdown]
# ## 1. Micro-batch-major vs layer-major
#
# A step of B sequences rarely fits on the GPU in one go, so it is split into M micro-batches whose
# gradients are summed. The usual loop is **micro-batch-major**:
#
# ```
# for each micro-batch j:    forward layers 0..L-1, backward L-1..0    -> 2L layer visits per j
# ```
#
# With weights on the GPU that costs nothing. With weights in host memory every visit is a copy:
# 2 L M copies per step. The engine turns the loops around -- **layer-major**:
#
# ```
# for each layer i (forward, then backward in reverse):  for each micro-batch j: ...   -> 2L visits
# ```
#
# One copy of layer i serves all M micro-batches. The price: the boundary activations (lesson 2) of
# all micro-batches must be kept at once, L x (B, T, d) -- on the GPU or offloaded to pinned host
# memory.
#
# Count the copies on the real engine: a small subclass overrides `Trainer.load_unit`, the one place
# weights are copied in, and notes each unit before doing the real copy.

# %%
class CountingTrainer(Trainer):
    def __init__(self, *args, **kw):
        self.loads = []                     # the unit index of every copy into a weight slot
        super().__init__(*args, **kw)

    def load_unit(self, u, slot):
        self.loads.append(u)
        return super().load_unit(u, slot)


cfg = model.PRESETS["toy"]
L = cfg.n_layer
w0 = model.init_weights(cfg, seed=0)
gen = torch.Generator().manual_seed(0)
tokens = torch.randint(0, cfg.vocab_size, (8, 32), generator=gen)     # (B, T): 8 sequences
targets = torch.randint(0, cfg.vocab_size, (8, 32), generator=gen)

copies, losses, trainers = {}, {}, {}
for M in (1, 4):
    t = CountingTrainer(cfg, w0, device="cpu", micro_batches=M, lr=1e-3)
    losses[M] = t.step(tokens, targets)
    copies[M], trainers[M] = len(t.loads), t
    print(f"M = {M}: {copies[M]} unit copies per step (layer-major); micro-batch-major would make "
          f"{copies[M] * M}")

# %% [markdown]
# (2L = 8 copies: L for the forward, the head once, L-1 for the backward -- the last layer is still
# in its slot when the backward starts.) And the two are the same training: one step of 4
# micro-batches equals one step of 1, up to the summation order of the gradients.

# %%
wa, wb = trainers[1].weights(), trainers[4].weights()
upd = sum(((wa[k] - wb[k]).double() ** 2).sum() for k in w0) ** 0.5 / \
    sum(((wa[k] - w0[k]).double() ** 2).sum() for k in w0) ** 0.5
loss_rel = abs(losses[1] - losses[4]) / losses[1]
print(f"loss M=1 {losses[1]:.7f}, M=4 {losses[4]:.7f} (rel diff {loss_rel:.1e}); "
      f"update rel diff {upd:.1e}")

# %% [markdown]
# ## 2. The arithmetic: when does a copy hide?
#
# One layer with P parameters, visited once per step by T tokens (all micro-batches: B x seq_len):
#
# | work | amount | time at F FLOP/s or BW bytes/s |
# |---|---|---|
# | copy weights in | P x b bytes (b = 2 for bf16) | P b / BW |
# | forward | 2 P T FLOPs | 2 P T / F |
# | recompute + backward | 2 P T + 4 P T | 6 P T / F |
# | gradient out | P x 4 bytes (fp32) | 4 P / BW |
# | CPU AdamW | ~38 bytes of DRAM traffic per param (see below) | 38 P / BW_dram |
#
# AdamW's 38 bytes: 28 to read p, g, m, v and write p, m, v; 4 more as train.py's guard reads the
# gradient once more; 6 for the bf16 shadow (p read again, 2 written: even from cache, measured on
# an H200's host, the copy costs what it costs from DRAM).
#
# The copy of layer i+1 runs during the forward of layer i (lesson 4), so it hides when
# 2 P T / F >= P b / BW. **P cancels**: the condition is about tokens, not model size --
#
#     T >= F * b / (2 * BW)
#
# Likewise the gradient hides behind the backward when 6 P T / F >= 4 P / BW, i.e. T >= 2 F / (3
# BW), and the CPU update of the whole model hides behind the whole step's compute (8 P T per layer)
# when T >= 38 F / (8 BW_dram). Only the number of tokens per layer visit appears -- and layer-major
# micro-batching is what makes that the tokens of the *whole step*, not of one micro-batch. With the
# example numbers of [docs/design.md](../docs/design.md) -- 500 TFLOP/s, bf16, 55 GB/s -- about 9k
# tokens:

# %%
def min_tokens(F, bw_h2d, bw_d2h, bw_dram, b=2, adam_bytes=38):
    return dict(h2d=F * b / (2 * bw_h2d), d2h=F * 4 / (6 * bw_d2h),
                cpu_adam=F * adam_bytes / (8 * bw_dram))


print("docs/design.md's example, 500 TFLOP/s, bf16, 55 GB/s:",
      f"T >= {min_tokens(500e12, 55e9, 55e9, 200e9)['h2d']:,.0f} tokens per step")
ours = {}
for name in ("h100", "gh200"):
    hw = hardware.HARDWARE[name]
    F = hw["bf16_tflops"] * 1e12 * hw["frac"]                     # the achievable FLOP/s it assumes
    ours[name] = min_tokens(F, hw["h2d_gbs"] * 1e9, hw["d2h_gbs"] * 1e9, hw["host_bw_gbs"] * 1e9)
    print(f"{name:>6}: F = {F / 1e12:.0f} TFLOP/s, H2D {hw['h2d_gbs']} GB/s, DRAM "
          f"{hw['host_bw_gbs']} GB/s -> "
          + ", ".join(f"{k} hides from {v:,.0f}" for k, v in ours[name].items()) + " tokens")

# %% [markdown]
# On an H100 over PCIe the weights need ~11k tokens per step and the CPU optimizer ~14k: a batch of
# 4 sequences of 4096. On a GH200 the C2C link is 6x faster, and the copies hide from ~2k tokens --
# but the CPU optimizer still wants ~6k: there the host's DRAM, not the link, sets the minimum
# batch.

# %% [markdown]
# ## 3. The planner
#
# `megatrain_min.plan.plan(cfg, hardware, batch_size, seq_len, micro_batches, ...)` does the same
# arithmetic per layer visit and then replays the engine's schedule (lesson 4's four lanes) for a
# few steps. It reports the step time, tokens/s, model TFLOP/s (6 N T: the recompute is not useful
# work), the busiest lane, and the thresholds above as `min_tokens`. Sweep the batch for Llama-2-7B
# on an H100:

# %%
C7 = model.PRESETS["7b"]
print(f"{'batch x 4096':>12} {'tokens/step':>11} {'s/step':>7} {'tokens/s':>9} {'MFU':>5}  "
      f"bottleneck   busy: h2d compute d2h adam")
sweep = []
for B in (1, 2, 4, 8, 16):
    # every unit streamed
    p = planner.plan(C7, "h100", batch_size=B, seq_len=4096, resident_units=0)
    u = p["utilization"]
    sweep.append(p)
    print(f"{B:>12} {p['tokens_per_step']:>11,} {p['step_time_s']:>7.2f} "
          f"{p['tokens_per_s']:>9,.0f} {p['mfu']:>5.0%}  {p['bottleneck']:<12} {u['h2d']:>9.0%} "
          f"{u['compute']:>7.0%} {u['d2h']:>3.0%} {u['cpu_adam']:>4.0%}")

# %% [markdown] Below ~12k tokens the step time hardly moves (the CPU optimizer and the copies set
# it), so throughput grows with the batch; past the threshold the GPU is the bottleneck and tokens/s
# flattens at the compute roofline. Why ~30% and not 60% (the assumed share of peak)? The engine
# computes 8 P T per layer (the recompute is a second forward), the model FLOPs count 6 P T: 0.6 x
# 6/8 = 45%; then attention, and the ops without FLOPs that HBM bandwidth bounds -- norms,
# autocast's casts, RoPE in fp32, residual adds, the fp32 gradient accumulation: the planner
# measures their bytes on model.py's own functions (megatrain_min/plan/cost.py), and for 7B at 16k
# tokens they add a third to the matmuls' time.
#
# ![tokens/s against tokens per step](figures/throughput.png)
#
# (`tutorials/make_figures.py`: the same planner on an H100 and a GH200; dashed lines where the
# weight copies hide, dotted where the CPU AdamW does.)
#
# ## 4. What micro-batches buy: memory, for a little time
#
# Layer-major, the weights cross once whatever M is. What shrinks is the GPU memory of the
# recompute: one layer's activations for one micro-batch. What M costs: each micro-batch's weight
# gradient is added into the fp32 grad slot (10 bytes per parameter of HBM traffic per micro-batch
# and layer). For Llama-3-70B at 8 x 4096 tokens:

# %%
C70 = model.PRESETS["70b"]
mb = {}
for M in (1, 2, 4, 8):
    p = planner.plan(C70, "h100", batch_size=8, seq_len=4096, micro_batches=M,
                     offload_activations=True,
                     resident_units=0)
    act = next(v for k, v in p["gpu"].items() if k.startswith("recompute activations"))
    mb[M] = p
    print(f"  M = {M}: recompute activations {act / 1e9:5.1f} GB, GPU total "
          f"{p['gpu_bytes'] / 1e9:5.1f} GB, step {p['step_time_s']:.2f} s")

# %% [markdown]
# ## Check
#
# * layer-major: the number of weight copies per step is 2L whatever M is, and M = 4 equals M = 1;
# * our thresholds are the planner's (`p["min_tokens"]`), to rounding;
# * the planner's throughput grows with the batch up to the threshold, and the bottleneck is the
#   compute beyond it; micro-batches cut the GPU memory for a few percent of step time.

# %%
assert copies[1] == copies[4] == 2 * L, copies
assert loss_rel <= 1e-6 and upd <= 1e-4, (loss_rel, upd)
for name, mins in ours.items():
    theirs = planner.plan(C7, name, batch_size=1, seq_len=4096, resident_units=0)["min_tokens"]
    for k in mins:
        assert abs(mins[k] - theirs[k]) <= 1e-9 * theirs[k], (name, k, mins[k], theirs[k])
assert all(a["tokens_per_s"] <= b["tokens_per_s"] * 1.001 for a, b in zip(sweep, sweep[1:]))
assert sweep[-1]["bottleneck"] == "compute"
assert sweep[-1]["tokens_per_step"] >= max(ours["h100"].values())
assert all(mb[a]["step_time_s"] <= mb[b]["step_time_s"] <= 1.05 * mb[1]["step_time_s"]
           for a, b in ((1, 2), (2, 4), (4, 8)))
assert mb[8]["gpu_bytes"] < mb[1]["gpu_bytes"]
print(f"OK  {copies[1]} copies per step for M=1 and M=4 (loss rel diff {loss_rel:.1e}, update rel "
      f"diff {upd:.1e}); H100 threshold {ours['h100']['h2d']:,.0f} tokens == planner's; tokens/s "
      f"{sweep[0]['tokens_per_s']:,.0f} -> {sweep[-1]['tokens_per_s']:,.0f}")
