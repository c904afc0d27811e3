"""plan.py -- will it fit, and how fast will it go? The memory and throughput plan of one training run.

What it is
    plan(cfg, hardware, ...) works from the config's arithmetic alone (model.units() sizes every unit
    without allocating it), so `--config 120b --plan` answers in milliseconds. It returns host memory by
    component (fp32 master, m, v, bf16 shadow, fp32 gradient store or slabs, offloaded boundary
    activations, runtime), GPU memory by component (weight and grad slots, lean cast buffer, boundary activations, one
    layer's recompute activations for one micro-batch, weight-grad outputs, the loss chunk), the time of
    each layer visit (H2D, compute, D2H, CPU AdamW), and stream.py's schedule replayed layer by layer on
    four lanes for three steps: step time, tokens/s, model TFLOP/s, the busiest lane (the bottleneck) and
    the tokens per step that hide the transfers (T >= F_eff * bytes_per_param / (2 * BW): docs/design.md,
    section 'The arithmetic').
    check(p) turns a plan that does not fit into one line: what, how much, the nearest setting that fits (and,
    at long context, the longest --seq-len that does). max_context(p): that longest sequence. At long T the
    layer is tiled (model.block's tile_tokens, chosen by tile_for) and the GPU side is O(T): x and dy, the
    boundary-activation ring, the whole sequence's attention tensors (flash-attention kernels assumed: bf16 compute).
What it is not
    Not a profiler: bandwidths and the achievable fraction of peak are the assumptions stated in HARDWARE
    until bench/ measures them. Not modelled: DRAM contention between DMA and AdamW, launch gaps, the data
    loader, back-pressure of the grad slabs, the transient extra fp32 copy init_weights makes.
Reference
    docs/design.md, sections 'Memory modes' and 'The arithmetic'; stream.py and optim.py for what is
    allocated where; MegaTrain (arXiv 2604.05091: 120B on one H200 with 1.5 TB of host memory).
Try it
    python -m megatrain_min.plan --config 120b --hardware h200 --mode lean --host-mem 1536 --grad-clip 0 \
        --batch-size 4 --seq-len 4096
    python -m megatrain_min.plan --config 70b --hardware all --batch-size 8 --seq-len 4096   # a line per profile
    python -m megatrain_min.plan --config 70b --hardware h100 --gpus 8 --nodes 2 --host-mem 2000 --batch-size 64 \
        --seq-len 4096
    python train.py --config 7b --plan --hardware gh200 --seq-len 524288 --batch-size 1   # long context
    python -m pytest tests/test_plan.py
"""
import argparse
import dataclasses
import json
import math
import os

import torch

import model
import optim
import stream
from megatrain_min import activations, cli, cost, memory
from megatrain_min.guard import Guard
from megatrain_min.tiling import Tiled

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
GB = 1e9  # decimal: "1536 GB" is 1.536e12 bytes (slightly conservative against GiB-sized DIMMs)

# Peaks: dense (no sparsity) TFLOP/s from NVIDIA's datasheets. frac: the share of peak a whole layer
# reaches (matmuls + attention + norms). h2d/d2h: what cudaMemcpyAsync from pinned memory on a copy engine
# measures, not the link's spec. host_mem: a typical host for one such GPU; host_bw: the DRAM bandwidth a
# multi-threaded fused CPU AdamW sees (28 B/param); host_l3_mb: its last-level cache (optim.TILE's tiles stay
# there: the shadow is written from cache). The H200 row is measured (bench/results/2026-11-27-nvidia-h200,
# 16 host cores, torch 2.11): frac 0.56 is its 7B-width layer's forward (15.5 ms), recompute + backward (48 ms)
# and head (31 ms) at 16,384 tokens; the links 55.2 / 55.3 GB/s; AdamW 101 GB/s (55 ms per 202M params, with
# the copies running); the host's last level 300 MB. The H100 and GH200 share its compute die: frac 0.56 too.
HARDWARE = {
    # H100 SXM5: 80 GB HBM3 3.35 TB/s, 989 bf16 / 67 fp32 TFLOP/s. PCIe Gen5 x16 (64 GB/s spec) ~55 each way.
    # Host: 2-socket Xeon, 16 x DDR5-4800 (614 GB/s spec), ~200 for AdamW over NUMA-unaware pinned pages.
    # 8 per node on NVLink 4 (450 GB/s per direction spec; NCCL all_gather / reduce_scatter bus bandwidth ~360),
    # one 400 Gb/s InfiniBand NDR NIC per GPU between nodes (50 GB/s spec, ~45).
    "h100": dict(gpu="NVIDIA H100 80GB", gpu_mem_gb=80, bf16_tflops=989, fp32_tflops=67, frac=0.56,
                 hbm_gbs=3350, h2d_gbs=55, d2h_gbs=55, host_mem_gb=1024, host_bw_gbs=200, host_l3_mb=105,
                 nvlink_gbs=360, ib_gbs=45),
    # H200 SXM: 141 GB HBM3e 4.8 TB/s, same compute as H100, PCIe Gen5; measured (above). Host memory as
    # MegaTrain's: 1.5 TB (the measured VM had 128 GB: --host-mem 128), its measured 16 cores' AdamW.
    "h200": dict(gpu="NVIDIA H200 141GB", gpu_mem_gb=141, bf16_tflops=989, fp32_tflops=67, frac=0.56,
                 hbm_gbs=4800, h2d_gbs=55.2, d2h_gbs=55.3, host_mem_gb=1536, host_bw_gbs=101, host_l3_mb=300,
                 nvlink_gbs=360, ib_gbs=45),
    # GH200: 96 GB HBM3 4 TB/s, H100 compute; NVLink-C2C 900 GB/s spec, ~340 H2D / ~295 D2H measured.
    # Host: Grace's 480 GB LPDDR5X (512 GB/s spec, ~400 achievable). One superchip per node: InfiniBand NDR (~45).
    "gh200": dict(gpu="NVIDIA GH200 96GB", gpu_mem_gb=96, bf16_tflops=989, fp32_tflops=67, frac=0.56,
                  hbm_gbs=4000, h2d_gbs=340, d2h_gbs=295, host_mem_gb=480, host_bw_gbs=400, host_l3_mb=114,
                  nvlink_gbs=360, ib_gbs=45),
    # A100 SXM4 80 GB: 2.0 TB/s, 312 bf16 / 19.5 fp32 TFLOP/s. PCIe Gen4 x16 (32 GB/s spec) ~25.
    # Host: 2-socket EPYC, 16 x DDR4-3200 (410 GB/s spec). NVLink 3 (300 GB/s per direction, NCCL ~230), HDR IB (~22).
    "a100": dict(gpu="NVIDIA A100 80GB", gpu_mem_gb=80, bf16_tflops=312, fp32_tflops=19.5, frac=0.6,
                 hbm_gbs=2039, h2d_gbs=25, d2h_gbs=25, host_mem_gb=512, host_bw_gbs=150, nvlink_gbs=230, ib_gbs=22),
    # RTX 4090: 24 GB GDDR6X 1.0 TB/s, 165 bf16 (fp32 accumulate) / 82.6 fp32 TFLOP/s, PCIe Gen4 ~25.
    # Host: a desktop, 2 channels of DDR5 (~90 GB/s spec). No NVLink: collectives cross PCIe through the host
    # (~12); 100 Gb/s Ethernet between nodes (~10).
    "rtx4090": dict(gpu="NVIDIA GeForce RTX 4090", gpu_mem_gb=24, bf16_tflops=165, fp32_tflops=82.6,
                    frac=0.6, hbm_gbs=1008, h2d_gbs=25, d2h_gbs=25, host_mem_gb=128, host_bw_gbs=60, nvlink_gbs=12,
                    ib_gbs=10),
}
# The host issues every op -- Python, the dispatcher, autograd's engine: HOST_OP_S each, whether issued from Python
# or run by autograd. Fitted on the CPU backend (bench/host_overhead.py --calibrate: a 2-core CPU, one OpenMP
# thread, the real engine with negligible tensors at 5 depths x micro-batch counts), so it leaves out what CUDA
# eager ops add (cudaLaunchKernel, autograd's device thread): bench/gpu_run.sh refits it on a GPU (host_op.json).
# plan(host_speed=) and the twin's --host-speed scale it for a faster host. The engine's own ops around the model's
# (copies, zeroing, the step's input; counted with megatrain_min.sim's recorder): per layer visit, per step, and
# per unit update on the optimizer thread.
HOST_OP_S = 10.5e-6
ENGINE_OPS = dict(visit=5, step=41, update=11)
HOST_USABLE = 0.97         # the share of host RAM a run may plan for; the rest is the OS's
RUNTIME = 4 * 10**9        # host RSS of Python + torch + the CUDA libraries (1 GB without CUDA)
CUDA_CONTEXT = 2 * 10**9   # GPU: CUDA context, cuBLAS workspaces, caching-allocator slack
# Sequence tiling (model.block): the planner tiles when the untiled layer does not fit comfortably, i.e. when the
# untiled plan's device memory exceeds TILE_HEADROOM of the device; then tiles of TILE_TOKENS tokens: matmuls of
# 8192 rows still run near full speed, and a tile of a 7B layer's token-local activations is ~2 GB (~140 GB
# untiled at 512k tokens).
TILE_HEADROOM = 0.9
TILE_TOKENS = 8192
# Resident units (stream.Trainer(resident_units=)): the plan fills the GPU memory the step leaves, up to
# RESIDENT_HEADROOM of it, with whole units in the order the forward needs them, 16 B/param each (fp32 master,
# m, v, gradient); their AdamW is torch's fused CUDA kernel, assumed at GPU_ADAM_FRAC of the HBM bandwidth
# (28 B/param; bench/gpu.py's pinned case measures it: cuda_adamw_gbs).
RESIDENT_HEADROOM = 0.9
GPU_ADAM_FRAC = 0.7


class PlanError(ValueError):
    """A run that does not fit, in one line: what, how much, what this machine has, what to try."""


def host_available_bytes():
    """Host RAM a run can have now: MemAvailable (or all of it without /proc), capped by a cgroup limit."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        avail = info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError):
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's limit (cgroup v2) is invisible in /proc/meminfo
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            avail = min(avail, int(limit) - int(open("/sys/fs/cgroup/memory.current").read()))
    except (OSError, ValueError):
        pass
    return avail


def local_hardware(device=None):
    """This machine, detected now, for a run on `device` (None: the current CUDA device when there is one, else the
    CPU). A GPU: its free memory, speeds from the matching profile (unknown GPUs get modest guesses). The CPU:
    it computes and copies are memcpys; GPU memory 0. Nothing touches a GPU other than `device`'s."""
    dev = optim.resolve_device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        key = next((k for k in ("gh200", "h200", "h100", "a100", "rtx4090")   # gh200 before h200
                    if k.removeprefix("rtx") in name.lower()), None)
        hw = dict(HARDWARE[key]) if key else dict(bf16_tflops=100, fp32_tflops=20, frac=0.5, hbm_gbs=1000,
                                                  h2d_gbs=25, d2h_gbs=25, host_bw_gbs=50, nvlink_gbs=12, ib_gbs=10)
        hw.update(gpu=name, gpu_mem_gb=torch.cuda.mem_get_info(dev)[0] / GB, profiled=key is not None)
    else:  # ~0.1 TFLOP/s per core in fp32 (AVX2/AVX-512 FMA), bf16 matmuls much slower on most CPUs
        cores, bw = os.cpu_count() or 1, 20
        hw = dict(gpu="cpu", gpu_mem_gb=0, bf16_tflops=0.02 * cores, fp32_tflops=0.1 * cores, frac=0.5,
                  hbm_gbs=bw, h2d_gbs=bw / 2, d2h_gbs=bw / 2, host_bw_gbs=bw, nvlink_gbs=bw / 4, ib_gbs=1,
                  profiled=False)
    return dict(hw, name="local", host_mem_gb=host_available_bytes() / GB)


def resolve_hardware(hardware, host_mem_gb=None, host_bw_gbs=None, device=None):
    if isinstance(hardware, dict):
        hw = dict(hardware)
    elif hardware == "local":
        hw = local_hardware(device)
    elif hardware in HARDWARE:
        hw = dict(HARDWARE[hardware], name=hardware)
    else:
        raise PlanError(f"unknown --hardware {hardware!r}; choose one of: local, {', '.join(HARDWARE)}")
    for k, v in (("host_mem_gb", host_mem_gb), ("host_bw_gbs", host_bw_gbs)):
        if v is not None:
            if v <= 0:
                raise PlanError(f"{k} must be positive, got {v}")
            hw[k] = v
    return hw


def flops_per_token(cfg):
    """Model FLOPs per trained token: 6 x the parameters that multiply (every matrix except the embedding
    table, which is a gather). No attention scores, no recompute: those are not useful work."""
    return 6 * sum(u.n_decay for u in model.units(cfg) if u.name != "embed")


def model_tflops(cfg, tokens, seconds):
    """Model TFLOP/s of `tokens` trained in `seconds`: flops_per_token (6 N) per token, as nanoGPT and PaLM count."""
    return flops_per_token(cfg) * tokens / seconds / 1e12


def peak_tflops(hw, dtype):
    """The dense peak TFLOP/s of one GPU of hardware `hw` in dtype ("bf16", "fp32"), or None when it is a guess (a
    CPU, a GPU without a profile in HARDWARE): MFU against a guess would be a made-up number."""
    return hw[f"{dtype}_tflops"] if hw.get("profiled", True) else None


def plan(cfg, hardware="local", batch_size=8, seq_len=None, micro_batches=1, mode="fast", dtype=None,
         grad_clip=0.0, offload_activations=None, host_mem_gb=None, host_bw_gbs=None,
         residual_dtype="fp32", grad_slabs=None, skip_nonfinite=True, chunk_tokens=None, host_speed=1.0, name=None,
         tile_tokens=None, gpus=1, nodes=1, device=None, resident_units=None):
    """The memory and throughput plan of training cfg: a JSON-ready dict (see plan_json, format_plan).

    hardware: a HARDWARE name, "local", or a dict like HARDWARE's. seq_len None: cfg.max_seq_len.
    dtype: "bf16" or "fp32" (None: model.default_dtype of the hardware). grad_clip: the global-norm clip
    (0 = off); with it the updates are deferred until every gradient is on the host, which keeps an fp32
    gradient per parameter there; without it each unit is updated as its gradient lands, through gradient
    slabs (grad_slabs None: as many as hide the D2H + AdamW latency, see `slabs`). offload_activations
    None: memory.offload_needed decides (p["offload_activations"]: activations.HostRing or not). residual_dtype:
    "fp32" (the default: autocast's arithmetic) or "bf16". skip_nonfinite: train.py's guard; without deferral
    it costs a host wait for the loss after the head and one more read of each gradient (HostAdamW.step's
    finite_only), never a gradient store. p["pinned_bytes"]: the host bytes page-locked (optim.page_locked,
    exactly their size): what a copy engine reads or writes, never Adam's m and v.
    tile_tokens: model.block's sequence tile (0 = untiled); None: the planner's choice (tile_for).
    device: with hardware "local", the device the run trains on (its free memory; None: local_hardware's choice).
    gpus, nodes: megatrain_min/sharded.py on gpus per node x nodes ranks (N), batch_size the global batch: each
    rank computes batch_size / N sequences in micro_batches and holds 1/N of the host store; host memory is then
    per node, GPU memory per GPU. Each visit adds an all_gather of the unit (compute dtype) and a reduce_scatter
    of its fp32 gradient, (N-1)/N of it per GPU, on a comm lane of their own: NVLink (nvlink_gbs, bus bandwidth)
    within a node, InfiniBand per GPU (ib_gbs) as soon as the ring crosses nodes. The node's AdamW threads share its
    DRAM bandwidth. Not modelled: the all_reduce of the loss and norm (a few bytes), collective latency.
    resident_units: how many units, in the order the forward needs them, stay whole on the GPU (16 B/param
    there, none on the host, AdamW on the GPU); None: as many as fit in the memory the step leaves (one rank).
    """
    hw = resolve_hardware(hardware, host_mem_gb, host_bw_gbs, device)
    cuda = hw["gpu_mem_gb"] > 0
    dtype = dtype or DTYPE_NAMES[model.default_dtype("cuda" if cuda else "cpu")]
    seq_len = seq_len or cfg.max_seq_len
    if mode not in ("fast", "lean") or dtype not in DTYPES or residual_dtype not in DTYPES:
        raise PlanError(f"mode must be fast or lean, dtype and residual dtype bf16 or fp32; got {mode!r}, "
                        f"{dtype!r} and {residual_dtype!r}")
    if residual_dtype == "bf16" and dtype == "fp32":
        raise PlanError("a bf16 residual needs bf16 compute (--dtype bf16); with fp32 compute drop --residual-dtype")
    if tile_tokens is not None and tile_tokens < 0:
        raise PlanError(f"tile_tokens must be >= 0 (0 = no tiling), got {tile_tokens}")
    if min(batch_size, seq_len, micro_batches) <= 0 or batch_size % micro_batches:
        raise PlanError(f"batch size {batch_size} must be a positive multiple of micro-batches {micro_batches}")
    if not (isinstance(gpus, int) and isinstance(nodes, int) and gpus >= 1 and nodes >= 1):
        raise PlanError(f"--gpus and --nodes must be integers >= 1, got {gpus!r} and {nodes!r}")
    world = gpus * nodes
    if batch_size % (world * micro_batches):
        raise PlanError(f"batch size {batch_size} must be a multiple of {world} GPUs x micro-batches {micro_batches}"
                        f" (each GPU computes batch_size / {world} sequences)")
    name = name or next((k for k, c in model.PRESETS.items() if c == cfg), "this config")
    units = model.units(cfg)
    layers, head = [u for u in units if u.name.startswith("layer.")], units[-1]
    lay, L, N, tied = layers[0], len(layers), sum(u.numel for u in units), cfg.tie_embeddings
    defer = grad_clip > 0                              # stream.Trainer.defer_updates
    cb, rb = DTYPES[dtype].itemsize, DTYPES[residual_dtype].itemsize   # bytes: compute, residual
    shadow = mode == "fast" and dtype == "bf16"        # fast streams a bf16 shadow; lean the fp32 master
    sb = 2 if shadow else 4                            # bytes per parameter that cross H2D
    n_slot = max(lay.numel, head.numel)                # a weight/grad slot holds the largest streamed unit
    shard = lambda n: -(-n // world)                   # noqa: E731  one rank's share of n elements (sharded.py)
    n_slot = world * shard(n_slot)                     # the all_gather fills N whole shards, padding included
    tokens_step = batch_size * seq_len                 # the global batch
    tokens = tokens_step // world                      # what one rank (GPU) computes
    act = tokens * cfg.d_model * rb                    # one (B, T, d) residual tensor, all micro-batches
    row_b = 2 if (shadow and rb == 2) else 4           # embedding rows: from the bf16 shadow or the fp32 master
    act_step = tokens_step * cfg.d_model * rb          # (B, T, d) of the whole step: dy of layer 0, gathered

    # ---- GPU (stream.Trainer.__init__ and the step's working set): independent of depth
    def device(tile):
        gpu = {f"weight slots: 2 x {count(n_slot)} {dtype}": 2 * n_slot * cb,
               "fp32 grad slots: 2": 2 * n_slot * 4}
        if mode == "lean" and dtype == "bf16":
            gpu["lean cast buffer: fp32 unit, cast on GPU"] = n_slot * 4
        gpu["CUDA context, workspaces, slack"] = CUDA_CONTEXT if cuda else 0
        if world > 1:  # sharded.py: H2D lands in a weight shard, reduce_scatter writes a grad shard (2 each); the
            # embedding's rows of the whole step cross PCIe before their reduce_scatter, dy is all_gathered whole
            gpu[f"shards: 2 weight + 2 fp32 grad of {count(shard(n_slot))}"] = 2 * shard(n_slot) * (cb + 4)
            # (made on the H2D and comm lanes: blocks of their own pools, which compute's allocations cannot reuse)
            gpu["embedding rows and dy of the whole step"] = tokens_step * cfg.d_model * (row_b + rb)
        gpu.update(memory.step_device_bytes(cfg, tokens, micro_batches, DTYPES[dtype], DTYPES[residual_dtype],
                                            chunk_tokens or model.default_chunk_tokens(cfg), n_slot,
                                            seq_len=seq_len, tile_tokens=tile))
        if cuda and dtype == "fp32" and cfg.n_kv_head != cfg.n_head:  # SDPA on CUDA: GQA in fp32 has no fused
            # kernel (flash needs bf16), so the math kernel runs: T x T scores, softmax and their gradient, fp32
            gpu["attention scores: math kernel (fp32 + GQA)"] = 3 * 4 * cfg.n_head * seq_len * tokens // micro_batches
        # boundary activations (every layer's input, for the recompute) stay on the GPU when all fits there, else
        # they go to pinned host memory through a ring of activations.RING device slots
        off = offload_activations if offload_activations is not None else \
            cuda and memory.offload_needed(L * act, sum(gpu.values()), hw["gpu_mem_gb"] * GB)
        gpu[f"boundary activations: device ring of {activations.RING}" if off else
            f"boundary activations: {L} layers"] = activations.RING * act if off else L * act
        return gpu, off

    host_limit = hw["host_mem_gb"] * GB * HOST_USABLE
    tile = tile_tokens
    if tile is None:  # the planner's choice (tile_for): untiled while the untiled layer fits comfortably
        tile = tile_for(sum(device(0)[0].values()), hw["gpu_mem_gb"] * GB if cuda else host_limit)
    gpu, offload = device(tile)
    gpu_bytes = sum(gpu.values())

    # ---- resident units: whole on the GPU, in the order the forward needs them (stream.Trainer.order)
    e = len(units) - 1 if tied else 0                  # the embedding's unit (tied: the head)
    order = [e] + [u for u in range(len(units)) if u != e]
    asked, k = resident_units, resident_units or 0
    if asked is None and cuda and world == 1:          # as many as fit in what the step leaves
        room = RESIDENT_HEADROOM * hw["gpu_mem_gb"] * GB - gpu_bytes
        while k < len(order) and 16 * units[order[k]].numel <= room:
            room, k = room - 16 * units[order[k]].numel, k + 1
    res = set(order[:k])                               # indices into units
    if res:
        gpu[f"resident units: {len(res)} of {len(units)}, 16 B/param"] = 16 * sum(units[u].numel for u in res)
        gpu_bytes = sum(gpu.values())
    emb_res = e in res
    sim_name = lambda u: "head" if u == len(units) - 1 else "embed" if not tied and u == 0 else u - (not tied)  # noqa

    # ---- throughput: seconds per visit (needed to size the gradient slabs)
    F = hw[f"{dtype}_tflops"] * 1e12 * hw["frac"]     # achievable FLOP/s
    h2d, d2h, hbw = hw["h2d_gbs"] * GB, hw["d2h_gbs"] * GB, hw["host_bw_gbs"] * GB
    cast = 6 / (hw["hbm_gbs"] * GB) if not shadow and dtype == "bf16" else 0  # lean: read fp32, write bf16
    # read p, g, m, v; write p, m, v; clipped: the kernel writes the scaled g back; the guard without deferral
    # reads g once more (HostAdamW.step(finite_only)); fast: read p again, write the shadow
    # reads p again and writes the shadow: from cache when optim.TILE's tile (18 B/param) fits the host's L3
    one_pass = optim.TILE * 18 <= hw.get("host_l3_mb", 32) * 2**20
    adam_b = 28 + (4 if defer else 0) + (4 if skip_nonfinite and not defer else 0) + \
        ((2 if one_pass else 6) if shadow else 0)
    attn = 2 * seq_len * cfg.n_head * cfg.head_dim     # QK^T + AV per token, causal half (SDPA skips it)
    # seconds per parameter of a unit: this rank's 1/N share crosses its PCIe link; the node's gpus ranks update
    # their shards at once, sharing its DRAM; the collectives move (N-1)/N of the unit per GPU
    net = (hw["nvlink_gbs"] if nodes == 1 else min(hw["nvlink_gbs"], hw["ib_gbs"])) * GB
    # AdamW runs in tiles of optim.TILE elements, each 5 views and a kernel call (+ the shadow's copy) of host ops
    tile_s = (5 + 2 * shadow) * HOST_OP_S / host_speed / optim.TILE
    hbm = hw["hbm_gbs"] * GB
    rate = dict(load=(sb / h2d + cast) / world, grad=4 / d2h / world, adam=adam_b / hbw / nodes + tile_s,
                norm=4 / hbw / nodes, all_gather=(world - 1) / world * cb / net,
                reduce_scatter=(world - 1) / world * 4 / net,
                # a resident unit: cast into its slot, gradient copied D2D, AdamW (or its norm) on the GPU
                load_res=(4 + cb) / hbm, grad_res=8 / hbm, gpu_adam=(28 + 4 * defer) / (hbm * GPU_ADAM_FRAC),
                gpu_norm=4 / hbm)
    numel = dict(layer=lay.numel, head=head.numel, embed=0 if tied else units[0].numel)
    qkv = cfg.d_model * (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    # the FLOP-free ops (norms, casts, RoPE, residual adds, the loss softmax, fp32 grad accumulation) are bound by
    # HBM: their bytes per token and per call, measured on the model's own functions (cost.elementwise_bytes)
    ew = cost.elementwise_bytes(cfg, DTYPES[dtype], DTYPES[residual_dtype])
    calls = dict(fwd=micro_batches, bwd=micro_batches,  # block, block_grad per micro-batch; head_grad per chunk
                 head=micro_batches * math.ceil(tokens // micro_batches / (chunk_tokens or model.default_chunk_tokens(cfg))))
    hbm_s = {k: (tokens * ew[k][0] + calls[k] * ew[k][1]) / hbm for k in ew}
    # the host issues every op (HOST_OP_S each): the model's, counted by cost.elementwise_bytes, and the engine's
    op_s = HOST_OP_S / host_speed
    host_s = {k: op_s * (calls[k] * ew[k][2] + ENGINE_OPS["visit"]) for k in ew}
    t = dict(fwd=tokens * (2 * lay.n_decay + attn) / F + hbm_s["fwd"],
             # recompute (1x forward) + backward (2x the matmuls, 2.5x attention: flash's 5 matmuls); zero the slot
             bwd=tokens * (6 * lay.n_decay + 3.5 * attn) / F + hbm_s["bwd"] + lay.numel * 4 / hbm
             + (2 * tokens * qkv / F if tile else 0),   # tiled: part A's projections run once more (block_grad)
             head=6 * tokens * head.n_decay / F + hbm_s["head"] + head.numel * 4 / hbm,  # not recomputed
             # the scatter: zero an untied embedding's gradient, then add dy's rows (read 4, read+write 8)
             rows=tokens_step * cfg.d_model * row_b / h2d, dy=act_step / d2h,  # sharded: the whole step's rows
             rows_comm=(world - 1) / world * tokens_step * cfg.d_model * row_b / net,   # their reduce_scatter
             dy_comm=(world - 1) / world * act_step / net,                              # dy's all_gather
             scatter=(tokens_step * cfg.d_model * (4 + 8) + (0 if tied else units[0].numel * 4)) / hbw,
             rows_res=tokens * cfg.d_model * 8 / hbm,      # resident: gathered and scattered on the GPU
             scatter_res=(tokens * cfg.d_model * (4 + 8) + (0 if tied else units[0].numel * 4)) / hbm,
             ckpt_d2h=act / d2h, ckpt_h2d=act / h2d, **{k: lay.numel * r for k, r in rate.items()},
             host_fwd=host_s["fwd"], host_bwd=host_s["bwd"], host_head=host_s["head"],
             host_step=op_s * ENGINE_OPS["step"], host_update=op_s * ENGINE_OPS["update"])
    slabs = 0 if defer else grad_slabs or stream_slabs(t, tied)

    # ---- host (optim.HostAdamW + stream.py's pinned buffers), of one node: its gpus ranks, each with 1/N of the store
    per_unit = lambda bytes_per_param: gpus * sum(shard(u.numel) * bytes_per_param  # noqa: E731
                                                  for i, u in enumerate(units) if i not in res)
    host = {"fp32 master": per_unit(4), "Adam m (fp32)": per_unit(4), "Adam v (fp32)": per_unit(4)}
    if shadow:
        host["bf16 shadow (streamed)"] = per_unit(2)
    if defer:
        host["fp32 grad store (global norm first)"] = per_unit(4)
    store = sum(host.values())                         # the per-parameter part: 12, 14, 16 or 18 B/param
    streamed = [u.numel for i, u in enumerate(units) if i not in res]
    if slabs and streamed:  # D2H lands in a slab, the worker updates from it
        host[f"fp32 grad slabs: {slabs}"] = gpus * slabs * shard(max(streamed)) * 4
    if offload:
        host[f"offloaded boundary activations: {L} layers"] = gpus * L * act
    if emb_res:  # the rows gathered on the GPU from the tokens, dy stays there
        host["pinned buffers: targets, tokens"] = gpus * tokens * 16
    else:
        host["pinned buffers: embedding rows, dy, targets"] = gpus * (tokens_step * cfg.d_model * row_b +
                                                                      act_step + tokens * 8)
    # page-locked with CUDA (optim.page_locked): what a copy engine reads or writes -- not Adam's m and v, nor
    # the fp32 master when a bf16 shadow is what crosses
    unpinned = {"Adam m (fp32)", "Adam v (fp32)"} | ({"fp32 master"} if shadow else set())
    pinned_bytes = sum(v for k, v in host.items() if cuda and k not in unpinned)
    host["runtime: Python, torch" + (", CUDA" if cuda else "")] = gpus * (RUNTIME if cuda else 10**9)
    if not cuda:
        host["device buffers (below)"] = gpus * gpu_bytes
    host_bytes = sum(host.values())
    fits_host, fits_gpu = host_bytes <= host_limit, (not cuda) or gpu_bytes <= hw["gpu_mem_gb"] * GB

    # ---- the schedule
    step_time, busy, critical = simulate(L, t, numel, rate, defer_updates=defer, tied=tied, offload=offload,
                                         slabs=slabs, guard=skip_nonfinite and not defer, overlap=cuda,
                                         sharded=world > 1, resident={sim_name(u) for u in res})
    peak = hw[f"{dtype}_tflops"] * world
    tflops = model_tflops(cfg, tokens_step, step_time)
    mins = {"h2d": F * (sb / h2d + cast) / 2,          # a layer's forward (2NT FLOPs) outlasts its copy (N sb B)
            "d2h": F * 4 / (6 * d2h),                  # its recompute + backward (6NT) outlasts the fp32 grad
            "cpu_adam": F * (adam_b + 4 * defer) * gpus / (8 * hbw) * sum(streamed) / N}  # the step's compute
    # (8NT) outlasts the host's AdamW of the units it updates
    # (tokens of the whole step; sharded: a rank computes 1/N of them and copies 1/N of each unit, the node's AdamW
    # threads share its DRAM, and a backward visit's compute (6NT/N) outlasts a gather + a reduce_scatter)
    if world > 1:
        mins["comm"] = F * (cb + 4) * (world - 1) / (6 * net)
    p = dict(config=name, model=cfg.to_dict(), hardware=hw, mode=mode, dtype=dtype, residual_dtype=residual_dtype,
             batch_size=batch_size, seq_len=seq_len, micro_batches=micro_batches, tokens_per_step=tokens_step,
             gpus=gpus, nodes=nodes, world=world,
             grad_clip=grad_clip, defer_updates=defer, chunk_tokens=chunk_tokens, host_speed=host_speed, tile_tokens=tile,
             tile_asked=tile_tokens, skip_nonfinite=skip_nonfinite, grad_slabs=slabs,
             grad_slabs_asked=grad_slabs, offload_activations=bool(offload), offload_asked=offload_activations,
             resident_units=len(res), resident_asked=asked, pinned_bytes=pinned_bytes, params=N, host=host, host_bytes=host_bytes, host_limit_bytes=host_limit,
             host_bytes_per_param=store / N, fits_host=fits_host, gpu=gpu, gpu_bytes=gpu_bytes,
             gpu_limit_bytes=hw["gpu_mem_gb"] * GB, fits_gpu=fits_gpu, fits=fits_host and fits_gpu, visit_s=t,
             step_time_s=step_time, tokens_per_s=tokens_step / step_time, model_tflops=tflops,
             mfu=tflops / peak, utilization={k: v / step_time for k, v in busy.items()},
             critical_path={k: v / step_time for k, v in critical.items()}, bottleneck=max(critical, key=critical.get),
             min_tokens=mins, min_tokens_per_step=max(mins.values()))
    return p


def tile_for(untiled_bytes, device_bytes):
    """The default tile_tokens (the one home of this rule): 0 -- no tiling, the fastest layer -- while the plan
    with the untiled layer needs at most TILE_HEADROOM of the device's memory (on the CPU: of the host's share);
    else TILE_TOKENS."""
    return 0 if untiled_bytes <= TILE_HEADROOM * device_bytes else TILE_TOKENS


def stream_slabs(t, tied):
    """Gradient slabs that hide a gradient's trip: the slab of backward visit k is given back when update k-S
    finished, D2H + AdamW after that visit's compute; the GPU stalls unless S-1 backward visits outlast the trip
    (a tied head holds one more slab until the embedding scatter). At least stream.GRAD_SLABS."""
    trip = t["grad"] + t["adam"]
    return max(stream.GRAD_SLABS, math.ceil(trip / max(t["bwd"], 1e-12)) + 1 + tied)


def simulate(L, t, numel, rate, defer_updates, tied, offload, slabs=stream.GRAD_SLABS, guard=False, overlap=True,
             steps=3, sharded=False, resident=frozenset()):
    """Replay stream.Trainer.step's issue order on four FIFO lanes -- h2d, compute, d2h (CUDA streams) and
    cpu_adam (the optimizer thread) -- and the host thread that issues the work. A task starts when its lane
    is free, its inputs are ready and the host has issued it; the host issues in program order and blocks where
    the engine blocks: a unit's update before its copy (_ready), a free gradient slab before each gradient's D2H
    (without deferral), the loss after the head (the guard), the squared norms (deferred) and the loss at the
    end of the step. Units: "embed", 0 .. L-1, "head". t: seconds of the per-step tasks; numel[kind] *
    rate[what]: seconds to load, drain ("grad"), "norm" or "adam" a unit. overlap=False (a CPU run): one lane,
    all in program order. Returns the steady-state step time (between the starts of the last two steps' first
    layer), the busy seconds per step of each lane, and each lane's seconds on the critical path of the last
    step (walked back from its end through the task each task waited for): the bottleneck. sharded: a fifth lane,
    comm (sharded.py): a unit's all_gather after its shard's H2D, its gradient's reduce_scatter before the D2H of
    the shard, the rows' reduce_scatter and dy's all_gather -- one collective at a time. resident: the units kept on
    the GPU -- cast into their slot and updated (or their norm taken) on the h2d lane, their gradient copied on
    d2h, the embedding's rows gathered and its dy scattered on the GPU: the host waits for none of it."""
    free = dict.fromkeys(("h2d", "compute", "d2h", "cpu_adam") + (("comm",) if sharded else ()), 0.0)
    busy, critical, ends = dict.fromkeys(("host", *free), 0.0), dict.fromkeys(("host", *free), 0.0), {}
    host = [0.0]                                 # when the host thread can issue its next operation
    last = [0.0]                                 # the start of the latest task

    def run(lane, after, dur):
        key = lane if overlap else "compute"
        start = last[0] = max(free[key], after, host[0])
        free[key] = start + dur
        busy[lane] += dur / steps
        if dur > 0:
            ends[free[key]] = (lane, start)    # whoever starts at this instant waited for this task
        return free[key]

    def block(until):                            # the host waits
        host[0] = max(host[0], until)

    def issue(h):                                # the host spends h issuing ops (no device work waits on it)
        busy["host"] += h / steps
        if h > 0:
            ends[host[0] + h] = ("host", host[0])
        host[0] += h

    def visit(after, dur, h):
        """A compute visit whose ops the host issues over h seconds: the GPU starts on the first and cannot finish
        before the last has been issued (then the host is what it waits for). On the CPU the one thread issues
        and computes, one after the other."""
        if not overlap:
            return run("compute", after, dur + h)
        h0 = host[0]
        end = run("compute", after, dur)
        issue(h)
        if host[0] > end:                        # host-bound: the GPU idles between the ops as they come
            free["compute"] = end = host[0]
            ends[end] = ("host", h0)
        return end

    def cost(what, u):
        return numel["layer" if isinstance(u, int) else u] * rate[what]

    def load(u, after):                          # H2D (of the shard; then its all_gather into the slot)
        if u in resident:                        # a D2D cast, after its update on the same lane
            return run("h2d", after, cost("load_res", u))
        block(upd.get(u, 0.0))
        x = run("h2d", after, cost("load", u))
        return run("comm", x, cost("all_gather", u)) if sharded else x

    emb, first = ("head" if tied else "embed"), "norm" if defer_updates else "adam"  # the worker's job per landing
    first_res = "gpu_norm" if defer_updates else "gpu_adam"
    upd, starts = {}, []                         # unit -> when its latest update finished
    for _ in range(steps):
        slot_free, gslot_free, loaded, sent = [0.0, 0.0], [0.0, 0.0], {}, {}
        slab_back = []                           # when each gradient slab taken this step is given back
        # forward: layer i in slot i % 2; the next unit is prefetched into the other slot
        issue(t.get("host_step", 0.0))            # the step's input: targets, checks
        loaded[0] = load(0, 0.0)
        if emb in resident:                      # rows gathered on the GPU, after the table's update (h2d)
            x = run("compute", free["h2d"], t["rows_res"])
        else:
            block(upd.get(emb, 0.0))
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
        if guard:                                # the non-finite guard: the host reads the loss first
            block(loss)

        def drain(unit, k, after):               # grad visit k: a slab (unless deferred), D2H, then the worker
            if unit in resident:                 # D2D into its store, then its update (or norm) on h2d
                done = gslot_free[k % 2] = run("d2h", after, cost("grad_res", unit))
                if unit != emb:
                    upd[unit] = run("h2d", done, cost(first_res, unit))
                return done
            if not defer_updates and len(slab_back) >= slabs - tied:
                block(slab_back[len(slab_back) - (slabs - tied)])
            if sharded:                          # the reduce_scatter frees the grad slot; D2H of the shard
                after = gslot_free[k % 2] = run("comm", after, cost("reduce_scatter", unit))
            done = run("d2h", after, cost("grad", unit))
            if not sharded:                      # the D2H frees the grad slot
                gslot_free[k % 2] = done
            if unit == emb:                      # tied: its update follows the embedding scatter
                return done
            upd[unit] = run("cpu_adam", done, cost(first, unit) + t.get("host_update", 0.0))
            slab_back.append(upd[unit])
            return done
        drain("head", 0, x)
        # backward: layer L-1 is still resident; recompute from the boundary activations, grads drain as they finish
        ready = run("h2d", sent[L - 1], t["ckpt_h2d"]) if offload else 0.0
        for k, i in enumerate(reversed(range(L)), start=1):
            if i > 0:
                loaded[i - 1] = load(i - 1, slot_free[(i - 1) % 2])
            nxt_ready = run("h2d", sent[i - 1], t["ckpt_h2d"]) if offload and i > 0 else 0.0
            x = slot_free[i % 2] = visit(max(loaded[i], ready, gslot_free[k % 2], x), t["bwd"], t.get("host_bwd", 0.0))
            drain(i, k, x)
            ready = nxt_ready
        # embedding: dy of layer 0 goes down, the worker scatters it into the rows used
        if emb in resident:                      # dy stays: scattered and the table updated on h2d
            upd[emb] = run("h2d", run("d2h", x, 0.0), t["scatter_res"] + cost(first_res, emb))
        else:
            if not defer_updates and not tied and len(slab_back) >= slabs:
                block(slab_back[len(slab_back) - slabs])
            dy = run("comm", x, t["dy_comm"]) if sharded else x     # dy of every rank, all_gathered
            upd[emb] = run("cpu_adam", run("cpu_adam", run("d2h", dy, t["dy"]), t["scatter"]),
                           cost(first, emb) + t.get("host_update", 0.0))
        block(loss)                              # the step's loss, read on the host
        if defer_updates:  # every norm known: updates in forward order, the next forward waits per unit
            block(max(upd.values()))
            for u in [emb] + list(range(L)) + ([] if tied else ["head"]):
                upd[u] = run("h2d", 0.0, cost("gpu_adam", u)) if u in resident else \
                    run("cpu_adam", 0.0, cost("adam", u) + t.get("host_update", 0.0))
    now = starts[-1]
    while now > starts[-2] and now in ends:      # each task ends where it starts, or earlier: bounded
        lane, start = ends[now]
        if start >= now:                         # a duration lost to float rounding at huge times: no progress
            break
        critical[lane] += now - max(start, starts[-2])
        now = start
    return starts[-1] - starts[-2], busy, critical


def plan_json(p):
    """One JSON object: params, host_bytes, gpu_bytes, fits, step_time_s, tokens_per_s, model_tflops,
    bottleneck, mode -- and every other field of the plan (components in bytes, times in seconds), and "fix":
    the nearest setting that fits (train.py flags) when it does not."""
    return json.dumps(cli.finite_json({**p, "fix": None if p["fits"] else suggest(p)})[0], allow_nan=False)


def tiling(p):
    """How the plan runs a layer, in words: 'untiled' or 'in tiles of 8,192 tokens'."""
    return f"in tiles of {p['tile_tokens']:,} tokens" if p["tile_tokens"] else "untiled"


def count(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def size(b):
    return f"{b / 1e12:.2f} TB" if b >= 1e12 else f"{b / GB:.{0 if b >= 10 * GB else 1}f} GB" if b >= GB \
        else f"{b / 1e6:.0f} MB"


def format_plan(p):
    """The plan as a table a person reads: memory by component, per-visit times, prediction, verdicts."""
    hw, N, m, t, cuda = p["hardware"], p["params"], p["model"], p["visit_s"], p["hardware"]["gpu_mem_gb"] > 0
    verdict = lambda ok: "fits" if ok else "DOES NOT FIT"  # noqa: E731
    pct = lambda d: ", ".join(f"{k} {v:.0%}" for k, v in d.items())  # noqa: E731
    rows = [f"{p['config']}: {count(N)} params (L={m['n_layer']} d={m['d_model']} heads={m['n_head']}/{m['n_kv_head']}"
            f" ff={m['d_ff']} V={m['vocab_size']}) on {hw['name']} ({hw['gpu']})",
            f"--mode {p['mode']}, {p['dtype']} compute, {p['batch_size']} x {p['seq_len']} = {p['tokens_per_step']:,}"
            f" tokens/step in {p['micro_batches']} micro-batch(es), grad clip {p['grad_clip'] or 'off'},"
            f" {p['residual_dtype']} residual,"
            f" boundary activations {'offloaded' if p['offload_activations'] else 'on the device'},"
            f" layer {tiling(p)}"]
    if p["world"] > 1:
        rows.append(f"sharded (megatrain_min/sharded.py): {p['nodes']} node(s) x {p['gpus']} GPUs = {p['world']} ranks, "
                    f"each {p['batch_size'] // p['world']} sequences and 1/{p['world']} of the host store; collectives "
                    f"over {'NVLink' if p['nodes'] == 1 else 'InfiniBand'} at "
                    f"{hw['nvlink_gbs'] if p['nodes'] == 1 else min(hw['nvlink_gbs'], hw['ib_gbs']):g} GB/s")
    per = (" per node", " per GPU") if p["world"] > 1 else ("", "")
    rows += ["", f"{'host memory' + per[0]:<50}{'GB':>10}{'B/param':>10}"]
    rows += [f"  {k:<48}{v / GB:10.2f}{v / N:10.2f}" for k, v in p["host"].items()]
    rows += [f"  {'total':<48}{p['host_bytes'] / GB:10.2f}{p['host_bytes'] / N:10.2f}   {verdict(p['fits_host'])}"
             f" in {size(p['host_limit_bytes'])} ({HOST_USABLE:.0%} of {size(hw['host_mem_gb'] * GB)})"]
    if cuda:
        rows += [f"  {'of it page-locked (what the copies read, write)':<48}{p['pinned_bytes'] / GB:10.2f}"]
    rows += ["",
             f"{'GPU memory' + per[1] if cuda else 'device buffers (CPU run: in host memory)':<50}{'GB':>10}"]
    rows += [f"  {k:<48}{v / GB:10.2f}" for k, v in p["gpu"].items() if v]
    rows += [f"  {'total':<48}{p['gpu_bytes'] / GB:10.2f}" +
             (f"   {verdict(p['fits_gpu'])} in {size(hw['gpu_mem_gb'] * GB)}" if cuda else ""), "",
             resident_line(p), "",
             f"{'time per layer visit':<50}{'ms':>10}"]
    rows += [f"  {k:<48}{v * 1e3:10.1f}" for k, v in (
        ("H2D weights", t["load"]), ("forward: 2NT + attention", t["fwd"]),
        ("recompute + backward: 2NT + 4NT + attention", t["bwd"]), ("D2H fp32 gradient", t["grad"]),
        ("CPU AdamW" + (" + grad-norm pass" if p["defer_updates"] else ""), t["adam"] + t["norm"] * p["defer_updates"]),
        ("head: loss forward + backward, 6 V d T", t["head"]))]
    if p["world"] > 1:
        rows += [f"  {k:<48}{v * 1e3:10.1f}" for k, v in (("all_gather of the weights (comm lane)", t["all_gather"]),
                                                         ("reduce_scatter of the fp32 gradient", t["reduce_scatter"]))]
    rows += ["", f"predicted: {p['step_time_s']:.3g} s/step, {p['tokens_per_s']:,.0f} tokens/s, "
                 f"{p['model_tflops']:.3g} model TFLOP/s = {p['mfu']:.0%} of the "
                 f"{(str(p['world']) + ' x ') if p['world'] > 1 else ''}{hw[p['dtype'] + '_tflops']:g} peak "
                 f"(6 N T per step: no recompute, no attention)",
             f"bottleneck: {p['bottleneck']} (share of the critical path: " + pct(p["critical_path"]) +
             "; busy: " + pct(p["utilization"]) + ")",
             f"transfers and AdamW hide behind compute from ~{p['min_tokens_per_step']:,.0f} tokens/step (" +
             ", ".join(f"{k} {v:,.0f}" for k, v in p["min_tokens"].items()) + ")",
             f"verdict on {hw['name']}: host RAM {verdict(p['fits_host'])}, GPU memory " +
             (verdict(p["fits_gpu"]) if cuda else "n/a (CPU)") + f" -> {'FITS' if p['fits'] else 'does not fit'}"]
    if not p["fits"]:
        fix = suggest(p)
        rows.append(f"nearest setting that fits: {fix}" if fix else "nothing nearby fits: see the breakdown above")
    return "\n".join(rows)


def resident_line(p):
    """What the plan keeps on the GPU, and why (--resident-units)."""
    k, n = p["resident_units"], len(model.units(model.GPTConfig(**p["model"])))
    why = "as asked (--resident-units)" if p["resident_asked"] is not None else \
        "as many as fit beside the step" if p["hardware"]["gpu_mem_gb"] > 0 and p["world"] == 1 else \
        "none: " + ("each rank holds 1/N of every unit" if p["world"] > 1 else "a CPU run")
    return (f"resident on the GPU: {k} of {n} units ({why}; the embedding and layer 0 first): updated there, the "
            f"host updates the other {n - k}" if k else f"resident on the GPU: none ({why}): every unit streams")


def describe_run(p, world=1, gpus=1):
    """The one line train.py prints of the plan of the run it is about to make (world ranks, gpus per node)."""
    many = world > 1
    return (f"plan{f' for {world} ranks ({gpus} per node)' if many else ''}: host {p['host_bytes'] / GB:.2f} GB"
            f"{' per node' if many else ''} ({p['host_bytes_per_param']:.1f} B/param in the store, "
            f"{p['pinned_bytes'] / GB:.2f} GB page-locked), device "
            f"{p['gpu_bytes'] / GB:.2f} GB{' per GPU' if many else ''}, boundary activations "
            f"{'offloaded' if p['offload_activations'] else 'on the device'}, layer {tiling(p)}, "
            f"{p['resident_units']} units resident on the GPU; predicted "
            f"{p['tokens_per_s']:,.0f} tokens/s, bound by {p['bottleneck']} (--plan for the breakdown)")


def describe_max_context(p, longest, max_seq_len):
    """The line of train.py --plan --max-context: the longest --seq-len (plan p is the plan at it)."""
    return (f"longest context that fits: --seq-len {longest} ({longest:,} tokens) at --batch-size "
            f"{p['batch_size']} on {p['hardware']['name']}, layer {tiling(p)}; GPU {p['gpu_bytes'] / GB:.1f} of "
            f"{p['gpu_limit_bytes'] / GB:.0f} GB, host {p['host_bytes'] / GB:.0f} of "
            f"{p['host_limit_bytes'] / GB:.0f} GB usable" +
            (f"; training at it needs --max-seq-len {longest}" if longest > max_seq_len else ""))


def replan(p, **change):
    """Plan p again with some of its arguments changed (change: planner.plan's arguments, or cfg=GPTConfig)."""
    kw = dict(hardware=p["hardware"], batch_size=p["batch_size"], seq_len=p["seq_len"],
              micro_batches=p["micro_batches"], mode=p["mode"], dtype=p["dtype"], grad_clip=p["grad_clip"],
              offload_activations=p["offload_asked"], name=p["config"],
              residual_dtype=p["residual_dtype"], grad_slabs=p["grad_slabs_asked"],
              skip_nonfinite=p["skip_nonfinite"], chunk_tokens=p["chunk_tokens"], host_speed=p["host_speed"],
              tile_tokens=p["tile_asked"], gpus=p["gpus"], nodes=p["nodes"], resident_units=p["resident_asked"])
    cfg = change.pop("cfg", None) or model.GPTConfig(**p["model"])
    kw.update(change)
    # train.py's --max-seq-len applies to whichever preset: plan at the asked length (the maths has no limit)
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, kw["seq_len"]))
    return plan(cfg, **kw)


def max_context(p, step=1024, limit=1 << 25):
    """The longest sequence, a multiple of `step` tokens up to `limit`, with which plan p's settings fit (its
    hardware, batch size, micro-batches, modes; the tile the planner's choice unless p asked for one).
    Returns (tokens, that plan), or (0, None) when not even `step` tokens fit. Memory grows with T: a doubling
    search, then bisection."""
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


def suggest(p):
    """The nearest setting that fits, as train.py flags, or None. Tried in order: the memory modes, activation
    offload, a smaller loss chunk, a (smaller) sequence tile, more micro-batches (smaller recompute activations), a
    smaller batch, a bf16 residual (it
    trades accuracy for memory, so it comes last), then smaller presets.
    (Fewer micro-batches never helps: the slots and boundary activations do not depend on them.)"""
    tries = []
    if p["dtype"] == "bf16":  # lean saves 2 B/param of host RAM, fast saves the GPU's fp32 cast buffer
        tries.append(("--mode lean", dict(mode="lean")) if p["mode"] == "fast" else ("--mode fast", dict(mode="fast")))
    if p["defer_updates"]:
        tries += [("--grad-clip 0", dict(grad_clip=0.0)),
                  ("--mode lean --grad-clip 0", dict(mode="lean", grad_clip=0.0))]
    tries.append(("--offload-activations off" if p["offload_activations"] else "--offload-activations on",
                  dict(offload_activations=not p["offload_activations"])))
    small_chunk = model.LOSS_CHUNK_LOGITS // p["model"]["vocab_size"]  # 256 MB of fp32 logits, without the floor
    if small_chunk < (p["chunk_tokens"] or model.default_chunk_tokens(model.GPTConfig(**p["model"]))):
        tries.append((f"--chunk-tokens {small_chunk}", dict(chunk_tokens=small_chunk)))
    tries += [(f"--tile-tokens {n}", dict(tile_tokens=n)) for n in (TILE_TOKENS, 2048)
              if n < p["seq_len"] and (not p["tile_tokens"] or n < p["tile_tokens"])]
    B, M, N = p["batch_size"], p["micro_batches"], p["world"]      # N GPUs share the batch: B/N each
    # the next divisors of B/N above M: the near ones and M's doublings (a bounded search, whatever B is)
    near = {*range(M + 1, min(B // N, M + 64) + 1), *(M << k for k in range(1, 64) if M << k <= B // N)}
    tries += [(f"--micro-batches {m}", dict(micro_batches=m)) for m in sorted(near) if B // N % m == 0][:4]
    tries += [(f"--batch-size {b} --micro-batches {min(M, b // N)}", dict(batch_size=b, micro_batches=min(M, b // N)))
              for b in (B // 2, B // 4, B // 8, N) if N <= b < B and b % N == 0 and b // N % min(M, b // N) == 0]
    if p["dtype"] == "bf16" and p["residual_dtype"] == "fp32":  # last: it trades accuracy for memory
        tries.append(("--residual-dtype bf16", dict(residual_dtype="bf16")))
    for flags, change in tries:
        if replan(p, **change)["fits"]:
            return flags
    smaller = sorted((c for c in model.PRESETS.items() if model.n_params(c[1]) < p["params"]),
                     key=lambda c: -model.n_params(c[1]))
    for name, c in smaller:
        if replan(p, cfg=c, name=name)["fits"]:
            return f"--config {name}" + (f" --max-seq-len {p['seq_len']}" if p["seq_len"] > c.max_seq_len else "")
    return None


def check(p):
    """None when the plan fits; else raise PlanError with one line: what is short, by how much, what to try."""
    if p["fits"]:
        return
    hw, cfg = p["hardware"], f"--config {p['config']}" if p["config"] in model.PRESETS else "this config"
    where = "this machine has" if hw["name"] == "local" else f"--hardware {hw['name']} has"
    if not p["fits_host"]:
        what = " + ".join(["fp32 master + Adam m, v"] + ["bf16 shadow"] * ("bf16 shadow (streamed)" in p["host"])
                          + ["fp32 grads"] * p["defer_updates"] + ["boundary activations"] * p["offload_activations"]
                          + ["the step's activations (device buffers, on the CPU)"] * ("device buffers (below)" in p["host"]))
        mode = f" in --mode {p['mode']}" if p["dtype"] == "bf16" else ""
        msg = (f"{cfg} needs ~{size(p['host_bytes'])} of host RAM ({p['host_bytes'] / p['params']:.1f} B/param: "
               f"{what}){mode}; {where} {size(hw['host_mem_gb'] * GB)}")
    else:
        msg = (f"{cfg} needs ~{size(p['gpu_bytes'])} of GPU memory at {p['batch_size']} x {p['seq_len']} "
               f"tokens in {p['micro_batches']} micro-batch(es); {where} {size(hw['gpu_mem_gb'] * GB)}")
    longest = max_context(p)[0] if p["seq_len"] > 1024 else 0
    if 0 < longest < p["seq_len"]:  # a long context: say how long one can be with these settings
        msg += f"; the longest context that fits at --batch-size {p['batch_size']} is --seq-len {longest}"
    fix = suggest(p) or (f"--seq-len {longest}" if 0 < longest < p["seq_len"] else None)
    raise PlanError(msg + (f". Try {fix}, or --plan for the breakdown." if fix else
                           ". Nothing smaller fits either; see --plan for the breakdown."))


def from_flags(a, cfg, hardware=None, guarded=True, real=False, **change):
    """plan() for the command-line flags of megatrain_min/cli.py (hardware: --hardware unless given; guarded:
    train.py's non-finite guard; change: arguments of plan() that replace the flags'). real: the plan of a run
    about to train here, whose --host-mem may lower this machine's memory, never raise it."""
    if real and a.host_mem is not None and a.host_mem * GB > host_available_bytes():
        raise PlanError(f"--host-mem {a.host_mem:g} GB is more than this machine has available "
                        f"({host_available_bytes() / GB:.0f} GB); a run is checked against the memory it has: "
                        f"drop --host-mem, or plan for another machine with --plan")
    kw = dict(batch_size=a.batch_size, seq_len=a.seq_len, micro_batches=a.micro_batches, mode=a.mode,
              dtype=a.dtype, grad_clip=a.grad_clip, offload_activations=cli.OFFLOAD[a.offload_activations],
              residual_dtype=a.residual_dtype, chunk_tokens=a.chunk_tokens or None, host_mem_gb=a.host_mem,
              host_bw_gbs=a.host_bw, tile_tokens=a.tile_tokens, skip_nonfinite=guarded, gpus=a.gpus,
              nodes=a.nodes, resident_units=getattr(a, "resident_units", None))
    return plan(cfg, hardware or a.hardware, **{**kw, **change})


def objects(offload=False, guarded=False, tile_tokens=0):
    """What the engine is handed: the boundary activations' store (offload: activations.HostRing, else on the
    device), a guard.Guard, the layer (tiling.Tiled or the model itself)."""
    store = activations.HostRing() if offload else None
    return dict(activations=store, guard=Guard() if guarded else None,
                layer=Tiled(tile_tokens) if tile_tokens else model)


def engine_kw(p):
    """stream.Trainer's arguments for plan p: dtypes, mode, micro-batches, clipping, the loss chunk, the slabs,
    and the objects it is handed (objects()). The optimizer's hyper-parameters come from elsewhere (train.py)."""
    return dict(dtype=DTYPES[p["dtype"]], residual_dtype=DTYPES[p["residual_dtype"]], mode=p["mode"],
                micro_batches=p["micro_batches"], grad_clip=p["grad_clip"], chunk_tokens=p["chunk_tokens"],
                grad_slabs=p["grad_slabs"] or stream.GRAD_SLABS, resident_units=p["resident_units"],
                **objects(p["offload_activations"], p["skip_nonfinite"], p["tile_tokens"]))


def main(argv=None):
    ap = argparse.ArgumentParser(description="Memory and throughput plan; nothing is allocated.")
    cli.add_model(ap)
    cli.add_step(ap)
    cli.add_hardware(ap)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = ap.parse_args(argv)
    cli.survive_closed_pipe()
    try:
        cli.check(a)
        if a.config not in model.PRESETS:
            raise ValueError(f"unknown preset --config {a.config!r}; choose one of: {', '.join(model.PRESETS)}")
        cfg = cli.config_of(a)
        cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, a.seq_len))   # planning: any length
        for hw_name in (list(HARDWARE) if a.hardware == "all" else [a.hardware]):
            p = from_flags(a, cfg, hw_name, name=a.config)
            if a.json:
                print(plan_json(p))
            elif a.hardware == "all":
                print(f"{hw_name:>8}: {'fits' if p['fits'] else 'no  '}  host {size(p['host_bytes'])} of "
                      f"{size(p['host_limit_bytes'])}, GPU {size(p['gpu_bytes'])} of {size(p['gpu_limit_bytes'])},"
                      f" {p['tokens_per_s']:,.0f} tokens/s, {p['model_tflops']:.0f} TFLOP/s, "
                      f"{p['bottleneck']}-bound")
            else:
                print(format_plan(p))
                try:
                    check(p)
                except PlanError as e:   # the plan says why; a verdict, not a usage error
                    print(f"error: {e}")
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
