"""optim.HostStore with the AdamW rule against torch.optim.AdamW(fused=True) with the same two parameter groups."""
import threading
import mmap

import pytest
import torch

import cuda_doubles
import optim
from megatrain_min.run.schedule import lr_at
from conftest import ReferenceLion
from megatrain_min.engine.lion import Lion
from optim import AdamW, HostStore, clip_coef


def side_by_side(make_ref, rule, max_norm, lr, weight_decay, moment):
    """10 steps of the store running `rule` on one unit ([2 matrices | 2 vectors]) beside the reference optimizer
    make_ref(param_groups) on the same tensors and gradients, clipping as torch.nn.utils.clip_grad_norm_ does: the
    store after each step within 1e-6 of the reference, and its first moment (the reference's state `moment`) at
    the end within 1e-5. Returns the store and the last step's max relative difference."""
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(48, 32, generator=g), torch.randn(16, 8, generator=g)]
    vecs = [torch.randn(32, generator=g), torch.randn(8, generator=g)]
    params = [t.clone().requires_grad_() for t in mats + vecs]
    ref = make_ref([{"params": params[:2], "weight_decay": weight_decay}, {"params": params[2:], "weight_decay": 0.0}])
    n_decay = sum(t.numel() for t in mats)
    n = n_decay + sum(t.numel() for t in vecs)
    opt = HostStore([(n, n_decay)], rule, lr=lr, weight_decay=weight_decay)
    opt.master[0].copy_(torch.cat([t.flatten() for t in mats + vecs]))
    for step in range(10):
        grads = [torch.randn(p.shape, generator=g) * (step + 1) for p in params]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        ref.step()
        opt.grad[0].copy_(torch.cat([gr.flatten() for gr in grads]))
        opt.step(0, coef=clip_coef(float(opt.grad_sq(0)) ** 0.5, max_norm))
        flat = torch.cat([p.detach().flatten() for p in params])
        err = ((flat - opt.master[0]).abs().max() / flat.abs().max()).item()
        assert err <= 1e-6, f"step {step}: max rel diff {err:.2e}"
    m_ref = torch.cat([ref.state[p][moment].flatten() for p in params])
    assert torch.allclose(m_ref, opt.tensors(0)["m"], rtol=1e-5, atol=1e-9)   # the moments match too
    return opt, err


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_equals_torch_adamw_fused_over_10_steps(max_norm):
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    _, err = side_by_side(lambda groups: torch.optim.AdamW(groups, fused=True, **hp), AdamW(hp["betas"], hp["eps"]),
                          max_norm, hp["lr"], 0.1, "exp_avg")
    print(f"HostStore (AdamW) vs torch AdamW(fused) after 10 steps: max rel diff {err:.2e}")


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_lion_equals_the_papers_rule_over_10_steps(max_norm):
    """megatrain_min.engine.lion.Lion run by the store (one region decayed, one not, one fp32 moment) against Lion written
    from the paper in plain PyTorch (conftest.ReferenceLion), clipping as torch.nn.utils.clip_grad_norm_ does
    (measured: 0 difference, the same ops element by element)."""
    opt, err = side_by_side(lambda groups: ReferenceLion(groups, lr=1e-3, betas=(0.9, 0.99)), Lion((0.9, 0.99)),
                            max_norm, 1e-3, 1.0, "m")
    n = opt.sizes[0][0]
    assert list(opt.tensors(0)) == ["master", "m"] and opt.nbytes() == 3 * 4 * n   # master, m, gradient
    print(f"HostStore (Lion) vs the paper's Lion after 10 steps: max rel diff {err:.2e}")


@pytest.mark.parametrize("rule", [AdamW(), Lion()], ids=["adamw", "lion"])
def test_a_rule_skips_itself_on_a_device_flag(rule):
    """found_inf (the guard's verdict taken on a GPU, no host sync): 1.0 leaves the master, the state and the step
    count as they were, whatever the gradient holds; 0.0 is an ordinary update."""
    opt = HostStore([(10, 6)], rule, lr=0.1, weight_decay=0.5)
    opt.master[0].normal_()
    opt.grad[0].normal_()
    opt.step(0)
    before = [t.clone() for t in opt.tensors(0).values()] + [opt.steps[0].item()]
    opt.grad[0][3] = float("nan")
    opt.step(0, found_inf=torch.ones(()))
    assert all(torch.equal(a, b) for a, b in zip(before, opt.tensors(0).values())) and opt.steps[0].item() == 1
    opt.grad[0][3] = 1.0
    opt.step(0, found_inf=torch.zeros(()))
    assert not torch.equal(before[0], opt.master[0]) and opt.steps[0].item() == 2


def test_no_decay_region_is_not_decayed():
    opt = HostStore([(6, 4)], lr=0.1, weight_decay=0.5)
    opt.master[0].fill_(1.0)
    opt.step(0)  # zero gradient: only decay moves weights
    assert torch.all(opt.master[0][:4] < 1.0) and torch.all(opt.master[0][4:] == 1.0)


def test_shadow_follows_master():
    opt = HostStore([(10, 10)], lr=0.1, shadow_dtype=torch.bfloat16)
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


def test_tiles_change_nothing(monkeypatch):
    """HostStore.step updates a unit in tiles of optim.TILE elements, each tile's bf16 shadow written while it is
    in cache (one pass over the unit): bit for bit what one call over the whole unit and a copy after it give."""
    n, n_decay = 1000, 700
    runs = []
    for tile in (64, 10**9):                 # tiles that straddle the decay boundary, and one tile per region
        monkeypatch.setattr(optim, "TILE", tile)
        opt = HostStore([(n, n_decay)], lr=1e-2, weight_decay=0.1, shadow_dtype=torch.bfloat16)
        opt.master[0].copy_(torch.randn(n, generator=torch.Generator().manual_seed(0)))
        for step in range(3):
            opt.grad[0].copy_(torch.randn(n, generator=torch.Generator().manual_seed(step)))
            opt.step(0, coef=0.5 if step else 1.0)
        runs.append([opt.master[0], opt.state["m"][0], opt.state["v"][0], opt.shadow[0]])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert torch.equal(runs[0][3], runs[0][0].to(torch.bfloat16))


def test_the_cuda_doubles_refuse_what_cuda_refuses(monkeypatch):
    """The doubles the CPU tests stand in for CUDA with fail where the real calls fail (else they would hide the
    bug they are there to catch): set_device of "cuda" without an index (torch's own check), a device ordinal the
    machine lacks, overlapping or empty host registrations, unregistering an address never registered."""
    gpu = cuda_doubles.install(monkeypatch, devices=2)
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(2)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.Stream(device="cuda:5")
    with pytest.raises(TypeError):
        torch.cuda.Stream().wait_event(object())
    rt, P = torch.cuda.cudart(), mmap.PAGESIZE
    assert rt.cudaHostRegister(10 * P, P, 0) == 0 and rt.cudaHostRegister(10 * P + 100, 8, 0) == 712
    assert rt.cudaHostRegister(20 * P, 0, 0) == 1 and rt.cudaHostRegister(20 * P, 8, 64) == 1
    assert rt.cudaHostUnregister(10 * P + 8) == 713 and rt.cudaHostUnregister(10 * P) == 0
    with pytest.raises(TypeError):
        rt.cudaHostRegister(1.5, 8, 0)


class Landing:
    """A CUDA event's host side as optim.Worker uses it: query() says whether it fired, without blocking;
    synchronize() blocks until it fires."""

    def __init__(self, fired=False):
        self.fired, self.waited = threading.Event(), threading.Event()
        if fired:
            self.fired.set()

    def query(self):
        return self.fired.is_set()

    def synchronize(self):
        self.waited.set()
        assert self.fired.wait(timeout=30), "the event never fired"


def test_worker_runs_the_landed_task_the_next_forward_needs_first():
    """optim.Worker is not first come, first served: of the tasks whose gradient has landed it runs the one with the
    least `need` (its unit's place in the next forward); a task whose event has not fired waits even when it is the
    most needed; with none landed it runs the oldest, which waits for its own input (as stream.Trainer's tasks do:
    the D2H lane lands them in submission order). A CUDA error in a query reaches a task, which raises it: no hang."""
    w, ran, gate = optim.Worker(torch.device("cpu")), [], threading.Event()

    def task(name, event):                 # as stream.Streamed.run's: wait for the gradient, then work
        if event is not None:
            event.synchronize()
        ran.append(name)
    try:
        w.submit(gate.wait)                                          # holds the thread while the rest come in
        late = Landing()
        futs = [w.submit(task, name, ready, need=need, ready=ready) for name, need, ready in
                [("layer 5", 6, Landing(True)), ("embedding, not landed", 0, late), ("layer 2", 3, Landing(True)),
                 ("layer 0, nothing to wait for", 1, None)]]
        gate.set()
        futs[3].result(timeout=30)
        futs[0].result(timeout=30)
        assert ran == ["layer 0, nothing to wait for", "layer 2", "layer 5"]     # the embedding has not landed
        late.fired.set()
        futs[1].result(timeout=30)
        assert ran[-1] == "embedding, not landed"
        ran.clear()
        gate.clear()
        w.submit(gate.wait)
        first, second = Landing(), Landing()
        futs = [w.submit(task, "oldest", first, need=9, ready=first),
                w.submit(task, "needed", second, need=0, ready=second)]
        gate.set()
        assert first.waited.wait(timeout=30)     # none landed: the oldest runs and waits ...
        second.fired.set()                       # ... and finishes first even if a later one lands meanwhile
        first.fired.set()
        [f.result(timeout=30) for f in futs]
        assert ran == ["oldest", "needed"]
        boom = w.submit(lambda: 1 / 0, need=0)
        with pytest.raises(ZeroDivisionError):                       # raised where its result is asked for
            boom.result(timeout=30)

        class Broken(Landing):                                       # a sticky CUDA error: every call raises it
            def query(self):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            synchronize = query
        lost = w.submit(task, "never", Broken(True), need=0, ready=Broken(True))
        with pytest.raises(RuntimeError, match="illegal memory access"):   # from the task's own wait: no hang
            lost.result(timeout=30)
        assert w.todo == [] and "never" not in ran
    finally:
        gate.set()
        w.shutdown()
