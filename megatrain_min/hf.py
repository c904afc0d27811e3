"""hf.py -- Hugging Face checkpoints in and out: Llama, Mistral, Qwen2 and Qwen3.

What it is
    load_hf(dir) reads config.json and model.safetensors (or the shards named by
    model.safetensors.index.json) and returns (GPTConfig, weights). `weights` is a lazy Mapping: a
    tensor is read from disk and converted to fp32 only when it is accessed, and nothing is cached,
    so
    stream.Trainer(cfg, weights) fills its host store one tensor at a time: the extra host memory is
    one fp32 tensor, the largest, plus a 64 MiB slice. Measured (python bench/hf_load_memory.py) on
    a Llama-3.2-1B-shaped bf16 checkpoint, 2-core dev machine: peak RSS 0.93-1.05 GiB above the
    store over runs (the 128256 x 2048 embedding in fp32 is 0.98 GiB), both for a 0.99B-param CPU
    Trainer (14.0 GiB store) and for the fp32 masters of the full 1.24B model (4.6 GiB).
    HFWeights.read_into(key, view) fills a store view directly: 0.03 GiB above the store.
    Every file header, key, shape and dtype is checked against config.json before a byte of data is
    read: a bad checkpoint fails before the store is allocated.
    save_hf(cfg, weights, dir) writes bf16 or fp32 safetensors shards (one tensor in memory at a
    time), the index, config.json and the tokenizer files, aside and then put in place whole
    (publish.py: an existing directory -- empty, a mount point -- is filled, never renamed), with a
    marker (EXPORT_MARKER) listing what it wrote: an existing dir is replaced only when it is empty
    or provably one of these exports and nothing more (check_export_dir; train.py asks before
    training), never inside a checkpoint (which --keep deletes whole), and only when it still holds
    what it held when checked (an export written there meanwhile, by another process, wins).
    export(ckpt, dir) / `python -m megatrain_min.hf export CKPT DIR`: one of our checkpoints
    (checkpoint.save, one process's or sharded) through save_hf, its master weights read tensor by
    tensor from the unit files (checkpoint.read_weights, CRCs verified first; no trainer, no
    optimizer state in memory), with the tokenizer files the checkpoint carries (verified:
    checkpoint.read_meta, and parsed as HFTokenizer does).
What it is not
    Not a general converter. Anything model.py does not compute fails with HFError naming it, never
    a silently different model: other architectures, mixture-of-experts, quantized weights, RoPE
    scaling other than Llama 3.1's llama3 (yarn, linear, ...), o_proj/MLP biases, activations other
    than SiLU, sliding-window attention in some layers only (Qwen's max_window_layers <
    num_hidden_layers). Sliding-window attention in every layer (Mistral's sliding_window; Qwen's
    use_sliding_window with max_window_layers 0) becomes cfg.sliding_window, and model.check_seq_len
    refuses any sequence longer than the window, in model.block and in stream.Trainer: a causal
    window of W tokens equals full causal attention for T <= W, which is what model.py computes. We
    refuse rather than implement a banded mask because SDPA's fast kernels take is_causal, not a
    band: a band means a dense T x T mask, which the long-context path (attention over the whole
    sequence through SDPA) cannot afford. So a Mistral-7B-v0.1 (window 4096) fine-tunes exactly at
    up to 4096 tokens. save_hf writes the window back: a Llama-shaped model with a window as
    MistralForCausalLM (Llama + sliding_window), a Qwen2/Qwen3 one with use_sliding_window and
    max_window_layers 0, so transformers applies the same window. Qwen with use_sliding_window and
    max_window_layers >= num_hidden_layers has no sliding layer at all (transformers' layer_types
    rule): that is plain full attention here too. Tokenizers and chat templates live in data.py
    (HFTokenizer) and chat.py; save_hf only copies their files.
Reference
    transformers' modeling_llama / mistral / qwen2 / qwen3 (model.py names its weights like them, so
    this is a rename-free copy); the safetensors format: 8-byte little-endian header length, a JSON
    header {name: {dtype, shape, data_offsets}}, then the raw little-endian bytes.
Try it
    python -m megatrain_min.hf export out/ckpt-00000400 my-model [--dtype bf16|fp32]
    python -m pytest tests/test_hf.py tests/test_export.py   # vs transformers, round trips, errors
    python bench/hf_load_memory.py              # peak extra RSS while loading a ~1B bf16 checkpoint
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
from pathlib import Path

import torch
from safetensors import safe_open

from model import HEAD, GPTConfig, units
from megatrain_min import checkpoint, publish
from megatrain_min.cli import survive_closed_pipe
from megatrain_min.checks import check_config, check_finite
from megatrain_min.tokenizer import TOKENIZER_FILES, HFTokenizer, copy_tokenizer_files

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
         "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
ST_NAME = {v: k for k, v in DTYPES.items()}
# bytes of fp32 per converted slice: bounds what a read makes beside its destination
CHUNK = 64 << 20
# {"format", "files"}: what save_hf wrote into the directory
EXPORT_MARKER = "megatrain-min-export.json"


class HFError(ValueError):
    """A checkpoint or config that this file cannot load or write. The message is one line, for a
    human."""


# ------------------------------------------------------------------------- config.json -> GPTConfig
def config_from_hf(c, where="config.json"):
    """Translate a transformers config dict into a GPTConfig, or raise HFError naming what is
    unsupported."""
    archs = c.get("architectures")
    # a bare string too
    archs = [archs] if isinstance(archs, str) else archs if isinstance(archs, list) else []
    arch = next((a for a in archs if isinstance(a, str)), None) or c.get("model_type", "?")
    if not isinstance(arch, str):
        raise HFError(f"{where}: \"architectures\" and \"model_type\" name no architecture; "
                      f"supported: {', '.join(ARCHS)}")
    # an architecture or a model_type
    family = ARCHS.get(arch) or (arch if arch in ARCHS.values() else None)
    if family is None:
        moe = "Moe" in arch or "Mixtral" in arch or c.get("num_experts") \
            or c.get("num_local_experts")
        raise HFError(f"{where}: {'mixture-of-experts ' if moe else ''}architecture {arch} is not "
                      f"supported; supported: {', '.join(ARCHS)}")

    def unsupported(feature):
        raise HFError(f"{where}: {arch} with {feature} is not supported "
                      "(model.py does not compute it)")

    if c.get("quantization_config"):
        unsupported(f"quantization ({c['quantization_config'].get('quant_method', '?')})")
    if c.get("hidden_act", "silu") != "silu":
        unsupported(f"hidden_act={c['hidden_act']}")
    if family != "qwen2" and c.get("attention_bias"):
        unsupported("attention_bias=true (a bias on o_proj too)")
    if c.get("mlp_bias"):
        unsupported("mlp_bias=true")
    # RoPE: transformers reads rope_scaling (legacy) before rope_parameters (v5); theta may sit at
    # top level
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None, "llama3"):
        unsupported(f"rope scaling type {rope_type!r}")
    max_len = c.get("max_position_embeddings", 4096)
    scaling = None
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
        if missing:
            unsupported(f"a llama3 rope scaling without {missing}")
        # the original context defaults as in transformers' standardize_rope_params (a top-level
        # value wins)
        orig = c.get("original_max_position_embeddings",
                     rope.get("original_max_position_embeddings", max_len))
        scaling = {"factor": rope["factor"], "low_freq_factor": rope["low_freq_factor"],
                   "high_freq_factor": rope["high_freq_factor"],
                   "original_max_position_embeddings": orig}
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        unsupported("partial_rotary_factor")
    # sliding window, by transformers' rule: Mistral slides in every layer when sliding_window is
    # set; Qwen2/3 only with use_sliding_window, and then in layer_types' layers (default: from
    # max_window_layers on)
    n_layer = c.get("num_hidden_layers", 0)
    layer_types = c.get("layer_types") or []
    if set(layer_types) - {"full_attention", "sliding_attention"}:
        unsupported(f"layer_types {sorted(set(layer_types))}")
    window = c.get("sliding_window") if family == "mistral" or (
        family != "llama" and c.get("use_sliding_window")) else None
    if window is not None and family != "mistral":
        first = c.get("max_window_layers", 28)
        slides = [t == "sliding_attention"
                  for t in layer_types] or [i >= first for i in range(n_layer)]
        if not any(slides):
            window = None                    # transformers: full attention in every layer
        elif not all(slides):
            unsupported(f"sliding-window attention in {sum(slides)} of {len(slides)} layers only "
                        f"(max_window_layers={first}; per-layer attention is not implemented)")
    n_head = c["num_attention_heads"]
    try:
        return check_config(GPTConfig(
            vocab_size=c["vocab_size"], n_layer=c["num_hidden_layers"], n_head=n_head,
            n_kv_head=c.get("num_key_value_heads") or n_head, d_model=c["hidden_size"],
            d_ff=c["intermediate_size"], head_dim=c.get("head_dim") or c["hidden_size"] // n_head,
            max_seq_len=max_len, rope_theta=float(
                rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            norm_eps=c.get("rms_norm_eps", 1e-6), qkv_bias=family == "qwen2",
                                      qk_norm=family == "qwen3",
            tie_embeddings=bool(c.get("tie_word_embeddings", False)), rope_scaling=scaling,
            sliding_window=int(window) if window is not None else None))
    except KeyError as e:
        raise HFError(f"{where}: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise HFError(f"{where}: {e}") from None


def config_to_hf(cfg, dtype=torch.bfloat16):
    """The config.json of a GPTConfig: Llama, Qwen2 when it has a qkv bias, Qwen3 when it has q/k
    norm; Mistral (= Llama + an optional sliding window) for a Llama-shaped model with a window, or
    with n_head * head_dim != d_model (transformers' LlamaConfig refuses a hidden size that the head
    count does not divide)."""
    if cfg.qkv_bias and cfg.qk_norm:
        raise HFError("no transformers family has a qkv bias AND q/k norm (Qwen3's attention_bias "
                      "biases o_proj too)")
    arch = ("Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM" if cfg.qkv_bias else
            "MistralForCausalLM" if cfg.sliding_window or cfg.d_model % cfg.n_head
            else "LlamaForCausalLM")
    rope = {"rope_type": "llama3" if cfg.rope_scaling else "default", "rope_theta": cfg.rope_theta,
            **(cfg.rope_scaling or {})}
    c = {"architectures": [arch], "model_type": ARCHS[arch], "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
         "num_hidden_layers": cfg.n_layer,
         "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
         "head_dim": cfg.head_dim,
         "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
         "hidden_act": "silu",
         "rope_theta": cfg.rope_theta,                                  # transformers v4 reads this
         "rope_parameters": rope,                                       # ... and v5 this
         "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
         "torch_dtype": str(dtype)[6:], "initializer_range": 0.02}
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


# ----------------------------------------------------------------------------- load
def _first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _headers(d):
    """{key: (file, shape, dtype name)} from the safetensors headers in directory d (no data is
    read)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise HFError(f"{index}: not a safetensors index ({_first_line(e)})") from None
        if not (isinstance(weight_map, dict)
                and all(isinstance(k, str) and isinstance(v, str) and "/" not in v
                                                     for k, v in weight_map.items())):
            raise HFError(f"{index}: \"weight_map\" must map each tensor name to a shard file name "
                          f"in {d}, got {type(weight_map).__name__}")
        files = sorted(set(weight_map.values()))
    elif (d / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise HFError(f"{d}: no model.safetensors or model.safetensors.index.json "
                      "(pytorch_model.bin is not read: pickle runs code; re-save with "
                      "safe_serialization=True)")
    found = {}
    for name in files:
        path = d / name
        if not path.is_file():
            raise HFError(f"{d}: shard {name} named in model.safetensors.index.json is missing")
        try:
            with safe_open(path, framework="pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    found[k] = (path, tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # safetensors raises its own error type for a corrupt header
            raise HFError(f"{path}: not a readable safetensors file ({_first_line(e)})") from None
    for k, name in (weight_map or {}).items():
        if found.get(k, (None,))[0] != d / name:
            raise HFError(f"{d / name}: has no tensor {k} although "
                          "model.safetensors.index.json says so")
    return found


class HFWeights(Mapping):
    """{key: fp32 CPU tensor}, read from the safetensors files on every access (nothing is cached).

    Iterates in forward order (units(cfg)), the order in which Trainer copies weights into its
    store.
    """

    def __init__(self, where):
        self.where = where   # {key: (file, shape)}, already checked against the config

    def __getitem__(self, key):
        # the one temporary
        return self.read_into(key, torch.empty(self.where[key][1], dtype=torch.float32))

    def read_into(self, key, out):
        """Copy tensor `key` into `out` (e.g. a view of a host store: then no full-size temporary at
        all), converting bf16/fp16 rows to out's dtype one CHUNK of the file at a time. Returns
        out."""
        path, shape = self.where[key]
        rows = max(1, CHUNK // max(1, math.prod(shape[1:]) * 4))
        for a in range(0, shape[0], rows):
            # reopened per slice: the file is mmapped, and its
            with safe_open(path, framework="pt") as f:
                # pages would count as ours until closed
                out[a:a + rows] = f.get_slice(key)[a:a + rows]
        return out

    def __contains__(self, key):  # Mapping's default would read the tensor
        return key in self.where

    def __iter__(self):
        return iter(self.where)

    def __len__(self):
        return len(self.where)


def load_hf(model_dir):
    """(GPTConfig, HFWeights) of a transformers checkpoint directory; HFError for anything
    unsupported."""
    d = Path(model_dir)
    runs = sorted(d.glob("ckpt-*/meta.json"))
    if runs:                                            # a run's output directory, not a model
        raise HFError(f"{d} is a training run's output directory; pass one of its checkpoints, "
                      f"e.g. {runs[-1].parent}")
    if not (d / "config.json").is_file():
        raise HFError(f"{d}: no config.json (expected a Hugging Face model directory)")
    try:
        c = json.loads((d / "config.json").read_text())
    except ValueError as e:
        raise HFError(f"{d / 'config.json'}: not valid JSON ({_first_line(e)})") from None
    if not isinstance(c, dict):
        raise HFError(f"{d / 'config.json'}: expected a JSON object, got {type(c).__name__}")
    found = _headers(d)
    if c.get("tie_word_embeddings") is None:   # some configs leave it out: the files then tell
        c["tie_word_embeddings"] = HEAD not in found
    try:
        cfg = config_from_hf(c, d / "config.json")
    except HFError:
        raise
    except (AttributeError, TypeError, ValueError, ZeroDivisionError) as e:
        # a field of the wrong type
        raise HFError(f"{d / 'config.json'}: a field has the wrong type or value "
                      f"({_first_line(e)})") from None
    expected = {e.key: e.shape for u in units(cfg) for e in u.entries}
    for key, shape in expected.items():
        if key not in found:
            raise HFError(f"{d}: tensor {key} is missing from the checkpoint")
        _, got, dt = found[key]
        if got != shape:
            raise HFError(f"{d}: {key} has shape {list(got)}, config.json implies {list(shape)}")
        if dt not in DTYPES:
            raise HFError(f"{d}: {key} is stored as {dt}; only F32, BF16 and F16 are read")
    extra = [k for k in found if k not in expected and not k.endswith("rotary_emb.inv_freq")
             # a tied lm_head copy is ignored, as transformers does
             and not (k == HEAD and cfg.tie_embeddings)]
    if extra:
        raise HFError(f"{d}: unexpected tensor {extra[0]} ({len(extra)} in all): a feature "
                      "model.py does not have")
    return cfg, HFWeights({key: (found[key][0], shape) for key, shape in expected.items()})


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
    another run wrote there in between is kept."""
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
    held = next((c for c in (d.absolute(), *d.absolute().parents) if checkpoint.is_checkpoint(c)),
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
    added = [n for n in names if n not in listed and n != EXPORT_MARKER]
    if added:
        raise HFError(f"{d} holds {added[0]!r}, which its export did not write ({len(added)} such "
                      "files); pick a new or empty directory, nothing there is replaced")
    return d


# ----------------------------------------------------------- export: our checkpoint -> transformers
DTYPE_FLAGS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def export_source(ckpt, model_dir):
    """(cfg, weights) of checkpoint `ckpt` for an export to model_dir, after every check that needs
    no writing: ckpt is a checkpoint whose files verify (checkpoint.read_weights), model_dir is one
    save_hf may replace (check_export_dir: so never a directory that holds ckpt). Raises
    CheckpointError or HFError, one line."""
    checkpoint.read_meta(ckpt)        # a run directory: the message names its latest checkpoint;
    check_export_dir(model_dir)       # its tokenizer files verified against their recorded sha256
    if (Path(ckpt) / "tokenizer.json").is_file():
        try:
            HFTokenizer(ckpt)               # files that load: what the export's users will read
        except ValueError as e:
            raise HFError(f"{ckpt}'s tokenizer: {e}") from None
    return checkpoint.read_weights(ckpt)


def export(ckpt, model_dir, dtype=torch.bfloat16):
    """Write checkpoint `ckpt` as a transformers directory (save_hf), with the tokenizer files it
    carries."""
    cfg, weights = export_source(ckpt, model_dir)
    return save_hf(cfg, weights, model_dir, dtype=dtype, tokenizer_from=ckpt)


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
    try:
        cfg, weights = export_source(a.ckpt, a.out_dir)
        state = export_state(a.out_dir)        # replaced only if it still holds this at the end
    except checkpoint.CheckpointError as err:
        before = checkpoint.before(Path(a.ckpt).absolute())
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


if __name__ == "__main__":
    sys.exit(main())
