"""timing.py -- how long a step takes: each layer visit's seconds, and stream.py's schedule
replayed.

What it is
    speeds(s): the rates a Setting runs at on its hardware (achievable FLOP/s, the links, the host's
    AdamW bytes and bandwidth, NVLink or InfiniBand). visits(s, tile, v): the seconds of every task
    of a step -- H2D of a unit, its forward, its recompute + backward, the head, D2H of its fp32
    gradient, the CPU (or GPU) AdamW, the collectives -- from FLOPs at the achievable rate, the
    FLOP-free ops' bytes at HBM bandwidth (cost.elementwise_bytes) and the host's issue cost per op
    (hardware.HOST_OP_S). slabs: the gradient slabs that hide a gradient's trip. simulate:
    stream.Trainer.step's issue order on FIFO lanes for three steps -- step time, each lane's busy
    share and its share of the critical path (the bottleneck). min_tokens: the tokens per step from
    which each transfer hides behind compute (T >= F_eff * bytes_per_param / (2 * BW):
    docs/design.md, section 'The arithmetic').
What it is not
    Not the twin: megatrain_min/sim/twin.py replays the real engine's op stream; this is the same
    schedule written by hand, and tests/sim/test_twin.py holds the two to 10% of each other. Not
    modelled: DRAM contention between DMA and AdamW, launch gaps, the data loader.
"""
import math
from types import SimpleNamespace

import optim
import stream
from megatrain_min.plan import cost
from megatrain_min.cli import DTYPES
from megatrain_min.plan.hardware import GB, GPU_ADAM_FRAC, HOST_OP_S

# The engine's own ops around the model's (copies, zeroing, the step's input), counted with
# megatrain_min/sim/record.py: per layer visit, per step, per unit update (optimizer thread).
ENGINE_OPS = dict(visit=5, step=41, update=11)
# optim.Worker's order: of the landed tasks, the one the next forward needs first. False: first
# come, first served (the engine of the H200 runs before bench/gpu.py's meta said "update_order")
NEED_FIRST = True


def update_bytes(s):
    """The update rule's DRAM bytes per parameter: p and g read, p written (12), each state read and
    written (8 per name): AdamW 28, Lion 20."""
    return 12 + 8 * s.states


def speeds(s):
    """The rates of Setting s on its hardware: F (achievable FLOP/s), the links h2d and d2h, hbm,
    hbw (the host's DRAM for AdamW) and net (NVLink within a node, else InfiniBand) in bytes/s; cast
    (lean bf16: the fp32 unit cast on the GPU, s/param) and adam_b (the host AdamW's
    bytes/param)."""
    hw = s.hw
    v = SimpleNamespace(F=hw[f"{s.dtype}_tflops"] * 1e12 * hw["frac"], h2d=hw["h2d_gbs"] * GB,
                        d2h=hw["d2h_gbs"] * GB, hbw=hw["host_bw_gbs"] * GB, hbm=hw["hbm_gbs"] * GB)
    # read 4, write 2
    v.cast = 6 / (hw["hbm_gbs"] * GB) if not s.shadow and s.dtype == "bf16" else 0
    # the rule reads p, g and its state and writes p and its state (AdamW: 28 B); clipped: the
    # kernel writes the scaled g back; the guard without deferral reads g once more; fast: it reads
    # p again and writes the shadow, 6 B -- also in optim.TILE's one pass, where p is read from
    # cache: on the measured H200 host the fp32 -> bf16 copy costs the same from cache
    # (bench/NOTES.md)
    v.update_b = update_bytes(s)
    v.adam_b = v.update_b + (4 if s.defer else 0) + (4 if s.skip_nonfinite and not s.defer else 0) \
        + (6 if s.shadow else 0)
    v.net = (hw["nvlink_gbs"] if s.nodes == 1 else min(hw["nvlink_gbs"], hw["ib_gbs"])) * GB
    return v


def visits(s, tile, v):
    """(t, numel, rate): t the seconds of each per-step task (a layer's fwd, bwd, head, the
    embedding's rows, dy, the host's issue time...) and of each per-unit task for a layer (load,
    grad, adam, ...); numel[kind] * rate[what]: the seconds of `what` for a unit of that kind."""
    cfg, lay, head, world, cb = s.cfg, s.lay, s.head, s.world, s.cb
    # QK^T + AV per token, causal half (SDPA skips)
    attn = 2 * s.seq_len * cfg.n_head * cfg.head_dim
    # seconds per parameter of a unit: this rank's 1/N share crosses its PCIe link; the node's gpus
    # ranks update their shards at once, sharing its DRAM; the collectives move (N-1)/N of the unit
    # per GPU. AdamW runs in tiles of optim.TILE elements, each 5 views and a kernel call (+ the
    # shadow's copy) of host ops
    tile_s = (5 + 2 * s.shadow) * HOST_OP_S / s.host_speed / optim.TILE
    hbm = v.hbm
    rate = dict(load=(s.sb / v.h2d + v.cast) / world, grad=4 / v.d2h / world,
                adam=v.adam_b / v.hbw / s.nodes + tile_s, norm=4 / v.hbw / s.nodes,
                all_gather=(world - 1) / world * cb / v.net,
                reduce_scatter=(world - 1) / world * 4 / v.net,
                # a resident unit: cast into its slot, gradient copied D2D, AdamW (or norm) on GPU
                load_res=(4 + cb) / hbm, grad_res=8 / hbm,
                # (the guard without deferral: its verdict a sum of the gradient, read on the GPU)
                gpu_adam=(v.update_b + 4 * s.defer) / (hbm * GPU_ADAM_FRAC)
                + 4 * (s.skip_nonfinite and not s.defer) / hbm, gpu_norm=4 / hbm,
                # a unit updated on the GPU (gpu_update.py): master and state cross both ways
                # (fast: the shadow, cast there, back too)
                visit_h2d=4 * (1 + s.states) / v.h2d,
                visit_d2h=(4 * (1 + s.states) + 2 * s.shadow) / v.d2h)
    numel = dict(layer=lay.numel, head=head.numel, embed=0 if s.tied else s.units[0].numel)
    qkv = cfg.d_model * (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    # the FLOP-free ops (norms, casts, RoPE, residual adds, the loss softmax, fp32 grad
    # accumulation) are bound by HBM: their bytes per token and per call, measured on the model's
    # own functions
    ew = cost.elementwise_bytes(cfg, DTYPES[s.dtype], DTYPES[s.residual_dtype])
    M, tokens = s.micro_batches, s.tokens
    # block, block_grad per micro-batch; head_grad per chunk
    calls = dict(fwd=M, bwd=M, head=M * math.ceil(tokens // M / s.chunk))
    hbm_s = {k: (tokens * ew[k][0] + calls[k] * ew[k][1]) / hbm for k in ew}
    # the host issues every op (HOST_OP_S each): the model's, counted by cost.elementwise_bytes, and
    # the engine's
    op_s = HOST_OP_S / s.host_speed
    host_s = {k: op_s * (calls[k] * ew[k][2] + ENGINE_OPS["visit"]) for k in ew}
    F, d, row_b, untied = v.F, cfg.d_model, s.row_b, (0 if s.tied else s.units[0].numel * 4)
    t = dict(fwd=tokens * (2 * lay.n_decay + attn) / F + hbm_s["fwd"],
             # recompute (1x forward) + backward (2x the matmuls, 2.5x attention: flash's 5
             # matmuls); zero the slot; tiled: part A's projections run once more (block_grad)
             bwd=tokens * (6 * lay.n_decay + 3.5 * attn) / F + hbm_s["bwd"] + lay.numel * 4 / hbm
             + (2 * tokens * qkv / F if tile else 0),
             # no recompute
             head=6 * tokens * head.n_decay / F + hbm_s["head"] + head.numel * 4 / hbm,
             # the scatter: zero an untied embedding's gradient, then add dy's rows (read 4, r+w 8)
             # sharded: the step's rows
             rows=s.tokens_step * d * row_b / v.h2d, dy=s.act_step / v.d2h,
             # their reduce_scatter
             rows_comm=(world - 1) / world * s.tokens_step * d * row_b / v.net,
             dy_comm=(world - 1) / world * s.act_step / v.net,                     # dy's all_gather
             scatter=(s.tokens_step * d * (4 + 8) + untied) / v.hbw,
             rows_res=tokens * d * 8 / hbm,      # resident: gathered and scattered on the GPU
             scatter_res=(tokens * d * (4 + 8) + untied) / hbm,
             ckpt_d2h=s.act / v.d2h, ckpt_h2d=s.act / v.h2d,
             **{k: lay.numel * r for k, r in rate.items()},
             host_fwd=host_s["fwd"], host_bwd=host_s["bwd"], host_head=host_s["head"],
             host_step=op_s * ENGINE_OPS["step"], host_update=op_s * ENGINE_OPS["update"])
    return t, numel, rate


def slabs(t, tied, step_of=None, most=0, fits=lambda k: True):
    """Gradient slabs: the fewest that hide a gradient's trip -- the slab of backward visit k is
    given back when update k-S finished, D2H + AdamW after that visit's compute; the GPU stalls
    unless S-1 backward visits outlast the trip (a tied head holds one more slab until the embedding
    scatter); at least stream.GRAD_SLABS -- then, given step_of(k) (the step time with k slabs) and
    `most` (a slab per streamed unit: no wait ever), as many more as save 1% of the step: where the
    host's AdamW is slower than the backward, its backlog holds a slab per unit it has still to
    update (the ones the next forward needs last: they wait), and a backward that waits for a slab
    waits for work that could come later. fits(k): k slabs fit in host memory."""
    trip = t["grad"] + t["adam"]
    k = max(stream.GRAD_SLABS, math.ceil(trip / max(t["bwd"], 1e-12)) + 1 + tied)
    k = min(k, most) if most else k                # a unit holds one slab at most
    if step_of is None or most <= k:
        return k
    lo, hi, goal = k, most, step_of(most) * 1.01   # the fewest within 1% (the step falls with k)
    if step_of(k) <= goal:                         # (the host keeps up: the usual case)
        return k
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if step_of(mid) <= goal else (mid + 1, hi)
    while lo > k and not fits(lo):
        lo -= 1
    return lo


def lane_units(s, resident):
    """The units of `resident` (indices into s.units) as simulate names them: "embed", 0 .. L-1,
    "head"."""
    last = len(s.units) - 1
    return {"head" if u == last else "embed" if not s.tied and u == 0 else u - (not s.tied)
            for u in resident}


def min_tokens(s, v, resident):
    """The tokens per step from which each transfer hides behind the compute that follows it."""
    streamed = sum(u.numel for i, u in enumerate(s.units) if i not in resident)
    mins = {"h2d": v.F * (s.sb / v.h2d + v.cast) / 2,   # a layer's forward (2NT) outlasts its copy
            "d2h": v.F * 4 / (6 * v.d2h),   # its recompute + backward (6NT) the fp32 grad
            # the step's compute (8NT) outlasts the host's AdamW of the units it updates
            "cpu_adam": v.F * (v.adam_b + 4 * s.defer) * s.gpus / (8 * v.hbw) * streamed / s.params}
    # (tokens of the whole step; sharded: a rank computes 1/N of them and copies 1/N of each unit,
    # the node's AdamW threads share its DRAM, and a backward visit's compute (6NT/N) outlasts a
    # gather + a reduce_scatter)
    if s.world > 1:
        mins["comm"] = v.F * (s.cb + 4) * (s.world - 1) / (6 * v.net)
    return mins


def simulate(L, t, numel, rate, defer_updates, tied, offload, slabs=stream.GRAD_SLABS, guard=False,
             overlap=True, steps=3, sharded=False, resident=frozenset(), need_first=None,
             gpu_updated=frozenset()):
    """Replay stream.Trainer.step's issue order on four lanes -- h2d, compute, d2h (CUDA streams,
    FIFO) and cpu_adam (the optimizer thread, in optim.Worker's order: work(); need_first None:
    NEED_FIRST) -- and the host thread that issues the work. A task
    starts when its lane is free, its inputs are ready and the host has issued it; the host issues
    in program order and blocks where the engine blocks: a unit's update before its copy
    (_await_update), a free gradient slab before each gradient's D2H (without deferral), the loss
    after the head (the guard), the squared norms (deferred) and the loss at the end of the step.
    Units: "embed", 0 .. L-1, "head". t: seconds of the per-step tasks; numel[kind] * rate[what]:
    seconds to load, drain ("grad"), "norm" or "adam" a unit. overlap=False (a CPU run): one lane,
    all in program order. Returns the steady-state step time (between the starts of the last two
    steps' first layer), the busy seconds per step of each lane, and each lane's seconds on the
    critical path of the last step (walked back from its end through the task each task waited
    for): the bottleneck. sharded:
    a fifth lane, comm (sharded.py): a unit's all_gather after its shard's H2D, its gradient's
    reduce_scatter before the D2H of the shard, the rows' reduce_scatter and dy's all_gather -- one
    collective at a time. resident: the units kept on the GPU -- cast into their slot and updated
    (or their norm taken) on the h2d lane, their gradient copied on d2h, the embedding's rows
    gathered and its dy scattered on the GPU: the host waits for none of it. gpu_updated: units
    whose gradient stays on the GPU (copied D2D, its norm taken there) and whose update crosses
    the link (gpu_update.GpuUpdated: master, state H2D into one of two scratches after its last D2H,
    the kernel, then D2H) on the h2d and d2h lanes; the unit's next H2D waits for that D2H."""
    need_first = NEED_FIRST if need_first is None else need_first
    free = dict.fromkeys(("h2d", "compute", "d2h", "cpu_adam") + (("comm",) if sharded else ()),
                         0.0)
    busy, critical, ends = dict.fromkeys(("host", *free),
                                         0.0), dict.fromkeys(("host", *free), 0.0), {}
    host = [0.0]                                 # when the host thread can issue its next operation
    last = [0.0]                                 # the start of the latest task

    def run(lane, after, dur, issued=None):     # issued: when the host issued it (None: now)
        key = lane if overlap else "compute"
        start = last[0] = max(free[key], after, host[0] if issued is None else issued)
        free[key] = start + dur
        busy[lane] += dur / steps
        if dur > 0:
            ends[free[key]] = (lane, start)    # whoever starts at this instant waited for this task
        return free[key]

    def block(until):                            # the host waits
        host[0] = max(host[0], until)

    def issue(h):                       # the host spends h issuing ops (no device work waits on it)
        busy["host"] += h / steps
        if h > 0:
            ends[host[0] + h] = ("host", host[0])
        host[0] += h

    def visit(after, dur, h):
        """A compute visit whose ops the host issues over h seconds: the GPU starts on the first and
        cannot finish before the last has been issued (then the host is what it waits for). On the
        CPU the one thread issues and computes, one after the other."""
        if not overlap:
            return run("compute", after, dur + h)
        h0 = host[0]
        end = run("compute", after, dur)
        issue(h)
        if host[0] > end:                   # host-bound: the GPU idles between the ops as they come
            free["compute"] = end = host[0]
            ends[end] = ("host", h0)
        return end

    def cost(what, u):
        return numel["layer" if isinstance(u, int) else u] * rate[what]

    def work(u, after, dur, gives_back=False):   # gives_back: the slab it was lent
        """A task of the optimizer thread (stream.Trainer._submit): it runs as optim.Worker picks
        it -- of the tasks issued and landed when the worker looks (its last task done, or the next
        issue), the one the next forward needs first; none landed: the oldest, once landed. Picks
        are made once nothing the host issues later could change them (pick)."""
        if not overlap:                          # one thread: in program order
            upd[u] = run("cpu_adam", after, dur)
            return puts.append(upd[u]) if gives_back else None
        pick(horizon=host[0])
        todo.append(dict(u=u, issued=host[0], at=max(after, host[0]), dur=dur, slab=gives_back,
                         need=0 if u == emb else L + 1 if u == "head" else u + 1))

    def pick(horizon=math.inf, until=lambda: False):
        while todo and not until():
            look = max(free["cpu_adam"], min(q["issued"] for q in todo))
            if look >= horizon:
                return
            seen = [q for q in todo if q["issued"] <= look]                   # oldest first
            landed = [q for q in seen if q["at"] <= look]
            q = min(landed, key=lambda q: q["need"]) if landed and need_first else seen[0]
            todo.remove(q)
            upd[q["u"]] = run("cpu_adam", q["at"], q["dur"], issued=q["issued"])
            if q["slab"]:
                puts.append(upd[q["u"]])

    def updated(u):                              # when unit u's latest update is done (0: none)
        pick(until=lambda: all(q["u"] != u for q in todo))
        return upd.get(u, 0.0)

    def slab():           # the host takes a gradient slab: the k-th given back (or one never lent)
        if (k := taken[0] - slabs) >= 0:
            pick(until=lambda: len(puts) > k)
            block(sorted(puts)[k])
        taken[0] += 1

    def load(u, after):                      # H2D (of the shard; then its all_gather into the slot)
        if u in resident:                    # a D2D cast, after its update on the same lane
            return run("h2d", after, cost("load_res", u))
        if u in gpu_updated:                 # after its update's D2H (the host waits for nothing)
            return run("h2d", max(after, back.get(u, 0.0)), cost("load", u))
        block(updated(u))
        x = run("h2d", after, cost("load", u))
        return run("comm", x, cost("all_gather", u)) if sharded else x

    # the worker's job per landing
    emb, first = ("head" if tied else "embed"), "norm" if defer_updates else "adam"
    first_res = "gpu_norm" if defer_updates else "gpu_adam"
    upd, starts = {}, []                         # unit -> when its latest update finished
    # the worker's tasks not run yet; when each slab was given back; how many the host took
    todo, puts, taken = [], [], [0]
    back, scratch_free = {}, [0.0, 0.0]         # gpu_updated: unit -> its D2H's end; each scratch's

    def on_gpu(u, after):                        # gpu_update.GpuUpdates.step: H2D, kernel, D2H
        k = turn[0] = 1 - turn[0]
        x = run("h2d", max(after, scratch_free[k]), cost("visit_h2d", u) + cost("gpu_adam", u))
        scratch_free[k] = back[u] = run("d2h", x, cost("visit_d2h", u))
        return x
    turn = [1]
    for _ in range(steps):
        slot_free, gslot_free, loaded, sent = [0.0, 0.0], [0.0, 0.0], {}, {}
        # forward: layer i in slot i % 2; the next unit is prefetched into the other slot
        issue(t.get("host_step", 0.0))            # the step's input: targets, checks
        loaded[0] = load(0, 0.0)
        if emb in resident:               # rows gathered on the GPU, after the table's update (h2d)
            x = run("compute", free["h2d"], t["rows_res"])
        else:
            block(updated(emb))
            x = run("h2d", 0.0, t["rows"])       # embedding rows, gathered from the updated master
        if sharded:                              # ... the parts of every rank's rows, summed
            x = run("comm", x, t["rows_comm"])
        for i in range(L):
            if offload:
                sent[i] = run("d2h", x, t["ckpt_d2h"])
            x = visit(max(loaded[i], x), t["fwd"], t.get("host_fwd", 0.0))
            if i == 0:
                starts.append(last[0])
            slot_free[i % 2] = x
            nxt = i + 1 if i + 1 < L else "head"
            loaded[nxt] = load(nxt, slot_free[1 - i % 2])
        # head: loss forward and backward per chunk, its gradient goes down first (grad slot 0)
        x = slot_free[L % 2] = visit(max(loaded["head"], x), t["head"], t.get("host_head", 0.0))
        loss = x
        if guard:                              # the non-finite guard: the host reads the loss first
            block(loss)

        def drain(unit, k, after):    # grad visit k: a slab (unless deferred), D2H, then the worker
            if unit in resident or unit in gpu_updated:   # D2D into its store, then its update
                done = gslot_free[k % 2] = run("d2h", after, cost("grad_res", unit))   # (or norm)
                if unit in gpu_updated and not defer_updates:
                    upd[unit] = on_gpu(unit, done)
                elif unit != emb:
                    upd[unit] = run("h2d", done, cost(first_res, unit))
                return done
            if not defer_updates:
                slab()
            if sharded:                   # the reduce_scatter frees the grad slot; D2H of the shard
                after = gslot_free[k % 2] = run("comm", after, cost("reduce_scatter", unit))
            done = run("d2h", after, cost("grad", unit))
            if not sharded:                      # the D2H frees the grad slot
                gslot_free[k % 2] = done
            if unit == emb:                      # tied: its update follows the embedding scatter
                return done
            work(unit, done, cost(first, unit) + t.get("host_update", 0.0), not defer_updates)
            return done
        drain("head", 0, x)
        # backward: layer L-1 is still resident; recompute from the boundary activations, grads
        # drain as they finish
        ready = run("h2d", sent[L - 1], t["ckpt_h2d"]) if offload else 0.0
        for k, i in enumerate(reversed(range(L)), start=1):
            if i > 0:
                loaded[i - 1] = load(i - 1, slot_free[(i - 1) % 2])
            nxt_ready = run("h2d", sent[i - 1], t["ckpt_h2d"]) if offload and i > 0 else 0.0
            x = slot_free[i % 2] = visit(max(loaded[i], ready, gslot_free[k % 2], x), t["bwd"],
                                         t.get("host_bwd", 0.0))
            drain(i, k, x)
            ready = nxt_ready
        # embedding: dy of layer 0 goes down, the worker scatters it into the rows used
        if emb in resident:                      # dy stays: scattered and the table updated on h2d
            upd[emb] = run("h2d", run("d2h", x, 0.0), t["scatter_res"] + cost(first_res, emb))
        else:
            dy = run("comm", x, t["dy_comm"]) if sharded else x     # dy of every rank, all_gathered
            landed = run("d2h", dy, t["dy"])             # dy's D2H is issued, then the slab taken
            if not defer_updates and not tied:
                slab()
            work(emb, landed,                            # the scatter, then the update: one task
                 t["scatter"] + cost(first, emb) + t.get("host_update", 0.0), not defer_updates)
        block(loss)                              # the step's loss, read on the host
        # every norm known: updates in forward order, the next forward waits per unit
        if defer_updates:
            pick(until=lambda: not todo)
            block(max(upd.values()))
            for u in [emb] + list(range(L)) + ([] if tied else ["head"]):
                upd[u] = run("h2d", 0.0, cost("gpu_adam", u)) if u in resident else \
                    on_gpu(u, 0.0) if u in gpu_updated else \
                    run("cpu_adam", 0.0, cost("adam", u) + t.get("host_update", 0.0))
    now = starts[-1]
    while now > starts[-2] and now in ends:    # each task ends where it starts, or earlier: bounded
        lane, start = ends[now]
        if start >= now:              # a duration lost to float rounding at huge times: no progress
            break
        critical[lane] += now - max(start, starts[-2])
        now = start
    return starts[-1] - starts[-2], busy, critical
