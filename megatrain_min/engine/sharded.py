"""sharded.py -- ZeRO-3 over the host store: N GPUs, on one node or several, train one model through
torch.distributed.

What it is
    ShardedTrainer is stream.Trainer on one rank of N. Every unit's flat buffer -- fp32 master, Adam
    m and v, the compute-dtype shadow, the fp32 gradient -- is cut into N equal shards (the last
    padded with zeros): rank r's host store holds shard r of every unit, so a node holds 1/K of the
    model's host state (K nodes) and each GPU's PCIe link carries 1/N of every unit. One layer
    visit, what crosses which wire (n: the unit's elements):

        H2D      rank r's shard of the unit, compute dtype      PCIe, its own link  n/N
        gather   all_gather of the N shards into a weight slot  NVLink (InfiniBand) (N-1)/N x n in
        compute  this rank's B/N sequences, in its M micro-batches
        scatter  reduce_scatter of the fp32 gradient slot       NVLink (InfiniBand) (N-1)/N x n out
        D2H      shard r of the summed gradient, fp32          PCIe                n/N
        AdamW    shard r, on the rank's optimizer thread (clipping: the squared norm summed over the
                 ranks)

    The collectives are issued on a fourth lane, comm, and ordered by events like the copies (NCCL
    runs one after the work issued so far on comm and makes comm wait for it: an event recorded on
    comm marks its end). To the stream checker a collective is an op of the comm lane that reads its
    input and writes its output (megatrain_min/plan/cost.py names what each c10d op writes).
    The engine is stream.Trainer handed Shards, the placement of the units over the ranks (which
    part of each unit this rank holds, how big a slot is, which rows of the batch it computes, the
    sums over the ranks), and ShardedStreamed, every unit's home: the embedding's rows in and dy
    out (rows, dy_out, add_dy), and the verdict on a unit's gradient, which every rank takes
    together (update). ShardedTrainer replaces the data movement of the slots alone: a unit's
    weights in (load_unit), its gradient out (grad_to_host).
The embedding
    Sharded like any unit, its rows gathered without a (V, d) buffer on the GPU: every rank writes,
    for every token of the step (it knows the global batch), the part of the token's row its shard
    holds (zeros elsewhere) into a pinned (B*T, d) buffer; that crosses PCIe and one reduce_scatter
    sums the parts (each element held by one rank: exact), leaving each rank its sequences' rows --
    B*T*d per GPU, where gathering the table would move V*d a step (4.2 GB at 70b). The backward is
    the adjoint: dy all_gathered in global order, D2H, each rank adding its parts token by token.
Exact
    N ranks train what one process trains with the same global batch: rank r computes sequences
    [r B/N, (r+1) B/N) of the step's B, the loss is the sum of the ranks' shares of the global mean,
    the gradient is the sum of the ranks' -- only the order of the fp32 additions differs
    (tests/engine/test_sharded.py: N = 2 and 4 against one process). A unit whose gradient is not
    finite is skipped by every rank or by none (the verdict is all-reduced).
What it is not
    No tensor or pipeline parallelism, no home-made transport: torch.distributed (NCCL on GPUs, gloo
    on CPUs), launched by torchrun. No overlap of the gradient collectives of two units (one process
    group: NCCL runs its collectives one at a time), no hierarchical (node-local) gathers, not
    elastic.
Reference
    DeepSpeed ZeRO-3 with CPU offload and FSDP2's CPUOffloadPolicy shard the same way over
    torch.distributed; picotron's data_parallel files for keeping the collectives in plain sight.
Try it
    torchrun --standalone --nproc-per-node 2 train.py --micro-batches 2   # two CPU processes, gloo
    python -m pytest tests/engine/test_sharded.py                          # N ranks against one
"""
import atexit
import collections
import datetime
import os

import torch
import torch.distributed as dist

import stream
from megatrain_min.engine import checks, pinned

TIMEOUT = datetime.timedelta(minutes=10)  # a collective that waits this long for a dead rank raises
RENDEZVOUS = datetime.timedelta(minutes=2)  # ranks that have not all joined by then never will


def shard_numel(numel, world):
    """Elements of one rank's shard of a unit of `numel` elements: the unit padded to a multiple of
    world, / world."""
    return -(-numel // world)


def row_pieces(lo, hi, d):
    """The elements [lo, hi) of a flat row-major (., d) table as rectangles (r0, r1, c0, c1,
    offset): rows r0..r1-1, columns c0..c1-1, at `offset` from lo. At most three: a partial first
    row, whole rows, a partial last row (one partial row when [lo, hi) lies inside a row)."""
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


# The two collectives of a layer visit, by their public names: torch >= 2.13 calls them
# all_gather_single and reduce_scatter_single and deprecates the names torch 2.11 has
# (all_gather_into_tensor, reduce_scatter_tensor), the same calls with the same arguments: the newer
# name where it exists, else the older (tests/core/test_torch_api.py).
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ShardedLanes(stream.Lanes):
    """stream.Lanes plus comm, the lane the collectives are issued on. procs: ranks on this host
    (torchrun's LOCAL_WORLD_SIZE), which share its cores among their optimizer threads."""

    def __init__(self, device, procs=1, lane=stream.Lane):
        super().__init__(device, procs, lane, pinned=pinned.page_locked)
        self.comm = lane(self.device if self.cuda else None, "comm")


class Shards:
    """The units' placement over the N ranks of a process group (stream.Whole: all in one process):
    rank r holds shard r of every unit and computes sequences [r B/N, (r+1) B/N) of each step's
    batch. It issues the collectives on the comm lane and counts the bytes they move per wire
    (traffic)."""

    def __init__(self, group, lanes, device):
        self.given, self.lanes, self.comm, self.device = group, lanes, lanes.comm, device
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        # bytes this rank moved, per wire (gathered, scattered, ...)
        self.traffic = collections.Counter()

    @property
    def group(self):
        """The process group; the default one looked up, never held: dist.destroy_process_group then
        frees it while Python is whole, not at interpreter exit (where the backend's threads can
        abort the process)."""
        return self.given if self.given is not None else dist.group.WORLD

    def shard(self, lay):
        return shard_numel(lay.numel, self.world)

    def part(self, lay):
        """The elements [lo, hi) of the unit this rank holds (its padding beyond them is zeros);
        checkpoint.py saves and loads by it, so a checkpoint loads at any world size."""
        lo = min(self.rank * self.shard(lay), lay.numel)
        return lo, min(lo + self.shard(lay), lay.numel)

    def slot_numel(self, lay):
        return self.world * self.shard(lay)   # the gather writes every shard, the padding included

    def sizes(self, units):
        """The shards in the store: decayed are the elements of the unit's [0, n_decay) in this
        rank's shard."""
        return [(self.shard(lay),
                 min(max(lay.n_decay - self.rank * self.shard(lay), 0), self.shard(lay)))
                for lay in units]

    def fill(self, opt, units, weights):
        """Read each unit whole (a lazy source: read_into), keep this rank's shard."""
        read_into = getattr(weights, "read_into", None)
        for u, lay in enumerate(units):
            whole, (lo, hi) = torch.empty(lay.numel), self.part(lay)
            for key, view in lay.key_views(whole).items():
                read_into(key, view) if read_into else view.copy_(weights[key])
            opt.master[u][:hi - lo].copy_(whole[lo:hi])
            opt.refresh_shadow(u)

    def local_batch(self, x):
        b = x.shape[0] // self.world    # checks.check_split: it divides
        # rank r: sequences [r B/N, (r+1) B/N) of the global batch
        return x[self.rank * b:(self.rank + 1) * b]

    def gather(self, out, shard):
        """all_gather: out = the N ranks' shards, in rank order. Each rank receives the N-1 it does
        not hold."""
        ALL_GATHER(out, shard, group=self.group)
        self.traffic["gathered"] += out.nbytes * (self.world - 1) // self.world

    def scatter(self, shard, full):
        """reduce_scatter: shard = rank r's part of the sum over the ranks of `full`. Each rank
        sends N-1 parts."""
        REDUCE_SCATTER(shard, full, group=self.group)
        self.traffic["scattered"] += full.nbytes * (self.world - 1) // self.world

    def all_reduce(self, t, op=dist.ReduceOp.SUM):
        """all_reduce: t = op over the ranks of t (a reduce_scatter, then an all_gather)."""
        dist.all_reduce(t, op=op, group=self.group)
        self.traffic["reduced"] += 2 * t.nbytes * (self.world - 1) // self.world

    def sum_loss(self, loss, lanes):
        """The loss: this rank's tokens' share of the step's mean, summed over the ranks on comm."""
        self.comm.wait_event(lanes.comp.record())
        with self.comm():
            self.all_reduce(loss)
            summed = self.comm.record()
        lanes.comp.wait_event(summed)
        return loss

    def sum(self, x):
        """x (the squared gradient norm of this rank's shards) summed over the ranks, in fp64; the
        host waits."""
        with self.comm():
            t = torch.tensor([x], dtype=torch.float64, device=self.device)
            self.all_reduce(t)
            summed = self.comm.record()
        self.lanes.host_wait(summed)
        return t.item()

    def gather_object(self, obj):
        """obj of every rank, in rank order (a collective: checkpoint.py agrees on names and errors
        through it)."""
        found = [None] * self.world
        dist.all_gather_object(found, obj, group=self.group)
        return found


class ShardedTrainer(checks.Checked, stream.Trainer):
    def __init__(self, cfg, weights, group=None, device=None, lanes=None, **kw):
        """stream.Trainer's arguments (weights: the whole model, read unit by unit, each rank
        keeping its shard; checked as checks.CheckedTrainer checks them), plus group: the run's
        torch.distributed process group (default: the whole world, initialised). micro_batches are
        per rank: the step's batch is split over the ranks, then each rank's share into
        micro-batches. lanes: with a comm lane (ShardedLanes, record.SimLanes)."""
        if kw.pop("homes", None) is not None:
            raise ValueError("resident or GPU-updated units need one process holding whole units"
                             "; sharded ranks stream every unit (no homes)")
        dev = checks.check_device(device)
        lanes = lanes if lanes is not None else ShardedLanes(
            dev, procs=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        shards = Shards(group, lanes, dev)
        self.comm, self.rank, self.world = lanes.comm, shards.rank, shards.world
        super().__init__(cfg, weights, device=dev, lanes=lanes, placement=shards,
                         homes=ShardedStreamed, **kw)
        # ---- device, made on comm: two weight shards (H2D lands there, the gather reads them), two
        # gradient shards (the reduce_scatter writes them, D2H reads them), a verdict per unit
        s_max = max(n for n, _ in self.opt.sizes)
        with self.comm():
            self.wshard = [torch.empty(s_max, dtype=self.dtype, device=self.dev) for _ in range(2)]
            self.gshard = [torch.empty(s_max, device=self.dev) for _ in range(2)]   # fp32
            self.finite_dev = torch.ones(len(self.units), device=self.dev)
        self.finite = self.host_buffer("finite", (len(self.units),), torch.float32).fill_(1)
        # gather -> H2D, D2H -> reduce_scatter
        self.shard_free, self.gshard_free = [None, None], [None, None]
        # the pinned rows buffer and the (tokens, columns) last written in it
        self.rows_written = (None, [])
        lo, hi = shards.part(self.units[self.embed])               # the table: the unit's first V*d
        self.table_pieces = row_pieces(lo, min(hi, cfg.vocab_size * cfg.d_model), cfg.d_model)
        self.lanes.synchronize()           # the shards exist before any lane's first touch of them

    @property
    def traffic(self):
        return self.placement.traffic

    def shard_numel(self, u):
        return self.placement.shard(self.units[u])

    # ------------------------------------------------------------------ weights in
    def load_unit(self, u, slot):
        """H2D of this rank's shard into wshard[slot], then all_gather of the shards into
        wslot[slot]."""
        s = self.shard_numel(u)
        src = self.opt.streamed(u)                               # (s,) host: shadow or master
        with self.h2d():
            # the last gather from this shard buffer has read it
            self.h2d.wait_event(self.shard_free[slot])
            if self.cast is None:
                self.wshard[slot][:s].copy_(src, non_blocking=True)
            else:
                # lean: the fp32 shard crosses PCIe, the cast happens on the GPU, the gather moves
                # compute dtype
                self.cast[:s].copy_(src, non_blocking=True)
                self.wshard[slot][:s].copy_(self.cast[:s])
            shard_ready = self.h2d.record()
        self.traffic["h2d"] += src.nbytes
        with self.comm():
            self.comm.wait_event(shard_ready)
            self.comm.wait_event(self.slot_free[slot])   # compute is done with the slot's last unit
            self.placement.gather(self.wslot[slot][:self.world * s], self.wshard[slot][:s])
            self.slot_loaded[slot] = self.shard_free[slot] = self.comm.record()

    # ------------------------------------------------------------------ gradients out
    def grad_to_host(self, u, gs, ready):
        """reduce_scatter of gslot[gs] into gshard[gs], D2H of this rank's shard into opt.grad[u].
        Without deferral and with a guard, the verdict "finite?" of the whole unit is all-reduced
        (min) beside it, so that every rank skips the same units."""
        s = self.shard_numel(u)
        with self.comm():
            self.comm.wait_event(ready)            # compute finished unit u's gradient in gslot[gs]
            # D2H has copied the last gradient out of gshard[gs]
            self.comm.wait_event(self.gshard_free[gs])
            self.placement.scatter(self.gshard[gs][:s], self.gslot[gs][:self.world * s])
            if self._per_unit_verdict():
                self.finite_dev[u] = torch.isfinite(self.gshard[gs][:s]).all()
                self.placement.all_reduce(self.finite_dev[u:u + 1], op=dist.ReduceOp.MIN)
            self.gslot_free[gs] = scattered = self.comm.record()
        with self.d2h():
            self.d2h.wait_event(scattered)
            self.opt.grad[u].copy_(self.gshard[gs][:s], non_blocking=True)
            if self._per_unit_verdict():
                self.finite[u:u + 1].copy_(self.finite_dev[u:u + 1], non_blocking=True)
            self.gshard_free[gs] = done = self.d2h.record()
        self.traffic["d2h"] += self.opt.grad[u].nbytes
        return done

    def _per_unit_verdict(self):
        return self.guard is not None and not self.defer_updates

    # ------------------------------------------------------------------ the whole model
    def weights(self, to=None):
        """{key: fp32 CPU tensor} of the whole model (a collective: every rank calls it): each
        unit's master shards gathered on the device through grad slot 0, one unit at a time, then
        copied to the host of rank `to` only (the others get {} and hold nothing: an export of 70b
        is 280 GB), or of every rank (to=None: for samples of models that fit). Always copies;
        checkpoints are the way to keep a big model."""
        self.wait()
        out = {}
        for u, lay in enumerate(self.units):
            s = self.shard_numel(u)
            with self.comm():  # the device is idle (wait): blocking copies, the host waits for each
                self.gshard[0][:s].copy_(self.opt.master[u])
                self.placement.gather(self.gslot[0][:self.world * s], self.gshard[0][:s])
                if to is None or to == self.rank:
                    out.update(lay.key_views(self.gslot[0][:lay.numel].to("cpu", copy=True)))
        return out


class ShardedStreamed(stream.Streamed):
    """The home of every unit of a sharded trainer: streamed, this rank's shard updated on its
    optimizer thread; the verdict on a unit's gradient agreed by every rank; the embedding's rows
    in and its gradient out across the ranks (see the module docstring)."""

    def update(self, u, lr, coef=1.0, guard=None):
        """The rule on this rank's shard, unless the unit's gradient is not finite on some rank."""
        t = self.t
        if guard is None or guard.ok(bool(t.finite[u]), t.units[u].name):
            t.opt.step(u, lr, coef)

    # ------------------------------------------------------------ the embedding (see the docstring)
    def rows(self, b):
        """x: M x (B/N/M, T, d), this rank's sequences: the parts of the rows of all B*T tokens that
        this rank's shard holds, zeros elsewhere, H2D, then a reduce_scatter that sums the parts and
        leaves each rank its rows."""
        t = self.t
        d = t.cfg.d_model
        src = t.opt.master[t.embed]                                         # (s,) this rank's shard
        if t.residual_dtype != torch.float32 and t.opt.shadow[t.embed] is not None:
            src = t.opt.shadow[t.embed]
        tokens = b.tokens.reshape(-1)                                  # (B*T,) the whole step's ids
        part = t.host_buffer("rows", (tokens.numel(), d), src.dtype)         # (B*T, d) pinned
        # zero only last step's rows: the work shrinks with N, not B
        if t.rows_written[0] is part:
            for sel, c0, c1 in t.rows_written[1]:
                part[sel, c0:c1] = 0
        else:                                     # a new buffer: zeros, once
            part.zero_()
        written = []
        for r0, r1, c0, c1, o in t.table_pieces:
            sel = ((tokens >= r0) & (tokens < r1)).nonzero().squeeze(1)
            table = src[o:o + (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)
            part[sel, c0:c1] = table[tokens[sel] - r0]
            written.append((sel, c0, c1))
        t.rows_written = (part, written)
        B, T = b.tokens.shape
        with t.h2d():                         # made on the lane that writes it, read on comm (uses)
            full = torch.empty(part.shape, dtype=part.dtype, device=t.dev)
            full.copy_(part, non_blocking=True)
            ready = t.h2d.record()
        t.traffic["h2d"] += part.nbytes
        with t.comm():                    # made on comm, which writes it; compute reads it (uses)
            x = torch.empty((B // t.world, T, d), dtype=part.dtype, device=t.dev)
            t.comm.wait_event(ready)
            t.comm.uses(full)
            t.placement.scatter(x.view(-1, d), full)
            summed = t.comm.record()
        t.comp.wait_event(summed)
        t.comp.uses(x)
        # M x (B/N/M, T, d); lean + bf16 residual: cast here
        return list(x.to(t.residual_dtype).chunk(t.M))

    def dy_out(self, dy):
        """dy of layer 0 of every rank, all_gathered in global order (rank r's B/N sequences r-th),
        then D2H: the (B, T, d) that one process would hold. Returns (pinned buffer, event)."""
        t = self.t
        mine = torch.cat(dy) if len(dy) > 1 else dy[0]     # (B/N, T, d), compute lane
        t.comm.wait_event(t.comp.record())
        with t.comm():
            full = torch.empty((t.world * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype,
                               device=t.dev)
            t.comm.uses(mine)
            t.placement.gather(full.view(-1), mine.reshape(-1))
            ready = t.comm.record()
        host = t.host_buffer("dy", full.shape, full.dtype)
        with t.d2h():
            t.d2h.wait_event(ready)
            t.d2h.uses(full)
            host.copy_(full, non_blocking=True)
            done = t.d2h.record()
        t.traffic["d2h"] += host.nbytes
        return host, done

    def add_dy(self, tokens, dy):
        """Optimizer thread: add every token's dy into the parts of its row that this rank's shard
        holds, in token order. The verdict on the embedding's gradient is taken on dy itself, which
        every rank holds whole."""
        t = self.t
        d = t.cfg.d_model
        grad = t.opt.grad[t.embed]                                          # (s,) this rank's shard
        if t.embed != t.head:
            grad.zero_()                   # untied: the scatter is the whole embedding gradient
        tokens, dy = tokens.reshape(-1), dy.reshape(-1, d)
        for r0, r1, c0, c1, o in t.table_pieces:
            sel = ((tokens >= r0) & (tokens < r1)).nonzero().squeeze(1)
            rows = grad[o:o + (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)
            rows.index_add_(0, tokens[sel] - r0, dy[sel, c0:c1].float())
        if t._per_unit_verdict():          # tied: the head's own verdict came with its gradient
            ok = bool(torch.isfinite(dy).all()) and (t.embed != t.head or bool(t.finite[t.embed]))
            t.finite[t.embed] = float(ok)


# ----------------------------------------------------------------------------- joining a run
def rank_device(device=None):
    """This rank's torch.device, made current: with CUDA, cuda:LOCAL_RANK -- or cuda:0 when the
    launcher gave each rank one GPU of its own (CUDA_VISIBLE_DEVICES) -- else the CPU. Call it
    before anything touches CUDA: the first CUDA call of a thread makes a context on its current
    device (GPU 0 unless set). ValueError (one line) when LOCAL_RANK names a GPU this process does
    not see."""
    dev = checks.check_device(device)
    if dev.type != "cuda":
        return dev
    local, seen = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if seen > 1 and local >= seen:
        raise ValueError(f"LOCAL_RANK {local} but this process sees {seen} CUDA devices; give each "
                         f"rank its own GPU (torchrun --nproc-per-node at most {seen}) or one "
                         "visible device per rank")
    dev = torch.device("cuda", local if seen > 1 else 0)
    torch.cuda.set_device(dev)
    return dev


def init_from_env(device=None):
    """Join the run torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
    and MASTER_PORT in the environment): NCCL with each rank on its own GPU (rank_device), or gloo
    on CPUs. device: "cuda", "cpu" or None (cuda when there is one). Returns the torch.device of
    this rank."""
    dev, env = rank_device(device), os.environ
    try:   # the rendezvous alone waits RENDEZVOUS for the ranks; the collectives get TIMEOUT
        store, rank, world = next(dist.rendezvous("env://", timeout=RENDEZVOUS))
    except (RuntimeError, ValueError) as e:          # DistStoreError: a rank that never came
        raise ValueError(f"rank {env.get('RANK')} of {env.get('WORLD_SIZE')}: the other ranks did "
                         f"not join at {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')} within "
                         f"{RENDEZVOUS.seconds} s ({(str(e).splitlines() or [''])[0][:120]}); "
                         "launch every rank with torchrun") from None
    store.set_timeout(TIMEOUT)
    store = dist.PrefixStore("default_pg", store)    # as init_process_group keys its own rendezvous
    kw = dict(store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    dist.init_process_group("nccl", device_id=dev, **kw) if dev.type == "cuda" else \
        dist.init_process_group("gloo", **kw)
    if dev.type != "cuda":   # gloo: however the process exits (a stop's sys.exit, a refusal)
        atexit.register(leave)
    return dev


def leave():
    """Destroy the process group while Python is whole: gloo's threads, torn down by a finalizing
    interpreter, abort the process (exit 134, "terminate called without an active exception").
    NCCL's destroy waits for this rank's queued collectives (a rank failing alone would hang), so
    on GPUs train.py calls it on its clean ways out only: the end, a stop after its save."""
    if dist.is_initialized():
        dist.destroy_process_group()

