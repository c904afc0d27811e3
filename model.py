"""model.py -- a Llama-style GPT written as stateless functions over flat weight buffers.

What it is
    GPTConfig and PRESETS (toy ... 120b); each "unit" (the embedding, a layer, the head) as ONE flat
    buffer, [2-D matrices | 1-D vectors]; the layer as a pure function block(cfg, x, w, rope) of its
    input and views into such a buffer; the gradients the engine computes one unit at a time
    (block_grad, head_grad); init_weights; a plain in-memory reference forward.
    Each entry of a layout declares its initial values (Init: normal with a std, ones, zeros),
    and the MLP's activation is a config field with its Hugging Face name (hidden_act,
    ACTIVATIONS): a new tensor or activation is declared here once, the rest of the project
    follows.
What it is not
    No nn.Module, no optimizer, no device logic, no input checks (megatrain_min/engine/checks.py).
Reference
    Hugging Face Llama / Qwen2 / Qwen3 (weights named as in their checkpoints); nanoGPT, llm.c.
Try it: python model.py      # the presets with parameter counts, the toy layer's layout
"""
import math
from dataclasses import asdict, dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100  # target id that contributes no loss (padding, prompt tokens in SFT)


# ------------------------------------------------------------------------------------------- config
@dataclass
class GPTConfig:
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4            # < n_head: grouped-query attention
    d_model: int = 128
    d_ff: int = 352               # the MLP's hidden size (gated: act(x W_gate) * (x W_up))
    hidden_act: str = "silu"      # the MLP's activation, by its Hugging Face name (ACTIVATIONS)
    head_dim: int = 0             # 0: d_model // n_head (Qwen3 sets it explicitly)
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False        # Qwen2
    qk_norm: bool = False         # Qwen3: RMSNorm on each head of q and k before RoPE
    tie_embeddings: bool = False  # lm_head.weight is model.embed_tokens.weight
    # Llama 3.1's RoPE: {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; None: plain RoPE
    rope_scaling: dict = None
    sliding_window: int = None    # Mistral / Qwen: attention sees the last W tokens (check_seq_len)

    def __post_init__(self):
        # given or derived head_dim (an attribute, not a field: out of to_dict() and ==)
        self.head_dim_given = self.head_dim != 0
        if not self.head_dim_given and isinstance(self.n_head, int) and self.n_head > 0:
            self.head_dim = self.d_model // self.n_head

    def to_dict(self):
        return asdict(self)


def default_dtype(device_type):
    """The compute dtype when none is asked for: bf16 on CUDA, fp32 on the CPU (slow bf16)."""
    return torch.bfloat16 if device_type == "cuda" else torch.float32


def as_config(cfg):
    """cfg, if it is a GPTConfig; TypeError when it is something else (a preset's name, say)."""
    if not isinstance(cfg, GPTConfig):
        got = f"{type(cfg).__name__} {cfg!r:.40}"
        raise TypeError(f"cfg must be a model.GPTConfig, e.g. model.PRESETS['toy'], got {got}")
    return cfg


# Parameter counts in the comments are exact (python model.py prints them).
PRESETS = {
    # a laptop model: byte vocabulary, trains on 2 CPU cores in minutes.            0.87M
    "toy": GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_kv_head=4, d_model=128, d_ff=352,
                     max_seq_len=256),
    # GPT-2-small-sized Llama (tied embeddings, GPT-2's padded vocab).               124M
    "small": GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_kv_head=12, d_model=768,
                       d_ff=2048, max_seq_len=1024, tie_embeddings=True),
    # Llama-3.2-1B.                                                                 1.24B
    "1b": GPTConfig(vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, d_model=2048,
                    d_ff=8192, max_seq_len=4096, rope_theta=500000.0, tie_embeddings=True,
                    rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192)),
    # Llama-2-7B.                                                                   6.74B
    "7b": GPTConfig(vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32, d_model=4096,
                    d_ff=11008, max_seq_len=4096),
    # Qwen2.5-14B (qkv bias, GQA 40/8).                                            14.77B
    "14b": GPTConfig(vocab_size=152064, n_layer=48, n_head=40, n_kv_head=8, d_model=5120,
                     d_ff=13824, max_seq_len=4096, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
    # Qwen2.5-32B.                                                                 32.76B
    "32b": GPTConfig(vocab_size=152064, n_layer=64, n_head=40, n_kv_head=8, d_model=5120,
                     d_ff=27648, max_seq_len=4096, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
    # Llama-3-70B.                                                                 70.55B
    "70b": GPTConfig(vocab_size=128256, n_layer=80, n_head=64, n_kv_head=8, d_model=8192,
                     d_ff=28672, max_seq_len=4096, rope_theta=500000.0),
    # Llama-3-70B's layer, 114 deep.                                               99.65B
    "100b": GPTConfig(vocab_size=128256, n_layer=114, n_head=64, n_kv_head=8, d_model=8192,
                      d_ff=28672, max_seq_len=4096, rope_theta=500000.0),
    # a wider Llama-style GQA model (d 12288, 96/8 heads), 76 deep.                119.82B
    "120b": GPTConfig(vocab_size=128256, n_layer=76, n_head=96, n_kv_head=8, d_model=12288,
                      d_ff=32768, max_seq_len=4096, rope_theta=500000.0),
}


# ------------------------------------------------------------------------------------- flat layouts
INIT_STD = 0.02  # GPT-2's std of the initial matrices (config_to_hf writes it as initializer_range)


class Init(NamedTuple):
    """How an entry of a layout starts: "normal" (mean 0, this std), "ones" or "zeros"."""
    kind: str
    std: float = 0.0

    def __str__(self):
        return f"normal({self.std:.3g})" if self.kind == "normal" else self.kind

    def tensor(self, shape, gen):
        """A new fp32 CPU tensor of shape; only "normal" draws from generator gen."""
        if self.kind == "normal":
            return torch.empty(shape).normal_(0.0, self.std, generator=gen)
        if self.kind == "ones":
            return torch.ones(shape)
        return torch.zeros(shape)


ONES = Init("ones")
ZEROS = Init("zeros")


def normal(std):
    return Init("normal", std)


class Entry(NamedTuple):
    """One tensor of a unit: block()'s name for it, its weights key, shape, offset in the unit, and
    how it starts (Init)."""
    short: str
    key: str
    shape: tuple
    offset: int
    init: Init

    @property
    def numel(self):
        return math.prod(self.shape)

    def view(self, flat):
        """This tensor as a view of the unit's flat buffer (no copy)."""
        return flat[self.offset:self.offset + self.numel].view(self.shape)


class Layout:
    """One unit's parameters in one flat buffer: [2-D matrices | 1-D vectors]. The leading n_decay
    elements are the matrices (AdamW decays them), the rest the vectors: two fused AdamW calls."""

    def __init__(self, name, entries):
        """entries: (short name, weights key, shape, Init), matrices first. An entry without its
        initial values is refused here: it would otherwise start at a silent zero."""
        self.name = name
        self.entries = []
        off = 0
        for entry in entries:
            if len(entry) != 4 or not isinstance(entry[3], Init):
                rules = "model.normal(std), model.ONES or model.ZEROS"
                raise ValueError(f"{name}: entry {entry[0]!r} declares no initial values; give it "
                                 f"one as its 4th item: {rules}")
            short, key, shape, init = entry
            self.entries.append(Entry(short, key, tuple(shape), off, init))
            off += math.prod(shape)
        dims = [len(e.shape) >= 2 for e in self.entries]
        assert dims == sorted(dims, reverse=True), f"{name}: matrices must come before vectors"
        self.numel = off
        self.n_decay = sum(e.numel for e in self.entries if len(e.shape) >= 2)

    def views(self, flat):
        """{short name: view of flat} -- no copy; the views share flat's storage and dtype."""
        return {e.short: e.view(flat) for e in self.entries}

    def key_views(self, flat):
        """{weights-dict key: view of flat}."""
        return {e.key: e.view(flat) for e in self.entries}

    def table(self):
        rows = [f"{self.name}: {self.numel:,} elements, decayed [0, {self.n_decay:,})"]
        for e in self.entries:
            rows.append(f"  {e.key:<44} {str(list(e.shape)):>14} @ {e.offset:>12,}  {e.init}")
        return "\n".join(rows)


def layer_entries(cfg):
    """(short name, shape, Init) of one transformer layer, matrices first. Names follow Hugging
    Face. Matrices start N(0, INIT_STD); the residual projections (o_proj, down_proj) scaled by
    1/sqrt(2 n_layer) as in GPT-2; norm gains 1, biases 0."""
    d = cfg.d_model
    hd = cfg.head_dim
    nh, nkv, ff = cfg.n_head, cfg.n_kv_head, cfg.d_ff
    w = normal(INIT_STD)
    residual = normal(INIT_STD / math.sqrt(2 * cfg.n_layer))
    mats = [("self_attn.q_proj.weight", (nh * hd, d), w),
            ("self_attn.k_proj.weight", (nkv * hd, d), w),
            ("self_attn.v_proj.weight", (nkv * hd, d), w),
            ("self_attn.o_proj.weight", (d, nh * hd), residual),
            ("mlp.gate_proj.weight", (ff, d), w),
            ("mlp.up_proj.weight", (ff, d), w),
            ("mlp.down_proj.weight", (d, ff), residual)]
    vecs = [("input_layernorm.weight", (d,), ONES),
            ("post_attention_layernorm.weight", (d,), ONES)]
    if cfg.qkv_bias:
        vecs += [("self_attn.q_proj.bias", (nh * hd,), ZEROS),
                 ("self_attn.k_proj.bias", (nkv * hd,), ZEROS),
                 ("self_attn.v_proj.bias", (nkv * hd,), ZEROS)]
    if cfg.qk_norm:
        vecs += [("self_attn.q_norm.weight", (hd,), ONES),
                 ("self_attn.k_norm.weight", (hd,), ONES)]
    return mats + vecs


EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def units(cfg):
    """The model as Layouts in forward order: [embed], layer.0 ... layer.{L-1}, head. Tied: no embed
    unit, the head's matrix IS the embedding (one key, one master, one gradient for both uses)."""
    V, d = cfg.vocab_size, cfg.d_model
    out = []
    if not cfg.tie_embeddings:
        out.append(Layout("embed", [("embed", EMBED, (V, d), normal(INIT_STD))]))
    for i in range(cfg.n_layer):
        entries = [(s, f"model.layers.{i}.{s}", *rest) for s, *rest in layer_entries(cfg)]
        out.append(Layout(f"layer.{i}", entries))
    head_key = EMBED if cfg.tie_embeddings else HEAD
    head = [("lm_head", head_key, (V, d), normal(INIT_STD)), ("norm", NORM, (d,), ONES)]
    return out + [Layout("head", head)]


def n_params(cfg):
    return sum(u.numel for u in units(cfg))


# ---------------------------------------------------------------------------------------- the layer
def rms_norm(x, w, eps):
    """Hugging Face's LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_cache(cfg, T, device=None, dtype=torch.float32):
    """cos, sin: (T, head_dim), computed in fp32 as Hugging Face does, then cast to dtype."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    if cfg.rope_scaling:
        inv_freq = llama3_inv_freq(inv_freq, **cfg.rope_scaling)
    freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)                                             # (T, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor,
                    original_max_position_embeddings):
    """Llama 3.1's RoPE: a frequency with fewer than low_freq_factor periods in the original
    context is slowed by `factor`, one with more than high_freq_factor kept; between, blended."""
    periods = original_max_position_embeddings * inv_freq / (2 * math.pi)
    # t = 1: keep the frequency; t = 0: slow it by factor
    t = ((periods - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    return (1 - t) * inv_freq / factor + t * inv_freq


def apply_rope(x, cos, sin):
    """x: (..., hd), cos, sin broadcastable to it: rotate each head's two halves (Llama, NeoX)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def check_seq_len(cfg, T):
    """ValueError past the sliding window W: only for T <= W is it block()'s full attention."""
    W = cfg.sliding_window
    if W is not None and T > W:
        raise ValueError(f"a sequence of {T} tokens is longer than this model's sliding window of "
                         f"{W}; use sequences of at most {W} tokens")


# The MLP's activations by their Hugging Face names (config.json's hidden_act): the one list.
ACTIVATIONS = {"silu": F.silu,
               "gelu": F.gelu,
               "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


def project(h, w, name, n_heads, hd):
    """h (B, t, d) through self_attn.{name}_proj, with its bias where it has one (Qwen2):
    (B, t, n_heads, hd)."""
    B, t, _ = h.shape
    bias = w.get(f"self_attn.{name}_proj.bias")
    return F.linear(h, w[f"self_attn.{name}_proj.weight"], bias).view(B, t, n_heads, hd)


# A layer: part A (norm, q/k/v, RoPE: token-local), attention over the whole sequence, part C
# (o_proj + residual, norm, MLP + residual: token-local). megatrain_min/engine/tiling.py tiles A
# and C.
def attn_in(cfg, x, w, cos, sin):
    """Part A. x: (B, t, d) the layer input; cos, sin: (t, hd). Returns q (B, t, nh, hd), k and v
    (B, t, nkv, hd), in the dtype SDPA computes in."""
    hd, eps = cfg.head_dim, cfg.norm_eps
    h = rms_norm(x, w["input_layernorm.weight"], eps)
    q = project(h, w, "q", cfg.n_head, hd)
    k = project(h, w, "k", cfg.n_kv_head, hd)
    v = project(h, w, "v", cfg.n_kv_head, hd)
    if cfg.qk_norm:
        # Qwen3: each head normalised
        q = rms_norm(q, w["self_attn.q_norm.weight"], eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], eps)
    cos, sin = cos[:, None], sin[:, None]                     # (t, 1, hd): the same for every head
    # RoPE in the tables' dtype (fp32 under autocast), then v's dtype: what autocast's SDPA casts to
    q = apply_rope(q, cos, sin).to(v.dtype)
    k = apply_rope(k, cos, sin).to(v.dtype)
    return q, k, v


def attention(cfg, q, k, v):
    """Causal attention. q: (B, T, nh, hd), k, v: (B, T, nkv, hd) -> (B, T, nh, hd), a view."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=cfg.n_kv_head != cfg.n_head)
    return y.transpose(1, 2)


def mlp(cfg, h, w):
    """The gated MLP, h (B, t, d) -> (B, t, d): act(h W_gate) * (h W_up), then W_down (SwiGLU when
    act is SiLU); act is ACTIVATIONS[cfg.hidden_act]."""
    act = ACTIVATIONS[cfg.hidden_act]
    gate = act(F.linear(h, w["mlp.gate_proj.weight"]))                  # (B, t, ff)
    up = F.linear(h, w["mlp.up_proj.weight"])                           # (B, t, ff)
    return F.linear(gate * up, w["mlp.down_proj.weight"])


def attn_out_mlp(cfg, x, y, w):
    """Part C. x: (B, t, d) the layer input, y: (B, t, nh, hd) its attention output -> (B, t, d)."""
    x = x + F.linear(y.flatten(2), w["self_attn.o_proj.weight"])
    h = rms_norm(x, w["post_attention_layernorm.weight"], cfg.norm_eps)
    return x + mlp(cfg, h, w)


def block(cfg, x, w, rope):
    """One transformer layer as a pure function. x: (B, T, d) the layer input; w: {short name:
    tensor}, views into the layer's flat buffer; rope: (cos, sin). Returns (B, T, d), x's dtype."""
    check_seq_len(cfg, x.shape[1])
    q, k, v = attn_in(cfg, x, w, *rope)
    y = attention(cfg, q, k, v)
    return attn_out_mlp(cfg, x, y, w)


# ---------------------------------------------------------------------------- the head and the loss
def head_loss(cfg, x, w, targets):
    """Final norm + LM head + cross-entropy SUM (fp32) of a chunk: x (N, d), w {"lm_head", "norm"},
    targets (N,). Callers divide by the step's token count: chunks add up to the batch's mean."""
    logits = F.linear(rms_norm(x, w["norm"], cfg.norm_eps), w["lm_head"])     # (N, V): one chunk
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")


LOSS_CHUNK_LOGITS = 1 << 26  # fp32 logits per loss chunk: 256 MB


def default_chunk_tokens(cfg):
    """Tokens per loss chunk: LOSS_CHUNK_LOGITS logits, at least 2048 tokens, whose 2 V d 2048 FLOP
    outweigh (on an H100) the V x d fp32 gradient each chunk's backward adds (~12 B/param moved)."""
    return max(2048, LOSS_CHUNK_LOGITS // cfg.vocab_size)


def chunked_loss_sum(cfg, x, w, targets, chunk_tokens):
    """Sum of head_loss over token chunks of x (B, T, d), each checkpointed: no (chunk, V) kept."""
    x = x.reshape(-1, x.shape[-1])
    targets = targets.reshape(-1)
    total = x.new_zeros((), dtype=torch.float32)
    for s in range(0, x.shape[0], chunk_tokens):
        xs, ts = x[s:s + chunk_tokens], targets[s:s + chunk_tokens]
        if torch.is_grad_enabled():
            total = total + checkpoint(head_loss, cfg, xs, w, ts, use_reentrant=False)
        else:
            total = total + head_loss(cfg, xs, w, ts)
    return total


# ------------------------------------------------------------------------------ the reference model
def layer_weights(cfg, weights, i):
    """{short name: tensor} of layer i, taken from a weights dict."""
    return {s: weights[f"model.layers.{i}.{s}"] for s, *_ in layer_entries(cfg)}


def head_weights(cfg, weights):
    return {"lm_head": weights[EMBED if cfg.tie_embeddings else HEAD], "norm": weights[NORM]}


def hidden(cfg, weights, tokens):
    """Reference trunk: tokens (B, T) -> final hidden states (B, T, d) before the final norm."""
    x = F.embedding(tokens, weights[EMBED])                      # (B, T, d)
    rope = rope_cache(cfg, tokens.shape[1], x.device, x.dtype)
    for i in range(cfg.n_layer):
        x = block(cfg, x, layer_weights(cfg, weights, i), rope)
    return x


def forward(cfg, weights, tokens):
    """Plain in-memory reference forward: logits (B, T, vocab), differentiable w.r.t. weights."""
    w = head_weights(cfg, weights)
    return F.linear(rms_norm(hidden(cfg, weights, tokens), w["norm"], cfg.norm_eps), w["lm_head"])


def loss(cfg, weights, tokens, targets, chunk_tokens=None):
    """Reference training loss: mean cross-entropy over the non-ignored targets, chunked head."""
    h = hidden(cfg, weights, tokens)
    n = (targets != IGNORE).sum().clamp(min=1)
    chunk = chunk_tokens or default_chunk_tokens(cfg)
    return chunked_loss_sum(cfg, h, head_weights(cfg, weights), targets, chunk) / n


# ----------------------------------------------------------------------------- one unit's gradients
# Per layer visit: no graph across layers; weight gradients added into fp32 buffers (acc, like w).
def block_grad(cfg, x, w, rope, dy, acc):
    """Recompute block(x) with grad and backpropagate dy through it. w: leaf tensors (requires_grad)
    keyed like block's weights; each one's gradient is added into acc[k]. Returns dx."""
    xin = x.detach().requires_grad_()
    with torch.enable_grad():
        dx, *gw = torch.autograd.grad(block(cfg, xin, w, rope), [xin, *w.values()], dy)
    torch._foreach_add_(list(acc.values()), gw)   # one call for all (torch.optim's foreach kernels)
    return dx


def head_grad(cfg, x, w, targets, n_tok, acc, chunk_tokens):
    """Final norm + LM head + cross-entropy of x (N, d), forward and backward in token chunks (no
    (N, V) logits ever). Loss = sum / n_tok, its gradients added into acc. Returns (loss, dx)."""
    dx = torch.empty_like(x)
    total = x.new_zeros((), dtype=torch.float32)
    for c in range(0, x.shape[0], chunk_tokens):
        xc = x[c:c + chunk_tokens].detach().requires_grad_()                   # (chunk, d)
        with torch.enable_grad():
            lc = head_loss(cfg, xc, w, targets[c:c + chunk_tokens]) / n_tok
            dx[c:c + chunk_tokens], *gw = torch.autograd.grad(lc, [xc, *w.values()])
        torch._foreach_add_(list(acc.values()), gw)
        total += lc.detach()
    return total, dx


# --------------------------------------------------------------------------------------------- init
def init_unit(cfg, layout, gen):
    """One unit's tensors, each as its layout entry declares (Init), drawn in layout order from
    generator gen. (cfg is not read: the rules sit in the layout, which units(cfg) made.)"""
    return {e.key: e.init.tensor(e.shape, gen) for e in layout.entries}


def init_weights(cfg, seed=0):
    """{key: fp32 CPU tensor}, keyed like a Hugging Face checkpoint: the interchange format
    (megatrain_min/engine/lazy_init.py makes the same tensors a unit at a time, as the engine
    reads)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for u in units(as_config(cfg)):
        weights.update(init_unit(cfg, u, gen))
    return weights


if __name__ == "__main__":
    for name, c in PRESETS.items():
        print(f"{name:>5}: {n_params(c):>16,} params  L={c.n_layer} d={c.d_model} "
              f"heads={c.n_head}/{c.n_kv_head} ff={c.d_ff} V={c.vocab_size}")
    print("\n" + "\n".join(u.table() for u in units(PRESETS["toy"])[:2]))
