"""pinned.py -- page-locked host memory of exactly the size asked for.

What it is
    page_locked(n, dtype): n zeros on pages of their own, registered with CUDA (cudaHostRegister)
    for exactly their size rounded up to a page, and unregistered just before numpy frees them.
    torch's pinned allocator (torch.zeros(..., pin_memory=True), the core's default:
    optim.pinned_zeros) rounds each block up to a power of two: a 7b store would page-lock 1.31x its
    size, and at 100B on 1.5 TB of host memory that does not fit. checks.CheckedTrainer and
    sharded.ShardedTrainer hand it to their lanes (stream.Lanes(pinned=)): the plan's pinned figure
    (plan/memory.py) is this one. cuda_last_error() clears the error a failed registration leaves,
    so the next kernel launch on the thread is not blamed for it.
What it is not
    Not an allocator with a cache: each buffer is registered once and lives as long as its tensor.
Try it
    python -m pytest tests/engine/test_pinned.py
"""
import ctypes
import mmap
import warnings
import weakref

import numpy as np
import torch


def page_locked(n, dtype=torch.float32):
    """n zeros of dtype page-locked with CUDA (DMA copies), its own pages cudaHostRegister'ed: its
    size, where pin_memory=True rounds each block up to a power of two (a 7b store: 1.31x)."""
    size = max(1, -(-n * dtype.itemsize // mmap.PAGESIZE)) * mmap.PAGESIZE
    # numpy owns the memory and frees it; mem: its page-aligned part, no page shared with another
    raw = np.zeros(size + mmap.PAGESIZE, dtype=np.uint8)
    mem = raw[-raw.ctypes.data % mmap.PAGESIZE:][:size]
    err = int(torch.cuda.cudart().cudaHostRegister(mem.ctypes.data, size, 0))
    if err:
        cuda_last_error()   # cleared: the next kernel launch on this thread is not blamed for it
        raise MemoryError(f"CUDA could not page-lock {size / 1e9:.2f} GB of host memory (cudaError"
                          f" {err}); free host memory, raise `ulimit -l`, or plan a smaller run")
    # numpy runs the finalizers before it frees the memory: unregistered first
    weakref.finalize(raw, unregister, mem.ctypes.data).atexit = False
    return torch.from_numpy(mem).view(dtype)[:n]


def unregister(ptr):
    """cudaHostUnregister of page_locked's pages (a finalizer: a failure is warned, not raised)."""
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err:
        cuda_last_error()
        warnings.warn(f"cudaHostUnregister failed (cudaError {err}); the pages stay locked")


def cuda_last_error():
    """CUDA's cudaGetLastError(): the error this thread's last failed runtime call left, cleared.
    torch's binding of the runtime (torch.cuda.cudart) has none in torch 2.11-2.13: the runtime
    torch loaded is asked by its soname (0: it could not be found)."""
    runtime = torch.cuda.cudart()
    if not hasattr(runtime, "cudaGetLastError"):
        major = (torch.version.cuda or "").split(".")[0]   # the CUDA torch was built for
        try:
            runtime = ctypes.CDLL(f"libcudart.so.{major}")
        except OSError:
            return 0
    return int(runtime.cudaGetLastError())
