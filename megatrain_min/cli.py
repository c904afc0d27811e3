"""cli.py -- the command-line flags of train.py, the planner and the stream checker; every default.

What it is
    Flag groups, each added to a parser by one function, their defaults in one place (DEFAULTS):
      model     --config and the shape overrides, --max-seq-len (config_of: the GPTConfig)
      step      batch, sequence, micro-batches, clipping, the update rule, memory mode, dtypes,
                offload, loss chunk, tile
      hardware  what to plan for: --hardware, --host-mem, --host-bw, --gpus, --nodes
      run       train.py's own: steps, schedule, data, outputs, checkpoints, --init-from, --plan
    python train.py, python -m megatrain_min.plan and python -m megatrain_min.sim take the same
    flags with the same defaults; plan.from_flags turns them into a plan, engine.arguments a plan
    into the engine's arguments.
    check(a) says in one line what is wrong with flags that cannot be right (FlagError), before
    anything runs.
What it is not
    Not a configuration system: a preset from model.PRESETS plus flags, nothing read from files.
"""
import argparse
import dataclasses
import math
import os
import sys
import warnings

import model
import optim
import stream
from megatrain_min.engine import DTYPE_NAMES, DTYPES, RULES   # (the flags' names of them)
from megatrain_min.engine.checks import HyperParameterError, check_hyper, check_split

# Every default, one home. The library's are the engine's own (what a bare stream.Trainer(cfg,
# weights) does): optim's LR, BETAS, EPS, WEIGHT_DECAY, stream's MICRO_BATCHES and GRAD_CLIP, the
# device optim.resolve_device picks for None. The flags take them (LIBRARY), but where train.py's
# recipe for its default model, the toy, differs (RECIPE, each with its reason). batch_size and
# seq_len have no library default -- the engine takes the batch it is given -- so DEFAULTS is their
# one home (plan() takes its batch from here too).
LIBRARY = dict(micro_batches=stream.MICRO_BATCHES, grad_clip=stream.GRAD_CLIP, lr=optim.LR,
               weight_decay=optim.WEIGHT_DECAY, device=None)
RECIPE = dict(lr=3e-3,         # the toy's rate; the library's (optim.LR) suits large models
              grad_clip=1.0)   # a script's run clips, as nanoGPT's does; the library clips if asked
DEFAULTS = dict(LIBRARY, **RECIPE, config="toy", batch_size=32, seq_len=128, mode="auto",
                dtype=None,
                residual_dtype="fp32", offload_activations="auto", chunk_tokens=0, tile_tokens=None,
                resident_units=None, gpu_updated_units=None, hardware="local", gpus=1, nodes=1,
                keep=2, optimizer="adamw", betas=None)   # betas None: the update rule's own
SHAPE = ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff")
OFFLOAD = {"auto": None, "on": True, "off": False}
# The largest values a flag can take: beyond them it is a typo, and the planner's searches and
# schedule replay would run for a long time on numbers no machine has.
MOST = dict(batch_size=1 << 24, seq_len=1 << 30, micro_batches=1 << 24, gpus=1 << 10, nodes=1 << 14,
            nproc_per_node=1 << 10, host_mem=1e7, host_bw=1e5, seed=(1 << 63) - 1)
LEAST = dict(host_bw=0.01)   # GB/s: below it a host is not a host


class FlagError(ValueError):
    """A flag no run can use: one line naming it."""


class _Survivor:
    """A standard stream whose reader may go away: the first write or flush that fails (a closed
    pipe, a terminal hung up) points the file descriptor at /dev/null, and the program goes on. A
    character its encoding lacks (PYTHONIOENCODING=ascii, a C locale) is written escaped
    (backslashreplace)."""

    def __init__(self, stream):
        self.stream = stream
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")

    def _gone(self):
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError:                 # BrokenPipeError, EIO of a closed terminal
            self._gone()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            self._gone()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def finite_json(obj):
    """obj with every non-finite float (NaN, an infinity) replaced by None, recursively, and whether
    there was one: json.dumps of it is strict JSON (no NaN or Infinity, which jq and JavaScript
    reject)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None, True
    if isinstance(obj, dict):
        pairs = [(k, finite_json(v)) for k, v in obj.items()]
        return {k: v for k, (v, _) in pairs}, any(bad for _, (_, bad) in pairs)
    if isinstance(obj, (list, tuple)):
        items = [finite_json(v) for v in obj]
        return [v for v, _ in items], any(bad for _, bad in items)
    return obj, False


def _num(v):
    """A bound or a value as people write it: 10,000,000 (not 1e+07), 0.01, 1e+308."""
    whole = isinstance(v, int) or float(v).is_integer() and abs(v) < 1e15
    return f"{int(v):,}" if whole else f"{v:g}"


def warn_in_one_line():
    """Warnings as errors are said: one line, 'warning: MESSAGE' (not Python's file:line and the
    source line)."""
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"


def survive_closed_pipe():
    """stdout and stderr survive a reader that went away (`python train.py --plan --json | head -c
    100`, a closed ssh session): no BrokenPipeError traceback, no "Exception ignored" at exit; a
    training run goes on (and saves) with its output discarded."""
    sys.stdout, sys.stderr = _Survivor(sys.stdout), _Survivor(sys.stderr)


def add_model(p, config_default=True):
    """--config, the shape overrides, --max-seq-len."""
    p.add_argument("--config", default=DEFAULTS["config"] if config_default else None,
                   help=f"preset: {', '.join(model.PRESETS)} (default: {DEFAULTS['config']})")
    for f in SHAPE:
        p.add_argument("--" + f.replace("_", "-"), type=int, default=None,
                       help=f"override the preset's {f}")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="raise (or lower) the model's max_seq_len: longer sequences than the "
                        "preset's (RoPE has no table; default: the preset's)")


def add_step(p):
    """What one step is: its batch, micro-batches and sequence length, and how the engine runs
    it."""
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"],
                   help="sequences per optimizer step (default: %(default)s)")
    p.add_argument("--micro-batches", type=int, default=DEFAULTS["micro_batches"],
                   help="split each step (under torchrun: each rank's share of it) into this many "
                        "micro-batches (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"],
                   help="tokens per sequence, <= the model's max_seq_len (default: %(default)s)")
    p.add_argument("--grad-clip", type=float, default=DEFAULTS["grad_clip"],
                   help="global grad-norm clip, 0 = off (default: %(default)s)")
    p.add_argument("--optimizer", default=DEFAULTS["optimizer"], choices=list(RULES),
                   help="the update rule. adamw; lion: one moment instead of two, 4 B/param less "
                        "host memory -- its paper advises an lr 3-10x below AdamW's and a weight "
                        "decay 3-10x above: the toy trains with --lr 1e-3 --weight-decay 0.3 "
                        "--betas 0.9 0.95 (README) (default: %(default)s)")
    p.add_argument("--mode", default=DEFAULTS["mode"], choices=["auto", "fast", "lean"],
                   help="host memory mode. fast: stream a bf16 shadow; lean: stream fp32, 12 "
                        "B/param; auto: the plan picks -- lean where it is >= 2%% faster or the "
                        "one that fits, else fast (default: %(default)s)")
    p.add_argument("--dtype", default=DEFAULTS["dtype"], choices=["bf16", "fp32"],
                   help="compute dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--residual-dtype", default=DEFAULTS["residual_dtype"], choices=["fp32", "bf16"],
                   help="dtype of the residual (x, dy, boundary activations); bf16 halves those "
                        "bytes at some accuracy (default: %(default)s)")
    p.add_argument("--offload-activations", default=DEFAULTS["offload_activations"],
                   choices=list(OFFLOAD),
                   help="boundary activations in host memory; auto: when they would not fit on the "
                        "device (default: %(default)s)")
    p.add_argument("--offload-checkpoints", dest="offload_activations", choices=list(OFFLOAD),
                   help=argparse.SUPPRESS)   # its earlier name: commands written with it still run
    p.add_argument("--chunk-tokens", type=int, default=DEFAULTS["chunk_tokens"],
                   help="tokens per loss chunk (default: 0 = model.default_chunk_tokens)")
    p.add_argument("--tile-tokens", type=int, default=DEFAULTS["tile_tokens"],
                   help="run each layer's norms, projections and MLP this many tokens at a time "
                        "(exact; 0 = untiled; default: the planner's choice, untiled unless long "
                        "sequences need it)")
    p.add_argument("--resident-units", type=int, default=DEFAULTS["resident_units"],
                   help="units kept whole on the GPU and updated there, the embedding and layer 0 "
                        "first (exact; 0 = stream every unit; default: the planner's choice, as "
                        "many as fit in GPU memory)")
    p.add_argument("--gpu-updated-units", type=int, default=DEFAULTS["gpu_updated_units"],
                   help="streamed units whose AdamW runs on the GPU, their master, m, v crossing "
                        "the link for it and their fp32 gradient kept there (exact; 0 = every "
                        "streamed unit on the host; default: the planner's choice, where it makes "
                        "the step faster)")


def add_hardware(p, default=DEFAULTS["hardware"]):
    """What to plan for (the planner, the stream checker's twin; train.py: --plan)."""
    p.add_argument("--hardware", default=default,
                   help="plan for: local (this machine) or a profile of "
                        "plan.hardware.HARDWARE (python -m megatrain_min.plan --hardware all "
                        "lists them) (default: %(default)s)")
    p.add_argument("--host-mem", type=float, default=None,
                   help="host RAM in GB (default: the hardware's)")
    p.add_argument("--host-bw", type=float, default=None,
                   help="host DRAM bandwidth in GB/s seen by AdamW (default: the hardware's)")
    p.add_argument("--gpus", type=int, default=DEFAULTS["gpus"],
                   help="GPUs per node (train.py under torchrun: its ranks per node) "
                        "(default: %(default)s)")
    p.add_argument("--nodes", type=int, default=DEFAULTS["nodes"],
                   help="nodes, each with --gpus GPUs and --host-mem of RAM (default: %(default)s)")


def add_run(p):
    """train.py's own flags: the schedule, the data, the outputs, where the weights come from,
    --plan."""
    a = p.add_argument
    a("--steps", type=int, default=400, help="total optimizer steps; a resumed run continues to "
                                             "this (default: %(default)s)")
    a("--lr", type=float, default=DEFAULTS["lr"], help="peak learning rate: warmup, then cosine to "
                                                       "lr/10 (default: %(default)s)")
    a("--warmup", type=int, default=30, help="linear warmup steps (default: %(default)s)")
    a("--betas", type=float, nargs=2, metavar=("BETA1", "BETA2"), default=DEFAULTS["betas"],
      help="the update rule's betas (default: its own -- AdamW 0.9 0.95, Lion its paper's 0.9 "
           "0.99)")
    a("--weight-decay", type=float, default=DEFAULTS["weight_decay"],
      help="weight decay (decoupled, as AdamW's) on tensors with >= 2 dims "
           "(default: %(default)s)")
    a("--seed", type=int, default=0, help="seed for init and batches (default: %(default)s)")
    a("--device", default=DEFAULTS["device"], help="cuda or cpu (default: cuda if available)")
    a("--nproc-per-node", type=int, default=1,
      help="train on N local ranks (GPUs, or CPU processes): every input checked here first, then "
           "the ranks started through torch.distributed's launcher, as torchrun --standalone "
           "(default: %(default)s)")
    a("--data", default=None, help="a .txt (bytes), a .npy token array, an SFT .jsonl, or a "
                                   "directory made by python -m megatrain_min.prepare (default: "
                                   "data/tinyshakespeare.txt)")
    a("--out", default="out",
      help="output directory for metrics, config and checkpoints (default: %(default)s)")
    a("--engine", default="stream", choices=["stream", "reference"],
      help="layer streaming, or plain PyTorch (default: %(default)s)")
    a("--eval-every", type=int, default=100, help="evaluate val loss every N steps and at the end "
                                                  "(default: %(default)s)")
    a("--eval-batches", type=int, default=8,
      help="val batches per evaluation (default: %(default)s)")
    a("--init-from", default=None,
      help="start from a Hugging Face model directory or one of our checkpoints (weights only)")
    a("--save-hf", default=None,
      help="at the end, write the weights as a Hugging Face checkpoint to this directory")
    a("--save-hf-dtype", default="bf16", choices=["bf16", "fp32"], help="tensor dtype of --save-hf "
                                                                         "(default: %(default)s)")
    a("--chat-format", default=None, choices=["native", "fixed"],
      help="how .jsonl conversations are rendered: native = the model directory's own "
           "chat_template (the default when it has one), fixed = '<|role|>\\n' + "
           "content + eos per message")
    a("--plan", action="store_true", help="print the memory and throughput plan for --hardware and "
                                          "exit (nothing allocated)")
    a("--json", action="store_true", help="with --plan: print the plan as one JSON object")
    a("--max-context", action="store_true",
      help="with --plan: print the longest --seq-len that fits at --batch-size on --hardware")
    a("--save-every", type=int, default=0, help="save a checkpoint every N steps, 0 = only at the "
                                                "end (default: %(default)s)")
    a("--keep", type=int, default=DEFAULTS["keep"],
      help="keep the last K >= 1 checkpoints of this run (default: %(default)s)")
    a("--resume", nargs="?", const="latest", default=None,
      help="continue from the latest checkpoint in --out (or the given one)")
    a("--max-skips", type=int, default=10, help="stop after this many consecutive non-finite steps "
                                                "(default: %(default)s)")
    a("--profile", action="store_true",
      help="write OUT/trace.json (torch.profiler, open in Perfetto) for steps 2-4")
    a("--sample-tokens", type=int, default=300, help="length of the sample printed at the end, 0 = "
                                                     "none (default: %(default)s)")
    a("--sample-prompt", default=None,
      help="what the closing sample continues -- or, fine-tuning on conversations, the user turn "
           "it answers (default: a newline; fine-tuning: the first held-out conversation's prompt)")


def betas_of(optimizer, betas=None):
    """The betas an --optimizer trains with: --betas as a list, or (None) the update rule's own."""
    return list(betas) if betas else list(RULES[optimizer]().betas)


def check(a, world=1):
    """FlagError naming the first flag that cannot be right, whatever the model: counts that must be
    positive or >= 0, hyper-parameters (checks.check_hyper), hardware numbers that must be finite
    and > 0, empty paths, flags that apply only with others; the batch split over `world` ranks
    (torchrun) and micro-batches."""
    run = hasattr(a, "out")   # train.py's flags (cli.add_run) too
    for flag in ("batch_size", "seq_len", "gpus", "nodes") + \
            (("steps", "eval_batches", "eval_every", "keep", "max_skips",
              "nproc_per_node") if run else ()):
        if getattr(a, flag) <= 0:
            raise FlagError(f"--{flag.replace('_', '-')} must be positive, got {getattr(a, flag)}")
    for flag in ("chunk_tokens",) + (
        ("warmup", "save_every", "sample_tokens", "seed") if run else ()):
        if getattr(a, flag) < 0:
            raise FlagError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(a, flag)}")
    hyper = dict(grad_clip=a.grad_clip, micro_batches=a.micro_batches)
    try:   # the one home of what a hyper-parameter may be (the engines check the same)
        if run:
            hyper.update(lr=a.lr, weight_decay=a.weight_decay)
        if run and a.betas is not None:
            hyper.update(betas=a.betas)
        check_hyper(**hyper)
    except HyperParameterError as e:
        raise FlagError(f"--{e.name.replace('_', '-')}: {e}") from None
    for flag, most in MOST.items():     # first: a typo in one of them is not the batch's fault
        v, least = getattr(a, flag, None), LEAST.get(flag, 0)
        if v is not None and not least <= v <= most:
            raise FlagError(f"--{flag.replace('_', '-')} {_num(v)} is out of range: at most "
                            f"{_num(most)}" + (f" and at least {_num(least)}" if least else ""))
    try:
        check_split(a.batch_size, a.micro_batches, world, names=("--batch-size", "--micro-batches"))
    except ValueError as e:
        raise FlagError(str(e)) from None
    if a.tile_tokens is not None and a.tile_tokens < 0:
        raise FlagError(f"--tile-tokens must be >= 0 (0 = untiled), got {a.tile_tokens}")
    if getattr(a, "resident_units", None) is not None and a.resident_units < 0:
        raise FlagError("--resident-units must be >= 0 (0 = stream every unit), got "
                        f"{a.resident_units}")
    if getattr(a, "gpu_updated_units", None) is not None and a.gpu_updated_units < 0:
        raise FlagError("--gpu-updated-units must be >= 0 (0 = update every streamed unit on the "
                        f"host), got {a.gpu_updated_units}")
    if a.max_seq_len is not None and a.max_seq_len <= 0:
        raise FlagError(f"--max-seq-len must be positive, got {a.max_seq_len}")
    for flag in ("host_mem", "host_bw"):
        v = getattr(a, flag)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise FlagError(f"--{flag.replace('_', '-')} must be a finite number > 0, got {v}")
    if not run:
        return
    for flag in ("out", "save_hf", "init_from", "data"):
        if getattr(a, flag) == "":
            raise FlagError(f"--{flag.replace('_', '-')} is an empty path")
    if a.sample_prompt == "":
        raise FlagError("--sample-prompt is empty: give the text the closing sample continues (or "
                        "answers), or drop the flag for the default")
    try:
        (a.sample_prompt or "").encode("utf-8")
    except UnicodeEncodeError as e:     # bytes not UTF-8 arrive as lone surrogates (PEP 383)
        ch = ord(a.sample_prompt[e.start])
        what = f"byte {ch - 0xDC00:#04x}" if 0xDC80 <= ch <= 0xDCFF else f"lone surrogate {ch:#06x}"
        raise FlagError(f"--sample-prompt is not UTF-8 text ({what} at character {e.start}); pass "
                        f"the prompt in UTF-8") from None
    if a.nproc_per_node > 1 and world != a.nproc_per_node:
        raise FlagError(f"--nproc-per-node {a.nproc_per_node} under torchrun: torchrun started the "
                        "ranks already; drop it")
    if world > 1 and (a.engine != "stream" or a.profile):
        raise FlagError(f"on {world} ranks (torchrun, --nproc-per-node) train.py runs --engine "
                        "stream without --profile")
    if a.engine == "reference" and a.optimizer != DEFAULTS["optimizer"]:
        raise FlagError(f"--optimizer {a.optimizer} with --engine reference: the reference engine "
                        "trains with torch.optim.AdamW; use --engine stream")
    planning = a.plan or a.json or a.max_context
    unused = ["--" + f.replace("_", "-") for f, given in (
        ("data", a.data), ("resume", a.resume), ("save_hf", a.save_hf),
        ("save_every", a.save_every),
        ("keep", a.keep != DEFAULTS["keep"]), ("profile", a.profile),
        ("sample_prompt", a.sample_prompt is not None)) if given]
    if planning and unused:   # a training command with --plan added: it plans, and trains nothing
        what = "--max-context" if a.max_context else "--plan" if a.plan else "--json"
        warnings.warn(f"{what} plans the run and trains nothing: {', '.join(unused)} "
                      f"{'is' if len(unused) == 1 else 'are'} not used (drop {what} to train)")
    if a.engine == "reference" and not planning:   # it keeps no host store: nothing to checkpoint
        given = (("--resume", a.resume), ("--save-every", a.save_every),
                 ("--keep", a.keep != DEFAULTS["keep"]))
        for flag, given in given:
            if given:
                raise FlagError(f"{flag} with --engine reference: the reference engine writes no "
                                f"checkpoint; drop {flag}, or use --engine stream")
        for flag in ("resident_units", "gpu_updated_units"):   # one model in memory: no units
            if getattr(a, flag):
                raise FlagError(f"--{flag.replace('_', '-')} {getattr(a, flag)} with --engine "
                                "reference: the reference engine holds the whole model in one "
                                "place and streams no unit; drop it, or use --engine stream")
    for flag, default in (("hardware", DEFAULTS["hardware"]), ("gpus", 1), ("nodes", 1)):
        if getattr(a, flag) != default and not planning:
            raise FlagError(f"--{flag} {getattr(a, flag)} applies to --plan (a run is checked "
                            "against this machine, and under torchrun its ranks say how many "
                            "GPUs); add --plan")
    if a.init_from and a.config:
        raise FlagError(f"--config {a.config} and --init-from both give the model; drop --config "
                        f"(the shape comes from {a.init_from})")
    over = [f for f in SHAPE if getattr(a, f) is not None]
    if a.init_from and over:
        raise FlagError(f"--init-from takes the model shape from {a.init_from}; drop "
                        f"--{over[0].replace('_', '-')}")


def config_of(a, preset=None):
    """The GPTConfig the flags describe: the preset (or `preset`, a config from a model directory)
    with the shape overrides (a multi-head preset stays multi-head when only --n-head changes) and
    --max-seq-len. Unchecked: checks.check_config says what is wrong with it."""
    over = {f: getattr(a, f) for f in SHAPE if getattr(a, f) is not None}
    base = preset or model.PRESETS[a.config]
    if "n_head" in over and "n_kv_head" not in over and base.n_kv_head == base.n_head:
        over["n_kv_head"] = over["n_head"]
    cfg = dataclasses.replace(base, head_dim=0, **over) if over else dataclasses.replace(base)
    if a.max_seq_len is not None:
        cfg = dataclasses.replace(cfg, max_seq_len=a.max_seq_len)
    return cfg
