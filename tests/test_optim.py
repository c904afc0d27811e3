"""optim.HostAdamW against torch.optim.AdamW(fused=True) with the same two parameter groups."""
import pytest
import torch

from optim import HostAdamW, clip_coef, lr_at, pin_exact_sizes


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_equals_torch_adamw_fused_over_10_steps(max_norm):
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(48, 32, generator=g), torch.randn(16, 8, generator=g)]
    vecs = [torch.randn(32, generator=g), torch.randn(8, generator=g)]
    params = [t.clone().requires_grad_() for t in mats + vecs]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1},
                             {"params": params[2:], "weight_decay": 0.0}], fused=True, **hp)
    n_decay = sum(t.numel() for t in mats)
    n = n_decay + sum(t.numel() for t in vecs)
    opt = HostAdamW([(n, n_decay)], weight_decay=0.1, **hp)
    opt.master[0].copy_(torch.cat([t.flatten() for t in mats + vecs]))
    for step in range(10):
        grads = [torch.randn(p.shape, generator=g) * (step + 1) for p in params]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        ref.step()
        opt.grad[0].copy_(torch.cat([gr.flatten() for gr in grads]))
        opt.step(0, clip_coef=clip_coef(opt.grad_sq(0) ** 0.5, max_norm))
        flat = torch.cat([p.detach().flatten() for p in params])
        err = ((flat - opt.master[0]).abs().max() / flat.abs().max()).item()
        assert err <= 1e-6, f"step {step}: max rel diff {err:.2e}"
    print(f"HostAdamW vs torch AdamW(fused) after 10 steps: max rel diff {err:.2e}")
    # the moments match too
    m_ref = torch.cat([ref.state[p]["exp_avg"].flatten() for p in params])
    assert torch.allclose(m_ref, opt.state(0)["m"], rtol=1e-5, atol=1e-9)


def test_no_decay_region_is_not_decayed():
    opt = HostAdamW([(6, 4)], lr=0.1, weight_decay=0.5)
    opt.master[0].fill_(1.0)
    opt.step(0)  # zero gradient: only decay moves weights
    assert torch.all(opt.master[0][:4] < 1.0) and torch.all(opt.master[0][4:] == 1.0)


def test_shadow_follows_master():
    opt = HostAdamW([(10, 10)], lr=0.1, shadow_dtype=torch.bfloat16)
    opt.master[0].normal_()
    opt.grad[0].normal_()
    opt.step(0)
    assert torch.equal(opt.shadow[0], opt.master[0].to(torch.bfloat16))


def test_lr_schedule_and_clip_coef():
    assert lr_at(0, 1.0, 100, warmup=10) == pytest.approx(0.1)
    assert lr_at(9, 1.0, 100, warmup=10) == pytest.approx(1.0)
    assert lr_at(10, 1.0, 100, warmup=10) == pytest.approx(1.0)
    assert lr_at(100, 1.0, 100, warmup=10) == pytest.approx(0.1)
    assert lr_at(55, 1.0, 100, warmup=10) == pytest.approx(0.55)
    assert clip_coef(10.0, 1.0) == pytest.approx(1 / (10 + 1e-6)) and clip_coef(0.5, 1.0) == 1.0
    assert clip_coef(10.0, 0.0) == 1.0


def test_pinned_allocator_settings_are_accepted_and_appended():
    """optim.pin_exact_sizes leans on a private torch setter (which replaces the whole configuration); make a
    torch upgrade that drops it loud, and keep what the user set (PYTORCH_ALLOC_CONF) in place."""
    before = torch._C._accelerator_getAllocatorSettings()
    try:
        torch._C._accelerator_setAllocatorSettings("max_split_size_mb:128,garbage_collection_threshold:0.6")
        pin_exact_sizes()
        pin_exact_sizes()                              # idempotent: not appended twice
        got = torch._C._accelerator_getAllocatorSettings()
        assert got == ("max_split_size_mb:128,garbage_collection_threshold:0.6,"
                       "pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:64")
    finally:
        torch._C._accelerator_setAllocatorSettings(before)
