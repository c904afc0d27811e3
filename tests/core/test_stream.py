"""The project's central test: stream.Trainer (weights in host memory, one layer at a time, recompute,
layer-major micro-batches) equals plain PyTorch training (megatrain_min.engine.reference: one autograd graph,
torch.optim.AdamW) step for step, on the CPU in fp32.
Tolerances (docs/design.md, section 'Numerics contract'): about 10x the difference measured on the dev machine,
per dtype, the measurement beside each bound below; weight updates are compared by the norm of their difference
(Adam magnifies rounding in near-zero gradients). A failure names the step, the tensor and the worst relative
difference (conftest.check_loss, check_updates); `python -m pytest -s` prints every measured difference."""
import dataclasses
import gc
import math
import mmap
import os
import shutil
import subprocess
import sys

import pytest
import torch

import cuda_doubles
import model
import optim
import stream
from conftest import (ROOT, SPECIAL, check_loss, check_updates, engine, homed, losses_agree, random_batch,
                      reference_lion, update_rel)
from megatrain_min import plan
from megatrain_min.engine.gpu_update import GpuUpdated
from megatrain_min.engine.lion import Lion
from megatrain_min.engine.resident import Resident
from megatrain_min.engine.reference import ReferenceTrainer

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# Bounds: about 10x the worst difference measured on the 2-core dev machine (torch 2.13, CPU), the measurement
# beside each; re-measure with `python -m pytest -s -v tests/core/test_stream.py | grep measured`. (The older 1e-5 and
# 1e-3 let a clipping epsilon of 1e-3 instead of 1e-6 pass: it moves the clipped cases' updates to 3.5e-5..8.5e-5
# and their losses to 3.8e-6.)
# fp32 engine vs reference, per-step loss: measured 2.2e-7 (test_stream_equals_reference[toy-1-clip-ckpt-offload],
# the worst of 80 steps); resident, GPU-updated, CUDA-double and tiled cases 6.5e-8..9e-8
LOSS_FP32 = 2e-6
# fp32 engine vs reference, weight updates: measured 2.9e-6 (the same case); resident, GPU-updated and CUDA-double
# cases 5.7e-7..7.7e-7
UPDATE_FP32 = 3e-5
# the same at T = 2048 in tiles of 700 (test_tiled_engine_equals_reference_at_2048_tokens): measured 1.3e-5, its
# longer sums rounding more
UPDATE_FP32_LONG = 1.3e-4
LOSS_BF16 = 3e-4       # bf16 engine vs the autocast reference, per-step loss: measured 2.6e-5
# bf16 engine vs the autocast reference, weight updates: measured 6.7e-3 (32 layers of bf16 rounding; the design's
# bound 1e-2 is kept, tighter than 10x: a bound is never loosened)
UPDATE_BF16 = 1e-2


@pytest.mark.parametrize("offload", [False, True], ids=["ckpt-gpu", "ckpt-offload"])
@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["noclip", "clip"])
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("cfg", [model.PRESETS["toy"], SPECIAL], ids=["toy", "gqa-bias-qknorm-tied"])
def test_stream_equals_reference(cfg, M, clip, offload):
    gen = torch.Generator().manual_seed(7)
    w0 = model.init_weights(cfg, seed=0)
    ours = engine(cfg, w0, device="cpu", grad_clip=clip, micro_batches=M, offload_activations=offload, **HP)
    ref = ReferenceTrainer(cfg, w0, device="cpu", grad_clip=clip, micro_batches=M, **HP)
    for step in range(5):
        tok, tgt = random_batch(cfg, 4, 24, gen)
        ours.set_lr(HP["lr"] * (1 - 0.1 * step))
        ref.set_lr(HP["lr"] * (1 - 0.1 * step))
        check_loss(step, ours.step(tok, tgt), ref.step(tok, tgt), LOSS_FP32)
    check_updates("after step 4", w0, ours.weights(), ref.weights(), UPDATE_FP32)
    assert set(ours.weights()) == set(w0)


@pytest.mark.parametrize("resident", [1, 3, 99], ids=["embedding", "embedding+2-layers", "all"])
@pytest.mark.parametrize("clip,offload", [(0.0, False), (0.5, True)], ids=["noclip", "clip-offload"])
@pytest.mark.parametrize("cfg", [model.PRESETS["toy"], SPECIAL], ids=["toy", "gqa-bias-qknorm-tied"])
def test_resident_units_equal_reference(cfg, resident, clip, offload):
    """Units kept whole on the device (the first the forward needs: the embedding -- tied: the head --, layer 0,
    1, ...; every unit: resident training), updated there on the H2D lane, train as plain PyTorch does: the
    central test's tolerances. On the CPU the device is host memory; tests/engine/test_gpu.py runs it on a GPU."""
    gen = torch.Generator().manual_seed(7)
    w0 = model.init_weights(cfg, seed=0)
    ours = engine(cfg, w0, device="cpu", grad_clip=clip, micro_batches=2, offload_activations=offload,
                  resident_units=resident, **HP)
    ref = ReferenceTrainer(cfg, w0, device="cpu", grad_clip=clip, micro_batches=2, **HP)
    want = ours.order[:resident]
    assert homed(ours, Resident) == sorted(want) and want[0] == ours.embed
    assert all(ours.opt.shadow[u] is None for u in want)
    for step in range(4):
        tok, tgt = random_batch(cfg, 4, 24, gen)
        check_loss(step, ours.step(tok, tgt), ref.step(tok, tgt), LOSS_FP32)
    check_updates(f"after step 3, {len(want)} resident", w0, ours.weights(), ref.weights(), UPDATE_FP32)
    assert all(ours.opt.steps[u].item() == 4 for u in range(len(ours.units)))


@pytest.mark.parametrize("n,resident", [(2, 0), (99, 1)], ids=["2-of-the-streamed", "every-streamed"])
@pytest.mark.parametrize("clip,offload", [(0.0, False), (0.5, True)], ids=["noclip", "clip-offload"])
@pytest.mark.parametrize("cfg,dtype,mode", [   # the fast tier: toy fp32 and bf16 lean; all: the slow one
    pytest.param(model.PRESETS["toy"], torch.float32, "fast", id="toy"),
    pytest.param(SPECIAL, torch.float32, "fast", id="gqa-bias-qknorm-tied", marks=pytest.mark.slow),
    pytest.param(model.PRESETS["toy"], torch.bfloat16, "fast", id="toy-bf16-fast", marks=pytest.mark.slow),
    pytest.param(model.PRESETS["toy"], torch.bfloat16, "lean", id="toy-bf16-lean")])
def test_gpu_updated_units_equal_reference(cfg, dtype, mode, n, resident, clip, offload):
    """Streamed units updated on the device (gpu_update.GpuUpdates: the gradient stays there, master, m and v
    cross for the update and back, with the bf16 shadow in fast mode) give, step for step, the very bits of the
    engine that updates them on the host -- losses, master, m, v, shadow -- and so, in fp32, plain PyTorch's
    training to the central test's tolerances. Never the embedding; spread evenly over the forward's order; the
    gradient's 4 B/param on the device instead of the host. On the CPU the device is host memory
    (tests/engine/test_gpu.py: a GPU)."""
    gen = torch.Generator().manual_seed(7)
    w0 = model.init_weights(cfg, seed=0)
    kw = dict(device="cpu", dtype=dtype, grad_clip=clip, micro_batches=2, **HP)
    ours = engine(cfg, w0, offload_activations=offload, resident_units=resident, gpu_updated_units=n,
                  mode=mode, **kw)
    host = engine(cfg, w0, offload_activations=offload, resident_units=resident, mode=mode, **kw)
    ref = ReferenceTrainer(cfg, w0, **kw)
    # the main thread (where a GPU-side update is issued) and the optimizer thread take a unit's squared norm with
    # as many OpenMP threads, so that a reduction's order, and its bits, are the same on both (on a GPU: cuBLAS)
    torch.set_num_threads(ours.lanes.threads[1])
    streamed = [u for u in ours.order[resident:] if u != ours.embed]
    want = streamed if n >= len(streamed) else [streamed[0], streamed[len(streamed) // 2]]
    assert homed(ours, GpuUpdated) == sorted(want) and ours.embed not in want
    moved = sum(4 * ours.units[u].numel for u in want)            # their fp32 gradients
    assert ours.opt.nbytes(gpu=True) == host.opt.nbytes(gpu=True) + moved
    assert ours.opt.nbytes() == host.opt.nbytes() - (moved if clip else 0)   # (no clip: slabs, not counted)
    for step in range(4):
        tok, tgt = random_batch(cfg, 4, 24, gen)
        a, h, b = ours.step(tok, tgt), host.step(tok, tgt), ref.step(tok, tgt)
        assert a == h, f"step {step}: loss {a} vs the host-updated engine's {h}"
        if dtype == torch.float32:
            check_loss(step, a, b, LOSS_FP32)
    ours.wait(), host.wait()
    for u in range(len(ours.units)):
        mine, theirs = ours.opt.tensors(u), host.opt.tensors(u)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), ours.units[u].name
        assert ours.opt.steps[u].item() == host.opt.steps[u].item() == 4
        if ours.opt.shadow[u] is not None:   # what the next forward streams
            assert torch.equal(ours.opt.shadow[u], host.opt.shadow[u])
    if dtype == torch.float32:
        check_updates(f"after step 3, {len(want)} updated on the device", w0, ours.weights(), ref.weights(),
                      UPDATE_FP32)


LION = dict(lr=1e-3, weight_decay=1.0)   # the Lion paper's advice against HP's AdamW: lr 10x lower, decay 10x higher


@pytest.mark.parametrize("cfg,dtype,clip,M,homes", [
    pytest.param(model.PRESETS["toy"], torch.float32, 0.0, 2, {}, id="toy-fp32-noclip-streamed"),
    pytest.param(SPECIAL, torch.float32, 1.0, 2, dict(resident_units=2), id="tied-fp32-clip-2-resident"),
    pytest.param(model.PRESETS["toy"], torch.float32, 1.0, 1, dict(gpu_updated_units=2), id="toy-fp32-clip-2-gpu-updated"),
    pytest.param(model.PRESETS["toy"], torch.bfloat16, 0.0, 2, dict(resident_units=1, gpu_updated_units=2),
                 id="toy-bf16-noclip-resident-and-gpu-updated"),
    pytest.param(SPECIAL, torch.bfloat16, 1.0, 1, {}, id="tied-bf16-clip-streamed", marks=pytest.mark.slow),
    pytest.param(SPECIAL, torch.float32, 0.0, 1, dict(gpu_updated_units=99), id="tied-fp32-every-gpu-updated",
                 marks=pytest.mark.slow)])
def test_lion_through_the_engine_equals_the_papers_lion(cfg, dtype, clip, M, homes):
    """The update rule is handed in: megatrain_min.engine.lion.Lion (one moment: the store holds master, m and -- clipping
    -- the gradient) through the streaming engine equals plain PyTorch training with Lion written from the paper
    (conftest.ReferenceLion, the whole model in memory): fp32 and bf16 (against the autocast reference), clipping
    on and off, micro-batches, resident and GPU-updated units, tied and untied embeddings. Lion's update is the
    sign of a sum: in fp32 the two runs' weights are the same (measured: none differs after 4 steps); in bf16 a
    gradient's rounding flips the sign where the sum is near 0, so the first step's updates are compared element by
    element (measured: at most 0.07% differ; bound 1%) and every step's loss (measured <= 8.8e-5; bound 1e-3)."""
    gen = torch.Generator().manual_seed(7)
    w0 = model.init_weights(cfg, seed=0)
    kw = dict(device="cpu", dtype=dtype, grad_clip=clip, micro_batches=M, **LION)
    ours = engine(cfg, w0, rule=Lion(), **homes, **kw)
    ref = ReferenceTrainer(cfg, w0, optimizer=reference_lion(), **kw)
    assert list(ours.opt.tensors(0)) == ["master", "m"]
    worst = 0.0
    for step in range(4):
        tok, tgt = random_batch(cfg, 4, 24, gen)
        a, b = ours.step(tok, tgt), ref.step(tok, tgt)
        worst = max(worst, abs(a - b) / abs(b))
        if step == 0:
            mine, theirs = ours.weights(), ref.weights()
            flipped = sum(int((mine[k] != theirs[k]).sum()) for k in mine) / model.n_params(cfg)
    mine, theirs = ours.weights(), ref.weights()
    differ = sum(int((mine[k] != theirs[k]).sum()) for k in mine) / model.n_params(cfg)
    print(f"Lion engine vs the paper's Lion ({dtype}): max loss rel diff {worst:.1e}, weights differing after the "
          f"first step {flipped:.2%}, after 4 steps {differ:.2%}")
    if dtype == torch.float32:   # measured: loss <= 8.4e-8, no weight differs
        assert worst <= 1e-6 and differ <= 1e-4, f"loss rel diff {worst:.1e}, {differ:.2%} of the weights differ"
    else:                        # measured: loss <= 8.8e-5, <= 0.07% differ after the first step
        assert worst <= 1e-3 and flipped <= 0.01, f"loss rel diff {worst:.1e}, {flipped:.2%} of the updates differ"


def test_the_resident_embeddings_scatter_allocates_per_token_not_per_row():
    """The resident embedding's gradient: dy (B*T, d) added into the rows of the (V, d) gradient the tokens used,
    with no (V, d) buffer made on the way (F.embedding's own backward makes a dense (V, d) gradient per step: 4.2 GB
    at 70b, from the memory the plan filled with resident units); in token order, as the host's index_add_."""
    from torch.utils._python_dispatch import TorchDispatchMode
    cfg = dataclasses.replace(model.PRESETS["toy"], vocab_size=4096, d_model=64, d_ff=128, n_head=2, n_kv_head=2)
    t = engine(cfg, model.init_weights(cfg, 0), device="cpu", resident_units=1, **HP)
    host = engine(cfg, model.init_weights(cfg, 0), device="cpu", **HP)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))   # repeats: same rows
    dy = torch.randn(32, cfg.d_model, generator=torch.Generator().manual_seed(1))

    class Largest(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):   # the largest new storage
            out = func(*args, **(kwargs or {}))
            given = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                     if isinstance(a, torch.Tensor)}
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in given:
                    Largest.made = max(Largest.made, o.untyped_storage().nbytes())
            return out
    host.opt.lend(host.embed)          # (no clipping: the host engine's gradient is a slab lent for the step)
    host.opt.grad[host.embed].zero_()
    with Largest():
        t.home[t.embed].add_dy(tokens, dy)
    host.home[host.embed].add_dy(tokens, dy)
    assert Largest.made <= 2 * dy.nbytes, f"{Largest.made:,} bytes made; dy is {dy.nbytes:,}"
    assert torch.equal(t.opt.grad[t.embed], host.opt.grad[host.embed])          # the host's bits


def test_resident_units_store_and_guard(gen):
    """A resident unit's state (master, m, v, gradient: 16 B/param) is the device's, none of it pinned and no
    shadow; the rest of the store is as before. With the non-finite guard (no clipping: checked per unit), a
    poisoned resident embedding row skips the step and leaves every weight as it was."""
    cfg = model.PRESETS["toy"]
    w0 = model.init_weights(cfg, 0)
    t = engine(cfg, w0, device="cpu", dtype=torch.bfloat16, resident_units=2, skip_nonfinite=True, **HP)
    host = engine(cfg, w0, device="cpu", dtype=torch.bfloat16, **HP)
    n_res = sum(t.units[u].numel for u in homed(t, Resident))
    assert t.opt.nbytes() == host.opt.nbytes() - 14 * n_res and t.opt.nbytes(gpu=True) == 16 * n_res
    tok, tgt = random_batch(cfg, 2, 16, gen)
    t.step(tok, tgt)
    before = t.weights()
    emb = t.units[0].views(t.opt.master[0])["embed"]
    saved = emb[tok[0, 0]].clone()
    emb[tok[0, 0], 0] = float("inf")
    loss = t.step(tok, tgt)
    assert t.guard.skipped and not math.isfinite(loss)
    emb[tok[0, 0]] = saved
    assert all(torch.equal(before[k], v) for k, v in t.weights().items())
    t.step(tok, tgt)
    assert not t.guard.skipped and not t.guard.units


def test_micro_batches_equal_one_batch():
    """Invariance: the same step in 1 or 4 micro-batches gives the same loss and (nearly) the same update."""
    cfg = SPECIAL
    gen = torch.Generator().manual_seed(3)
    w0 = model.init_weights(cfg, 0)
    one, four = (engine(cfg, w0, device="cpu", micro_batches=m, **HP) for m in (1, 4))
    losses_agree(four, one, cfg, gen, steps=3, B=8, T=16, rtol=1e-6)                      # measured 1.0e-7
    # measured 1.8e-5 (the older bound 1e-4 kept, tighter than 10x)
    check_updates("after step 2, 4 micro-batches vs 1", w0, four.weights(), one.weights(), 1e-4)


def test_two_identical_runs_match_bit_for_bit():
    cfg = model.PRESETS["toy"]
    w0 = model.init_weights(cfg, 0)
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(5)
        t = engine(cfg, w0, device="cpu", micro_batches=2, grad_clip=1.0, **HP)
        losses = [t.step(*random_batch(cfg, 4, 16, gen)) for _ in range(3)]
        runs.append((losses, t.weights()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in w0)


def test_evaluate_equals_reference_loss(gen):
    cfg = SPECIAL
    w0 = model.init_weights(cfg, 0)
    t = engine(cfg, w0, device="cpu", micro_batches=2, chunk_tokens=5, **HP)
    tok, tgt = random_batch(cfg, 4, 16, gen)
    ref = model.loss(cfg, w0, tok, tgt).item()
    check_loss(0, t.evaluate(tok, tgt), ref, 1e-6, "evaluation loss")                  # measured 1.0e-7
    assert all(torch.equal(v, w0[k]) for k, v in t.weights().items())  # evaluation changes nothing


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["loss-check", "norm-check"])
def test_nonfinite_step_is_skipped_and_weights_untouched(gen, clip):
    cfg = model.PRESETS["toy"]
    w0 = model.init_weights(cfg, 0)
    t = engine(cfg, w0, device="cpu", skip_nonfinite=True, grad_clip=clip, **HP)
    tok, tgt = random_batch(cfg, 2, 16, gen)
    t.step(tok, tgt)
    before = t.weights()
    m_before = [t.opt.tensors(u)["m"].clone() for u in range(len(t.units))]
    emb = t.units[0].views(t.opt.master[0])["embed"]
    saved = emb[tok[0, 0]].clone()
    emb[tok[0, 0], 0] = float("inf")   # poison one embedding row that the batch uses
    loss = t.step(tok, tgt)
    assert t.guard.skipped and not math.isfinite(loss)
    emb[tok[0, 0]] = saved
    after = t.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(m, t.opt.tensors(u)["m"]) for u, m in enumerate(m_before))
    assert all(t.opt.steps[u].item() == 1 for u in range(len(t.units)))  # step counts untouched too
    t.step(tok, tgt)
    assert not t.guard.skipped


def test_lean_mode_and_bad_arguments():
    cfg = model.PRESETS["toy"]
    w0 = model.init_weights(cfg, 0)
    gen = torch.Generator().manual_seed(0)
    batch = random_batch(cfg, 2, 16, gen)
    fast = engine(cfg, w0, device="cpu", mode="fast", **HP)
    lean = engine(cfg, w0, device="cpu", mode="lean", **HP)
    assert fast.step(*batch) == lean.step(*batch)
    with pytest.raises(ValueError, match="mode must be"):
        engine(cfg, w0, device="cpu", mode="quick")
    with pytest.raises(ValueError, match="not divisible by micro_batches"):
        engine(cfg, w0, device="cpu", micro_batches=3).step(*batch)
    tied = dataclasses.replace(cfg, tie_embeddings=True)    # its head holds a slab until the scatter:
    with pytest.raises(ValueError, match="grad_slabs must be >= 2"):   # one would wait forever
        engine(tied, model.init_weights(tied, 0), device="cpu", grad_clip=0.0, grad_slabs=1)
    with pytest.raises(plan.PlanError, match="grad_slabs must be >= 2"):
        plan.plan(tied, "local", batch_size=2, seq_len=16, grad_clip=0.0, grad_slabs=1, resident_units=0)
    one = engine(tied, model.init_weights(tied, 0), device="cpu", grad_clip=0.0, grad_slabs=2)
    assert math.isfinite(one.step(*batch)) and one.wait() is None          # two are enough


def test_host_store_layout_bf16_shadow():
    """In fast mode with a bf16 compute dtype the store keeps an exact bf16 copy of each master unit."""
    cfg = model.PRESETS["toy"]
    t = engine(cfg, model.init_weights(cfg, 0), device="cpu", dtype=torch.bfloat16)
    for u in range(len(t.units)):
        assert torch.equal(t.opt.shadow[u], t.opt.master[u].to(torch.bfloat16))
    assert t.wslot[0].dtype == torch.bfloat16 and t.gslot[0].dtype == torch.float32


class CountingTrainer(stream.Trainer):
    """A Trainer that notes the name of every unit copied into a weight slot (load_unit: the one place weights cross)."""

    def __init__(self, *args, **kw):
        self.loads = []
        super().__init__(*args, **kw)

    def load_unit(self, u, slot):
        self.loads.append(self.units[u].name)
        return super().load_unit(u, slot)


@pytest.mark.parametrize("M", [1, 4])
def test_weights_cross_once_per_visit_whatever_the_micro_batches(M):
    """Layer-major: per step each layer is copied in once for forward and once for backward, the last
    layer only once, the head once: 2L copies in all, independent of the number of micro-batches."""
    cfg = model.PRESETS["toy"]
    t = CountingTrainer(cfg, model.init_weights(cfg, 0), device="cpu", micro_batches=M, **HP)
    t.step(*random_batch(cfg, 4, 16, torch.Generator().manual_seed(0)))
    L = cfg.n_layer
    assert len(t.loads) == 2 * L
    assert t.loads == [f"layer.{i}" for i in range(L)] + ["head"] + [f"layer.{i}" for i in reversed(range(L - 1))]


def test_gradient_store_only_when_updates_wait_for_the_global_norm(gen):
    """No clipping: gradients pass through stream.GRAD_SLABS pinned slabs (no 4 B/param store), also with the
    non-finite guard on; clipping: an fp32 gradient per unit, since every gradient precedes any update."""
    cfg = SPECIAL  # tied: the head holds a slab until the embedding scatter
    w0 = model.init_weights(cfg, 0)
    t = engine(cfg, w0, device="cpu", micro_batches=2, skip_nonfinite=True, **HP)
    for _ in range(3):
        t.step(*random_batch(cfg, 4, 16, gen))
    t.weights()
    assert all(g is None for g in t.opt.grad) and t.opt.pool.qsize() == stream.GRAD_SLABS
    clipped = engine(cfg, w0, device="cpu", grad_clip=1.0, **HP)
    assert all(g is not None and g.numel() == lay.numel for g, lay in zip(clipped.opt.grad, clipped.units))


# ----------------------------------------------------------------------------- bf16 = what torch.autocast means
NARROW = model.GPTConfig(vocab_size=256, n_layer=32, n_head=4, n_kv_head=2, d_model=64, d_ff=176, max_seq_len=64)


def two_steps_against(ours, ref, w0, cfg, B, T, loss_tol):
    """Two steps of both trainers on the same random (B, T) batches; each step's loss within loss_tol (relative).
    Returns (the worst loss rel diff, the update rel diff after the two steps)."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for step in range(2):
        tok, tgt = random_batch(cfg, B, T, gen)
        worst = max(worst, check_loss(step, ours.step(tok, tgt), ref.step(tok, tgt), loss_tol))
    return worst, update_rel(w0, ours.weights(), ref.weights())


@pytest.mark.parametrize("clip,resident", [(0.0, 0), (1.0, 0), (0.0, 3), (1.0, 99)],
                         ids=["noclip", "clip", "noclip-3-resident", "clip-all-resident"])
@pytest.mark.parametrize("M", [1, 2])
def test_bf16_engine_equals_autocast_reference(M, clip, resident):
    """bf16 compute: the engine (blocks and head under autocast, fp32 residual, weights from the bf16
    shadow) equals the reference trainer under torch.autocast(bf16) on a 32-layer narrow model: loss <= LOSS_BF16
    relative at every step, weight updates <= UPDATE_BF16 relative after 2 steps (docs/design.md, section
    'Numerics contract')."""
    w0 = model.init_weights(NARROW, 0)
    ours = engine(NARROW, w0, device="cpu", dtype=torch.bfloat16, grad_clip=clip, micro_batches=M,
                  resident_units=resident, **HP)
    ref = ReferenceTrainer(NARROW, w0, device="cpu", dtype=torch.bfloat16, grad_clip=clip, micro_batches=M, **HP)
    two_steps_against(ours, ref, w0, NARROW, 4, 32, loss_tol=LOSS_BF16)
    check_updates("after step 1 (bf16)", w0, ours.weights(), ref.weights(), UPDATE_BF16)


def test_bf16_residual_option_is_explicit_and_drifts_further():
    """residual_dtype=bf16 is a memory saver, not the default: it keeps x, checkpoints and dy in bf16 and so
    drifts further from the autocast reference than the default fp32 residual does (docs/design.md, section
    'Numerics contract')."""
    w0 = model.init_weights(NARROW, 0)
    runs = {}
    for name, t in (("fp32-residual", engine(NARROW, w0, device="cpu", dtype=torch.bfloat16, **HP)),
                    ("bf16-residual", engine(NARROW, w0, device="cpu", dtype=torch.bfloat16,
                                              residual_dtype=torch.bfloat16, **HP)),
                    ("autocast-ref", ReferenceTrainer(NARROW, w0, device="cpu", dtype=torch.bfloat16, **HP))):
        gen = torch.Generator().manual_seed(0)
        [t.step(*random_batch(NARROW, 4, 32, gen)) for _ in range(2)]
        runs[name] = t.weights()
    near = update_rel(w0, runs["fp32-residual"], runs["autocast-ref"])
    far = update_rel(w0, runs["bf16-residual"], runs["autocast-ref"])
    print(f"update rel diff vs autocast reference: fp32 residual {near:.1e}, bf16 residual {far:.1e}")
    assert near <= 1e-2 and far > 3 * near
    with pytest.raises(ValueError, match="residual_dtype"):
        engine(NARROW, w0, device="cpu", dtype=torch.float32, residual_dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- failures, threads, buffers
@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["noclip", "clip"])
def test_optimizer_thread_failure_is_raised_not_hung(clip, monkeypatch):
    """A failing optimizer update must surface in the main thread (from Trainer.step, within seconds), never
    leave it waiting forever for a gradient slab that the failed update would have given back."""
    import signal
    cfg = model.PRESETS["toy"]
    t = engine(cfg, model.init_weights(cfg, 0), device="cpu", grad_clip=clip, **HP)

    def broken(*a, **k):
        raise RuntimeError("injected optimizer failure")

    monkeypatch.setattr(t.opt, "step", broken)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("Trainer.step hung after an optimizer failure"))
    signal.alarm(30)
    try:
        with pytest.raises(RuntimeError, match="injected optimizer failure"):
            gen = torch.Generator().manual_seed(0)
            for _ in range(3):   # no clipping: raised in step 1; clipping: the updates follow step 1, so step 2
                t.step(*random_batch(cfg, 2, 16, gen))
    finally:
        signal.alarm(0)


def test_pinned_buffers_are_made_once_and_grow_only_to_the_largest_shape():
    """The per-step host buffers (targets, embedding rows, dy, offloaded boundary activations, the loss) are
    allocated once and reused, a smaller shape as a view of the same pages: no page-locking (cudaHostRegister,
    slow) and no device sync per step or per evaluation at another shape. A name's buffer grows to the largest
    shape asked for and no further; the activations' device ring and the RoPE tables keep only the last shape.
    The activations' host rows and ring exist before the step's first op."""
    cfg = model.PRESETS["toy"]
    t = engine(cfg, model.init_weights(cfg, 0), device="cpu", offload_activations=True, micro_batches=2, **HP)
    gen = torch.Generator().manual_seed(0)
    t.step(*random_batch(cfg, 4, 16, gen))
    first = {k: v.data_ptr() for k, v in t.host_buffers.items()}
    assert set(first) == {"targets", "rows", "dy", "activations", "loss"}
    t.step(*random_batch(cfg, 4, 16, gen))
    t.evaluate(*random_batch(cfg, 2, 8, gen))
    assert {k: v.data_ptr() for k, v in t.host_buffers.items()} == first       # smaller: the same pages
    largest = {"activations": cfg.n_layer * 4 * 16 * cfg.d_model, "targets": 4 * 16}
    for B, T in ((2, 8), (4, 32), (2, 24), (4, 16)):
        t.step(*random_batch(cfg, B, T, gen))
        t.evaluate(*random_batch(cfg, B, T + 1, gen))
        largest = {"activations": max(largest["activations"], cfg.n_layer * B * T * cfg.d_model),
                   "targets": max(largest["targets"], B * (T + 1))}
        ring = t.activations.ring
        assert set(t.host_buffers) == set(first) and len(t.rope) == 1 and ring[0].shape == (B, T, cfg.d_model)
        assert t.activations.host.shape == (cfg.n_layer, B, T, cfg.d_model) and t.batch.tokens.shape == (B, T + 1)
        assert {k: t.host_buffers[k].numel() for k in largest} == largest and list(t.rope) == [T + 1]
    t.wait()


def test_cpu_threads_split_the_usable_cpus(monkeypatch):
    """The main thread's and the optimizer thread's OpenMP teams, from this process's share of the CPUs in its
    affinity mask (not os.cpu_count()): with CUDA the main thread keeps 2 and the update rule gets the rest; on the
    CPU the main thread, which computes the step, keeps every CPU and the optimizer thread runs a quarter beside it
    (bench/cpu_threads.py: 1.6-1.7x faster than splitting them, the toy and a wide model alike). A Trainer sets
    both teams (the optimizer's on its own thread)."""
    def split(cuda, procs=1):
        return optim.Worker(torch.device("cuda" if cuda else "cpu"), procs).threads   # no thread started yet
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert split(True) == (2, 14) and split(False) == (16, 4)
    assert split(True, procs=4) == (2, 2) and split(True, procs=8) == (1, 1) and split(False, procs=4) == (4, 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert split(True) == split(False) == (1, 1)
    monkeypatch.undo()
    before = torch.get_num_threads()
    try:
        cfg = model.PRESETS["toy"]
        t = engine(cfg, model.init_weights(cfg, 0), device="cpu", **HP)
        main, worker = t.lanes.threads
        assert (main, worker) == split(False) and main == len(os.sched_getaffinity(0))
        assert t.lanes.submit(torch.get_num_threads).result() == worker and torch.get_num_threads() == main
    finally:
        torch.set_num_threads(before)


def test_the_optimizer_thread_selects_the_trainers_gpu(monkeypatch):
    """CUDA's current device is per thread: the optimizer thread selects the trainer's GPU itself (else its event
    waits and first CUDA call would make a context on GPU 0). The CUDA calls are doubles that refuse what the real
    ones refuse (tests/cuda_doubles.py): an un-indexed torch.device("cuda") given to the lanes is resolved once,
    to the current device, before anything is asked of set_device."""
    import threading
    gpu = cuda_doubles.install(monkeypatch, devices=4)
    lanes = stream.Lanes(torch.device("cuda", 3))
    assert lanes.submit(lambda: threading.current_thread().name).result().startswith("optimizer")
    assert [(who.startswith("optimizer"), d) for who, d in gpu.set_device_calls] == [(True, 3)], gpu.set_device_calls
    assert {s.device for s in gpu.streams} == {torch.device("cuda", 3)}
    lanes.worker.shutdown()
    gpu.set_device(1)                                       # the current device: what "cuda" means
    lanes = stream.Lanes(torch.device("cuda"))
    assert lanes.device == torch.device("cuda", 1) and lanes.submit(torch.cuda.current_device).result() == 1
    lanes.worker.shutdown()
    with pytest.raises(ValueError, match="specified index"):  # the double refuses what the real call refuses
        torch.cuda.set_device(torch.device("cuda"))


@pytest.mark.parametrize("clip,offload,resident,gpu_updated", [(0.0, True, 0, 0), (1.0, False, None, 0),
                                                               (1.0, True, 1, 3), (0.0, False, 0, 2)],
                         ids=["noclip-offload-streamed", "clip-resident-as-planned", "clip-3-gpu-updated",
                              "noclip-2-gpu-updated"])
def test_a_cuda_trainer_built_and_stepped_through_validating_doubles(monkeypatch, clip, offload, resident,
                                                                     gpu_updated):
    """A Trainer configured for CUDA with an un-indexed torch.device("cuda"), as train.py makes it, built and
    stepped on the CPU through doubles of every CUDA call it makes, each refusing what the real call refuses
    (tests/cuda_doubles.py; device tensors made on the CPU): the device is resolved once to cuda:0 and its lanes
    and optimizer thread use it; it trains as the plain PyTorch reference does (the central test's tolerances);
    and the host memory it page-locks is the plan's pinned figure, each buffer rounded up to whole pages -- every
    unit streamed, or as many resident on the GPU as the plan keeps there, or some updated there."""
    cfg, (B, T, M) = model.PRESETS["toy"], (4, 32, 2)
    w0 = model.init_weights(cfg, 0)
    kw = dict(dtype=torch.float32, grad_clip=clip, micro_batches=M, **HP)
    gen = torch.Generator().manual_seed(5)
    batches = [random_batch(cfg, B, T, gen) for _ in range(3)]
    ref = ReferenceTrainer(cfg, w0, device="cpu", **kw)                  # before the doubles: torch.optim asks CUDA things
    expected = [ref.step(*b) for b in batches]
    p = plan.plan(cfg, "h100", batch_size=B, seq_len=T, micro_batches=M, dtype="fp32", grad_clip=clip,
                  offload_activations=offload, grad_slabs=3, resident_units=resident,
                  gpu_updated_units=gpu_updated)
    gpu = cuda_doubles.install(monkeypatch)
    with gpu.placing():
        t = engine(cfg, w0, device=torch.device("cuda"), offload_activations=offload, grad_slabs=3,
                   resident_units=p["resident_units"], gpu_updated_units=p["gpu_updated_units"], **kw)
        losses = [t.step(*b) for b in batches]
        got = t.weights()
    assert t.dev == t.lanes.device == torch.device("cuda", 0)
    assert {s.device for s in gpu.streams} == {t.dev} and len(gpu.streams) == 3     # h2d, compute, d2h
    worker = [] if p["resident_units"] == len(t.units) else [(True, 0)]   # all resident: the thread never starts
    assert [(who.startswith("optimizer"), d) for who, d in gpu.set_device_calls] == worker, gpu.set_device_calls
    for step, (ours, theirs) in enumerate(zip(losses, expected)):
        check_loss(step, ours, theirs, LOSS_FP32)
    check_updates("after step 2", w0, got, ref.weights(), UPDATE_FP32)
    assert len(homed(t, Resident)) == p["resident_units"] == (0 if resident == 0 else len(t.units)
                                                               if resident is None else resident)
    assert len(homed(t, GpuUpdated)) == p["gpu_updated_units"] == gpu_updated
    registered = gpu.cudart.registered
    print(f"page-locked: {sum(registered.values()):,} B in {len(registered)} buffers; plan: {p['pinned_bytes']:,} B")
    assert 0 <= sum(registered.values()) - p["pinned_bytes"] <= len(registered) * mmap.PAGESIZE
    assert t.opt.pinned_bytes <= p["pinned_bytes"] and gpu.torch_pinned == []   # all exact: none from torch
    del t, got
    gc.collect()
    assert gpu.cudart.registered == {}                         # every page unregistered as its buffer went


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_cpu_threads_follow_taskset():
    """Under `taskset -c 0` the process may run on one CPU whatever os.cpu_count() says: one thread each."""
    code = ("import os, sys, torch; sys.path.insert(0, sys.argv[1]); import model, stream; "
            "t = stream.Trainer(model.PRESETS['toy'], model.init_weights(model.PRESETS['toy'], 0), device='cpu'); "
            "print(len(os.sched_getaffinity(0)), os.cpu_count(), *t.lanes.threads, torch.get_num_threads(), "
            "t.lanes.submit(torch.get_num_threads).result())")
    r = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    mask, cores, main, worker, main_now, worker_now = map(int, r.stdout.split())
    assert mask == 1 and (main, worker, main_now, worker_now) == (1, 1, 1, 1), (r.stdout, cores)


# ----------------------------------------------------------------------------- long context
LONG = model.GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=176, max_seq_len=2048,
                       qk_norm=True)


def test_tiled_engine_equals_reference_at_2048_tokens():
    """Sequence tiling in the engine (tiles of 700 tokens: 2048 is not a multiple), boundary activations through
    the host ring as at long T, against the plain PyTorch reference, which runs the untiled layer: 2 steps at 2 x 2048
    tokens in 2 micro-batches, loss <= LOSS_FP32, updates <= UPDATE_FP32_LONG."""
    w0 = model.init_weights(LONG, seed=0)
    ours = engine(LONG, w0, device="cpu", micro_batches=2, offload_activations=True, tile_tokens=700, **HP)
    ref = ReferenceTrainer(LONG, w0, device="cpu", micro_batches=2, **HP)
    two_steps_against(ours, ref, w0, LONG, 2, 2048, loss_tol=LOSS_FP32)
    check_updates("after step 1, tiles of 700 at T=2048", w0, ours.weights(), ref.weights(), UPDATE_FP32_LONG)
    with pytest.raises(ValueError, match="tile_tokens"):
        engine(LONG, w0, device="cpu", tile_tokens=-1)
    with pytest.raises(ValueError, match="tile_tokens"):
        engine(LONG, w0, device="cpu", tile_tokens=2.5)
