"""fit.py -- does the plan fit, and if not, what would: the planner's verdict and its searches.

What it is
    check(p): None when plan p fits; else PlanError, one line: what is short, by how much, what this
    machine (or --hardware) has, the nearest setting that fits. suggest(p): that setting, as
    train.py flags -- fewer units on the GPU than asked, more of this machine's memory than
    --host-mem gave, the memory modes, activation offload, a smaller loss chunk, a sequence tile,
    more micro-batches, a smaller batch, a bf16 residual, then smaller presets, each tried by
    planning again.
    max_context(p): the longest --seq-len that fits with p's other settings (doubling, then
    bisection); longest_context(p): the same, or PlanError saying why not even 1024 tokens fit.
What it is not
    Not an optimiser of throughput: the first setting that fits, in an order that keeps the run
    closest to what was asked.
Try it
    python train.py --config 70b --plan --hardware h100 --batch-size 8 --seq-len 4096
    python train.py --config 7b --plan --max-context --hardware gh200 --host-mem 480 --batch-size 1
"""
import math

import model
from megatrain_min.engine.checks import splits
from megatrain_min.plan import PlanError, replan
from megatrain_min.plan.hardware import GB, host_available_bytes
from megatrain_min.plan.memory import HOST_USABLE, TILE_TOKENS, size


def check(p):
    """None when the plan fits; else raise PlanError with one line: what is short, by how much, what
    to try."""
    if p["fits"]:
        return
    hw = p["hardware"]
    cfg = f"--config {p['config']}" if p["config"] in model.PRESETS else "this config"
    where = "this machine has" if hw["name"] == "local" else f"--hardware {hw['name']} has"
    host = where
    if p["host_mem_asked"] is not None:   # the flag counts GB: say so, and what the host has
        host = f"--host-mem {p['host_mem_asked']:g} (GB) gives it"
        if hw["name"] == "local":
            host = f"this machine has {size(host_available_bytes())} available, {host}"
    if not p["fits_host"]:
        what = " + ".join(
            [f"fp32 master + {p['optimizer']} state"]
            + ["bf16 shadow"] * ("bf16 shadow (streamed)" in p["host"])
            + ["fp32 grads"] * p["defer_updates"]
            + ["boundary activations"] * p["offload_activations"]
            + ["the step's activations (device buffers, on the CPU)"]
            * ("device buffers (below)" in p["host"]))
        mode = f" in --mode {p['mode']}" if p["dtype"] == "bf16" else ""
        msg = (f"{cfg} needs ~{size(p['host_bytes'])} of host RAM "
               f"({p['host_bytes'] / p['params']:.1f} B/param: {what}){mode}; {host} "
               f"{size(hw['host_mem_gb'] * GB)}")
    else:
        msg = (f"{cfg} needs ~{size(p['gpu_bytes'])} of GPU memory at {p['batch_size']} x "
               f"{p['seq_len']} tokens in {p['micro_batches']} micro-batch(es){units_asked(p)}; "
               f"{where} {size(hw['gpu_mem_gb'] * GB)}")
    longest = max_context(p)[0] if p["seq_len"] > 1024 else 0
    if 0 < longest < p["seq_len"]:  # a long context: say how long one can be with these settings
        msg += (f"; the longest context that fits at --batch-size {p['batch_size']} "
                f"is --seq-len {longest}")
    fix = suggest(p) or (f"--seq-len {longest}" if 0 < longest < p["seq_len"] else None)
    raise PlanError(msg + (f". Try {fix}, or --plan for the breakdown." if fix else
                           ". Nothing smaller fits either; see --plan for the breakdown."))


def units_asked(p):
    """', of it N GB for ...' naming the flags that asked for units on the GPU, or ''."""
    said = []
    for flag, asked, used, parts in (
            ("--resident-units", p["resident_asked"], p["resident_units"], ("resident units",)),
            ("--gpu-updated-units", p["gpu_updated_asked"], p["gpu_updated_units"],
             ("GPU-updated units", "GPU update scratch"))):
        if asked:
            held = sum(v for k, v in p["gpu"].items() if k.startswith(parts))
            said.append(f"{size(held)} for the {used} units of {flag} {asked}")
    return f", of it {' and '.join(said)}" if said else ""


def fewer_units(p):
    """The most units resident (or updated on the GPU), below the count p asked for, with which p
    fits, as a flag -- or None: a count not asked for (the plan's own fits), or even 0 does not
    fit. A bisection: fewer units on the GPU never need more of its memory."""
    for flag, key, asked in (("--resident-units", "resident_units", p["resident_asked"]),
                             ("--gpu-updated-units", "gpu_updated_units", p["gpu_updated_asked"])):
        if not asked or not p[key] or not replan(p, **{key: 0})["fits"]:
            continue
        lo, hi = 0, p[key]                                  # lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if replan(p, **{key: mid})["fits"] else (lo, mid)
        return f"{flag} {lo}"
    return None


def more_host_mem(p):
    """--host-mem X, the least (in tenths of a GB, whole GB from 10) with which p fits, when p plans
    for this machine (--hardware local) with less memory than it has (--host-mem) and it has X; else
    None. (For a profile --host-mem is that machine's memory: not a setting to change.)"""
    if p["host_mem_asked"] is None or p["fits_host"] or p["hardware"]["name"] != "local":
        return None
    gb = p["host_bytes"] / HOST_USABLE / GB
    gb = math.ceil(gb) if gb >= 10 else math.ceil(gb * 10) / 10
    if gb * GB > host_available_bytes():
        return None
    return f"--host-mem {gb:g}" if replan(p, host_mem_gb=gb)["fits"] else None


def suggest(p):
    """The nearest setting that fits, as train.py flags, or None. Tried in order: fewer units on
    the GPU than asked (--resident-units, --gpu-updated-units), a larger --host-mem where one
    lowered this machine's, the memory modes, activation offload, a smaller loss chunk, a
    (smaller) sequence tile, more micro-batches (smaller recompute activations), a smaller batch, a
    bf16 residual (it trades accuracy for memory, so it comes last), then smaller presets. (Fewer
    micro-batches never helps: the slots and boundary activations do not depend on them.)"""
    asked = fewer_units(p) or more_host_mem(p)
    if asked:
        return asked
    tries = []
    if p["dtype"] == "bf16":  # lean saves 2 B/param of host RAM, fast the GPU's fp32 cast buffer
        tries.append(("--mode lean", dict(mode="lean")) if p["mode"] == "fast" else
                     ("--mode fast", dict(mode="fast")))
    if p["defer_updates"]:
        tries += [("--grad-clip 0", dict(grad_clip=0.0)),
                  ("--mode lean --grad-clip 0", dict(mode="lean", grad_clip=0.0))]
    tries.append(("--offload-activations off" if p["offload_activations"] else
                  "--offload-activations "
                  "on", dict(offload_activations=not p["offload_activations"])))
    # 256 MB of fp32 logits, without the floor
    small_chunk = model.LOSS_CHUNK_LOGITS // p["model"]["vocab_size"]
    if small_chunk < (p["chunk_tokens"] or
                      model.default_chunk_tokens(model.GPTConfig(**p["model"]))):
        tries.append((f"--chunk-tokens {small_chunk}", dict(chunk_tokens=small_chunk)))
    tries += [(f"--tile-tokens {n}", dict(tile_tokens=n)) for n in (TILE_TOKENS, 2048)
              if n < p["seq_len"] and (not p["tile_tokens"] or n < p["tile_tokens"])]
    B, M, N = p["batch_size"], p["micro_batches"], p["world"]   # N GPUs share the batch: B/N each
    # the next divisors of B/N above M: the near ones and M's doublings (a bounded search, whatever
    # B is)
    near = {*range(M + 1, min(B // N, M + 64) + 1),
            *(M << k for k in range(1, 64) if M << k <= B // N)}
    tries += [(f"--micro-batches {m}", dict(micro_batches=m))
              for m in sorted(near) if splits(B, m, N)][:4]
    tries += [(f"--batch-size {b} --micro-batches {min(M, b // N)}",
               dict(batch_size=b, micro_batches=min(M, b // N)))
              for b in (B // 2, B // 4, B // 8, N)
              if N <= b < B and splits(b, min(M, b // N), N)]
    if p["dtype"] == "bf16" and p["residual_dtype"] == "fp32":   # last: it costs accuracy
        tries.append(("--residual-dtype bf16", dict(residual_dtype="bf16")))
    for flags, change in tries:
        if replan(p, **change)["fits"]:
            return flags
    smaller = sorted((c for c in model.PRESETS.items() if model.n_params(c[1]) < p["params"]),
                     key=lambda c: -model.n_params(c[1]))
    for name, c in smaller:
        if replan(p, cfg=c, name=name)["fits"]:
            longer = p["seq_len"] > c.max_seq_len
            return f"--config {name}" + (f" --max-seq-len {p['seq_len']}" if longer else "")
    return None


def max_context(p, step=1024, limit=1 << 25):
    """The longest sequence, a multiple of `step` tokens up to `limit`, with which plan p's settings
    fit (its hardware, batch size, micro-batches, modes; the tile the planner's choice unless p
    asked for one). Returns (tokens, that plan), or (0, None) when not even `step` tokens fit.
    Memory grows with T: a doubling search, then bisection."""
    lo, best, hi = 0, None, step
    while hi <= limit:
        q = replan(p, seq_len=hi)
        if not q["fits"]:
            break
        lo, best, hi = hi, q, 2 * hi
    while hi - lo > step and lo < limit:
        mid = (lo + hi) // 2 // step * step
        q = replan(p, seq_len=mid)
        lo, best, hi = (mid, q, hi) if q["fits"] else (lo, best, mid)
    return lo, best


def longest_context(p, step=1024):
    """max_context(p), or PlanError when not even `step` tokens fit: check's line of the plan at
    `step` tokens (what is short, the flag that asked for it, what would fit)."""
    longest, q = max_context(p, step)
    if longest:
        return longest, q
    try:
        check(replan(p, seq_len=step))
    except PlanError as e:
        raise PlanError(f"--max-context: not even {p['batch_size']} x {step} tokens fit: {e}") \
            from None
    raise PlanError(f"--max-context: not even {p['batch_size']} x {step} tokens fit")
