"""sharded.py -- ZeRO-3 over the host store: N GPUs, on one node or several, train one model through torch.distributed.

What it is
    ShardedTrainer is stream.Trainer on one rank of N. Every unit's flat buffer -- fp32 master, Adam m and v, the
    compute-dtype shadow, the fp32 gradient -- is cut into N equal shards (the last padded with zeros): rank r's
    host store holds shard r of every unit, so a node holds 1/K of the model's host state (K nodes) and each GPU's
    PCIe link carries 1/N of every unit. One layer visit, what crosses which wire (n: the unit's elements):

        H2D      rank r's shard of the unit, compute dtype        PCIe, this GPU's link      n/N
        gather   all_gather of the N shards into a weight slot   NVLink (InfiniBand)        (N-1)/N x n in
        compute  this rank's B/N sequences, in its M micro-batches
        scatter  reduce_scatter of the fp32 gradient slot        NVLink (InfiniBand)        (N-1)/N x n out, fp32
        D2H      shard r of the summed gradient, fp32           PCIe                       n/N
        AdamW    shard r, on the rank's optimizer thread (clipping: the squared norm summed over the ranks)

    The collectives are issued on a fourth lane, comm, and ordered by events like the copies. With NCCL, c10d
    runs a collective on its own stream after the work issued so far on the current stream (comm) and makes
    comm wait for it, so events recorded on comm mark its end: to the stream checker (megatrain_min/sim.py) a
    collective is an op of the comm lane that reads its input and writes its output (megatrain_min/cost.py
    names what each c10d op writes: their schemas do not).
The embedding
    Sharded like any unit. Its rows are gathered where that moves the fewest bytes without a (V, d) buffer on the
    GPU: every rank knows the whole step's token ids (the global batch), so it writes, for every token of the
    step, the part of the token's row that its shard holds (zeros elsewhere) into a pinned (B*T, d) buffer; that
    crosses PCIe and one reduce_scatter sums the parts -- each element is held by exactly one rank, so the sum
    is exact -- leaving each rank the rows of its own sequences. Per step that is B*T*d per GPU over PCIe and
    (N-1)/N of it over NVLink, against gathering the table, V*d every step into a (V, d) device buffer (128k x 8k
    fp32 = 4.2 GB for Llama-3-70B, where 32k tokens are 1.1 GB). The backward is the adjoint: dy of every rank is
    all_gathered in global order, comes down to the host, and each rank adds into its shard of the gradient the
    parts of the rows it holds, token by token in the order one process adds them.
Exact
    N ranks train what one process trains with the same global batch: rank r computes sequences [r B/N, (r+1) B/N)
    of the step's B, the loss is the sum of the ranks' shares of the global mean, the gradient is the sum of the
    ranks' -- only the order of the fp32 additions differs (tests/test_sharded.py: N = 2 and 4 against one process).
    A unit whose gradient is not finite is skipped by every rank or by none (the verdict is all-reduced).
What it is not
    No tensor or pipeline parallelism, no home-made transport: torch.distributed (NCCL on GPUs, gloo on CPUs),
    launched by torchrun. No overlap of the gradient collectives of two units (one process group: NCCL runs its
    collectives one at a time), no hierarchical (node-local) gathers, not elastic.
Reference
    DeepSpeed ZeRO-3 with CPU offload and FSDP2's CPUOffloadPolicy shard the same way over torch.distributed;
    picotron's data_parallel files for keeping the collectives in plain sight.
Try it
    torchrun --standalone --nproc-per-node 2 train.py --micro-batches 2      # two CPU processes, gloo
    python -m megatrain_min.sharded --world 2 --micro-batches 2             # N local ranks against one process
    python -m pytest tests/test_sharded.py
"""
import argparse
import collections
import datetime
import json
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import model
import stream

TIMEOUT = datetime.timedelta(minutes=10)   # a collective that waits this long for a dead rank raises


def shard_numel(numel, world):
    """Elements of one rank's shard of a unit of `numel` elements: the unit padded to a multiple of world, / world."""
    return -(-numel // world)


def row_pieces(lo, hi, d):
    """The elements [lo, hi) of a flat row-major (., d) table as rectangles (r0, r1, c0, c1, offset): rows
    r0..r1-1, columns c0..c1-1, at `offset` from lo. At most three: a partial first row, whole rows, a partial
    last row (one partial row when [lo, hi) lies inside a row)."""
    out, a = [], lo
    while a < hi:
        r, c = divmod(a, d)
        if c or hi - a < d:                          # a partial row
            c1 = min(d, c + hi - a)
            out.append((r, r + 1, c, c1, a - lo))
            a += c1 - c
        else:                                        # whole rows
            k = (hi - a) // d
            out.append((r, r + k, 0, d, a - lo))
            a += k * d
    return out


class ShardedLanes(stream.Lanes):
    """stream.Lanes plus comm, the lane the collectives are issued on. procs: ranks on this host (torchrun's
    LOCAL_WORLD_SIZE), which share its cores among their optimizer threads."""

    def __init__(self, device, sync=False, procs=1):
        super().__init__(device, sync, procs)
        self.comm = stream.Lane(device if device.type == "cuda" else None, sync)


class ShardedTrainer(stream.Trainer):
    def __init__(self, cfg, weights, group=None, device=None, lanes=None, sync=False, **kw):
        """stream.Trainer's arguments (cfg, weights: the whole model, read unit by unit, each rank keeping its
        shard), plus group: the torch.distributed process group of the run (default: the whole world, which
        must be initialised). micro_batches are per rank: the step's batch is split over the ranks, then each
        rank's share into micro-batches. lanes: a backend with a comm lane (ShardedLanes, or sim.SimLanes)."""
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        dev = model.check_device(device)
        lanes = lanes or ShardedLanes(dev, sync, procs=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        self.comm = lanes.comm
        self.traffic = collections.Counter()   # bytes this rank moved since it was made, per wire (see _gather ...)
        super().__init__(cfg, weights, device=dev, lanes=lanes, sync=sync, **kw)
        # ---- device: two weight shards (H2D lands there, the gather reads them), two fp32 gradient shards (the
        # reduce_scatter writes them, D2H reads them), one verdict per unit (a finite gradient?). Made on comm.
        s_max = max(n for n, _ in self.opt.sizes)
        with self.comm():
            self.wshard = [torch.empty(s_max, dtype=self.dtype, device=self.dev) for _ in range(2)]
            self.gshard = [torch.empty(s_max, dtype=torch.float32, device=self.dev) for _ in range(2)]
            self.finite_dev = torch.ones(len(self.units), dtype=torch.float32, device=self.dev)
        self.finite = torch.ones(len(self.units), dtype=torch.float32, pin_memory=self.lanes.pin)   # host copy
        self.shard_free, self.gshard_free = [None, None], [None, None]   # gather -> H2D, D2H -> reduce_scatter
        self.rows_written = (None, [])     # the pinned rows buffer and the (tokens, columns) last written in it
        lo, hi = self.owned(self.embed)                                   # the table: the unit's first V*d
        self.table_pieces = row_pieces(lo, min(hi, cfg.vocab_size * cfg.d_model), cfg.d_model)
        self.lanes.synchronize()           # the shards exist before any lane's first touch of them

    def buffers(self):
        """stream.Trainer's, and the shards H2D lands in and D2H reads (once they exist)."""
        return {**super().buffers(), **{f"wshard[{i}]": b for i, b in enumerate(getattr(self, "wshard", ()))},
                **{f"gshard[{i}]": b for i, b in enumerate(getattr(self, "gshard", ()))}}

    # ------------------------------------------------------------------ who holds what
    def shard_numel(self, u):
        return shard_numel(self.units[u].numel, self.world)

    def owned(self, u):
        """The elements [lo, hi) of unit u's flat buffer that this rank's store holds (its padding beyond them is
        zeros). checkpoint.py saves and loads by it, so a checkpoint loads at any world size."""
        s, n = self.shard_numel(u), self.units[u].numel
        lo = min(self.rank * s, n)
        return lo, min(lo + s, n)

    def gather_object(self, obj):
        """obj of every rank, in rank order (a collective: checkpoint.py agrees on names and errors through it)."""
        found = [None] * self.world
        dist.all_gather_object(found, obj, group=self.group)
        return found

    def store_sizes(self):
        """The shards: decayed are the elements of the unit's [0, n_decay) that fall into this rank's shard."""
        return [(self.shard_numel(u), min(max(lay.n_decay - self.rank * self.shard_numel(u), 0), self.shard_numel(u)))
                for u, lay in enumerate(self.units)]

    def fill_unit(self, u, weights):
        """Read unit u whole (checked as stream.read_unit checks it), keep this rank's shard."""
        lo, hi = self.owned(u)
        full = torch.empty(self.units[u].numel)
        stream.read_unit(self.units[u], weights, full)
        self.opt.master[u][:hi - lo].copy_(full[lo:hi])
        self.opt.refresh_shadow(u)

    def slot_numel(self, u):
        return self.world * self.shard_numel(u)       # the gather writes every shard, the padding included

    def local_batch(self, x):
        B = x.shape[0]
        if B % (self.world * self.M):
            raise ValueError(f"batch size {B} is not divisible by {self.world} ranks x micro_batches={self.M}")
        b = B // self.world
        return x[self.rank * b:(self.rank + 1) * b]   # rank r: sequences [r B/N, (r+1) B/N) of the global batch

    # ------------------------------------------------------------------ the collectives (on the comm lane)
    def _gather(self, out, shard):
        """all_gather: out = the N ranks' shards, in rank order. Each rank receives the N-1 it does not hold."""
        dist.all_gather_single(out, shard, group=self.group)
        self.traffic["gathered"] += out.nbytes * (self.world - 1) // self.world

    def _scatter(self, shard, full):
        """reduce_scatter: shard = rank r's part of the sum over the ranks of `full`. Each rank sends N-1 parts."""
        dist.reduce_scatter_single(shard, full, group=self.group)
        self.traffic["scattered"] += full.nbytes * (self.world - 1) // self.world

    def _all_reduce(self, t, op=dist.ReduceOp.SUM):
        """all_reduce: t = op over the ranks of t (a reduce_scatter, then an all_gather)."""
        dist.all_reduce(t, op=op, group=self.group)
        self.traffic["reduced"] += 2 * t.nbytes * (self.world - 1) // self.world

    # ------------------------------------------------------------------ weights in
    def load_unit(self, u, slot):
        """H2D of this rank's shard into wshard[slot], then all_gather of the shards into wslot[slot]."""
        s = self.shard_numel(u)
        src = self.opt.shadow[u] if self.opt.shadow is not None else self.opt.master[u]    # (s,) host
        with self.h2d():
            self.h2d.wait(self.shard_free[slot])          # the last gather from this shard buffer has read it
            if self.stage is None:
                self.wshard[slot][:s].copy_(src, non_blocking=True)
            else:  # lean: the fp32 shard crosses PCIe, the cast happens on the GPU, the gather moves compute dtype
                self.stage[:s].copy_(src, non_blocking=True)
                self.wshard[slot][:s].copy_(self.stage[:s])
            shard_ready = self.h2d.record()
        self.traffic["h2d"] += src.nbytes
        with self.comm():
            self.comm.wait(shard_ready)
            self.comm.wait(self.slot_free[slot])          # compute is done with the slot's previous unit
            self._gather(self.wslot[slot][:self.world * s], self.wshard[slot][:s])
            self.slot_loaded[slot] = self.shard_free[slot] = self.comm.record()

    # ------------------------------------------------------------------ gradients out
    def grad_to_host(self, u, gs, ready):
        """reduce_scatter of gslot[gs] into gshard[gs], D2H of this rank's shard into opt.grad[u]. Without
        deferral and with skip_nonfinite, the verdict "finite?" of the whole unit is all-reduced (min) beside it,
        so that every rank skips the same units."""
        s = self.shard_numel(u)
        with self.comm():
            self.comm.wait(ready)                         # compute finished unit u's gradient in gslot[gs]
            self.comm.wait(self.gshard_free[gs])          # D2H has copied the last gradient out of gshard[gs]
            self._scatter(self.gshard[gs][:s], self.gslot[gs][:self.world * s])
            if self._per_unit_verdict():
                self.finite_dev[u] = torch.isfinite(self.gshard[gs][:s]).all()
                self._all_reduce(self.finite_dev[u:u + 1], op=dist.ReduceOp.MIN)
            self.gslot_free[gs] = scattered = self.comm.record()
        with self.d2h():
            self.d2h.wait(scattered)
            self.opt.grad[u].copy_(self.gshard[gs][:s], non_blocking=True)
            if self._per_unit_verdict():
                self.finite[u:u + 1].copy_(self.finite_dev[u:u + 1], non_blocking=True)
            self.gshard_free[gs] = done = self.d2h.record()
        self.traffic["d2h"] += self.opt.grad[u].nbytes
        return done

    def _per_unit_verdict(self):
        return self.skip_nonfinite and not self.defer_updates

    def update_unit(self, u, lr):
        """AdamW on this rank's shard, unless the unit's gradient is not finite on some rank (skip_nonfinite)."""
        if self._per_unit_verdict() and not self.finite[u]:
            return False
        return self.opt.step(u, lr)

    def reduce_loss(self, loss):
        """The loss: this rank's tokens' share of the step's mean, summed over the ranks on comm."""
        self.comm.wait(self.comp.record())
        with self.comm():
            self._all_reduce(loss)
            summed = self.comm.record()
        self.comp.wait(summed)
        return loss

    def global_sum(self, x):
        """x (the squared gradient norm of this rank's shards) summed over the ranks, in fp64; the host waits."""
        with self.comm():
            t = torch.tensor([x], dtype=torch.float64, device=self.dev)
            self._all_reduce(t)
            summed = self.comm.record()
        self.lanes.host_wait(summed)
        return t.item()

    # ------------------------------------------------------------------ the embedding (see the docstring)
    def embed_rows(self, b):
        """x: M x (B/N/M, T, d), this rank's sequences: the parts of the rows of all B*T tokens that this rank's shard
        holds, zeros elsewhere, H2D, then a reduce_scatter that sums the parts and leaves each rank its rows."""
        V, d = self.cfg.vocab_size, self.cfg.d_model
        src = self.opt.master[self.embed]                                     # (s,) this rank's shard
        if self.residual_dtype != torch.float32 and self.opt.shadow is not None:
            src = self.opt.shadow[self.embed]
        tokens = b.tokens.reshape(-1)                                         # (B*T,) the whole step's ids
        part = self.pinned("rows", (tokens.numel(), d), src.dtype)           # (B*T, d) pinned
        if self.rows_written[0] is not part:                                  # a new buffer: zeros, once
            part.zero_()
        for sel, c0, c1 in self.rows_written[1]:                              # else only last step's rows: the
            part[sel, c0:c1] = 0                                              # work shrinks with N, not the batch
        written = []
        for r0, r1, c0, c1, o in self.table_pieces:
            sel = ((tokens >= r0) & (tokens < r1)).nonzero().squeeze(1)
            part[sel, c0:c1] = src[o:o + (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)[tokens[sel] - r0]
            written.append((sel, c0, c1))
        self.rows_written = (part, written)
        B, T = b.tokens.shape
        with self.h2d():                                  # made on the lane that writes it, read on comm (keep)
            full = torch.empty(part.shape, dtype=part.dtype, device=self.dev)
            full.copy_(part, non_blocking=True)
            ready = self.h2d.record()
        self.traffic["h2d"] += part.nbytes
        with self.comm():                                 # made on comm, which writes it; compute reads it (keep)
            x = torch.empty((B // self.world, T, d), dtype=part.dtype, device=self.dev)
            self.comm.wait(ready)
            self.comm.keep(full)
            self._scatter(x.view(-1, d), full)
            summed = self.comm.record()
        self.comp.wait(summed)
        self.comp.keep(x)
        return list(x.to(self.residual_dtype).chunk(self.M))   # M x (B/N/M, T, d); lean + bf16 residual: cast here

    def dy_to_host(self, dy):
        """dy of layer 0 of every rank, all_gathered in global order (rank r's B/N sequences r-th), then D2H:
        the (B, T, d) that one process would hold. Returns (pinned buffer, event)."""
        mine = torch.cat(dy) if len(dy) > 1 else dy[0]     # (B/N, T, d), compute lane
        self.comm.wait(self.comp.record())
        with self.comm():
            full = torch.empty((self.world * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype, device=self.dev)
            self.comm.keep(mine)
            self._gather(full.view(-1), mine.reshape(-1))
            ready = self.comm.record()
        host = self.pinned("dy", full.shape, full.dtype)
        with self.d2h():
            self.d2h.wait(ready)
            self.d2h.keep(full)
            host.copy_(full, non_blocking=True)
            done = self.d2h.record()
        self.traffic["d2h"] += host.nbytes
        return host, done

    def add_embedding_grad(self, tokens, dy_host):
        """Worker: add every token's dy into the parts of its row that this rank's shard holds, in token order.
        The verdict on the embedding's gradient is taken on dy itself, which every rank holds whole."""
        d = self.cfg.d_model
        grad = self.opt.grad[self.embed]                                     # (s,) this rank's shard
        if self.embed != self.head:
            grad.zero_()                   # untied: the scatter is the whole embedding gradient
        tokens, dy = tokens.reshape(-1), dy_host.reshape(-1, d)
        for r0, r1, c0, c1, o in self.table_pieces:
            sel = ((tokens >= r0) & (tokens < r1)).nonzero().squeeze(1)
            rows = grad[o:o + (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)
            rows.index_add_(0, tokens[sel] - r0, dy[sel, c0:c1].float())
        if self._per_unit_verdict():       # tied: the head's own verdict came with its gradient
            ok = bool(torch.isfinite(dy).all()) and (self.embed != self.head or bool(self.finite[self.embed]))
            self.finite[self.embed] = float(ok)

    # ------------------------------------------------------------------ the whole model, on every rank
    def weights(self, copy=True, to=None):
        """{key: fp32 CPU tensor} of the whole model (a collective: every rank calls it): each unit's master shards
        gathered on the device through grad slot 0, one unit at a time, then copied to the host of rank `to` only
        (the others get {} and hold nothing: an export of 70b is 280 GB), or of every rank (to=None: for samples of
        models that fit). Always copies; checkpoints are the way to keep a big model."""
        self.wait()
        out = {}
        for u, lay in enumerate(self.units):
            s = self.shard_numel(u)
            with self.comm():   # the device is idle (wait): blocking copies, the host waits for each
                self.gshard[0][:s].copy_(self.opt.master[u])
                self._gather(self.gslot[0][:self.world * s], self.gshard[0][:s])
                if to is None or to == self.rank:
                    out.update(lay.key_views(self.gslot[0][:lay.numel].to("cpu", copy=True)))
        return out


# ----------------------------------------------------------------------------- joining a run
def rank_device(device=None):
    """This rank's torch.device, made current: with CUDA, cuda:LOCAL_RANK -- or cuda:0 when the launcher gave each
    rank one GPU of its own (CUDA_VISIBLE_DEVICES) -- else the CPU. Call it before anything touches CUDA: the first
    CUDA call of a thread makes a context on its current device (GPU 0 unless set). ValueError (one line) when
    LOCAL_RANK names a GPU this process does not see."""
    dev = model.check_device(device)
    if dev.type != "cuda":
        return dev
    local, seen = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if seen > 1 and local >= seen:
        raise ValueError(f"LOCAL_RANK {local} but this process sees {seen} CUDA devices; give each rank its own GPU "
                         f"(torchrun --nproc-per-node at most {seen}) or one visible device per rank")
    dev = torch.device("cuda", local if seen > 1 else 0)
    torch.cuda.set_device(dev)
    return dev


def init_from_env(device=None):
    """Join the run torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    in the environment): NCCL with each rank on its own GPU (rank_device), or gloo on CPUs. device: "cuda", "cpu"
    or None (cuda when there is one). Returns the torch.device of this rank."""
    dev = rank_device(device)
    if dev.type == "cuda":
        dist.init_process_group("nccl", device_id=dev, timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    return dev


def agree(error):
    """The first error message of any rank (prefixed by its rank), or None when every rank had none: a
    collective, so that every rank stops together where one of them found something wrong."""
    if not (dist.is_available() and dist.is_initialized()):
        return error
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, error)
    return next((e if r == 0 else f"rank {r}: {e}" for r, e in enumerate(found) if e is not None), None)


# ----------------------------------------------------------------------------- N ranks on this machine
def _rank_main(rank, world, tmp, fn, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)                   # as torchrun: the ranks share this machine's cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        torch.save(fn(*args), os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(fn, world, *args, meanwhile=None):
    """fn(*args) on `world` fresh local processes joined by gloo (what torchrun --standalone makes, without the
    launcher): returns their results by rank -- and meanwhile()'s, run here while they run (the ranks wait on each
    other a lot: a reference computed meanwhile uses cores they leave idle). fn must be importable (a module-level
    function), its result something torch.save writes. A failing rank raises here with its traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_rank_main, args=(world, tmp, fn, args), nprocs=world, start_method="spawn",
                                 join=False)
        try:
            mine = meanwhile() if meanwhile else None
        finally:
            while not ctx.join():
                pass
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)], mine


def train(cfg, steps, batch, sharded, seed=0, **kw):
    """Train cfg from init_weights(seed) for `steps` steps on random global batches batch=(B, T) (the same ones
    whatever runs it), on ShardedTrainer (the ranks of the current process group) or stream.Trainer. Returns
    (losses, weights, grad norms, traffic per step) -- weights whole, on every rank."""
    gen = torch.Generator().manual_seed(seed + 1)
    t = (ShardedTrainer if sharded else stream.Trainer)(cfg, model.init_weights(cfg, seed), device="cpu", **kw)
    losses, norms, traffic = [], [], []
    for _ in range(steps):
        tok = torch.randint(0, cfg.vocab_size, batch, generator=gen)
        tgt = torch.randint(0, cfg.vocab_size, batch, generator=gen)
        tgt[torch.rand(batch, generator=gen) < 0.2] = model.IGNORE
        before = collections.Counter(getattr(t, "traffic", {}))
        losses.append(t.step(tok, tgt))
        t.wait()
        norms.append(t.grad_norm)
        traffic.append(dict(collections.Counter(getattr(t, "traffic", {})) - before))
    return losses, t.weights(), norms, traffic


def _train_rank(cases, steps, batch):
    return [train(model.GPTConfig(**c), steps, batch, True, **kw) for c, kw in cases]


def compare(cases, world, steps=5, batch=(8, 16)):
    """Each case (cfg, Trainer kwargs) for `steps` steps on `world` local ranks (one spawn for them all) and in
    one process, on the same global batches. The one process runs world x micro_batches micro-batches: the same
    micro-batch size, so that both compute the same matmuls and only the order of the fp32 gradient sums differs
    (with another micro-batch size the one process disagrees with ITSELF by as much: tests/test_sharded.py).
    Returns per case {"loss_rel": the worst per-step relative loss difference, "weights_rel": ||w_N - w_1|| /
    ||w_1|| after the steps, "weights_max": the largest elementwise difference, "traffic": bytes per wire of
    rank 0's last step, "losses": (N ranks, one process), "norms": rank 0's grad norms}."""
    ranks, ones = spawn(_train_rank, world, [(cfg.to_dict(), kw) for cfg, kw in cases], steps, batch, meanwhile=lambda: [
        train(cfg, steps, batch, False, **dict(kw, micro_batches=world * kw.get("micro_batches", 1))) for cfg, kw in cases])
    out = []
    for k, (cfg, kw) in enumerate(cases):
        (losses, w, norms, traffic), (losses1, w1, _, _) = ranks[0][k], ones[k]
        assert all(r[k][0] == losses for r in ranks), "the ranks disagree on the losses"
        out.append(dict(loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, losses1)),
                        weights_rel=weights_rel(w, w1), weights_max=max(float((w[k] - w1[k]).abs().max()) for k in w1),
                        traffic=traffic[-1], losses=(losses, losses1), norms=norms))
    return out


def weights_rel(w, w1):
    """||w - w1|| / ||w1|| over every tensor of two whole models, in fp64."""
    diff = sum(float(((w[k] - w1[k]).double() ** 2).sum()) for k in w1)
    return (diff / sum(float((v.double() ** 2).sum()) for v in w1.values())) ** 0.5


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="N local ranks (gloo) against one process: losses, weights, bytes per wire.")
    ap.add_argument("--world", type=int, default=2, help="ranks (processes on this machine)")
    ap.add_argument("--config", default="toy", help=f"preset: {', '.join(model.PRESETS)}")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8, help="the global batch: sequences per step")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=1, help="per rank")
    ap.add_argument("--grad-clip", type=float, default=0.0)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = ap.parse_args(argv)
    if a.config not in model.PRESETS:
        ap.exit(2, f"error: unknown preset --config {a.config!r}; choose one of: {', '.join(model.PRESETS)}\n")
    if a.world < 1 or a.steps < 1 or a.batch_size % (a.world * a.micro_batches):
        ap.exit(2, f"error: --batch-size {a.batch_size} must be a multiple of --world {a.world} x --micro-batches "
                   f"{a.micro_batches}, and --world, --steps >= 1\n")
    kw = dict(micro_batches=a.micro_batches, grad_clip=a.grad_clip, lr=1e-2)
    r, = compare([(model.PRESETS[a.config], kw)], a.world, a.steps, (a.batch_size, a.seq_len))
    if a.json:
        print(json.dumps({k: v for k, v in r.items()}))
        return 0
    for k, (x, y) in enumerate(zip(*r["losses"])):
        print(f"step {k + 1}: loss {x:.7f} on {a.world} ranks, {y:.7f} in one process ({a.world * a.micro_batches} "
              f"micro-batches)")
    print(f"worst relative loss difference {r['loss_rel']:.1e}; weights after {a.steps} steps: ||dw|| / ||w|| = "
          f"{r['weights_rel']:.1e}, max |dw| = {r['weights_max']:.1e}")
    print("rank 0, last step: " + ", ".join(f"{k} {v:,} B" for k, v in sorted(r["traffic"].items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
