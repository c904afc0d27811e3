"""train.py -- the script, top to bottom: flags -> config -> plan check -> data -> outputs -> weights -> engine
-> loop -> checkpoints -> sample.

What it is
    The one command people run. `python train.py` with no flags trains the ~1M-parameter toy preset on
    the shipped Shakespeare bytes on whatever device there is, in a few minutes on a 2-core laptop, and
    prints a sample. The same script plans and trains 7B-120B presets on one GPU with enough host RAM.
    Under torchrun it trains on N GPUs (or N CPU processes, gloo) and nodes: megatrain_min/sharded.py, each rank
    holding 1/N of the host store. The global batch of a step is the same whatever the world size; rank r computes
    its B/N sequences in --micro-batches micro-batches. Only rank 0 prints and writes config.json and metrics.jsonl;
    every rank writes its part of each checkpoint into --out, which every rank must see (one filesystem).
What it is not
    No tensor or pipeline parallelism, no config files: a preset from model.PRESETS plus flags.
Try it
    python train.py                                  # toy, CPU or GPU
    torchrun --standalone --nproc-per-node 2 train.py --batch-size 8 --micro-batches 2   # 2 ranks: same losses
    python train.py --engine reference               # the plain PyTorch oracle: same losses on CPU
    python train.py --config 70b --plan              # memory and speed plan, nothing allocated
Every run writes OUT/config.json (the resolved settings) and OUT/metrics.jsonl (one object per step).
Exit codes (README: Troubleshooting): 0 done or stopped by a signal after a save; 2 bad input, refused before
anything is trained, nothing lost; 3 training diverged (non-finite steps in a row, or non-finite weights that
are never saved); 4 an output could not be written (disk full, file too large, no permission), every earlier
checkpoint whole; 130 Ctrl-C before the first step or a second one while training: out at once, no save.
"""
import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import model
from megatrain_min import checkpoint, data, hf, sharded
from megatrain_min import plan as planner
from megatrain_min.reference import ReferenceTrainer
from optim import HyperParameterError, check_hyper, lr_at
from stream import Trainer, default_dtype


# torchrun sets these: rank RANK of WORLD_SIZE processes (megatrain_min/sharded.py), LOCAL_WORLD_SIZE of them on each
# node; a plain run is rank 0 of 1
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
GPUS = int(os.environ.get("LOCAL_WORLD_SIZE", WORLD))    # ranks (GPUs) per node
SHUTDOWN_S = 30   # torchrun's default wait between its SIGTERM to the ranks and SIGKILL (--shutdown-timeout)
if RANK:
    sys.stdout = open(os.devnull, "w")  # only rank 0 prints; errors: see fail
quiet = RANK > 0                        # until the outputs section, every rank finds the same errors: rank 0 says them


def fail(msg, code=2):
    """One line on stderr and an exit code: 2 = bad input, refused before training, nothing half-written."""
    if not quiet:
        print(f"error: {f'rank {RANK}: ' if RANK else ''}{msg}", file=sys.stderr)
    sys.exit(code)


# ----------------------------------------------------------------------------- flags
# Each help string names its default once: "%(default)s" where the value says it all, in words where it depends on
# something (the device, the preset, the planner).
p = argparse.ArgumentParser(description="Train a GPT whose weights and optimizer live in host memory.")
p.add_argument("--config", default=None, help=f"preset: {', '.join(model.PRESETS)} (default: toy)")
p.add_argument("--steps", type=int, default=400,
               help="total optimizer steps; a resumed run continues to this (default: %(default)s)")
p.add_argument("--batch-size", type=int, default=32, help="sequences per optimizer step (default: %(default)s)")
p.add_argument("--micro-batches", type=int, default=1,
               help="split each step (under torchrun: each rank's share of it) into this many micro-batches "
                    "(default: %(default)s)")
p.add_argument("--seq-len", type=int, default=128,
               help="tokens per sequence, <= the model's max_seq_len (default: %(default)s)")
p.add_argument("--max-seq-len", type=int, default=None,
               help="raise (or lower) the model's max_seq_len: longer sequences than the preset's (RoPE has no table; "
                    "default: the preset's)")
p.add_argument("--tile-tokens", type=int, default=None,
               help="run each layer's norms, projections and MLP this many tokens at a time (exact; 0 = untiled; "
                    "default: the planner's choice, untiled unless long sequences need it)")
p.add_argument("--lr", type=float, default=3e-3,
               help="peak learning rate: warmup, then cosine to lr/10 (default: %(default)s)")
p.add_argument("--warmup", type=int, default=30, help="linear warmup steps (default: %(default)s)")
p.add_argument("--weight-decay", type=float, default=0.1,
               help="AdamW decay on tensors with >= 2 dims (default: %(default)s)")
p.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip, 0 = off (default: %(default)s)")
p.add_argument("--seed", type=int, default=0, help="seed for init and batches (default: %(default)s)")
p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
p.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
               help="compute dtype (default: bf16 on cuda, fp32 on cpu)")
p.add_argument("--data", default=None,
               help="a .txt (bytes), a .npy token array, or an SFT .jsonl (default: data/tinyshakespeare.txt)")
p.add_argument("--out", default="out",
               help="output directory for metrics, config and checkpoints (default: %(default)s)")
p.add_argument("--engine", default="stream", choices=["stream", "reference"],
               help="layer streaming, or plain PyTorch (default: %(default)s)")
p.add_argument("--eval-every", type=int, default=100,
               help="evaluate val loss every N steps and at the end (default: %(default)s)")
p.add_argument("--eval-batches", type=int, default=8, help="val batches per evaluation (default: %(default)s)")
p.add_argument("--offload-checkpoints", default="auto", choices=["auto", "on", "off"],
               help="boundary checkpoints in host memory; auto: when they would not fit on the device "
                    "(default: %(default)s)")
p.add_argument("--mode", default="fast", choices=["fast", "lean"],
               help="fast: stream a bf16 shadow; lean: stream fp32, 12 B/param (default: %(default)s)")
p.add_argument("--residual-dtype", default="fp32", choices=["fp32", "bf16"],
               help="dtype of the residual stream (x, checkpoints, dy); bf16 halves those bytes at some accuracy "
                    "(default: %(default)s)")
p.add_argument("--chunk-tokens", type=int, default=0,
               help="tokens per loss chunk (default: 0 = model.default_chunk_tokens)")
for f in ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff"):
    p.add_argument("--" + f.replace("_", "-"), type=int, default=None, help=f"override the preset's {f}")
p.add_argument("--init-from", default=None,
               help="start from a Hugging Face model directory or one of our checkpoints (weights only)")
p.add_argument("--save-hf", default=None,
               help="at the end, write the weights as a Hugging Face checkpoint to this directory")
p.add_argument("--save-hf-dtype", default="bf16", choices=["bf16", "fp32"],
               help="tensor dtype of --save-hf (default: %(default)s)")
p.add_argument("--chat-format", default=None, choices=["native", "fixed"],
               help="how .jsonl conversations are rendered: native = the model directory's own chat_template (the "
                    "default when it has one), fixed = '<|role|>\\n' + content + eos per message")
p.add_argument("--plan", action="store_true",
               help="print the memory and throughput plan for --hardware and exit (nothing allocated)")
p.add_argument("--json", action="store_true", help="with --plan: print the plan as one JSON object")
p.add_argument("--max-context", action="store_true",
               help="with --plan: print the longest --seq-len that fits at --batch-size on --hardware")
p.add_argument("--hardware", default="local",
               help=f"plan for: local (this machine), {', '.join(planner.HARDWARE)} (default: %(default)s)")
p.add_argument("--host-mem", type=float, default=None, help="host RAM in GB for the plan (default: the hardware's)")
p.add_argument("--host-bw", type=float, default=None,
               help="host DRAM bandwidth in GB/s for the plan (default: the hardware's)")
p.add_argument("--save-every", type=int, default=0,
               help="save a checkpoint every N steps, 0 = only at the end (default: %(default)s)")
p.add_argument("--keep", type=int, default=2,
               help="keep the last K >= 1 checkpoints of this run (default: %(default)s)")
p.add_argument("--resume", nargs="?", const="latest", default=None,
               help="continue from the latest checkpoint in --out (or the given one)")
p.add_argument("--max-skips", type=int, default=10,
               help="stop after this many consecutive non-finite steps (default: %(default)s)")
p.add_argument("--profile", action="store_true",
               help="write OUT/trace.json (torch.profiler, open in Perfetto) for steps 2-4")
p.add_argument("--sample-tokens", type=int, default=300,
               help="length of the sample printed at the end, 0 = none (default: %(default)s)")
p.error = fail  # argparse's own complaints: one line and exit code 2 too
warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"  # one line each, like the errors
signal.signal(signal.SIGINT, lambda *_: fail("interrupted before the first step; nothing was trained", 130))
args = p.parse_args()

# ----------------------------------------------------------------------------- flags that cannot be right
for flag, v in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--seq-len", args.seq_len),
                ("--eval-batches", args.eval_batches), ("--eval-every", args.eval_every), ("--keep", args.keep),
                ("--max-skips", args.max_skips)):
    if v <= 0:
        fail(f"{flag} must be positive, got {v}")
for flag, v in (("--warmup", args.warmup), ("--save-every", args.save_every), ("--sample-tokens", args.sample_tokens),
                ("--seed", args.seed)):
    if v < 0:
        fail(f"{flag} must be >= 0, got {v}")
for flag, v in (("--host-mem", args.host_mem), ("--host-bw", args.host_bw)):
    if v is not None and not (math.isfinite(v) and v > 0):
        fail(f"{flag} must be a finite number > 0, got {v}")
try:  # the one home of what a hyper-parameter may be (the engines check the same)
    check_hyper(lr=args.lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip, micro_batches=args.micro_batches)
except HyperParameterError as e:
    fail(f"--{e.name.replace('_', '-')}: {e}")
for flag, v in (("--out", args.out), ("--save-hf", args.save_hf), ("--init-from", args.init_from),
                ("--data", args.data)):
    if v == "":
        fail(f"{flag} is an empty path")
if args.hardware != "local" and not (args.plan or args.json):
    fail(f"--hardware {args.hardware} applies to --plan (a run is always checked against this machine); add --plan")
if args.init_from and args.config:
    fail(f"--config {args.config} and --init-from both give the model; drop --config (the shape comes from "
         f"{args.init_from})")

# ----------------------------------------------------------------------------- config
args.config = args.config or "toy"
if args.config not in model.PRESETS and not args.init_from:
    fail(f"unknown preset --config {args.config!r}; choose one of: {', '.join(model.PRESETS)}")
overrides = {f: getattr(args, f) for f in ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff")
             if getattr(args, f) is not None}
init_dir, init_weights, tokenizer = Path(args.init_from) if args.init_from else None, None, None
if init_dir is not None:  # the model comes from the directory: --config and shape flags do not apply
    if overrides:
        fail(f"--init-from takes the model shape from {init_dir}; drop --{next(iter(overrides)).replace('_', '-')}")
    try:
        if (init_dir / "meta.json").is_file():                                  # one of our checkpoints
            if args.engine != "stream":
                fail("--init-from a checkpoint needs --engine stream")
            init_cfg = model.GPTConfig(**checkpoint.read_meta(init_dir)["config"])
        else:                                                                   # a transformers directory
            init_cfg, init_weights = hf.load_hf(init_dir)
            tokenizer = data.HFTokenizer(init_dir) if (init_dir / "tokenizer.json").is_file() else None
    except (ValueError, TypeError) as e:  # HFError, CheckpointError, a config with fields GPTConfig lacks
        fail(f"--init-from {init_dir}: {e}" if isinstance(e, TypeError) else str(e))
if init_dir is not None:
    cfg, args.config = init_cfg, init_dir.name
else:
    preset = model.PRESETS[args.config]
    if "n_head" in overrides and "n_kv_head" not in overrides and preset.n_kv_head == preset.n_head:
        overrides["n_kv_head"] = overrides["n_head"]      # a multi-head preset stays multi-head
    cfg = dataclasses.replace(preset, head_dim=0, **overrides) if overrides else dataclasses.replace(preset)
if args.max_seq_len is not None:
    if args.max_seq_len <= 0:
        fail(f"--max-seq-len must be positive, got {args.max_seq_len}")
    cfg = dataclasses.replace(cfg, max_seq_len=args.max_seq_len)
try:
    cfg.check()
except ValueError as e:
    fail(str(e))
try:  # under torchrun: this rank's GPU, made current before anything touches CUDA (else a context on GPU 0)
    device = sharded.rank_device(args.device) if WORLD > 1 else model.check_device(args.device)
except ValueError as e:
    fail(f"--device: {e}")
dtype = planner.DTYPES[args.dtype] if args.dtype else default_dtype(device.type)
why = "asked for" if args.dtype else ("default on CUDA" if device.type == "cuda" else
                                      "default on CPU: bf16 matmuls are slow there")
plan_only = args.plan or args.json
if args.seq_len > cfg.max_seq_len and plan_only:  # planning is arithmetic: any length (training needs --max-seq-len)
    cfg = dataclasses.replace(cfg, max_seq_len=args.seq_len)
    if not args.json:
        print(f"note: --seq-len {args.seq_len} is above {args.config}'s max_seq_len; training at it needs "
              f"--max-seq-len {args.seq_len}")
if args.seq_len > cfg.max_seq_len:
    fail(f"--seq-len {args.seq_len} is above the {args.config} preset's max_seq_len {cfg.max_seq_len}; use --seq-len "
         f"{cfg.max_seq_len} or less, or allow it with --max-seq-len {args.seq_len}")
if args.tile_tokens is not None and args.tile_tokens < 0:
    fail(f"--tile-tokens must be >= 0 (0 = untiled), got {args.tile_tokens}")
try:
    model.check_seq_len(cfg, args.seq_len)   # a sliding window: only T <= window is computed exactly
except ValueError as e:
    fail(f"--seq-len {args.seq_len}: {e}")
if args.batch_size % args.micro_batches:
    fail(f"--batch-size {args.batch_size} is not divisible by --micro-batches {args.micro_batches}")
if WORLD > 1 and args.batch_size % (WORLD * args.micro_batches):
    fail(f"--batch-size {args.batch_size} is not divisible by {WORLD} ranks x --micro-batches {args.micro_batches} "
         f"(each rank computes --batch-size / {WORLD} sequences in --micro-batches micro-batches)")
if WORLD > 1 and (args.engine != "stream" or args.profile):
    fail(f"under torchrun ({WORLD} ranks) train.py runs --engine stream without --profile")
tokens_per_step = args.batch_size * args.seq_len
n_params = model.n_params(cfg)

# ----------------------------------------------------------------------------- plan: will it fit, how fast
offload = {"auto": None, "on": True, "off": False}[args.offload_checkpoints]


def make_plan(hardware):
    try:
        return planner.plan(cfg, hardware, batch_size=args.batch_size, seq_len=args.seq_len,
                            micro_batches=args.micro_batches, mode=args.mode,
                            dtype=args.dtype or (None if hardware != "local" else planner.DTYPE_NAMES[dtype]),
                            grad_clip=args.grad_clip, offload_checkpoints=offload, residual_dtype=args.residual_dtype,
                            chunk_tokens=args.chunk_tokens or None, host_mem_gb=args.host_mem,
                            host_bw_gbs=args.host_bw, name=args.config, tile_tokens=args.tile_tokens,
                            gpus=GPUS, nodes=WORLD // GPUS, device=device)   # torchrun: N GPUs, this rank's
    except ValueError as e:  # an unknown --hardware, say
        fail(str(e))


if plan_only:
    pl = make_plan(args.hardware)
    if args.max_context:  # the longest --seq-len with these settings, and its plan
        longest, pl = planner.max_context(pl)
        if not longest:
            fail(f"--max-context: not even {args.batch_size} x 1024 tokens fit {args.config} on --hardware "
                 f"{args.hardware}; --plan without --max-context shows why")
    print(planner.plan_json(pl) if args.json else planner.format_plan(pl))
    if args.max_context and not args.json:
        print(f"longest context that fits: --seq-len {longest} ({longest:,} tokens) at --batch-size {args.batch_size} "
              f"on {pl['hardware']['name']}, layer {planner.tiling(pl)}; GPU {pl['gpu_bytes'] / 1e9:.1f} of "
              f"{pl['gpu_limit_bytes'] / 1e9:.0f} GB, host {pl['host_bytes'] / 1e9:.0f} of "
              f"{pl['host_limit_bytes'] / 1e9:.0f} GB usable" +
              (f"; training at it needs --max-seq-len {longest}" if longest > cfg.max_seq_len else ""))
    sys.exit(0)
pl = make_plan("local")
if args.engine == "stream":  # refuse before anything is allocated
    try:
        planner.check(pl)
    except ValueError as e:
        fail(str(e))
    offload = pl["offload_checkpoints"]
print(f"config {args.config}: {n_params:,} params | {json.dumps(cfg.to_dict())}")
print(f"device {device} | compute dtype {str(dtype)[6:]} ({why}), {args.residual_dtype} residual stream | "
      f"engine {args.engine} | {tokens_per_step:,} tokens/step in {args.micro_batches} micro-batch(es)")
print(f"plan{f' for {WORLD} ranks ({GPUS} per node)' if WORLD > 1 else ''}: "
      f"host {pl['host_bytes'] / 1e9:.2f} GB{' per node' if WORLD > 1 else ''} "
      f"({pl['host_bytes_per_param']:.1f} B/param in the store), "
      f"device {pl['gpu_bytes'] / 1e9:.2f} GB{' per GPU' if WORLD > 1 else ''}, checkpoints {'offloaded' if offload else 'on the device'}, "
      f"layer {planner.tiling(pl)}; "
      f"predicted {pl['tokens_per_s']:,.0f} tokens/s, bound by {pl['bottleneck']} (--plan for the breakdown)")

# ----------------------------------------------------------------------------- data
data_path = Path(args.data or data.DEFAULT_DATA)
try:
    if init_weights is not None and tokenizer is None and data_path.suffix != ".npy":
        raise ValueError(f"{init_dir} has no tokenizer.json, and {data_path.name} needs the model's own tokenizer "
                         f"(bytes are token ids only for the byte-vocabulary presets); add it, or pass --data "
                         f"tokens.npy")
    if data_path.suffix == ".jsonl":  # SFT: loss only on assistant / completion tokens, one example per row
        tok = tokenizer or data.ByteTokenizer()
        where = init_dir if tokenizer is not None else "the byte tokenizer"
        chat_format = args.chat_format or ("native" if tok.chat_template else "fixed")
        if chat_format == "native" and not tok.chat_template:
            raise ValueError(f"--chat-format native: {where} has no chat_template; use --chat-format fixed")
        print(f"chat format: native (the chat_template of {where})" if chat_format == "native" else
              f"chat format: fixed ('<|role|>\\n' + content + {'eos' if tok.eos_id is not None else 'newline'} per "
              f"message; {'asked for' if args.chat_format else f'{where} has no chat_template'})")
        train_ex, val_ex = data.split_examples(data.load_sft_jsonl(data_path, tok, args.seq_len, chat_format))
        model.check_token_ids(np.concatenate([x for x, _ in train_ex + val_ex]), cfg.vocab_size, f"data {data_path}")
        train_batches = data.SFTBatches(train_ex, args.batch_size, args.seq_len, seed=args.seed)
        val_batches = data.SFTBatches(val_ex, args.batch_size, args.seq_len, seed=10_000 + args.seed, name="val")
        sizes = f"{len(train_ex):,} train / {len(val_ex):,} val examples"
    else:
        if tokenizer is not None and data_path.suffix != ".npy":  # text through the model's own tokenizer
            if not data_path.is_file():
                raise ValueError(f"data file {data_path} does not exist; pass --data with a .txt, .npy or .jsonl file")
            tokens = np.array(tokenizer.encode(data_path.read_text(encoding="utf-8", errors="replace")), dtype=np.int64)
        else:
            tokens = data.load_tokens(data_path)
        model.check_token_ids(tokens, cfg.vocab_size, f"data {data_path}")     # one pass each for min and max
        train_tok, val_tok = data.split(tokens)
        train_batches = data.Batches(train_tok, args.batch_size, args.seq_len, seed=args.seed)
        val_batches = data.Batches(val_tok, args.batch_size, args.seq_len, seed=10_000 + args.seed, name="val")
        sizes = f"{len(train_tok):,} train / {len(val_tok):,} val tokens"
except ValueError as e:
    fail(str(e))
print(f"data {data_path}: {sizes}")

# ----------------------------------------------------------------------------- outputs: checked before any allocation
# Nothing lost: a new run never writes into a directory that holds another run, --save-hf replaces only an earlier
# export of save_hf's, one run at a time holds --out (a lock), and every place this run writes to is checked first.
out = Path(args.out)
hf_dir = Path(args.save_hf) if args.save_hf else None
quiet = False  # from here a rank may find what the others do not (its disk, its device): every rank says so


def writable(path, flag):
    """The nearest existing directory at or above `path`; fail unless this process may create files there."""
    base = path
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        fail(f"{flag} {path}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        fail(f"{flag} {path}: {base} is not writable by this user")
    return base


def write_atomically(path, text):
    """Replace path by a file holding text: a new file, fsynced, renamed over it (a crash leaves old or new)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


out_base = writable(out, "--out")
run_id, start_step, val_loss, n_skips, resume_from = uuid.uuid4().hex[:12], 0, None, 0, None
SAME_RUN = ("batch_size", "seq_len", "micro_batches", "lr", "warmup", "weight_decay", "grad_clip", "seed", "data")
if args.resume:  # its meta.json now (cheap); its weights once the engine exists
    if args.engine != "stream":
        fail("--resume needs --engine stream (the reference engine keeps no host store to checkpoint)")
    resume_from = checkpoint.latest(out) if args.resume == "latest" else Path(args.resume)
    if resume_from is None:
        fail(f"--resume: no checkpoint in {out}; run without --resume to start, or pass --resume DIR")
    try:
        doc = checkpoint.read_meta(resume_from)
        checkpoint.check_model(resume_from, doc, cfg)
        ck = doc["meta"]
        changed = [k for k in SAME_RUN if ck["args"].get(k) != vars(args)[k]]
        if changed:
            was = ', '.join('--' + k.replace('_', '-') + ' ' + str(ck['args'][k]) for k in changed)
            fail(f"--resume: {resume_from.name} was made with other settings ({was}); "
                 f"pass the same flags to continue bit-exactly")
        run_id, start_step, val_loss, n_skips = ck.get("run"), doc["step"], ck["val_loss"], int(ck["skips"])
        train_batches.load_state_dict(ck["data"])
        checkpoint.set_rng_state(ck["rng"])
    except checkpoint.CheckpointError as e:
        fail(str(e))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:  # edited, CRC recomputed
        fail(f"--resume: {resume_from}/meta.json does not hold what train.py saves ({type(e).__name__}: {e})")
    if start_step >= args.steps:
        fail(f"--resume: {resume_from.name} is at step {start_step}, already >= --steps {args.steps}; raise --steps "
             f"to train on")
if hf_dir is not None:
    try:
        hf.check_export_dir(hf_dir)
    except hf.HFError as e:
        fail(f"--save-hf: {e}")
    if hf_dir.resolve() == out.resolve() or hf_dir.resolve() in out.resolve().parents:
        fail(f"--save-hf {hf_dir} holds --out {out}; an export replaces its whole directory: put it beside the run")
    if init_dir is not None and hf_dir.resolve() == init_dir.resolve():
        fail(f"--save-hf {hf_dir} is the --init-from directory; the export would replace the model this run starts "
             f"from")
    hf_base = writable(hf_dir.parent, "--save-hf")
need = {}  # free disk space per filesystem: one checkpoint (older ones go only after it is whole), the export
for base, n in ((out_base, 12 * n_params if args.engine == "stream" else 0),
                (hf_base if hf_dir else None, n_params * {"bf16": 2, "fp32": 4}[args.save_hf_dtype] if hf_dir else 0)):
    if n:
        dev_base, had = need.get(os.stat(base).st_dev, (base, 0))
        need[os.stat(base).st_dev] = (dev_base, had + n)
for base, n in need.values():
    if (free := shutil.disk_usage(base).free) < n:
        fail(f"{base} has {free / 1e9:.2f} GB free; this run writes {n / 1e9:.2f} GB there (a checkpoint is "
             f"12 B/param, --save-hf 2 or 4). Free some space, or write elsewhere")
try:  # under torchrun rank 0 holds the lock for the run (its ranks write their checkpoint parts there too)
    run_lock = checkpoint.lock(out) if RANK == 0 else None  # held until this process ends, dropped even on SIGKILL
    out.mkdir(parents=True, exist_ok=True)     # (rank 0 made it in lock(), maybe not yet)
    probe = out / f".probe-{os.getpid()}"      # the lock file may exist already: can we still create files?
    probe.touch()
    probe.unlink()
except checkpoint.LockError as e:
    fail(f"{e}; wait for it to finish, or pass another --out")
except OSError as e:
    fail(f"--out {out}: cannot write there ({e.strerror})")
held = [p for p in (out / "config.json", out / "metrics.jsonl") if p.is_file()] + \
    [p for _, p in checkpoint.checkpoints(out)] if RANK == 0 else []
for p in held:  # under the lock: nobody else writes here now
    try:
        owner = (json.loads(p.read_text()).get("run") if p.name == "config.json" else
                 checkpoint.read_meta(p)["meta"].get("run") if p.name.startswith("ckpt-") else run_id)
    except (OSError, ValueError, AttributeError):
        owner = "unknown"
    if not args.resume or owner != run_id:
        fail(f"--out {out} holds {'another' if args.resume else 'a'} run ({p.name}); continue it with --resume, or "
             f"pass a fresh --out (nothing here is overwritten)")

# ----------------------------------------------------------------------------- weights and engine
if WORLD > 1:  # join the other ranks: NCCL, each rank on its GPU (cuda:LOCAL_RANK), or gloo on CPUs
    device = sharded.init_from_env(args.device)
    print(f"torchrun: {WORLD} ranks, each holding 1/{WORLD} of the host store and computing "
          f"{args.batch_size // WORLD} of the {args.batch_size} sequences of a step; a checkpoint writes "
          f"{12 * n_params / (WORLD // GPUS) / 1e9:.1f} GB per node. A SIGTERM to torchrun stops the ranks with a "
          f"save, and torchrun SIGKILLs them {SHUTDOWN_S} s later unless launched with --shutdown-timeout SECONDS: "
          f"the first save says how long one takes")
weights = init_weights if init_weights is not None else model.LazyInit(cfg, seed=args.seed)  # read unit by unit
hyper = dict(lr=args.lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip, micro_batches=args.micro_batches)
try:  # a tensor of --init-from that is not finite, say: one line naming it
    if args.engine == "stream":
        engine = sharded.ShardedTrainer if WORLD > 1 else Trainer   # rank r of N: its shard of every unit
        trainer = engine(cfg, weights, device=device, dtype=dtype, mode=args.mode, offload_checkpoints=offload,
                         residual_dtype=planner.DTYPES[args.residual_dtype], chunk_tokens=args.chunk_tokens or None,
                         staging_slabs=pl["staging_slabs"], skip_nonfinite=True, tile_tokens=pl["tile_tokens"],
                         **hyper)
    else:
        trainer = ReferenceTrainer(cfg, weights, device=device, dtype=dtype, **hyper)
except (ValueError, TypeError) as e:
    fail(f"{init_dir or 'weights'}: {e}")
del weights  # the engine holds its own copy (the host store)
for path, fresh in ((init_dir, True), (resume_from, False)):
    if path is not None and (path / "meta.json").is_file():  # our checkpoint: its weights (resuming: its optimizer)
        try:
            checkpoint.load(trainer, path)
        except checkpoint.CheckpointError as e:
            fail(str(e))
        if fresh:
            trainer.reset_optimizer()  # --init-from: weights only, Adam starts fresh (--resume continues a run)
if init_dir is not None:
    print(f"initialised from {init_dir}")
if resume_from is not None:
    print(f"resumed from {resume_from} at step {start_step}")


def evaluate():
    """Mean val loss over --eval-batches fixed batches (the same ones at every evaluation)."""
    state = val_batches.state_dict()
    losses = []
    for _ in range(args.eval_batches):
        losses.append(trainer.evaluate(*val_batches.next()))
    val_batches.load_state_dict(state)
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------- the record: config.json, metrics.jsonl
metrics = None
try:
    if RANK == 0:                                         # under torchrun rank 0 keeps the record
        record = {"args": vars(args), "run": run_id, "model": cfg.to_dict(), "params": n_params,
                  "device": str(device), "dtype": str(dtype), "world_size": WORLD}
        write_atomically(out / "config.json", json.dumps(record, indent=2) + "\n")
        if args.resume and (out / "metrics.jsonl").exists():  # keep the records up to the checkpoint, drop the rest
            kept = []
            for line in (out / "metrics.jsonl").read_text(errors="replace").splitlines():
                try:
                    if json.loads(line)["step"] <= start_step:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):  # a line torn by a kill
                    pass
            write_atomically(out / "metrics.jsonl", "".join(kept))
        metrics = open(out / "metrics.jsonl", "a")            # one flushed line per step
except OSError as e:
    fail(f"could not write the run record in {out} ({e.strerror}: {e.filename})", 4)

stop = []  # SIGTERM / first Ctrl-C: finish the step, save, exit cleanly (a second Ctrl-C interrupts at once)


def request_stop(signum, frame):
    if stop and signum == signal.SIGINT:
        print(f"error: interrupted twice: exiting now without a save; the last checkpoint is "
              f"{checkpoint.latest(out) or 'none'}", file=sys.stderr)
        raise SystemExit(130)          # raised where the main thread is: an unfinished save cleans up after itself
    stop.append(signum)
    tqdm.write(f"signal {signal.Signals(signum).name}: saving at the end of this step, then exiting")


signal.signal(signal.SIGTERM, request_stop)
signal.signal(signal.SIGINT, request_stop)


def save(step_done):
    if args.engine != "stream":
        return None
    t0 = time.time()
    try:
        path = checkpoint.save(trainer, out, step_done, {"run": run_id, "data": train_batches.state_dict(),
                                                         "rng": checkpoint.rng_state(), "args": vars(args),
                                                         "skips": n_skips, "val_loss": val_loss}, keep=args.keep)
    except checkpoint.NonFiniteError as e:
        fail(f"{e}; the last good checkpoint is {checkpoint.latest(out) or 'none'}. Try a lower --lr", 3)
    except checkpoint.SaveError as e:
        fail(f"{e}. Free space (or fix the permission), then continue with --resume", 4)
    took = time.time() - t0
    if WORLD > 1 and not saved_once:   # a stop on SIGTERM saves within torchrun's --shutdown-timeout, or is killed
        saved_once.append(took)
        tqdm.write(f"checkpoint {path.name} took {took:.1f} s" + (
            f": more than half of torchrun's default {SHUTDOWN_S} s between its SIGTERM and SIGKILL; launch it with "
            f"--shutdown-timeout {math.ceil(3 * took)} so that a stop can save" if took > SHUTDOWN_S / 2 else ""))
    return path


saved_once = []  # the first save's seconds (torchrun)


peak = planner.peak_tflops(pl["hardware"], pl["dtype"])  # MFU only against a known peak: a profiled GPU, not a CPU
peak = peak and peak * WORLD                               # the run's: every rank's GPU (tokens_per_step is global)
t_start = time.time()
bar = tqdm(range(start_step, args.steps), desc="train", dynamic_ncols=True, disable=True if RANK else None,
           initial=start_step, total=args.steps)
prof = None
if args.profile:  # skip step 1 (allocations, warm-up), record the next three
    acts = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # profile_all_threads (framework internal, torch 2.13: off by default) records the optimizer thread too --
    # the AdamW overlap the trace exists to show; tests/test_train.py pins that its ops are in the trace
    prof = torch.profiler.profile(activities=acts,
                                  schedule=torch.profiler.schedule(wait=1, warmup=0, active=3, repeat=1),
                                  experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True),
                                  on_trace_ready=lambda p_: p_.export_chrome_trace(str(out / "trace.json")))
    prof.start()
for step in bar:
    lr = lr_at(step, args.lr, args.steps, warmup=args.warmup)
    trainer.set_lr(lr)
    x, y = train_batches.next()
    t0 = time.time()
    loss = trainer.step(x, y)
    if args.engine == "stream" and not trainer.defer_updates:
        trainer.wait()  # updates run as gradients land: a unit's non-finite gradient is known once they are done
    dt = time.time() - t0
    rec = {"step": step + 1, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_step / dt,
           "model_tflops": planner.model_tflops(cfg, tokens_per_step, dt)}        # 6 N per token, as the planner
    if peak:
        rec["mfu"] = rec["model_tflops"] / peak
    n_skips = n_skips + 1 if trainer.skipped or trainer.skipped_units else 0
    if trainer.skipped:
        rec["skipped"] = True
        tqdm.write(f"step {step + 1}: non-finite loss or gradient norm (loss {loss}): step skipped, weights untouched")
    elif trainer.skipped_units:
        rec["skipped"] = trainer.skipped_units
        tqdm.write(f"step {step + 1}: non-finite gradient in {', '.join(trainer.skipped_units)}: those units kept "
                   f"their weights, the other units were updated")
    if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
        val_loss = rec["val_loss"] = evaluate()
        tqdm.write(f"step {step + 1}: train loss {loss:.4f}  val loss {val_loss:.4f}")
    try:
        if metrics is not None:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
    except OSError as e:
        fail(f"could not write {out / 'metrics.jsonl'} ({e.strerror}); the last checkpoint is "
             f"{checkpoint.latest(out) or 'none'}", 4)
    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                    **(dict(tflops=f"{rec['model_tflops']:.1f}", mfu=f"{rec['mfu']:.0%}") if peak else {}))
    if prof is not None:
        prof.step()
    if n_skips >= args.max_skips:
        fail(f"{n_skips} consecutive steps had a non-finite loss or gradient; stopping. Last good checkpoint: "
             f"{checkpoint.latest(out) or 'none'}. Try a lower --lr or --grad-clip 1.0.", 3)
    if WORLD > 1:  # a signal may reach the ranks in different steps: they stop (and save) in the same one
        stop[:] = [s for s in trainer.gather_object(stop[0] if stop else None) if s is not None][:1]
    if stop or (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps:
        path = save(step + 1)
        if stop:
            print(f"stopped at step {step + 1}; checkpoint {path}; continue with --resume")
            sys.exit(0)
bar.close()
if prof is not None:
    prof.stop()
    print(f"profile: {out / 'trace.json'} (open in https://ui.perfetto.dev)")
if metrics is not None:
    metrics.close()
elapsed = time.time() - t_start
print(f"done: {args.steps} steps in {elapsed:.0f}s, final val loss {val_loss:.4f} (nats/token), "
      f"checkpoint {checkpoint.latest(out) if args.engine == 'stream' else 'none (reference engine)'}")

# ----------------------------------------------------------------------------- export and sample
if hf_dir is not None:
    # torchrun: a collective, every rank calls it; the whole model lands on rank 0 alone, which writes it
    final = trainer.weights(to=0) if WORLD > 1 else trainer.weights(copy=False) if args.engine == "stream" else \
        trainer.weights()
    try:
        if RANK == 0:
            hf.save_hf(cfg, final, hf_dir, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[args.save_hf_dtype],
                       tokenizer_from=init_dir)
    except hf.HFError as e:  # the directory changed during the run
        fail(f"--save-hf: {e}; the run's checkpoint is {checkpoint.latest(out) or 'none'}")
    except OSError as e:
        fail(f"--save-hf {hf_dir}: could not write the export ({e.strerror}); nothing there was replaced, the run's "
             f"checkpoint is {checkpoint.latest(out) or 'none'}", 4)
    print(f"saved a Hugging Face checkpoint to {hf_dir} ({args.save_hf_dtype})")
if args.sample_tokens and n_params < 2e9 and cfg.vocab_size == 256:
    final = trainer.weights(to=0) if WORLD > 1 else trainer.weights()  # torchrun: a collective; rank 0 samples
    ctx = torch.tensor([list(b"\n")], dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)
    # the sample's context: the trained length (RoPE positions past --seq-len were never seen: the text degenerates
    # there), which is <= max_seq_len, and at most 1024 tokens at any length (a plain forward per sampled token)
    window = min(1024, args.seq_len)
    with torch.no_grad():
        for _ in range(args.sample_tokens if RANK == 0 else 0):
            logits = model.forward(cfg, final, ctx[:, -window:])[0, -1]
            nxt = torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=gen)
            ctx = torch.cat([ctx, nxt[None]], dim=1)
    print("-" * 40 + " sample (temperature 0.8)\n" + data.decode(ctx[0, 1:].tolist()) + "\n" + "-" * 40)
if WORLD > 1:
    sharded.dist.destroy_process_group()
