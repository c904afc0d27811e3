"""race.py -- a happens-before race checker for the engine's lanes and threads (what CUDA's
sanitizer does on a GPU).

What it is
    Checker consumes megatrain_min.sim.record.Recorder's stream. Each actor -- the lanes h2d,
    compute, d2h, default and the host threads main and worker -- keeps a vector clock. Edges:
      issue       an op on a lane comes after everything its host thread did before issuing it;
      record/wait an event carries the recording lane's clock; a lane that waits for it joins it;
      host waits  host_wait(event), synchronize(), a Future's result(), a slab taken from the pool
                  (after the put that gave it back), a task's start (after its submit), a blocking
                  copy;
      tasks       the optimizer thread's tasks are ordered by these edges alone, not by the order
                  they came in: optim.Worker runs them most-needed first. Each task is an actor of
                  its own ("worker task 7"), its clock its submit's;
    Every access (storage, byte range, read or write, actor, the actor's tick) is kept per storage.
    Two accesses conflict when their ranges overlap, at least one writes, and they come from
    different actors; without an edge from the first to the second it is a race: reported with the
    buffer's name, both ops, both actors and both source lines.
    The caching allocator's rules, checked too: a device block belongs to the lane it was allocated
    on, whose kernels issued before the allocation may still use it (the allocator hands a block
    freed on a stream to that stream's next allocation at once), so another lane's first touch of it
    must come after them; a block freed on the host while another lane may still use it goes to the
    next allocation on its own lane (no Lane.uses / record_stream); and a lane's kernel must not
    touch memory made outside any lane (which on the CPU cannot be told apart from work on CUDA's
    legacy default stream: both are wrong, both are reported). Counted per step: host syncs with
    their source lines, bytes per copy lane, weight copies per unit.
What it is not
    Not a data-flow analysis of values: it sees what the engine did in this run, on these shapes and
    options (tests/sim/test_sim.py runs the option matrix).
Reference
    torch/cuda/_sanitizer.py: vector clocks per stream and event, accesses from the op schema;
    CSAN's report.
"""
import collections

from megatrain_min.plan import cost
from megatrain_min.sim.record import LANES

ALLOCATIONS = {str(f) for f in cost.EMPTY}   # ops that only allocate: no kernel runs on the lane


class Clock(dict):
    """A vector clock: actor -> the last tick of that actor known to have happened before."""

    def join(self, other):
        for k, v in other.items():
            if v > self.get(k, 0):
                self[k] = v

    def knows(self, actor, tick):
        return self.get(actor, 0) >= tick


class Checker:
    def __init__(self, limit=20):
        self.vc = collections.defaultdict(Clock)       # actor -> its clock
        self.events, self.tasks, self.ends, self.puts = {}, {}, {}, {}
        self.history = collections.defaultdict(list)    # Storage -> [access]
        # allocating lane -> storages freed on the host
        self.pending_free = collections.defaultdict(list)
        self.made = {}   # device Storage -> (lane, its last kernel before, the op)
        self.kernel = collections.Counter()   # lane -> the tick of its latest op that runs a kernel
        self.races, self.seen, self.limit, self.unnamed = [], set(), limit, []
        self.rec = None                          # set by the first op: names come from the recorder
        self.steps, self.k, self.task = [], None, "worker"   # the worker's task running now

    # ---- per-step figures
    def step(self, k):
        self.k = k
        for race, st in self.unnamed:
            race["buffer"] = self.rec_name(st)
        self.unnamed = [(race, st) for race, st in self.unnamed if st.name is None]
        self.steps.append(
            dict(syncs=collections.Counter(), worker_waits=collections.Counter(), h2d_bytes=0,
                               d2h_bytes=0, copies=collections.Counter()))

    def sync(self, thread, what, src):
        """Count a blocking point: the main thread waiting on the device is a host sync (it stalls
        the issue of work); the worker's waits for its gradients are listed apart."""
        if self.steps:
            self.steps[-1]["syncs" if thread == "main" else "worker_waits"][f"{what} at {src}"] += 1

    # ---- ordering edges
    def tick(self, actor):
        c = self.vc[actor]
        c[actor] = c.get(actor, 0) + 1
        return c[actor]

    def record(self, lane, event):
        self.vc[lane].join(self.vc["main"])
        self.events[event.eid] = Clock(self.vc[lane])

    def wait(self, lane, event):
        self.vc[lane].join(self.vc["main"])
        self.vc[lane].join(self.events[event.eid])

    def who(self, thread):  # the actor: a host thread, or the worker's task running now
        return self.task if thread == "worker" else thread

    def host_wait(self, thread, event, src):
        self.vc[self.who(thread)].join(self.events[event.eid])
        self.sync(thread, "host_wait(event)", src)

    def synchronize(self, thread, src):
        for lane in LANES:
            self.vc[self.who(thread)].join(self.vc[lane])
        self.sync(thread, "synchronize()", src)

    def submit(self, thread, task, **_):
        self.tasks[task] = Clock(self.vc[self.who(thread)])
        self.tick(self.who(thread))

    def task_start(self, task):   # no edge from the task before: they run in any order
        self.task = f"worker task {task}"
        self.vc[self.task] = Clock(self.tasks[task])

    def task_end(self, task):
        self.ends[task] = Clock(self.vc[self.task])
        self.vc.pop(self.task)        # (its clock lives on in ends[task])
        self.task = "worker"

    def result(self, thread, task):
        self.vc[self.who(thread)].join(self.ends[task])

    def put(self, thread, item):
        self.puts[item] = Clock(self.vc[self.who(thread)])
        self.tick(self.who(thread))

    def get(self, thread, item, src):
        self.vc[self.who(thread)].join(self.puts[item])
        self.sync(thread, "gradient slab taken (waits for the worker)", src)

    def uses(self, **_):
        pass

    def free(self, storage):
        self.pending_free[storage.made_on].append(storage)

    # ---- accesses
    def op(self, op):
        a = self.who(op.actor)
        if a in LANES:
            self.vc[a].join(self.vc["main"])            # issued by the host thread
        tick = self.tick(a)
        if op.fresh and a in LANES:           # the allocator may hand out blocks freed on this lane
            for st in self.pending_free.pop(a, []):
                self.check_free(st, a, op)
            self.made.update(
                {st: (a, self.kernel[a], op) for st in op.fresh if st.where == "device"})
        if a in LANES and op.name not in ALLOCATIONS:
            self.kernel[a] = tick
        for st, lo, hi in op.reads:
            self.access(st, lo, hi, False, a, tick, op)
        for st, lo, hi in op.writes:
            self.access(st, lo, hi, True, a, tick, op)
        # a kernel touching memory not made on a lane (more than a scalar)
        for st, lo, hi in op.reads + op.writes:
            if a in LANES and op.kind == "compute" and st.where != "device" and hi - lo > 8:
                self.flag(st, f"a lane op touches memory made outside any lane ({st.made_by} on "
                              f"{st.made_on}): host memory, or with CUDA the legacy default "
                              "stream, which the lanes do not wait for",
                          op, None)
        if op.blocking:                                  # the host waits for a synchronous copy
            self.vc["main"].join(self.vc[a])
            self.sync("main", f"blocking {op.kind} copy ({op.name})", op.src)
        if op.name == "aten._local_scalar_dense.default" and any(st.where == "device"
                                                                 for st, _, _ in op.reads):
            self.sync(a, ".item() of a device tensor", op.src)
        if self.steps and op.kind in ("h2d", "d2h"):
            self.steps[-1][f"{op.kind}_bytes"] += sum(hi - lo for _, lo, hi in op.writes)
            names = [self.rec_name(st) for st, _, _ in op.reads]
            dest = [self.rec_name(st) for st, _, _ in op.writes]
            if op.kind == "h2d" and any(d.startswith(("wslot", "cast")) for d in dest):
                self.steps[-1]["copies"][names[0].split("[", 1)[-1].rstrip("]")] += 1

    def access(self, st, lo, hi, write, actor, tick, op):
        hist = self.history[st]
        clock = self.vc[actor]
        lane, before, made = self.made.get(st, (actor, 0, None))
        if lane != actor and actor in LANES and not clock.knows(lane, before):
            self.flag(st, f"first touch on {actor} of a block allocated on {lane} before {actor} "
                          f"waited for what {lane} issued earlier: the caching allocator may hand "
                          f"{lane}'s next allocation a block its kernels still use (allocate on "
                          "the lane that writes it, Lane.uses on the others)", made, op)
        for plo, phi, pactor, pwrite, ptick, pop in hist:
            if plo < hi and lo < phi and pactor != actor and (write or pwrite) \
                    and not clock.knows(pactor, ptick):
                self.flag(st, f"{'write' if pwrite else 'read'} on {pactor} / "
                              f"{'write' if write else 'read'} on {actor} without a "
                              "happens-before edge", pop, op)
        # an access is superseded by a later one of the same actor that covers it and writes if it
        # wrote
        hist[:] = [h for h in hist
                   if not (h[2] == actor and lo <= h[0] and h[1] <= hi and (write or not h[3]))]
        hist.append((lo, hi, actor, write, tick, op))

    def check_free(self, st, lane, op):
        for plo, phi, pactor, pwrite, ptick, pop in self.history.pop(st, []):
            if pactor in LANES and pactor != lane and pactor not in st.kept \
                    and not self.vc[lane].knows(pactor, ptick):
                self.flag(st, f"freed on the host while {pactor} may still use it: the allocator "
                              f"hands it to the next allocation on {lane} (no Lane.keep / "
                              f"record_stream on {pactor})", pop, op)

    # ---- reports
    def attach(self, rec):
        self.rec = rec

    def rec_name(self, st):
        return self.rec.name_of(st) if self.rec else f"storage {st.sid}"

    def flag(self, st, what, first, second):
        """Keep one report per (buffer, kind, pair of source lines)."""
        name = self.rec_name(st)
        key = (name.split(" "
                          "from ")[0], what.split(":")[0], first.src if first else None,
               second.src if second else None)
        if key in self.seen:
            return
        self.seen.add(key)
        self.races.append(dict(buffer=name, what=what, step=self.k,
                               first=dict(op=first.name, actor=first.actor,
                                          src=first.src) if first else None,
                               second=dict(op=second.name, actor=second.actor, src=second.src)
                               if second else None))
        # a buffer the engine names only later (the step's targets): named at the next step
        if st.name is None:
            self.unnamed.append((self.races[-1], st))

    def summary(self):
        """The report a person reads: races first, then the per-step figures."""
        lines = []
        for r in self.races[:self.limit]:
            lines.append(f"RACE on {r['buffer']} (step {r['step']}): {r['what']}")
            for tag in ("first", "second"):
                if r[tag]:
                    lines.append(f"    {tag:<6} {r[tag]['op']:<46} on {r[tag]['actor']:<8} at "
                                 f"{r[tag]['src']}")
        if len(self.races) > self.limit:
            lines.append(f"... and {len(self.races) - self.limit} more")
        for k, s in enumerate(self.steps[:-1]):
            lines.append(f"step {k + 1}: {sum(s['syncs'].values())} host syncs on the main thread, "
                         f"{sum(s['worker_waits'].values())} waits of the optimizer thread; H2D "
                         f"{s['h2d_bytes']:,} B, D2H {s['d2h_bytes']:,} B; weight copies: "
                         + ", ".join(f"{u} x{n}" for u, n in s["copies"].items()))
            lines += [f"    main   {n} x {where}" for where, n in s["syncs"].items()]
            lines += [f"    worker {n} x {where}" for where, n in s["worker_waits"].items()]
        lines.append("races: "
                     f"{len(self.races)}" + (" -- the schedule is "
                                             "ordered" if not self.races else ""))
        return "\n".join(lines)
