# %% [markdown]
# # Lesson 4 -- three streams and a ping-pong, built by hand
#
# **What you will learn**
#
# * how a GPU overlaps copies with compute: **streams** (queues that run concurrently) and
#   **events**;
# * the engine's ping-pong, from scratch: two weight slots -- layer i computes from one while layer
#   i+1 is copied into the other -- two gradient slots, the events that make reusing them safe, and
#   the hand-off of each gradient to AdamW on a CPU thread while the GPU moves on;
# * the proof: the hand-written schedule gives `stream.Trainer`'s losses and weights bit for bit,
#   and the order of operations it issued obeys every ordering rule -- checked, and drawn as a
#   timeline.
#
# Lessons 2-3 gave us the maths (forward without a graph, head, backward by recompute) and a host
# store with AdamW. Done naively -- copy, wait, compute, copy, wait -- the GPU would idle during
# every copy.
#
# Run it: `python tutorials/04_three_streams.py` (~2 s on a 2-core CPU; with CUDA the lanes are real
# streams).

# %%
import contextlib
import sys
from collections import Counter, namedtuple
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = (Path(__file__).resolve().parents[1] if "__file__" in globals()   # a script, or a notebook
        else Path.cwd().resolve().parent)                                 # run from tutorials/
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
import stream  # noqa: E402
from megatrain_min.engine.pinned import page_locked  # noqa: E402
from optim import AdamW, HostStore  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
torch.backends.cuda.matmul.allow_tf32 = False           # fp32 means fp32 (the engine does the same)

# %% [markdown]
# ## 1. Lanes that keep a log
#
# A stream runs its work in issue order; two streams run concurrently. An event recorded on a stream
# fires once the work issued before it is done; a stream that waits for it starts nothing issued
# after the wait before then, and the host can block on it. The engine has three streams -- **h2d**
# copies weights in, **compute** runs the layers, **d2h** copies gradients out -- and a CPU thread
# for AdamW. Our `Lane` is a stream that also logs what it ran (with the buffers read and written)
# and which events it recorded and waited for. With CUDA it wraps a `torch.cuda.Stream`; on the CPU
# it has none and the work runs synchronously in program order. The host and the AdamW thread are
# lanes without a stream, so that their waits are logged too.

# %%
# cuda: the torch.cuda.Event, None on the CPU or between host threads
Event = namedtuple("Event", "name cuda")


class Lane:
    def __init__(self, name, log, device=False):
        self.name, self.log, self.forgetful = name, log, False
        self.stream = torch.cuda.Stream(DEV) if device and CUDA else None

    def __call__(self):                       # `with lane():` issues the work inside on this stream
        return torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()

    # logs the work issued next: a name, the buffers it touches
    def op(self, what, reads=(), writes=()):
        self.log.append((self.name, "op", what, tuple(reads), tuple(writes)))

    def record(self, name):
        ev = Event(name, self.stream.record_event() if self.stream else None)
        self.log.append((self.name, "record", ev, (), ()))
        return ev

    def wait(self, ev):                        # ev None: nothing recorded yet (a slot's first use)
        if ev is not None and not self.forgetful:
            self.log.append((self.name, "wait", ev, (), ()))
            if self.stream:
                self.stream.wait_event(ev.cuda)    # the stream waits, the host goes on
            elif ev.cuda is not None:
                ev.cuda.synchronize()              # a host thread blocks until the device got there

# %% [markdown]
# ## 2. The schedule
#
# The host store is lesson 3's `HostStore`: fp32 master, m, v and gradient per unit, numbered as
# `model.units` lists them (0 the embedding, 1..L the layers, L+1 the head). On the device: weight
# slots A and B, two fp32 gradient slots, each as big as the largest unit that visits, with views
# made once per slot (every layer has the same layout, lesson 1); layer i always sits in slot i % 2.
# The events, named as in `stream.py`:
#
# | event | recorded by | after | waited for by | so that |
# |---|---|---|---|---|
# | `slot_loaded[s]` | h2d | the copy into slot s | compute | no compute on half-copied weights |
# | `slot_free[s]` | compute | last read of slot s | h2d; d2h | in-use weights kept; whole grad |
# | `gslot_free[g]` | d2h | the copy out of grad slot g | compute; AdamW | no grad zeroed unsent |
# | `loss_ready` | compute | the loss's copy to the host | the host | the loss read once written |
#
# And a hand-off on the host: a unit is copied in only after its last AdamW finished (`updated[u]`).

# %%
class PingPong:
    def __init__(self, cfg, weights, micro_batches, **adamw):
        self.cfg, self.M = cfg, micro_batches
        self.log = []       # what each lane did, in order
        self.steps = []     # where each step begins in log
        self.units = model.units(cfg)
        self.label = ["E", *map(str, range(cfg.n_layer)), "H"]    # unit -> its name in the timeline
        lr, wd = adamw.pop("lr"), adamw.pop("weight_decay")
        self.opt = HostStore([(lay.numel, lay.n_decay) for lay in self.units], AdamW(**adamw), lr,
                             wd, pinned=page_locked if CUDA else None)
        for u, lay in enumerate(self.units):
            for key, view in lay.key_views(self.opt.master[u]).items():
                view.copy_(weights[key])
        self.h2d, self.comp, self.d2h = (Lane(n, self.log, device=True)
                                         for n in ("h2d", "compute", "d2h"))
        self.host, self.adam = Lane("host", self.log), Lane("cpu adam", self.log)
        # the AdamW thread
        self.worker = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,))
        n = max(lay.numel for lay in self.units[1:])
        with self.comp():                                    # made on the lane that uses them first
            # (n,) fp32: weight slots A, B
            self.wslot = [torch.empty(n, device=DEV) for _ in range(2)]
            self.gslot = [torch.zeros(n, device=DEV) for _ in range(2)]  # (n,) fp32: gradient slots
        lay, head = self.units[1], self.units[-1]

        def leaves(flat, layout):   # weight views as leaves to differentiate
            return {k: v.detach().requires_grad_() for k, v in layout.views(flat).items()}
        self.wviews = [{"layer": leaves(w, lay), "head": leaves(w, head)} for w in self.wslot]
        self.gviews = [{"layer": lay.views(g), "head": head.views(g)} for g in self.gslot]
        self.slot_loaded, self.slot_free, self.gslot_free = [None, None], [None, None], [None, None]
        self.updated = {}                                        # unit -> Future of its last AdamW
        self.loss_host = torch.zeros((), pin_memory=CUDA)        # the step's loss lands here (host)

    def ready(self, u):              # the host waits for unit u's last update: no half-updated copy
        if u in self.updated:
            self.host.wait(self.updated.pop(u).result())

    def wait(self):
        for u in list(self.updated):
            self.ready(u)

    def load(self, u, s):                   # h2d: unit u's fp32 master into weight slot s, one copy
        self.ready(u)
        with self.h2d():
            self.h2d.wait(self.slot_free[s])
            self.h2d.op(f"{self.label[u]}>{'AB'[s]}", [f"master[{u}]"], [f"wslot[{s}]"])
            self.wslot[s][:self.units[u].numel].copy_(self.opt.master[u], non_blocking=True)
            self.slot_loaded[s] = self.h2d.record(f"slot_loaded[{s}]")

    def drain(self, u, s, g):            # compute is done with unit u in weight slot s, grad slot g
        self.slot_free[s] = done = self.comp.record(f"slot_free[{s}]")
        with self.d2h():
            self.d2h.wait(done)                               # grad slot g holds the whole gradient
            self.d2h.op(f"g{self.label[u]}", [f"gslot[{g}]"], [f"grad[{u}]"])
            self.opt.grad[u].copy_(self.gslot[g][:self.units[u].numel], non_blocking=True)
            self.gslot_free[g] = landed = self.d2h.record(f"gslot_free[{g}]")
        self.hand_over(u, landed, [f"grad[{u}]"])

    # AdamW of unit u on the CPU thread once it landed
    def hand_over(self, u, landed, reads, scatter=None):
        def task():
            self.adam.wait(landed)
            self.adam.op(f"a{self.label[u]}", reads,
                         [f"grad[{u}]"] * bool(scatter) + [f"master[{u}]"])
            if scatter:
                scatter()
            self.opt.step(u)                                # fused AdamW on the unit's flat buffers
            return self.adam.record(f"updated[{u}]")
        self.updated[u] = self.worker.submit(task)

    def step(self, tokens, targets):
        cfg, M, comp = self.cfg, self.M, self.comp
        L = cfg.n_layer
        self.steps.append(len(self.log))
        n_tok = max(1, int((targets != model.IGNORE).sum()))        # the step's loss is sum / n_tok
        with comp():
            rope = model.rope_cache(cfg, tokens.shape[1], DEV)
            tgt = targets.to(DEV).chunk(M)                             # M x (B/M, T), on the device
            # ---- forward: layer i computes from slot i % 2 while the next unit is copied into the
            # other
            self.load(1, 0)
            self.ready(0)                                 # the rows come from the updated embedding
            self.host.op("rows", ["master[0]"])
            x = self.units[0].views(self.opt.master[0])["embed"][tokens]    # (B, T, d), on the host
            x = list(x.to(DEV).chunk(M))                             # M x (B/M, T, d), compute lane
            ckpt = []
            for i in range(L):
                s = i % 2
                comp.wait(self.slot_loaded[s])
                comp.op(str(i), [f"wslot[{s}]"])
                ckpt.append(x)                            # layer i's input (lesson 2), compute lane
                with torch.no_grad():
                    x = [model.block(cfg, xj, self.wviews[s]["layer"], rope) for xj in x]
                self.slot_free[s] = comp.record(f"slot_free[{s}]")
                self.load(i + 2, 1 - s)                      # layer i+1, or the head after the last
            # ---- head, forward and backward at once: loss, dy of the last layer, its gradient in
            # grad slot 0
            s = L % 2
            comp.wait(self.slot_loaded[s])
            comp.wait(self.gslot_free[0])
            comp.op("H", [f"wslot[{s}]"], ["gslot[0]", "loss"])
            self.gslot[0].zero_()
            loss, dy = torch.zeros((), device=DEV), []            # fp32 scalar; dy: M x (B/M, T, d)
            for xj, tj in zip(x, tgt):
                lj, dx = model.head_grad(cfg, xj.reshape(-1, cfg.d_model), self.wviews[s]["head"],
                                         tj.reshape(-1),
                                         n_tok, self.gviews[0]["head"],
                                         model.default_chunk_tokens(cfg))
                dy.append(dx.view_as(xj))                              # (B/M, T, d), compute lane
                loss += lj
            self.loss_host.copy_(loss, non_blocking=True)
            loss_ready = comp.record("loss_ready")
            self.drain(L + 1, s, 0)
            # ---- backward: layer L-1 is still in its slot; layer i-1 is copied in while layer i
            # recomputes
            for i in reversed(range(L)):
                s, g = i % 2, (L - i) % 2
                if i > 0:
                    self.load(i, 1 - s)                                # unit i = layer i-1
                comp.wait(self.slot_loaded[s])
                comp.wait(self.gslot_free[g])
                comp.op(f"{i}'", [f"wslot[{s}]"], [f"gslot[{g}]"] + ["dy"] * (i == 0))
                self.gslot[g].zero_()
                for j in range(M):                            # fp32 accumulation over micro-batches
                    dy[j] = model.block_grad(cfg, ckpt[i][j], self.wviews[s]["layer"], rope, dy[j],
                                             self.gviews[g]["layer"])
                ckpt[i] = None
                self.drain(i + 1, s, g)
            # ---- dy of layer 0, (B, T, d), to the host: the embedding's gradient, behind layer 0's
            # on d2h
            dy_host = torch.empty((*tokens.shape, cfg.d_model), pin_memory=CUDA)   # (B, T, d), host
            with self.d2h():
                self.d2h.op("dy", ["dy"], ["dy_host"])
                for dst, dyj in zip(dy_host.chunk(M), dy):
                    if CUDA:
                        dyj.record_stream(self.d2h.stream)             # made on compute, read here
                    dst.copy_(dyj, non_blocking=True)
                dy_ready = self.d2h.record("dy_ready")
        # (V, d): the embedding's gradient
        table = self.opt.grad[0].view(cfg.vocab_size, cfg.d_model)

        def scatter():
            table.zero_().index_add_(0, tokens.reshape(-1), dy_host.reshape(-1, cfg.d_model))
        self.hand_over(0, dy_ready, ["dy_host"], scatter)
        self.host.wait(loss_ready)
        self.host.op("loss", ["loss"])
        return self.loss_host.item()

# %% [markdown]
# ## 3. The same numbers as the engine
#
# Three steps of the toy model (4 layers, lesson 1), 2 micro-batches, some targets ignored, fp32,
# from the same weights on the same batches: the same ops in the same order on the same values -- so
# the same bits.

# %%
cfg, HP = model.PRESETS["toy"], dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
w0 = model.init_weights(cfg, seed=0)
gen = torch.Generator().manual_seed(0)
# tokens, targets: (B, T) each
batches = [torch.randint(0, 256, (2, 4, 32), generator=gen) for _ in range(3)]
for _, tgt in batches:
    tgt[:, :4] = model.IGNORE                                        # no loss on the first 4 tokens
engine = stream.Trainer(cfg, w0, device=DEV, dtype=torch.float32, grad_clip=0.0, micro_batches=2,
                        **HP)
ours = PingPong(cfg, w0, micro_batches=2, **HP)
losses = [(ours.step(*b), engine.step(*b)) for b in batches]
ours.wait()
w_engine = engine.weights()
w_ours = {k: v for u, lay in enumerate(ours.units)
          for k, v in lay.key_views(ours.opt.master[u]).items()}
diff = {k: w_ours[k] - w_engine[k] for k in w0}
loss_rel = max(abs(a - b) / b for a, b in losses)
w_abs = max(d.abs().max().item() for d in diff.values())
w_rel = (sum(d.pow(2).sum() for d in diff.values()) / sum(w.pow(2).sum()
                                                          for w in w_engine.values())).sqrt().item()
bitwise = all(a == b for a, b in losses) and w_abs == 0
print("losses, by hand / stream.Trainer:", "   ".join(f"{a:.9f} / {b:.9f}" for a, b in losses))
print(f"losses max rel diff {loss_rel:.1e}; weights max |diff| {w_abs:.1e}, ||diff|| / ||w|| "
      f"{w_rel:.1e}; bit for bit: {bitwise}")

# %% [markdown]
# ## 4. What the schedule issued
#
# On the CPU every op ran as it was issued: the numbers cannot tell a missing wait from a present
# one, the log can. Step 2 begins with the host waiting for step 1's AdamW of layer 0 (unit 1):

# %%
step_2 = [e for e in ours.log[ours.steps[1]:] if e[0] != "cpu adam"]
for lane, kind, what, reads, writes in step_2[:9]:
    if kind == "op":
        print(f"  {lane:<8} {kind:<7} {what:<4} {', '.join(reads)} -> {', '.join(writes)}")
    else:
        print(f"  {lane:<8} {kind:<7} {what.name}")

# %% [markdown]
# ## 5. Happens-before, checked
#
# On a GPU op a surely finishes before op b starts only if lane order and events chain a to b.
# Replay the log with a **vector clock** per lane (how many ops of each lane it knows finished): an
# op ticks its own lane,
# `record` copies the lane's clock into the event, `wait` takes the maximum with it, and the device
# lanes take in the host's clock (the host issues their work). Then a happens before b when b's
# clock has counted a, and:
#
# * two ops on two lanes touching one buffer, one writing it, must be ordered -- else on a GPU the
#   result depends on timing, a **race** (`wslot`: slot_loaded and slot_free; `gslot`: gslot_free;
#   `grad`: the landed gradient; `master`: an update before the next copy; `loss`: loss_ready);
# * an op that reads a weight slot must read the unit that the last copy ordered before it put
#   there.

# %%
Op = namedtuple("Op", "lane tick clock what reads writes")
DEVICE_LANES = ("h2d", "compute", "d2h")


def replay(log):
    clocks, recorded, ops = {}, {}, []

    def join(c, other):
        c.update({k: max(c.get(k, 0), t) for k, t in other.items()})
    for lane, kind, what, reads, writes in log:
        c = clocks.setdefault(lane, {})
        if lane in DEVICE_LANES:
            join(c, clocks.get("host", {}))
        if kind == "record":
            recorded[id(what)] = dict(c)                         # an event is known by its identity
        elif kind == "wait":
            join(c, recorded[id(what)])
        else:
            c[lane] = c.get(lane, 0) + 1
            ops.append(Op(lane, c[lane], dict(c), what, reads, writes))
    return ops


def check(ops):
    """(races, ordered conflicting pairs per kind of buffer, reads of a weight slot holding the
    wrong unit)."""
    before = lambda a, b: b.clock.get(a.lane, 0) >= a.tick                 # noqa: E731
    races, ordered, wrong = [], Counter(), []
    for k, a in enumerate(ops):
        for b in ops[k + 1:]:
            shared = (set(a.writes) & set(b.reads + b.writes)) | (set(a.reads) & set(b.writes))
            if a.lane != b.lane and shared and (before(a, b) or before(b, a)):
                ordered.update(buf.split("[")[0] for buf in shared)
            elif a.lane != b.lane and shared:
                races.append((a, b, sorted(shared)))
        for slot in [r for r in a.reads if r.startswith("wslot")]:
            copies = [c for c in ops if slot in c.writes and before(c, a)]
            if not copies or copies[-1].what.split(">")[0] != a.what.rstrip("'"):
                wrong.append(a)
    return races, ordered, wrong


ops = replay(ours.log)
races, ordered, wrong = check(ops)
print(f"{len(ops)} ops in 3 steps; {sum(ordered.values())} conflicting pairs on two lanes, all "
      f"ordered ({', '.join(f'{k} {n}' for k, n in ordered.items())}); {len(races)} races; "
      f"{len(wrong)} wrong slot reads")

# %% [markdown]
# A slip a refactoring could make: an h2d lane that forgets its waits. On the CPU no number changes
# -- every op still runs in program order -- but the checker sees copies into a slot that compute
# may still be reading:

# %%
forgetful = PingPong(cfg, w0, micro_batches=2, **HP)
forgetful.h2d.forgetful = True
same = [forgetful.step(*b) for b in batches[:2]] == [a for a, _ in losses[:2]]
forgetful.wait()
bad = check(replay(forgetful.log))[0]
a, b, bufs = bad[0]
print(f"forgetful h2d lane: same losses {same}; {len(bad)} races, e.g. {a.lane} {a.what!r} / "
      f"{b.lane} {b.what!r} on {bufs}")

# %% [markdown]
# ## 6. The timeline
#
# Give every op the same duration and start it once all that happens before it has finished: the
# overlap the events allow (lesson 10 replays the engine with real durations). Steps 1 and 2, one
# column per op: `1>B` copies layer 1 into slot B, `1` is its forward, `H` the head (forward and
# backward), `1'` the recompute and backward of layer 1, `g1` its gradient to the host, `a1` its
# AdamW; `dy` and `aE`: the embedding's.

# %%
col, end = [], {}                # the column each op starts in; (lane, tick) -> the column after it
for o in ops:
    # each lane's last op before o
    last = [(lane, t - (lane == o.lane)) for lane, t in o.clock.items()]
    col.append(max([end[p] for p in last if p[1] > 0] + [0]))
    end[o.lane, o.tick] = col[-1] + 1


def at(lane, what):
    return [c for o, c in zip(ops, col) if (o.lane, o.what) == (lane, what)]


width = at("compute", "0")[2]                 # up to step 3's first layer
for lane in (*DEVICE_LANES, "cpu adam"):
    cells = [" " * 4] * width
    for o, c in zip(ops, col):
        if o.lane == lane and c < width:
            cells[c] = f"{o.what:<4}"
    print(f"  {lane:<8}|{''.join(cells).rstrip()}")

# %% [markdown]
# In the forward each copy runs beside the compute before it (`1>B` under `0`). The head sits in
# slot A, which layer 2 needs next, so `2>A` waits for `H`; layer 3 needs no copy in the backward.
# Gradients leave one visit behind the compute, AdamW runs one behind them. Step 2's first copy
# waits for `a0` and its first layer for
# `aE` (the rows come from the updated embedding): the backward ends with the units the next forward
# needs first. That bubble is a large part of a 4-layer step and a small one of a 32-layer step.
#
# ## Check
#
# By hand == `stream.Trainer` (bit for bit on the CPU, within 1e-6 anywhere); every conflicting pair
# ordered, every slot read the right unit, a forgetful h2d lane caught; the forward copies overlap
# the compute before them, and step 2 starts right after `a0`.

# %%
assert loss_rel <= 1e-6 and w_rel <= 1e-6, (loss_rel, w_rel)
assert bitwise or CUDA, "on the CPU the same ops in the same order give the same bits"
assert not races and not wrong and ordered["wslot"] and ordered["gslot"] and ordered["grad"]
# GPU: a real race
assert (same or CUDA) and any("wslot[0]" in bufs or "wslot[1]" in bufs for _, _, bufs in bad)
assert all(at("h2d", f"{i + 1}>{'AB'[(i + 1) % 2]}")[0] == at("compute", str(i))[0]
           for i in range(cfg.n_layer - 1))
assert at("h2d", "0>A")[2] == at("cpu adam", "a0")[0] + 1
print(f"OK  by hand == stream.Trainer over 3 steps: losses {loss_rel:.0e}, weights max |diff| "
      f"{w_abs:.0e} (bit for bit: {bitwise}); {sum(ordered.values())} conflicting pairs ordered, 0 "
      f"races; forgetful h2d: {len(bad)} races")
