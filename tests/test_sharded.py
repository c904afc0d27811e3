"""megatrain_min/sharded.py: N ranks (gloo, local processes) train exactly what one process trains on the same global
batches. Reference: stream.Trainer in one process, itself held to plain PyTorch by tests/test_stream.py.
Tolerances (issue 16): per-step loss <= 1e-6 relative, weights after 5 steps <= 1e-5 relative (||w_N - w_1|| / ||w_1||).
The one process runs N x M micro-batches, the ranks' micro-batch size: both then compute the same matmuls and only
the order of the fp32 sums of the gradients (gloo's reduce_scatter against the accumulation in one grad slot) differs.
One spawn per world size runs every case (a spawn costs seconds of imports on 2 cores)."""
import pytest
import torch

import model
from conftest import SPECIAL
from megatrain_min import sharded

UNTIED = model.GPTConfig(vocab_size=101, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=32)
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 0.5      # below the toy's gradient norms (asserted): clipping happens
CASES = [(cfg, dict(HP, micro_batches=M, grad_clip=clip))
         for cfg in (UNTIED, SPECIAL) for M in (1, 2) for clip in (0.0, CLIP)]
IDS = [f"{'tied' if cfg.tie_embeddings else 'untied'}-M{kw['micro_batches']}-{'clip' if kw['grad_clip'] else 'noclip'}"
       for cfg, kw in CASES]
BATCH = (8, 8)  # the global batch: 8 sequences of 8 tokens; N=4, M=2 leaves one sequence per micro-batch


@pytest.fixture(scope="module", params=[2, 4], ids=["N2", "N4"])
def runs(request):
    world = request.param
    return world, sharded.compare(CASES, world, steps=5, batch=BATCH)


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_n_ranks_train_what_one_process_trains(runs, case):
    world, results = runs
    r, (cfg, kw) = results[case], CASES[case]
    print(f"N={world} {IDS[case]}: loss rel {r['loss_rel']:.1e}, weights rel {r['weights_rel']:.1e}, "
          f"max |dw| {r['weights_max']:.1e}")
    assert r["loss_rel"] <= 1e-6, r["losses"]
    assert r["weights_rel"] <= 1e-5
    assert len(set(r["losses"][0])) == 5                        # it trained: every step's loss differs
    if kw["grad_clip"]:
        assert max(r["norms"]) > CLIP                           # the clip was applied, from the all-reduced norm
    t = r["traffic"]
    assert t["gathered"] > 0 and t["scattered"] > 0 and t["h2d"] > 0 and t["d2h"] > 0


def test_shards_cover_every_unit_once():
    """The ranks' [lo, hi) of a unit tile it; the shard sizes pad it to a multiple of N."""
    for n in (1, 7, 101 * 32, 4097):
        for world in (1, 2, 3, 4):
            s = sharded.shard_numel(n, world)
            assert s * world >= n > s * (world - 1) - (world - 1) or n < world
            spans = [(min(r * s, n), min(r * s + s, n)) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("lo,hi,d", [(0, 12, 4), (5, 6, 4), (3, 14, 4), (5, 7, 4), (4, 8, 4), (0, 0, 4)])
def test_row_pieces_cover_the_span_in_order(lo, hi, d):
    """row_pieces: rectangles of a row-major (., d) table whose elements, in order, are exactly [lo, hi)."""
    table = torch.arange(4 * d * 4).view(-1, d)
    flat = table.reshape(-1)
    got = [None] * (hi - lo)
    for r0, r1, c0, c1, off in sharded.row_pieces(lo, hi, d):
        block = table[r0:r1, c0:c1].reshape(-1)
        got[off:off + block.numel()] = block.tolist()
    assert got == flat[lo:hi].tolist()
    assert len(sharded.row_pieces(lo, hi, d)) <= 3


def test_the_embedding_shards_split_rows():
    """Some rank's shard of the table starts inside a row, in both embeddings above (so the partial-row pieces of
    embed_rows and add_embedding_grad are exercised): untied at N = 2 and 4, tied at N = 4."""
    for cfg, worlds in ((UNTIED, (2, 4)), (SPECIAL, (4,))):
        unit = model.units(cfg)[-1 if cfg.tie_embeddings else 0]
        for world in worlds:
            s = sharded.shard_numel(unit.numel, world)
            assert any(r * s % cfg.d_model for r in range(1, world) if r * s < cfg.vocab_size * cfg.d_model)
