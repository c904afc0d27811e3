"""hardware.py -- what the planner plans for: a GPU and its host, as the numbers the plan reads.

What it is
    HARDWARE: a profile per GPU (peak TFLOP/s and the share of it a layer reaches, HBM, the links
    each way, the host's memory and AdamW bandwidth, NVLink and InfiniBand for N GPUs).
    local(device): this machine, detected now. resolve(...): a profile by name ("local" or a key of
    HARDWARE), or a dict like one, with --host-mem and --host-bw applied. The host's issue cost of
    an op (HOST_OP_S) and the GPU's AdamW efficiency (GPU_ADAM_FRAC): the rates the schedule and the
    twin share. And useful work against the peak: flops_per_token, model_tflops, peak_tflops (MFU).
What it is not
    Not a profiler: the rates are measured (the H200 row) or measured-class assumptions, said per
    row.
Try it
    python -m megatrain_min.plan --config 70b --hardware all --batch-size 8 --seq-len 4096
"""
import os

import torch

import model
import optim

GB = 1e9  # decimal: "1536 GB" is 1.536e12 bytes (slightly conservative against GiB-sized DIMMs)

# Peaks: dense (no sparsity) TFLOP/s from NVIDIA's datasheets. frac: the share of peak a whole layer
# reaches (matmuls + attention + norms). h2d/d2h: what cudaMemcpyAsync from pinned memory on a copy
# engine measures, not the link's spec. host_mem: a typical host for one such GPU; host_bw: the DRAM
# bandwidth a multi-threaded fused CPU AdamW sees (28 B/param). The H200 row is measured
# (bench/results/2026-11-27-nvidia-h200, 16 host cores, torch 2.11): frac 0.56 is its 7B-width
# layer's forward (15.5 ms), recompute + backward (48 ms) and head (31 ms) at 16,384 tokens; the
# links 55.2 /
# 55.3 GB/s; AdamW 101 GB/s (55 ms per 202M params, with the copies running); the host's last level
# 300 MB. The H100 and GH200 share its compute die: frac 0.56 too.
HARDWARE = {
    # H100 SXM5: 80 GB HBM3 3.35 TB/s, 989 bf16 / 67 fp32 TFLOP/s. PCIe Gen5 x16 (64 GB/s spec) ~55
    # each way. Host: 2-socket Xeon, 16 x DDR5-4800 (614 GB/s spec), ~200 for AdamW over
    # NUMA-unaware pinned pages. 8 per node on NVLink 4 (450 GB/s per direction spec; NCCL
    # all_gather / reduce_scatter bus bandwidth ~360), one 400 Gb/s InfiniBand NDR NIC per GPU
    # between nodes (50 GB/s spec, ~45).
    "h100": dict(gpu="NVIDIA H100 80GB", gpu_mem_gb=80, bf16_tflops=989, fp32_tflops=67, frac=0.56,
                 hbm_gbs=3350, h2d_gbs=55, d2h_gbs=55, host_mem_gb=1024, host_bw_gbs=200,
                 nvlink_gbs=360, ib_gbs=45),
    # H200 SXM: 141 GB HBM3e 4.8 TB/s, same compute as H100, PCIe Gen5; measured (above). Host
    # memory as MegaTrain's: 1.5 TB (the measured VM had 128 GB: --host-mem 128), its measured 16
    # cores' AdamW.
    "h200": dict(gpu="NVIDIA H200 141GB", gpu_mem_gb=141, bf16_tflops=989, fp32_tflops=67,
                 frac=0.56,
                 hbm_gbs=4800, h2d_gbs=55.2, d2h_gbs=55.3, host_mem_gb=1536, host_bw_gbs=101,
                 nvlink_gbs=360, ib_gbs=45),
    # GH200: 96 GB HBM3 4 TB/s, H100 compute; NVLink-C2C 900 GB/s spec, ~340 H2D / ~295 D2H
    # measured. Host: Grace's 480 GB LPDDR5X (512 GB/s spec, ~400 achievable). One superchip per
    # node: InfiniBand NDR (~45).
    "gh200": dict(gpu="NVIDIA GH200 96GB", gpu_mem_gb=96, bf16_tflops=989, fp32_tflops=67,
                  frac=0.56,
                  hbm_gbs=4000, h2d_gbs=340, d2h_gbs=295, host_mem_gb=480, host_bw_gbs=400,
                  nvlink_gbs=360, ib_gbs=45),
    # A100 SXM4 80 GB: 2.0 TB/s, 312 bf16 / 19.5 fp32 TFLOP/s. PCIe Gen4 x16 (32 GB/s spec) ~25.
    # Host: 2-socket EPYC, 16 x DDR4-3200 (410 GB/s spec). NVLink 3 (300 GB/s per direction, NCCL
    # ~230), HDR IB (~22).
    "a100": dict(gpu="NVIDIA A100 80GB", gpu_mem_gb=80, bf16_tflops=312, fp32_tflops=19.5, frac=0.6,
                 hbm_gbs=2039, h2d_gbs=25, d2h_gbs=25, host_mem_gb=512, host_bw_gbs=150,
                 nvlink_gbs=230, ib_gbs=22),
    # RTX 4090: 24 GB GDDR6X 1.0 TB/s, 165 bf16 (fp32 accumulate) / 82.6 fp32 TFLOP/s, PCIe Gen4
    # ~25. Host: a desktop, 2 channels of DDR5 (~90 GB/s spec). No NVLink: collectives cross PCIe
    # through the host (~12); 100 Gb/s Ethernet between nodes (~10).
    "rtx4090": dict(gpu="NVIDIA GeForce RTX 4090", gpu_mem_gb=24, bf16_tflops=165, fp32_tflops=82.6,
                    frac=0.6, hbm_gbs=1008, h2d_gbs=25, d2h_gbs=25, host_mem_gb=128, host_bw_gbs=60,
                    nvlink_gbs=12, ib_gbs=10),
}
# The host issues every op -- Python, the dispatcher, autograd's engine: HOST_OP_S each, whether
# issued from Python or run by autograd. Fitted on the CPU backend (bench/host_overhead.py
# --calibrate: a 2-core CPU, one OpenMP thread, the real engine with negligible tensors at 5 depths
# x micro-batch counts), so it leaves out what CUDA eager ops add (cudaLaunchKernel, autograd's
# device thread): bench/gpu_run.sh refits it on a GPU (host_op.json). plan(host_speed=) and the
# twin's --host-speed scale it for a faster host.
HOST_OP_S = 10.5e-6
# A resident unit's AdamW is torch's fused CUDA kernel, at GPU_ADAM_FRAC of the HBM bandwidth (28
# B/param): measured 2.70 TB/s of the H200's 4.8 (bench/gpu.py's pinned case: cuda_adamw_gbs).
GPU_ADAM_FRAC = 0.56
# matched in a GPU's name: gh200 before h200
PROFILED = ("gh200", "h200", "h100", "a100", "rtx4090")


def host_available_bytes():
    """Host RAM a run can have now: MemAvailable (or all of it without /proc), capped by a cgroup
    limit."""
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


def local(device=None):
    """This machine, detected now, for a run on `device` (None: optim.resolve_device's choice). A
    GPU: its free memory, speeds from the matching profile (unknown GPUs get modest guesses). The
    CPU: it computes and copies are memcpys; GPU memory 0. Nothing touches a GPU other than
    `device`'s."""
    dev = optim.resolve_device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        key = next((k for k in PROFILED if k.removeprefix("rtx") in name.lower()), None)
        hw = dict(HARDWARE[key]) if key else dict(
            bf16_tflops=100, fp32_tflops=20, frac=0.5, hbm_gbs=1000, h2d_gbs=25, d2h_gbs=25,
            host_bw_gbs=50, nvlink_gbs=12, ib_gbs=10)
        hw.update(gpu=name, gpu_mem_gb=torch.cuda.mem_get_info(dev)[0] / GB,
                  profiled=key is not None)
    else:  # ~0.1 TFLOP/s per core in fp32 (AVX2/AVX-512 FMA), bf16 matmuls much slower on most CPUs
        cores, bw = os.cpu_count() or 1, 20
        hw = dict(gpu="cpu", gpu_mem_gb=0, bf16_tflops=0.02 * cores, fp32_tflops=0.1 * cores,
                  frac=0.5, hbm_gbs=bw, h2d_gbs=bw / 2, d2h_gbs=bw / 2, host_bw_gbs=bw,
                  nvlink_gbs=bw / 4, ib_gbs=1, profiled=False)
    return dict(hw, name="local", host_mem_gb=host_available_bytes() / GB)


def resolve(hardware, host_mem_gb=None, host_bw_gbs=None, device=None):
    """The profile planned for: "local" (local(device)), a key of HARDWARE, or a dict like its rows;
    host_mem_gb, host_bw_gbs (not None) replace the profile's. ValueError naming what is wrong."""
    if isinstance(hardware, dict):
        hw = dict(hardware)
    elif hardware == "local":
        hw = local(device)
    elif hardware in HARDWARE:
        hw = dict(HARDWARE[hardware], name=hardware)
    else:
        raise ValueError(f"unknown --hardware {hardware!r}; choose one of: local, "
                         f"{', '.join(HARDWARE)}")
    for k, v in (("host_mem_gb", host_mem_gb), ("host_bw_gbs", host_bw_gbs)):
        if v is not None:
            if v <= 0:
                raise ValueError(f"{k} must be positive, got {v}")
            hw[k] = v
    return hw


# ---- useful work against the peak
def flops_per_token(cfg):
    """Model FLOPs per trained token: 6 x the parameters that multiply (every matrix except the
    embedding table, which is a gather). No attention scores, no recompute: those are not useful
    work."""
    return 6 * sum(u.n_decay for u in model.units(cfg) if u.name != "embed")


def model_tflops(cfg, tokens, seconds):
    """Model TFLOP/s of `tokens` trained in `seconds`: flops_per_token (6 N) per token, as nanoGPT
    and PaLM count."""
    return flops_per_token(cfg) * tokens / seconds / 1e12


def peak_tflops(hw, dtype):
    """The dense peak TFLOP/s of one GPU of hardware `hw` in dtype ("bf16", "fp32"), or None when it
    is a guess (a CPU, a GPU without a profile in HARDWARE): MFU against a guess would be a made-up
    number."""
    return hw[f"{dtype}_tflops"] if hw.get("profiled", True) else None
