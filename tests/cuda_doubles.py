"""Test doubles of the CUDA calls the engine makes, for a machine without a GPU. Each double checks its arguments
as the real call does -- with torch's own validation (torch.cuda._utils._get_device_index) where the real call uses
it -- and fails the way the real call fails; a double that accepted what the real call refuses would hide the bug
it is there to catch (torch.cuda.set_device(torch.device("cuda")) raised on every real GPU while a double that
only recorded its argument passed).

    gpu = install(monkeypatch, devices=2)   # torch.cuda.* replaced; tensors asked for on "cuda:N" made on the CPU
    with gpu.placing():                      # ... while this mode is on (factory calls, .to(device), .cuda())
        t = stream.Trainer(cfg, weights, device=torch.device("cuda"), dtype=torch.float32)
    with gpu.hold():                         # events recorded now stay pending (query() False) until released
        ...; gpu.release(event)

Where a tensor is. A tensor asked for on cuda:N while placing() is on is made on the CPU and its storage noted as
cuda:N (gpu.device_of); the mode makes it say so -- .device, .is_cuda, .get_device(), .is_pinned() -- as the real
one would, so code that makes a tensor "on p.device" makes it on the GPU too. A tensor an op makes from GPU tensors
is on their GPU (a view or an in-place result keeps its own storage's place); .cpu() / .to("cpu") of one is a copy
on the host. The mode is per thread, as torch's function modes are: on another thread a GPU tensor says "cpu", but
the checks below read the noted place, on every thread.

What each double refuses (as torch 2.11 with CUDA does; the source read is named):
- set_device of a device without an index, or an ordinal >= the device count; a Stream / synchronize /
  mem_get_info of a device that does not exist (torch.cuda._utils, the runtime's invalid device ordinal);
- wait_event of something that is not an event; record_stream with something that is not a stream, or of a
  tensor that is not on a GPU (record_stream has a CUDA kernel alone, native_functions.yaml: "Could not run
  'aten::record_stream' with arguments from the 'CPU' backend");
- an event recorded on a stream of another device than its first record's (CUDAEvent.h: "Event device 0 does
  not match recording stream's device 1.");
- torch._fused_adamw_ (optim.HostStore.step) with operands on two devices: on a GPU, the generated CUDA wrapper
  checks every positional tensor (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps: a step
  count on the CPU included) against the first one's device (torchgen's gen_device_check over
  flat_positional; c10/core/impl adaption.cpp's "Expected all tensors to be on the same device, but got ...");
  grad_scale and found_inf are keyword-only, so that check skips them, and FusedAdamWKernel.cu's float-lr
  overload does not check them either: its kernel reads them at their address on the device -- a host
  address there is an illegal memory access, a sticky error every later CUDA call raises. The double refuses
  both at the call. On the host, GPU operands would be read by the CPU kernel at device addresses (a crash);
  a GPU step count is read with .item() there (a sync, accepted);
- torch.dot (optim.HostStore.grad_sq) of tensors on two devices: the generated wrapper's check (dot is no
  TensorIterator op: a CPU scalar is no exception);
- cudaHostRegister of a range that overlaps a registered one (cudaErrorHostMemoryAlreadyRegistered, 712), of 0
  bytes or with unknown flags (cudaErrorInvalidValue, 1), with arguments that are not unsigned integers
  (TypeError, as pybind11); cudaHostUnregister of an address that is not the start of a registration
  (cudaErrorHostMemoryNotRegistered, 713). Each failure stays the thread's last error (Cudart: a later kernel
  launch raises it) until cudaGetLastError, which torch does not bind: libcudart's own, through ctypes.
Current device and stream are per thread. mem_get_info and get_device_name answer what the test sets (install's
memory= and name=: H200 below is what an H200 reports); is_bf16_supported is True (Ampere and later), and autocast
on "cuda" is the CPU's over the stand-ins, so the engine's bf16 path runs through the doubles too.
"""
import contextlib
import ctypes
import mmap
import threading
import weakref

import torch
from torch.cuda._utils import _get_device_index
from torch.overrides import TorchFunctionMode

INVALID_VALUE, ALREADY_REGISTERED, NOT_REGISTERED = 1, 712, 713
HOST_REGISTER_FLAGS = 0b1111      # Default 0, Portable 1, Mapped 2, IoMemory 4, ReadOnly 8
GiB = 2**30
MEMORY = (80 * GiB, 80 * GiB)     # mem_get_info's (free, total) unless a test sets it
H200 = dict(name="NVIDIA H200", memory=(139 * GiB, 143771 * 2**20))   # the measured H200: 143,771 MiB in all
HELD_S = 30                       # how long a synchronize waits for a held event before it reports a hang
REAL_FUSED_ADAMW, REAL_DOT, REAL_AUTOCAST = torch._fused_adamw_, torch.dot, torch.autocast


class Cudart:
    """torch.cuda.cudart(): cudaHostRegister / cudaHostUnregister over page ranges. registered: ptr -> bytes.
    As CUDA's runtime, a call that fails also leaves its error as this thread's last error, until
    cudaGetLastError -- which torch's binding lacks: the runtime library's own (runtime below, what
    ctypes.CDLL("libcudart.so.N") gives) -- returns and clears it; a kernel launch checks it
    (C10_CUDA_KERNEL_LAUNCH_CHECK) and raises a stale error as its own."""

    def __init__(self):
        self.registered, self.calls = {}, []
        self.errors = threading.local()             # .last: this thread's last error
        self.runtime = Runtime(self)

    def failed(self, err):
        if err:
            self.errors.last = err
        return err

    def launch_check(self, kernel):
        err = self.runtime.cudaGetLastError()
        if err:
            raise RuntimeError(f"CUDA error: cudaError {err} (reported by the launch of {kernel}; an earlier call "
                               "left it: it is sticky until cudaGetLastError)")

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        for name, v in (("ptr", ptr), ("size", size), ("flags", flags)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise TypeError(f"cudaHostRegister(): incompatible function arguments: {name}={v!r}")
        self.calls.append(("register", ptr, size))
        if size == 0 or flags & ~HOST_REGISTER_FLAGS:
            return self.failed(INVALID_VALUE)
        lo, hi = pages(ptr, size)
        if any(lo < pages(p, n)[1] and pages(p, n)[0] < hi for p, n in self.registered.items()):
            return self.failed(ALREADY_REGISTERED)
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        if not isinstance(ptr, int) or ptr < 0:
            raise TypeError(f"cudaHostUnregister(): incompatible function arguments: ptr={ptr!r}")
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else self.failed(NOT_REGISTERED)

    def live_bytes(self):
        return sum(self.registered.values())


class Runtime:
    """libcudart itself, as ctypes loads it: cudaGetLastError (the rest of its API is not asked for)."""

    def __init__(self, cudart):
        self.cudart = cudart

    def cudaGetLastError(self):  # noqa: N802 (CUDA's name)
        err = getattr(self.cudart.errors, "last", 0)
        self.cudart.errors.last = 0
        return err


def pages(ptr, size):
    """[first page, end of the last page) that CUDA pins for `size` bytes at `ptr`."""
    P = mmap.PAGESIZE
    return ptr // P * P, -(-(ptr + size) // P) * P


class Event:
    """torch.cuda.Event: on the device of the stream it was first recorded on. Done (query() True, synchronize()
    returns) as soon as it is recorded -- the doubles run every op at once -- unless the GPU holds the events
    recorded now (GPU.hold): then not until the test releases it. Never recorded: done (cudaEventQuery)."""

    def __init__(self, gpu, enable_timing=False, blocking=False, interprocess=False):
        self.gpu, self.device, self.stream, self.done = gpu, None, None, threading.Event()
        self.done.set()

    def record(self, stream=None):
        stream = stream if stream is not None else self.gpu.current_stream()
        if self.device is not None and self.device != stream.device:
            raise RuntimeError(f"Event device {self.device.index} does not match recording stream's device "
                               f"{stream.device.index}.")
        self.device, self.stream, self.done = stream.device, stream, threading.Event()
        self.gpu.recorded(self)

    def query(self):
        return self.done.is_set()

    def synchronize(self):
        if not self.done.wait(timeout=HELD_S):
            raise RuntimeError(f"an event held by the test was never released (waited {HELD_S} s)")

    def wait(self, stream=None):
        (stream if stream is not None else self.gpu.current_stream()).wait_event(self)


class GPU:
    """The doubles of one fake machine of `devices` GPUs; who asked for what is kept for the tests to read."""

    def __init__(self, devices, memory=MEMORY, name=None):
        self.devices, self.cudart, self.local = devices, Cudart(), threading.local()
        self.memory = {i: memory for i in range(devices)}   # (free, total) bytes: mem_get_info
        self.device_name = name
        self.set_device_calls, self.streams = [], []   # (thread name, index); every Stream made
        self.torch_pinned = []                           # bytes of each pin_memory=True allocation
        self.placed = weakref.WeakKeyDictionary()        # storage -> the index of the GPU it is on
        self.held, self.holding = [], []                 # events held, not yet released; hold()s' streams
        self.default_streams = {}
        gpu = self

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device = torch.device("cuda", gpu.index(device, optional=True))
                gpu.streams.append(self)

            def record_event(self, event=None):
                event = event if event is not None else gpu.Event()
                event.record(self)
                return event

            def wait_event(self, event):
                if not isinstance(event, Event):
                    raise TypeError(f"wait_event(): expected a torch.cuda.Event, got {type(event).__name__}")

            def query(self):
                return all(e.query() for e in gpu.held if e.stream is self)

            def synchronize(self):
                for e in [e for e in gpu.held if e.stream is self]:
                    e.synchronize()
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
        idx = self.index(device, optional=True)
        return self.device_name or f"Fake GPU {idx}"

    def synchronize(self, device=None):
        idx = self.index(device, optional=True)
        for e in [e for e in self.held if e.device.index == idx]:
            e.synchronize()

    def mem_get_info(self, device=None):
        return self.memory[self.index(self.current_device() if device is None else device, optional=True)]

    def set_memory(self, free, total, device=None):
        """What mem_get_info answers for `device` (None: every device) from now on."""
        for i in range(self.devices) if device is None else [self.index(device)]:
            self.memory[i] = (free, total)

    # ---- streams and events
    @contextlib.contextmanager
    def stream(self, s):
        if s is not None and not isinstance(s, self.Stream):
            raise TypeError(f"torch.cuda.stream(): expected a torch.cuda.Stream, got {type(s).__name__}")
        outer, self.local.stream = getattr(self.local, "stream", None), s
        try:
            yield s
        finally:
            self.local.stream = outer

    def current_stream(self, device=None):
        s = getattr(self.local, "stream", None)
        idx = self.index(self.current_device() if device is None else device, optional=True)
        if s is not None and s.device.index == idx:
            return s
        if idx not in self.default_streams:
            self.default_streams[idx] = self.Stream(idx)
        return self.default_streams[idx]

    def Event(self, enable_timing=False, blocking=False, interprocess=False):  # noqa: N802 (torch's name)
        return Event(self, enable_timing, blocking, interprocess)

    def recorded(self, event):
        if any(not streams or event.stream in streams for streams in self.holding):
            self.held.append(event)
        else:
            event.done.set()

    @contextlib.contextmanager
    def hold(self, *streams):
        """Events recorded inside (on `streams`; none given: on any) stay pending -- query() False,
        synchronize() blocks -- until released (release(event), release()); the ones still held are released
        on the way out."""
        self.holding.append(set(streams))
        try:
            yield self
        finally:
            self.holding.pop()
            if not self.holding:
                self.release()

    def release(self, *events):
        """The work before `events` (none given: every held one) has run."""
        for e in events or list(self.held):
            self.held.remove(e)
            e.done.set()

    # ---- where tensors are
    def device_of(self, t):
        """The device tensor t is on: cuda:N for one made there while placing() was on, else its own."""
        idx = self.placed.get(t.untyped_storage())
        return t.device if idx is None else torch.device("cuda", idx)

    def put(self, t, idx):
        self.placed[t.untyped_storage()] = idx
        return t

    def record_stream(self, tensor, s):
        if not isinstance(s, self.Stream):
            raise TypeError(f"record_stream(): argument 'stream' must be Stream, not {type(s).__name__}")
        if self.device_of(tensor).type != "cuda":
            raise NotImplementedError(f"Could not run 'aten::record_stream' with arguments from the "
                                      f"'{self.device_of(tensor).type.upper()}' backend.")

    def fused_adamw(self, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1,
                    beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        """torch._fused_adamw_, its operands' devices checked as torch 2.11 checks (or fails on) them."""
        lists = (("self", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                 ("max_exp_avg_sqs", max_exp_avg_sqs), ("state_steps", state_steps))
        on = self.device_of(params[0])
        if on.type == "cuda":
            for arg, ts in lists:               # the generated wrapper: every positional tensor
                for t in ts:
                    self.same_device(on, t, arg, "wrapper_CUDA___fused_adamw_")
        else:
            for arg, ts in lists[1:-1]:         # the CPU kernel reads them at their addresses on the host
                for t in ts:
                    if self.device_of(t) != on:
                        raise RuntimeError(f"_fused_adamw_: {arg} on {self.device_of(t)} beside params on {on}:"
                                           f" the CPU kernel would read device memory on the host")
        for arg, t in (("grad_scale", grad_scale), ("found_inf", found_inf)) + \
                ((("lr", lr),) if isinstance(lr, torch.Tensor) and self.device_of(lr).type == "cuda" else ()):
            if t is not None and self.device_of(t) != on:
                raise RuntimeError(f"_fused_adamw_: {arg} on {self.device_of(t)} beside params on {on}: the "
                                   f"kernel reads it at its address on {on.type} (keyword-only, it escapes the "
                                   "device check) -- an illegal memory access on a GPU, a crash on the host")
        if on.type == "cuda":
            self.cudart.launch_check("the fused AdamW kernel")
        return REAL_FUSED_ADAMW(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
                                maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)

    def dot(self, input, tensor, *, out=None):   # noqa: A002 (torch's names)
        on = self.device_of(input)
        if on.type == "cuda" or self.device_of(tensor).type == "cuda":
            self.same_device(on, tensor, "tensor", "wrapper_CUDA__dot")
        return REAL_DOT(input, tensor) if out is None else REAL_DOT(input, tensor, out=out)

    def same_device(self, common, t, arg, method):
        """c10::impl::check_and_update_common_device (the generated wrappers' device check)."""
        if self.device_of(t) != common:
            raise RuntimeError(f"Expected all tensors to be on the same device, but got {arg} is on "
                               f"{self.device_of(t)}, different from other tensors on {common} (when checking "
                               f"argument in method {method})")

    def placing(self):
        """A mode under which a tensor asked for on cuda:N (N validated; no index: the current device) is made on
        the CPU and noted as on cuda:N (the module docstring says what follows); pin_memory=True and
        Tensor.pin_memory (torch's pinned allocator) give ordinary memory and note its size in torch_pinned."""
        return Placing(self)

    def place(self, device):
        """(the device to make a tensor on, the index of the GPU it stands for or None)."""
        if device is None:
            return None, None
        if isinstance(device, int):
            return torch.device("cpu"), self.index(device)
        dev = torch.device(device)
        if dev.type != "cuda":
            return device, None
        return torch.device("cpu"), self.index(dev, optional=True)


DEVICE, IS_CUDA = torch._C.TensorBase.device, torch._C.TensorBase.is_cuda   # the properties' descriptors


class Placing(TorchFunctionMode):
    """GPU.placing()'s mode (this thread only, as torch's function modes)."""

    def __init__(self, gpu):
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        gpu, kwargs = self.gpu, dict(kwargs or {})
        prop = getattr(func, "__self__", None)
        if prop is DEVICE or prop is IS_CUDA or func in (torch.Tensor.get_device, torch.Tensor.is_pinned):
            on = gpu.device_of(args[0])
            if on.type == "cuda":
                return {DEVICE: on, IS_CUDA: True}.get(prop, on.index if func is torch.Tensor.get_device
                                                       else False)
            return func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self.move(func, args, kwargs)
        if func is torch.Tensor.pin_memory:                  # torch's pinned allocator: ordinary memory, noted
            out = args[0].clone()
            gpu.torch_pinned.append(out.nbytes)
            return out
        target = None
        if "device" in kwargs:
            kwargs["device"], target = gpu.place(kwargs["device"])
        pinned = kwargs.pop("pin_memory", False)
        out = func(*args, **kwargs)
        if pinned:
            gpu.torch_pinned.append(out.nbytes)
        inputs = tensors_in(args) + tensors_in(list(kwargs.values()))
        if "device" not in kwargs:                           # an op's result: where its inputs are
            target = next((gpu.device_of(t).index for t in inputs if gpu.device_of(t).type == "cuda"), None)
        if target is not None:
            given = {id(t.untyped_storage()) for t in inputs}
            for t in tensors_in(out if isinstance(out, (tuple, list)) else [out]):
                if id(t.untyped_storage()) not in given:     # a view or an in-place result keeps its place
                    gpu.put(t, target)
        return out

    def move(self, func, args, kwargs):
        """Tensor.to / .cuda / .cpu: to a GPU, a copy noted there; from one to the host, a copy not noted."""
        gpu, src = self.gpu, args[0]
        if func is torch.Tensor.cuda:
            device = args[1] if len(args) > 1 else kwargs.pop("device", None)
            device = torch.device("cuda", gpu.current_device()) if device is None else device
            args, kwargs = (src,), dict(kwargs, device=device)
            func = torch.Tensor.to
        elif func is torch.Tensor.cpu:
            args, kwargs, func = (src,), dict(kwargs, device="cpu"), torch.Tensor.to
        rest, device = list(args[1:]), kwargs.pop("device", None)
        if rest and isinstance(rest[0], (str, int, torch.device)):
            device = rest.pop(0)
        elif rest and isinstance(rest[0], torch.Tensor):     # .to(other): other's device and dtype
            other = rest.pop(0)
            device, kwargs["dtype"] = gpu.device_of(other), other.dtype
        was = gpu.device_of(src)
        if device is None:                                   # a dtype change: where the input is
            out = func(src, *rest, **kwargs)
            return gpu.put(out, was.index) if was.type == "cuda" and out is not src else out
        host, idx = gpu.place(device)
        now = torch.device("cuda", idx) if idx is not None else torch.device(host)
        if now == was:
            return func(src, *rest, **kwargs)
        out = func(src, *rest, **dict(kwargs, device=host, copy=True))   # a new buffer on the other side
        return gpu.put(out, idx) if idx is not None else out


def tensors_in(xs):
    """The tensors among xs, and in the lists and tuples among them (one level: a TensorList argument)."""
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(y for y in x if isinstance(y, torch.Tensor))
    return out


def autocast(device_type, *args, **kwargs):
    """torch.autocast: on "cuda", the CPU's autocast -- the stand-ins of GPU tensors are CPU tensors (bf16
    matmuls, fp32 accumulation: the dtypes the engine's bf16 path expects, not CUDA's op list to the letter)."""
    return REAL_AUTOCAST("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def install(monkeypatch, devices=1, memory=MEMORY, name=None):
    """Replace the torch.cuda calls the engine makes, and the ops it hands GPU tensors to whose device checks
    matter (torch._fused_adamw_, torch.dot, Tensor.record_stream), with doubles of a `devices`-GPU machine whose
    mem_get_info says `memory` (free, total) and whose name is `name` (H200: an H200's): a GPU object."""
    import stream                                  # the engine keeps one stream per (device, lane) per process
    gpu = GPU(devices, memory, name)
    for attr, fn in (("is_available", lambda: True), ("device_count", lambda: devices),
                     ("current_device", gpu.current_device), ("set_device", gpu.set_device),
                     ("synchronize", gpu.synchronize), ("mem_get_info", gpu.mem_get_info), ("stream", gpu.stream),
                     ("Stream", gpu.Stream), ("Event", gpu.Event), ("current_stream", gpu.current_stream),
                     ("cudart", lambda: gpu.cudart), ("get_device_name", gpu.name),
                     ("is_bf16_supported", lambda including_emulation=True: True)):   # Ampere and later
        monkeypatch.setattr(torch.cuda, attr, fn)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, s: gpu.record_stream(tensor, s))
    monkeypatch.setattr(torch, "_fused_adamw_", gpu.fused_adamw)
    monkeypatch.setattr(torch, "dot", gpu.dot)
    monkeypatch.setattr(torch, "autocast", autocast)
    monkeypatch.setattr(torch.Tensor, "dot", lambda input, tensor: gpu.dot(input, tensor))
    monkeypatch.setattr(stream.Lane, "streams", {}, raising=False)   # (an engine without it: made anew)
    real_cdll = ctypes.CDLL                        # the CUDA runtime library, loaded by its soname

    def cdll(name, *args, **kwargs):
        return gpu.cudart.runtime if str(name).startswith("libcudart.so") else real_cdll(name, *args, **kwargs)
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(torch.version, "cuda", "12.8")    # what a CUDA build of torch says
    return gpu
