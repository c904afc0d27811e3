"""inputs.py -- the model and the sequence length train.py's flags ask for, resolved and checked
before anything is allocated.

What it is
    model_from(args): the model -- a preset (--config), one of our checkpoints (--init-from: its
    config now, its weights when the run loads them) or a transformers directory (--init-from: its
    config and its weights) -- and the tokenizer a directory brings. seq_len_checked(args, cfg,
    plan_only): the config a --seq-len trains or plans at. Both raise ValueError with one line
    saying what is wrong and what to do; train.py prints it and exits 2. compute_dtype(name,
    device): the compute dtype --dtype asks for (none: the device's default), and why.
What it is not
    Not the flags themselves (cli.py) nor the device (engine/checks.py, run/launch.py).
"""
import dataclasses
from pathlib import Path

import model
from megatrain_min import cli
from megatrain_min.checkpoints import ckpt_read
from megatrain_min.data.tokenizer import HFTokenizer
from megatrain_min.engine.checks import check_config
from megatrain_min.hf import load as hf_load


def model_from(args):
    """(cfg, init_dir, init_weights, tokenizer): init_dir None for a preset; init_weights the
    weights of a transformers directory (None otherwise); tokenizer a directory's tokenizer.json
    (None: bytes). Sets args.config to the model's name when none was given."""
    init_dir = Path(args.init_from) if args.init_from else None
    args.config = args.config or (init_dir.name if init_dir else cli.DEFAULTS["config"])
    if init_dir is None and args.config not in model.PRESETS:
        raise ValueError(f"unknown preset --config {args.config!r}; choose one of: "
                         f"{', '.join(model.PRESETS)}")
    try:
        return read_model(args, init_dir)
    except TypeError as e:   # a config field GPTConfig lacks, in a checkpoint or a config.json
        raise ValueError(f"--init-from {init_dir}: {e}") from None


def read_model(args, init_dir):
    """model_from's result once the name is known: the preset's config with the flags' changes, or
    the config (and a transformers directory's weights) read from --init-from."""
    base = None                                                 # the preset
    init_weights = None
    tokenizer = None
    if init_dir is not None and (init_dir / "meta.json").is_file():   # one of our checkpoints
        if args.engine != "stream":
            raise ValueError("--init-from a checkpoint needs --engine stream")
        meta = ckpt_read.read_meta(init_dir)
        base = ckpt_read.config_of(init_dir, meta)   # a field it lacks: the default
    elif init_dir is not None:                                        # a transformers directory
        base, init_weights = hf_load.load_hf(init_dir)
    if init_dir is not None and (init_dir / "tokenizer.json").is_file():
        tokenizer = HFTokenizer(init_dir)    # our checkpoints carry their model's tokenizer
    cfg = check_config(cli.config_of(args, base))
    return cfg, init_dir, init_weights, tokenizer


def seq_len_checked(args, cfg, plan_only):
    """cfg, to train or plan at --seq-len: planning is arithmetic (any length: max_seq_len raised
    to it, with a note); training past max_seq_len or a sliding window is refused."""
    if args.seq_len > cfg.max_seq_len and plan_only:
        cfg = dataclasses.replace(cfg, max_seq_len=args.seq_len)
        if not args.json:
            print(f"note: --seq-len {args.seq_len} is above {args.config}'s max_seq_len; training "
                  f"at it needs --max-seq-len {args.seq_len}")
    if args.seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} is above the {args.config} preset's "
                         f"max_seq_len {cfg.max_seq_len}; use --seq-len {cfg.max_seq_len} or less, "
                         f"or allow it with --max-seq-len {args.seq_len}")
    try:
        model.check_seq_len(cfg, args.seq_len)   # a sliding window: only T <= window is exact
    except ValueError as e:
        raise ValueError(f"--seq-len {args.seq_len}: {e}") from None
    return cfg


def compute_dtype(name, device):
    """(dtype, why): --dtype's (cli.DTYPES), or the device's default (model.default_dtype), and the
    reason train.py prints beside it."""
    if name:
        return cli.DTYPES[name], "asked for"
    if device.type == "cuda":
        return model.default_dtype("cuda"), "default on CUDA"
    return model.default_dtype(device.type), "default on CPU: bf16 matmuls are slow there"
