"""Test doubles of the CUDA calls the engine makes, for a machine without a GPU. Each double checks its arguments
as the real call does -- with torch's own validation (torch.cuda._utils._get_device_index) where the real call uses
it -- and fails the way the real call fails; a double that accepted what the real call refuses would hide the bug
it is there to catch (torch.cuda.set_device(torch.device("cuda")) raised on every real GPU while a double that
only recorded its argument passed).

    gpu = install(monkeypatch, devices=2)   # torch.cuda.* replaced; tensors asked for on "cuda:N" made on the CPU
    with gpu.placing():                      # ... while this mode is on (factory calls and .to(device))
        t = stream.Trainer(cfg, weights, device=torch.device("cuda"), dtype=torch.float32)

What each double refuses (as the real one): set_device of a device without an index, or an ordinal >= the device
count; a Stream / synchronize / mem_get_info of a device that does not exist; wait_event of something that is not
an event; record_stream with something that is not a stream; cudaHostRegister of a range that overlaps a registered
one (cudaErrorHostMemoryAlreadyRegistered, 712), of 0 bytes or with unknown flags (cudaErrorInvalidValue, 1), with
arguments that are not unsigned integers (TypeError, as pybind11); cudaHostUnregister of an address that is not the
start of a registration (cudaErrorHostMemoryNotRegistered, 713). Current device and stream are per thread.
"""
import contextlib
import mmap
import threading

import torch
from torch.cuda._utils import _get_device_index
from torch.overrides import TorchFunctionMode

INVALID_VALUE, ALREADY_REGISTERED, NOT_REGISTERED = 1, 712, 713
HOST_REGISTER_FLAGS = 0b1111      # Default 0, Portable 1, Mapped 2, IoMemory 4, ReadOnly 8


class Cudart:
    """torch.cuda.cudart(): cudaHostRegister / cudaHostUnregister over page ranges. registered: ptr -> bytes."""

    def __init__(self):
        self.registered, self.calls = {}, []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        for name, v in (("ptr", ptr), ("size", size), ("flags", flags)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise TypeError(f"cudaHostRegister(): incompatible function arguments: {name}={v!r}")
        self.calls.append(("register", ptr, size))
        if size == 0 or flags & ~HOST_REGISTER_FLAGS:
            return INVALID_VALUE
        lo, hi = pages(ptr, size)
        if any(lo < pages(p, n)[1] and pages(p, n)[0] < hi for p, n in self.registered.items()):
            return ALREADY_REGISTERED
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        if not isinstance(ptr, int) or ptr < 0:
            raise TypeError(f"cudaHostUnregister(): incompatible function arguments: ptr={ptr!r}")
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else NOT_REGISTERED

    def live_bytes(self):
        return sum(self.registered.values())


def pages(ptr, size):
    """[first page, end of the last page) that CUDA pins for `size` bytes at `ptr`."""
    P = mmap.PAGESIZE
    return ptr // P * P, -(-(ptr + size) // P) * P


class Event:
    def __init__(self, stream):
        self.stream = stream

    def synchronize(self):
        pass

    def query(self):
        return True


class GPU:
    """The doubles of one fake machine of `devices` GPUs; who asked for what is kept for the tests to read."""

    def __init__(self, devices):
        self.devices, self.cudart, self.local = devices, Cudart(), threading.local()
        self.set_device_calls, self.streams = [], []   # (thread name, index); every Stream made
        self.torch_pinned = []                           # bytes of each pin_memory=True allocation
        gpu = self

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device = torch.device("cuda", gpu.index(device, optional=True))
                gpu.streams.append(self)

            def record_event(self, event=None):
                return Event(self)

            def wait_event(self, event):
                if not isinstance(event, Event):
                    raise TypeError(f"wait_event(): expected a torch.cuda.Event, got {type(event).__name__}")

            def synchronize(self):
                pass
        self.Stream = Stream

    # ---- devices
    def index(self, device, optional=False):
        """The real validation (torch's own), then the ordinal checked against this machine."""
        idx = _get_device_index(device, optional=optional)
        if not 0 <= idx < self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({idx} of {self.devices} devices)")
        return idx

    def current_device(self):
        return getattr(self.local, "device", 0)

    def set_device(self, device):
        idx = _get_device_index(device)            # raises for torch.device("cuda"): no index
        if idx >= 0:                               # negative: a no-op, as torch.cuda.set_device
            self.index(idx)
            self.local.device = idx
        self.set_device_calls.append((threading.current_thread().name, idx))

    def name(self, device=None):
        return f"Fake GPU {self.index(device, optional=True)}"

    def synchronize(self, device=None):
        self.index(device, optional=True)

    def mem_get_info(self, device=None):
        self.index(self.current_device() if device is None else device, optional=True)
        return 80 * 2**30, 80 * 2**30

    @contextlib.contextmanager
    def stream(self, s):
        if s is not None and not isinstance(s, self.Stream):
            raise TypeError(f"torch.cuda.stream(): expected a torch.cuda.Stream, got {type(s).__name__}")
        outer, self.local.stream = getattr(self.local, "stream", None), s
        try:
            yield s
        finally:
            self.local.stream = outer

    def record_stream(self, tensor, s):
        if not isinstance(s, self.Stream):
            raise TypeError(f"record_stream(): argument 'stream' must be Stream, not {type(s).__name__}")

    # ---- where device tensors go
    def placing(self):
        """A mode under which a tensor asked for on cuda:N (N validated; no index: the current device) is made on
        the CPU: factory functions' device= and Tensor.to's device; pin_memory=True and Tensor.pin_memory (torch's
        pinned allocator) give ordinary memory and note its size in torch_pinned."""
        gpu = self

        class OnCPU(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = {k: gpu.place(v) if k == "device" else v for k, v in (kwargs or {}).items()}
                if func in (torch.Tensor.to,):
                    args = tuple(gpu.place(a) if isinstance(a, (str, torch.device)) else a for a in args)
                pinned = kwargs.pop("pin_memory", False) or func is torch.Tensor.pin_memory
                out = func(*args, **kwargs) if func is not torch.Tensor.pin_memory else args[0].clone()
                if pinned:                       # torch's pinned allocator: works, noted with its rounding
                    gpu.torch_pinned.append(out.nbytes)
                return out
        return OnCPU()

    def place(self, device):
        if device is None or isinstance(device, int):
            return device
        dev = torch.device(device)
        if dev.type != "cuda":
            return device
        self.index(dev, optional=True)
        return torch.device("cpu")


def install(monkeypatch, devices=1):
    """Replace the torch.cuda calls the engine makes with doubles of a `devices`-GPU machine: a GPU object."""
    import stream                                  # the engine keeps one stream per (device, lane) per process
    gpu = GPU(devices)
    for name, fn in (("is_available", lambda: True), ("device_count", lambda: devices),
                     ("current_device", gpu.current_device), ("set_device", gpu.set_device),
                     ("synchronize", gpu.synchronize), ("mem_get_info", gpu.mem_get_info), ("stream", gpu.stream),
                     ("Stream", gpu.Stream), ("cudart", lambda: gpu.cudart), ("get_device_name", gpu.name)):
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, s: gpu.record_stream(tensor, s))
    monkeypatch.setattr(stream.Lane, "streams", {}, raising=False)   # (an engine without it: made anew)
    return gpu
