"""hf/ -- Hugging Face checkpoints in (load.py: load_hf) and out (this file: save_hf, and
`python -m megatrain_min.hf export`, __main__.py). Not here: our own checkpoints (checkpoints/).

This file: out -- a directory transformers loads, from any weights or from one of our checkpoints.

What it is
    save_hf(cfg, weights, dir) writes bf16 or fp32 safetensors shards (one tensor in memory at a
    time), the index, config.json (config_to_hf: Llama, Mistral, Qwen2 or Qwen3) and the tokenizer
    files, aside and then put in place whole
    (publish.py: an existing directory -- empty, a mount point -- is filled, never renamed), with a
    marker (EXPORT_MARKER) listing what it wrote: an existing dir is replaced only when it is empty
    or provably one of these exports and nothing more (check_export_dir; train.py asks before
    training), never inside a checkpoint (which --keep deletes whole), and only when it still holds
    what it held when checked (an export written there meanwhile, by another process, wins).
    export(ckpt, dir) / `python -m megatrain_min.hf export CKPT DIR`: one of our checkpoints
    (checkpoint.save, one process's or sharded) through save_hf, its master weights read tensor by
    tensor from the unit files (ckpt_read.read_weights, CRCs verified first; no trainer, no
    optimizer state in memory), with the tokenizer files the checkpoint carries (verified:
    ckpt_read.read_meta, and parsed as HFTokenizer does).
    The way in -- load_hf, config_from_hf, HFWeights, and HFError, ARCHS and DTYPES, which this file
    uses too -- is hf_load.py.
What it is not
    Not a general converter: it writes what model.py computes (hf_load.py lists what is refused).
    save_hf writes the sliding window back: a Llama-shaped model with a window as
    MistralForCausalLM (Llama + sliding_window), a Qwen2/Qwen3 one with use_sliding_window and
    max_window_layers 0, so transformers applies the same window. Tokenizers and chat templates
    live in tokenizer.py (HFTokenizer) and chat.py; save_hf only copies their files.
Reference
    transformers' modeling_llama / mistral / qwen2 / qwen3 (model.py names its weights like them, so
    this is a rename-free copy); the safetensors format: 8-byte little-endian header length, a JSON
    header {name: {dtype, shape, data_offsets}}, then the raw little-endian bytes.
Try it
    python -m megatrain_min.hf export out/ckpt-00000400 my-model [--dtype bf16|fp32]
    python -m pytest tests/hf/test_hf.py tests/hf/test_export.py   # vs transformers, round trips
"""
import argparse
import json
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

import torch

from model import INIT_STD, GPTConfig, units
from megatrain_min.checkpoints import ckpt_read
from megatrain_min.data import publish
from megatrain_min.cli import survive_closed_pipe
from megatrain_min.engine.checks import check_finite
from megatrain_min.hf.load import ARCHS, DTYPES, HFError
from megatrain_min.data.tokenizer import TOKENIZER_FILES, HFTokenizer, copy_tokenizer_files

ST_NAME = {v: k for k, v in DTYPES.items()}
# {"format", "files"}: what save_hf wrote into the directory
EXPORT_MARKER = "megatrain-min-export.json"


# ------------------------------------------------------------------------- GPTConfig -> config.json
# The tensors of a layer each family holds (transformers' modeling files), by model.block's names.
LLAMA_LAYER = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"}
QKV_BIAS = {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
QK_NORM = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
LAYER_TENSORS = {"llama": LLAMA_LAYER, "mistral": LLAMA_LAYER, "qwen2": LLAMA_LAYER | QKV_BIAS,
                 "qwen3": LLAMA_LAYER | QK_NORM}
# The GPTConfig fields config_to_hf writes; a field added to model.py and not here is exported only
# at its default (where, by the rule of a default, the model computes what it computed without it).
EXPORTED = {"vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "hidden_act",
            "head_dim", "max_seq_len", "rope_theta", "norm_eps", "qkv_bias", "qk_norm",
            "tie_embeddings", "rope_scaling", "sliding_window"}


def architecture(cfg):
    """The transformers architecture that computes what model.py computes for cfg: Llama, Qwen2 when
    it has a qkv bias, Qwen3 when it has q/k norm; Mistral (= Llama + an optional sliding window)
    for a Llama-shaped model with a window, or with n_head * head_dim != d_model (transformers'
    LlamaConfig refuses a hidden size that the head count does not divide). HFError, one line, for
    a model none of them represents: a qkv bias with q/k norm, a tensor of the layout that the
    architecture lacks, a config field config_to_hf does not write set to other than its default.
    save_hf asks (config_to_hf); train.py --save-hf asks before step 1 (rundir.Run.check)."""
    if cfg.qkv_bias and cfg.qk_norm:
        raise HFError("no transformers family has a qkv bias AND q/k norm (Qwen3's attention_bias "
                      "biases o_proj too)")
    if cfg.qk_norm:
        arch = "Qwen3ForCausalLM"
    elif cfg.qkv_bias:
        arch = "Qwen2ForCausalLM"
    elif cfg.sliding_window or cfg.d_model % cfg.n_head:
        arch = "MistralForCausalLM"
    else:
        arch = "LlamaForCausalLM"
    known = LAYER_TENSORS[ARCHS[arch]] | {"embed", "lm_head", "norm"}
    extra = [e.key for lay in units(cfg) for e in lay.entries if e.short not in known]
    if extra:
        raise HFError(f"{arch} has no tensor {extra[0]} ({len(extra)} such in the layout): "
                      "transformers would drop it and compute another model")
    defaults = GPTConfig()
    for f in fields(GPTConfig):
        value = getattr(cfg, f.name)
        if f.name not in EXPORTED and value != getattr(defaults, f.name):
            raise HFError(f"{arch}'s config.json has no place for {f.name}={value!r} "
                          "(hf.config_to_hf writes no such field)")
    return arch


def config_to_hf(cfg, dtype=torch.bfloat16):
    """The config.json of a GPTConfig, every field derived from it, for architecture(cfg)."""
    arch = architecture(cfg)
    rope = {"rope_type": "llama3" if cfg.rope_scaling else "default", "rope_theta": cfg.rope_theta,
            **(cfg.rope_scaling or {})}
    c = {"architectures": [arch], "model_type": ARCHS[arch], "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
         "num_hidden_layers": cfg.n_layer,
         "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
         "head_dim": cfg.head_dim,
         "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
         "hidden_act": cfg.hidden_act,
         "rope_theta": cfg.rope_theta,                                  # transformers v4 reads this
         "rope_parameters": rope,                                       # ... and v5 this
         "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
         "torch_dtype": str(dtype)[6:], "initializer_range": INIT_STD}
    if cfg.rope_scaling:
        c["rope_scaling"] = rope                                                  # v4's name for it
    if arch == "MistralForCausalLM":
        c["sliding_window"] = cfg.sliding_window                                 # None: no window
    elif arch != "LlamaForCausalLM":
        # Qwen: a window slides in the layers from max_window_layers on
        W = cfg.sliding_window
        c.update(use_sliding_window=W is not None, sliding_window=W,
                 max_window_layers=0 if W else cfg.n_layer,
                 layer_types=["sliding_attention" if W else "full_attention"] * cfg.n_layer)
    return c


# ----------------------------------------------------------------------------- save
def _parse_size(size):
    """5_000_000_000, "5GB" or "500MB" (decimal, as transformers' max_shard_size) -> bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?B)?", str(size).strip().upper())
    if not m:
        raise HFError(f"shard_size {size!r}: expected bytes or a size like '5GB'")
    return int(float(m[1]) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[m[2] or "B"])


def _write_safetensors(path, entries, weights, dtype):
    """One safetensors file, written tensor by tensor: entries [(key, shape)] in file order."""
    esize = torch.finfo(dtype).bits // 8
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for key, shape in entries:
        n = math.prod(shape) * esize
        header[key] = {"dtype": ST_NAME[dtype], "shape": list(shape),
                       "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                                   # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for key, shape in entries:
            t = weights[key]
            if tuple(t.shape) != tuple(shape):
                raise HFError(f"{key} has shape {list(t.shape)}, the config implies {list(shape)}")
            try:
                check_finite({key: t})                                # a NaN is never exported
            except ValueError as e:
                raise HFError(f"not exporting: {e}") from None
            t = t.detach().to("cpu", dtype).contiguous()            # one tensor in the target dtype
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


# save_hf(replaces=ANY): replace whatever check_export_dir allows at the time of writing
ANY = object()


def export_state(model_dir):
    """What save_hf would replace at model_dir now: None (nothing there), else the text of its
    export marker (each export's differs). save_hf(replaces=state) replaces only that: an export
    another run wrote there in between is kept. Take it before check_export_dir and before reading
    the weights (they take a while): what lands after it is another process's, and wins."""
    d = Path(model_dir)
    if not d.is_dir() or not any(p for p in d.iterdir() if not publish.is_staging(p)):
        return None
    try:
        return (d / EXPORT_MARKER).read_text()
    except OSError:
        return "unreadable"


def save_hf(cfg, weights, model_dir, dtype=torch.bfloat16, shard_size="5GB", tokenizer_from=None,
            replaces=ANY):
    """Write a transformers-loadable checkpoint of weights (any Mapping {key: tensor}) to model_dir.

    dtype: torch.bfloat16 or torch.float32 (an fp32 round trip is exact). Shards hold at most
    shard_size bytes (one tensor may exceed it). tokenizer_from: a directory whose tokenizer files
    (tokenizer.copy_tokenizer_files: and generation_config.json, and config.json's bos/eos/pad ids)
    are copied along. An existing model_dir is replaced only when check_export_dir allows it (empty,
    or an earlier export), and, given replaces (export_state when the caller checked it), only when
    it still holds what it held then.
    """
    if dtype not in ST_NAME:
        raise HFError("save dtype must be torch.bfloat16, torch.float16 or "
                      f"torch.float32, got {dtype}")
    out, limit = check_export_dir(model_dir), _parse_size(shard_size)
    esize = torch.finfo(dtype).bits // 8
    config = config_to_hf(cfg, dtype)
    entries = [(e.key, e.shape) for u in units(cfg) for e in u.entries]  # forward order
    shards, size = [[]], 0
    for key, shape in entries:                                 # greedy: start a new shard when full
        n = math.prod(shape) * esize
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((key, shape))
        size += n
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    old = json.loads((out / EXPORT_MARKER).read_text())["files"] if export_state(out) else []
    expect = export_state(out) if replaces is ANY else replaces
    tmp = publish.stage(out)
    try:
        for name, shard in zip(names, shards):
            _write_safetensors(tmp / name, shard, weights, dtype)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(math.prod(s) * esize for _, s in entries)},
                     "weight_map": {key: name for name, shard in zip(names, shards)
                                    for key, _ in shard}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if tokenizer_from:                             # a model directory or one of our checkpoints
            config.update(copy_tokenizer_files(tokenizer_from, tmp)["config_ids"])
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        written = sorted(p.name for p in tmp.iterdir())
        marker = {"format": "megatrain-min save_hf", "files": written, "id": uuid.uuid4().hex}
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker) + "\n")
        publish.publish(tmp, out, expect, export_state, EXPORT_MARKER, old)
    except publish.Conflict:
        raise HFError(f"{out} was written by another export while this one ran; nothing there "
                      "was replaced") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_export_dir(model_dir):
    """model_dir as a Path if save_hf may write it: it does not exist, is an empty directory, or is
    one of save_hf's exports (EXPORT_MARKER there, and no file the marker does not list). Anything
    else -- a file, another model's directory, a run's output, an export with a file added since --
    raises HFError: save_hf replaces the whole directory, and nothing that is not provably its own
    may go with it."""
    d = Path(model_dir)
    held = next((c for c in (d.absolute(), *d.absolute().parents) if ckpt_read.is_checkpoint(c)),
                None)
    if held is not None:
        beside = held.parent.parent / (held.parent.name + "-hf")
        raise HFError(f"{d} is inside checkpoint {held}, which --keep deletes whole when it "
                      f"prunes; put the export beside the run, e.g. {beside}")
    if not d.exists():
        return d
    if not d.is_dir():
        raise HFError(f"{d} exists and is not a directory; pick a new or empty "
                      "directory for the export")
    if busy := publish.writers(d):
        raise HFError(f"{d} is being written by another export (pid {busy[0]}); wait for it to "
                      f"finish, or pick another directory")
    names = sorted(p.name for p in d.iterdir() if not publish.is_staging(p))
    if not names:
        return d
    try:
        listed = json.loads((d / EXPORT_MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    if not isinstance(listed, list):
        raise HFError(f"{d} exists and is not a model directory written by save_hf (no "
                      f"{EXPORT_MARKER}); pick a new or empty directory, nothing there is replaced")
    try:                                   # the names it will remove: inside d, every one
        for name in listed:
            publish.inside(d, name)
    except publish.Unsafe as e:
        raise HFError(f"{e}; pick a new or empty directory") from None
    added = [n for n in names if n not in listed and n != EXPORT_MARKER]
    if added:
        raise HFError(f"{d} holds {added[0]!r}, which its export did not write ({len(added)} such "
                      "files); pick a new or empty directory, nothing there is replaced")
    return d


class MasterWeights(Mapping):
    """{key: fp32 CPU tensor} of a stream.Trainer's master weights, each tensor copied from the
    store as it is read (save_hf reads one at a time): an export never holds a second copy of the
    model, and nothing written into a tensor reaches the store (whose shadow would go stale)."""

    def __init__(self, trainer):
        trainer.wait()                               # no update in flight
        self.views = {k: v for u, lay in enumerate(trainer.units)
                      for k, v in lay.key_views(trainer.opt.master[u]).items()}

    def __getitem__(self, key):
        return self.views[key].to("cpu", copy=True)

    def __iter__(self):
        return iter(self.views)

    def __len__(self):
        return len(self.views)


# ----------------------------------------------------------- export: our checkpoint -> transformers
DTYPE_FLAGS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def export_source(ckpt, model_dir):
    """(cfg, weights) of checkpoint `ckpt` for an export to model_dir, after every check that needs
    no writing: ckpt is a checkpoint whose files verify (ckpt_read.read_weights), model_dir is one
    save_hf may replace (check_export_dir: so never a directory that holds ckpt). Raises
    CheckpointError or HFError, one line."""
    ckpt_read.read_meta(ckpt)         # a run directory: the message names its latest checkpoint;
    check_export_dir(model_dir)       # its tokenizer files verified against their recorded sha256
    if (Path(ckpt) / "tokenizer.json").is_file():
        try:
            HFTokenizer(ckpt)               # files that load: what the export's users will read
        except ValueError as e:
            raise HFError(f"{ckpt}'s tokenizer: {e}") from None
    return ckpt_read.read_weights(ckpt)


def export(ckpt, model_dir, dtype=torch.bfloat16):
    """Write checkpoint `ckpt` as a transformers directory (save_hf), with the tokenizer files it
    carries. model_dir is replaced only when it still holds what it held before the checkpoint was
    read (export_state first: an export another process put there meanwhile wins)."""
    state = export_state(model_dir)
    cfg, weights = export_source(ckpt, model_dir)
    return save_hf(cfg, weights, model_dir, dtype=dtype, tokenizer_from=ckpt, replaces=state)


def main(argv=None):
    """`python -m megatrain_min.hf export CKPT OUT_DIR`: exit 0 done, 2 bad input (one line, nothing
    written), 4 the export could not be written (nothing at OUT_DIR replaced)."""
    def fail(msg, code=2):
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(code)

    p = argparse.ArgumentParser(prog="python -m "
                                     "megatrain_min.hf", description="Hugging Face checkpoints "
                                                                     "out.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="one of our checkpoints -> a directory transformers loads")
    e.add_argument("ckpt", help="a checkpoint directory (OUT/ckpt-NNNNNNNN) written by "
                   "train.py / checkpoint.save")
    e.add_argument("out_dir", help="new or empty directory, or an earlier export (replaced)")
    e.add_argument("--dtype", choices=DTYPE_FLAGS, default="bf16",
                   help="tensor dtype written (default: %(default)s)")
    p.error = e.error = fail                   # argparse's complaints: one line and exit code 2 too
    survive_closed_pipe()                      # and a stdout that cannot encode a path
    a = p.parse_args(argv)
    try:   # what out_dir holds before it is checked: replaced only if it still holds it at the end
        state = export_state(a.out_dir)
        cfg, weights = export_source(a.ckpt, a.out_dir)
    except ckpt_read.CheckpointError as err:
        before = ckpt_read.before(Path(a.ckpt).absolute())
        fail(f"{err}" + (f"; the checkpoint before it may be intact: export {before}"
                         if before else ""))
    except (ValueError, OSError) as err:
        fail(str(err) if isinstance(err, ValueError) else f"{a.ckpt}: cannot read {err.filename} "
                                                          f"({err.strerror})")
    try:
        save_hf(cfg, weights, a.out_dir, dtype=DTYPE_FLAGS[a.dtype], tokenizer_from=a.ckpt,
                replaces=state)
    except ValueError as err:
        fail(str(err))
    except OSError as err:
        fail(f"could not write the export {a.out_dir} ({err.strerror or err}); nothing "
             "there was replaced", 4)
    carried = [f for f in TOKENIZER_FILES if (Path(a.out_dir) / f).is_file()]
    print(f"exported {a.ckpt} to {a.out_dir} ({a.dtype}, {sum(u.numel for u in units(cfg)):,} "
          f"params); tokenizer files: {', '.join(carried) or 'none in the checkpoint'}")
    return 0
