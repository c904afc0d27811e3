# %% [markdown]
# # Lesson 6 -- scaling the plan to 100B and 120B: fast versus lean
#
# **What you will learn**
#
# * how many bytes of host memory each parameter costs, component by component, and how big a model
#   1.5 TB can hold in each memory mode;
# * why the GPU side does not grow with depth, and the one term that does grow (boundary
#   activations);
# * one 120B plan made by hand -- its host bytes, component by component, and the tokens per step
#   that hide each transfer -- then the same plan from `megatrain_min.plan`, equal to the byte;
# * `fast` (stream a bf16 shadow: +2 B/param, half the PCIe bytes) versus `lean` (stream the fp32
#   master and cast on the GPU: 12 B/param) -- and what each costs in time;
# * what `megatrain_min.plan` says for the 100b and 120b presets on an H200 and a GH200 with 1.5 TB:
#   the MegaTrain paper's setting (120B on one H200 with 1.5 TB of host memory).
#
# Lesson 3 built the host store, lesson 5 the time per step. Nothing here allocates a big model: the
# planner works from `model.units(cfg)`, i.e. from shapes.
#
# Run it: `python tutorials/06_scaling_to_120b.py` (~4 s on a 2-core CPU).

# %%
import math
import sys
from pathlib import Path

import torch

ROOT = (Path(__file__).resolve().parents[1] if "__file__" in globals()   # a script, or a notebook
        else Path.cwd().resolve().parent)                                 # run from tutorials/
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
from megatrain_min.plan import cost  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402
from megatrain_min.plan import fit, hardware, memory, report  # noqa: E402
from stream import Trainer  # noqa: E402

# %% [markdown]
# ## 1. Bytes per parameter, from scratch
#
# | component | fast | lean | why |
# |---|---|---|---|
# | fp32 master | 4 | 4 | the weights (true full precision) |
# | Adam m, v (fp32) | 8 | 8 | the optimizer |
# | bf16 shadow | 2 | -- | fast streams it; lean streams the master (4 B) and casts on the GPU |
# | fp32 gradient store | 4 if clipping | 4 if clipping | the global norm, before any update |
#
# (Global-norm clipping needs every gradient before any update: lesson 2's order.)
#
# Without clipping each unit is updated as soon as its gradient lands, so a couple of unit-sized
# gradient slabs suffice instead of a full gradient store.

# %%
def bytes_per_param(mode, clip):
    return 4 + 8 + (2 if mode == "fast" else 0) + (4 if clip else 0)


HOST = 1536e9 * memory.HOST_USABLE           # 1.5 TB, minus what the OS keeps (the planner's share)
N100, N120 = model.n_params(model.PRESETS["100b"]), model.n_params(model.PRESETS["120b"])
print(f"100b = {N100 / 1e9:.1f}B params, 120b = {N120 / 1e9:.1f}B params; usable host RAM "
      f"{HOST / 1e12:.2f} TB")
print(f"{'mode':<6}{'clip':<6}{'B/param':>8}{'100b':>9}{'120b':>9}{'largest model in 1.5 TB':>26}")
for mode in ("fast", "lean"):
    for clip in (False, True):
        b = bytes_per_param(mode, clip)
        print(f"{mode:<6}{str(clip):<6}{b:>8}{N100 * b / 1e12:>8.2f}T{N120 * b / 1e12:>8.2f}T"
              f"{HOST / b / 1e9:>24.0f}B")

# %% [markdown]
# Only one row holds 120B: **lean, without clipping** -- 12 B/param, 1.44 TB. (Skipping clipping at
# this scale is a real trade-off; the planner will also show what clipping costs.) 100B fits fast
# without clipping, and lean either way.
#
# ## 2. The GPU side
#
# The GPU holds two weight slots and two fp32 gradient slots sized for the largest streamed unit,
# one layer's recompute activations and the loss chunk: nothing there depends on the number of
# layers. The exception is the boundary activations of lesson 2 -- L x (tokens, d) -- which the
# engine offloads to pinned host memory when they would not fit (and then they cost host RAM
# instead).

# %%
C120 = model.PRESETS["120b"]
biggest = max(u.numel for u in model.units(C120)[1:])          # a layer or the head
tokens = 8 * 4096
ckpt = C120.n_layer * tokens * C120.d_model * 2                  # bf16 (B, T, d) per layer
print(f"120b: largest unit {biggest / 1e9:.2f}B params -> weight slots 2 x {biggest * 2 / 1e9:.1f} "
      f"GB (bf16), grad slots 2 x {biggest * 4 / 1e9:.1f} GB (fp32)")
print(f"      boundary activations at {tokens:,} tokens: {C120.n_layer} x {tokens:,} x "
      f"{C120.d_model} x 2 B = {ckpt / 1e9:.0f} GB (grows with depth and tokens)")

# %% [markdown]
# ## 3. One 120b plan by hand: its bytes and its tokens
#
# The setting the rest of this lesson plans: 120b in lean mode on an H200 with the paper's 1.5 TB,
# 4 x 4096 tokens per step, no clipping, train.py's guard on (it skips a step whose gradient is not
# finite), the engine's fp32 residual. Its host memory, component by component:
#
# * the store: fp32 master, m and v, 12 B/param (section 1);
# * gradient slabs: without clipping each gradient lands in a slab the size of the largest unit and
#   is updated from there; the slab comes back when the update is done. The GPU never waits for one
#   while S - 1 backward visits outlast a gradient's trip (its D2H, then AdamW): S = ceil(trip /
#   backward) + 1, and at least 3 (`stream.GRAD_SLABS`) -- the fewest; section 4 says why the
#   planner may add some;
# * pinned buffers of the step: the embedding rows (gathered from the fp32 master in lean mode),
#   dy of layer 0 on its way back (fp32), the targets (int64);
# * the runtime: Python, torch and the CUDA libraries, ~4 GB.
#
# And the tokens per step that hide each transfer -- lesson 5's rule and its siblings, F the
# achievable FLOP/s: a layer's forward (2 N T FLOPs) outlasts its copy (4 N bytes in lean, plus the
# cast on the GPU: 4 bytes read and 2 written in HBM); its recompute + backward (6 N T) outlasts its
# fp32 gradient's D2H (4 N); the step's compute (8 N T per layer) outlasts AdamW's host traffic (28
# B/param, + 4 for the guard's read of the gradient). The hardware's numbers are the planner's h200
# profile (datasheet peaks, an assumed 60% of peak, measured-class link bandwidths).

# %%
H200 = hardware.HARDWARE["h200"]
T = 4 * 4096
F = H200["bf16_tflops"] * 1e12 * H200["frac"]                    # achievable FLOP/s
h2d, d2h, hbm, dram = (H200[k] * 1e9 for k in ("h2d_gbs", "d2h_gbs", "hbm_gbs", "host_bw_gbs"))
units120 = model.units(C120)
lay = units120[1]                                           # a layer: N = lay.numel
adam_b = 28 + 4                                             # AdamW's bytes + the guard's read
attn = 2 * 4096 * C120.n_head * C120.head_dim               # QK^T + AV per token (causal half)
backward = T * (6 * lay.n_decay + 3.5 * attn) / F           # recompute + backward: matmuls, and the
# HBM-bound ops (norms, casts, ...)
ew = cost.elementwise_bytes(C120, torch.bfloat16, torch.float32)["bwd"]
# per token and per call; zero the grad slot
backward += (T * ew[0] + ew[1]) / hbm + lay.numel * 4 / hbm
trip = lay.numel * (4 / d2h + adam_b / dram)                     # the gradient's D2H, then AdamW
slabs = max(3, math.ceil(trip / backward) + 1)
by_hand = {"fp32 master + Adam m, v": 12 * N120,
           f"fp32 grad slabs: {slabs}": slabs * max(u.numel for u in units120) * 4,
           "pinned buffers: rows, dy, targets": T * C120.d_model * (4 + 4) + T * 8,
           "runtime": 4 * 10**9}
tokens_by_hand = {"h2d": F * (4 / h2d + 6 / hbm) / 2, "d2h": F * 4 / (6 * d2h),
                  "cpu_adam": F * adam_b / (8 * dram)}
print(f"a layer's backward {backward * 1e3:.0f} ms, its gradient's trip "
      f"{trip * 1e3:.0f} ms -> {slabs} slabs")
for k, v in by_hand.items():
    print(f"  {k:<36}{v / 1e9:>10.1f} GB")
print(f"  {'host, by hand':<36}{sum(by_hand.values()) / 1e12:>10.3f} TB")
print("tokens per step that hide: " + ", ".join(f"{k} {v:,.0f}" for k, v in tokens_by_hand.items()))

# %% [markdown]
# ## 4. The planner's verdict
#
# Now the planner, with the paper's host (1.5 TB) on both GPUs, 4 x 4096 tokens per step (lesson 5:
# enough to hide PCIe on an H200), clipping off, and the engine's default fp32 residual (x, the
# boundary activations and dy in fp32: what torch.autocast computes):

# %%
rows = {}
print(f"{'model':<6}{'GPU':<7}{'mode':<6}{'host':>9}{'B/param':>9}{'GPU mem':>9}{'s/step':>8}"
      f"{'tokens/s':>9}  {'bottleneck':<10} verdict")
for name in ("100b", "120b"):
    for hw in ("h200", "gh200"):
        for mode in ("fast", "lean"):
            p = planner.plan(model.PRESETS[name], hw, batch_size=4, seq_len=4096, mode=mode,
                             grad_clip=0, host_mem_gb=1536, resident_units=0)  # every unit streamed
            rows[name, hw, mode] = p
            why = "" if p["fits"] else " (host)" if not p["fits_host"] else " (GPU)"
            print(f"{name:<6}{hw:<7}{mode:<6}{p['host_bytes'] / 1e12:>8.2f}T"
                  f"{p['host_bytes'] / p['params']:>9.1f}{p['gpu_bytes'] / 1e9:>8.0f}G"
                  f"{p['step_time_s']:>8.1f}{p['tokens_per_s']:>9,.0f} "
                  f" {p['bottleneck']:<10} {'FITS' if p['fits'] else 'no' + why}"
                  + ("  ckpts offloaded" if p["offload_activations"] else ""))

# %% [markdown]
# The 120b lean row on the h200 is section 3's plan. The planner's bytes and tokens, beside the hand
# arithmetic (the planner keeps the boundary activations on this GPU, so none are on the host):

# %%
p120 = rows["120b", "h200", "lean"]
# The planner starts from section 3's fewest slabs and adds slabs while each saves 1% of the step:
# where the host's AdamW is slower than the backward, the optimizer thread falls behind, and since
# it updates the landed unit the next forward needs first (optim.Worker), its backlog -- the units
# the next forward needs last -- holds a slab each. A backward that waits for a slab waits for work
# that could have come later. So the slabs are the planner's count, each the largest unit's size:
kept = p120["grad_slabs"]
print(f"gradient slabs: {slabs} hide one trip, the planner keeps {kept} for the backlog")
by_hand = {(f"fp32 grad slabs: {kept}" if k.startswith("fp32 grad slabs") else k):
           (kept * max(u.numel for u in units120) * 4 if k.startswith("fp32 grad slabs") else v)
           for k, v in by_hand.items()}
planned = {key: sum(v for k, v in p120["host"].items() if k.startswith(prefix)) for key, prefix in
           zip(by_hand, ("fp32 master", "fp32 grad slabs", "pinned buffers", "runtime"))}
planned["fp32 master + Adam m, v"] += sum(v for k, v in p120["host"].items()
                                          if k.startswith("Adam"))
print(f"  {'':36}{'by hand':>18}{'planner':>18}")
for k in by_hand:
    print(f"  {k:<36}{by_hand[k]:>18,}{planned[k]:>18,}")
for k, v in tokens_by_hand.items():
    print(f"  {'tokens to hide ' + k:<36}{v:>18,.0f}{p120['min_tokens'][k]:>18,.0f}")

# %% [markdown]
# Read the table:
#
# * **120b needs lean**: fast is 1.7 TB. Lean on the H200 fits at 1.46 TB with fp32 master weights
#   and fp32 Adam states, compute-bound: at 16k tokens the 4-byte copies of lean are nearly hidden.
# * **Boundary activations decide the rest.** 76 layers x 4 x 4096 tokens x 12288 x 4 bytes = 61 GB
#   of fp32 boundary activations. The H200 keeps them; the GH200's 96 GB cannot keep them beside its
#   working set, so they are offloaded -- to the host, which then overflows. Twice the tokens (8 x
#   4096) would push them out of the H200 too. The planner names the way out, and a bf16 residual
#         (half the bytes, some accuracy:
#   docs/design.md, Numerics contract) is one:

# %%
p_gh = rows["120b", "gh200", "lean"]
try:
    fit.check(p_gh)
except planner.PlanError as e:
    print("fit.check:", e)
p_gh16 = planner.plan(C120, "gh200", batch_size=4, seq_len=4096, mode="lean", grad_clip=0,
                      host_mem_gb=1536,
                      resident_units=0,
                      residual_dtype="bf16")
print(f"120b lean on gh200, bf16 residual: {'FITS' if p_gh16['fits'] else 'no'}, host "
      f"{p_gh16['host_bytes'] / 1e12:.2f} TB, GPU {p_gh16['gpu_bytes'] / 1e9:.0f} GB, "
      f"{p_gh16['tokens_per_s']:,.0f} tokens/s ({p_gh16['bottleneck']}-bound: the C2C link needs "
      f"only ~{p_gh16['min_tokens']['h2d']:,.0f} tokens to hide)")
p_480 = planner.plan(C120, "gh200", batch_size=4, seq_len=4096, mode="lean", grad_clip=0,
                     residual_dtype="bf16",
                     resident_units=0)
print(f"... but a stock GH200 has {hardware.HARDWARE['gh200']['host_mem_gb']} GB of LPDDR5X: "
      f"{'FITS' if p_480['fits'] else 'does not fit'}")

# %% [markdown]
# ## 5. The whole breakdown
#
# ![120b host memory by component](figures/memory.png)
#
# `format_plan` prints what `python -m megatrain_min.plan --config 120b --hardware h200 --mode lean
# --host-mem 1536 --grad-clip 0 --batch-size 4 --seq-len 4096` (or `python train.py --config 120b
# --plan ...` with the same flags) shows:

# %%
print(report.format_plan(p120))

# %% [markdown]
# And the price of clipping at this scale: +4 B/param of gradient store, and the updates wait for
# the global norm, so they no longer overlap the backward:

# %%
clip = planner.plan(C120, "h200", batch_size=4, seq_len=4096, mode="lean", grad_clip=1.0,
                    host_mem_gb=1536,
                    resident_units=0)
print(f"120b lean + clipping: {clip['host_bytes'] / 1e12:.2f} TB "
      f"({'FITS' if clip['fits'] else 'does not fit'} in 1.5 TB), {clip['step_time_s']:.1f} s/step "
      f"vs {p120['step_time_s']:.1f} without")

# %% [markdown]
# ## 6. The plan matches the engine's real store
#
# A plan is only useful if it counts what the engine allocates. On a toy model, build the real
# `stream.Trainer` for each mode, with and without clipping (bf16 compute on the CPU gives fast mode
# its shadow), and ask its store what it holds (`HostStore.nbytes()`). Without clipping the engine
# keeps no per-unit gradient; it allocates unit-sized gradient slabs instead -- as many as the plan
# says hide a gradient's trip to the optimizer (train.py passes p["grad_slabs"]), which the plan
# lists apart.

# %%
toy = model.PRESETS["toy"]
w0 = model.init_weights(toy, 0)
N = model.n_params(toy)
store = {}
for mode in ("fast", "lean"):
    for clip_on in (True, False):
        p = planner.plan(toy, "h200", batch_size=8, mode=mode, dtype="bf16",
                         grad_clip=1.0 if clip_on else 0.0, resident_units=0)
        t = Trainer(toy, w0, device="cpu", dtype=torch.bfloat16, mode=mode,
                    grad_clip=1.0 if clip_on else 0.0,
                    grad_slabs=p["grad_slabs"])
        slabs_engine = t.opt.pool.qsize()    # the slabs waiting to be lent (none is, between steps)
        slabs_plan = sum(int(k.split(":")[1].split()[0]) for k in p["host"]
                         if k.startswith("fp32 grad slabs"))
        store[mode, clip_on] = (t.opt.nbytes(), p["host_bytes_per_param"] * N)
        print(f"toy {mode:<4} clip {str(clip_on):<5}: engine store "
              f"{store[mode, clip_on][0] / N:.0f} B/param, plan {store[mode, clip_on][1] / N:.0f} "
              f"B/param; grad slabs: engine {slabs_engine}, plan {slabs_plan}")

# %% [markdown]
# ## Check
#
# * the planner's bytes per parameter equal section 1's arithmetic for every mode;
# * with the paper's 1.5 TB, 120b fits on an H200 in lean mode (>= 12 B/param: fp32 master + Adam)
#   and not in fast mode; 100b fits in both; on the GH200 a bf16 residual makes 120b fit;
# * the plan's per-parameter store is exactly the bytes the engine's store allocates, in all four
#   cases.
# * the 120b plan of section 3, made by hand, is the planner's to the byte, its tokens to 1e-9.

# %%
for (name, hw, mode), p in rows.items():
    assert p["host_bytes_per_param"] == bytes_per_param(mode, False), (name, hw, mode)
assert planned == by_hand and sum(by_hand.values()) == p120["host_bytes"], (planned, by_hand)
assert not p120["offload_activations"] and p120["grad_slabs"] >= slabs
for k, v in tokens_by_hand.items():
    assert abs(v - p120["min_tokens"][k]) <= 1e-9 * v, (k, v, p120["min_tokens"][k])
assert clip["host_bytes_per_param"] == bytes_per_param("lean", True)
assert rows["120b", "h200", "lean"]["fits"] and not rows["120b", "h200", "fast"]["fits"]
assert rows["120b", "h200", "lean"]["host_bytes"] >= 12 * N120
assert rows["100b", "h200", "fast"]["fits"] and rows["100b", "h200", "lean"]["fits"]
assert not p_gh["fits"] and p_gh16["fits"]
for (mode, clip_on), (engine, plan_bytes) in store.items():
    assert engine == plan_bytes, (mode, clip_on, engine, plan_bytes)
    assert slabs_engine == slabs_plan
print("OK  bytes/param as derived; 120b lean on h200 + 1.5 TB fits "
      f"({p120['host_bytes'] / 1e12:.2f} TB, {p120['tokens_per_s']:,.0f} tokens/s predicted), fast "
      "does not; the plan by hand == the planner's; plan == engine store in all 4 modes")
