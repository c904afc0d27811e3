# %% [markdown]
# # Lesson 9 -- scaling out: N GPUs over one sharded host store
#
# **What you will learn**
#
# * **ZeRO-3 over the host store**: each of N ranks owns 1/N of every unit's fp32 master, Adam m and
#   v (and shadow and gradient) in its own host RAM; a layer visit gathers the unit from the shards
#   and scatters its gradient back (`megatrain_min/engine/sharded.py`, a subclass of
#   `stream.Trainer`);
# * one layer visit on 2 ranks written with plain `torch.distributed` calls
#   (`all_gather_into_tensor`, `reduce_scatter_tensor`), then done by
#   `megatrain_min/engine/sharded.py`: the same bits;
# * why N ranks train **exactly** what one process trains on the same global batch, and where the
#   last rounding difference comes from;
# * **what crosses which wire**, counted byte by byte on a real 2-rank run and checked against the
#   arithmetic: PCIe (H2D, D2H) per GPU, the collectives (NVLink within a node, InfiniBand between
#   nodes);
# * what that means for a 70B model on 8 GPUs and on 2 nodes of 8 (the planner's predictions).
#
# Lessons 3-5 put the store in host memory and streamed it through one GPU. Here the same engine
# runs on N processes joined by torch.distributed (gloo on this CPU; NCCL on GPUs), launched by
# torchrun.
#
# Run it: `python tutorials/09_scaling_out.py` (~11-14 s on a 2-core CPU: it forks 2 ranks for one
# layer visit, then runs train.py on 2 ranks and in one process).

# %%
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = (Path(__file__).resolve().parents[1] if "__file__" in globals()   # a script, or a notebook
        else Path.cwd().resolve().parent)                                 # run from tutorials/
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
import optim  # noqa: E402
from megatrain_min import plan as planner  # noqa: E402
from megatrain_min.checkpoints import ckpt_read  # noqa: E402
from megatrain_min.engine import sharded  # noqa: E402

# %% [markdown]
# ## 1. Who owns what
#
# A unit's flat buffer (lesson 3: `[matrices | vectors]`, one per layer, plus the embedding and the
# head) of n elements is padded to a multiple of N and cut into N equal shards; rank r holds
# elements [r s, (r+1) s) with s = ceil(n / N). Every buffer of the store is cut the same way, so
# AdamW of a shard needs nothing from the other ranks -- except, with clipping, one number: the
# global squared norm, an
# `all_reduce` of each rank's sum.

# %%
CFG = model.PRESETS["toy"]
N = 2
for lay in model.units(CFG):
    s = sharded.shard_numel(lay.numel, N)
    spans = ", ".join(
        f"rank {r}: [{min(r * s, lay.numel):,}, {min(r * s + s, lay.numel):,})" for r in range(N))
    print(f"{lay.name:8} {lay.numel:8,} elements -> shards of {s:,}: {spans}")

# %% [markdown]
# ## 2. One layer visit on rank r
#
# ```
#   H2D      rank r's shard, compute dtype             PCIe (its own link)  n/N elements
#   gather   all_gather of the N shards -> weight slot NVLink / InfiniBand  (N-1)/N x n received
#   compute  rank r's B/N sequences, M micro-batches
#   scatter  reduce_scatter of the fp32 gradient slot  NVLink / InfiniBand  (N-1)/N x n sent, fp32
#   D2H      shard r of the summed gradient            PCIe                 n/N elements, fp32
#   AdamW    shard r, on the rank's optimizer thread
# ```
#
# The embedding is sharded too; its rows are gathered where that moves the fewest bytes: every rank
# knows the whole step's token ids, writes for each token the part of its row that its shard holds
# (zeros elsewhere), and one `reduce_scatter` sums the parts -- each element comes from exactly one
# rank, so the sum is exact -- leaving each rank the rows of its own sequences. In the backward, dy
# of layer 0 is all_gathered and every rank adds into its shard of the embedding gradient the parts
# it holds.
#
# **One visit by hand.** Two processes joined by gloo, as torchrun would join them (forked here:
# each starts with this file's imports and nothing computed yet -- a fork after torch's thread pool
# has run can hang it). Each holds shard r of layer 0's flat fp32 master and computes its half of a
# batch: the table above in plain `torch.distributed` calls. On this CPU "H2D" and "D2H" are copies
# between buffers; the collectives are the real ones. Then the same visit through
# `megatrain_min/engine/sharded.py`'s own data movement, on a `ShardedTrainer` of the same two
# ranks: `load_unit` (H2D of the shard, all_gather into a weight slot), the same `block_grad` into
# its grad slot, `grad_to_host` (reduce_scatter, D2H into the store), the store's AdamW.

# %%
def visit(rank, world, init, out):
    try:
        torch.set_num_threads(1)
        # torch 2.13 deprecates these two names for *_single versions that torch 2.11 does not have;
        # sharded.py calls the newer names where they exist (sharded.ALL_GATHER, REDUCE_SCATTER)
        warnings.filterwarnings("ignore", ".*is deprecated. Please use", FutureWarning)
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        lay = model.units(CFG)[1]                                     # layer 0 (unit 1)
        n, s = lay.numel, sharded.shard_numel(lay.numel, world)
        w = model.init_weights(CFG, 0)                                # the model, on every rank
        flat = torch.zeros(world * s)                                 # the unit, padded to N shards
        for key, view in lay.key_views(flat[:n]).items():
            view.copy_(w[key])
        master = flat[rank * s:(rank + 1) * s].clone()                # this rank's host store
        gen = torch.Generator().manual_seed(1)
        x, dy = (torch.randn(4, 16, CFG.d_model, generator=gen) for _ in range(2))  # (B, T, d)
        mine = slice(rank * 4 // world, (rank + 1) * 4 // world)     # this rank's sequences
        rope = model.rope_cache(CFG, 16)

        # ---- by hand
        shard = master.clone()                                        # H2D (this GPU's link)
        weights = torch.empty(world * s)
        dist.all_gather_into_tensor(weights, shard)                   # the N shards: the whole unit
        wv = {k: t.detach().requires_grad_() for k, t in lay.views(weights[:n]).items()}
        gslot = torch.zeros(world * s)                                # the fp32 gradient slot
        model.block_grad(CFG, x[mine], wv, rope, dy[mine], lay.views(gslot[:n]))
        gshard = torch.empty(s)
        dist.reduce_scatter_tensor(gshard, gslot)                     # summed over ranks: shard r
        g = gshard.clone()                                            # D2H
        (b1, b2), lr, eps = optim.BETAS, optim.LR, optim.EPS          # AdamW of shard r, step 1:
        decay = torch.arange(rank * s, (rank + 1) * s) < lay.n_decay  # [matrices | vectors]
        m, v = (1 - b1) * g, (1 - b2) * g * g
        p = master * (1 - lr * optim.WEIGHT_DECAY * decay) \
            - lr / (1 - b1) * m / ((v / (1 - b2)).sqrt() + eps)
        wire = {"gathered": weights.nbytes * (world - 1) // world,    # what each rank received
                "scattered": gslot.nbytes * (world - 1) // world}     # and sent

        # ---- megatrain_min/engine/sharded.py
        t = sharded.ShardedTrainer(CFG, w, device="cpu", grad_clip=1.0)   # a gradient per unit
        t.load_unit(1, 0)                                             # into weight slot 0
        t.gslot[0].zero_()
        model.block_grad(CFG, x[mine], t.wviews[0]["layer"], rope, dy[mine], t.gviews[0]["layer"])
        t.grad_to_host(1, 0, None)
        t.opt.step(1)
        out.put(dict(rank=rank, weights=torch.equal(t.wslot[0][:world * s], weights),
                     grad=torch.equal(t.opt.grad[1], g),
                     adamw=float((t.opt.master[1] - p).abs().max()),
                     wire=wire, traffic={k: t.traffic[k] for k in wire}))
        dist.destroy_process_group()
    except BaseException:                                             # the parent shows it
        out.put(dict(rank=rank, error=traceback.format_exc()))


ctx = multiprocessing.get_context("fork")
init_dir, out = tempfile.mkdtemp(), ctx.Queue()
ranks = [ctx.Process(target=visit, args=(r, N, f"{init_dir}/init", out)) for r in range(N)]
for r in ranks:
    r.start()
visits = sorted((out.get(timeout=300) for _ in ranks), key=lambda v: v["rank"])
for r in ranks:
    r.join()
shutil.rmtree(init_dir)
for v in visits:
    assert "error" not in v, v.get("error")
    print(f"rank {v['rank']}: by hand vs sharded.py -- gathered weights equal {v['weights']}, "
          f"gradient shard equal {v['grad']}, AdamW max |diff| {v['adamw']:.1e}; bytes on the "
          f"collectives' wire {v['wire']} (sharded.py counted {v['traffic']})")
    assert v["weights"] and v["grad"] and v["adamw"] <= 1e-6 and v["wire"] == v["traffic"], v

# %% [markdown]
# The gathered weights and the reduce-scattered gradient are the same bits: the same collectives on
# the same buffers. AdamW differs in the last bits only (torch's fused kernel against the formula).
#
# ## 3. Exact, and counted
#
# Two ranks against one process: train.py itself, 3 steps of the toy on the same global batches of 8
# x 16 tokens from the corpus, once under torchrun with 2 CPU processes (gloo) and once alone. The
# one process runs 2 micro-batches (each rank's micro-batch size): both compute the same matmuls,
# and the only difference is the order of fp32 sums. The gradient's agree at N = 2 (gloo's
# reduce_scatter adds a + b, one grad slot b + a); the global norm of the clipping (train.py's
# default) does not quite: one process sums every unit's squares in one order, 2 ranks each their
# shards' and then the two partial sums -- the last bits of the clip factor differ, and the loss a
# step later in the 7th digit. Each run writes its losses to metrics.jsonl and its weights to a
# checkpoint; `ckpt_read.read_weights` stitches the 2 ranks' parts back into one model.

# %%
B, T, STEPS = 8, 16, 3
tmp = Path(tempfile.mkdtemp())
flags = ["train.py", "--steps", str(STEPS), "--batch-size", str(B), "--seq-len", str(T),
         "--sample-tokens", "0",
         "--eval-batches", "1"]
launch = {
    N: [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={N}"],
          1: [sys.executable]}
runs = {}
for n, micro in ((N, 1), (1, N)):
    out = tmp / f"{n}-ranks"
    subprocess.run(launch[n] + flags + ["--micro-batches", str(micro), "--out", str(out)], cwd=ROOT,
                   check=True,
                   capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    runs[n] = metrics, ckpt_read.read_weights(ckpt_read.latest(out))[1]
(m_n, w_n), (m_1, w_1) = runs[N], runs[1]
for a, b in zip(m_n, m_1):
    print(f"step {a['step']}: loss {a['loss']:.7f} on {N} ranks, {b['loss']:.7f} in one process")
loss_rel = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(m_n, m_1))
weights_rel = (sum(float(((w_n[k] - w_1[k]).double() ** 2).sum()) for k in w_1) /
               sum(float((v.double() ** 2).sum()) for v in w_1.values())) ** 0.5
print(f"worst relative loss difference {loss_rel:.1e}; weights ||dw|| / ||w|| = {weights_rel:.1e}")
assert loss_rel <= 1e-6 and weights_rel <= 1e-5
shutil.rmtree(tmp)

# %% [markdown]
# Each rank counts the bytes it moved (`ShardedTrainer.traffic`); under torchrun train.py writes
# rank 0's of each step into metrics.jsonl. Here is the last step, next to the arithmetic. Per step
# the forward loads every layer and the head (L + 1 loads), the backward every layer but the last,
# which is still resident (L - 1): 2L loads of a shard. Each unit but the embedding drains one
# gradient; the embedding's comes from dy on the host. fp32 on the CPU: 4 bytes everywhere.
# ("reduced" is the scalars: the loss, the norm.)

# %%
units = model.units(CFG)
L, d = CFG.n_layer, CFG.d_model
shard = {lay.name: sharded.shard_numel(lay.numel, N) for lay in units}
loads = [f"layer.{i}" for i in range(L)] + ["head"] + [f"layer.{i}" for i in range(L - 1)]
drains = ["head"] + [f"layer.{i}" for i in range(L)]
rows = B * T * d * 4                                     # the whole step's (B*T, d) rows / dy, fp32


def part(full):                                          # what a ring collective moves per rank
    return full * (N - 1) // N


want = {"h2d": sum(shard[u] * 4 for u in loads) + rows,      # shards, and the rows' parts
        "gathered": sum(part(N * shard[u] * 4) for u in loads) + part(rows),      # weights, and dy
        # gradients, and the rows
        "scattered": sum(part(N * shard[u] * 4) for u in drains) + part(rows),
        "d2h": sum(shard[u] * 4 for u in drains) + rows}     # gradient shards, and dy
got = m_n[-1]["traffic"]
print(f"{'wire':10}{'counted':>12}{'arithmetic':>12}")
for k in want:
    print(f"{k:10}{got[k]:12,}{want[k]:12,}")
print(f"{'reduced':10}{got['reduced']:12,}")
assert {k: got[k] for k in want} == want

# %% [markdown]
# ## 4. What crosses which wire at 70B
#
# Per step and per GPU, in bf16 with a bf16 shadow (the fast mode): one GPU copies each weight twice
# (forward, backward) and each fp32 gradient once over its PCIe link -- 2 x 2 + 4 = 8 bytes per
# parameter. N GPUs copy 1/N of that each, and the collectives move (N-1)/N of the weights twice (2
# x 2 bytes) and of the gradient once (4 bytes) over NVLink or InfiniBand. The planner puts those
# collectives on a comm lane of the schedule (`python -m megatrain_min.plan --gpus 8 --nodes 2
# ...`). Predictions, not measurements.

# %%
P70 = model.n_params(model.PRESETS["70b"])
print(f"70b: {P70 / 1e9:.1f}B params, per GPU per step:")
print(f"{'setup':24}{'PCIe GB':>10}{'NVLink/IB GB':>14}{'s/step':>9}{'tokens/s':>10}"
      f"{'comm busy':>11}")
for gpus, nodes in ((1, 1), (8, 1), (8, 2)):
    n = gpus * nodes
    p = planner.plan(model.PRESETS["70b"], "h100", batch_size=4 * n, seq_len=4096, grad_clip=0.0,
                     host_mem_gb=2000,
                     gpus=gpus, nodes=nodes, tile_tokens=0, offload_activations=True)
    pcie, net = 8 * P70 / n, (n - 1) / n * 8 * P70
    print(f"{f'{nodes} x {gpus} H100':24}{pcie / 1e9:10.1f}{net / 1e9:14.1f}{p['step_time_s']:9.1f}"
          f"{p['tokens_per_s']:10,.0f}{p['utilization'].get('comm', 0):11.0%}")

# %% [markdown]
# The PCIe traffic per GPU falls N-fold and the host RAM per node K-fold, while each GPU keeps its 4
# x 4096 tokens: the compute per layer visit stays the same and hides the collectives (the comm lane
# is busy 7% of the step on NVLink, ~60% on InfiniBand -- still hidden). What is not hidden at
# larger N: a fixed batch per GPU means the global batch grows with N; below ~12k tokens per GPU
# (the planner's `min_tokens`), the collectives over InfiniBand show.

# %%
print(f"OK: one layer visit by hand == sharded.py's on {N} ranks; {N} ranks train what one "
      f"process trains (loss {loss_rel:.0e}, weights {weights_rel:.0e}); every byte of rank 0's "
      f"step accounted for on its wire")
