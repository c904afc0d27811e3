"""resident.py -- units resident on the GPU: their whole state there, updated there, never crossing.

What it is
    Resident is the home (stream.Streamed's questions, other answers) of a unit kept on the GPU: its
    fp32 master, the rule's state, its gradient and its step count live in device memory (16 B/param
    with AdamW), made on the compute lane (Trainer.zeros). Each visit copies the master into a
    weight slot on the H2D lane, cast on the way (a device-to-device copy: nothing crosses PCIe);
    its gradient is copied from the grad slot into its own buffer on the D2H lane; its update is
    torch's fused CUDA kernel, issued by the main thread on the H2D lane the moment its gradient is
    there (run_on_h2d: the lane that copies it next, so the copy follows the update in stream
    order). The units the next forward needs first are the ones kept (megatrain_min.engine.homes),
    so its first copies wait for no host update at all. The non-finite guard's verdict on such a
    unit is taken on the device (Guard.found_inf): the fused kernel skips the update by itself, and
    nothing waits for the host.
The resident embedding
    Its rows are gathered on the GPU from the resident table (the token ids cross, not the rows);
    dy stays on the GPU, and its scatter into the gradient is an index_put_ with accumulate: on the
    CPU serial in token order, on CUDA a stable sort of the ids and one pass over each row's
    tokens in that order -- the host's index_add_ order, deterministic, O(B*T*d) memory (a dense
    embedding backward would make a (V, d) gradient per step; tests/engine/test_gpu.py checks it).
What it is not
    Not sharded (one process holds whole units) and not a second arithmetic: the same rule, on the
    device (on the CPU, host memory: the host-updated engine's results).
"""
from concurrent.futures import Future

import torch


def run_on_h2d(t, fn, args, ready):
    """fn(*args) issued now by the main thread on trainer t's H2D lane, after event `ready`: its
    kernels queue behind the copies in flight, before the unit's next copy. A finished Future."""
    fut = Future()
    with t.h2d():
        t.h2d.wait_event(ready)
        fut.set_result(fn(*args))
    return fut


class Resident:
    # the whole unit (no shadow: its master is cast on the GPU)
    kept_on_device = ("master", "state", "grad", "step")
    crossing = ()

    def __init__(self, trainer):
        self.t = trainer

    def source(self, u):
        return self.t.opt.master[u]     # on the GPU: the slot's copy is device to device

    def source_ready(self, u):
        return None                     # its update came before on this very lane

    def run(self, u, fn, *args, ready=None):
        return run_on_h2d(self.t, fn, args, ready)

    def update(self, u, lr, coef=1.0, guard=None):
        """The rule on the device; the guard's verdict taken there, no host sync."""
        t = self.t
        found_inf = None if guard is None else guard.found_inf(t.opt.grad[u], t.units[u].name)
        t.opt.step(u, lr, coef, found_inf=found_inf)

    # the embedding, resident: its rows gathered and its gradient scattered on the GPU
    def tokens(self, tokens):
        """The step's token ids (B, T) on the device, through a pinned buffer."""
        t = self.t
        return t.upload(t.host_buffer("tokens", tokens.shape, torch.int64).copy_(tokens))

    def rows(self, b):
        """x, M x (B/M, T, d): rows of the resident table, on compute in the residual dtype."""
        t = self.t
        t.comp.wait_event(t.h2d.record())   # after the table's update, issued on H2D
        x = t.table(t.opt.master[t.embed])[b.tokens]                       # (B, T, d) fp32
        return list(x.to(t.residual_dtype).chunk(t.M))

    def dy_out(self, dy):
        """dy stays on the device, (B, T, d): (it, an event after compute and the head's gradient
        copy on D2H -- the tied head's gradient is there before the scatter adds to it)."""
        t = self.t
        dy = torch.cat(dy)
        t.h2d.uses(dy)                  # the scatter reads it on H2D
        with t.d2h():
            t.d2h.wait_event(t.comp.record())
            return dy, t.d2h.record()

    def add_dy(self, tokens, dy):
        """On H2D: add dy into the rows of the gradient the tokens used, in token order."""
        t = self.t
        grad = t.table(t.opt.grad[t.embed])
        if t.embed != t.head:
            grad.zero_()                # untied: the scatter is the whole embedding gradient
        grad.index_put_((tokens.reshape(-1),), dy.reshape(-1, grad.shape[1]).float(),
                        accumulate=True)
