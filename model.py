"""model.py -- a Llama-style GPT written as stateless functions over flat weight buffers.

What it is
    GPTConfig and PRESETS (toy ... 120b); the parameter layout of every "unit" (the embedding, each
    transformer layer, the head) as ONE flat buffer laid out [2-D matrices | 1-D vectors]; the layer
    as a pure function block(cfg, x, w, rope, tile_tokens) of its input and views into such a buffer,
    its token-local parts optionally run a tile of tokens at a time (sequence tiling, for long context);
    the per-unit gradients the engine runs (block_grad, head_grad); init_weights; a plain in-memory
    reference forward; a chunked cross-entropy head.
    The checks of what the public surface is given -- check_config, check_weights (+ check_tensor,
    check_finite), check_batch, check_token_ids, check_device -- one home each, used by both trainers
    and train.py: TypeError/ValueError with a one-line message naming the argument.
What it is not
    No nn.Module, no optimizer, no device logic. stream.py decides where buffers live and when they
    move; this file only says what the numbers are and how they combine.
Reference
    Hugging Face LlamaForCausalLM / Qwen2 / Qwen3 (the names of the weights follow their checkpoints,
    so load_hf/save_hf are a rename-free copy), nanoGPT and llm.c for the shape of the code; sequence
    tiling after Arctic Long Sequence Training's TiledMLP (arXiv 2506.13996).
Try it
    python model.py            # prints the presets with parameter counts and the toy layer layout
    python -m pytest tests/test_model.py
"""
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, asdict
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100  # target id that contributes no loss (padding, prompt tokens in SFT)


# ----------------------------------------------------------------------------- config
@dataclass
class GPTConfig:
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4            # < n_head: grouped-query attention
    d_model: int = 128
    d_ff: int = 352               # SwiGLU hidden size
    head_dim: int = 0             # 0: d_model // n_head (Qwen3 sets it explicitly)
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False        # Qwen2
    qk_norm: bool = False         # Qwen3: RMSNorm on each head of q and k before RoPE
    tie_embeddings: bool = False  # lm_head.weight is model.embed_tokens.weight
    rope_scaling: dict = None     # Llama 3.1+ "llama3" RoPE: {factor, low_freq_factor, high_freq_factor,
    #                               original_max_position_embeddings}; None = plain RoPE
    sliding_window: int = None    # Mistral / Qwen: attention sees the last W tokens. Only T <= W is computed
    #                               (then it equals full causal attention); longer input is refused, see check_seq_len

    def __post_init__(self):
        # head_dim given (Qwen3, any HF config.json) or derived from d_model: only a derived one must divide d_model.
        # A plain attribute, not a field: it stays out of to_dict(), ==, and the checkpoints' config comparison.
        self.head_dim_given = self.head_dim != 0
        if self.head_dim == 0 and _integer(self.n_head) and _integer(self.d_model) and self.n_head > 0:
            self.head_dim = self.d_model // self.n_head

    def check(self):
        """Raise ValueError (one line, what to do) for a config that cannot describe a model."""
        for k in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "head_dim", "max_seq_len"):
            if not _integer(getattr(self, k)):
                raise ValueError(f"{k} must be an integer, got {getattr(self, k)!r}")
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive, got {getattr(self, k)}")
        for k in ("rope_theta", "norm_eps"):
            if not (_real(getattr(self, k)) and getattr(self, k) > 0):
                raise ValueError(f"{k} must be a finite number > 0, got {getattr(self, k)!r}")
        for k in ("qkv_bias", "qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"{k} must be True or False, got {getattr(self, k)!r}")
        llama3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if self.rope_scaling is not None and not (isinstance(self.rope_scaling, dict) and set(self.rope_scaling) == set(llama3)
                                                  and all(_real(v) and v > 0 for v in self.rope_scaling.values())):
            raise ValueError(f"rope_scaling must be None or {{{', '.join(llama3)}}} (positive numbers), got {self.rope_scaling!r}")
        if self.d_model % self.n_head and not self.head_dim_given:
            raise ValueError(f"n_head={self.n_head} does not divide d_model={self.d_model}; "
                             f"pick n_head among the divisors of {self.d_model}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}; "
                             f"grouped-query attention shares each k/v head between n_head/n_kv_head q heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        return self

    def to_dict(self):
        return asdict(self)


def _integer(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v):
    """A finite real number (not a bool: True is not a learning rate)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


# Parameter counts in the comments are exact (python model.py prints them).
PRESETS = {
    # a laptop model: byte vocabulary, trains on 2 CPU cores in minutes.               0.87M
    "toy": GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_kv_head=4, d_model=128, d_ff=352,
                     max_seq_len=256),
    # GPT-2-small-sized Llama (tied embeddings, GPT-2's padded vocab).                  124M
    "small": GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_kv_head=12, d_model=768,
                       d_ff=2048, max_seq_len=1024, tie_embeddings=True),
    # Llama-3.2-1B.                                                                    1.24B
    "1b": GPTConfig(vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, d_model=2048,
                    d_ff=8192, max_seq_len=4096, rope_theta=500000.0, tie_embeddings=True,
                    rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192)),
    # Llama-2-7B.                                                                      6.74B
    "7b": GPTConfig(vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32, d_model=4096,
                    d_ff=11008, max_seq_len=4096),
    # Qwen2.5-14B (qkv bias, GQA 40/8).                                               14.77B
    "14b": GPTConfig(vocab_size=152064, n_layer=48, n_head=40, n_kv_head=8, d_model=5120,
                     d_ff=13824, max_seq_len=4096, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
    # Qwen2.5-32B.                                                                    32.76B
    "32b": GPTConfig(vocab_size=152064, n_layer=64, n_head=40, n_kv_head=8, d_model=5120,
                     d_ff=27648, max_seq_len=4096, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
    # Llama-3-70B.                                                                    70.55B
    "70b": GPTConfig(vocab_size=128256, n_layer=80, n_head=64, n_kv_head=8, d_model=8192,
                     d_ff=28672, max_seq_len=4096, rope_theta=500000.0),
    # Llama-3-70B's layer, 114 deep.                                                  99.65B
    "100b": GPTConfig(vocab_size=128256, n_layer=114, n_head=64, n_kv_head=8, d_model=8192,
                      d_ff=28672, max_seq_len=4096, rope_theta=500000.0),
    # a wider Llama-style GQA model (d 12288, 96/8 heads), 76 deep.                   119.82B
    "120b": GPTConfig(vocab_size=128256, n_layer=76, n_head=96, n_kv_head=8, d_model=12288,
                      d_ff=32768, max_seq_len=4096, rope_theta=500000.0),
}


# ----------------------------------------------------------------------------- flat layouts
class Entry(NamedTuple):
    """One tensor of a unit: the name block() reads it by, its weights-dict key, its shape, its offset (elements)
    in the unit's flat buffer."""
    short: str
    key: str
    shape: tuple
    offset: int

    @property
    def numel(self):
        return math.prod(self.shape)

    def view(self, flat):
        """This tensor as a view of the unit's flat buffer (no copy)."""
        return flat[self.offset:self.offset + self.numel].view(self.shape)


class Layout:
    """One unit's parameters packed into one flat buffer: [2-D matrices | 1-D vectors].

    entries: [Entry(short, key, shape, offset)], made from (short name, full weights-dict key, shape) triples.
    The leading n_decay elements are the matrices (AdamW decays them), the rest are vectors (no decay): two
    fused optimizer calls.
    """

    def __init__(self, name, entries):
        dims = [len(shape) >= 2 for _, _, shape in entries]
        assert dims == sorted(dims, reverse=True), f"{name}: matrices must come before vectors"
        self.name, self.entries, off = name, [], 0
        for short, key, shape in entries:
            self.entries.append(Entry(short, key, tuple(shape), off))
            off += math.prod(shape)
        self.numel = off
        self.n_decay = sum(e.numel for e in self.entries if len(e.shape) >= 2)

    def views(self, flat):
        """{short name: view of flat} -- no copy; the views share flat's storage and dtype."""
        return {e.short: e.view(flat) for e in self.entries}

    def key_views(self, flat):
        """{full weights-dict key: view of flat}."""
        return {e.key: e.view(flat) for e in self.entries}

    def keys(self):
        return [e.key for e in self.entries]

    def key_at(self, i):
        """The key of the tensor that holds element i of the flat buffer."""
        return next(e.key for e in self.entries if e.offset <= i < e.offset + e.numel)

    def table(self):
        rows = [f"{self.name}: {self.numel:,} elements, decayed [0, {self.n_decay:,})"]
        rows += [f"  {e.key:<44} {str(list(e.shape)):>14} @ {e.offset:>12,}" for e in self.entries]
        return "\n".join(rows)


def layer_entries(cfg):
    """(short name, shape) of one transformer layer, matrices first. Names follow Hugging Face."""
    d, hd, nh, nkv, ff = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_ff
    mats = [("self_attn.q_proj.weight", (nh * hd, d)), ("self_attn.k_proj.weight", (nkv * hd, d)),
            ("self_attn.v_proj.weight", (nkv * hd, d)), ("self_attn.o_proj.weight", (d, nh * hd)),
            ("mlp.gate_proj.weight", (ff, d)), ("mlp.up_proj.weight", (ff, d)),
            ("mlp.down_proj.weight", (d, ff))]
    vecs = [("input_layernorm.weight", (d,)), ("post_attention_layernorm.weight", (d,))]
    if cfg.qkv_bias:
        vecs += [("self_attn.q_proj.bias", (nh * hd,)), ("self_attn.k_proj.bias", (nkv * hd,)),
                 ("self_attn.v_proj.bias", (nkv * hd,))]
    if cfg.qk_norm:
        vecs += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
    return mats + vecs


EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def units(cfg):
    """The model as a list of Layouts in forward order: [embed], layer.0 ... layer.{L-1}, head.

    With tied embeddings there is no separate embed unit: the head's matrix IS the embedding
    (one key, one master copy, one gradient that sums both uses).
    """
    V, d = cfg.vocab_size, cfg.d_model
    out = [] if cfg.tie_embeddings else [Layout("embed", [("embed", EMBED, (V, d))])]
    for i in range(cfg.n_layer):
        out.append(Layout(f"layer.{i}", [(s, f"model.layers.{i}.{s}", sh) for s, sh in layer_entries(cfg)]))
    head_key = EMBED if cfg.tie_embeddings else HEAD
    out.append(Layout("head", [("lm_head", head_key, (V, d)), ("norm", NORM, (d,))]))
    return out


def n_params(cfg):
    return sum(u.numel for u in units(cfg))


# ----------------------------------------------------------------------------- the functions
def rms_norm(x, w, eps):
    """Hugging Face's LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope_cache(cfg, T, device=None, dtype=torch.float32):
    """cos, sin: (T, head_dim), computed in fp32 as Hugging Face does, then cast to dtype."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    if cfg.rope_scaling:
        inv_freq = llama3_inv_freq(inv_freq, **cfg.rope_scaling)
    freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)                                             # (T, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """Llama 3.1's long-context RoPE: a frequency whose wavelength is long against the original context
    (fewer than low_freq_factor periods fit in it) is slowed down by `factor`, a short one (more than
    high_freq_factor periods) is kept, and in between the two are blended linearly in periods-per-context."""
    periods = original_max_position_embeddings * inv_freq / (2 * math.pi)     # periods in the original context
    t = ((periods - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)  # 0: slow down, 1: keep
    return (1 - t) * inv_freq / factor + t * inv_freq


def apply_rope(x, cos, sin):
    """x: (..., hd), cos, sin broadcastable to it (block: x (B, T, h, hd), cos (T, 1, hd)). Rotate the two halves
    of each head (the Llama / NeoX convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def check_seq_len(cfg, T):
    """Refuse (ValueError) a sequence longer than cfg.sliding_window. A causal window of W tokens is exactly
    full causal attention for T <= W, which block() computes; beyond W it is not, and a banded mask is not
    implemented here (a dense T x T mask would cost what the long-context path must not)."""
    if cfg.sliding_window is not None and T > cfg.sliding_window:
        raise ValueError(f"a sequence of {T} tokens is longer than this model's sliding window of "
                         f"{cfg.sliding_window} (sliding_window attention is computed only for T <= "
                         f"{cfg.sliding_window}); use sequences of at most {cfg.sliding_window} tokens")


# A layer is token-local part A (norm, q/k/v, RoPE), attention over the whole sequence, and token-local part C
# (o_proj + residual, norm, MLP + residual). Sequence tiling (ALST's TiledMLP, generalised to both token-local
# parts): A and C run on `tile_tokens` tokens at a time, so no (T, d_ff) tensor ever exists; attention sees all
# T tokens at once through SDPA (flash / efficient kernels: O(T) memory). Every token's arithmetic is the same
# tiled or not; only the weight gradients are summed in another order (tile by tile, in fp32: block_grad).
def tiles(T, tile_tokens):
    """The token tiles of a sequence: slices of tile_tokens positions (the last one shorter when tile_tokens does
    not divide T); tile_tokens 0 = one tile, the whole sequence."""
    n = tile_tokens or T
    return [slice(s, min(s + n, T)) for s in range(0, T, n)]


def over_tiles(fn, T, tile_tokens, into=None):
    """THE tile loop. fn(s) returns a tuple of (B, len(s), ...) tensors for token tile s; they are assembled along
    the token axis (dim 1) into (B, T, ...) tensors -- new ones, or, when `into` is given, added into those (a
    gradient w.r.t. a tensor that feeds both token-local parts). One tile and no `into`: fn's own results
    (autograd then sees plain ops: the untiled layer)."""
    for s in tiles(T, tile_tokens):
        res = fn(s)
        if into is None:
            if s.stop - s.start == T:
                return res
            into = [r.new_zeros((r.shape[0], T, *r.shape[2:])) for r in res]
        for o, r in zip(into, res):
            o[:, s] += r
    return into


def attn_in(cfg, x, w, cos, sin):
    """Part A, token-local. x: (B, t, d) a tile of the layer input; cos, sin: (t, hd) its positions' RoPE.
    Returns q (B, t, nh, hd), k and v (B, t, nkv, hd), in the dtype SDPA computes in."""
    B, t, _ = x.shape
    nh, nkv, hd, eps = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.norm_eps
    # pre-norm, q/k/v projections (Qwen2 adds a bias), Qwen3 normalises each q/k head
    h = rms_norm(x, w["input_layernorm.weight"], eps)
    q = F.linear(h, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias")).view(B, t, nh, hd)
    k = F.linear(h, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias")).view(B, t, nkv, hd)
    v = F.linear(h, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias")).view(B, t, nkv, hd)
    if cfg.qk_norm:
        q, k = rms_norm(q, w["self_attn.q_norm.weight"], eps), rms_norm(k, w["self_attn.k_norm.weight"], eps)
    cos, sin = cos[:, None], sin[:, None]                                   # (t, 1, hd): the same for every head
    # RoPE in the rope tables' dtype (fp32 under autocast), then v's dtype: what autocast's SDPA would cast to
    return apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype), v


def attention(cfg, q, k, v):
    """Causal attention over the whole sequence. q: (B, T, nh, hd), k, v: (B, T, nkv, hd) -> (B, T, nh, hd),
    a view of SDPA's (B, nh, T, hd) output."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=cfg.n_kv_head != cfg.n_head)          # (B, nh, T, hd)
    return y.transpose(1, 2)


def attn_out_mlp(cfg, x, y, w):
    """Part C, token-local. x: (B, t, d) a tile of the layer input, y: (B, t, nh, hd) its attention output.
    Returns the layer output (B, t, d): x + o_proj(y), then + SwiGLU MLP."""
    x = x + F.linear(y.flatten(2), w["self_attn.o_proj.weight"])
    h = rms_norm(x, w["post_attention_layernorm.weight"], cfg.norm_eps)
    h = F.silu(F.linear(h, w["mlp.gate_proj.weight"])) * F.linear(h, w["mlp.up_proj.weight"])  # (B, t, ff)
    return x + F.linear(h, w["mlp.down_proj.weight"])


def block(cfg, x, w, rope, tile_tokens=0):
    """One transformer layer as a pure function.

    x: (B, T, d) layer input; w: {short name: tensor} (views into the layer's flat buffer);
    rope: (cos, sin) from rope_cache; tile_tokens: run the token-local parts that many tokens at a time
    (0 = the whole sequence at once). Returns the layer output (B, T, d), same dtype as x.
    """
    T, (cos, sin) = x.shape[1], rope
    check_seq_len(cfg, T)
    if not tile_tokens or tile_tokens >= T:      # untiled: the parts on the whole sequence, nothing sliced
        return attn_out_mlp(cfg, x, attention(cfg, *attn_in(cfg, x, w, cos, sin)), w)
    q, k, v = over_tiles(lambda s: attn_in(cfg, x[:, s], w, cos[s], sin[s]), T, tile_tokens)
    y = attention(cfg, q, k, v)                                                # (B, T, nh, hd)
    return over_tiles(lambda s: (attn_out_mlp(cfg, x[:, s], y[:, s], w),), T, tile_tokens)[0]


def head_loss(cfg, x, w, targets):
    """Final norm + LM head + summed cross-entropy for one chunk of tokens.

    x: (N, d) hidden states; w: the head unit's views {"lm_head": (V, d), "norm": (d,)};
    targets: (N,) with IGNORE for no loss. Returns the fp32 SUM of the losses (callers divide by the
    step's token count, so micro-batches and chunks add up to exactly the big-batch mean).
    """
    logits = F.linear(rms_norm(x, w["norm"], cfg.norm_eps), w["lm_head"])  # (N, V): one chunk only
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")


LOSS_CHUNK_LOGITS = 1 << 26  # fp32 logits per loss chunk: 256 MB (default_chunk_tokens; plan.py's smaller chunk)


def default_chunk_tokens(cfg):
    """Tokens per loss chunk (the one home of this default): LOSS_CHUNK_LOGITS fp32 logits, at least 2048 tokens.
    Why the floor: each chunk's backward builds a V x d lm_head gradient that is added into fp32 (~12 B/param of
    memory traffic); at 2048 tokens the chunk's 2*V*d*2048 FLOP outweigh it on an H100 (~340 FLOP/B against a
    ridge of ~295), at Llama 3's V=128k the 2**26 rule alone would give 523 tokens and a memory-bound head."""
    return max(2048, LOSS_CHUNK_LOGITS // cfg.vocab_size)


def chunked_loss_sum(cfg, x, w, targets, chunk_tokens):
    """Sum of head_loss over token chunks of x: (B, T, d). Each chunk is checkpointed, so autograd
    keeps no (chunk, V) logits alive either: peak memory is one chunk's logits in forward and backward."""
    x, targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    total = x.new_zeros((), dtype=torch.float32)
    for s in range(0, x.shape[0], chunk_tokens):
        xs, ts = x[s:s + chunk_tokens], targets[s:s + chunk_tokens]
        if torch.is_grad_enabled():
            total = total + checkpoint(head_loss, cfg, xs, w, ts, use_reentrant=False)
        else:
            total = total + head_loss(cfg, xs, w, ts)
    return total


def layer_weights(cfg, weights, i):
    """{short name: tensor} of layer i, taken from a weights dict."""
    return {s: weights[f"model.layers.{i}.{s}"] for s, _ in layer_entries(cfg)}


def head_weights(cfg, weights):
    return {"lm_head": weights[EMBED if cfg.tie_embeddings else HEAD], "norm": weights[NORM]}


def hidden(cfg, weights, tokens):
    """Reference trunk: tokens (B, T) -> final hidden states (B, T, d) before the final norm."""
    T = tokens.shape[1]
    x = F.embedding(tokens, weights[EMBED])                      # (B, T, d)
    rope = rope_cache(cfg, T, x.device, x.dtype)
    for i in range(cfg.n_layer):
        x = block(cfg, x, layer_weights(cfg, weights, i), rope)
    return x


def forward(cfg, weights, tokens):
    """Plain in-memory reference forward: logits (B, T, vocab), differentiable w.r.t. weights."""
    w = head_weights(cfg, weights)
    return F.linear(rms_norm(hidden(cfg, weights, tokens), w["norm"], cfg.norm_eps), w["lm_head"])


def loss(cfg, weights, tokens, targets, chunk_tokens=None):
    """Reference training loss: mean cross-entropy over the non-ignored targets, chunked head."""
    n = (targets != IGNORE).sum().clamp(min=1)
    chunk = chunk_tokens or default_chunk_tokens(cfg)
    return chunked_loss_sum(cfg, hidden(cfg, weights, tokens), head_weights(cfg, weights), targets, chunk) / n


# ----------------------------------------------------------------------------- gradients, one unit at a time
# What the streaming engine (and bench/) runs per layer visit: no graph across layers, the weight gradients
# added into fp32 buffers (acc: views keyed like w) -- accumulation over micro-batches and chunks in fp32.
def block_grad(cfg, x, w, rope, dy, acc, tile_tokens=0):
    """Recompute block(x) with grad and backpropagate dy through it. w: leaf tensors (requires_grad) keyed like
    block's weights. Adds each weight's gradient into acc[k]; returns dx, the gradient w.r.t. x.

    tile_tokens 0: one autograd graph through the whole layer (the untiled oracle). Otherwise the layer's
    backward in three phases, so that only one tile's token-local activations exist at a time:
      C  per tile: recompute x + o_proj(y) + MLP from (x, y) with grad; dy -> dx (part), dy_att, dW_C
      attention  : SDPA's backward on the whole sequence, dy_att -> dq, dk, dv
      A  per tile: recompute q, k, v from x with grad; (dq, dk, dv) -> dx (added), dW_A
    Each tile's weight gradients are added into acc (fp32) as they come: autograd never sums them in bf16."""
    if not tile_tokens:
        xin = x.detach().requires_grad_()
        with torch.enable_grad():
            y = block(cfg, xin, w, rope)
            dx, *gw = torch.autograd.grad(y, [xin, *w.values()], dy)
        torch._foreach_add_(list(acc.values()), gw)   # one call for every weight (torch.optim's foreach kernels)
        return dx
    T, (cos, sin) = x.shape[1], rope
    check_seq_len(cfg, T)
    part_a = lambda s, x_s: attn_in(cfg, x_s, w, cos[s], sin[s])                            # noqa: E731
    part_c = lambda s, x_s, y_s: (attn_out_mlp(cfg, x_s, y_s, w),)                          # noqa: E731
    with torch.no_grad():                       # q, k, v of the whole sequence, a tile at a time, no graph
        q, k, v = (t.requires_grad_() for t in over_tiles(lambda s: part_a(s, x[:, s]), T, tile_tokens))
    with torch.enable_grad():
        y = attention(cfg, q, k, v)             # (B, T, nh, hd); SDPA saves q, k, v, its output and lse
    dx, dy_att = tile_grad(part_c, T, tile_tokens, [x, y.detach()], [dy], w, acc)   # (B, T, d), (B, T, nh, hd)
    dqkv = torch.autograd.grad(y, [q, k, v], dy_att)                                # the whole sequence
    del q, k, v, y, dy_att                      # SDPA's saved tensors go with its graph
    return tile_grad(part_a, T, tile_tokens, [x], dqkv, w, acc, into=[dx])[0]


def tile_grad(fn, T, tile_tokens, xs, grads, w, acc, into=None):
    """The backward of a token-local part, tile by tile: for each token tile s, recompute fn(s, *xs' tiles) with
    grad and backpropagate the tiles of grads (one per output of fn). The weights' gradients are added into acc
    (fp32); returns the gradients w.r.t. xs as (B, T, ...) tensors (added into `into` when given)."""
    def one(s):
        x_s = [x[:, s].detach().requires_grad_() for x in xs]
        with torch.enable_grad():
            g = torch.autograd.grad(fn(s, *x_s), [*x_s, *w.values()], [g[:, s] for g in grads], allow_unused=True)
        used = [(a, g_w) for a, g_w in zip(acc.values(), g[len(xs):]) if g_w is not None]  # part A's weights
        torch._foreach_add_([a for a, _ in used], [g_w for _, g_w in used])                 # get none from C
        return g[:len(xs)]
    return over_tiles(one, T, tile_tokens, into)


def head_grad(cfg, x, w, targets, n_tok, acc, chunk_tokens):
    """Final norm + LM head + cross-entropy of x (N, d), forward and backward in token chunks (no (N, V) logits
    ever exist). The loss is sum / n_tok; its gradients w.r.t. w are added into acc. Returns (loss, dx)."""
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


def block_activation_bytes(cfg, n_tok, cb, rb=None, tile_tokens=0, seq_len=None):
    """Bytes of one layer's backward for n_tok tokens (one micro-batch, in sequences of seq_len tokens; default:
    one sequence). cb: bytes of the compute dtype, rb: of the residual stream (default cb; 4 with 2 is bf16
    autocast on an fp32 residual, the engine's default). The layer input is the boundary checkpoint, and dy / dx
    are the residual stream's gradient: both counted apart (stream.step_device_bytes).

    Untiled: what autograd saves when block() is recomputed with grad, plus the backward's largest transients --
    an estimate from the ops (flash/efficient SDPA: no T x T scores), checked against autograd in
    tests/test_plan.py. Tiled (block_grad's three phases): the whole sequence's attention (attention_bytes) plus
    the untiled estimate for one tile of n_tok / seq_len rows x tile_tokens tokens, which bounds part A or part C
    of one tile with its gradients."""
    rb = rb or cb
    if tile_tokens:
        seq_len = seq_len or n_tok
        tile = n_tok // seq_len * min(tile_tokens, seq_len)
        return attention_bytes(cfg, n_tok, cb) + block_activation_bytes(cfg, tile, cb, rb)
    d, ff = cfg.d_model, cfg.d_ff
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    # 2 rms_norms: fp32 normalised x (+ the fp32 copy of a bf16 x), the 2nd one's input; the linears' inputs:
    # shared by q/k/v and by gate/up, or -- autocast on an fp32 residual -- a bf16 cast per linear (5)
    norms = 12 * d + (5 if cb != rb else 2) * cb * d
    attn = cb * (3 * q + 2 * kv) + 4 * cfg.n_head  # SDPA's q, k, v, its output + the copy o_proj reads; lse
    if cfg.qk_norm:
        attn += (cb + 4) * (q + kv)
    mlp = 4 * cb * ff                            # gate (silu's input), silu(gate), up, their product
    transient = 2 * cb * ff + 8 * d              # two (n, ff) grads alive at once, fp32 norm grads
    return n_tok * (norms + attn + mlp + transient)


def attention_bytes(cfg, n_tok, cb):
    """Bytes the whole-sequence attention holds at the peak of the tiled backward (SDPA's backward), n_tok tokens:
    what SDPA saves (q, k, v, its output, the fp32 log-sum-exp per head), the gradient w.r.t. its output, dq, dk,
    dv, and a flash-attention-2 backward's workspace (an fp32 dq accumulator and an fp32 row statistic; with
    grouped-query attention dk and dv are made for all n_head heads before the sum over each group). O(n_tok):
    flash / efficient kernels keep no T x T scores."""
    q, kv, nh = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_head
    saved = cb * (2 * q + 2 * kv) + 4 * nh
    grads = cb * q + cb * (q + 2 * kv)
    workspace = 4 * q + 4 * nh + (2 * cb * q if cfg.n_kv_head != cfg.n_head else 0)
    return n_tok * (saved + grads + workspace)


# ----------------------------------------------------------------------------- init
def init_unit(cfg, layout, gen):
    """Fill one unit's tensors, in layout order, from generator gen: {key: fp32 CPU tensor}.

    N(0, 0.02) for matrices and embeddings; residual output projections (o_proj, down_proj) scaled by
    1/sqrt(2 n_layer) as in GPT-2; norms 1; biases 0.
    """
    out = {}
    for e in layout.entries:
        if len(e.shape) == 1:
            t = torch.ones(e.shape) if e.short.endswith("norm.weight") or e.short == "norm" else torch.zeros(e.shape)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if e.short.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            t = torch.empty(e.shape).normal_(0.0, std, generator=gen)
        out[e.key] = t
    return out


def init_weights(cfg, seed=0):
    """dict[str, fp32 CPU tensor] keyed like a Hugging Face checkpoint: the project's interchange format."""
    check_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for u in units(cfg):
        weights.update(init_unit(cfg, u, gen))
    return weights


class LazyInit(Mapping):
    """init_weights(cfg, seed) without the dict: a unit's tensors are made when one of its keys is first
    read, in init_weights' RNG order, and only that unit is held. stream.Trainer reads the keys unit by
    unit, so a model is initialised straight into the host store (no second fp32 copy of a 70B model)."""

    def __init__(self, cfg, seed=0):
        self.cfg, self.seed, self.layouts = check_config(cfg), seed, units(cfg)
        self.unit_of = {key: u for u, lay in enumerate(self.layouts) for key in lay.keys()}
        self.u, self.cur, self.gen = len(self.layouts), {}, None

    def __contains__(self, key):  # Mapping's default would make the unit's tensors
        return key in self.unit_of

    def __getitem__(self, key):
        u = self.unit_of[key]
        if u < self.u:  # going back: restart the generator (a sequential reader never does)
            self.u, self.gen = -1, torch.Generator().manual_seed(self.seed)
        while self.u < u:  # the units in between are generated (and dropped) to keep the RNG order
            self.u += 1
            self.cur = init_unit(self.cfg, self.layouts[self.u], self.gen)
        return self.cur[key]

    def __iter__(self):
        return iter(self.unit_of)

    def __len__(self):
        return len(self.unit_of)


# ----------------------------------------------------------------------------- checks of what the public surface is given
def check_config(cfg):
    """cfg, checked (GPTConfig.check); TypeError when it is not a GPTConfig at all (a preset's name, say)."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a model.GPTConfig, e.g. model.PRESETS['toy'], got {type(cfg).__name__} {cfg!r:.40}")
    return cfg.check()


def check_weights(cfg, weights, tensors=True):
    """weights must be a Mapping with exactly the keys of cfg's layout, each a floating-point torch.Tensor of
    exactly its shape (nothing broadcast or transposed into the store) holding only finite values.
    tensors=False checks the mapping and its keys only, reading no tensor: the engines then check each tensor
    as they copy it (check_tensor) and each unit once it is filled (check_finite), so a lazy mapping of a 70B
    model (LazyInit, hf.HFWeights) is read once, not twice. TypeError/ValueError naming the key."""
    check_config(cfg)
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a Mapping {{key: tensor}} as model.init_weights returns, got {type(weights).__name__}")
    want = {e.key: e.shape for lay in units(cfg) for e in lay.entries}
    missing = [key for key in want if key not in weights]
    if missing:
        raise ValueError(f"weights has no {missing[0]!r} ({len(missing)} of the config's {len(want)} tensors missing)")
    extra = [key for key in weights if key not in want]
    if extra:
        raise ValueError(f"weights has {extra[0]!r}, which this config does not use ({len(extra)} such keys); "
                         f"is it the config these weights were made for?")
    if tensors:
        check_finite({key: check_tensor(key, weights[key], shape) for key, shape in want.items()})


def check_tensor(key, t, shape):
    """weights[key] = t must be a floating-point torch.Tensor with data, of exactly `shape`; returns t detached."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"weights[{key!r}] must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.is_meta:
        raise TypeError(f"weights[{key!r}] must be a floating-point tensor with data, got {t.dtype} on {t.device}")
    if tuple(t.shape) != tuple(shape):
        hint = " (transposed?)" if len(shape) == 2 and tuple(t.shape) == tuple(shape)[::-1] else ""
        raise ValueError(f"weights[{key!r}] has shape {list(t.shape)}, the config needs exactly {list(shape)}{hint}")
    return t.detach()


def check_finite(tensors):
    """ValueError naming the first of {key: tensor} that holds a NaN or an infinity. One read pass: a sum is
    finite whenever every value is (~9 GB/s on one core, where isfinite().all() runs at 0.4); only a sum that
    is not -- a non-finite value, or an overflow of huge finite ones -- is looked at element by element."""
    for key, t in tensors.items():
        if not all_finite(t):
            bad = int((~torch.isfinite(t.detach())).sum())
            raise ValueError(f"weights[{key!r}] holds {bad:,} non-finite values (NaN or inf) among {t.numel():,}")


def all_finite(t):
    """No NaN, no infinity in tensor t (check_finite's test; checkpoint.py uses it on the master weights)."""
    t = t.detach()
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def check_token_ids(ids, vocab_size, name):
    """Every id of a non-empty integer array or tensor lies in [0, vocab_size); ValueError naming `name` else."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} hold token id {lo if lo < 0 else hi}; ids must be in [0, {vocab_size}) (vocab_size)")


def check_batch(cfg, tokens, targets):
    """A training or evaluation batch: tokens and targets (B, T) int64 tensors of one shape, B, T >= 1,
    T <= cfg.max_seq_len (the one home of the sequence-length rule), token ids in [0, vocab_size), targets
    too or IGNORE. A batch whose targets are all IGNORE is valid: its loss is 0 and an optimizer step still
    applies weight decay and momentum, exactly as torch.optim.AdamW does with zero gradients."""
    for name, t in (("tokens", tokens), ("targets", targets)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            got = f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an int64 torch.Tensor (B, T), got a {got}")
        if t.dim() != 2 or 0 in t.shape:
            raise ValueError(f"{name} must be (B, T) with B, T >= 1, got shape {list(t.shape)}")
    if targets.shape != tokens.shape:
        raise ValueError(f"targets has shape {list(targets.shape)}, tokens {list(tokens.shape)}: they must match")
    if tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(f"tokens hold sequences of {tokens.shape[1]} tokens, longer than max_seq_len={cfg.max_seq_len}")
    check_token_ids(tokens, cfg.vocab_size, "tokens")
    # IGNORE read as 0; elementwise, not a boolean mask (whose parallel nonzero costs ms on a busy machine)
    check_token_ids(torch.where(targets == IGNORE, 0, targets), cfg.vocab_size, f"targets (besides {IGNORE}, ignored)")


def check_device(device):
    """torch.device of `device` ("cpu", "cuda", "cuda:i"; None = cuda when available), or ValueError naming it
    when the engines cannot run there: not a device torch knows, not cpu/cuda, or a GPU this machine lacks."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device {str(device)!r} is not a device torch knows; use 'cpu' or 'cuda'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r}: the engines run on 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but torch sees no CUDA device; use 'cpu'")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


if __name__ == "__main__":
    for name, c in PRESETS.items():
        print(f"{name:>5}: {n_params(c):>16,} params  L={c.n_layer} d={c.d_model} "
              f"heads={c.n_head}/{c.n_kv_head} ff={c.d_ff} V={c.vocab_size}")
    print()
    for u in units(PRESETS["toy"])[:2]:
        print(u.table())
