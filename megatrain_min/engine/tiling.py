"""tiling.py -- sequence tiling: a layer's token-local parts run a tile of tokens at a time (long
context).

What it is
    A layer is token-local part A (norm, q/k/v, RoPE), attention over the whole sequence, and
    token-local part C (o_proj + residual, norm, MLP + residual): model.attn_in, model.attention,
    model.attn_out_mlp. Tiled(n) is the layer the engine is handed for long sequences
    (stream.Trainer(layer=Tiled(n))): its block and block_grad run A and C on n tokens at a time, so
    no (T, d_ff) tensor ever exists, while attention sees all T tokens at once through SDPA (flash /
    efficient kernels: O(T) memory). Every token's arithmetic is the same tiled or not; only the
    weight gradients are summed in another order (tile by tile, in fp32). over_tiles is THE tile
    loop; tile_grad is the backward of a token-local part, tile by tile.
Reference
    Arctic Long Sequence Training's TiledMLP (arXiv 2506.13996), generalised to both token-local
    parts. Oracle: model.block / model.block_grad (tests/core/test_model.py,
    tests/core/test_stream.py).
Try it
    python train.py --seq-len 8192 --max-seq-len 8192 --batch-size 1 --tile-tokens 1000 --steps 2
"""
import torch

import model


def tiles(T, tile_tokens):
    """The token tiles of a sequence: slices of tile_tokens positions (the last one shorter when
    tile_tokens does not divide T); tile_tokens 0 = one tile, the whole sequence."""
    n = tile_tokens or T
    return [slice(s, min(s + n, T)) for s in range(0, T, n)]


def over_tiles(fn, T, tile_tokens, into=None):
    """THE tile loop. fn(s) returns a tuple of (B, len(s), ...) tensors for token tile s; they are
    assembled along the token axis (dim 1) into (B, T, ...) tensors -- new ones, or, when `into` is
    given, added into those (a gradient w.r.t. a tensor that feeds both token-local parts). One tile
    and no `into`: fn's own results (autograd then sees plain ops: the untiled layer)."""
    for s in tiles(T, tile_tokens):
        res = fn(s)
        if into is None:
            if s.stop - s.start == T:
                return res
            into = [r.new_zeros((r.shape[0], T, *r.shape[2:])) for r in res]
        for o, r in zip(into, res):
            o[:, s] += r
    return into


def tile_grad(fn, T, tile_tokens, xs, grads, w, acc, into=None):
    """The backward of a token-local part, tile by tile: for each token tile s, recompute fn(s, *xs'
    tiles) with grad and backpropagate the tiles of grads (one per output of fn). The weights'
    gradients are added into acc (fp32); returns the gradients w.r.t. xs as (B, T, ...) tensors
    (added into `into` when given)."""
    def one(s):
        x_s = [x[:, s].detach().requires_grad_() for x in xs]
        with torch.enable_grad():
            g = torch.autograd.grad(fn(s, *x_s), [*x_s, *w.values()], [g[:, s] for g in grads],
                                    allow_unused=True)
        # a part's weights get no gradient from the other part (None): add the ones made here
        used = [(a, g_w) for a, g_w in zip(acc.values(), g[len(xs):]) if g_w is not None]
        torch._foreach_add_([a for a, _ in used], [g_w for _, g_w in used])
        return g[:len(xs)]
    return over_tiles(one, T, tile_tokens, into)


class Tiled:
    """A layer (block, block_grad) whose token-local parts run tile_tokens tokens at a time."""

    def __init__(self, tile_tokens):
        if not (isinstance(tile_tokens, int) and tile_tokens > 0):
            raise ValueError("tile_tokens must be a positive integer (tokens per tile), got "
                             f"{tile_tokens!r}")
        self.tile_tokens = tile_tokens

    def block(self, cfg, x, w, rope):
        """model.block, parts A and C a tile at a time (untiled when one tile holds the
        sequence)."""
        T, (cos, sin), n = x.shape[1], rope, self.tile_tokens
        if n >= T:
            return model.block(cfg, x, w, rope)
        model.check_seq_len(cfg, T)
        q, k, v = over_tiles(lambda s: model.attn_in(cfg, x[:, s], w, cos[s], sin[s]), T, n)
        y = model.attention(cfg, q, k, v)                                           # (B, T, nh, hd)
        return over_tiles(lambda s: (model.attn_out_mlp(cfg, x[:, s], y[:, s], w),), T, n)[0]

    def block_grad(self, cfg, x, w, rope, dy, acc):
        """model.block_grad in three phases, so that one tile's token-local activations exist at a
        time:
          C  per tile: recompute x + o_proj(y) + MLP from (x, y) with grad; dy -> dx (part), dy_att,
             dW_C
          attention  : SDPA's backward on the whole sequence, dy_att -> dq, dk, dv
          A  per tile: recompute q, k, v from x with grad; (dq, dk, dv) -> dx (added), dW_A
        Each tile's weight gradients are added into acc (fp32) as they come: never summed in
        bf16."""
        T, (cos, sin), n = x.shape[1], rope, self.tile_tokens
        model.check_seq_len(cfg, T)
        part_a = lambda s, x_s: model.attn_in(cfg, x_s, w, cos[s], sin[s])           # noqa: E731
        part_c = lambda s, x_s, y_s: (model.attn_out_mlp(cfg, x_s, y_s, w),)         # noqa: E731
        with torch.no_grad():            # q, k, v of the whole sequence, a tile at a time, no graph
            q, k, v = (t.requires_grad_() for t in over_tiles(lambda s: part_a(s, x[:, s]), T, n))
        with torch.enable_grad():
            # (B, T, nh, hd); SDPA saves q, k, v, its output and lse
            y = model.attention(cfg, q, k, v)
        # (B, T, d), (B, T, nh, hd)
        dx, dy_att = tile_grad(part_c, T, n, [x, y.detach()], [dy], w, acc)
        dqkv = torch.autograd.grad(y, [q, k, v], dy_att)                        # the whole sequence
        del q, k, v, y, dy_att                  # SDPA's saved tensors go with its graph
        return tile_grad(part_a, T, n, [x], dqkv, w, acc, into=[dx])[0]
