"""bench/trace_extract.py -- one steady-state step of a profiler trace of stream.Trainer, as a small JSON of lanes.

    python bench/trace_extract.py TRACE.json[.gz] OUT.json [--step 1] [--results results.json]

What it reads
    The Chrome trace bench/gpu.py --profile writes (torch.profiler, CPU + CUDA activities, all threads): a few
    steps of stream.Trainer, hundreds of thousands of events. Nothing is named in advance; the extract finds:
      streams   compute: the stream that runs the most kernels; h2d / d2h: the streams that copy the most bytes
                host -> device / device -> host (each of the three a different stream);
      threads   main: the process's own thread (tid == pid); adamw: the thread that runs aten::_fused_adamw_ (the
                optimizer thread, optim.Worker); autograd: the threads that run autograd's engine (pt_autograd_N:
                torch.autograd.grad on CUDA runs the backward there, the main thread waits);
      steps     a step starts when the main thread gathers the embedding rows (aten::index_select,
                stream.Trainer.embed_rows): the first thing a step can do only once the previous step's last
                update (the embedding's) is done. Step k is [start k, start k+1); k = 1 by default: the first
                step with a step before it (the profiler's first step has no earlier step's updates to wait for);
      units     from the order of the copies, which is the schedule of stream.Trainer.step: H2D rows (the
                embedding), layers 1 .. L-1, head, layers L-2 .. 0 (then the next step's targets and layer 0);
                D2H head, layers L-1 .. 0, then dy (M chunks: the embedding's gradient). A GPU op belongs to the
                unit whose copy was launched last before it was launched (a layer's forward ops are issued after
                its own copy and before the next one; a layer's backward ops after the previous unit's D2H and
                before its own). The optimizer thread updates units in landing order; each update begins with a
                wait for its gradient's D2H event (cudaEventSynchronize).
What it writes (OUT.json: ~90 kB for a step of 24 layers)
    meta (device, torch, the run's command, from --results: results.json beside the trace by default), config
    (layers, tokens, micro-batches, parameters per unit -- from the copies' bytes), the step boundaries, per lane
    the step's intervals (seconds from the step's start), and a summary computed here from the raw events.
      compute   GPU ops merged while unit and kind stay the same and the stream does not wait for the host:
                kind forward / head / recompute / backward / accumulate (zeroing the fp32 grad slot, adding each
                micro-batch's gradient) / other; busy = seconds of ops inside; ops = how many; launched = when
                the host launched the first one (after the previous interval's end: the stream waited for the host)
      h2d, d2h  one interval per copy (dy's M chunks merged): unit, what (weights, rows, targets, grad, dy), bytes
      main      the host threads that issue (main + autograd): kind gather / forward / head / backward / prepare
                (the next step's targets and first copy) while issuing, wait (on: slab -- a free gradient slab,
                optim.HostStore.lend; update -- a unit's update before its copy, stream.Trainer._await_update; host --
                neither, e.g. a pause of the thread) for gaps of 1 ms (MAIN_GAP) or more
      adamw     per unit: wait (for its gradient's D2H), scatter (the embedding's zero_ + index_add_), adamw (the
                _fused_adamw_ calls; busy = their seconds), shadow_copy (the compute-dtype copy the next forward
                streams)
What it is not
    Not a general profiler reader: it knows stream.Trainer's schedule without gradient clipping (updates as
    gradients land) and stops, saying what it did not find, on anything else.
Run by tests/sim/test_trace_extract.py on a synthetic trace of the same shape; its output for the first GPU run is
bench/results/2026-11-27-nvidia-h200/trace_extract.json, read by tutorials/11_a_real_gpu_step.py.
"""
import argparse
import bisect
import collections
import gzip
import json
import statistics
import sys
from pathlib import Path

MAIN_GAP = 1e-3        # s: a pause of the issuing host threads this long is a wait, not issue overhead
SPLIT_GAP = 20e-6      # s: compute ops this far apart start a new interval even when the op was already queued
COPY_WAIT = 20e-6      # s: a compute gap that ends this soon after a copy ends waited for that copy
SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


class NotTheEngine(SystemExit):
    """The trace does not hold what stream.Trainer's step would put there."""


class Unreadable(SystemExit):
    """A file that is not there, or not whole JSON (garbage, an empty or truncated .gz): one line."""


def read_json(path, what):
    """The JSON in `path` (gzip-compressed when it ends in .gz), or Unreadable naming it and why."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (OSError, EOFError, ValueError) as e:   # missing, not gzip, cut short, not UTF-8, not JSON
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise Unreadable(f"trace_extract: cannot read {what} {path}: {why}") from None


def load(path):
    """The Chrome trace at path: a JSON object with a traceEvents list, else Unreadable."""
    trace = read_json(path, "the trace")
    if not (isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list)):
        raise Unreadable(f"trace_extract: {path} is not a Chrome trace (no traceEvents list); give "
                         "the trace bench/gpu.py --profile wrote")
    return trace


def top_level(events):
    """The events not nested in another event of the same thread (sorted by start)."""
    out, end = [], -1.0
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def covering(tops, starts, ts):
    """The top-level event of a thread that contains time ts, or None."""
    i = bisect.bisect_right(starts, ts) - 1
    return tops[i] if i >= 0 and tops[i]["ts"] + tops[i]["dur"] >= ts else None


def identify(X):
    """The three streams (compute, h2d, d2h) and the host threads (main, autograd, adamw) from what runs on them."""
    kernels, h2d, d2h = collections.Counter(), collections.Counter(), collections.Counter()
    for e in X:
        if e["cat"] == "kernel":
            kernels[e["tid"]] += 1
        elif e["cat"] == "gpu_memcpy":
            (h2d if "HtoD" in e["name"] else d2h if "DtoH" in e["name"] else collections.Counter())[e["tid"]] += \
                e["args"].get("bytes", 0)
    if not kernels:
        raise NotTheEngine("no kernels in the trace: was it profiled with ProfilerActivity.CUDA?")
    comp = kernels.most_common(1)[0][0]
    h = next((s for s, _ in h2d.most_common() if s != comp), None)
    d = next((s for s, _ in d2h.most_common() if s not in (comp, h)), None)
    if h is None or d is None:
        raise NotTheEngine("no H2D and D2H copy streams apart from the compute stream")
    ops = collections.defaultdict(collections.Counter)
    for e in X:
        if e["cat"] == "cpu_op":
            ops[(e["pid"], e["tid"])][e["name"]] += 1
    main = next((k for k in ops if k[0] == k[1] and ops[k]["aten::index_select"]), None)
    adamw = max(ops, key=lambda k: ops[k]["aten::_fused_adamw_"])
    if main is None or not ops[adamw]["aten::_fused_adamw_"]:
        raise NotTheEngine("no main thread gathering embedding rows, or no thread running aten::_fused_adamw_")
    autograd = [k for k in ops if k not in (main, adamw) and any(n.startswith("autograd::engine") for n in ops[k])]
    return dict(compute=comp, h2d=h, d2h=d), dict(main=main, autograd=autograd, adamw=adamw)


def extract(trace, step=1, results=None):
    X = [e for e in trace["traceEvents"] if e.get("ph") == "X" and isinstance(e.get("pid"), int) and "dur" in e]
    streams, threads = identify(X)
    issuing = {threads["main"], *threads["autograd"]}
    by_thread = collections.defaultdict(list)
    for e in X:
        by_thread[(e["pid"], e["tid"])].append(e)
    main_ops = top_level([e for e in by_thread[threads["main"]] if e["cat"] == "cpu_op"])
    starts = [e["ts"] for e in main_ops if e["name"] == "aten::index_select"]
    if step < 0 or len(starts) < step + 2:
        raise NotTheEngine(f"{len(starts)} step starts (embedding gathers) in the trace: step {step} needs "
                           f"{step + 2} (its start and the next step's)")
    S, E = starts[step], starts[step + 1]
    us = lambda t: round((t - S) / 1e6, 7)              # noqa: E731  trace microseconds -> seconds from the step
    launch = {e["args"]["correlation"]: e for e in X
              if e["cat"] in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    lane_of = {v: k for k, v in streams.items()}
    gpu = collections.defaultdict(list)
    for e in X:
        if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset") and e["tid"] in lane_of and S <= e["ts"] < E:
            L_ = launch.get(e["args"].get("correlation"))
            gpu[lane_of[e["tid"]]].append(dict(e=e, at=L_["ts"] if L_ else None,
                                               by=(L_["pid"], L_["tid"]) if L_ else None))
    for ops in gpu.values():
        ops.sort(key=lambda o: o["e"]["ts"])

    # ---- the copies: units from stream.Trainer.step's order
    copies = {k: sorted(gpu[k], key=lambda o: o["at"] if o["at"] is not None else o["e"]["ts"]) for k in ("h2d", "d2h")}
    d2h = copies["d2h"]
    if len(d2h) < 3:
        raise NotTheEngine(f"{len(d2h)} D2H copies in step {step}: expected the head's, each layer's and dy")
    nbytes = lambda o: o["e"]["args"].get("bytes", 0)   # noqa: E731
    layer_grad = nbytes(d2h[1])
    L = next((i for i, o in enumerate(d2h[1:]) if nbytes(o) != layer_grad), len(d2h) - 1)
    M = len(d2h) - 1 - L
    d2h_units = [("head", "grad")] + [(i, "grad") for i in reversed(range(L))] + [("embed", "dy")] * M
    big = max(nbytes(o) for o in copies["h2d"])
    h2d_big = [o for o in copies["h2d"] if nbytes(o) >= big / 100]
    h2d_units = ([("embed", "rows")] + [(i, "weights") for i in range(1, L)] + [("head", "weights")]
                 + [(i, "weights") for i in reversed(range(L - 1))])
    if len(h2d_big) < len(h2d_units) or M < 1:
        raise NotTheEngine(f"step {step}: {len(h2d_big)} large H2D copies and {len(d2h)} D2H copies, expected "
                           f"{len(h2d_units)}+ and {L + 2}+ for {L} layers (is gradient clipping on?)")
    h2d_units += [(0, "weights")] * (len(h2d_big) - len(h2d_units))     # the next step's first layer, prefetched
    unit_of = {id(o): u for o, u in zip(h2d_big, h2d_units)} | {id(o): u for o, u in zip(d2h, d2h_units)}
    for o in copies["h2d"]:
        unit_of.setdefault(id(o), (None, "targets"))
    # marks: (host time, unit, kind) -- what the host issues from that moment on
    marks = [(h2d_big[0]["at"], 0, "forward")] + [(h2d_big[i]["at"], i, "forward") for i in range(1, L)] + \
            [(h2d_big[L]["at"], "head", "head"), (d2h[0]["at"], L - 1, "backward")] + \
            [(d2h[k]["at"], L - 1 - k, "backward") for k in range(1, L)] + [(d2h[L]["at"], "embed", "backward")]
    mark_ts = [m[0] for m in marks]

    def phase(ts):
        i = bisect.bisect_right(mark_ts, ts) - 1
        return (marks[i][1], marks[i][2]) if i >= 0 else ("embed", "gather")

    tops = {t: top_level([e for e in by_thread[t] if e["cat"] == "cpu_op"]) for t in issuing}
    top_starts = {t: [e["ts"] for e in v] for t, v in tops.items()}

    def compute_kind(o):
        """(unit, kind) of a compute-stream op, from when and by whom it was launched."""
        if o["at"] is None:
            return None, "other"
        unit, kind = phase(o["at"])
        if unit == "embed":                   # before layer 0's forward: the gather; after its backward: none
            return unit, "gather" if kind == "gather" else "other"
        if kind != "backward":
            return unit, kind
        if o["by"] in threads["autograd"]:    # torch.autograd.grad: the backward runs on autograd's thread
            return unit, "backward"
        op = covering(tops.get(o["by"], []), top_starts.get(o["by"], []), o["at"])   # on the main thread
        return unit, "accumulate" if op and op["name"] in ("aten::_foreach_add_", "aten::zero_") else "recompute"

    # ---- compute: merged intervals; the step's idle time, classified, from the raw ops
    lanes = {k: [] for k in ("compute", "h2d", "d2h", "main", "adamw")}
    comp, prev_end, gaps = lanes["compute"], None, []
    for o in gpu["compute"]:
        e = o["e"]
        s, t, (unit, kind) = e["ts"], e["ts"] + e["dur"], compute_kind(o)
        host_bound = prev_end is not None and o["at"] is not None and o["at"] >= prev_end
        if prev_end is not None and s > prev_end:
            gaps.append((prev_end, s, host_bound))
        cur = comp[-1] if comp else None
        if cur and cur["unit"] == unit and cur["kind"] == kind and not host_bound and s - cur["_end"] < SPLIT_GAP * 1e6:
            cur["_end"] = max(cur["_end"], t)
            cur["_busy"] += max(0.0, t - max(s, cur["_busy_to"]))
            cur["_busy_to"], cur["ops"] = max(cur["_busy_to"], t), cur["ops"] + 1
        else:
            comp.append(dict(_start=s, _end=t, unit=unit, kind=kind, _busy=t - s, _busy_to=t, ops=1, _at=o["at"]))
        prev_end = t if prev_end is None else max(prev_end, t)
    if not comp:
        raise NotTheEngine(f"no compute-stream work in step {step}")
    busy = sum(c["_busy"] for c in comp) / 1e6

    # ---- main: the issuing threads' activity, their waits classified by what the host did next
    host = sorted((e for t in issuing for e in by_thread[t] if S <= e["ts"] < E), key=lambda e: e["ts"])
    later = sorted((e for t in issuing for e in by_thread[t] if e["ts"] >= S), key=lambda e: e["ts"])
    later_ts = [e["ts"] for e in later]
    copy_of = {o["e"]["args"]["correlation"]: (k, unit_of.get(id(o))) for k in ("h2d", "d2h") for o in copies[k]}
    loss_sync = next((e["ts"] + e["dur"] for e in host if e["name"] in SYNCS and e["ts"] > d2h[L]["at"]), None)

    def why(ts):
        """What the host did first after a pause at ts: a D2H (or the step's loss wait) after a slab; a unit's copy
        or the next step's gather after its update; else nothing it waited for."""
        for e in later[bisect.bisect_left(later_ts, ts):]:
            c = copy_of.get(e.get("args", {}).get("correlation"))
            if e["name"] == "aten::index_select":
                return "update", "embed"
            if c and c[0] == "h2d" and c[1] and c[1][1] == "weights":
                return "update", c[1][0]
            if (c and c[0] == "d2h") or e["name"] in SYNCS:
                return "slab", None
            if e["cat"] in ("cuda_runtime", "cuda_driver") and "Launch" in e["name"]:
                return "host", None
        return "host", None

    def host_phase(ts):
        if loss_sync is not None and ts >= loss_sync:
            return None, "prepare"
        return phase(ts)

    main, end = lanes["main"], S
    for e in host:
        s, t = e["ts"], e["ts"] + e["dur"]
        if s - end >= MAIN_GAP * 1e6:
            on, unit = why(s)
            main.append(dict(_start=end, _end=s, unit=unit if unit is not None else host_phase(end)[0],
                             kind="wait", on=on))
        unit, kind = host_phase(s)
        cur = main[-1] if main else None
        if cur and cur["kind"] == kind and cur["unit"] == unit and s - cur["_end"] < MAIN_GAP * 1e6:
            cur["_end"] = max(cur["_end"], t)
        elif t > end:
            main.append(dict(_start=max(s, end), _end=t, unit=unit, kind=kind))
        end = max(end, t)
    if E - end >= MAIN_GAP * 1e6:
        on, unit = why(E)
        main.append(dict(_start=end, _end=E, unit=unit, kind="wait", on=on))
    for m in main:
        m["_end"] = min(m["_end"], E)

    # compute idle: before the first op (the gather), after the last (the tail), between: who the stream waited for
    waits = [(m["_start"], m["_end"], m["on"]) for m in main if m["kind"] == "wait"]
    copy_ends = sorted(o["e"]["ts"] + o["e"]["dur"] for k in ("h2d", "d2h") for o in gpu[k])
    idle = collections.Counter(gather=(comp[0]["_start"] - S) / 1e6, tail=(E - max(c["_end"] for c in comp)) / 1e6)
    for a, b, host_bound in gaps:
        if host_bound:
            on = next((w for s, t, w in waits if s < b and a < t and w != "host"), "launch")
        else:
            i = bisect.bisect_right(copy_ends, b) - 1
            on = "copy" if i >= 0 and a <= copy_ends[i] and b - copy_ends[i] <= COPY_WAIT * 1e6 else "gpu"
        idle[on] += (b - a) / 1e6

    # ---- copies
    for k in ("h2d", "d2h"):
        for o in copies[k]:
            e, (unit, what) = o["e"], unit_of[id(o)]
            cur = lanes[k][-1] if lanes[k] else None
            if cur and cur["unit"] == unit and cur["what"] == what and e["ts"] - cur["_end"] < SPLIT_GAP * 1e6:
                cur["_end"], cur["bytes"] = e["ts"] + e["dur"], cur["bytes"] + nbytes(o)
            else:
                lanes[k].append(dict(_start=e["ts"], _end=e["ts"] + e["dur"], unit=unit, kind=k, what=what,
                                     bytes=nbytes(o), _at=o["at"]))
        lanes[k].sort(key=lambda c: c["_start"])

    # ---- the optimizer thread: units in landing order, each from the wait for its gradient
    order = [u for u, what in d2h_units if what == "grad"] + ["embed"]
    adam = [e for e in top_level(by_thread[threads["adamw"]]) if S <= e["ts"] < E]
    k, lane = -1, lanes["adamw"]
    for e in adam:
        s, t, name = e["ts"], e["ts"] + e["dur"], e["name"]
        if name in SYNCS:
            k += 1
            if k >= len(order):
                raise NotTheEngine(f"more than {len(order)} gradient waits on the optimizer thread in step {step}")
            kind = "wait"
        elif k < 0:
            continue
        elif name in ("aten::zero_", "aten::index_add_", "aten::scatter_add_"):
            kind = "scatter"
        elif name == "aten::copy_":
            kind = "shadow_copy"
        else:
            kind = "adamw"
        cur = lane[-1] if lane else None
        if cur and cur["unit"] == order[k] and cur["kind"] == kind and kind != "wait":
            cur["_end"] = t
            if name == "aten::_fused_adamw_":
                cur["_busy"] += t - s
        elif kind != "adamw" or name == "aten::_fused_adamw_":   # an update starts with its first kernel
            lane.append(dict(_start=s, _end=t, unit=order[k], kind=kind, on="d2h" if kind == "wait" else None,
                             _busy=t - s if name == "aten::_fused_adamw_" else None))
    if k + 1 != len(order):
        raise NotTheEngine(f"{k + 1} units updated in step {step}, expected {len(order)} (head, {L} layers, embed)")

    # ---- the output: seconds from the step's start, private fields dropped
    for name, items in lanes.items():
        for c in items:
            c["start"], c["end"] = us(c.pop("_start")), us(c.pop("_end"))
            if "_busy" in c:
                b = c.pop("_busy")
                if b is not None:
                    c["busy"] = round(b / 1e6, 7)
            if "_at" in c:
                at = c.pop("_at")
                if at is not None:
                    c["launched"] = us(at)
            c.pop("_busy_to", None)
            for key in [key for key, v in c.items() if v is None and key != "unit"]:
                del c[key]
        lanes[name] = [{key: c[key] for key in ("start", "end", "unit", "kind") + tuple(
            sorted(set(c) - {"start", "end", "unit", "kind"}))} for c in items]

    def per_layer(lane, kind, span=False):
        """The median over the layers of a kind's seconds per layer: busy where known (else the span)."""
        tot = collections.Counter()
        for c in lanes[lane]:
            if c["kind"] == kind and isinstance(c["unit"], int):
                tot[c["unit"]] += c["end"] - c["start"] if span or "busy" not in c else c["busy"]
        return statistics.median(tot.values()) if tot else 0.0

    weights = [c for c in lanes["h2d"] if c["what"] == "weights" and isinstance(c["unit"], int)]
    meta = dict(trace=dict(file=Path(trace.get("traceName", "trace.json")).name, events=len(trace["traceEvents"]),
                           steps=len(starts), cuda_driver=trace.get("cuda_driver_version"),
                           cuda_runtime=trace.get("cuda_runtime_version")),
                device=(trace.get("deviceProperties") or [{}])[0].get("name"))
    layer_params = layer_grad // 4                           # D2H gradients are fp32
    cfg = dict(layers=L, micro_batches=M, tokens=next((c["bytes"] // 8 for c in lanes["h2d"] if c["what"] == "targets"),
                                                      None),
               layer_params=layer_params, head_params=nbytes(d2h[0]) // 4,
               weight_bytes_per_param=nbytes(h2d_big[1]) / layer_params if L > 1 else None)
    if results:
        r = results.get("meta", {})
        meta.update({k: r[k] for k in ("device", "torch", "cuda", "driver", "date", "command", "cpus") if k in r})
        wide = results.get("cases", {}).get("wide", {})
        if wide.get("n_layer") not in (None, L) or wide.get("at_min_tokens", {}).get("tokens") not in (None,
                                                                                                     cfg["tokens"]):
            raise NotTheEngine(f"--results describes {wide.get('n_layer')} layers, the trace {L}: not this run")
        keep = ("tokens", "step_s", "compute_only_s", "overlap")   # the benchmark's medians, unprofiled
        meta["timed"] = {case: {k: wide[case][k] for k in keep if k in wide[case]}
                         for case in ("at_min_tokens", "at_2x_tokens") if case in wide}
        meta["planned_step_s"] = wide.get("planned_step_s")
    summary = dict(
        step_s=round((E - S) / 1e6, 6), compute_busy_s=round(busy, 6),
        compute_idle_s={k: round(v, 6) for k, v in sorted(idle.items())},
        adamw_thread_busy_s=round(sum(c["end"] - c["start"] for c in lanes["adamw"] if c["kind"] != "wait"), 6),
        median_per_layer_s={k: round(v, 6) for k, v in dict(
            forward=per_layer("compute", "forward"), recompute=per_layer("compute", "recompute"),
            backward=per_layer("compute", "backward"), accumulate=per_layer("compute", "accumulate"),
            adamw=per_layer("adamw", "adamw"), shadow_copy=per_layer("adamw", "shadow_copy"),
            h2d=statistics.median(c["end"] - c["start"] for c in weights) if weights else 0.0,
            d2h=per_layer("d2h", "d2h")).items()},
        head_s=round(sum(c["busy"] for c in lanes["compute"] if c["kind"] == "head"), 6))
    steps = [dict(index=i, start=us(s)) for i, s in enumerate(starts)]
    return dict(what="one steady-state step of stream.Trainer from a torch.profiler trace (bench/trace_extract.py): "
                     "per lane, intervals in seconds from the step's start (the main thread's embedding gather)",
                meta=meta, config=cfg, step=dict(index=step, start=0.0, end=us(E)), steps=steps,
                streams={k: v for k, v in streams.items()},
                threads=dict(main=threads["main"][1], autograd=[t[1] for t in threads["autograd"]],
                             adamw=threads["adamw"][1]),
                definitions=__doc__.split("What it writes")[1].split("What it is not")[0].strip(),
                summary=summary, lanes=lanes)


def dump(x):
    """JSON with one interval per line: small, and readable in a diff."""
    head = json.dumps({k: v for k, v in x.items() if k != "lanes"}, indent=1)
    lanes = ",\n".join(f' "{k}": [\n' + ",\n".join("  " + json.dumps(c, separators=(",", ":")) for c in v) + "\n ]"
                       for k, v in x["lanes"].items())
    return head[:-2] + ',\n "lanes": {\n' + lanes + "\n }\n}\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a Chrome trace of stream.Trainer steps (.json or .json.gz): bench/gpu.py --profile")
    ap.add_argument("out", help="where to write the extract (JSON)")
    ap.add_argument("--step", type=int, default=1, help="which step of the trace (0 = the first; default 1)")
    ap.add_argument("--results", help="the benchmark's results.json (device, torch, command); default: the trace's")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():                  # said now, not after the work
        raise Unreadable(f"trace_extract: cannot write {out}: "
                         + ("it is a directory" if out.is_dir() else f"{out.parent} is not a directory"))
    res = Path(args.results) if args.results else Path(args.trace).with_name("results.json")
    results = read_json(res, "the results") if args.results or res.exists() else None
    x = extract(load(args.trace), args.step, results)
    out.write_text(dump(x))
    s = x["summary"]
    print(f"step {args.step}: {s['step_s']:.3f} s, compute busy {s['compute_busy_s']:.3f} s; idle: "
          + ", ".join(f"{k} {v:.3f}" for k, v in s["compute_idle_s"].items()))
    print(f"wrote {args.out}: {sum(len(v) for v in x['lanes'].values())} intervals, "
          f"{Path(args.out).stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    sys.exit(main())
