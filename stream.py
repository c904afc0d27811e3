"""stream.py -- the engine: train a model whose weights live in host memory, one layer at a time.

What it is
    Trainer keeps every weight and optimizer state in optim.HostAdamW (pinned host memory) and uses the
    GPU as a stateless compute engine: two weight slots, two gradient slots, one layer's activations.
    Three CUDA streams overlap the work; events order it. Without CUDA the same schedule runs on the
    CPU with no-op streams and synchronous copies -- that is what CI and the exactness tests run.
What it is not
    No tensor/pipeline parallelism, no nn.Module, no autograd graph across layers. The model maths is
    model.py's; the optimizer is optim.py's. Reference: megatrain_min/reference.py (plain PyTorch), which
    tests/test_stream.py holds this engine to.

One step, layer-major (every micro-batch passes through a layer during ONE visit of its weights):

  forward   embed rows gathered on the host -> x[j] (B/M, T, d) for micro-batches j = 0..M-1
            for layer i:  ckpt[i][j] = x[j];  x[j] = block(x[j], slot)          (no autograd graph)
  head      per micro-batch, per token chunk: norm + lm_head + CE, forward AND backward at once
  backward  for layer i = L-1..0:  recompute block(ckpt[i][j]) with grad, autograd.grad w.r.t.
            (input, weights), fp32 gradient accumulated in a grad slot, then D2H to the host store
  update    a worker thread runs AdamW on each unit as its gradient lands (no clipping), or, with
            clipping, once the global norm is known, in forward order, so that the next step's
            forward of layer i waits only for layer i's update.

The three streams for L=3, one column per layer visit (0/1/2 = layers, H = head, ' = backward,
(A)/(B) = weight slot, X>A = copy unit X into slot A, gX = unit X's fp32 gradient to the host):

  compute  |emb|  0 (A)   |  1 (B)   |  2 (A)   | H+H' (B) |  2' (A)  |  1' (B)  |  0' (A)  |
  H2D      |0>A|1>B       |2>A       |H>B       |          |1>B       |0>A       |
  D2H                                                      |gH        |g2        |g1        |g0, dy
  CPU worker                                                 AdamW H    AdamW 2    AdamW 1    AdamW 0, embed

The copy of the next unit runs under the compute of the current one; 2' needs no copy (slot A still
holds layer 2). Boundary-checkpoint offloads and reloads, when on, ride the D2H and H2D lanes too.
Without clipping a gradient lands in one of 3 pinned staging slabs and is updated at once (the CPU row);
with clipping every unit keeps its gradient until the global norm is known (the updates follow the step).

Each copy is one contiguous transfer of a unit's flat buffer. A slot is refilled only after the
compute stream has finished with it (event slot_free), and the compute stream uses a slot only after
its copy landed (event slot_loaded). A grad slot is zeroed only after its previous D2H finished.

Try it
    python -m pytest tests/test_stream.py       # CPU: equals the reference trainer step for step
    python train.py --engine stream             # the default engine of train.py
"""
import contextlib
import math
import queue
from concurrent.futures import ThreadPoolExecutor

import torch

import model
from optim import HostAdamW, clip_coef


class Lane:
    """A CUDA stream, or nothing on the CPU (work then runs synchronously, in program order)."""

    def __init__(self, cuda, sync=False):
        self.stream = torch.cuda.Stream() if cuda else None
        self.sync = sync  # debug: synchronise after every recorded operation (the race detector's baseline)

    def __call__(self):  # `with lane():` -- issue the work inside on this stream
        if self.stream is None:
            return contextlib.nullcontext()
        if self.sync:
            torch.cuda.synchronize()
        return torch.cuda.stream(self.stream)

    def wait(self, event):
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def record(self):
        if self.stream is None:
            return None
        if self.sync:
            torch.cuda.synchronize()
        return self.stream.record_event()

    def keep(self, t):  # t was allocated on another stream: the caching allocator must not reuse it early
        if self.stream is not None:
            t.record_stream(self.stream)


def wait_event(event):
    """Block the calling host thread until the GPU passed `event` (no-op on the CPU)."""
    if event is not None:
        event.synchronize()


class Trainer:
    def __init__(self, cfg, weights, device=None, dtype=None, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.1, grad_clip=0.0, micro_batches=1, offload_checkpoints=None,
                 chunk_tokens=None, mode="fast", sync=False, skip_nonfinite=False):
        """cfg: model.GPTConfig; weights: {key: fp32 tensor} as model.init_weights returns.
        device: "cuda" or "cpu" (default: cuda when available); dtype: compute dtype (bf16 on CUDA,
        fp32 on CPU by default); grad_clip 0 = off; offload_checkpoints: keep boundary checkpoints in
        pinned host memory (None = only when they would not fit on the GPU); mode: "fast" streams a
        compute-dtype shadow of the master, "lean" streams the fp32 master and casts on the GPU (no
        shadow: 12 B/param + gradients on the host); sync: synchronise after every operation (debug);
        skip_nonfinite: a step with a non-finite loss updates nothing (checked after the head, before any
        gradient leaves the GPU: one host sync per step); with clipping the global gradient norm is
        checked too (it is known before any update)."""
        if mode not in ("fast", "lean"):
            raise ValueError(f"mode must be 'fast' or 'lean', got {mode!r}")
        if dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"compute dtype must be torch.bfloat16 or torch.float32, got {dtype} (fp16 would need loss scaling)")
        self.cfg = cfg.check()
        self.dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cuda = self.dev.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
        self.M, self.grad_clip, self.lr = micro_batches, grad_clip, lr
        self.deferred = bool(grad_clip)               # update only once every gradient is on the host
        self.skip_nonfinite, self.skipped, self.grad_norm = skip_nonfinite, False, None
        self.chunk = chunk_tokens or model.default_chunk_tokens(cfg)
        self.offload = offload_checkpoints
        if cuda and self.dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = False  # "fp32" means fp32 unless asked otherwise
            torch.backends.cudnn.allow_tf32 = False

        # ---- host store: every unit's master/m/v/grad (+ compute-dtype shadow in fast mode)
        self.units = model.units(cfg)                 # [embed], layer.0..layer.{L-1}, head
        self.layers = [u for u, lay in enumerate(self.units) if lay.name.startswith("layer.")]
        self.head = len(self.units) - 1
        self.embed = self.head if cfg.tie_embeddings else 0  # the unit whose first V*d elements are the embedding
        shadow = self.dtype if (mode == "fast" and self.dtype != torch.float32) else None
        self.opt = HostAdamW([(lay.numel, lay.n_decay) for lay in self.units], lr=lr, betas=betas, eps=eps,
                             weight_decay=weight_decay, pin=cuda, shadow_dtype=shadow, grad_store=self.deferred)
        # Without deferral a unit's gradient lives on the host only until its update: a few staging slabs
        # suffice (3: one may be held by the tied head until the embedding scatter, two rotate).
        self.slabs, self.held = queue.Queue(), {}     # free slabs; unit -> the slab its gradient sits in
        if not self.deferred:
            for _ in range(3):
                self.slabs.put(torch.zeros(max(lay.numel for lay in self.units), pin_memory=cuda))
        read_into = getattr(weights, "read_into", None)  # hf.load_hf's lazy weights fill a view in place
        for u, lay in enumerate(self.units):
            for key, view in lay.key_views(self.opt.master[u]).items():
                read_into(key, view) if read_into else view.copy_(weights[key])
            self.opt.refresh_shadow(u)

        # ---- GPU: two weight slots (ping-pong), two fp32 grad slots, streams. Independent of depth.
        n_slot = max(self.units[u].numel for u in self.layers + [self.head])
        self.wslot = [torch.empty(n_slot, dtype=self.dtype, device=self.dev) for _ in range(2)]
        self.gslot = [torch.zeros(n_slot, dtype=torch.float32, device=self.dev) for _ in range(2)]
        self.stage = (torch.empty(n_slot, dtype=torch.float32, device=self.dev)  # lean mode: fp32 lands here
                      if shadow is None and self.dtype != torch.float32 else None)
        self.h2d, self.comp, self.d2h = Lane(cuda, sync), Lane(cuda, sync), Lane(cuda, sync)
        self.slot_loaded, self.slot_free, self.gslot_free = [None, None], [None, None], [None, None]
        self.resident = {}                            # unit -> slot holding its current weights
        self.worker = ThreadPoolExecutor(max_workers=1)  # the CPU optimizer, off the critical path
        self.pending = {}                             # unit -> Future of its update
        self.rope = {}
        self.loss_host = torch.zeros((), dtype=torch.float32, pin_memory=cuda)

    # ------------------------------------------------------------------ weights in and out
    def _ready(self, u):
        """Block until unit u's last update finished (never copy half-updated weights)."""
        fut = self.pending.pop(u, None)
        if fut is not None:
            fut.result()

    def _load(self, u, slot):
        """H2D: unit u's weights into wslot[slot], one contiguous copy, once compute is done with the slot."""
        self._ready(u)
        n = self.units[u].numel
        src = self.opt.shadow[u] if self.opt.shadow is not None else self.opt.master[u]
        with self.h2d():
            self.h2d.wait(self.slot_free[slot])
            if self.stage is None:
                self.wslot[slot][:n].copy_(src, non_blocking=True)
            else:  # lean: fp32 crosses PCIe, the cast to the compute dtype happens on the GPU
                self.stage[:n].copy_(src, non_blocking=True)
                self.wslot[slot][:n].copy_(self.stage[:n])
            self.slot_loaded[slot] = self.h2d.record()
        self.resident = {k: s for k, s in self.resident.items() if s != slot}
        self.resident[u] = slot

    def _prefetch(self, u, busy_slot):
        """Make sure unit u is (being) loaded into the slot that the current visit does not use."""
        if u not in self.resident:
            self._load(u, 1 - busy_slot)
        return self.resident[u]

    def weights(self, copy=True):
        """{key: fp32 CPU tensor} of the master weights, after all pending updates: copies, or with
        copy=False views into the host store itself (no second copy of the model; valid until the next step)."""
        for u in list(self.pending):
            self._ready(u)
        return {k: v.clone() if copy else v
                for u, lay in enumerate(self.units) for k, v in lay.key_views(self.opt.master[u]).items()}

    def set_lr(self, lr):
        self.lr = lr

    # ------------------------------------------------------------------ activations to and from the host
    def _offload(self, x):
        """D2H copy of a boundary checkpoint into pinned host memory; returns the host tensor."""
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.dev.type == "cuda")
        ev = self.comp.record()
        with self.d2h():
            self.d2h.wait(ev)
            self.d2h.keep(x)
            host.copy_(x, non_blocking=True)
        return host

    def _reload(self, hosts, offloaded):
        """H2D copies of a layer's offloaded checkpoints (after their D2H finished); returns (GPU tensors, event)."""
        with self.h2d():
            self.h2d.wait(offloaded)
            xs = [h.to(self.dev, non_blocking=True) for h in hosts]
            ev = self.h2d.record()
        for x in xs:
            self.comp.keep(x)
        return xs, ev

    # ------------------------------------------------------------------ one training step
    def step(self, tokens, targets):
        """tokens, targets: (B, T) int64 CPU tensors, targets == -100 ignored. Returns the step's mean
        loss (before the update). Updates may still be running on the worker when this returns."""
        tok_mb, n_tok, rope, offload = self._prepare(tokens, targets)
        self.skipped = False
        with self.comp():
            x, ckpt = self._forward(tok_mb, rope, offload, keep=True)
            dy, loss_ready = self._head(x, targets, n_tok, backward=True)
            if dy is None:                              # non-finite loss: nothing was updated or drained
                self.skipped = True
                return self.loss_host.item()
            self._backward(dy, ckpt, rope, offload)
            # embedding gradient: dy of layer 0 goes to the host, the worker scatters it into the rows used
            dy_host = [self._offload(d) for d in dy]
            dy_ready = self.d2h.record()
        self._host_grad(self.embed)                   # the tied head already holds one
        self._submit(self.embed, self._scatter_embedding, tok_mb, dy_host, dy_ready, self.lr)

        # updates: each unit as its gradient lands, or all of them once the global norm is known
        wait_event(loss_ready)
        loss = self.loss_host.item()
        if self.deferred:
            self.grad_norm = sum(self.pending.pop(u).result() for u in range(len(self.units))) ** 0.5
            if self.skip_nonfinite and not math.isfinite(self.grad_norm + loss):
                self.skipped = True                                   # weights, m, v and step counts untouched
                return loss
            coef = clip_coef(self.grad_norm, self.grad_clip)
            order = [self.embed] + [u for u in range(len(self.units)) if u != self.embed]  # as the forward needs them
            for u in order:
                self.pending[u] = self.worker.submit(self.opt.step, u, self.lr, coef)
        return loss

    @torch.no_grad()
    def evaluate(self, tokens, targets):
        """Mean loss of (tokens, targets) with the current weights: the forward half of a step, streamed."""
        tok_mb, n_tok, rope, _ = self._prepare(tokens, targets)
        with self.comp():
            x, _ = self._forward(tok_mb, rope, offload=False, keep=False)
            _, loss_ready = self._head(x, targets, n_tok, backward=False)
        wait_event(loss_ready)
        return self.loss_host.item()

    def _prepare(self, tokens, targets):
        B, T = tokens.shape
        if B % self.M:
            raise ValueError(f"batch size {B} is not divisible by micro_batches={self.M}")
        model.check_seq_len(self.cfg, T)                   # before anything moves
        if T not in self.rope:
            self.rope[T] = model.rope_cache(self.cfg, T, self.dev, self.dtype)
        n_tok = max(1, int((targets != model.IGNORE).sum()))   # loss = sum / n_tok over the whole step
        offload = self.offload if self.offload is not None else self._auto_offload(B, T)
        return tokens.chunk(self.M), n_tok, self.rope[T], offload

    def _forward(self, tok_mb, rope, offload, keep):
        """Embedding + all layers, layer-major, no autograd graph. Returns (x, ckpt): x is M x (B/M, T, d)
        on the compute stream; ckpt[i] = (inputs of layer i per micro-batch, D2H event or None)."""
        cfg, L = self.cfg, len(self.layers)
        self.resident = {}                              # last step's slots hold stale weights
        self._load(self.layers[0], 0)
        self._ready(self.embed)
        emb = self.units[self.embed].views(self.opt.master[self.embed])
        emb = emb["embed" if "embed" in emb else "lm_head"]                     # (V, d) fp32 master, host
        cuda = self.dev.type == "cuda"
        with self.h2d():                                # only (B, T, d) rows cross PCIe, not the table
            x = [emb[t].to(self.dtype).pin_memory().to(self.dev, non_blocking=True) if cuda
                 else emb[t].to(self.dtype) for t in tok_mb]                  # M x (B/M, T, d)
            ev = self.h2d.record()
        self.comp.wait(ev)
        for x_j in x:
            self.comp.keep(x_j)
        ckpt = []
        for i, u in enumerate(self.layers):
            s = self.resident[u]
            self.comp.wait(self.slot_loaded[s])
            w = self.units[u].views(self.wslot[s])      # views into weight slot s, compute dtype
            if keep:                                    # boundary checkpoint: the input of layer i
                ckpt.append(([self._offload(x_j) for x_j in x], self.d2h.record()) if offload else (x, None))
            x = [model.block(cfg, x_j, w, rope) for x_j in x]                 # (B/M, T, d) each
            self.slot_free[s] = self.comp.record()
            self._prefetch(self.layers[i + 1] if i + 1 < L else self.head, s)
        return x, ckpt

    def _head(self, x, targets, n_tok, backward):
        """Final norm + LM head + loss per micro-batch and token chunk. With backward, each chunk's
        gradient is taken at once (no (B, T, V) logits ever exist), the head's weight gradient goes to
        the host, and dy (M x (B/M, T, d)) is returned for the last layer. Returns (dy, loss event)."""
        cfg, M = self.cfg, self.M
        s = self.resident[self.head]
        self._prefetch(self.layers[-1], s)              # resident already: the last layer stays in its slot
        self.comp.wait(self.slot_loaded[s])
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.dev)
        w = self.units[self.head].views(self.wslot[s])
        if backward:
            g, gs = self._grad_slot(self.head, 0)
            w = {k: v.detach().requires_grad_() for k, v in w.items()}
        dy = []
        for j, x_j in enumerate(x):
            tgt = targets.chunk(M)[j].reshape(-1).to(self.dev, non_blocking=True)
            xf = x_j.reshape(-1, cfg.d_model)                                   # (B/M*T, d)
            dx = torch.empty_like(xf) if backward else None
            for c in range(0, xf.shape[0], self.chunk):
                xc = xf[c:c + self.chunk].detach().requires_grad_(backward)     # (chunk, d)
                with torch.set_grad_enabled(backward):
                    lc = model.head_loss(cfg, xc, w, tgt[c:c + self.chunk]) / n_tok
                if backward:
                    dx[c:c + self.chunk], *gw = torch.autograd.grad(lc, [xc, *w.values()])
                    for acc, gi in zip(g.values(), gw):
                        acc.add_(gi)
                loss_sum += lc.detach()
            dy.append(dx.view_as(x_j) if backward else None)
        self.loss_host.copy_(loss_sum, non_blocking=True)
        loss_ready = self.comp.record()
        if backward and self.skip_nonfinite and not self.deferred:
            wait_event(loss_ready)                      # the guard's price: the host waits for the head
            if not math.isfinite(self.loss_host.item()):
                backward = False                        # drop the gradients: no D2H, no update
                dy = None
        if backward:
            self._drain(self.head, gs, s)
        else:
            self.slot_free[s] = self.comp.record()
        return dy, loss_ready

    def _backward(self, dy, ckpt, rope, offload):
        """Layers L-1..0: recompute from the boundary checkpoint with grad, autograd.grad w.r.t. (input,
        weights), fp32 accumulation over micro-batches, then the gradient drains to the host. dy is
        updated in place to the gradient w.r.t. the input of layer 0."""
        L = len(self.layers)
        reloaded = self._reload(*ckpt[L - 1]) if offload else ckpt[L - 1]
        for i in reversed(range(L)):
            u = self.layers[i]
            s = self.resident[u]
            if i > 0:
                self._prefetch(self.layers[i - 1], s)
            xs, ev = reloaded
            if i > 0:                                   # next layer's inputs come back while this one computes
                reloaded = self._reload(*ckpt[i - 1]) if offload else ckpt[i - 1]
            self.comp.wait(self.slot_loaded[s])
            self.comp.wait(ev)
            g, gs = self._grad_slot(u, L - i)           # fp32 views of a grad slot
            w = {k: v.detach().requires_grad_() for k, v in self.units[u].views(self.wslot[s]).items()}
            for j in range(self.M):
                xin = xs[j].detach().requires_grad_()                          # (B/M, T, d) boundary ckpt
                with torch.enable_grad():
                    y = model.block(self.cfg, xin, w, rope)
                    dy[j], *gw = torch.autograd.grad(y, [xin, *w.values()], dy[j])
                for acc, gi in zip(g.values(), gw):
                    acc.add_(gi)                                               # fp32 accumulation
            ckpt[i] = xs = None
            self._drain(u, gs, s)

    # ------------------------------------------------------------------ gradient plumbing
    def _grad_slot(self, u, k):
        """Grad slot k % 2 for unit u, zeroed once its previous D2H copy finished: (views, slot)."""
        gs = k % 2
        self.comp.wait(self.gslot_free[gs])
        self.gslot[gs][:self.units[u].numel].zero_()
        return self.units[u].views(self.gslot[gs]), gs

    def _drain(self, u, gs, s):
        """Compute is done with unit u: free its weight slot, D2H its gradient, hand it to the worker."""
        self.slot_free[s] = ev = self.comp.record()
        n = self.units[u].numel
        self._host_grad(u)
        with self.d2h():
            self.d2h.wait(ev)
            self.opt.grad[u].copy_(self.gslot[gs][:n], non_blocking=True)
            self.gslot_free[gs] = done = self.d2h.record()
        if u != self.embed:  # the embedding's unit is handed over after its scatter (_scatter_embedding)
            self._submit(u, self._grad_landed, u, done, self.lr)

    def _host_grad(self, u):
        """Point opt.grad[u] at a free staging slab (waiting for the worker to release one), unless the
        store keeps a gradient per unit. The worker gives the slab back after the update (_release)."""
        if self.deferred or (self.opt.grad[u] is not None):
            return
        self.held[u] = self.slabs.get()
        self.opt.grad[u] = self.held[u][:self.units[u].numel]

    def _release(self, u):
        if not self.deferred:
            self.slabs.put(self.held.pop(u))
            self.opt.grad[u] = None

    def _submit(self, u, fn, *args):
        self.pending[u] = self.worker.submit(fn, *args)

    def _grad_landed(self, u, done, lr):
        """Worker: wait for unit u's gradient on the host, then update it now (no clipping) or
        return its squared norm for the global clip (the update follows in step())."""
        wait_event(done)
        if self.deferred:
            return self.opt.grad_sq(u)
        self.opt.step(u, lr)
        self._release(u)

    def _scatter_embedding(self, tok_mb, dy_host, dy_ready, lr):
        """Worker: add dy of layer 0 into the embedding rows that were used (index_add on the host)."""
        wait_event(dy_ready)
        u, d = self.embed, self.cfg.d_model
        V = self.cfg.vocab_size
        grad = self.opt.grad[u][:V * d].view(V, d)
        if u != self.head:
            grad.zero_()                 # untied: the scatter is the whole embedding gradient
        # tied: the head's D2H already wrote the lm_head gradient here; the scatter adds to it.
        # That D2H was queued on the same stream before dy_ready, so it has landed too.
        for t, g in zip(tok_mb, dy_host):
            grad.index_add_(0, t.reshape(-1), g.reshape(-1, d).float())
        return self._grad_landed(u, None, lr)

    def _auto_offload(self, B, T):
        """Offload boundary checkpoints when they would take more than half of the free GPU memory."""
        if self.dev.type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(self.dev)
        need = len(self.layers) * B * T * self.cfg.d_model * torch.finfo(self.dtype).bits // 8
        return need > free // 2
