"""memory.py -- what a training step holds on the device, by component: the arithmetic the planner asks of the
engine and the model.

What it is
    block_activation_bytes: one layer's backward (what autograd saves when model.block is recomputed with grad,
    and the largest transients), untiled or in tiles (megatrain_min/tiling.py); attention_bytes: the whole
    sequence's attention at the peak of the tiled backward; step_device_bytes: everything a step holds beside
    the weight and gradient slots and the boundary activations; offload_needed: the rule that sends the
    boundary activations to host memory. Estimates from the ops, checked against autograd in
    tests/test_plan.py; flash / efficient SDPA kernels assumed (no T x T scores).
Used by
    megatrain_min/plan.py (the plan, its fit check and suggestions).
"""


def block_activation_bytes(cfg, n_tok, cb, rb=None, tile_tokens=0, seq_len=None):
    """Bytes of one layer's backward for n_tok tokens (one micro-batch, in sequences of seq_len tokens; default:
    one sequence). cb: bytes of the compute dtype, rb: of the residual (default cb; 4 with 2 is bf16 autocast on
    an fp32 residual, the engine's default). The layer input (a boundary activation) and dy / dx are counted
    apart (step_device_bytes).
    Untiled: what autograd saves when model.block is recomputed with grad, plus the backward's largest
    transients. Tiled (tiling.Tiled.block_grad's three phases): the whole sequence's attention
    (attention_bytes) plus the untiled estimate for one tile of n_tok / seq_len rows x tile_tokens tokens,
    which bounds part A or part C of one tile with its gradients."""
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
    """Bytes the whole-sequence attention holds at the peak of the tiled backward (SDPA's backward), n_tok
    tokens: what SDPA saves (q, k, v, its output, the fp32 log-sum-exp per head), the gradient w.r.t. its
    output, dq, dk, dv, and a flash-attention-2 backward's workspace (an fp32 dq accumulator and an fp32 row
    statistic; with grouped-query attention dk and dv are made for all n_head heads before the sum over each
    group). O(n_tok): flash / efficient kernels keep no T x T scores."""
    q, kv, nh = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_head
    saved = cb * (2 * q + 2 * kv) + 4 * nh
    grads = cb * q + cb * (q + 2 * kv)
    workspace = 4 * q + 4 * nh + (2 * cb * q if cfg.n_kv_head != cfg.n_head else 0)
    return n_tok * (saved + grads + workspace)


def step_device_bytes(cfg, tokens, micro_batches, dtype, residual_dtype, chunk_tokens, n_slot, seq_len=None,
                      tile_tokens=0):
    """What a step holds on the device beside the weight/grad slots and the boundary activations, by component:
    plan.py prints it, offload_needed weighs it. tokens: per step; n_slot: elements of a slot; seq_len: tokens
    per sequence (default: one sequence per micro-batch); tile_tokens: the layer's tile (0 = untiled)."""
    cb, rb, per_mb = dtype.itemsize, residual_dtype.itemsize, tokens // micro_batches
    seq_len = seq_len or per_mb
    chunk = min(chunk_tokens, per_mb)
    layer = block_activation_bytes(cfg, per_mb, cb, rb, tile_tokens, seq_len)
    if tile_tokens:  # the whole sequence's attention, and one tile of the token-local parts
        attn = attention_bytes(cfg, per_mb, cb)
        layer = {f"whole-sequence attention: {per_mb:,} tok": attn,     # q, k, v, out, grads, kernel workspace
                 f"token-local activations: tiles of {min(tile_tokens, seq_len):,} tok": layer - attn}
    else:
        layer = {f"recompute activations: 1 layer, {per_mb:,} tok": layer}
    return {"residual x and its grad dy": 2 * tokens * cfg.d_model * rb, **layer,
            f"weight grads from autograd ({str(dtype)[6:]}, one unit)": n_slot * cb,
            f"loss chunk: {chunk:,} tokens x {cfg.vocab_size:,} logits":  # logits, fp32 copy, log-softmax, grads
                chunk * cfg.vocab_size * (12 + (2 * cb if cb == 2 else 0)),
            f"RoPE cos, sin: {seq_len:,} positions": 2 * seq_len * cfg.head_dim * rb,
            "targets": tokens * 8}


def offload_needed(activation_bytes, working_bytes, free_bytes):
    """Offload the boundary activations to host memory when, with one layer's working set beside them, they
    would not fit in the free device memory (the planner decides by it)."""
    return activation_bytes + working_bytes > free_bytes
