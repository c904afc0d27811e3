"""stream.py -- the engine: train a model whose weights live in host memory, one layer at a time.

Trainer keeps every weight and optimizer state in pinned host memory (optim.HostAdamW); the GPU is
a stateless compute engine: two weight slots, two gradient slots, one layer's activations. Three
CUDA streams (lanes) overlap the work, events order it. On the CPU the lanes do nothing.

One step, layer-major (every micro-batch passes through a layer during ONE visit of its weights):
  forward   embedding rows gathered on the host -> x[j] (B/M, T, d), micro-batches j = 0..M-1;
            for layer i: keep x[j] (boundary activations); x[j] = block(x[j], slot), no graph
  head      per micro-batch, per token chunk: norm + lm_head + CE, forward AND backward at once
  backward  for layer i = L-1..0: recompute block(x[j]) with grad, autograd.grad w.r.t. (input,
            weights), fp32 gradient accumulated in a grad slot, then D2H to the host store
  update    a worker thread runs AdamW on the landed units, the one the next forward needs first
            (clipping: all landed, the global norm known); on H2D: resident units, gpu_update's

The lanes for L=3, a column per layer visit (0/1/2 = layers, H = head, ' = backward, (A)/(B) =
weight slot, X>A = copy unit X into slot A, gX = unit X's fp32 gradient to the host):

  compute  |emb|  0 (A)  |  1 (B)  |  2 (A)  | H+H' (B) |  2' (A) |  1' (B) |  0' (A) |
  H2D      |0>A|1>B      |2>A      |H>B      |          |1>B      |0>A      |
  D2H                                                   |gH       |g2       |g1       |g0, dy
  CPU worker                                              AdamW H   AdamW 2   AdamW 1   AdamW 0, E

The next unit's copy runs under the current one's compute; 2' needs no copy (slot A still holds
layer 2). Each ordering rule is an event: slot_loaded[s] (H2D -> compute: never compute on half-
copied weights), slot_free[s] (compute -> H2D: never overwrite weights in use), gslot_free[g]
(D2H -> compute: never zero a grad slot before its copy left), loss_ready (compute -> host); and
host-side hand-offs: an update ends before its unit is copied again (_ready), the worker waits
for a gradient's D2H event, a gradient waits for a free slab (GRAD_SLABS).
bf16 = torch.autocast(bf16) around blocks and head, the residual (x, dy) fp32: the reference's
arithmetic. Handed to the engine: the layer (model, tiling.Tiled), the boundary activations' store
(OnDevice, activations.HostRing), placement (Whole, sharded.Shards), guard.Guard, gpu_update.
"""
import math
from collections import namedtuple
from concurrent.futures import Future
from contextlib import nullcontext

import torch
import torch.nn.functional as F

import model
import optim

GRAD_SLABS = 3   # pinned fp32 slabs for gradients (no clipping): two rotate, a tied head holds one
MICRO_BATCHES, GRAD_CLIP = 1, 0.0   # the engine's defaults (optim.py: the optimizer's): no clipping
Batch = namedtuple("Batch", "tokens targets n_tok rope")   # tokens where the table is; targets: GPU


class Trainer:
    def __init__(self, cfg, weights, device=None, dtype=None, lr=optim.LR, betas=optim.BETAS,
                 eps=optim.EPS, weight_decay=optim.WEIGHT_DECAY, grad_clip=GRAD_CLIP,
                 micro_batches=MICRO_BATCHES, mode="fast", residual_dtype=None, chunk_tokens=None,
                 grad_slabs=GRAD_SLABS, layer=model, activations=None, placement=None, guard=None,
                 lanes=None, resident_units=0, gpu_updates=None):
        """cfg: model.GPTConfig; weights: {key: tensor}, read unit by unit. Unchecked: the checked
        front door is megatrain_min.checks.CheckedTrainer. mode "fast" streams a bf16 shadow, "lean"
        the fp32 master (12 B/param on the host). grad_clip: the updates wait for the global norm.
        resident_units: how many of self.order stay on the GPU (all: resident training)."""
        self.cfg, self.M, self.lr, self.grad_clip = cfg, micro_batches, lr, grad_clip
        self.dev = optim.resolve_device(device)     # cuda:N: the lanes and the worker use it too
        self.lanes = lanes if lanes is not None else Lanes(self.dev)
        self.h2d, self.comp, self.d2h = self.lanes.h2d, self.lanes.comp, self.lanes.d2h
        self.dtype = dtype or model.default_dtype(self.dev.type)
        self.residual_dtype = residual_dtype or torch.float32
        self.defer_updates = bool(grad_clip)        # every update waits for the global norm
        self.chunk = chunk_tokens or model.default_chunk_tokens(cfg)
        self.layer, self.guard, self.grad_norm, self.gpu_updates = layer, guard, None, gpu_updates
        self.activations = activations if activations is not None else OnDevice()
        self.placement = placement if placement is not None else Whole()
        if self.dev.type == "cuda" and self.dtype == torch.float32:   # fp32 is fp32: no TF32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

        # ---- host store: each unit's master, m, v (+ gradients when deferred, + the shadow)
        self.units = model.units(cfg)               # [embed], layer.0 .. layer.{L-1}, head
        self.layer_units = [u for u, lay in enumerate(self.units) if lay.name.startswith("layer.")]
        self.head = len(self.units) - 1
        self.embed = self.head if cfg.tie_embeddings else 0    # see "the embedding" below
        self.order = [self.embed] + [u for u in range(len(self.units)) if u != self.embed]
        shadow = self.dtype if mode == "fast" and self.dtype != torch.float32 else None
        self.opt = optim.HostAdamW(
            self.placement.sizes(self.units), lr, betas, eps, weight_decay, shadow_dtype=shadow,
            pinned=self.lanes.pinned, slabs=grad_slabs, grad_store=self.defer_updates,
            pool=self.lanes.pool, resident=self.order[:resident_units], on_device=self.zeros,
            gpu_updated=gpu_updates and gpu_updates.place(self, resident_units, shadow))
        with torch.no_grad(), self.comp():    # (a resident unit's, on the lane that made it)
            self.placement.fill(self.opt, self.units, weights)   # the model, into the store
        self.pending, self.failed, self.pinned_buffers = {}, [], {}   # unit -> Future of its
        self.loss_host = self.pinned("loss", (), torch.float32)        # update; errors; pinned()

        # ---- GPU: 2 weight slots (ping-pong), 2 fp32 grad slots, made on their first user's lane
        lay, head = self.units[self.layer_units[0]], self.units[self.head]
        n_slot = max(self.placement.slot_numel(lay), self.placement.slot_numel(head))
        with self.comp():
            self.wslot = [torch.empty(n_slot, dtype=self.dtype, device=self.dev) for _ in range(2)]
            self.gslot = [torch.zeros(n_slot, device=self.dev) for _ in range(2)]
        with self.h2d():  # lean: the fp32 master lands in the cast buffer, cast into a slot on H2D
            lean = shadow is None and self.dtype != torch.float32
            self.cast = torch.empty(n_slot, device=self.dev) if lean else None
        # views made once per slot serve any layer it holds; weight views: leaves to differentiate
        leaf = lambda f, lay: {k: v.detach().requires_grad_() for k, v in lay.views(f).items()}
        self.wviews = [{"layer": leaf(w, lay), "head": leaf(w, head)} for w in self.wslot]
        self.gviews = [{"layer": lay.views(g), "head": head.views(g)} for g in self.gslot]
        self.slot_loaded, self.slot_free = [None, None], [None, None]   # events (None: none yet)
        self.gslot_free, self.in_slot = [None, None], {}   # unit -> the slot holding its weights
        self.rope, self.batch = {}, None            # T -> (cos, sin), the last T; the step's Batch
        self.lanes.synchronize()                    # the buffers exist before any lane touches them

    # ------------------------------------------------------------------------------ one step
    def step(self, tokens, targets):
        """tokens, targets: (B, T) int64, -100 = ignored. The mean loss (updates may still run)."""
        b = self._prepare(tokens, targets, train=True)
        self.guard and self.guard.reset()
        with self.comp(), self._autocast():
            x = self._forward(b, keep=True)
            dy, loss_ready = self._head(x, b, backward=True)    # its gradient waits in grad slot 0
            del x                                               # the backward holds dy, not x
            if self.guard and not self.defer_updates:           # the guard: the loss, a host sync
                self.lanes.host_wait(loss_ready)
                if not self.guard.ok(self.loss_host.item()):
                    self.slot_free[self.in_slot[self.head]] = self.comp.record()
                    return self.loss_host.item()                # no gradient leaves the GPU
            self._drain(self.head, 0)
            dy = self._backward(dy, b)
            dy_host, dy_ready = self.dy_to_host(dy)             # the embedding's gradient (B, T, d)
        self._host_grad(self.embed)                             # (a tied head holds one already)
        self._submit(self.embed, self._grad_landed, self.embed, dy_ready, self.lr,   # the scatter
                     lambda: self.add_embedding_grad(b.tokens, dy_host), ready=dy_ready)   # update
        self.lanes.host_wait(loss_ready)
        loss = self.loss_host.item()
        if self.defer_updates:  # every squared norm known: clip, then update in forward order
            with self.h2d():    # (one on the GPU: a scalar made on this lane; summed as floats)
                sq = sum(float(self.pending.pop(u).result()) for u in range(len(self.units)))
                self.grad_norm = math.sqrt(self.placement.sum(sq))   # every process's shards
            if self.guard and not self.guard.ok(self.grad_norm + loss):
                return loss                                          # weights, m, v untouched
            coef = optim.clip_coef(self.grad_norm, self.grad_clip)
            for u in self.order:
                self._submit(u, (self.gpu_updates or self.opt).step, u, self.lr, coef)
        return loss

    @torch.no_grad()
    def evaluate(self, tokens, targets):
        """Mean loss of (tokens, targets) with the current weights: a step's forward half."""
        b = self._prepare(tokens, targets, train=False)
        with self.comp(), self._autocast():
            _, loss_ready = self._head(self._forward(b, keep=False), b, backward=False)
            self.slot_free[self.in_slot[self.head]] = self.comp.record()
        self.lanes.host_wait(loss_ready)
        return self.loss_host.item()

    @torch.no_grad()
    def _forward(self, b, keep):
        """Embedding + layers, no graph, a micro-batch at a time. x: M x (B/M, T, d), compute."""
        self.in_slot = {}                             # last step's slots hold stale weights
        self._prefetch(self.layer_units[0], busy_slot=1)   # into slot 0
        self._ready(self.embed)                        # the rows come from the updated embedding
        x = self.embed_rows(b)
        for i, u in enumerate(self.layer_units):
            s = self.in_slot[u]
            self.comp.wait(self.slot_loaded[s])
            if keep:                                   # boundary activations: layer i's input
                self.activations.keep(i, x)
            w = self.wviews[s]["layer"]                # views into weight slot s, compute dtype
            x = [self.layer.block(self.cfg, x_j, w, b.rope) for x_j in x]    # (B/M, T, d) each
            self.slot_free[s] = self.comp.record()
            self._prefetch((self.layer_units + [self.head])[i + 1], s)   # the next unit
        return x

    def _head(self, x, b, backward):
        """Norm + LM head + loss in token chunks (backward: gradient in grad slot 0): dy, event."""
        cfg, s = self.cfg, self.in_slot[self.head]
        self._prefetch(self.layer_units[-1], s)        # in a slot already: the last layer stays
        self.comp.wait(self.slot_loaded[s])
        w, gs = self.wviews[s]["head"], self._grad_slot(self.head, 0) if backward else None
        loss, dy = torch.zeros((), dtype=torch.float32, device=self.dev), []
        for x_j, tgt in zip(x, b.targets.chunk(self.M)):               # per micro-batch
            xf, tgt = x_j.reshape(-1, cfg.d_model), tgt.reshape(-1)    # (B/M*T, d), (B/M*T,)
            if backward:
                lj, dx = model.head_grad(cfg, xf, w, tgt, b.n_tok, self.gviews[gs]["head"],
                                         self.chunk)
                dy.append(dx.view_as(x_j))
            else:
                lj = model.chunked_loss_sum(cfg, xf, w, tgt, self.chunk) / b.n_tok
            loss += lj
        self.loss_host.copy_(self.placement.sum_loss(loss, self.lanes), non_blocking=True)
        return dy, self.comp.record()

    def _backward(self, dy, b):
        """Layers L-1..0: recompute with grad, micro-batches accumulated in fp32, drain each."""
        L = len(self.layer_units)
        for i in reversed(range(L)):
            s = self.in_slot[u := self.layer_units[i]]
            xs = self.activations.take(i)              # on compute, ready (the next on its way)
            if i > 0:
                self._prefetch(self.layer_units[i - 1], s)
            self.comp.wait(self.slot_loaded[s])
            gs = self._grad_slot(u, L - i)
            w, acc = self.wviews[s]["layer"], self.gviews[gs]["layer"]
            for j in range(self.M):
                dy[j] = self.layer.block_grad(self.cfg, xs[j], w, b.rope, dy[j], acc)
            self.activations.release(i)                # compute is done with layer i's inputs
            self._drain(u, gs)
        return dy

    def _prepare(self, tokens, targets, train):
        """The step's batch: targets to the device (H2D, pinned); tokens stay for the host rows."""
        model.check_seq_len(self.cfg, tokens.shape[1])          # before any work is issued
        n_tok = max(1, int((targets != model.IGNORE).sum()))    # loss = sum / n_tok, whole step
        targets = self.placement.local_batch(targets)           # the rows this process computes
        B, T = targets.shape
        tgt = self.upload(self.pinned("targets", (B, T), torch.int64).copy_(targets))
        if self.embed in self.opt.resident:                     # its rows gathered on the GPU
            tokens = self.upload(self.pinned("tokens", (B, T), torch.int64).copy_(tokens))
        with self.comp():
            if T not in self.rope:                              # on compute: its only reader
                self.rope = {T: model.rope_cache(self.cfg, T, self.dev, self.residual_dtype)}
        if train:  # where the boundary activations go, made ready before the step's first op
            self.activations.prepare(self, len(self.layer_units), (B, T, self.cfg.d_model))
        self.batch = Batch(tokens, tgt, n_tok, self.rope[T])
        return self.batch

    def upload(self, host):
        """A pinned buffer's H2D copy, made on the lane that writes it, kept for compute."""
        with self.h2d():
            out = torch.empty(host.shape, dtype=host.dtype, device=self.dev)
            out.copy_(host, non_blocking=True)
        self.comp.keep(out)
        return out

    def zeros(self, n, dtype):  # a resident unit's GPU buffer: made on compute, as the slots
        with self.comp():
            return torch.zeros(n, dtype=dtype, device=self.dev)

    def _autocast(self):  # bf16: autocast around blocks and head, as the reference trainer
        return torch.autocast(self.dev.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    # ------------------------------------------------------------------------------ weights in
    def _ready(self, u):  # block until unit u's last update finished (no half-updated copy)
        return (fut := self.pending.pop(u, None)) is not None and fut.result()

    def _prefetch(self, u, busy_slot):
        """Unit u (being) loaded after its update, into the slot the visit does not use."""
        if u not in self.in_slot:
            self._ready(u)
            self.load_unit(u, 1 - busy_slot)
            self.in_slot = {**{k: s for k, s in self.in_slot.items() if s == busy_slot},
                            u: 1 - busy_slot}

    def load_unit(self, u, slot):
        """H2D of unit u into wslot[slot] (the one place weights cross to the GPU): slot_loaded."""
        n, src = self.units[u].numel, self.opt.streamed(u)   # a resident one: D2D, cast on the way
        with self.h2d():
            self.h2d.wait(self.slot_free[slot])
            self.h2d.wait(self.gpu_updates and self.gpu_updates.landed.get(u))   # back on the host
            if self.cast is None:
                self.wslot[slot][:n].copy_(src, non_blocking=True)
            else:  # lean: fp32 crosses PCIe, the cast to the compute dtype happens on the GPU
                self.cast[:n].copy_(src, non_blocking=True)
                self.wslot[slot][:n].copy_(self.cast[:n])
            self.slot_loaded[slot] = self.h2d.record()

    # ------------------------------------------------------------------------------ the embedding
    # Tied: self.embed is the head, whose first V*d elements are the table; its gradient gets dy's
    # scatter on top of the head's own (landed first), so it is updated after the scatter.
    def _table(self, flat):  # the (V, d) table in a flat buffer of unit self.embed (first entry)
        return flat[:self.cfg.vocab_size * self.cfg.d_model].view(self.cfg.vocab_size, -1)

    def embed_rows(self, b):
        """x, M x (B/M, T, d): rows gathered on the host (B x T x d cross PCIe), or on the GPU."""
        if self.embed in self.opt.resident:
            self.comp.wait(self.h2d.record())
            x = self._table(self.opt.master[self.embed])[b.tokens]          # (B, T, d) fp32
            return list(x.to(self.residual_dtype).chunk(self.M))
        bf16 = self.residual_dtype != torch.float32 and self.opt.shadow is not None
        table = self._table((self.opt.shadow if bf16 else self.opt.master)[self.embed])
        rows = self.pinned("rows", (*b.tokens.shape, self.cfg.d_model), table.dtype)  # (B, T, d)
        torch.index_select(table, 0, b.tokens.reshape(-1), out=rows.view(-1, self.cfg.d_model))
        x = self.upload(rows)
        self.comp.wait(self.h2d.record())
        return list(x.to(self.residual_dtype).chunk(self.M))     # lean + bf16 residual: cast here

    def dy_to_host(self, dy):
        """D2H of dy, queued behind layer 0's gradient (which waited for dy): (buffer, event)."""
        if self.embed in self.opt.resident:                      # it stays: (B, T, d), compute
            self.h2d.keep(dy := torch.cat(dy))                   # the scatter reads it on H2D
            with self.d2h():                                     # after compute and the head's D2D
                self.d2h.wait(self.comp.record())
                return dy, self.d2h.record()
        host = self.pinned("dy", (self.M * dy[0].shape[0], *dy[0].shape[1:]), dy[0].dtype)
        with self.d2h():
            for dst, x in zip(host.chunk(self.M), dy):
                self.d2h.keep(x)
                dst.copy_(x, non_blocking=True)
            return host, self.d2h.record()

    def add_embedding_grad(self, tokens, dy_host):
        """Worker: add dy (B, T, d) into the rows of opt.grad[embed] the tokens (B, T) used."""
        grad, ids = self._table(self.opt.grad[self.embed]), tokens.reshape(-1)
        if self.embed != self.head:
            grad.zero_()            # untied: the scatter is the whole embedding gradient
        dy = dy_host.reshape(-1, grad.shape[1]).float()
        if self.embed not in self.opt.resident:
            return grad.index_add_(0, ids, dy)
        w = grad.detach().requires_grad_()   # a GPU index_add_ adds in no fixed order (atomics):
        grad.add_(torch.autograd.grad(F.embedding(ids, w), w, dy)[0])   # embedding's own backward

    # ------------------------------------------------------------------------------ gradients out
    def _grad_slot(self, u, k):  # grad slot k % 2 for unit u, zeroed once its last D2H is done
        gs = k % 2
        self.comp.wait(self.gslot_free[gs])
        self.gslot[gs][:self.placement.slot_numel(self.units[u])].zero_()
        return gs

    def _drain(self, u, gs):
        """Compute is done with unit u: free its slot, D2H its gradient, hand it to the worker."""
        self.slot_free[self.in_slot[u]] = ev = self.comp.record()
        self._host_grad(u)
        done = self.grad_to_host(u, gs, ev)
        if u != self.embed:  # tied: the head is handed over after the embedding scatter
            self._submit(u, self._grad_landed, u, done, self.lr, ready=done)

    def grad_to_host(self, u, gs, ready):
        """D2H of u's gradient from gslot[gs] (done at `ready`) into opt.grad[u]: its event."""
        with self.d2h():
            self.d2h.wait(ready)
            self.opt.grad[u].copy_(self.gslot[gs][:self.units[u].numel], non_blocking=True)
            self.gslot_free[gs] = done = self.d2h.record()
        return done

    def _host_grad(self, u):
        """A slab for unit u's gradient (unless deferred, or tied and held), a failure raised."""
        if not self.defer_updates and self.opt.grad[u] is None:
            self.opt.lend(u)                 # the worker gives slabs back, failed updates too ...
            if self.failed:                  # ... and notes the failure (_submit): raised here
                raise self.failed[0]

    def _submit(self, u, fn, *args, ready=None):
        """fn(*args), unit u's work for the optimizer thread (which runs first, of the work `ready`,
        what the next forward needs first: its place in self.order); its failure noted at once."""
        if u in self.opt.on_gpu:   # its gradient on the GPU: here, on H2D, the lane copying it next
            with self.h2d():
                (fut := Future()).set_result(fn(*args))
        else:
            fut = self.lanes.submit(fn, *args, need=self.order.index(u), ready=ready)
        fut.add_done_callback(lambda f: f.exception() and self.failed.append(f.exception()))
        self.pending[u] = fut

    def _grad_landed(self, u, done, lr, scatter=None):
        """Worker: once u's gradient landed (the embedding's scattered), update, or its norm^2."""
        try:
            self.h2d.wait(done) if u in self.opt.on_gpu else self.lanes.host_wait(done)
            if scatter:
                scatter()
            return self.opt.grad_sq(u) if self.defer_updates else self.update_unit(u, lr)
        finally:
            if not self.defer_updates and u in self.opt.lent:
                self.opt.give_back(u)

    def update_unit(self, u, lr):
        """Worker: AdamW on unit u, unless the guard finds its gradient not finite."""
        if not self.guard or self.guard.ok(self.opt.grad[u], self.units[u].name):
            (self.gpu_updates or self.opt).step(u, lr)   # (GpuUpdates: its units on the GPU)

    # ------------------------------------------------------------------------------ the surface
    def set_lr(self, lr): self.lr = lr

    def wait(self):
        """Block until the updates in flight and the device are done; re-raise a worker failure."""
        for u in list(self.pending):
            self._ready(u)
        self.lanes.synchronize()

    def weights(self, copy=True):
        """{key: fp32 CPU tensor}: the master weights, copies or (copy=False) views of the store."""
        self.wait()
        return {k: v.to("cpu", copy=True) if copy else v for u, lay in enumerate(self.units)
                for k, v in lay.key_views(self.opt.master[u]).items()}

    def pinned(self, name, shape, dtype):
        """A view of host buffer `name` (page-locked with CUDA), made anew only to grow."""
        buf, n = self.pinned_buffers.get(name), math.prod(shape)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf is not None and self.lanes.synchronize()   # none in flight from or into the old
            buf = self.pinned_buffers[name] = (self.lanes.pinned or torch.zeros)(n, dtype=dtype)
        return buf[:n].view(shape)


class OnDevice(dict):
    """Boundary activations on the device: i -> layer i's inputs (activations.HostRing: host)."""
    offloaded = False
    keep, take, release = dict.__setitem__, dict.__getitem__, dict.pop   # forward, backward, done
    def prepare(self, trainer, n_layers, shape): self.clear()     # a new step


class Whole:
    """The units' placement: every unit whole, the whole batch here (sharded.Shards: 1/N each)."""
    group = None                                  # no process group: one process

    def part(self, lay): return 0, lay.numel      # the elements [lo, hi) of the unit held here
    def slot_numel(self, lay): return lay.numel   # what a weight or grad slot needs for it
    def local_batch(self, x): return x            # the rows of the step's batch computed here
    def sum_loss(self, loss, lanes): return loss  # a device scalar, summed over the processes
    def sum(self, x): return x                    # a host number, summed over the processes
    def gather_object(self, obj): return [obj]    # obj of every process
    def sizes(self, units): return [(lay.numel, lay.n_decay) for lay in units]   # in the store

    def fill(self, opt, units, weights):          # the master weights, read unit by unit
        read_into = getattr(weights, "read_into", None)   # a lazy source fills a view in place
        for u, lay in enumerate(units):
            for key, view in lay.key_views(opt.master[u]).items():
                read_into(key, view) if read_into else view.copy_(weights[key])
            opt.refresh_shadow(u)


# -------------------------------------------------------------------------------- the hardware
class Lane:
    """A CUDA stream, or nothing on the CPU (work runs in program order). `with lane():` issues the
    work inside on it; record() an event, wait(event) for one; keep(t): t is used here too."""
    streams = {}   # (device, name) -> stream, one per process: cuBLAS keeps a workspace per stream
    #                it ran on (32 MiB a thread on Hopper) until exit: a stream per Trainer leaks

    def __init__(self, device=None, name="compute"):
        if device is not None and (device, name) not in Lane.streams:
            Lane.streams[device, name] = torch.cuda.Stream(device=device)
        self.stream = Lane.streams.get((device, name))

    def __call__(self): return torch.cuda.stream(self.stream) if self.stream else nullcontext()
    def record(self): return self.stream.record_event() if self.stream else None
    def wait(self, event): return self.stream.wait_event(event) if self.stream and event else None
    def keep(self, t): return t.record_stream(self.stream) if self.stream else None


class Lanes:
    """The hardware as the engine sees it (record.SimLanes: the same, every ordering recorded)."""

    def __init__(self, device, procs=1, lane=Lane):
        self.device = device = optim.resolve_device(device)
        self.cuda = cuda = device.type == "cuda"
        self.pinned = optim.page_locked if cuda else None     # makes host buffers the copies use
        self.h2d, self.comp, self.d2h = (lane(device if cuda else None, n)
                                         for n in ("h2d", "compute", "d2h"))
        self.worker = optim.Worker(device, procs)             # the optimizer thread
        self.threads = self.worker.threads                     # OpenMP teams: (main, optimizer)
        torch.set_num_threads(self.threads[0])                 # a setting of the calling thread

    def host_wait(self, event): return event.synchronize() if event is not None else None
    def synchronize(self): return torch.cuda.synchronize(self.device) if self.cuda else None
    def submit(self, fn, *args, **when): return self.worker.submit(fn, *args, **when)   # Future
    pool = None   # where the gradient slabs wait: optim's queue (record.SimLanes: a recorded one)
