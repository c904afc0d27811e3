"""stream.py -- the engine: train a model whose weights live in host memory, one layer at a time.

What it is
    Trainer keeps every weight and optimizer state in optim.HostAdamW (pinned host memory) and uses the
    GPU as a stateless compute engine: two weight slots, two gradient slots, one layer's activations.
    Three CUDA streams overlap the work; events order it. Without CUDA the same schedule runs on the
    CPU with no-op streams and synchronous copies -- that is what CI and the exactness tests run.
What it is not
    No tensor/pipeline parallelism, no nn.Module, no autograd graph across layers. The model maths is
    model.py's; the optimizer is optim.py's. Reference: megatrain_min/reference.py (plain PyTorch), which
    tests/test_stream.py holds this engine to. The ordering is proven on the CPU by the stream checker
    (python -m megatrain_min.sim check), which runs this file unchanged with checked Lanes.
    More than one GPU: megatrain_min/sharded.py subclasses Trainer and replaces the methods marked "hook"
    (where a unit's weights come from, where its gradient goes, the embedding's rows, the sums of the loss
    and of the squared gradient norm over the ranks); for one GPU each of them is the few lines it always was.

One step, layer-major (every micro-batch passes through a layer during ONE visit of its weights):

  forward   embed rows gathered on the host -> x[j] (B/M, T, d) for micro-batches j = 0..M-1
            for layer i:  ckpt[i][j] = x[j];  x[j] = block(x[j], slot)          (no autograd graph)
  head      per micro-batch, per token chunk: norm + lm_head + CE, forward AND backward at once
  backward  for layer i = L-1..0:  recompute block(ckpt[i][j]) with grad, autograd.grad w.r.t.
            (input, weights), fp32 gradient accumulated in a grad slot, then D2H to the host store
  update    a worker thread runs AdamW on each unit as its gradient lands, or, when updates are deferred
            (clipping: the global norm comes first), once every gradient is on the host, in forward order,
            so that the next step's forward of layer i waits only for layer i's update.

The three streams for L=3, one column per layer visit (0/1/2 = layers, H = head, ' = backward,
(A)/(B) = weight slot, X>A = copy unit X into slot A, gX = unit X's fp32 gradient to the host):

  compute  |emb|  0 (A)   |  1 (B)   |  2 (A)   | H+H' (B) |  2' (A)  |  1' (B)  |  0' (A)  |
  H2D      |0>A|1>B       |2>A       |H>B       |          |1>B       |0>A       |
  D2H                                                      |gH        |g2        |g1        |g0, dy
  CPU worker                                                 AdamW H    AdamW 2    AdamW 1    AdamW 0, embed

The copy of the next unit runs under the compute of the current one; 2' needs no copy (slot A still
holds layer 2). Boundary-checkpoint offloads and reloads, when on, ride the D2H and H2D lanes too.

Every ordering rule is an event, each one line below:
  slot_loaded[s]  H2D -> compute    never compute on half-copied weights
  slot_free[s]    compute -> H2D    never overwrite weights still in use
  gslot_free[g]   D2H -> compute    never zero a gradient slot before its copy to the host finished
  ring_ready[r]   writer -> reader  a checkpoint ring slot holds the checkpoint (compute->D2H fwd, H2D->compute bwd)
  ring_free[r]    reader -> writer  never overwrite a ring slot still being read
  grad landed     D2H -> worker     AdamW reads a complete gradient (the worker waits on the host)
  loss_ready      compute -> host   the loss is in pinned memory
and three host-side hand-offs: a unit's update finishes before its weights are copied again (_ready), a
gradient waits for a free staging slab (without deferral, see STAGING_SLABS), and the embedding's gradient
is scattered after its dy landed.

Numerics (DESIGN.md section 2): with bf16 compute the blocks and the head run under torch.autocast(bf16), the
residual stream (x between layers, the boundary checkpoints, dy) stays fp32 unless residual_dtype=bf16 asks to
save memory: the arithmetic of autocast on the reference trainer, with weights from the bf16 shadow.

Try it
    python -m pytest tests/test_stream.py       # CPU: equals the reference trainer step for step
    python -m megatrain_min.sim check           # the ordering, proven by a happens-before checker
    python train.py --engine stream             # the default engine of train.py
"""
import contextlib
import math
import os
import queue
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor

import torch

import model
from optim import HostAdamW, check_hyper, clip_coef

# Pinned fp32 staging slabs for gradients on their way to the optimizer (when updates are not deferred): two
# rotate, and a tied head may hold a third until the embedding scatter. With fewer free slabs than units in
# flight the main thread waits for the worker; plan.py sizes more when D2H + AdamW outlast two backwards.
STAGING_SLABS = 3
RING = 2  # device slots that boundary checkpoints pass through on their way to and from the host


def default_dtype(device_type):
    """The compute dtype when none is asked for: bf16 on CUDA, fp32 on the CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if device_type == "cuda" else torch.float32


def cpu_threads(device_type, procs=1):
    """(main, worker): the OpenMP threads of the thread that runs step() and of the optimizer thread. Their sum is
    this process's share of the CPUs it may run on (its affinity mask -- taskset, a container, torchrun's
    --numa-binding -- split among `procs` engines on this host: the ranks of a sharded run), never more: two teams
    that each span every core oversubscribe them, and OpenMP's spinning barriers then slow both by 10x or more.
    With CUDA the main thread keeps two (it issues kernels and gathers embedding rows), AdamW gets the rest; on
    the CPU the main thread computes the model and the worker gets a quarter."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = max(1, usable // procs)
    worker = max(1, share - 2) if device_type == "cuda" else max(1, share // 4)
    return max(1, share - worker), worker


def step_device_bytes(cfg, tokens, micro_batches, dtype, residual_dtype, chunk_tokens, n_slot, seq_len=None,
                      tile_tokens=0):
    """What a step holds on the device beside the weight/grad slots and the boundary checkpoints, by component:
    plan.py prints it, offload_needed weighs it. tokens: per step; n_slot: elements of a slot; seq_len: tokens
    per sequence (default: one sequence per micro-batch); tile_tokens: model.block's tile (0 = untiled)."""
    cb, rb, per_mb = dtype.itemsize, residual_dtype.itemsize, tokens // micro_batches
    seq_len = seq_len or per_mb
    chunk = min(chunk_tokens, per_mb)
    layer = model.block_activation_bytes(cfg, per_mb, cb, rb, tile_tokens, seq_len)
    if tile_tokens:  # the whole sequence's attention, and one tile of the token-local parts
        attn = model.attention_bytes(cfg, per_mb, cb)
        layer = {f"whole-sequence attention: {per_mb:,} tok": attn,     # q, k, v, out, grads, kernel workspace
                 f"token-local activations: tiles of {min(tile_tokens, seq_len):,} tok": layer - attn}
    else:
        layer = {f"recompute activations: 1 layer, {per_mb:,} tok": layer}
    return {"residual stream x and its grad dy": 2 * tokens * cfg.d_model * rb, **layer,
            f"weight grads from autograd ({str(dtype)[6:]}, one unit)": n_slot * cb,
            f"loss chunk: {chunk:,} tokens x {cfg.vocab_size:,} logits":  # logits, fp32 copy, log-softmax, grads
                chunk * cfg.vocab_size * (12 + (2 * cb if cb == 2 else 0)),
            f"RoPE cos, sin: {seq_len:,} positions": 2 * seq_len * cfg.head_dim * rb,
            "targets": tokens * 8}


def offload_needed(ckpt_bytes, working_bytes, free_bytes):
    """The rule for offload_checkpoints=None (plan.py applies the same one): offload the boundary checkpoints
    to host memory when, with one layer's working set beside them, they would not fit in the free device memory."""
    return ckpt_bytes + working_bytes > free_bytes


def read_unit(layout, weights, flat):
    """Fill `flat`, one unit's fp32 buffer, with the unit's tensors from `weights`, each checked (shape, finite).
    hf.load_hf's lazy weights fill a view in place (read_into)."""
    read_into = getattr(weights, "read_into", None)
    for key, view in layout.key_views(flat).items():
        read_into(key, view) if read_into else view.copy_(model.check_tensor(key, weights[key], view.shape))
    model.check_finite(layout.key_views(flat))


# ----------------------------------------------------------------------------- the hardware, as the engine sees it
class Lane:
    """A CUDA stream on `device`, or nothing on the CPU (work then runs synchronously, in program order)."""

    def __init__(self, device=None, sync=False):
        self.stream = torch.cuda.Stream(device=device) if device is not None else None
        self.sync = sync  # debug: synchronise after every recorded operation (the race detector's baseline)

    def __call__(self):  # `with lane():` -- issue the work inside on this stream (and on its device)
        if self.stream is None:
            return contextlib.nullcontext()
        if self.sync:
            torch.cuda.synchronize(self.stream.device)
        return torch.cuda.stream(self.stream)

    def wait(self, event):
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def record(self):
        if self.stream is None:
            return None
        if self.sync:
            torch.cuda.synchronize(self.stream.device)
        return self.stream.record_event()

    def keep(self, t):  # t was allocated on another stream: the caching allocator must not reuse it early
        if self.stream is not None:
            t.record_stream(self.stream)


class Lanes:
    """What the engine asks of the hardware: three lanes, the host's waits on them, pinned memory and the
    optimizer thread. megatrain_min/sim.py supplies a checked backend with the same methods, which records
    every ordering edge; the engine does not know which one it runs on."""

    def __init__(self, device, sync=False, procs=1):
        cuda = device.type == "cuda"
        self.device, self.pin = device, cuda
        self.h2d, self.comp, self.d2h = (Lane(device if cuda else None, sync) for _ in range(3))
        # one optimizer thread; torch.set_num_threads sizes the calling thread's own OpenMP team (per thread)
        self.threads = cpu_threads(device.type, procs)             # (main, worker)
        torch.set_num_threads(self.threads[0])
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adamw", initializer=self._worker_init)

    def _worker_init(self):
        """The optimizer thread's OpenMP team, and its current CUDA device (per thread: else its event waits and
        any CUDA call would create a context on GPU 0)."""
        torch.set_num_threads(self.threads[1])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def host_wait(self, event):
        """Block the calling host thread until the device passed `event` (no-op on the CPU)."""
        if event is not None:
            event.synchronize()

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def free_memory(self):
        """Bytes the device has free now, or None when device buffers live in host memory (the CPU)."""
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None

    def submit(self, fn, *args):
        """Run fn(*args) on the optimizer thread; returns a concurrent.futures.Future."""
        return self.worker.submit(fn, *args)

    def slab_pool(self):
        return queue.Queue()


# one step's input, staged: tokens (B, T) on the host, targets (B, T) on the device (see _prepare)
Batch = namedtuple("Batch", "tokens targets n_tok rope offload")


class Trainer:
    def __init__(self, cfg, weights, device=None, dtype=None, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.1, grad_clip=0.0, micro_batches=1, offload_checkpoints=None,
                 chunk_tokens=None, mode="fast", residual_dtype=None, staging_slabs=STAGING_SLABS,
                 skip_nonfinite=False, sync=False, lanes=None, tile_tokens=0):
        """cfg: model.GPTConfig; weights: {key: fp32 tensor} as model.init_weights returns.

        device      "cuda[:i]" or "cpu" (default: cuda when available).
        dtype       compute dtype, torch.bfloat16 or torch.float32 (default_dtype: bf16 on CUDA, fp32 on CPU).
        grad_clip   global grad-norm clip, 0 = off. Clipping defers the updates until every gradient is on
                    the host (the norm needs them all), which keeps an fp32 gradient per parameter there.
        offload_checkpoints  keep the boundary checkpoints in pinned host memory; None = decide at the first
                    step by offload_needed (reported in self.offload_checkpoints).
        mode        "fast" streams a compute-dtype shadow of the master; "lean" streams the fp32 master and
                    casts on the GPU (no shadow: 12 B/param + gradients on the host).
        residual_dtype  the residual stream's dtype (x, checkpoints, dy): fp32 by default, as under autocast;
                    torch.bfloat16 halves those bytes at some accuracy (README: Numerics).
        staging_slabs  pinned gradient slabs without deferral (STAGING_SLABS; plan.py gives the count to use).
        skip_nonfinite  a step with a non-finite loss (or, deferred, gradient norm) updates nothing. Without
                    deferral a unit whose gradient is not finite keeps its weights while the others update; its
                    name is in self.skipped_units, complete once the step's updates are done (wait()).
        tile_tokens  run each layer's token-local parts (norms, projections, MLP) this many tokens at a time, in
                    forward, recompute and backward (model.block); 0 = untiled. plan.py picks one for long T.
        sync        synchronise after every operation (debug). lanes: the hardware backend (default Lanes).
        """
        if mode not in ("fast", "lean"):
            raise ValueError(f"mode must be 'fast' or 'lean', got {mode!r}")
        if dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"compute dtype must be torch.bfloat16 or torch.float32, got {dtype} "
                             f"(fp16 would need loss scaling)")
        if residual_dtype not in (None, torch.float32, torch.bfloat16) or (residual_dtype == torch.bfloat16
                                                                           and dtype == torch.float32):
            raise ValueError(f"residual_dtype must be torch.float32, or torch.bfloat16 with bf16 compute; "
                             f"got {residual_dtype} with compute dtype {dtype}")
        check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_clip=grad_clip, micro_batches=micro_batches)
        model.check_weights(cfg, weights, tensors=False)  # the keys; each tensor is checked as the loop below reads it
        self.cfg = cfg
        self.dev = model.check_device(device)
        self.lanes = lanes or Lanes(self.dev, sync)
        self.h2d, self.comp, self.d2h = self.lanes.h2d, self.lanes.comp, self.lanes.d2h
        self.dtype = dtype or default_dtype(self.dev.type)
        self.residual_dtype = residual_dtype or torch.float32
        self.M = micro_batches
        self.lr = lr
        self.grad_clip = grad_clip
        self.defer_updates = bool(grad_clip)   # the update of any unit waits for the global gradient norm
        self.skip_nonfinite = skip_nonfinite
        self.skipped = False                   # did the last step skip its update (non-finite)?
        self.skipped_units = []                # names of the units whose update the last step skipped (no deferral)
        self.grad_norm = None                  # the last step's global gradient norm (deferred updates only)
        self.chunk = chunk_tokens or model.default_chunk_tokens(cfg)
        if tile_tokens < 0:
            raise ValueError(f"tile_tokens must be >= 0 (0 = no tiling), got {tile_tokens}")
        self.tile = tile_tokens
        self.offload_checkpoints = offload_checkpoints
        if self.dev.type == "cuda" and self.dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = False  # "fp32" means fp32 unless asked otherwise
            torch.backends.cudnn.allow_tf32 = False

        # ---- host store: every unit's master/m/v (+ gradients when deferred, + compute-dtype shadow in fast mode)
        self.units = model.units(cfg)          # [embed], layer.0..layer.{L-1}, head
        self.layers = [u for u, lay in enumerate(self.units) if lay.name.startswith("layer.")]
        self.head = len(self.units) - 1
        self.embed = self.head if cfg.tie_embeddings else 0  # see "tied embeddings" below
        shadow = self.dtype if (mode == "fast" and self.dtype != torch.float32) else None
        self.opt = HostAdamW(self.store_sizes(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             pin=self.lanes.pin, shadow_dtype=shadow, grad_store=self.defer_updates)
        for u in range(len(self.units)):
            self.fill_unit(u, weights)
        # Without deferral a unit's gradient lives on the host only until its update: staging slabs suffice.
        self.slabs = self.lanes.slab_pool()    # the free slabs; the worker puts a slab back after each update
        self.held = {}                         # unit -> the slab its gradient sits in
        if not self.defer_updates:
            biggest = max(n for n, _ in self.opt.sizes)
            for _ in range(staging_slabs):
                self.slabs.put(torch.zeros(biggest, pin_memory=self.lanes.pin))
        self.staging = {}                      # name -> pinned per-step buffer of the last shape: pinned()
        self.loss_host = torch.zeros((), dtype=torch.float32, pin_memory=self.lanes.pin)
        self.pending = {}                      # unit -> Future of its update (or of its squared grad norm)
        self.failed = []                       # exceptions raised on the optimizer thread (see _submit)

        # ---- GPU: two weight slots (ping-pong), two fp32 grad slots. Independent of depth. Allocated and
        # zeroed on the compute lane, which uses them first: the pool streams do not wait for the default one.
        lay, head = self.units[self.layers[0]], self.units[self.head]
        n_slot = max(self.slot_numel(self.layers[0]), self.slot_numel(self.head))
        with self.comp():
            self.wslot = [torch.empty(n_slot, dtype=self.dtype, device=self.dev) for _ in range(2)]
            self.gslot = [torch.zeros(n_slot, dtype=torch.float32, device=self.dev) for _ in range(2)]
        with self.h2d():  # lean mode: the fp32 master lands here and is cast into the slot on the GPU, all on H2D
            # (the largest unit in the store: the head, or a layer; a sharded engine's store holds shards)
            self.stage = (torch.empty(max(n for n, _ in self.opt.sizes), dtype=torch.float32, device=self.dev)
                          if shadow is None and self.dtype != torch.float32 else None)
        # Views made once per slot ("stateless layer templates"): every layer has the same layout, so a slot's
        # views serve whichever layer it holds. Weight views are detached leaves that autograd differentiates.
        leaves = lambda flat, layout: {k: v.detach().requires_grad_() for k, v in layout.views(flat).items()}  # noqa
        self.wviews = [{"layer": leaves(w, lay), "head": leaves(w, head)} for w in self.wslot]
        self.gviews = [{"layer": lay.views(g), "head": head.views(g)} for g in self.gslot]
        # the events that order the slots (None: nothing to wait for yet)
        self.slot_loaded = [None, None]        # H2D: weight slot s holds its unit's weights
        self.slot_free = [None, None]          # compute: done reading weight slot s
        self.gslot_free = [None, None]         # D2H: done copying grad slot s out
        # offloaded checkpoints pass through RING device buffers (_ring_slot), each with its two events
        self.ring = {}                         # shape -> the RING device buffers (the last shape only)
        self.ring_ready = [None] * RING        # its copy (compute: in; H2D: back) is done
        self.ring_free = [None] * RING         # its reader (D2H: out; compute: the backward) is done
        self.resident = {}                     # unit -> the weight slot holding its current weights
        self.rope = {}                         # T -> (cos, sin) on the device (the last T only)
        self.batch = None                      # the step being run: its staged input (Batch)
        self.lanes.synchronize()               # the device buffers exist before any lane's first touch of them

    # ------------------------------------------------------------------ what this process holds and sums (hooks)
    # One process holds every unit whole and computes the whole batch. megatrain_min/sharded.py replaces these
    # (and load_unit, embed_rows, dy_to_host, grad_to_host, add_embedding_grad, update_unit) for N ranks.
    def store_sizes(self):
        """Hook. (numel, n_decay) of each unit's buffers in the host store: the whole unit, [matrices | vectors]."""
        return [(lay.numel, lay.n_decay) for lay in self.units]

    def fill_unit(self, u, weights):
        """Hook. Unit u's tensors from `weights` into its fp32 master in the store (read_unit), then its shadow."""
        read_unit(self.units[u], weights, self.opt.master[u])
        self.opt.refresh_shadow(u)

    def slot_numel(self, u):
        """Hook. Elements of a weight or grad slot that unit u occupies: its numel."""
        return self.units[u].numel

    def local_batch(self, x):
        """Hook. The rows of the step's (B, T) batch that this process computes: all of them."""
        return x

    def reduce_loss(self, loss):
        """Hook. The step's loss from this process's share, a device scalar on the compute lane: all of it."""
        return loss

    def global_sum(self, x):
        """Hook. A host number (the squared gradient norm) summed over the processes of the run: this one."""
        return x

    rank, world = 0, 1   # this process's place in the run: the only one (sharded.py: rank r of N)

    def owned(self, u):
        """Hook. The elements [lo, hi) of unit u's flat buffer that this process's store holds (checkpoint.py
        saves and loads by it): all of them, at the start of opt.master[u]."""
        return 0, self.units[u].numel

    def gather_object(self, obj):
        """Hook. obj of every process of the run, in rank order (checkpoint.py agrees through it): this one's."""
        return [obj]

    # ------------------------------------------------------------------ the surface beyond step()
    def buffers(self):
        """{name: tensor} of the buffers the engine holds now, named as a person reads them in a report: weight and
        grad slots, the lean stage, the host store per unit, the pinned staging, the checkpoint ring, RoPE, the
        step's targets. The stream checker (megatrain_min/sim.py) names the buffers of its reports by it."""
        named = {f"wslot[{i}]": w for i, w in enumerate(self.wslot)}
        named.update({f"gslot[{i}]": g for i, g in enumerate(self.gslot)}, stage=self.stage, loss_host=self.loss_host)
        for what in ("master", "m", "v", "grad", "shadow"):
            named.update({f"{what}[{self.units[u].name}]": b for u, b in enumerate(getattr(self.opt, what) or [])})
        named.update({f"{name} (pinned staging)": b for name, b in self.staging.items()})
        named.update({f"ring[{i}]": r for ring in self.ring.values() for i, r in enumerate(ring)})
        named.update({f"rope[{T}]": c for T, cs in self.rope.items() for c in cs})
        if self.batch is not None:
            named["targets"] = self.batch.targets
        return {k: v for k, v in named.items() if v is not None}

    def set_lr(self, lr):
        check_hyper(lr=lr)
        self.lr = lr

    def wait(self):
        """Block until every update in flight has finished and the device is idle: the host store is then
        consistent (checkpoints, weights(), export). Re-raises an optimizer-thread failure."""
        for u in list(self.pending):
            self._ready(u)
        self.lanes.synchronize()

    def weights(self, copy=True):
        """{key: fp32 CPU tensor} of the master weights, after all pending updates: copies, or with
        copy=False views into the host store itself (no second copy of the model; valid until the next step)."""
        self.wait()
        return {k: v.clone() if copy else v
                for u, lay in enumerate(self.units) for k, v in lay.key_views(self.opt.master[u]).items()}

    def reset_optimizer(self):
        """Keep the weights, forget Adam's moments and step counts (fine-tuning from a checkpoint's weights)."""
        self.wait()
        self.opt.reset()

    # ------------------------------------------------------------------ one training step
    def step(self, tokens, targets):
        """tokens, targets: (B, T) int64 CPU tensors, targets == -100 ignored. Returns the step's mean
        loss (before the update). Updates may still be running on the worker when this returns."""
        b = self._prepare(tokens, targets, train=True)
        self.skipped, self.skipped_units = False, []
        with self.comp(), self._autocast():
            x, ckpt = self._forward(b, keep=True)
            dy, loss_ready = self._head(x, b, backward=True)  # the head's gradient waits in grad slot 0
            del x                                             # the backward holds dy, not x (long T: GBs)
            if self.skip_nonfinite and not self.defer_updates and not self._loss_finite(loss_ready):
                self.slot_free[self.resident[self.head]] = self.comp.record()  # no gradient leaves the GPU
                self.skipped = True
                return self.loss_host.item()
            self._drain(self.head, 0)
            dy = self._backward(dy, ckpt, b)
            dy_host, dy_ready = self.dy_to_host(dy)           # dy of layer 0: the embedding's gradient (B, T, d)
        self._host_grad(self.embed)                            # the tied head already holds one
        self._submit(self.embed, self._scatter_embedding, b.tokens, dy_host, dy_ready, self.lr)

        self.lanes.host_wait(loss_ready)
        loss = self.loss_host.item()
        if self.defer_updates:  # every squared norm known: clip, then update in the order the forward needs
            sq = sum(self.pending.pop(u).result() for u in range(len(self.units)))
            self.grad_norm = math.sqrt(self.global_sum(sq))           # a sharded run: over every rank's shards
            if self.skip_nonfinite and not math.isfinite(self.grad_norm + loss):
                self.skipped = True                                   # weights, m, v and step counts untouched
                return loss
            coef = clip_coef(self.grad_norm, self.grad_clip)
            for u in [self.embed] + [u for u in range(len(self.units)) if u != self.embed]:
                self._submit(u, self.opt.step, u, self.lr, coef)
        return loss

    @torch.no_grad()
    def evaluate(self, tokens, targets):
        """Mean loss of (tokens, targets) with the current weights: the forward half of a step, streamed."""
        b = self._prepare(tokens, targets, train=False)
        with self.comp(), self._autocast():
            x, _ = self._forward(b, keep=False)
            _, loss_ready = self._head(x, b, backward=False)
            self.slot_free[self.resident[self.head]] = self.comp.record()
        self.lanes.host_wait(loss_ready)
        return self.loss_host.item()

    def _autocast(self):
        """bf16 compute = torch.autocast(bf16) around blocks and head, exactly as on the reference trainer."""
        return torch.autocast(self.dev.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def _prepare(self, tokens, targets, train):
        """Check the batch and stage it: the targets go to the device on the H2D lane now, from a pinned buffer;
        the tokens stay on the host, where the embedding rows are gathered."""
        model.check_batch(self.cfg, tokens, targets)
        model.check_seq_len(self.cfg, tokens.shape[1])         # a sliding window cannot be computed past
        n_tok = max(1, int((targets != model.IGNORE).sum()))   # loss = sum / n_tok over the whole step
        targets = self.local_batch(targets)                    # the sequences this process computes: all of them
        B, T = targets.shape
        if B % self.M:
            raise ValueError(f"batch size {B} is not divisible by micro_batches={self.M}")
        tgt_host = self.pinned("targets", (B, T), torch.int64)
        tgt_host.copy_(targets)
        with self.h2d():  # made on the lane that writes it, kept for compute, which reads it. No event of its own:
            #               it is the step's first H2D, and compute waits for layer 0's weight copy (slot_loaded),
            #               queued behind it, before any layer runs
            tgt = torch.empty((B, T), dtype=torch.int64, device=self.dev)
            tgt.copy_(tgt_host, non_blocking=True)
        self.comp.keep(tgt)
        with self.comp():
            if T not in self.rope:               # on the compute lane: its only reader
                self.rope = {T: model.rope_cache(self.cfg, T, self.dev, self.residual_dtype)}
        offload = False
        if train:
            if self.offload_checkpoints is None:  # decided once, at the first step
                self.offload_checkpoints = self._decide_offload(B, T)
            offload = self.offload_checkpoints
            if offload:  # the host copies and the device ring, made before any work of the step is issued
                self.pinned("checkpoints", (len(self.layers), B, T, self.cfg.d_model), self.residual_dtype)
                self._ring_slot(0, (B, T, self.cfg.d_model))
        self.batch = Batch(tokens, tgt, n_tok, self.rope[T], offload)
        return self.batch

    def _decide_offload(self, B, T):
        free = self.lanes.free_memory()
        if free is None:
            return False
        act = B * T * self.cfg.d_model * self.residual_dtype.itemsize     # one (B, T, d) residual tensor
        working = step_device_bytes(self.cfg, B * T, self.M, self.dtype, self.residual_dtype, self.chunk,
                                    self.wslot[0].numel(), seq_len=T, tile_tokens=self.tile)
        return offload_needed(len(self.layers) * act, sum(working.values()), free)

    def pinned(self, name, shape, dtype):
        """The pinned host buffer `name`, made once and reused by every step of the same shape: no cudaHostAlloc or
        cudaFreeHost per step (cudaFreeHost synchronises the device). A new shape replaces it (the pinned allocator
        frees the old one once its copies are done): the buffers stay bounded whatever shapes come."""
        buf = self.staging.get(name)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype:
            buf = self.staging[name] = torch.empty(shape, dtype=dtype, pin_memory=self.lanes.pin)
        return buf

    # ------------------------------------------------------------------ weights in
    def _ready(self, u):
        """Block until unit u's last update finished (never copy half-updated weights)."""
        fut = self.pending.pop(u, None)
        if fut is not None:
            fut.result()

    def _load(self, u, slot):
        """Unit u's weights into wslot[slot] (load_unit), after its last update; remember which slot holds it."""
        self._ready(u)
        self.load_unit(u, slot)
        self.resident = {k: s for k, s in self.resident.items() if s != slot}
        self.resident[u] = slot

    def load_unit(self, u, slot):
        """Hook. H2D: unit u's weights into wslot[slot], one contiguous copy, once compute is done with the slot;
        sets slot_loaded[slot]. The one place weights cross to the GPU (a subclass may count or replace it)."""
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

    def _prefetch(self, u, busy_slot):
        """Make sure unit u is (being) loaded into the slot that the current visit does not use."""
        if u not in self.resident:
            self._load(u, 1 - busy_slot)
        return self.resident[u]

    # ------------------------------------------------------------------ tied embeddings
    # With tie_embeddings there is no embed unit: the head's first V*d elements (lm_head) ARE the embedding
    # table, and self.embed is the head. Four consequences, all here or marked "tied": the rows are gathered
    # from unit self.embed; the embedding's gradient is scattered into that unit's gradient, on top of the
    # head's own lm_head gradient when tied (its D2H landed first, same lane); so that unit is handed to the
    # optimizer only after the scatter (_drain skips it); and its update comes first in the deferred order.
    def _table(self, flat):
        """The (V, d) embedding table inside a flat buffer of unit self.embed (its first entry either way)."""
        V, d = self.cfg.vocab_size, self.cfg.d_model
        return flat[:V * d].view(V, d)

    def embed_rows(self, b):
        """Hook. x for the step: the embedding rows of its tokens, gathered on the host by one index_select into a
        pinned buffer (only B x T x d cross PCIe, never the table), from the fp32 master -- or the bf16 shadow
        when the residual stream is bf16. Returns M x (B/M, T, d) in the residual dtype, on the compute lane."""
        src = self.opt.master[self.embed]
        if self.residual_dtype != torch.float32 and self.opt.shadow is not None:
            src = self.opt.shadow[self.embed]
        table, d = self._table(src), self.cfg.d_model
        rows = self.pinned("rows", (*b.tokens.shape, d), table.dtype)                 # (B, T, d) pinned
        torch.index_select(table, 0, b.tokens.reshape(-1), out=rows.view(-1, d))
        with self.h2d():                                     # made on the lane that writes it, kept for compute
            x = torch.empty(rows.shape, dtype=rows.dtype, device=self.dev)
            x.copy_(rows, non_blocking=True)
            ready = self.h2d.record()
        self.comp.wait(ready)
        self.comp.keep(x)
        return list(x.to(self.residual_dtype).chunk(self.M))                  # lean + bf16 residual: cast here

    def _scatter_embedding(self, tokens, dy_host, dy_ready, lr):
        """Worker: once dy of layer 0 is on the host, the embedding's gradient (add_embedding_grad), its update."""
        try:
            self.lanes.host_wait(dy_ready)
            self.add_embedding_grad(tokens, dy_host)
        except BaseException:
            self._release(self.embed)
            raise
        return self._grad_landed(self.embed, None, lr)

    def add_embedding_grad(self, tokens, dy_host):
        """Hook (worker). Add dy of layer 0, (B, T, d) on the host, into the rows of opt.grad[embed] that the tokens
        (B, T) used: one index_add."""
        grad = self._table(self.opt.grad[self.embed])
        if self.embed != self.head:
            grad.zero_()                   # untied: the scatter is the whole embedding gradient
        # tied: the head's D2H wrote the lm_head gradient here first (same lane, before dy_ready)
        grad.index_add_(0, tokens.reshape(-1), dy_host.reshape(-1, grad.shape[1]).float())

    # ------------------------------------------------------------------ forward, head, backward
    @torch.no_grad()
    def _forward(self, b, keep):
        """Embedding + all layers, layer-major, no autograd graph, one micro-batch at a time (so that one layer's
        transients are a micro-batch's, as in the backward). Returns (x, ckpt): x is M x (B/M, T, d) on the
        compute lane; ckpt[i] = the inputs of layer i: on the device, or (offloaded) their pinned host copy."""
        cfg, L = self.cfg, len(self.layers)
        self.resident = {}                              # last step's slots hold stale weights
        self._load(self.layers[0], 0)
        self._ready(self.embed)                         # the rows come from the embedding's updated master
        x = self.embed_rows(b)
        ckpt = []
        for i, u in enumerate(self.layers):
            s = self.resident[u]
            self.comp.wait(self.slot_loaded[s])
            w = self.wviews[s]["layer"]                 # views into weight slot s, compute dtype
            if keep:                                    # boundary checkpoint: the input of layer i
                ckpt.append(self._offload(i, x) if b.offload else x)
            x = [model.block(cfg, x_j, w, b.rope, self.tile) for x_j in x]      # (B/M, T, d) each
            self.slot_free[s] = self.comp.record()
            self._prefetch(self.layers[i + 1] if i + 1 < L else self.head, s)
        return x, ckpt

    def _head(self, x, b, backward):
        """Final norm + LM head + loss per micro-batch in token chunks (model.head_grad: no (B*T, V) logits). With
        backward the head's gradient is accumulated into grad slot 0 and dy (M x (B/M, T, d)) is returned for the
        last layer. Returns (dy, loss_ready): the loss is in self.loss_host once the host waited for loss_ready."""
        cfg = self.cfg
        s = self.resident[self.head]
        self._prefetch(self.layers[-1], s)              # resident already: the last layer stays in its slot
        self.comp.wait(self.slot_loaded[s])
        w = self.wviews[s]["head"]
        if backward:
            gs = self._grad_slot(self.head, 0)
        loss, dy = torch.zeros((), dtype=torch.float32, device=self.dev), []
        for x_j, tgt in zip(x, b.targets.chunk(self.M)):                          # per micro-batch, as the oracle
            xf, tgt = x_j.reshape(-1, cfg.d_model), tgt.reshape(-1)             # (B/M*T, d), (B/M*T,)
            if backward:
                lj, dx = model.head_grad(cfg, xf, w, tgt, b.n_tok, self.gviews[gs]["head"], self.chunk)
                dy.append(dx.view_as(x_j))
            else:
                lj = model.chunked_loss_sum(cfg, xf, w, tgt, self.chunk) / b.n_tok
            loss += lj
        self.loss_host.copy_(self.reduce_loss(loss), non_blocking=True)
        return dy, self.comp.record()

    def _loss_finite(self, loss_ready):
        """The non-finite guard without deferral: the host waits for the head (one sync per step)."""
        self.lanes.host_wait(loss_ready)
        return math.isfinite(self.loss_host.item())

    def _backward(self, dy, ckpt, b):
        """Layers L-1..0: recompute from the boundary checkpoint with grad (model.block_grad), one micro-batch at a
        time (what autograd saves is one micro-batch's), fp32 accumulation over them, then the gradient drains to
        the host. Returns the gradient w.r.t. layer 0's input, M x (B/M, T, d)."""
        L = len(self.layers)
        nxt = self._reload(L - 1, ckpt) if b.offload else None
        for i in reversed(range(L)):
            u = self.layers[i]
            s = self.resident[u]
            if b.offload:                               # the next layer's inputs come back while this one computes
                (xs, r), nxt = nxt, (self._reload(i - 1, ckpt) if i > 0 else None)
                self.comp.wait(self.ring_ready[r])
            else:
                xs = ckpt[i]
            if i > 0:
                self._prefetch(self.layers[i - 1], s)
            self.comp.wait(self.slot_loaded[s])
            gs = self._grad_slot(u, L - i)
            w, acc = self.wviews[s]["layer"], self.gviews[gs]["layer"]
            for j in range(self.M):
                dy[j] = model.block_grad(self.cfg, xs[j], w, b.rope, dy[j], acc, self.tile)
            if b.offload:
                self.ring_free[r] = self.comp.record()
            ckpt[i] = xs = None
            self._drain(u, gs)
        return dy

    # ------------------------------------------------------------------ activations to and from the host
    def _ring_slot(self, i, shape):
        """Device ring slot of layer i's checkpoint: RING buffers of (B, T, d), made for the step's shape (on compute,
        which writes them first; the H2D of the backward's reloads waits for compute's reads of them)."""
        if shape not in self.ring:
            with self.comp():
                self.ring = {shape: [torch.empty(shape, dtype=self.residual_dtype, device=self.dev)
                                     for _ in range(RING)]}
        return i % RING, self.ring[shape][i % RING]

    def _offload(self, i, x):
        """Layer i's input to host memory through a ring slot: compute copies x into the slot once its previous
        D2H finished, D2H copies the slot out. The ring bounds the device memory whatever the host's lead."""
        r, slot = self._ring_slot(i, (self.M * x[0].shape[0], *x[0].shape[1:]))
        self.comp.wait(self.ring_free[r])
        for dst, x_j in zip(slot.chunk(self.M), x):
            dst.copy_(x_j)
        self.ring_ready[r] = self.comp.record()
        host = self.pinned("checkpoints", (len(self.layers), *slot.shape), self.residual_dtype)[i]
        with self.d2h():
            self.d2h.wait(self.ring_ready[r])
            host.copy_(slot, non_blocking=True)
            self.ring_free[r] = self.d2h.record()
        return host

    def _reload(self, i, ckpt):
        """H2D of layer i's offloaded checkpoint into its ring slot once the slot's last reader is done: compute,
        in the backward; for the first two reloads, the forward's D2H of this very checkpoint -- so its host copy
        has landed too (the later ones' D2Hs ran before those, on the same lane). Returns (M x (B/M, T, d) views
        of the slot, ring index)."""
        host = ckpt[i]
        r, slot = self._ring_slot(i, tuple(host.shape))
        with self.h2d():
            self.h2d.wait(self.ring_free[r])
            slot.copy_(host, non_blocking=True)
            self.ring_ready[r] = self.h2d.record()
        return slot.chunk(self.M), r

    def dy_to_host(self, dy):
        """Hook. D2H of dy, M x (B/M, T, d), into one pinned (B, T, d) buffer; returns (buffer, event). No event of its
        own: it is queued on D2H right behind layer 0's gradient, whose copy waited for the compute that made dy."""
        host = self.pinned("dy", (self.M * dy[0].shape[0], *dy[0].shape[1:]), dy[0].dtype)
        with self.d2h():
            for dst, x in zip(host.chunk(self.M), dy):
                self.d2h.keep(x)
                dst.copy_(x, non_blocking=True)
            done = self.d2h.record()
        return host, done

    # ------------------------------------------------------------------ gradient plumbing
    def _grad_slot(self, u, k):
        """Grad slot k % 2 for unit u, zeroed once its previous D2H copy finished. Returns the slot index."""
        gs = k % 2
        self.comp.wait(self.gslot_free[gs])
        self.gslot[gs][:self.slot_numel(u)].zero_()
        return gs

    def _drain(self, u, gs):
        """Compute is done with unit u: free its weight slot, D2H its gradient, hand it to the worker."""
        self.slot_free[self.resident[u]] = ev = self.comp.record()
        self._host_grad(u)
        done = self.grad_to_host(u, gs, ev)
        if u != self.embed:  # tied: the head is handed over after the embedding scatter
            self._submit(u, self._grad_landed, u, done, self.lr)

    def grad_to_host(self, u, gs, ready):
        """Hook. D2H of unit u's fp32 gradient from gslot[gs] (complete at event `ready` of the compute lane) into
        opt.grad[u]; sets gslot_free[gs]. Returns the event after which opt.grad[u] holds it."""
        n = self.units[u].numel
        with self.d2h():
            self.d2h.wait(ready)
            self.opt.grad[u].copy_(self.gslot[gs][:n], non_blocking=True)
            self.gslot_free[gs] = done = self.d2h.record()
        return done

    def _host_grad(self, u):
        """Point opt.grad[u] at a free staging slab, unless the store keeps a gradient per unit (deferred) or
        u holds one already (tied). Waits for the worker to give one back; re-raises a failed update."""
        if self.defer_updates or self.opt.grad[u] is not None:
            return
        self.held[u] = self.slabs.get()      # the worker puts slabs back even when an update fails
        if self.failed:                      # ... and notes the failure (_submit): raise it here, not later
            raise self.failed[0]
        self.opt.grad[u] = self.held[u][:self.opt.sizes[u][0]]

    def _submit(self, u, fn, *args):
        """Hand fn(*args) to the optimizer thread as unit u's pending work. A failure is noted at once, so that
        the main thread raises it at its next slab (_host_grad) instead of running on without that update."""
        fut = self.lanes.submit(fn, *args)
        fut.add_done_callback(self._note_failure)
        self.pending[u] = fut

    def _note_failure(self, fut):
        if fut.exception() is not None:
            self.failed.append(fut.exception())

    def _release(self, u):
        if not self.defer_updates:
            self.opt.grad[u] = None
            self.slabs.put(self.held.pop(u))

    def _grad_landed(self, u, done, lr):
        """Worker: wait for unit u's gradient on the host, then update it now (no deferral) or return its
        squared norm for the global clip (the update follows in step())."""
        try:
            self.lanes.host_wait(done)
            if self.defer_updates:
                return self.opt.grad_sq(u)
            if not self.update_unit(u, lr):
                self.skipped_units.append(self.units[u].name)      # a non-finite gradient: this unit keeps its weights
        finally:
            self._release(u)

    def update_unit(self, u, lr):
        """Hook (worker). AdamW on unit u with its gradient on the host; False when skip_nonfinite found it not
        finite and changed nothing."""
        return self.opt.step(u, lr, finite_only=self.skip_nonfinite)
