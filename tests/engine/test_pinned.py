"""megatrain_min/engine/pinned.py: page-locked host memory of exactly the size asked for, as the engine that
train.py builds uses it; the core's default is torch's pinned allocator."""
import gc
import mmap

import pytest
import torch

import cuda_doubles
import model
import optim
import stream
from conftest import engine
from megatrain_min.engine import pinned
from megatrain_min.engine.sharded import ShardedLanes


def test_page_locked_is_exact_and_unregistered_when_freed(monkeypatch):
    """page_locked: n zeros on pages of their own, registered with CUDA (cudaHostRegister) for exactly their
    size rounded up to a page -- not torch's power-of-two pinned blocks -- and unregistered just before they are
    freed. CUDA's runtime is the double of tests/cuda_doubles.py, which refuses overlapping registrations and
    unregistering what is not registered, as CUDA does; a refusal is a one-line MemoryError."""
    gpu = cuda_doubles.install(monkeypatch)
    P = mmap.PAGESIZE
    a, b = pinned.page_locked(3 * P // 4 + 1, torch.float32), pinned.page_locked(10, torch.bfloat16)
    assert a.shape == (3 * P // 4 + 1,) and a.dtype == torch.float32 and b.shape == (10,) and b.dtype == torch.bfloat16
    assert not a.any() and not b.any()                                   # zeros
    assert sorted(gpu.cudart.registered.items()) == sorted([(a.data_ptr(), 4 * P), (b.data_ptr(), P)])
    assert a.data_ptr() % P == 0 and b.data_ptr() % P == 0             # page-aligned: no page shared
    big = pinned.page_locked(5 * 2**20 + 3)                               # 20 MB: not rounded up to 32 MB
    assert gpu.cudart.registered[big.data_ptr()] == -(-(5 * 2**20 + 3) * 4 // P) * P
    view = a[5:]                                                         # a view keeps the pages registered
    del a
    gc.collect()
    assert len(gpu.cudart.registered) == 3
    del view, b, big
    gc.collect()
    assert gpu.cudart.registered == {} and ("unregister" in {c[0] for c in gpu.cudart.calls})
    monkeypatch.setattr(gpu.cudart, "cudaHostRegister", lambda ptr, size, flags: 2)   # cudaErrorMemoryAllocation
    with pytest.raises(MemoryError, match=r"could not page-lock 0.00 GB of host memory \(cudaError 2\)"):
        pinned.page_locked(100)


def test_a_failed_page_lock_leaves_no_error_for_the_next_kernel(monkeypatch):
    """A cudaHostRegister that fails leaves its error as the thread's last error (CUDA's runtime), which the next
    kernel launch on the thread would raise as its own (C10_CUDA_KERNEL_LAUNCH_CHECK): page_locked clears it
    (cudaGetLastError, libcudart's own: torch binds none) before its one-line MemoryError. A cudaHostUnregister
    that fails is warned and cleared too."""
    gpu = cuda_doubles.install(monkeypatch)
    real = gpu.cudart.cudaHostRegister
    monkeypatch.setattr(gpu.cudart, "cudaHostRegister", lambda ptr, size, flags: gpu.cudart.failed(2))   # OOM
    with pytest.raises(MemoryError, match="cudaError 2"):
        pinned.page_locked(100)
    monkeypatch.setattr(gpu.cudart, "cudaHostRegister", real)
    with gpu.placing():
        p, g, m, v = (torch.zeros(8, device="cuda") for _ in range(4))
        step = torch.zeros((), device="cuda")
        optim.AdamW().update(p, g, {"m": m, "v": v}, step + 1, lr=1e-3, weight_decay=0.0)   # no stale error
    with pytest.warns(UserWarning, match="cudaHostUnregister failed"):
        pinned.unregister(12345)                                  # never registered: cudaError 713
    assert gpu.cudart.runtime.cudaGetLastError() == 0            # cleared there too


def test_the_engine_train_py_builds_page_locks_exactly_and_the_core_alone_through_torch(monkeypatch):
    """checks.CheckedTrainer and sharded.ShardedLanes hand pinned.page_locked to their lanes (the plan's pinned
    figure is its); stream.Lanes alone pins with torch's allocator (optim.pinned_zeros); on a CPU nothing is
    pinned. (tests/core/test_stream.py builds and steps a CUDA CheckedTrainer through the doubles: every page-
    locked byte registered exactly, none from torch.)"""
    cfg = model.PRESETS["toy"]
    assert stream.Lanes(torch.device("cpu")).pinned is None
    gpu = cuda_doubles.install(monkeypatch)
    assert stream.Lanes(torch.device("cuda")).pinned is optim.pinned_zeros
    with gpu.placing():
        assert not optim.pinned_zeros(10).any() and gpu.torch_pinned == [40]   # torch's pinned allocator
    assert ShardedLanes(torch.device("cuda")).pinned is pinned.page_locked
    built = {}
    monkeypatch.setattr(stream.Trainer, "__init__", lambda self, *a, lanes=None, **k: built.update(lanes=lanes))
    engine(cfg, model.init_weights(cfg, 0), device=torch.device("cuda"))
    assert built["lanes"].pinned is pinned.page_locked
