"""The engine on a real GPU. Skipped without CUDA; on a GPU machine run them all with
    python -m pytest -q tests/engine/test_gpu.py -s
- asynchronous (three streams, events) equals a run that synchronises after every operation, bit for bit,
  with units resident on the GPU, or streamed and updated there, too;
- fp32 on CUDA (TF32 off) equals the plain PyTorch reference on CUDA (same tolerances as on the CPU), with 0, 2
  and all units resident, and with streamed units updated on the GPU;
- bf16 streaming tracks the fp32 reference loss on the toy corpus within 2% after 200 steps;
- peak GPU memory does not grow with depth when boundary activations are offloaded (spread < 5%);
- the lanes and the optimizer thread run on the Trainer's device, and the host memory it page-locks
  (cudaHostRegister, counted here) is the plan's pinned figure.
The exactness subset -- test_async_equals_synchronised_bit_for_bit and test_cuda_fp32_equals_reference, 22 cases --
is what `bash bench/gpu_run.sh --quick` runs, by these names (tests/test_bench.py counts them)."""
import dataclasses
import mmap

import pytest
import torch

import model
from conftest import SPECIAL, engine, losses_agree, random_batch, update_rel
from megatrain_min import data, plan
from megatrain_min.engine.checks import CheckedTrainer
from megatrain_min.engine.pinned import page_locked
from megatrain_min.engine.reference import ReferenceTrainer
from stream import Lane, Lanes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class SyncLane(Lane):
    """A stream that waits for the whole device before work is issued on it and before an event is recorded:
    every operation runs alone, in program order (no overlap, no race possible)."""

    def __call__(self):
        torch.cuda.synchronize(self.stream.device)
        return super().__call__()

    def record(self):
        torch.cuda.synchronize(self.stream.device)
        return super().record()


@pytest.mark.parametrize("clip,resident,gpu_updated", [(0.0, 0, 0), (1.0, 0, 0), (0.0, 3, 0), (1.0, 99, 0),
                                                       (1.0, 1, 99), (0.0, 0, 3)])
@pytest.mark.parametrize("offload", [False, True])
def test_async_equals_synchronised_bit_for_bit(clip, offload, resident, gpu_updated):
    cfg = dataclasses.replace(model.PRESETS["toy"], n_layer=6, d_model=256, n_head=8, n_kv_head=8, d_ff=704)
    w0 = model.init_weights(cfg, 0)
    out = []
    for sync in (False, True):
        gen = torch.Generator().manual_seed(0)
        lanes = Lanes(torch.device("cuda"), lane=SyncLane if sync else Lane, pinned=page_locked)   # train.py's
        t = engine(cfg, w0, device="cuda", dtype=torch.bfloat16, grad_clip=clip, micro_batches=4,
                   offload_activations=offload, lanes=lanes, resident_units=resident,
                   gpu_updated_units=gpu_updated, **HP)
        losses = [t.step(*random_batch(cfg, 16, 128, gen)) for _ in range(4)]
        out.append((losses, t.weights()))
    assert out[0][0] == out[1][0], out
    assert all(torch.equal(out[0][1][k], out[1][1][k]) for k in w0)


@pytest.mark.parametrize("resident,gpu_updated", [(0, 0), (2, 0), (99, 0), (1, 99), (0, 2)])
@pytest.mark.parametrize("cfg", [model.PRESETS["toy"], SPECIAL], ids=["toy", "special"])
def test_cuda_fp32_equals_reference(cfg, resident, gpu_updated):
    gen = torch.Generator().manual_seed(1)
    w0 = model.init_weights(cfg, 0)
    ours = engine(cfg, w0, device="cuda", dtype=torch.float32, micro_batches=2, grad_clip=1.0,
                  resident_units=resident, gpu_updated_units=gpu_updated, **HP)
    ref = ReferenceTrainer(cfg, w0, device="cuda", dtype=torch.float32, micro_batches=2, grad_clip=1.0, **HP)
    losses_agree(ours, ref, cfg, gen, steps=5, B=4, T=32, rtol=1e-5)
    assert update_rel(w0, ours.weights(), ref.weights()) <= 1e-3


def test_bf16_tracks_fp32_reference_on_the_corpus():
    cfg = model.PRESETS["toy"]
    train, _ = data.split(data.load_tokens(data.DEFAULT_DATA))
    w0 = model.init_weights(cfg, 0)
    runs = {}
    for name, trainer in (("bf16-stream", CheckedTrainer(cfg, w0, device="cuda", dtype=torch.bfloat16, grad_clip=1.0, lr=3e-3)),
                          ("fp32-reference", ReferenceTrainer(cfg, w0, device="cuda", grad_clip=1.0, lr=3e-3))):
        batches = data.Batches(train, 32, 128, seed=0)
        losses = [trainer.step(*batches.next()) for _ in range(200)]
        runs[name] = sum(losses[-20:]) / 20
    rel = abs(runs["bf16-stream"] - runs["fp32-reference"]) / runs["fp32-reference"]
    print(f"loss over the last 20 of 200 steps: {runs}, rel diff {rel:.3%}")
    assert rel < 0.02


def test_peak_gpu_memory_flat_in_depth():
    peaks = {}
    for L in (8, 32):
        print(f"L={L}: {torch.cuda.memory_allocated() / 2**20:.1f} MiB allocated before the trainer")
        cfg = dataclasses.replace(model.PRESETS["toy"], vocab_size=1024, n_layer=L, d_model=512, n_head=8,
                                  n_kv_head=8, d_ff=1408)
        t = engine(cfg, model.init_weights(cfg, 0), device="cuda", micro_batches=2, offload_activations=True,
                   **HP)
        gen = torch.Generator().manual_seed(0)
        batch = random_batch(cfg, 8, 256, gen)
        t.step(*batch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t.step(*batch)
        t.weights()
        torch.cuda.synchronize()
        peaks[L] = torch.cuda.max_memory_allocated()
        del t
        torch.cuda.empty_cache()
    spread = abs(peaks[32] - peaks[8]) / peaks[8]
    print(f"peak GPU memory: {peaks}, spread {spread:.2%}")
    assert spread < 0.05


class CountingCudart:
    """The real CUDA runtime, with what is page-locked through it (cudaHostRegister) counted: ptr -> bytes."""

    def __init__(self, real):
        self.real, self.registered = real, {}

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        err = self.real.cudaHostRegister(ptr, size, flags)
        if int(err) == 0:
            self.registered[ptr] = size
        return err

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.registered.pop(ptr, None)
        return self.real.cudaHostUnregister(ptr)


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_lanes_worker_and_pinned_bytes_on_the_trainers_device(monkeypatch, clip):
    rt = CountingCudart(torch.cuda.cudart())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    cfg, (B, T, M) = model.PRESETS["toy"], (8, 64, 2)
    t = engine(cfg, model.init_weights(cfg, 0), device=torch.device("cuda"), micro_batches=M, grad_clip=clip,
               offload_activations=True, grad_slabs=3, **HP)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        t.step(*random_batch(cfg, B, T, gen))
    t.wait()
    dev = torch.device("cuda", torch.cuda.current_device())
    assert t.dev == dev and {lane.stream.device for lane in (t.h2d, t.comp, t.d2h)} == {dev}
    assert t.lanes.submit(torch.cuda.current_device).result() == dev.index
    assert all(g.is_pinned() for g in t.opt.grad if g is not None) and all(s.is_pinned() for s in t.opt.shadow)
    assert not t.opt.state["m"][0].is_pinned() and not t.opt.master[0].is_pinned()     # Adam's state never crosses
    p = plan.plan(cfg, "h100", batch_size=B, seq_len=T, micro_batches=M, grad_clip=clip, offload_activations=True,
                  grad_slabs=3, resident_units=0, gpu_updated_units=0)
    got = sum(rt.registered.values())
    print(f"page-locked {got:,} B in {len(rt.registered)} buffers, plan {p['pinned_bytes']:,} B")
    assert 0 <= got - p["pinned_bytes"] <= len(rt.registered) * mmap.PAGESIZE


def test_resident_units_checkpoint_round_trip(tmp_path):
    """A checkpoint of a trainer with units resident on the GPU (their state in device memory) loads, bit for bit,
    into one with none resident and back: save copies them through the host, load back into the device."""
    from megatrain_min.checkpoints import checkpoint
    cfg = model.PRESETS["toy"]
    gen = torch.Generator().manual_seed(0)
    a = engine(cfg, model.init_weights(cfg, 0), device="cuda", resident_units=3, **HP)
    for _ in range(2):
        a.step(*random_batch(cfg, 4, 32, gen))
    path = checkpoint.save(a, tmp_path, 2, {})
    state = lambda t: [t.opt.tensors(u)[s].cpu() for u in range(len(t.units)) for s in ("master", "m", "v")]  # noqa
    for k in (0, 99):
        b = engine(cfg, model.init_weights(cfg, 1), device="cuda", resident_units=k, **HP)
        checkpoint.load(b, path)
        b.wait()
        assert all(torch.equal(x, y) for x, y in zip(state(a), state(b)))


def test_resident_scatter_is_deterministic_on_cuda():
    """The resident embedding's scatter on CUDA (resident.Resident.add_dy: index_put_ with accumulate -- a stable
    sort of the token ids, then each row's tokens added in that order): the same bits twice, and the host's
    index_add_ to fp32 rounding (bit for bit where the kernel keeps the token order: printed)."""
    from megatrain_min.engine.resident import Resident
    cfg = dataclasses.replace(model.PRESETS["toy"], vocab_size=32000, d_model=512, n_head=8, n_kv_head=8)
    t = engine(cfg, model.init_weights(cfg, 0), device="cuda", resident_units=1, **HP)
    assert isinstance(t.home[t.embed], Resident)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (8, 512), generator=gen).cuda()       # many repeats: rows shared by tokens
    dy = torch.randn(8 * 512, cfg.d_model, generator=gen).cuda()
    runs = []
    for _ in range(2):
        t.opt.grad[t.embed].zero_()
        t.home[t.embed].add_dy(tokens, dy)
        torch.cuda.synchronize()
        runs.append(t.opt.grad[t.embed].clone())
    host = torch.zeros(cfg.vocab_size, cfg.d_model).index_add_(0, tokens.cpu().reshape(-1), dy.cpu())
    got = runs[0][:cfg.vocab_size * cfg.d_model].view(cfg.vocab_size, -1).cpu()
    print(f"resident scatter: deterministic {torch.equal(runs[0], runs[1])}, the host's bits {torch.equal(got, host)}, "
          f"max |diff| {float((got - host).abs().max()):.1e}")
    assert torch.equal(runs[0], runs[1])
    assert torch.allclose(got, host, rtol=1e-6, atol=1e-5)
