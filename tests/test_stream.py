"""The project's central test: stream.Trainer (weights in host memory, one layer at a time, recompute,
layer-major micro-batches) equals plain PyTorch training (megatrain_min.reference: one autograd graph,
torch.optim.AdamW) step for step, on the CPU in fp32.
Tolerances (DESIGN.md section 2): per-step loss <= 1e-5 relative; weight updates <= 1e-3 relative by
the norm of their difference (Adam magnifies rounding in near-zero gradients)."""
import math

import pytest
import torch

import model
from conftest import SPECIAL, losses_agree, random_batch, update_rel
from megatrain_min.reference import ReferenceTrainer
from stream import Trainer

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("offload", [False, True], ids=["ckpt-gpu", "ckpt-offload"])
@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["noclip", "clip"])
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("cfg", [model.PRESETS["toy"], SPECIAL], ids=["toy", "gqa-bias-qknorm-tied"])
def test_stream_equals_reference(cfg, M, clip, offload):
    gen = torch.Generator().manual_seed(7)
    w0 = model.init_weights(cfg, seed=0)
    ours = Trainer(cfg, w0, device="cpu", grad_clip=clip, micro_batches=M, offload_checkpoints=offload, **HP)
    ref = ReferenceTrainer(cfg, w0, grad_clip=clip, micro_batches=M, **HP)
    worst = 0.0
    for step in range(5):
        tok, tgt = random_batch(cfg, 4, 24, gen)
        ours.set_lr(HP["lr"] * (1 - 0.1 * step))
        ref.set_lr(HP["lr"] * (1 - 0.1 * step))
        a, b = ours.step(tok, tgt), ref.step(tok, tgt)
        worst = max(worst, abs(a - b) / abs(b))
        assert abs(a - b) / abs(b) <= 1e-5, f"step {step}: loss {a} vs {b}"
    rel = update_rel(w0, ours.weights(), ref.weights())
    print(f"max loss rel diff {worst:.1e}, update rel diff {rel:.1e}")
    assert rel <= 1e-3
    assert set(ours.weights()) == set(w0)


def test_micro_batches_equal_one_batch():
    """Invariance: the same step in 1 or 4 micro-batches gives the same loss and (nearly) the same update."""
    cfg = SPECIAL
    gen = torch.Generator().manual_seed(3)
    w0 = model.init_weights(cfg, 0)
    one, four = (Trainer(cfg, w0, device="cpu", micro_batches=m, **HP) for m in (1, 4))
    losses_agree(four, one, cfg, gen, steps=3, B=8, T=16, rtol=1e-6)
    assert update_rel(w0, four.weights(), one.weights()) <= 1e-4


def test_two_identical_runs_match_bit_for_bit():
    cfg = model.PRESETS["toy"]
    w0 = model.init_weights(cfg, 0)
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(5)
        t = Trainer(cfg, w0, device="cpu", micro_batches=2, grad_clip=1.0, **HP)
        losses = [t.step(*random_batch(cfg, 4, 16, gen)) for _ in range(3)]
        runs.append((losses, t.weights()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in w0)


def test_evaluate_equals_reference_loss(gen):
    cfg = SPECIAL
    w0 = model.init_weights(cfg, 0)
    t = Trainer(cfg, w0, device="cpu", micro_batches=2, chunk_tokens=5, **HP)
    tok, tgt = random_batch(cfg, 4, 16, gen)
    ref = model.loss(cfg, w0, tok, tgt).item()
    assert abs(t.evaluate(tok, tgt) - ref) / ref <= 1e-6
    assert all(torch.equal(v, w0[k]) for k, v in t.weights().items())  # evaluation changes nothing


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["loss-check", "norm-check"])
def test_nonfinite_step_is_skipped_and_weights_untouched(gen, clip):
    cfg = model.PRESETS["toy"]
    w0 = model.init_weights(cfg, 0)
    t = Trainer(cfg, w0, device="cpu", skip_nonfinite=True, grad_clip=clip, **HP)
    tok, tgt = random_batch(cfg, 2, 16, gen)
    t.step(tok, tgt)
    before = t.weights()
    m_before = [m.clone() for m in t.opt.m]
    emb = t.units[0].views(t.opt.master[0])["embed"]
    saved = emb[tok[0, 0]].clone()
    emb[tok[0, 0], 0] = float("inf")   # poison one embedding row that the batch uses
    loss = t.step(tok, tgt)
    assert t.skipped and not math.isfinite(loss)
    emb[tok[0, 0]] = saved
    after = t.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a, b) for a, b in zip(m_before, t.opt.m))
    assert all(float(s) == 1.0 for s in t.opt.steps)  # step counts untouched too
    t.step(tok, tgt)
    assert not t.skipped


def test_lean_mode_and_bad_arguments():
    cfg = model.PRESETS["toy"]
    w0 = model.init_weights(cfg, 0)
    gen = torch.Generator().manual_seed(0)
    batch = random_batch(cfg, 2, 16, gen)
    fast = Trainer(cfg, w0, device="cpu", mode="fast", **HP)
    lean = Trainer(cfg, w0, device="cpu", mode="lean", **HP)
    assert fast.step(*batch) == lean.step(*batch)
    with pytest.raises(ValueError, match="mode must be"):
        Trainer(cfg, w0, device="cpu", mode="quick")
    with pytest.raises(ValueError, match="not divisible by micro_batches"):
        Trainer(cfg, w0, device="cpu", micro_batches=3).step(*batch)


def test_host_store_layout_bf16_shadow():
    """In fast mode with a bf16 compute dtype the store keeps an exact bf16 copy of each master unit."""
    cfg = model.PRESETS["toy"]
    t = Trainer(cfg, model.init_weights(cfg, 0), device="cpu", dtype=torch.bfloat16)
    assert t.opt.shadow is not None
    for u in range(len(t.units)):
        assert torch.equal(t.opt.shadow[u], t.opt.master[u].to(torch.bfloat16))
    assert t.wslot[0].dtype == torch.bfloat16 and t.gslot[0].dtype == torch.float32


@pytest.mark.parametrize("M", [1, 4])
def test_weights_cross_once_per_visit_whatever_the_micro_batches(M, monkeypatch):
    """Layer-major: per step each layer is copied in once for forward and once for backward, the last
    layer only once, the head once: 2L copies in all, independent of the number of micro-batches."""
    cfg = model.PRESETS["toy"]
    t = Trainer(cfg, model.init_weights(cfg, 0), device="cpu", micro_batches=M, **HP)
    loads = []
    real = t._load
    monkeypatch.setattr(t, "_load", lambda u, slot: (loads.append(t.units[u].name), real(u, slot)))
    t.step(*random_batch(cfg, 4, 16, torch.Generator().manual_seed(0)))
    L = cfg.n_layer
    assert len(loads) == 2 * L
    assert loads == [f"layer.{i}" for i in range(L)] + ["head"] + [f"layer.{i}" for i in reversed(range(L - 1))]


def test_gradient_store_only_when_updates_wait_for_the_global_norm(gen):
    """No clipping: gradients pass through 3 pinned staging slabs (no 4 B/param store), also with the
    non-finite guard on; clipping: an fp32 gradient per unit, since every gradient precedes any update."""
    cfg = SPECIAL  # tied: the head holds a slab until the embedding scatter
    w0 = model.init_weights(cfg, 0)
    t = Trainer(cfg, w0, device="cpu", micro_batches=2, skip_nonfinite=True, **HP)
    for _ in range(3):
        t.step(*random_batch(cfg, 4, 16, gen))
    t.weights()
    assert all(g is None for g in t.opt.grad) and t.slabs.qsize() == 3
    clipped = Trainer(cfg, w0, device="cpu", grad_clip=1.0, **HP)
    assert all(g is not None and g.numel() == lay.numel for g, lay in zip(clipped.opt.grad, clipped.units))
