"""stream.py -- the engine: train a model whose weights live in host memory, one layer at a time.

Trainer keeps every weight and optimizer state in pinned host memory (optim.HostStore); the GPU is
a stateless compute engine: two weight slots, two gradient slots, one layer's activations. Three
CUDA streams (lanes) overlap the work, events order it. On the CPU the lanes do nothing.

One step, layer-major (every micro-batch passes through a layer during ONE visit of its weights):
  forward   embedding rows gathered on the host -> x[j] (B/M, T, d), micro-batches j = 0..M-1;
            for layer i: keep x[j] (boundary activations); x[j] = block(x[j], slot), no graph
  head      per micro-batch, per token chunk: norm + lm_head + CE, forward AND backward at once
  backward  for layer i = L-1..0: recompute block(x[j]) with grad, autograd.grad w.r.t. (input,
            weights), fp32 gradient accumulated in a grad slot, then D2H to the host store
  update    the optimizer thread runs the update rule (AdamW) on the units whose gradients landed,
            first the one the next forward needs first (clipping: once the global norm is known);
            a unit whose home keeps it on the GPU is updated there instead, issued on the H2D lane

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
host-side hand-offs: an update ends before its unit is copied again (_await_update), the worker
waits for a gradient's D2H event, a gradient waits for a free slab (GRAD_SLABS).
bf16 = torch.autocast(bf16) around blocks and head, the residual (x, dy) fp32: the reference's.
Handed in (defaults here): the layer (model; tiling.Tiled), the boundary activations' store
(OnDevice; activations.HostRing), the placement over processes (Whole; sharded.Shards), a guard,
the update rule (optim.AdamW; lion.Lion), and each unit's home (Streamed, the paper's engine; in
megatrain_min.engine.homes: resident on the GPU, or streamed but updated there).
"""
import math
from collections import namedtuple
from contextlib import nullcontext
from functools import partial

import torch

import model
import optim

GRAD_SLABS = 3   # pinned fp32 slabs for gradients (no clipping): two rotate, a tied head holds one
MICRO_BATCHES = 1   # the engine's defaults (optim.py: the optimizer's)
GRAD_CLIP = 0.0     # no clipping
Batch = namedtuple("Batch", "tokens targets n_tok rope")   # tokens: where the embedding gathers


class Trainer:
    def __init__(self, cfg, weights, device=None, dtype=None, lr=optim.LR, betas=optim.BETAS,
                 eps=optim.EPS, weight_decay=optim.WEIGHT_DECAY, grad_clip=GRAD_CLIP,
                 micro_batches=MICRO_BATCHES, mode="fast", residual_dtype=None, chunk_tokens=None,
                 grad_slabs=GRAD_SLABS, layer=model, activations=None, placement=None, guard=None,
                 lanes=None, homes=None, rule=None):
        """cfg: model.GPTConfig; weights: {key: tensor}, read unit by unit. Unchecked: the checked
        front door is megatrain_min.engine.checks.CheckedTrainer. mode "fast" streams a bf16
        shadow, "lean" (or any fp32 run) the fp32 master: AdamW's master, m, v are 12 B/param on
        the host, the gradients (slabs, or a store when clipping) and fast's shadow come on top.
        grad_clip: the updates wait for the global norm. homes: where each unit lives
        (megatrain_min.engine.homes.Homes; None: every unit Streamed). rule: the update rule (None:
        optim.AdamW(betas, eps))."""
        self.cfg = cfg
        self.M = micro_batches
        self.lr = lr
        self.grad_clip = grad_clip
        self.defer_updates = bool(grad_clip)        # every update waits for the global norm
        self.dev = optim.resolve_device(device)     # cuda:N: the lanes and the worker use it too
        self.lanes = lanes if lanes is not None else Lanes(self.dev)
        self.h2d, self.comp, self.d2h = self.lanes.h2d, self.lanes.comp, self.lanes.d2h
        self.dtype = dtype or model.default_dtype(self.dev.type)
        self.residual_dtype = residual_dtype or torch.float32
        self.chunk = chunk_tokens or model.default_chunk_tokens(cfg)
        self.layer = layer
        self.guard = guard
        self.activations = activations if activations is not None else OnDevice()
        self.placement = placement if placement is not None else Whole()
        if self.dev.type == "cuda" and self.dtype == torch.float32:   # fp32 is fp32: no TF32
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False

        # ---- the units, in the order the next forward needs them, and where each one lives
        self.units = model.units(cfg)               # [embed], layer.0 .. layer.{L-1}, head
        self.layer_units = [u for u, lay in enumerate(self.units) if lay.name.startswith("layer.")]
        self.head = len(self.units) - 1
        self.embed = self.head if cfg.tie_embeddings else 0    # see "the embedding" below
        self.order = [self.embed] + [u for u in range(len(self.units)) if u != self.embed]
        self.rule = rule if rule is not None else optim.AdamW(betas, eps)
        # fast: the bf16 shadow of the master is what streams; lean (or fp32): the master
        fast = mode == "fast" and self.dtype != torch.float32
        self.shadow_dtype = self.dtype if fast else None
        self.home = (homes if homes is not None else Streamed).assign(self)   # unit -> its home

        # ---- the host store: each unit's master and optimizer state (+ gradients, the shadow)
        self.opt = optim.HostStore(
            self.placement.sizes(self.units), self.rule, lr, weight_decay,
            pinned=self.lanes.pinned, shadow_dtype=self.shadow_dtype,
            grad_store=self.defer_updates, slabs=grad_slabs, pool=self.lanes.pool,
            homes=self.home, on_device=self.zeros)
        with torch.no_grad(), self.comp():    # (a unit kept on the GPU: on the lane that made it)
            self.placement.fill(self.opt, self.units, weights)   # the model, into the store
        self.grad_norm = None      # clipping: the last step's global gradient norm
        self.updates = {}          # unit -> the Future of its update in flight
        self.sq_norms = {}         # clipping: unit -> the Future of its squared gradient norm
        self.failed = []           # the optimizer thread's errors, raised on the main thread
        self.host_buffers = {}     # name -> a buffer of host_buffer()
        self.loss_host = self.host_buffer("loss", (), torch.float32)

        # ---- GPU: 2 weight slots (ping-pong), 2 fp32 grad slots, made on their first user's lane
        lay, head = self.units[self.layer_units[0]], self.units[self.head]
        n_slot = max(self.placement.slot_numel(lay), self.placement.slot_numel(head))
        with self.comp():
            self.wslot = [torch.empty(n_slot, dtype=self.dtype, device=self.dev) for _ in range(2)]
            self.gslot = [torch.zeros(n_slot, device=self.dev) for _ in range(2)]
        with self.h2d():  # lean: the fp32 master lands in the cast buffer, cast into a slot on H2D
            lean = self.shadow_dtype is None and self.dtype != torch.float32
            self.cast = torch.empty(n_slot, device=self.dev) if lean else None
        # views made once per slot serve any layer it holds; weight views: leaves to differentiate
        leaf = lambda f, lay: {k: v.detach().requires_grad_() for k, v in lay.views(f).items()}
        self.wviews = [{"layer": leaf(w, lay), "head": leaf(w, head)} for w in self.wslot]
        self.gviews = [{"layer": lay.views(g), "head": head.views(g)} for g in self.gslot]
        # events (None: none yet) ordering each slot's copies and compute
        self.slot_loaded = [None, None]
        self.slot_free = [None, None]
        self.gslot_free = [None, None]
        self.in_slot = {}          # unit -> the weight slot holding it
        self.rope = {}             # T -> (cos, sin), of the last T
        self.batch = None          # the step's Batch
        self.lanes.synchronize()   # the buffers exist before any lane touches them

    # ------------------------------------------------------------------------------ one step
    def step(self, tokens, targets):
        """tokens, targets: (B, T) int64, -100 = ignored. The mean loss (updates may still run)."""
        b = self._prepare(tokens, targets, train=True)
        if self.guard is not None:
            self.guard.reset()
        with self.comp(), self._autocast():
            x = self._forward(b, keep=True)
            dy, loss_ready = self._head(x, b, backward=True)    # its gradient waits in grad slot 0
            del x                                               # the backward holds dy, not x
            if self.guard is not None and not self.defer_updates:   # the loss: a host sync
                self.lanes.host_wait(loss_ready)
                if not self.guard.ok(self.loss_host.item()):
                    self.slot_free[self.in_slot[self.head]] = self.comp.record()
                    return self.loss_host.item()                # no gradient leaves the GPU
            self._drain(self.head, 0)
            dy = self._backward(dy, b)
            dy_out, dy_ready = self.home[self.embed].dy_out(dy)    # the embedding's gradient
        self._lend_grad(self.embed)                             # (a tied head holds one already)
        scatter = partial(self.home[self.embed].add_dy, b.tokens, dy_out)
        self._hand_off(self.embed, dy_ready, scatter)
        self.lanes.host_wait(loss_ready)
        loss = self.loss_host.item()
        if self.defer_updates:
            self._clip_and_update(loss)
        return loss

    def _clip_and_update(self, loss):
        """Every squared norm known: the global norm, the clip factor, then every update, in the
        order the next forward needs them."""
        with self.h2d():   # a norm taken on the GPU is read on the lane that took it
            sq = sum(float(self.sq_norms.pop(u).result()) for u in range(len(self.units)))
        self.grad_norm = math.sqrt(self.placement.sum(sq))   # every process's shards
        if self.guard is not None and not self.guard.ok(self.grad_norm + loss):
            return                                             # weights, state untouched
        coef = optim.clip_coef(self.grad_norm, self.grad_clip)
        for u in self.order:
            self.updates[u] = self._submit(u, self.home[u].update, u, self.lr, coef)

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
        self._prefetch(self.layer_units[0], 0)
        self._await_update(self.embed)                # the rows come from the updated embedding
        x = self.home[self.embed].rows(b)
        for i, u in enumerate(self.layer_units):
            s = self.in_slot[u]
            self.comp.wait_event(self.slot_loaded[s])
            if keep:                                   # boundary activations: layer i's input
                self.activations.keep(i, x)
            w = self.wviews[s]["layer"]                # views into weight slot s, compute dtype
            x = [self.layer.block(self.cfg, x_j, w, b.rope) for x_j in x]    # (B/M, T, d) each
            self.slot_free[s] = self.comp.record()
            self._prefetch((self.layer_units + [self.head])[i + 1], 1 - s)   # the next unit
        return x

    def _head(self, x, b, backward):
        """Norm + LM head + loss in token chunks (backward: gradient in grad slot 0): dy, event."""
        cfg, s = self.cfg, self.in_slot[self.head]
        self._prefetch(self.layer_units[-1], 1 - s)    # in a slot already: the last layer stays
        self.comp.wait_event(self.slot_loaded[s])
        w = self.wviews[s]["head"]
        gs = self._grad_slot(self.head, 0) if backward else None
        loss = torch.zeros((), dtype=torch.float32, device=self.dev)
        dy = []
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
            u = self.layer_units[i]
            s = self.in_slot[u]
            xs = self.activations.take(i)              # on compute, ready (the next on its way)
            if i > 0:
                self._prefetch(self.layer_units[i - 1], 1 - s)
            self.comp.wait_event(self.slot_loaded[s])
            gs = self._grad_slot(u, L - i)
            w, acc = self.wviews[s]["layer"], self.gviews[gs]["layer"]
            for j in range(self.M):
                dy[j] = self.layer.block_grad(self.cfg, xs[j], w, b.rope, dy[j], acc)
            self.activations.release(i)                # compute is done with layer i's inputs
            self._drain(u, gs)
        return dy

    def _prepare(self, tokens, targets, train):
        """The step's batch: targets to the device (H2D, pinned); tokens to the embedding's home."""
        model.check_seq_len(self.cfg, tokens.shape[1])          # before any work is issued
        n_tok = max(1, int((targets != model.IGNORE).sum()))    # loss = sum / n_tok, whole step
        targets = self.placement.local_batch(targets)           # the rows this process computes
        B, T = targets.shape
        tgt = self.upload(self.host_buffer("targets", (B, T), torch.int64).copy_(targets))
        tokens = self.home[self.embed].tokens(tokens)
        with self.comp():
            if T not in self.rope:                              # on compute: its only reader
                self.rope = {T: model.rope_cache(self.cfg, T, self.dev, self.residual_dtype)}
        if train:  # where the boundary activations go, made ready before the step's first op
            self.activations.prepare(self, len(self.layer_units), (B, T, self.cfg.d_model))
        self.batch = Batch(tokens, tgt, n_tok, self.rope[T])
        return self.batch

    def upload(self, host):
        """A host buffer's H2D copy, made on the lane that writes it, used by compute too."""
        with self.h2d():
            out = torch.empty(host.shape, dtype=host.dtype, device=self.dev)
            out.copy_(host, non_blocking=True)
        self.comp.uses(out)
        return out

    def zeros(self, n, dtype):
        """A buffer of the store on the GPU (a home's): made on compute, as the slots."""
        with self.comp():
            return torch.zeros(n, dtype=dtype, device=self.dev)

    def _autocast(self):  # bf16: autocast around blocks and head, as the reference trainer
        return torch.autocast(self.dev.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    # ------------------------------------------------------------------------------ weights in
    def _await_update(self, u):
        """Block until unit u's update in flight (if any) is done: no half-updated copy."""
        fut = self.updates.pop(u, None)
        if fut is not None:
            fut.result()

    def _prefetch(self, u, slot):
        """Unit u (being) loaded into weight slot `slot`, after its update; the other slot kept."""
        if u not in self.in_slot:
            self._await_update(u)
            self.load_unit(u, slot)
            kept = {k: s for k, s in self.in_slot.items() if s != slot}
            self.in_slot = {**kept, u: slot}

    def load_unit(self, u, slot):
        """H2D of unit u into wslot[slot] (the one place weights cross to the GPU): slot_loaded."""
        n = self.units[u].numel
        src = self.home[u].source(u)     # what streams (the shadow or the master), from its home
        with self.h2d():
            self.h2d.wait_event(self.slot_free[slot])
            self.h2d.wait_event(self.home[u].source_ready(u))
            if self.cast is None:
                self.wslot[slot][:n].copy_(src, non_blocking=True)
            else:  # lean: fp32 crosses PCIe, the cast to the compute dtype happens on the GPU
                self.cast[:n].copy_(src, non_blocking=True)
                self.wslot[slot][:n].copy_(self.cast[:n])
            self.slot_loaded[slot] = self.h2d.record()

    def table(self, flat):
        """The (V, d) embedding table in a flat buffer of unit self.embed (its first entry). Tied:
        self.embed is the head, whose first V*d elements are the table; its gradient gets dy's
        scatter on top of the head's own (landed first), so it is updated after the scatter."""
        return flat[:self.cfg.vocab_size * self.cfg.d_model].view(self.cfg.vocab_size, -1)

    # ------------------------------------------------------------------------------ gradients out
    def _grad_slot(self, u, k):
        """Grad slot k % 2 for unit u, zeroed once its last D2H is done."""
        gs = k % 2
        self.comp.wait_event(self.gslot_free[gs])
        self.gslot[gs][:self.placement.slot_numel(self.units[u])].zero_()
        return gs

    def _drain(self, u, gs):
        """Compute is done with unit u: free its slot, D2H its gradient, hand it to its home."""
        self.slot_free[self.in_slot[u]] = computed = self.comp.record()
        self._lend_grad(u)
        landed = self.grad_to_host(u, gs, computed)
        if u != self.embed:  # tied: the head is handed over after the embedding's scatter
            self._hand_off(u, landed)

    def grad_to_host(self, u, gs, ready):
        """D2H of u's gradient from gslot[gs] (done at `ready`) into opt.grad[u], on the d2h lane
        (a device-to-device copy for a unit whose gradient its home keeps on the GPU): its event."""
        with self.d2h():
            self.d2h.wait_event(ready)
            self.opt.grad[u].copy_(self.gslot[gs][:self.units[u].numel], non_blocking=True)
            self.gslot_free[gs] = landed = self.d2h.record()
        return landed

    def _lend_grad(self, u):
        """A slab for unit u's gradient, unless it has a buffer (deferred, kept on the GPU, tied and
        held); a failure of the optimizer thread raised."""
        if self.opt.grad[u] is None:
            self.opt.lend(u)                 # waits while the thread gives slabs back
        if self.failed:                      # a failed update gave its slab back too
            raise self.failed[0]

    def _hand_off(self, u, landed, scatter=None):
        """Unit u's gradient (landed at event `landed`) to where its home runs its work: then the
        embedding's scatter (if any) and the update (or, clipping, its squared norm)."""
        fut = self._submit(u, self._after_grad, u, self.lr, scatter, ready=landed)
        if self.defer_updates:
            self.sq_norms[u] = fut
        else:
            self.updates[u] = fut

    def _submit(self, u, fn, *args, ready=None):
        """fn(*args), work of unit u where its home runs it, after event `ready`: a Future, whose
        failure is noted at once (raised by the next step's first gradient)."""
        fut = self.home[u].run(u, fn, *args, ready=ready)
        fut.add_done_callback(self._note_failure)
        return fut

    def _note_failure(self, fut):
        if fut.exception() is not None:
            self.failed.append(fut.exception())

    def _after_grad(self, u, lr, scatter=None):
        """Once u's gradient landed: the embedding's scatter, then the update (the guard asked), or
        with clipping the squared norm."""
        try:
            if scatter is not None:
                scatter()
            if self.defer_updates:
                return self.opt.grad_sq(u)
            self.home[u].update(u, lr, guard=self.guard)
        finally:
            if u in self.opt.lent:           # its slab back, a failed update's too
                self.opt.give_back(u)

    # ------------------------------------------------------------------------------ the surface
    def set_lr(self, lr):
        self.lr = lr

    def wait(self):
        """The host blocks until the updates in flight and the device are done; a failure of the
        optimizer thread re-raised."""
        for u in list(self.updates):
            self._await_update(u)
        self.lanes.synchronize()

    def weights(self):
        """{key: fp32 CPU tensor}: copies of the master weights (the store's own are never handed
        out: a master written without its shadow would leave the shadow stale, optim.py)."""
        self.wait()
        return {k: v.to("cpu", copy=True) for u, lay in enumerate(self.units)
                for k, v in lay.key_views(self.opt.master[u]).items()}

    def host_buffer(self, name, shape, dtype):
        """A view of host buffer `name` (page-locked with CUDA), made anew only to grow."""
        buf = self.host_buffers.get(name)
        n = math.prod(shape)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            if buf is not None:   # no copy in flight from or into the old one
                self.lanes.synchronize()
            alloc = self.lanes.pinned or torch.zeros
            buf = self.host_buffers[name] = alloc(n, dtype=dtype)
        return buf[:n].view(shape)


class Streamed:
    """The home of a unit as the paper has it: its master and optimizer state in host memory, its
    weights streamed at each visit, its gradient copied to the host, its update run on the
    optimizer thread. For the embedding: its rows gathered on the host, dy copied to the host and
    scattered into its gradient there. (megatrain_min.engine.homes: units resident on the GPU, or
    streamed but updated there; each answers the same questions.)"""
    kept_on_device = ()   # none of its store's buffers live on the GPU
    crossing = ()         # none crosses the link but its gradient and what streams

    def __init__(self, trainer):
        self.t = trainer

    @classmethod
    def assign(cls, trainer):
        """Every unit's home (the engine's default): one Streamed, shared."""
        return [cls(trainer)] * len(trainer.units)

    def source(self, u):
        return self.t.opt.streamed(u)   # the shadow, else the master: host memory

    def source_ready(self, u):
        return None                     # an event the copy waits for: none

    def run(self, u, fn, *args, ready=None):
        """fn(*args) on the optimizer thread once event `ready` is done: of the work whose input
        landed, it runs first what the next forward needs first (u's place in order). A Future."""
        t = self.t

        def task():
            t.lanes.host_wait(ready)
            return fn(*args)
        return t.lanes.submit(task, need=t.order.index(u), ready=ready)

    def update(self, u, lr, coef=1.0, guard=None):
        """The rule on unit u in host memory, unless the guard finds its gradient not finite."""
        t = self.t
        if guard is None or guard.ok(t.opt.grad[u], t.units[u].name):
            t.opt.step(u, lr, coef)

    # the embedding: its rows in, its gradient out
    def tokens(self, tokens):
        return tokens                   # the rows are gathered on the host

    def rows(self, b):
        """x, M x (B/M, T, d): the rows of b.tokens gathered on the host from what streams (B x T x
        d cross PCIe), on compute in the residual dtype."""
        t = self.t
        table = t.table(t.opt.master[t.embed])
        if t.residual_dtype != torch.float32 and t.opt.shadow[t.embed] is not None:
            table = t.table(t.opt.shadow[t.embed])
        rows = t.host_buffer("rows", (*b.tokens.shape, t.cfg.d_model), table.dtype)  # (B, T, d)
        torch.index_select(table, 0, b.tokens.reshape(-1), out=rows.view(-1, t.cfg.d_model))
        x = t.upload(rows)
        t.comp.wait_event(t.h2d.record())
        return list(x.to(t.residual_dtype).chunk(t.M))     # lean + bf16 residual: cast here

    def dy_out(self, dy):
        """D2H of dy, queued behind layer 0's gradient (which waited for dy): (buffer, event)."""
        t = self.t
        host = t.host_buffer("dy", (t.M * dy[0].shape[0], *dy[0].shape[1:]), dy[0].dtype)
        with t.d2h():
            for dst, x in zip(host.chunk(t.M), dy):
                t.d2h.uses(x)
                dst.copy_(x, non_blocking=True)
            return host, t.d2h.record()

    def add_dy(self, tokens, dy):
        """Optimizer thread: add dy (B, T, d) into the rows of the embedding's gradient that the
        tokens (B, T) used, token by token in order."""
        t = self.t
        grad = t.table(t.opt.grad[t.embed])
        if t.embed != t.head:
            grad.zero_()            # untied: the scatter is the whole embedding gradient
        grad.index_add_(0, tokens.reshape(-1), dy.reshape(-1, grad.shape[1]).float())


class OnDevice(dict):
    """Boundary activations on the device: i -> layer i's inputs (activations.HostRing: host)."""
    offloaded = False
    keep = dict.__setitem__      # forward: layer i's inputs
    take = dict.__getitem__      # backward: back, for the recompute
    release = dict.pop           # done with them

    def prepare(self, trainer, n_layers, shape):   # a new step
        self.clear()


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

    def fill(self, opt, units, weights):
        """The master weights, read unit by unit (a lazy source fills a view in place)."""
        read_into = getattr(weights, "read_into", None)
        for u, lay in enumerate(units):
            for key, view in lay.key_views(opt.master[u]).items():
                if read_into is not None:
                    read_into(key, view)
                else:
                    view.copy_(weights[key])
            opt.refresh_shadow(u)


# -------------------------------------------------------------------------------- the hardware
class Lane:
    """A CUDA stream, or nothing on the CPU (work runs in program order). `with lane():` issues the
    work inside on it; record() an event, wait_event(event) makes the lane wait for one; uses(t): t
    is used on this lane too (record_stream: its memory is not reused before the lane's work)."""
    # (device, name) -> stream, one per process: cuBLAS keeps a workspace per stream it ran on
    # (32 MiB a thread on Hopper) until exit, so a stream per Trainer would leak
    streams = {}

    def __init__(self, device=None, name="compute"):
        if device is not None and (device, name) not in Lane.streams:
            Lane.streams[device, name] = torch.cuda.Stream(device=device)
        self.stream = Lane.streams.get((device, name))

    def __call__(self):
        return torch.cuda.stream(self.stream) if self.stream else nullcontext()

    def record(self):
        return self.stream.record_event() if self.stream else None

    def wait_event(self, event):
        if self.stream and event:
            self.stream.wait_event(event)

    def uses(self, t):
        if self.stream:
            t.record_stream(self.stream)


class Lanes:
    """The hardware as the engine sees it (record.SimLanes: the same, every ordering recorded)."""
    pool = None   # where the gradient slabs wait: optim's queue (record.SimLanes: a recorded one)

    def __init__(self, device, procs=1, lane=Lane, pinned=None):
        """pinned(n, dtype): page-locked zeros for the copies' host buffers (optim.pinned_zeros)."""
        self.device = device = optim.resolve_device(device)
        self.cuda = device.type == "cuda"
        self.pinned = (pinned or optim.pinned_zeros) if self.cuda else None
        on = device if self.cuda else None
        self.h2d = lane(on, "h2d")
        self.comp = lane(on, "compute")
        self.d2h = lane(on, "d2h")
        self.worker = optim.Worker(device, procs)             # the optimizer thread
        self.threads = self.worker.threads                     # OpenMP teams: (main, optimizer)
        torch.set_num_threads(self.threads[0])                 # a setting of the calling thread

    def host_wait(self, event):
        """The host blocks until the event's work is done."""
        if event is not None:
            event.synchronize()

    def synchronize(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def submit(self, fn, *args, **when):
        return self.worker.submit(fn, *args, **when)   # a Future; when: need, ready
