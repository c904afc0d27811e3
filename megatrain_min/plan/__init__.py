"""plan/ -- will it fit, and how fast will it go? The memory and throughput plan of a run: this
file (plan()), setting.py, hardware.py, memory.py, timing.py, fit.py, report.py, cost.py (what an
aten op reads, writes, computes), __main__.py (`python -m megatrain_min.plan`).

What it is
    plan(cfg, hardware, batch_size, ...) works from the config's arithmetic alone (model.units()
    sizes every unit without allocating it), so `--config 120b --plan` answers in milliseconds. It
    is composed of named steps, one file each:
      setting.py    the run in numbers: what the caller fixed, checked, and what follows from it
      hardware.py   the GPU and host planned for: HARDWARE's profiles, or this machine (local)
      memory.py     host and GPU bytes by component: the tile, the boundary activations on the
                    device or offloaded, the units resident on the GPU, the store, what is
                    page-locked
      timing.py     each layer visit's seconds, and stream.py's schedule replayed on its lanes for
                    three steps: step time, tokens/s, the bottleneck, the tokens per step that hide
                    transfers
    Around the plan: fit.py (check: a plan that does not fit as one line, with the nearest setting
    that fits; max_context), report.py (the plan as a table, as JSON, as train.py's one line), and
    the command line (__main__.py). megatrain_min/engine/__init__.py turns a plan into the engine's
    arguments.
What it is not
    Not a profiler: bandwidths and the achievable fraction of peak are the assumptions in HARDWARE
    until bench/ measures them. Not modelled: DRAM contention between DMA and AdamW, launch gaps,
    the data loader, back-pressure of the grad slabs, the transient extra fp32 copy init_weights
    makes.
Reference
    docs/design.md, sections 'Memory modes' and 'The arithmetic'; stream.py and optim.py for what is
    allocated where; MegaTrain (arXiv 2604.05091: 120B on one H200 with 1.5 TB of host memory).
Try it
    python -m megatrain_min.plan --config 120b --hardware h200 --mode lean --host-mem 1536 \\
        --grad-clip 0 --batch-size 4 --seq-len 4096
    python -m megatrain_min.plan --config 70b --hardware all --batch-size 8 --seq-len 4096   # each
    python -m megatrain_min.plan --config 70b --hardware h100 --gpus 8 --nodes 2 --host-mem 2000 \\
        --batch-size 64 --seq-len 4096
    python train.py --config 7b --plan --hardware gh200 --seq-len 524288 --batch-size 1   # 512k
    python -m pytest tests/plan/test_plan.py
"""
import dataclasses
import functools
import warnings

import model
import stream
from megatrain_min import cli
from megatrain_min.engine import checks, gpu_update
from megatrain_min.cli import DEFAULTS, DTYPE_NAMES
from megatrain_min.plan import hardware, memory, timing
from megatrain_min.plan.hardware import GB, model_tflops
from megatrain_min.plan.setting import Setting


class PlanError(ValueError):
    """A plan that cannot be made (an argument no run can have) or a run that does not fit, in one
    line: what, how much, what this machine has, what to try."""


def plan(cfg, hardware="local", batch_size=DEFAULTS["batch_size"], seq_len=None,
         micro_batches=stream.MICRO_BATCHES,
         mode="fast", dtype=None, grad_clip=stream.GRAD_CLIP, offload_activations=None,
         host_mem_gb=None, host_bw_gbs=None, residual_dtype="fp32", grad_slabs=None,
         skip_nonfinite=True, chunk_tokens=None, host_speed=1.0, name=None, tile_tokens=None,
         gpus=1,
         nodes=1, device=None, resident_units=None, gpu_updated_units=None,
         optimizer=cli.DEFAULTS["optimizer"]):
    """The memory and throughput plan of training cfg: a JSON-ready dict (report.py prints it).

    hardware: a hardware.HARDWARE name, "local", or a dict like HARDWARE's rows. batch_size:
    sequences per step (train.py's default: cli.DEFAULTS); seq_len None: cfg.max_seq_len. dtype:
    "bf16" or "fp32" (None: model.default_dtype of the hardware). grad_clip: the global-norm clip (0
    = off, the engine's default); with it the updates are deferred until every gradient is on the
    host, which keeps an fp32 gradient per parameter there; without it each unit is updated as its
    gradient lands, through gradient slabs (grad_slabs None: as many as hide the D2H + AdamW
    latency: timing.slabs). offload_activations None: memory.offload_needed decides
    (p["offload_activations"]). residual_dtype: "fp32" (autocast's arithmetic) or "bf16".
    skip_nonfinite: train.py's guard; without deferral it costs a host wait for the loss after the
    head and one more read of each gradient, never a gradient store. p["pinned_bytes"]: the host
    bytes page-locked (exactly: engine/pinned.py): what a copy engine reads or writes, never Adam's
    m and v.
    tile_tokens: model.block's sequence tile (0 = untiled); None: the planner's choice
    (memory.tile_for). device: with hardware "local", the device the run trains on (its free memory;
    None: optim.resolve_device's choice). gpus, nodes: megatrain_min/engine/sharded.py on gpus per
    node x nodes ranks (N), batch_size the global batch: each rank computes batch_size / N sequences
    in micro_batches and holds 1/N of the host store; host memory is then per node, GPU memory per
    GPU. Each visit adds an all_gather of the unit (compute dtype) and a reduce_scatter of its fp32
    gradient, (N-1)/N of it per GPU, on a comm lane of their own: NVLink (nvlink_gbs, bus bandwidth)
    within a node, InfiniBand per GPU (ib_gbs) as soon as the ring crosses nodes. The node's AdamW
    threads share its DRAM bandwidth. Not modelled: the all_reduce of the loss and norm (a few
    bytes), collective latency. resident_units: how many units, in the order the forward needs them,
    stay whole on the GPU (16 B/param there, none on the host, AdamW on the GPU); None: as many as
    fit in the memory the step leaves (one rank). gpu_updated_units: how many of the other streamed
    units are updated on the GPU (megatrain_min/engine/gpu_update.py: their gradient there, 4
    B/param; master, m, v cross both ways); None: the count that makes the simulated step fastest,
    within the memory left (gpu_updates). mode "auto": the plan picks (auto_mode). optimizer: the
    update rule (cli.RULES): its state is 4 B/param per name on the host, its update's DRAM traffic
    8.
    """
    if mode == "auto":
        return auto_mode(cfg, **{k: v for k, v in locals().items() if k not in ("cfg", "mode")})
    # ---- the setting: the hardware and every argument, checked
    try:
        hw = hardware_of(hardware, host_mem_gb, host_bw_gbs, device)
        dtype = dtype or DTYPE_NAMES[model.default_dtype("cuda" if hw["gpu_mem_gb"] > 0 else "cpu")]
        if tile_tokens is not None and tile_tokens < 0:
            raise ValueError(f"tile_tokens must be >= 0 (0 = no tiling), got {tile_tokens}")
        s = Setting(cfg, hw, batch_size, seq_len or cfg.max_seq_len, micro_batches, mode, dtype,
                    residual_dtype, grad_clip, skip_nonfinite, chunk_tokens, host_speed, gpus,
                    nodes, optimizer)
    except ValueError as e:
        raise PlanError(str(e)) from None
    name = name or next((k for k, c in model.PRESETS.items() if c == cfg), "this config")

    # ---- the units kept on the GPU: counts any run can have
    for arg, n in (("resident_units", resident_units), ("gpu_updated_units", gpu_updated_units)):
        if n is not None and not (checks.integer(n) and n >= 0):
            raise PlanError(f"{arg} must be an integer >= 0, got {n!r}")
    if resident_units and s.world > 1:
        raise PlanError(f"--resident-units {resident_units}: units kept resident need one process "
                        f"holding whole units; {s.world} sharded ranks stream every unit, each "
                        "holding 1/N of it (--resident-units 0)")
    if gpu_updated_units and s.world > 1:
        raise PlanError("units updated on the GPU need one process holding whole units; sharded "
                        "ranks update every unit on the host (--gpu-updated-units 0)")

    # ---- memory: the GPU's (tile, boundary activations, resident units), then the host's
    tile = memory.tile(s, tile_tokens, offload_activations)
    gpu, offloaded, resident = memory.gpu(s, tile, offload_activations, resident_units)
    if resident_units is None and gpu_updated_units and s.cuda and s.world == 1:
        # the GPU updates asked for take their room first: as many residents as fit beside them
        room = memory.RESIDENT_HEADROOM * hw["gpu_mem_gb"] * GB
        r = len(resident)
        while r and sum(memory.gpu(s, tile, offloaded, r)[0].values()) + memory.gpu_bytes_of(
                s, gpu_update.chosen(s.order, r, s.embed, gpu_updated_units)) > room:
            r -= 1
        gpu, offloaded, resident = memory.gpu(s, tile, offloaded, r)
    # ---- time: each visit's seconds, the slabs that hide a gradient's trip, the schedule replayed
    v = timing.speeds(s)
    t, numel, rate = timing.visits(s, tile, v)
    @functools.cache
    def simulated(k, g=0, r=None):   # the schedule replayed with k gradient slabs, r units resident
        held = resident if r is None else set(s.order[:r])   # (None: the plan's), g GPU-updated
        return timing.simulate(
            s.L, t, numel, rate, defer_updates=s.defer, tied=s.tied, offload=offloaded, slabs=k,
            guard=skip_nonfinite and not s.defer, overlap=s.cuda, sharded=s.world > 1,
            resident=timing.lane_units(s, held),
            gpu_updated=timing.lane_units(s, memory.gpu_updated(s, held, g, {})))

    def host_bytes_with(g, r, k):   # the host's bytes with g units GPU-updated, r resident, k slabs
        held = set(s.order[:r])
        return sum(memory.host(s, held, k, offloaded, 0, memory.gpu_updated(s, held, g, {}))[0]
                   .values())

    def step_with(g, r, what=0):   # the step (what=2: its critical path), g units GPU-updated, r
        k = 0 if s.defer else len(s.units) - r - g   # resident; a slab per host update, as many
        if k:                                        # as the host holds (at least the fewest)
            one = host_bytes_with(g, r, 1) - host_bytes_with(g, r, 0)
            k = min(k, int((host_limit - host_bytes_with(g, r, 0)) // max(one, 1)))
        return simulated(max(fewest, k) if not s.defer else 0, g, r)[what]

    def host_bound(r):   # the host's AdamW on the critical path (else GPU updates cannot help)
        return step_with(0, r, 2)["cpu_adam"] >= GPU_UPDATES_SAVE * step_with(0, r)

    def best_gpu_updates(r, beside):   # the plan's count with r units resident, beside those bytes
        most = memory.gpu_updatable(s, set(s.order[:r]), beside)   # (arithmetic: first)
        return gpu_updates(lambda g: step_with(g, r), most if most and host_bound(r) else 0)
    fewest = 0 if s.defer else timing.slabs(t, s.tied, most=len(s.units) - len(resident))
    host_limit = memory.host_limit(s)
    g = gpu_updated_units
    if g is None:
        g = best_gpu_updates(len(resident), sum(gpu.values()))
        if resident_units is None and s.cuda and s.world == 1 and host_bound(len(resident)):
            # residents fill the GPU first (16 B/param each); a GPU-updated unit takes as much work
            # off the host for 4 B/param: also try the updates first, then residents in what is left
            bytes_of = lambda r: 16 * sum(s.units[u].numel for u in s.order[:r])  # noqa: E731
            base = sum(gpu.values()) - bytes_of(len(resident))
            first = best_gpu_updates(0, base)
            room = base + memory.gpu_bytes_of(s, gpu_update.chosen(s.order, 0, s.embed, first))
            r = len(memory.residents(s, None, room)) if first else len(resident)
            g2 = best_gpu_updates(r, base + bytes_of(r)) if r != len(resident) else g
            if r != len(resident) and step_with(g2, r) < (1 - GPU_UPDATES_SAVE) * step_with(
                    g, len(resident)) and host_bytes_with(g2, r, fewest) <= host_limit:   # (fits)
                gpu, offloaded, resident = memory.gpu(s, tile, offloaded, r)
                g = g2
    if grad_slabs == 1 and s.tied and not s.defer and len(s.units) - 1 not in resident:
        raise PlanError(f"{name}'s tied head holds a gradient slab until the embedding's scatter: "
                        "grad_slabs must be >= 2 (or None: the plan's count)")
    on_gpu = memory.gpu_updated(s, resident, g, gpu)
    gpu_bytes, streamed = sum(gpu.values()), len(s.units) - len(resident) - len(on_gpu)
    fewest = 0 if s.defer else timing.slabs(t, s.tied, most=streamed)   # hide one gradient's trip

    def host_fits(k):
        return sum(memory.host(s, resident, k, offloaded, gpu_bytes, on_gpu)[0].values()) <= \
            host_limit
    slabs = 0 if s.defer else grad_slabs or timing.slabs(   # a slab per host-updated unit at most
        t, s.tied, lambda k: simulated(k, len(on_gpu))[0], streamed, host_fits)
    host, store, pinned_bytes = memory.host(s, resident, slabs, offloaded, gpu_bytes, on_gpu)
    host_bytes = sum(host.values())
    fits_host = host_bytes <= host_limit
    fits_gpu = (not s.cuda) or gpu_bytes <= hw["gpu_mem_gb"] * GB
    step_time, busy, critical = simulated(slabs, len(on_gpu))
    tflops = model_tflops(cfg, s.tokens_step, step_time)
    mins = timing.min_tokens(s, v, resident)

    # ---- the plan, JSON-ready
    return dict(
        config=name, model=cfg.to_dict(), hardware=hw, mode=mode, mode_asked=mode, mode_why=None,
        dtype=dtype, optimizer=optimizer,
        residual_dtype=residual_dtype, batch_size=batch_size, seq_len=s.seq_len,
        micro_batches=micro_batches, tokens_per_step=s.tokens_step, gpus=gpus, nodes=nodes,
        world=s.world, grad_clip=grad_clip, defer_updates=s.defer, chunk_tokens=chunk_tokens,
        host_speed=host_speed, tile_tokens=tile, tile_asked=tile_tokens,
        skip_nonfinite=skip_nonfinite, host_mem_asked=host_mem_gb,
        grad_slabs=slabs, grad_slabs_asked=grad_slabs, grad_slabs_fewest=fewest,
        offload_activations=bool(offloaded),
        offload_asked=offload_activations, resident_units=len(resident),
        resident_asked=resident_units, gpu_updated_units=len(on_gpu),
        gpu_updated_asked=gpu_updated_units,
        pinned_bytes=pinned_bytes, params=s.params, host=host, host_bytes=host_bytes,
        host_limit_bytes=host_limit, host_bytes_per_param=store / s.params, fits_host=fits_host,
        gpu=gpu, gpu_bytes=gpu_bytes, gpu_limit_bytes=hw["gpu_mem_gb"] * GB, fits_gpu=fits_gpu,
        fits=fits_host and fits_gpu, visit_s=t, step_time_s=step_time,
        tokens_per_s=s.tokens_step / step_time, model_tflops=tflops,
        mfu=tflops / (hw[f"{dtype}_tflops"] * s.world),
        utilization={k: v / step_time for k, v in busy.items()},
        critical_path={k: v / step_time for k, v in critical.items()},
        bottleneck=max(critical, key=critical.get), min_tokens=mins,
        min_tokens_per_step=max(mins.values()))


GPU_UPDATES_SAVE = 0.01   # the plan updates units on the GPU where that saves >= 1% of the step


def gpu_updates(step_of, most):
    """The plan's count of streamed units updated on the GPU: of 0 .. most (what fits), the fewest
    whose simulated step (step_of(g)) is within GPU_UPDATES_SAVE of the fastest -- 0 where it saves
    less than that: a grid of 9 counts (every count up to 8), then every count around its best."""
    if not most:
        return 0
    stride = -(-most // 8)
    steps = {g: step_of(g) for g in sorted({*range(0, most + 1, stride), most})}
    best = min(steps, key=steps.get)
    steps.update({g: step_of(g) for g in range(max(0, best - stride + 1),
                                               min(most, best + stride))})
    fastest = min(steps.values())
    return min(g for g, t in steps.items() if t <= fastest * (1 + GPU_UPDATES_SAVE))


def hardware_of(hw, host_mem_gb=None, host_bw_gbs=None, device=None):
    """hardware.resolve, its ValueError a PlanError."""
    try:
        return hardware.resolve(hw, host_mem_gb, host_bw_gbs, device)
    except ValueError as e:
        raise PlanError(str(e)) from None


# --mode auto takes lean where its step is at most this share of fast's: 2% faster, more than the
# planner and the twin differ on the measured profile (within 1%), so the pick is not their noise
LEAN_FASTER = 0.98


def auto_mode(cfg, **kw):
    """--mode auto, the plan's pick of the host memory mode: fast (a bf16 shadow crosses the link),
    unless lean (the fp32 master crosses, 2 B/param less on the host, 6 B/param less for its AdamW
    to move) is at least 2% faster (LEAN_FASTER) or is the one that fits. Both stream the same bf16
    values: the choice changes speed and memory, never a number. fp32 compute: fast (the modes are
    one). More than one rank: fast, since ranks plan apart (on their own free memory) and must
    stream alike."""
    fast = plan(cfg, mode="fast", **kw)
    if fast["dtype"] != "bf16" or fast["world"] > 1:
        why = "more than one rank: every rank streams alike" if fast["world"] > 1 else None
        return dict(fast, mode_asked="auto", mode_why=why)
    lean = plan(cfg, mode="lean", **kw)
    if lean["fits"] and not fast["fits"]:
        p, why = lean, "only lean fits"
    elif lean["fits"] and lean["step_time_s"] <= LEAN_FASTER * fast["step_time_s"]:
        p, why = lean, f"{fast['step_time_s'] / lean['step_time_s'] - 1:.0%} faster than fast here"
    else:
        p, why = fast, (f"lean is not {1 - LEAN_FASTER:.0%} faster here" if lean["fits"] else
                        "lean does not fit")
    return dict(p, mode_asked="auto", mode_why=why)


def replan(p, **change):
    """Plan p again with some of its arguments changed (change: plan()'s arguments, or
    cfg=GPTConfig)."""
    kw = dict(hardware=p["hardware"], batch_size=p["batch_size"], seq_len=p["seq_len"],
              micro_batches=p["micro_batches"], mode=p["mode_asked"], dtype=p["dtype"],
              grad_clip=p["grad_clip"], offload_activations=p["offload_asked"], name=p["config"],
              residual_dtype=p["residual_dtype"], grad_slabs=p["grad_slabs_asked"],
              skip_nonfinite=p["skip_nonfinite"], chunk_tokens=p["chunk_tokens"],
              host_speed=p["host_speed"], tile_tokens=p["tile_asked"], gpus=p["gpus"],
              nodes=p["nodes"], resident_units=p["resident_asked"],
              gpu_updated_units=p["gpu_updated_asked"], host_mem_gb=p["host_mem_asked"],
              optimizer=p["optimizer"])
    cfg = change.pop("cfg", None) or model.GPTConfig(**p["model"])
    kw.update(change)
    # train.py's --max-seq-len applies to whichever preset: plan at the asked length (the
    # arithmetic has no limit)
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, kw["seq_len"]))
    return plan(cfg, **kw)


def from_flags(a, cfg, hw=None, guarded=True, real=False, **change):
    """plan() for the command-line flags of megatrain_min/cli.py (hw: --hardware unless given;
    guarded: train.py's non-finite guard; change: arguments of plan() that replace the flags').
    real: the plan of a run about to train here, whose --host-mem may lower this machine's memory,
    never raise it, and whose --engine reference keeps no unit on the GPU (nothing streams). A
    count of units above what the model has is used as all of them, with a warning when the plan
    fits (capped)."""
    if real and a.host_mem is not None and a.host_mem * GB > hardware.host_available_bytes():
        raise PlanError(f"--host-mem {a.host_mem:g} GB is more than this machine has "
                        f"available ({hardware.host_available_bytes() / GB:.0f} GB); a run is "
                        "checked against the memory it has: drop --host-mem, or plan for "
                        "another machine with --plan")
    kw = dict(batch_size=a.batch_size, seq_len=a.seq_len, micro_batches=a.micro_batches,
              mode=a.mode, dtype=a.dtype, grad_clip=a.grad_clip,
              offload_activations=cli.OFFLOAD[a.offload_activations],
              residual_dtype=a.residual_dtype, chunk_tokens=a.chunk_tokens or None,
              host_mem_gb=a.host_mem, host_bw_gbs=a.host_bw, tile_tokens=a.tile_tokens,
              skip_nonfinite=guarded, gpus=a.gpus, nodes=a.nodes,
              resident_units=getattr(a, "resident_units", None),
              gpu_updated_units=getattr(a, "gpu_updated_units", None),
              optimizer=getattr(a, "optimizer", cli.DEFAULTS["optimizer"]))
    if real and getattr(a, "engine", "stream") == "reference":   # one model in memory, no units
        kw.update(resident_units=0, gpu_updated_units=0)
    p = plan(cfg, hw or a.hardware, **{**kw, **change})
    for line in capped(p) if p["fits"] else ():   # (a plan that does not fit: its refusal says it)
        warnings.warn(line)
    return p


def capped(p):
    """The lines that say where plan p used fewer units than asked: a count above the units
    there are (--resident-units), or above the streamed units a GPU may update (every one but the
    embedding: --gpu-updated-units)."""
    n = len(model.units(model.GPTConfig(**p["model"])))
    k = p["resident_units"]
    g = p["gpu_updated_units"]
    lines = []
    if p["resident_asked"] is not None and p["resident_asked"] > k:
        lines.append(f"--resident-units {p['resident_asked']} is more than the {n} units "
                     f"{p['config']} has: all {k} are kept resident")
    if p["gpu_updated_asked"] is not None and p["gpu_updated_asked"] > g:
        asked = f"--gpu-updated-units {p['gpu_updated_asked']}"
        lines.append(f"{asked}: no unit streams (all {k} are resident), so none is updated on "
                     "the GPU" if not g else
                     f"{asked} is more than the {g} streamed units the GPU can update (every "
                     f"one but the embedding): all {g} are updated there")
    return lines
