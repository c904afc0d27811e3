"""The CUDA doubles (tests/cuda_doubles.py) fail where torch 2.11 with CUDA fails, and the engine's optimizer thread
is tested through them. Each refusal has a test here; each of these failed on the doubles before issue 43 (which
accepted them):
- a tensor made on a GPU says so (.device, .is_cuda), and what is made from it or "on its device" is there too;
- events carry their device, and a test can hold their completion (query() False until released); an event
  recorded on two devices' streams is refused (CUDAEvent.h);
- torch._fused_adamw_ refuses operands on two devices: a CPU step count (the generated wrapper's device check),
  grad_scale or found_inf (keyword-only: unchecked by torch, read by the kernel at a host address -- an illegal
  memory access on the GPU);
- torch.dot of a GPU and a CPU tensor is refused (the wrapper's check; a CPU scalar is no exception);
- record_stream of a host tensor is refused (the op has a CUDA kernel alone);
- mem_get_info answers what the test set: an H200's ~139 GiB free, which the planner's "local" profile reads.
Then optim.Worker's need-first order through held events, alone and inside the engine (stream.Trainer); and the
engine configured for CUDA in bf16 (train.py's default there) through the doubles, equal to the CPU engine."""
import contextlib
import gc
import threading

import pytest
import torch

import cuda_doubles
import model
import optim
from conftest import engine, random_batch
from megatrain_min.plan import hardware

GiB = 2**30


def test_a_tensor_made_on_a_gpu_says_so_and_what_is_made_from_it_is_there_too(monkeypatch):
    gpu = cuda_doubles.install(monkeypatch, devices=2)
    host = torch.arange(6.0)
    with gpu.placing():
        x = torch.zeros(6, device="cuda:1")
        assert x.device == torch.device("cuda", 1) and x.is_cuda and x.get_device() == 1 and not x.is_pinned()
        y = torch.full((), 2.0, device=x.device)           # "on p.device": the engine's clip scale
        assert y.device == torch.device("cuda", 1)
        assert (x + host).device == x.device and x[2:].device == x.device and x.view(2, 3).is_cuda
        assert torch.cat([x, x]).device == x.device and x.to(torch.float64).device == x.device
        assert host.add_(1.0).device.type == "cpu" and not host.is_cuda   # in place: where it was
        back = x.cpu()
        assert back.device.type == "cpu" and back.data_ptr() != x.data_ptr()   # a copy on the host
        up = host.to("cuda")                               # the current device (0): a copy, the host stays
        assert up.device == torch.device("cuda", 0) and host.device.type == "cpu"
        assert up.data_ptr() != host.data_ptr() and host.to("cpu") is host
    assert gpu.device_of(x) == torch.device("cuda", 1) and gpu.device_of(host).type == "cpu"


def test_events_carry_a_device_and_a_test_holds_their_completion(monkeypatch):
    gpu = cuda_doubles.install(monkeypatch, devices=2)
    s0, s1 = torch.cuda.Stream(device=0), torch.cuda.Stream(device=1)
    done = s1.record_event()
    assert done.device == torch.device("cuda", 1) and done.query()      # nothing held: done at once
    with gpu.hold(s1):
        late, other = s1.record_event(), s0.record_event()
        assert not late.query() and other.query() and not s1.query()    # held: pending until released
        threading.Timer(0.2, gpu.release, (late,)).start()
        late.synchronize()                                              # blocks until released
        assert late.query()
        again = s1.record_event()
    assert again.query()                                                # released on the way out
    e = torch.cuda.Event()
    assert e.query() and e.device is None                               # never recorded: done, no device
    e.record(s0)
    with pytest.raises(RuntimeError, match="Event device 0 does not match recording stream's device 1"):
        e.record(s1)
    monkeypatch.setattr(cuda_doubles, "HELD_S", 0.1)
    with gpu.hold():
        never = s0.record_event()
        with pytest.raises(RuntimeError, match="never released"):      # a test's hang, reported
            never.synchronize()


def adamw_args(p, g, step, **kw):
    return ([p], [g], [torch.zeros_like(p)], [torch.zeros_like(p)], [], [step]), dict(
        dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False), **kw)


def test_fused_adamw_refuses_operands_on_two_devices(monkeypatch):
    gpu = cuda_doubles.install(monkeypatch)
    with gpu.placing():
        p, g, step = torch.ones(8, device="cuda"), torch.full((8,), 0.5, device="cuda"), torch.ones((), device="cuda")
        on_host = torch.ones(())
        args, kw = adamw_args(p, g, step, grad_scale=torch.full((), 2.0, device=p.device))
        torch._fused_adamw_(*args, **kw)                                  # every operand on cuda:0: runs
        ref = torch.ones(8)
        cuda_doubles.REAL_FUSED_ADAMW(*adamw_args(ref, torch.full((8,), 0.5), torch.ones(()))[0],
                                      **kw | dict(grad_scale=torch.full((), 2.0)))
        assert torch.equal(p, ref) and p.isfinite().all() and not torch.equal(p, torch.ones(8))   # its values
        with pytest.raises(RuntimeError, match="argument state_steps|got state_steps is on cpu"):
            torch._fused_adamw_(*adamw_args(p, g, torch.ones(()))[0], **adamw_args(p, g, step)[1])
        for name in ("grad_scale", "found_inf"):
            with pytest.raises(RuntimeError, match=f"{name} on cpu beside params on cuda:0"):
                torch._fused_adamw_(*adamw_args(p, g, step, **{name: on_host})[0],
                                    **adamw_args(p, g, step, **{name: on_host})[1])
        with pytest.raises(RuntimeError, match="got grads is on cpu, different from other tensors on cuda:0"):
            torch._fused_adamw_(*adamw_args(p, torch.ones(8), step)[0], **adamw_args(p, g, step)[1])
        host_p = torch.ones(8)                # the host's update: a step count on the GPU is read with .item()
        torch._fused_adamw_(*adamw_args(host_p, torch.ones(8), step)[0], **kw | dict(grad_scale=None))
        with pytest.raises(RuntimeError, match="grads on cuda:0 beside params on cpu"):
            torch._fused_adamw_(*adamw_args(host_p, g, torch.ones(()))[0], **adamw_args(p, g, step)[1])


def test_dot_and_record_stream_refuse_what_cuda_refuses(monkeypatch):
    gpu = cuda_doubles.install(monkeypatch)
    with gpu.placing():
        x, host = torch.ones(4, device="cuda"), torch.ones(4)
        assert float(torch.dot(x, x)) == 4.0 and float(x.dot(x)) == 4.0 and float(torch.dot(host, host)) == 4.0
        for a, b in ((x, host), (host, x), (x, torch.ones(()).expand(4))):
            with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
                torch.dot(a, b)
        s = torch.cuda.Stream()
        x.record_stream(s)
        with pytest.raises(NotImplementedError, match="'aten::record_stream' with arguments from the 'CPU'"):
            host.record_stream(s)
        with pytest.raises(TypeError, match="must be Stream"):
            x.record_stream(object())


def test_mem_get_info_and_the_name_are_the_tests_and_the_planner_reads_them(monkeypatch):
    gpu = cuda_doubles.install(monkeypatch)
    assert torch.cuda.mem_get_info() == (80 * GiB, 80 * GiB)
    for call in (torch.cuda.mem_get_info, torch.cuda.synchronize, torch.cuda.get_device_name):
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            call(1)
    gpu.set_memory(3 * GiB, 80 * GiB)
    assert torch.cuda.mem_get_info(0) == (3 * GiB, 80 * GiB)
    gpu = cuda_doubles.install(monkeypatch, **cuda_doubles.H200)
    free, total = torch.cuda.mem_get_info()
    assert free == 139 * GiB and 140 * GiB < total < 141 * GiB
    hw = hardware.local(torch.device("cuda", 0))
    assert hw["profiled"] and hw["gpu"] == "NVIDIA H200" and hw["gpu_mem_gb"] == pytest.approx(139 * GiB / 1e9)
    assert hw["h2d_gbs"] == hardware.HARDWARE["h200"]["h2d_gbs"]


def test_need_first_worker_through_held_events(monkeypatch):
    """optim.Worker, its tasks' `ready` events the doubles' (recorded on a D2H stream, held): of the landed it runs
    the least `need`; with none landed the oldest, which blocks in its own wait until the event is released."""
    gpu = cuda_doubles.install(monkeypatch)
    d2h, ran, gate = torch.cuda.Stream(), [], threading.Event()
    w = optim.Worker(torch.device("cuda", 0))

    def task(name, event):                 # as Trainer._grad_landed: wait for the gradient, then work
        event.synchronize()
        ran.append(name)
    try:
        with gpu.hold(d2h):
            w.submit(gate.wait)                                        # holds the thread while the rest come in
            ev = {name: d2h.record_event() for name in ("layer 5", "embedding", "layer 2")}
            futs = [w.submit(task, name, ev[name], need=need, ready=ev[name])
                    for name, need in (("layer 5", 6), ("embedding", 0), ("layer 2", 3))]
            gpu.release(ev["layer 5"], ev["layer 2"])                  # the embedding's gradient still on its way
            gate.set()
            futs[2].result(timeout=30)
            futs[0].result(timeout=30)
            assert ran == ["layer 2", "layer 5"] and not futs[1].done()
            gpu.release(ev["embedding"])
            futs[1].result(timeout=30)
            ran.clear()
            gate.clear()
            w.submit(gate.wait)
            first, second = d2h.record_event(), d2h.record_event()
            futs = [w.submit(task, "oldest", first, need=9, ready=first),
                    w.submit(task, "needed", second, need=0, ready=second)]
            gate.set()                                                 # none landed: the oldest runs and waits
            threading.Timer(0.3, gpu.release, (second, first)).start()
            [f.result(timeout=30) for f in futs]
            assert ran == ["oldest", "needed"]
    finally:
        gate.set()
        w.shutdown()


@pytest.mark.parametrize("resident,gpu_updated", [(0, 0), (1, 1)])
def test_the_engine_updates_the_landed_units_the_next_forward_needs_first(monkeypatch, resident, gpu_updated):
    """stream.Trainer through the doubles, every gradient's D2H event held until the step has returned: the
    optimizer thread finds none landed and waits in the oldest task (the head's); once they land it runs the
    others by their place in the next forward -- embedding, layer 0, 1, ... -- not first come, first served
    (layer L-1 ... 0, embedding). A resident unit (the embedding) and one updated on the GPU (layer 0) are
    updated on the main thread meanwhile, waiting for nothing on the host. The weights equal a run whose events
    land at once, bit for bit."""
    cfg = model.GPTConfig(vocab_size=64, n_layer=3, n_head=2, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=16)
    w0 = model.init_weights(cfg, 0)
    gpu = cuda_doubles.install(monkeypatch)
    names = {}                                          # a unit's first master address -> its name
    updates, fused = [], torch._fused_adamw_

    def logged(params, *args, **kw):
        scratch = "on a GPU scratch" if gpu.device_of(params[0]).type == "cuda" else None   # or a vector region
        updates.append(names.get(params[0].data_ptr(), scratch))
        return fused(params, *args, **kw)
    monkeypatch.setattr(torch, "_fused_adamw_", logged)
    out = []
    for held in (False, True):
        gen = torch.Generator().manual_seed(0)
        with gpu.placing():
            t = engine(cfg, w0, device=torch.device("cuda"), dtype=torch.float32, micro_batches=2,
                       grad_slabs=len(model.units(cfg)), lr=1e-2, resident_units=resident,
                       gpu_updated_units=gpu_updated)
            names.update({t.opt.master[u].data_ptr(): lay.name for u, lay in enumerate(model.units(cfg))})
            t.step(*random_batch(cfg, 4, 16, gen))
            t.wait()
            updates.clear()
            with gpu.hold(t.lanes.d2h.stream) if held else gpu.hold(object()):
                t.step(*random_batch(cfg, 4, 16, gen))
                during = [u for u in updates if u]      # what ran before any gradient landed
            t.wait()
            order = [u for u in dict.fromkeys(updates) if u]     # (a unit's vectors: a second call)
            out.append((t.weights(), during, order))
            del t                                       # its pages unregistered while the doubles stand
            gc.collect()
    (free, _, _), (late, during, order) = out
    on_main = ["embed"] * resident + ["on a GPU scratch"] * gpu_updated   # (layer 0: gpu_update.chosen)
    assert sorted(set(during)) == sorted(on_main), during
    host = ["head"] + ["embed", "layer.0"][resident + gpu_updated:] + ["layer.1", "layer.2"]
    assert [u for u in order if u not in on_main] == host, order
    assert all(torch.equal(free[k], late[k]) for k in free)


@pytest.mark.parametrize("mode,clip,resident,gpu_updated", [("fast", 1.0, 0, 2), ("lean", 0.0, 1, 1),
                                                             ("lean", 1.0, 99, 0)])
def test_the_engine_in_bf16_through_the_doubles_computes_what_the_cpu_engine_computes(monkeypatch, mode, clip,
                                                                                      resident, gpu_updated):
    """train.py's default on a GPU -- bf16 -- configured for CUDA and run through the doubles (every operand's
    device checked; autocast on "cuda" is the CPU's over the stand-ins): fast streams the shadow, lean casts the
    fp32 master on the GPU, GPU-updated units cast their shadow there, resident units never leave, the guard's
    verdict for them is a flag on the GPU. It computes the CPU engine's very losses and weights, bit for bit (the
    same ops on the same values)."""
    cfg = model.GPTConfig(vocab_size=64, n_layer=3, n_head=2, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=16)
    w0 = model.init_weights(cfg, 0)
    kw = dict(dtype=torch.bfloat16, mode=mode, grad_clip=clip, micro_batches=2, grad_slabs=3, lr=1e-2,
              resident_units=resident, gpu_updated_units=gpu_updated, offload_activations=True,
              skip_nonfinite=True)   # the guard: its verdict for a GPU-side unit a flag on the GPU (found_inf)
    runs = []
    for device in ("cpu", "cuda"):
        gen = torch.Generator().manual_seed(0)
        with monkeypatch.context() as m:
            placing = cuda_doubles.install(m).placing() if device == "cuda" else contextlib.nullcontext()
            with placing:
                t = engine(cfg, w0, device=torch.device(device), **kw)
                losses = [t.step(*random_batch(cfg, 4, 16, gen)) for _ in range(3)]
                runs.append((losses, t.weights()))
                del t                                   # its pages unregistered while the doubles stand
                gc.collect()
    (cpu_losses, cpu_w), (gpu_losses, gpu_w) = runs
    assert gpu_losses == cpu_losses and all(torch.isfinite(torch.tensor(cpu_losses)))
    assert all(torch.equal(cpu_w[k], gpu_w[k]) for k in cpu_w)
