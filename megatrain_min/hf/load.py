"""hf_load.py -- Hugging Face checkpoints in: Llama, Mistral, Qwen2 and Qwen3, read lazily.

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
    config_from_hf(c) is the translation of config.json into a GPTConfig. The families (ARCHS), the
    dtypes read (DTYPES) and HFError are shared with the way out, hf.py (save_hf, config_to_hf,
    export and `python -m megatrain_min.hf export`), which imports them from here.
What it is not
    Not a general converter. Anything model.py does not compute fails with HFError naming it, never
    a silently different model: other architectures, mixture-of-experts, quantized weights, RoPE
    scaling other than Llama 3.1's llama3 (yarn, linear, ...), o_proj/MLP biases, activations not
    in model.ACTIVATIONS, sliding-window attention in some layers only (Qwen's max_window_layers
    < num_hidden_layers). Sliding-window attention in every layer (Mistral's sliding_window; Qwen's
    use_sliding_window with max_window_layers 0) becomes cfg.sliding_window, and model.check_seq_len
    refuses any sequence longer than the window, in model.block and in stream.Trainer: a causal
    window of W tokens equals full causal attention for T <= W, which is what model.py computes. We
    refuse rather than implement a banded mask because SDPA's fast kernels take is_causal, not a
    band: a band means a dense T x T mask, which the long-context path (attention over the whole
    sequence through SDPA) cannot afford. So a Mistral-7B-v0.1 (window 4096) fine-tunes exactly at
    up to 4096 tokens (hf.save_hf writes the window back). Qwen with use_sliding_window and
    max_window_layers >= num_hidden_layers has no sliding layer at all (transformers' layer_types
    rule): that is plain full attention here too. Not pytorch_model.bin (pickle runs code). The
    tokenizer is tokenizer.py's (HFTokenizer).
Reference
    transformers' modeling_llama / mistral / qwen2 / qwen3 (model.py names its weights like them, so
    this is a rename-free copy); the safetensors format: 8-byte little-endian header length, a JSON
    header {name: {dtype, shape, data_offsets}}, then the raw little-endian bytes.
Try it
    python -m pytest tests/hf/test_hf.py           # vs transformers, round trips, errors
    python bench/hf_load_memory.py              # peak extra RSS while loading a ~1B bf16 checkpoint
"""
import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from model import ACTIVATIONS, HEAD, GPTConfig, units
from megatrain_min.engine.checks import check_config

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
         "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# bytes of fp32 per converted slice: bounds what a read makes beside its destination
CHUNK = 64 << 20
# transformers' own defaults (its LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config) for the
# keys config_from_hf reads and a config.json may leave out: a missing key means here what it means
# there. None: derived, as there (num_key_value_heads: num_attention_heads; head_dim: hidden_size //
# num_attention_heads). tests/hf/test_hf.py deletes each key and compares with transformers.
HF_COMMON = dict(rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", head_dim=None,
                 max_window_layers=28, use_sliding_window=False, sliding_window=4096)
HF_DEFAULTS = {
    "llama": dict(HF_COMMON, max_position_embeddings=2048, num_key_value_heads=None),
    "mistral": dict(HF_COMMON, max_position_embeddings=4096 * 32, num_key_value_heads=8),
    "qwen2": dict(HF_COMMON, max_position_embeddings=32768, num_key_value_heads=32),
    "qwen3": dict(HF_COMMON, max_position_embeddings=32768, num_key_value_heads=32, head_dim=128),
}


class HFError(ValueError):
    """A checkpoint or config that cannot be loaded (this file) or written (hf.py). The message is
    one line, for a human."""


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

    def get(key):
        """config.json's value of key, or transformers' default for this family."""
        return c.get(key, HF_DEFAULTS[family][key])

    if c.get("quantization_config"):
        unsupported(f"quantization ({c['quantization_config'].get('quant_method', '?')})")
    if get("hidden_act") not in ACTIVATIONS:
        unsupported(f"hidden_act={get('hidden_act')}")
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
    max_len = get("max_position_embeddings")
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
    window = get("sliding_window") if family == "mistral" or (
        family != "llama" and get("use_sliding_window")) else None
    if window is not None and family != "mistral":
        first = get("max_window_layers")
        slides = [t == "sliding_attention"
                  for t in layer_types] or [i >= first for i in range(n_layer)]
        if not any(slides):
            window = None                    # transformers: full attention in every layer
        elif not all(slides):
            unsupported(f"sliding-window attention in {sum(slides)} of {len(slides)} layers only "
                        f"(max_window_layers={first}; per-layer attention is not implemented)")
    try:
        n_head = c["num_attention_heads"]
        return check_config(GPTConfig(
            vocab_size=c["vocab_size"], n_layer=c["num_hidden_layers"], n_head=n_head,
            n_kv_head=get("num_key_value_heads") or n_head, d_model=c["hidden_size"],
            d_ff=c["intermediate_size"], hidden_act=get("hidden_act"),
            head_dim=get("head_dim") or c["hidden_size"] // n_head,
            max_seq_len=max_len, rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
            norm_eps=get("rms_norm_eps"), qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
            tie_embeddings=bool(c.get("tie_word_embeddings", False)), rope_scaling=scaling,
            sliding_window=int(window) if window is not None else None))
    except KeyError as e:
        raise HFError(f"{where}: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise HFError(f"{where}: {e}") from None


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
