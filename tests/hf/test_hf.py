"""megatrain_min/hf/load.py and hf.py (in and out) against Hugging Face transformers (the oracle), on tiny
random models made here.

Tolerances (below, each about 10x the difference measured on the dev machine, the measurement beside it): our
logits vs transformers' on the same weights (fp32, CPU; the two compute attention differently), save_hf output
loaded by transformers vs our logits; fp32 round trip exact; 3 steps of stream.Trainer vs transformers +
torch.optim.AdamW: per-step loss, and weight updates by the norm of their difference. Every relative difference
is max|a - b| / max|b| (conftest.check_close: a failure names the family, the tensor and the worst element) and
is printed (pytest -s).
"""
import dataclasses
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config  # noqa: E402

import model  # noqa: E402
from conftest import check_close, check_loss, check_updates, engine, random_batch, rel_diff  # noqa: E402
from megatrain_min import hf  # noqa: E402
from megatrain_min.engine import checks  # noqa: E402
from megatrain_min.hf import load as hf_load  # noqa: E402
from megatrain_min.hf import save_hf  # noqa: E402
from megatrain_min.hf.load import HFError, load_hf  # noqa: E402

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, rms_norm_eps=1e-5)
FAMILIES = {  # each family with the feature it brings
    "llama-gqa": lambda: LlamaConfig(**BASE, num_key_value_heads=2, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # Llama 3.1/3.2's long-context RoPE; original context 32 with head_dim 16 puts frequencies in all
    # three bands (kept, blended, slowed down)
    "llama3.2-rope-tied": lambda: LlamaConfig(**BASE, num_key_value_heads=2, tie_word_embeddings=True,
                                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                               "factor": 8.0, "low_freq_factor": 1.0,
                                                               "high_freq_factor": 4.0,
                                                               "original_max_position_embeddings": 32}),
    "mistral": lambda: MistralConfig(**BASE, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False),
    "qwen2-bias-tied": lambda: Qwen2Config(**BASE, num_key_value_heads=4, tie_word_embeddings=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3-qknorm-headdim": lambda: Qwen3Config(**BASE, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
    "llama-gelu-tanh": lambda: LlamaConfig(**BASE, num_key_value_heads=2, hidden_act="gelu_pytorch_tanh"),
}


def make_hf(path, hf_cfg, dtype=torch.float32, seed=0, **save_kw):
    """A random transformers model (norms and biases random too, so every tensor matters), saved to path."""
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    m.to(dtype).save_pretrained(path, **save_kw)
    return path


def hf_model(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# Bounds: about 10x the worst difference measured on the 2-core dev machine (torch 2.13 CPU, transformers 5.23);
# re-measure with `python -m pytest -s -v tests/hf/test_hf.py | grep measured`.
# Our logits vs transformers' on the same weights, and save_hf's directory in transformers vs our logits: measured
# 0 in every case (bit-identical: the same ops in the same order); 1e-6 is a few fp32 roundings, room for a
# transformers release that reorders one
LOGITS = 1e-6
SAVED = 1e-6
LOSS = 1e-6      # stream.Trainer vs transformers + torch.optim.AdamW, per-step loss: measured 9.6e-8
# the same, weight updates after 3 steps, per family: measured 9.8e-7, 1.3e-4 (Qwen2's biases: Adam magnifies
# the rounding of their near-zero gradients), 2.0e-6
UPDATES = {"llama-gqa": 1e-5, "qwen2-bias-tied": 1.3e-3, "qwen3-qknorm-headdim": 2e-5}


def tokens(cfg, T=16, seed=0):
    return torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the model maths
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tmp_path, family):
    d = make_hf(tmp_path / "hf", FAMILIES[family]())
    cfg, w = load_hf(d)
    x = tokens(cfg)
    with torch.no_grad():
        ours, theirs = model.forward(cfg, w, x), hf_model(d)(x).logits
    check_close(f"{family}: logits", ours, theirs, LOGITS)


def test_config_translation(tmp_path):
    cfg, w = load_hf(make_hf(tmp_path / "q3", FAMILIES["qwen3-qknorm-headdim"]()))
    assert list(w) == [e.key for u in model.units(cfg) for e in u.entries]   # forward order
    assert (cfg.head_dim, cfg.n_kv_head, cfg.qk_norm, cfg.qkv_bias, cfg.tie_embeddings) == (24, 2, True, False, False)
    cfg, _ = load_hf(make_hf(tmp_path / "q2", FAMILIES["qwen2-bias-tied"]()))
    assert (cfg.qkv_bias, cfg.tie_embeddings, cfg.rope_theta) == (True, True, 1e6)


def test_rope_theta_top_level(tmp_path):
    """Older configs keep rope_theta at the top level (and rope_scaling: null) instead of rope_parameters."""
    d = make_hf(tmp_path / "hf", FAMILIES["llama-gqa"]())
    c = json.loads((d / "config.json").read_text())
    c.pop("rope_parameters")
    c.update(rope_theta=500000.0, rope_scaling=None)
    (d / "config.json").write_text(json.dumps(c))
    cfg, w = load_hf(d)
    assert cfg.rope_theta == 500000.0
    x = tokens(cfg)
    with torch.no_grad():
        check_close("logits", model.forward(cfg, w, x), hf_model(d)(x).logits, LOGITS)


WINDOWED = {  # a window of 8 in every layer
    "mistral": lambda: MistralConfig(**BASE, num_key_value_heads=2, sliding_window=8),
    "qwen2": lambda: Qwen2Config(**BASE, num_key_value_heads=4, use_sliding_window=True, sliding_window=8,
                                 max_window_layers=0),
}


@pytest.mark.parametrize("kind", WINDOWED)
def test_sliding_window_is_kept_and_longer_input_refused(tmp_path, kind):
    """A window of W tokens is full causal attention for T <= W: logits match there, before and after save_hf
    (which writes the window back, so transformers applies it too). T > W is refused by model.forward and by
    both Trainer entry points, where transformers' banded attention would differ from ours."""
    d = make_hf(tmp_path / "hf", WINDOWED[kind]())
    cfg, w = load_hf(d)
    assert (cfg.sliding_window, cfg.max_seq_len) == (8, 64)           # the window, not a clamped context
    x = tokens(cfg, T=8)
    with torch.no_grad():
        check_close("logits", model.forward(cfg, w, x), hf_model(d)(x).logits, LOGITS)
    long = tokens(cfg, T=9)
    with pytest.raises(ValueError, match="9 tokens is longer than this model's sliding window of 8"):
        model.forward(cfg, w, long)
    t = engine(cfg, w, device="cpu")
    for call in (t.step, t.evaluate):
        with pytest.raises(ValueError, match="sliding window of 8"):
            call(long, long)
    # the export keeps the window: same config back, and transformers slides it over the saved model
    out = save_hf(cfg, w, tmp_path / "out", dtype=torch.float32)
    assert load_hf(out)[0] == cfg
    theirs = hf_model(out)
    assert theirs.config.sliding_window == 8
    with torch.no_grad():
        check_close(f"{kind}: saved, logits", theirs(x).logits, model.forward(cfg, w, x), SAVED)
        x16 = tokens(cfg, T=16)
        full = model.forward(dataclasses.replace(cfg, sliding_window=None), w, x16)   # what we would compute
        r = rel_diff(full, theirs(x16).logits)
    print(f"{kind}: at T=16 full attention differs from the window of 8 by {r:.1e}")
    assert r > 1e-3


def test_qwen_window_in_no_layer_is_full_attention(tmp_path):
    """use_sliding_window with max_window_layers >= num_hidden_layers: transformers slides in no layer."""
    d = make_hf(tmp_path / "hf", Qwen2Config(**BASE, num_key_value_heads=4, use_sliding_window=True, sliding_window=8,
                                             max_window_layers=2))
    cfg, w = load_hf(d)
    assert cfg.sliding_window is None and cfg.max_seq_len == 64
    x = tokens(cfg, T=24)
    with torch.no_grad():
        check_close("logits", model.forward(cfg, w, x), hf_model(d)(x).logits, LOGITS)


def test_qwen_window_in_some_layers_is_refused(tmp_path):
    d = make_hf(tmp_path / "hf", Qwen2Config(**BASE, num_key_value_heads=4, use_sliding_window=True, sliding_window=8,
                                             max_window_layers=1))
    with pytest.raises(HFError, match="sliding-window attention in 1 of 2 layers only"):
        load_hf(d)


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_explicit_head_dim_need_not_divide_hidden_size(tmp_path, family):
    """head_dim given in config.json: 6 heads of 16 on a hidden size of 64 (q is 96 wide). transformers' Mistral
    and Qwen3 take it (its Llama refuses it, so save_hf writes such a Llama-shaped model as a Mistral)."""
    kw = dict(BASE, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    d = make_hf(tmp_path / "hf", MistralConfig(**kw, sliding_window=None) if family == "mistral" else Qwen3Config(**kw))
    cfg, w = load_hf(d)
    assert (cfg.n_head, cfg.head_dim, cfg.d_model) == (6, 16, 64)
    x = tokens(cfg)
    with torch.no_grad():
        check_close("logits", model.forward(cfg, w, x), hf_model(d)(x).logits, LOGITS)
        out = save_hf(cfg, w, tmp_path / "out", dtype=torch.float32)
        assert load_hf(out)[0] == cfg
        check_close(f"{family}: saved, logits", hf_model(out)(x).logits, model.forward(cfg, w, x), SAVED)
    with pytest.raises(ValueError, match="does not divide d_model"):       # a derived head_dim still must
        checks.check_config(model.GPTConfig(d_model=64, n_head=6, n_kv_head=2))


def test_llama3_rope_without_original_context(tmp_path):
    """llama3 RoPE scaling without original_max_position_embeddings: transformers takes max_position_embeddings."""
    d = make_hf(tmp_path / "hf", FAMILIES["llama3.2-rope-tied"]())
    c = json.loads((d / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        if c.get(key):
            c[key].pop("original_max_position_embeddings", None)
    c["rope_parameters"]["rope_theta"] = 10000.0      # with a context of 64, frequencies in all three bands
    (d / "config.json").write_text(json.dumps(c))
    cfg, w = load_hf(d)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 64
    x = tokens(cfg, T=32)
    with torch.no_grad():
        check_close("logits", model.forward(cfg, w, x), hf_model(d)(x).logits, LOGITS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_source(tmp_path, dtype, monkeypatch):
    """bf16/fp16 tensors on disk come out as fp32 holding exactly the stored values (read in slices)."""
    monkeypatch.setattr(hf_load, "CHUNK", 1000)         # several slices per tensor, as for a real model
    d = make_hf(tmp_path / "hf", FAMILIES["qwen2-bias-tied"](), dtype=dtype)
    cfg, w = load_hf(d)
    ref = hf_model(d)                              # transformers upcasts the same stored values
    sd = ref.state_dict()
    for k in w:
        assert w[k].dtype == torch.float32 and torch.equal(w[k], sd[k])
        assert torch.equal(w.read_into(k, torch.zeros(w[k].shape)), sd[k])   # straight into a store view
    x = tokens(cfg)
    with torch.no_grad():
        check_close("logits", model.forward(cfg, w, x), ref(x).logits, LOGITS)


def test_sharded_transformers_checkpoint(tmp_path):
    d = make_hf(tmp_path / "hf", FAMILIES["llama-gqa"](), max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").is_file()
    cfg, w = load_hf(d)
    x = tokens(cfg)
    with torch.no_grad():
        check_close("logits", model.forward(cfg, w, x), hf_model(d)(x).logits, LOGITS)


# ----------------------------------------------------------------------------- a key left out: transformers' default
SIZES = dict(vocab_size=101, intermediate_size=96, num_hidden_layers=2)
# Each family made from transformers' own class defaults (sizes aside), its head count chosen so that no two
# defaults coincide (Mistral's 8 key/value heads and Qwen's 32 are not the head count): every key config_from_hf
# reads then holds transformers' default, and deleting one must leave the same model.
AT_DEFAULTS = {
    "llama": lambda: LlamaConfig(**SIZES, hidden_size=64, num_attention_heads=4),
    "mistral": lambda: MistralConfig(**SIZES, hidden_size=64, num_attention_heads=16),
    "qwen2": lambda: Qwen2Config(**SIZES, hidden_size=128, num_attention_heads=64),
    "qwen2-window": lambda: Qwen2Config(**SIZES, hidden_size=128, num_attention_heads=64, use_sliding_window=True,
                                        max_window_layers=0),
    "qwen3": lambda: Qwen3Config(**SIZES, hidden_size=128, num_attention_heads=64),
}
DEFAULTED = ("rms_norm_eps", "max_position_embeddings", "num_key_value_heads", "head_dim", "hidden_act",
             "rope_parameters", "rope_theta", "tie_word_embeddings", "sliding_window", "use_sliding_window",
             "max_window_layers", "layer_types", "attention_bias", "mlp_bias", "partial_rotary_factor")


def as_transformers_reads_it(t):
    """Our GPTConfig's fields, as transformers' config object t (AutoConfig) sets them."""
    window = getattr(t, "sliding_window", None)
    if t.model_type != "mistral" and "sliding_attention" not in (getattr(t, "layer_types", None) or []):
        window = None                                        # Llama has none; Qwen slides only in those layers
    return dict(norm_eps=t.rms_norm_eps, max_seq_len=t.max_position_embeddings, n_kv_head=t.num_key_value_heads,
                head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
                hidden_act=t.hidden_act, rope_theta=t.rope_parameters["rope_theta"],
                tie_embeddings=t.tie_word_embeddings, sliding_window=window)


@pytest.mark.parametrize("family", AT_DEFAULTS)
def test_a_key_left_out_means_transformers_default(tmp_path, family):
    """config.json with one key deleted (each key config_from_hf has a default for, in turn) is read as transformers
    reads the same file: its own class default, per family (hf_load.HF_DEFAULTS)."""
    AT_DEFAULTS[family]().save_pretrained(tmp_path)
    full = json.loads((tmp_path / "config.json").read_text())
    tried = [k for k in DEFAULTED if k in full]
    assert {"rms_norm_eps", "max_position_embeddings", "num_key_value_heads", "hidden_act"} <= set(tried)
    for key in tried:
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != key}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = as_transformers_reads_it(transformers.AutoConfig.from_pretrained(tmp_path))
        ours = hf_load.config_from_hf({k: v for k, v in full.items() if k != key})
        got = {k: getattr(ours, k) for k in theirs}
        assert got == theirs, f"{family} without {key!r}: {got} here, {theirs} in transformers"


def test_tie_left_out_of_an_untied_checkpoint(tmp_path):
    """tie_word_embeddings left out of an untied checkpoint: untied, as in transformers (its default is False). One
    departure, kept on purpose: a checkpoint with no lm_head.weight and no tie_word_embeddings loads tied here,
    where transformers would start a random head."""
    d = make_hf(tmp_path / "hf", FAMILIES["llama-gqa"]())
    c = json.loads((d / "config.json").read_text())
    c.pop("tie_word_embeddings")
    (d / "config.json").write_text(json.dumps(c))
    cfg, w = load_hf(d)
    assert cfg.tie_embeddings is False is hf_model(d).config.tie_word_embeddings
    x = tokens(cfg)
    with torch.no_grad():
        check_close("logits", model.forward(cfg, w, x), hf_model(d)(x).logits, LOGITS)


# ----------------------------------------------------------------------------- save_hf
@pytest.mark.parametrize("family", FAMILIES)
def test_save_hf_loads_in_transformers(tmp_path, family):
    cfg, w = load_hf(make_hf(tmp_path / "src", FAMILIES[family]()))
    out = save_hf(cfg, w, tmp_path / "out", dtype=torch.float32)
    x = tokens(cfg)
    with torch.no_grad():
        check_close(f"{family}: saved, logits", hf_model(out)(x).logits, model.forward(cfg, w, x), SAVED)


@pytest.mark.parametrize("shard_size", ["5GB", 30_000], ids=["one-file", "sharded"])
def test_fp32_round_trip_is_exact(tmp_path, shard_size):
    cfg = model.GPTConfig(vocab_size=50, n_layer=3, n_head=4, n_kv_head=2, d_model=32, d_ff=48, head_dim=16,
                          qk_norm=True, tie_embeddings=True, rope_theta=12345.0, norm_eps=1e-6, max_seq_len=32)
    w = model.init_weights(cfg, seed=1)
    out = save_hf(cfg, w, tmp_path / "out", dtype=torch.float32, shard_size=shard_size)
    assert (out / "model.safetensors.index.json").is_file() == (shard_size != "5GB")
    assert (len(list(out.glob("*.safetensors"))) > 2) == (shard_size != "5GB")
    cfg2, w2 = load_hf(out)
    assert cfg2 == cfg
    assert list(w2) == list(w) and all(torch.equal(w2[k], w[k]) for k in w)
    save_hf(cfg, w2, out, dtype=torch.float32)     # an earlier export is replaced
    assert not (out / "model.safetensors.index.json").is_file() and not list(tmp_path.glob(".*"))


def test_bf16_save_and_tokenizer_files(tmp_path):
    cfg, w = load_hf(make_hf(tmp_path / "src", FAMILIES["llama-gqa"]()))
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    (tmp_path / "src" / "additional_chat_templates").mkdir()
    (tmp_path / "src" / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    out = save_hf(cfg, w, tmp_path / "out", tokenizer_from=tmp_path / "src")
    assert (out / "tokenizer.json").read_text() == "{}"
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ tools }}"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, w2 = load_hf(out)
    assert all(torch.equal(w2[k], w[k].bfloat16().float()) for k in w)


# ----------------------------------------------------------------------------- what the export can represent
OTHER = {"rope_scaling": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=16), "sliding_window": 8}


def another(name, value):
    """A value of config field `name` other than `value`."""
    if name in OTHER:
        return OTHER[name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2
    return {"silu": "gelu"}.get(value, "silu")


def test_every_config_field_reaches_config_json_or_is_refused():
    """config_to_hf derives config.json from every field of GPTConfig: each field changed alone changes config.json,
    or the export refuses the model (hf.architecture) -- never the same file for another model."""
    base = model.GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, max_seq_len=64)
    written = hf.config_to_hf(base)
    for f in dataclasses.fields(model.GPTConfig):
        cfg = dataclasses.replace(base, **{f.name: another(f.name, getattr(base, f.name))})
        try:
            assert hf.config_to_hf(cfg) != written, f"{f.name} changed, config.json did not"
        except HFError as e:
            print(f"{f.name}: refused ({e})")


def test_export_refuses_what_the_architecture_cannot_represent(tmp_path, monkeypatch):
    """A model no transformers family computes is refused by save_hf in one line, nothing written: a qkv bias with
    q/k norm; a tensor the architecture has no place for (a per-layer gate added to the layout); a config field
    config_to_hf does not write, at other than its default."""
    cases = {"qkv bias AND q/k norm": (model.GPTConfig(vocab_size=64, n_layer=2, d_model=64, d_ff=96, qkv_bias=True,
                                                         qk_norm=True), None)}
    entries = model.layer_entries
    cases["has no tensor model.layers.0.gate"] = (model.GPTConfig(vocab_size=64, n_layer=2, d_model=64, d_ff=96),
                                                  lambda cfg: entries(cfg) + [("gate", (1,), model.ONES)])
    cases["no place for hidden_act='gelu'"] = (model.GPTConfig(vocab_size=64, n_layer=2, d_model=64, d_ff=96,
                                                               hidden_act="gelu"), "drop hidden_act")
    for words, (cfg, change) in cases.items():
        with monkeypatch.context() as m:
            if change == "drop hidden_act":
                m.setattr(hf, "EXPORTED", hf.EXPORTED - {"hidden_act"})
            elif change is not None:
                m.setattr(model, "layer_entries", change)
            with pytest.raises(HFError) as e:
                save_hf(cfg, model.init_weights(cfg), tmp_path / "out")
        print(e.value)
        assert words in str(e.value) and "\n" not in str(e.value)
        assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- training from a checkpoint
@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-bias-tied", "qwen3-qknorm-headdim"])
def test_trainer_matches_transformers_adamw(tmp_path, family):
    """3 steps of stream.Trainer (2 micro-batches, clipping) from load_hf, then save_hf, versus transformers
    + torch.optim.AdamW (decay on >= 2-D tensors) + clip_grad_norm_ on the same batches."""
    d = make_hf(tmp_path / "src", FAMILIES[family]())
    cfg, w = load_hf(d)
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    trainer = engine(cfg, w, device="cpu", weight_decay=0.1, grad_clip=1.0, micro_batches=2, **hp)
    ref = hf_model(d).train()
    params = list(ref.parameters())                 # tied embeddings appear once
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], **hp)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        x, y = random_batch(cfg, 4, 16, gen)
        ours = trainer.step(x, y)
        loss = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten(), ignore_index=model.IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        check_loss(step, ours, loss.item(), LOSS, f"{family} loss")
    out = save_hf(cfg, trainer.weights(), tmp_path / "out", dtype=torch.float32)
    _, saved = load_hf(out)
    theirs = ref.state_dict()
    check_updates(f"{family}, after step 2", w, dict(saved.items()), {k: theirs[k] for k in saved},
                  UPDATES[family])


# ----------------------------------------------------------------------------- bad input: one line, named
def _edit_config(d, **kv):
    c = json.loads((d / "config.json").read_text())
    c.update(kv)
    (d / "config.json").write_text(json.dumps(c))


def _drop_tensor(d, key):
    from safetensors.torch import load_file, save_file
    sd = load_file(d / "model.safetensors")
    sd.pop(key)
    save_file(sd, d / "model.safetensors")


def _corrupt_header(d):
    p = d / "model.safetensors"
    b = bytearray(p.read_bytes())
    b[8:40] = b"#" * 32
    p.write_bytes(bytes(b))


def _missing_shard(d):
    next(d.glob("model-00002-*.safetensors")).unlink()


BAD = {  # name: (how to break a fresh tiny Llama checkpoint, words the message must contain)
    "no-config": (lambda d: (d / "config.json").unlink(), "no config.json"),
    "missing-shard": (_missing_shard, "shard model-00002"),
    "shape": (lambda d: _edit_config(d, intermediate_size=100), "mlp.gate_proj.weight has shape"),
    "corrupt-header": (_corrupt_header, "not a readable safetensors file"),
    "architecture": (lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]), "architecture GPT2LMHeadModel"),
    "moe": (lambda d: _edit_config(d, architectures=["MixtralForCausalLM"]), "mixture-of-experts architecture Mixtral"),
    "rope-scaling": (lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 8}),
                     "rope scaling type 'yarn'"),
    "o-proj-bias": (lambda d: _edit_config(d, attention_bias=True), "attention_bias"),
    "activation": (lambda d: _edit_config(d, hidden_act="relu2"), "hidden_act=relu2"),
    "missing-tensor": (lambda d: _drop_tensor(d, "model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight is missing"),
    "no-weights": (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_checkpoint_is_one_line_hferror(tmp_path, bad):
    break_it, words = BAD[bad]
    d = make_hf(tmp_path / "hf", FAMILIES["llama-gqa"](), **({"max_shard_size": "40KB"} if bad == "missing-shard" else {}))
    break_it(d)
    with pytest.raises(HFError) as e:
        load_hf(d)
    msg = str(e.value)
    print(msg)
    assert words in msg and "\n" not in msg


def test_save_hf_refuses_and_leaves_nothing(tmp_path):
    cfg = model.PRESETS["toy"]
    w = model.init_weights(cfg)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(HFError, match="not a model directory"):
        save_hf(cfg, w, tmp_path / "run")
    w["model.norm.weight"] = torch.ones(3)
    with pytest.raises(HFError, match="model.norm.weight has shape"):
        save_hf(cfg, w, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]   # no temp dir, no half-written out
