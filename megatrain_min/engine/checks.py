"""checks.py -- what the engines may be given: one home for every check of an input.

What it is
    Functions that raise TypeError / ValueError with one line naming the argument and what to do,
    before anything is allocated: a config (check_config), a weights mapping and its tensors
    (check_weights, check_tensor, check_finite), a batch (check_batch, check_token_ids), a device
    (check_device), the optimizer's hyper-parameters (check_hyper) and the engine's options
    (check_options). One predicate says what a number may be (real). And the checked front door:
    CheckedTrainer is stream.Trainer with every entry point checked (its weights checked as the
    engine reads them, so a lazy 70B mapping is read once); sharded.ShardedTrainer and
    reference.ReferenceTrainer use the same functions. train.py checks its flags with them and turns
    the message into one line on stderr and exit code 2.
What it is not
    Not part of the engine: stream.py trusts what it is given, so that it reads as the technique
    alone.
Try it
    python -m pytest tests/run/test_hostile.py tests/run/test_nothing_lost.py -k api
"""
import math
import numbers
from collections.abc import Mapping

import torch

import model
import optim
import stream
from megatrain_min.engine.pinned import page_locked


def real(v):
    """A finite real number (not a bool: True is not a learning rate)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def integer(v):
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------- the model
# The largest value of each size that can describe a model at all (the largest presets are far
# below): beyond them a config is a typo, and even its arithmetic (model.units lists every layer)
# would exhaust the memory.
LIMITS = dict(vocab_size=1 << 24, n_layer=10_000, n_head=1 << 14, n_kv_head=1 << 14,
              d_model=1 << 20,
              d_ff=1 << 22, head_dim=1 << 14, max_seq_len=1 << 30)


def check_config(cfg):
    """cfg, checked: TypeError when it is not a model.GPTConfig at all (a preset's name, say),
    ValueError (one line, what to do) for one that cannot describe a model."""
    cfg = model.as_config(cfg)
    for k in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "head_dim",
              "max_seq_len"):
        v = getattr(cfg, k)
        if not integer(v):
            raise ValueError(f"{k} must be an integer, got {v!r}")
        if v <= 0:
            raise ValueError(f"{k} must be positive, got {v}")
        if v > LIMITS[k]:   # a typo, not a model: its layout alone would fill the memory
            raise ValueError(f"{k}={v:,} is beyond any model this engine can hold "
                             f"(at most {LIMITS[k]:,})")
    for k in ("rope_theta", "norm_eps"):
        if not (real(getattr(cfg, k)) and getattr(cfg, k) > 0):
            raise ValueError(f"{k} must be a finite number > 0, got {getattr(cfg, k)!r}")
    if cfg.hidden_act not in model.ACTIVATIONS:
        raise ValueError(f"hidden_act must be one of {', '.join(model.ACTIVATIONS)} "
                         f"(model.ACTIVATIONS), got {cfg.hidden_act!r}")
    for k in ("qkv_bias", "qk_norm", "tie_embeddings"):
        if not isinstance(getattr(cfg, k), bool):
            raise ValueError(f"{k} must be True or False, got {getattr(cfg, k)!r}")
    llama3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    rs = cfg.rope_scaling
    if rs is not None and not (isinstance(rs, dict) and set(rs) == set(llama3)
                               and all(real(v) and v > 0 for v in rs.values())):
        raise ValueError(f"rope_scaling must be None or {{{', '.join(llama3)}}} (positive "
                         f"numbers), got {rs!r}")
    if cfg.d_model % cfg.n_head and not cfg.head_dim_given:
        raise ValueError(f"n_head={cfg.n_head} does not divide d_model={cfg.d_model}; "
                         f"pick n_head among the divisors of {cfg.d_model}")
    if cfg.n_head % cfg.n_kv_head:
        raise ValueError(f"n_head={cfg.n_head} is not a multiple of n_kv_head={cfg.n_kv_head}; "
                         "grouped-query attention shares each k/v head between "
                         "n_head/n_kv_head q heads")
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim={cfg.head_dim} must be even for RoPE")
    if cfg.sliding_window is not None and not (integer(cfg.sliding_window)
                                               and cfg.sliding_window > 0):
        raise ValueError("sliding_window must be a positive integer or None, got "
                         f"{cfg.sliding_window!r}")
    return cfg


def check_weights(cfg, weights, tensors=True):
    """weights must be a Mapping with exactly the keys of cfg's layout, each a floating-point
    torch.Tensor of exactly its shape (nothing broadcast or transposed into the store) holding only
    finite values. tensors=False checks the mapping and its keys only, reading no tensor (Weights
    below checks each one as an engine reads it, so a lazy mapping of a 70B model is read once, not
    twice)."""
    check_config(cfg)
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a Mapping {{key: tensor}} as model.init_weights returns, "
                        f"got {type(weights).__name__}")
    want = {e.key: e.shape for lay in model.units(cfg) for e in lay.entries}
    missing = [key for key in want if key not in weights]
    if missing:
        raise ValueError(f"weights has no {missing[0]!r} ({len(missing)} of the config's "
                         f"{len(want)} tensors missing)")
    extra = [key for key in weights if key not in want]
    if extra:
        raise ValueError(f"weights has {extra[0]!r}, which this config does not use ({len(extra)} "
                         "such keys); is it the config these weights were made for?")
    if tensors:
        check_finite({key: check_tensor(key, weights[key], shape) for key, shape in want.items()})


def check_tensor(key, t, shape):
    """weights[key] = t must be a floating-point torch.Tensor with data, of exactly `shape`; returns
    t detached."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"weights[{key!r}] must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.is_meta:
        raise TypeError(f"weights[{key!r}] must be a floating-point tensor with data, got "
                        f"{t.dtype} on {t.device}")
    if tuple(t.shape) != tuple(shape):
        hint = " (transposed?)" if len(shape) == 2 and tuple(t.shape) == tuple(shape)[::-1] else ""
        raise ValueError(f"weights[{key!r}] has shape {list(t.shape)}, the config needs exactly "
                         f"{list(shape)}{hint}")
    return t.detach()


def check_finite(tensors):
    """ValueError naming the first of {key: tensor} that holds a NaN or an infinity (all_finite)."""
    for key, t in tensors.items():
        if not all_finite(t):
            bad = int((~torch.isfinite(t.detach())).sum())
            raise ValueError(f"weights[{key!r}] holds {bad:,} non-finite values (NaN or "
                             f"inf) among {t.numel():,}")


def all_finite(t):
    """No NaN, no infinity in tensor t. One read pass: a sum is finite whenever every value is (a
    sum reads at memory speed, where isfinite().all() writes a mask first); only a sum that is not
    -- a non-finite value, or an overflow of huge finite ones -- is looked at element by element."""
    t = t.detach()
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


class Weights(Mapping):
    """weights, its keys checked now (check_weights(tensors=False)) and each tensor as it is read
    (check_tensor, check_finite): what the engines read a model through. A lazy mapping's read_into
    (hf_load.HFWeights) is kept, its view checked for finite values once filled (load_hf checked
    every header's shape and dtype)."""

    def __init__(self, cfg, weights):
        check_weights(cfg, weights, tensors=False)
        self.weights = weights
        self.shapes = {e.key: e.shape for lay in model.units(cfg) for e in lay.entries}
        if hasattr(weights, "read_into"):
            self.read_into = self._read_into

    def __getitem__(self, key):
        t = check_tensor(key, self.weights[key], self.shapes[key])
        check_finite({key: t})
        return t

    def _read_into(self, key, view):
        self.weights.read_into(key, view)
        check_finite({key: view})

    def __contains__(self, key):
        return key in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)


def check_token_ids(ids, vocab_size, name):
    """Every id of a non-empty integer array or tensor lies in [0, vocab_size); ValueError naming
    `name` else."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} hold token id {lo if lo < 0 else hi}; ids must be in [0, "
                         f"{vocab_size}) (vocab_size)")


def check_batch(cfg, tokens, targets):
    """A training or evaluation batch: tokens and targets (B, T) int64 tensors of one shape, B, T >=
    1, T <= cfg.max_seq_len (and the sliding window, model.check_seq_len), token ids in
    [0, vocab_size), targets too or model.IGNORE. A batch whose targets are all IGNORE is valid: its
    loss is 0 and an optimizer step still applies weight decay and momentum, exactly as
    torch.optim.AdamW does with zero gradients."""
    for name, t in (("tokens", tokens), ("targets", targets)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            got = f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an int64 torch.Tensor (B, T), got a {got}")
        if t.dim() != 2 or 0 in t.shape:
            raise ValueError(f"{name} must be (B, T) with B, T >= 1, got shape {list(t.shape)}")
    if targets.shape != tokens.shape:
        raise ValueError(f"targets has shape {list(targets.shape)}, tokens "
                         f"{list(tokens.shape)}: they must match")
    if tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(f"tokens hold sequences of {tokens.shape[1]} tokens, longer than "
                         f"max_seq_len={cfg.max_seq_len}")
    model.check_seq_len(cfg, tokens.shape[1])
    check_token_ids(tokens, cfg.vocab_size, "tokens")
    # IGNORE read as 0; elementwise, not a boolean mask (whose parallel nonzero costs ms on a busy
    # machine)
    check_token_ids(torch.where(targets == model.IGNORE, 0, targets), cfg.vocab_size,
                    f"targets (besides {model.IGNORE}, ignored)")


def check_device(device, present=True):
    """torch.device of `device` ("cpu", "cuda", "cuda:i"; None: the engine's default,
    optim.resolve_device: the current CUDA device when there is one, else the CPU), or ValueError
    naming it when the engines cannot run there: not a device torch knows, not cpu/cuda, or
    (present: it must be here, not only planned for) a GPU this machine lacks."""
    if device is None:
        return optim.resolve_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device {str(device)!r} is not a device torch knows; use "
                         "'cpu' or 'cuda'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r}: the engines run on 'cpu' or 'cuda'")
    if dev.type == "cuda" and present and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but torch sees no "
                         "CUDA device; use 'cpu'")
    if dev.type == "cuda" and present and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r}: this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


# --------------------------------------------------------------------- the optimizer and the engine
class HyperParameterError(ValueError):
    """A hyper-parameter no step can use; .name is the argument's name (train.py turns it into a
    flag)."""

    def __init__(self, name, msg):
        super().__init__(msg)
        self.name = name


def check_hyper(**hp):
    """Raise HyperParameterError naming the first of the given hyper-parameters that cannot train.
    Only those given are checked (set_lr checks lr alone). lr, weight_decay, grad_clip (0 = off):
    finite and >= 0 (a negative lr is gradient ascent, a negative grad_clip would silently turn
    clipping off); eps: finite and
    > 0 (with eps = 0 a gradient that is exactly zero, an unused embedding row, gives 0/0 = NaN);
    betas: two numbers in [0, 1) (beta2 = 1 divides by 1 - beta2**t = 0); micro_batches: a positive
    integer."""
    for name, v in hp.items():
        if name in ("lr", "weight_decay", "grad_clip"):
            ok, want = real(v) and v >= 0, "a finite number >= 0"
        elif name == "eps":
            ok, want = real(v) and v > 0, "a finite number > 0"
        elif name == "betas":
            ok = isinstance(v, (tuple,
                                list)) and len(v) == 2 and all(real(b) and 0 <= b < 1 for b in v)
            want = "two numbers in [0, 1)"
        elif name == "micro_batches":
            ok, want = integer(v) and v >= 1, "a positive integer"
        else:
            raise TypeError(f"check_hyper() got an unknown hyper-parameter {name!r}")
        if not ok:
            raise HyperParameterError(name, f"{name} must be {want}, got {v!r}")


HYPER = ("lr", "betas", "eps", "weight_decay", "grad_clip", "micro_batches")


def check_options(mode="fast", dtype=None, residual_dtype=None, chunk_tokens=None,
                  grad_slabs=stream.GRAD_SLABS, tied=False, grad_clip=None, homes=None, **_):
    """The engine's own options: the memory mode, the compute and residual dtypes, the loss chunk,
    the slabs (a tied head holds one until the embedding's scatter), the units' homes."""
    resident_units = getattr(homes, "resident_units", 0)   # (Homes: units kept on the GPU)
    if mode not in ("fast", "lean"):
        raise ValueError(f"mode must be 'fast' or 'lean', got {mode!r}")
    if dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"compute dtype must be torch.bfloat16 or torch.float32, got {dtype} "
                         f"(fp16 would need loss scaling)")
    if residual_dtype not in (None, torch.float32,
                              torch.bfloat16) or (residual_dtype == torch.bfloat16
                                                                       and dtype == torch.float32):
        raise ValueError("residual_dtype must be torch.float32, or torch.bfloat16 with bf16 "
                         f"compute; got {residual_dtype} with compute dtype {dtype}")
    if chunk_tokens is not None and not (integer(chunk_tokens) and chunk_tokens > 0):
        raise ValueError("chunk_tokens must be a positive integer (tokens per loss chunk), got "
                         f"{chunk_tokens!r}")
    if not (integer(grad_slabs) and grad_slabs >= 1):
        raise ValueError(f"grad_slabs must be a positive integer, got {grad_slabs!r}")
    if tied and grad_slabs < 2 and not grad_clip and not resident_units:   # else the engine waits
        raise ValueError("a tied head holds a gradient slab until the embedding's scatter: "
                         f"grad_slabs must be >= 2, got {grad_slabs}")   # for a slab forever
    if homes is not None and not callable(getattr(homes, "assign", None)):
        raise ValueError("homes must be a megatrain_min.engine.homes.Homes (or None: every unit "
                         f"streamed), got {type(homes).__name__}")


def splits(batch_size, micro_batches, ranks=1):
    """The rule: batch_size sequences split evenly over the ranks, each share into micro_batches."""
    return batch_size % (ranks * micro_batches) == 0


def check_split(batch_size, micro_batches, ranks=1, names=("batch size", "micro_batches")):
    """The one home of the rule that a step's batch splits evenly: over `ranks` ranks, then each
    rank's share into micro_batches micro-batches. ValueError naming both otherwise; names: what the
    caller calls them (the engine's arguments, the planner's words, train.py's flags)."""
    b, m = names
    if not all(integer(n) and n >= 1 for n in (batch_size, micro_batches)):
        raise ValueError(f"{b} and {m} must be positive integers, got {batch_size!r} and "
                         f"{micro_batches!r}")
    if splits(batch_size, micro_batches, ranks):
        return
    if ranks == 1:
        raise ValueError(f"{b} {batch_size} is not divisible by {m} {micro_batches}")
    raise ValueError(f"{b} {batch_size} is not divisible by {ranks} ranks x {m} {micro_batches} "
                     f"(each rank computes {b} / {ranks} sequences in {m} micro-batches)")


class Checked:
    """A trainer whose every entry point checks what it is given before the engine sees it: mix it
    in first (CheckedTrainer, sharded.ShardedTrainer)."""

    def __init__(self, cfg, weights, device=None, **kw):
        check_config(cfg)
        check_hyper(**{k: kw[k] for k in HYPER if k in kw})
        check_options(tied=cfg.tie_embeddings, **kw)
        dev = check_device(device)
        if kw.get("lanes") is None:   # the host buffers page-locked exactly (pinned.py)
            kw["lanes"] = stream.Lanes(dev, pinned=page_locked)
        super().__init__(cfg, Weights(cfg, weights), device=dev, **kw)

    def step(self, tokens, targets):
        self.check_batch(tokens, targets)
        return super().step(tokens, targets)

    def evaluate(self, tokens, targets):
        self.check_batch(tokens, targets)
        return super().evaluate(tokens, targets)

    def check_batch(self, tokens, targets):
        """A batch of the config (check_batch) that splits over the ranks (sharded: self.world),
        each rank's share into self.M micro-batches (check_split)."""
        check_batch(self.cfg, tokens, targets)
        check_split(tokens.shape[0], self.M, getattr(self, "world", 1))

    def set_lr(self, lr):
        check_hyper(lr=lr)
        super().set_lr(lr)


class CheckedTrainer(Checked, stream.Trainer):
    """stream.Trainer, every argument, batch and learning rate checked first: the one to build by
    hand."""
