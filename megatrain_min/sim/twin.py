"""twin.py -- the timeline twin: the real engine's op stream at full size, replayed on a hardware
profile.

What it is
    Twin consumes megatrain_min.sim.record.Recorder's stream of a stream.Trainer run under
    FakeTensorMode (shapes, no data: 120B in seconds and a few hundred MB) and replays it as the
    hardware would run it:
      lanes      each CUDA stream runs its ops in issue order; an op starts when its lane is free,
                 the host has issued it, and the events its lane waits for have fired;
      compute    an op takes max(FLOPs / achievable FLOP/s, bytes / HBM bandwidth) (roofline;
                 attention at the causal half of its matmuls, as flash kernels do);
      copies     H2D and D2H at the profile's link bandwidth per direction, concurrently;
      host       the main thread issues every op in program order (hardware.HOST_OP_S each, /
                 --host-speed) and blocks where the engine blocks (host waits, a future's result, a
                 gradient slab); its own host work (the embedding gather) runs at DRAM bandwidth;
                 the optimizer thread's AdamW too, its tasks run as optim.Worker picks them: of
                 those submitted and landed when it looks, the one the next forward needs first
                 (none landed: the oldest, once landed). A pick is made once no task still to be
                 submitted could change it (the host is past it, or waits for the worker). An op
                 standing for several of the engine's (a host update recorded a region at a time,
                 sim/fake.py's whole_regions: Op.count) is issued that many times.
    Memory: a device allocation is live from its issue until the GPU passes its free -- at once for
    its own lane, after the kept lanes' work issued before the free (record_stream), as the caching
    allocator does. Out: step time, tokens/s, model TFLOP/s, overlap (compute busy / step), busy
    share and critical-path share per lane, the bottleneck (the lane with the most time on the
    critical path), peak device memory, and a Chrome/Perfetto trace. Everything is a prediction.
What it is not
    Not a GPU simulator: no kernel launch latency beyond the host issue cost, no contention between
    DMA and AdamW for DRAM, no L2 effects. plan/timing.py models the same schedule analytically;
    tests/sim/test_twin.py holds the two to 10% of each other on the big presets.
Try it
    python -m megatrain_min.sim timeline --config 7b --hardware h100 --batch-size 4 --seq-len 4096
    python -m megatrain_min.sim timeline --config 120b --hardware h200 --host-mem 1536 \\
        --mode lean --grad-clip 0 --batch-size 8 --seq-len 4096 --json
"""
import collections
import dataclasses
import json
import math

import torch

from megatrain_min.plan import hardware


GB = 1e9
ACTORS = ("host", "h2d", "compute", "d2h", "default", "cpu_adam")
NAME = {"main": "host", "worker": "cpu_adam"}   # the recorder's threads, as lanes of the replay


@dataclasses.dataclass(eq=False)
class Span:
    actor: str
    start: float
    end: float
    pred: "Span" = None      # what it waited for last (the critical path walks back through these)
    label: str = ""


@dataclasses.dataclass(eq=False)
class Task:
    """A task of the optimizer thread, recorded, waiting to be run as optim.Worker would."""
    need: int
    submitted: Span
    ready: Span = None        # what it waits for (the D2H of its gradient), None: nothing
    events: list = dataclasses.field(default_factory=list)    # [(handler, kwargs)] in order

    def at(self):             # when it has landed
        return max(self.submitted.end, self.ready.end if self.ready else 0.0)


class Twin:
    def __init__(self, hw, host_speed=1.0, host_op_s=hardware.HOST_OP_S, need_first=True):
        """need_first: the optimizer thread's order as optim.Worker's; False: first come, first
        served (the engine before bench/gpu.py's results said "update_order")."""
        self.need_first = need_first
        self.hw, self.issue = hw, host_op_s / host_speed
        self.hbm, self.host_bw = hw["hbm_gbs"] * GB, hw["host_bw_gbs"] * GB
        self.link = {"h2d": hw["h2d_gbs"] * GB, "d2h": hw["d2h_gbs"] * GB}
        self.flops = {torch.bfloat16: hw["bf16_tflops"] * 1e12 * hw["frac"],
                      torch.float32: hw["fp32_tflops"] * 1e12 * hw["frac"]}
        zero = Span("host", 0.0, 0.0)
        # the latest span of each actor (lane FIFO / thread program order)
        self.last = {a: zero for a in ACTORS}
        self.events, self.task_ends, self.puts, self.gets = {}, {}, [], 0
        self.queue, self.recording = {}, None           # task id -> Task not run yet; the one now
        self.spans, self.step_starts, self.first_compute = [], [], []
        self.mem, self.live = [], {}                # [(t, issue order, +/-bytes)]; Storage -> bytes
        self.alloc_t = {}

    # ---- time of an actor: its latest span's end
    def t(self, actor):
        return self.last[actor].end

    def advance(self, actor, start_after, dur, pred, label=""):
        """A span on actor: after its previous one and after `start_after` (caused by pred)."""
        prev = self.last[actor]
        start = max(prev.end, start_after)
        s = Span(actor, start, start + dur, pred if start_after > prev.end else prev, label)
        self.last[actor] = s
        self.spans.append(s)
        return s

    def block(self, thread, span):
        """A host thread waits for span's end."""
        a = NAME[thread]
        if span.end > self.t(a):
            self.advance(a, span.end, 0.0, span, "wait")

    # ---- the recorder's events
    def step(self, k):
        self.step_starts.append(self.t("host"))
        self.first_compute.append(None)

    def record(self, lane, event):
        self.events[event.eid] = self.last[lane]

    def wait(self, lane, event):
        ev = self.events[event.eid]
        if ev.end > self.t(lane):                     # the lane idles until the event fires
            self.advance(lane, ev.end, 0.0, ev, "wait")

    def host_wait(self, thread, event, src):
        if thread == "worker":
            return self.recording.events.append((self.block, dict(thread=thread,
                                                                   span=self.events[event.eid])))
        self.block(thread, self.events[event.eid])

    def synchronize(self, thread, src):
        for lane in ("h2d", "compute", "d2h", "default"):
            self.block(thread, self.last[lane])

    def submit(self, thread, task, need=0, ready=None):
        self.schedule(horizon=self.t("host"))    # the picks no later submit can change: made now
        self.queue[task] = Task(need, self.last[NAME[thread]],
                                self.events[ready.eid] if ready is not None else None)

    def task_start(self, task):               # its events are kept, to run when the worker picks it
        self.recording = self.queue[task]

    def task_end(self, task):
        self.recording = None

    def schedule(self, horizon=math.inf, until=lambda: False):
        """Run the waiting tasks in optim.Worker's order, each picked when the worker looks (its
        last task done, or idle: the next submit) if that is before `horizon`, until `until()`."""
        while self.queue and not until():
            look = max(self.t("cpu_adam"), min(q.submitted.end for q in self.queue.values()))
            if look >= horizon:
                return
            seen = [k for k, q in self.queue.items() if q.submitted.end <= look]   # oldest first
            landed = [k for k in seen if self.queue[k].at() <= look]
            k = min(landed, key=lambda k: self.queue[k].need) if landed and self.need_first \
                else seen[0]                        # (first come, first served: the oldest)
            q = self.queue.pop(k)
            if q.at() > self.t("cpu_adam"):   # it waited for its gradient, or for its submit
                late = q.ready if q.ready is not None and q.ready.end > q.submitted.end else None
                self.advance("cpu_adam", q.at(), 0.0, late or q.submitted, "task")
            for handler, kw in q.events:
                handler(**kw)
            self.task_ends[k] = self.last["cpu_adam"]

    def result(self, thread, task):
        self.schedule(until=lambda: task in self.task_ends)
        self.block(thread, self.task_ends[task])

    def put(self, thread, item):              # a slab given back (the worker's: when its task runs)
        if thread == "worker":
            return self.recording.events.append((self.puts_now, dict(actor="cpu_adam")))
        self.puts_now(NAME[thread])

    def puts_now(self, actor):
        self.puts.append(self.last[actor])

    def get(self, thread, item, src):         # the k-th slab taken: once k were given back
        self.gets += 1
        self.schedule(until=lambda: len(self.puts) >= self.gets)
        self.block(thread, sorted(self.puts, key=lambda s: s.end)[self.gets - 1])

    def uses(self, **_):
        pass

    def free(self, storage):
        t = self.t("host")                    # freed by the host now; kept lanes: when they pass it
        for lane in storage.kept:
            t = max(t, self.t(lane))
        if storage in self.live:
            self.mem.append((t, len(self.mem), -self.live.pop(storage)))

    def op(self, op):
        actor = NAME.get(op.actor, op.actor)
        if op.actor == "worker" and self.recording is not None:   # kept, run when the task is
            return self.recording.events.append((self.op, dict(op=op)))
        if op.actor == "worker":                      # the optimizer thread issues its own ops too
            self.advance(actor, 0.0, self.issue * op.count + op.nbytes / self.host_bw, None,
                         op.name)
            return
        issued = self.advance("host", 0.0,
                              self.issue * op.count
                              + (op.nbytes / self.host_bw if actor == "host" else 0.0),
                              None, op.name)
        for st in op.fresh:
            if st.where == "device":
                self.live[st] = st.nbytes
                self.mem.append((issued.end, len(self.mem), st.nbytes))
        if actor == "host":
            return
        written = sum(hi - lo for _, lo, hi in op.writes)
        if op.kind in self.link:
            dur = written / self.link[op.kind]
        elif op.kind == "dd":
            dur = 2 * written / self.hbm
        elif op.name == "aten._fused_adamw_.default":  # a resident unit's AdamW on the GPU
            dur = op.nbytes / (self.hbm * hardware.GPU_ADAM_FRAC)
        else:
            dur = max(op.flops / self.flops[torch.bfloat16 if op.low_precision else torch.float32],
                      op.nbytes / self.hbm)
        s = self.advance(actor, issued.end, dur, issued, op.name)
        if actor == "compute" and self.first_compute and self.first_compute[-1] is None:
            self.first_compute[-1] = s
        if op.blocking:
            self.block("main", s)

    # ---- the result
    def result_of(self, cfg, tokens):
        """The steady state: between the starts of the first compute op of the last two recorded
        steps."""
        # the list ends with the after-last-step mark
        a, b = self.first_compute[-3], self.first_compute[-2]
        t0, t1 = a.start, b.start
        step = t1 - t0
        busy = collections.Counter()
        for s in self.spans:
            if s.label != "wait" and s.end > t0 and s.start < t1:
                busy[s.actor] += min(s.end, t1) - max(s.start, t0)
        crit, s = collections.Counter(), b
        while s is not None and s.end > t0:            # walk back from the last step's start
            if s.label != "wait":
                crit[s.actor] += max(0.0, s.end - max(s.start, t0))
            s = s.pred
        total = sum(crit.values()) or 1.0
        level, peak = 0, 0
        for _, _, delta in sorted(self.mem):          # in time; at one host instant, in issue order
            level += delta
            peak = max(peak, level)
        return dict(prediction=True, step_time_s=step, tokens_per_s=tokens / step,
                    model_tflops=hardware.flops_per_token(cfg) * tokens / step / 1e12,
                    overlap=busy["compute"] / step, busy={k: busy[k] / step for k in ACTORS},
                    critical_path={k: crit[k] / total for k in ACTORS},
                    bottleneck=max(ACTORS, key=lambda k: crit[k]), peak_gpu_bytes=peak)

    def trace(self, path):
        """A Chrome/Perfetto trace of every span (one row per lane and thread), in microseconds."""
        tid = {a: i for i, a in enumerate(ACTORS)}
        events = [dict(name="thread_name", ph="M", pid=0, tid=i, args=dict(name=a))
                  for a, i in tid.items()]
        events += [dict(name=s.label, ph="X", pid=0, tid=tid[s.actor], ts=s.start * 1e6,
                        dur=(s.end - s.start) * 1e6)
                   for s in self.spans if s.end > s.start]
        with open(path, "w") as f:
            json.dump(dict(traceEvents=events, displayTimeUnit="ms"), f)
