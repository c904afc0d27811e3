"""N local ranks (gloo) against one process, for the tests: what torchrun --standalone makes, without the launcher.

spawn(fn, world, *args) runs fn on `world` fresh processes joined by gloo and returns their results by rank;
train() trains a config on random global batches with sharded.ShardedTrainer (the ranks of the current group)
or stream.Trainer; compare() runs cases both ways and measures how far they are apart.
"""
import collections
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import model
import stream
from megatrain_min.engine.sharded import TIMEOUT, ShardedTrainer


def _rank_main(rank, world, tmp, fn, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)                   # as torchrun: the ranks share this machine's cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        torch.save(fn(*args), os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(fn, world, *args, meanwhile=None):
    """fn(*args) on `world` fresh local processes joined by gloo (what torchrun --standalone makes, without the
    launcher): returns their results by rank -- and meanwhile()'s, run here while they run (the ranks wait on each
    other a lot: a reference computed meanwhile uses cores they leave idle). fn must be importable (a module-level
    function), its result something torch.save writes. A failing rank raises here with its traceback.
    The ranks are forked by multiprocessing's forkserver: one process, started on the first spawn, that has
    imported torch and this module and computed nothing (so forking it is safe), instead of a fresh interpreter
    per rank importing torch (~1.5 s each). So the ranks see os.environ as it was at the first spawn: what a
    rank needs set goes in through args."""
    mp.set_forkserver_preload([__name__])
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_rank_main, args=(world, tmp, fn, args), nprocs=world, start_method="forkserver",
                                 join=False)
        try:
            mine = meanwhile() if meanwhile else None
        finally:
            while not ctx.join():
                pass
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)], mine


def train(cfg, steps, batch, sharded, seed=0, **kw):
    """Train cfg from init_weights(seed) for `steps` steps on random global batches batch=(B, T) (the same ones
    whatever runs it), on ShardedTrainer (the ranks of the current process group) or stream.Trainer. Returns
    (losses, weights, grad norms, traffic per step) -- weights whole, on every rank."""
    gen = torch.Generator().manual_seed(seed + 1)
    t = (ShardedTrainer if sharded else stream.Trainer)(cfg, model.init_weights(cfg, seed), device="cpu", **kw)
    losses, norms, traffic = [], [], []
    for _ in range(steps):
        tok = torch.randint(0, cfg.vocab_size, batch, generator=gen)
        tgt = torch.randint(0, cfg.vocab_size, batch, generator=gen)
        tgt[torch.rand(batch, generator=gen) < 0.2] = model.IGNORE
        before = collections.Counter(getattr(t, "traffic", {}))
        losses.append(t.step(tok, tgt))
        t.wait()
        norms.append(t.grad_norm)
        traffic.append(dict(collections.Counter(getattr(t, "traffic", {})) - before))
    return losses, t.weights(), norms, traffic


def _train_rank(cases, steps, batch):
    return [train(model.GPTConfig(**c), steps, batch, True, **kw) for c, kw in cases]


def compare(cases, world, steps=5, batch=(8, 16)):
    """Each case (cfg, Trainer kwargs) for `steps` steps on `world` local ranks (one spawn for them all) and in
    one process, on the same global batches. The one process runs world x micro_batches micro-batches: the same
    micro-batch size, so that both compute the same matmuls and only the order of the fp32 gradient sums differs
    (with another micro-batch size the one process disagrees with ITSELF by as much: test_sharded.py).
    Returns per case {"loss_rel": the worst per-step relative loss difference, "weights_rel": ||w_N - w_1|| /
    ||w_1|| after the steps, "weights_max": the largest elementwise difference, "traffic": bytes per wire of
    rank 0's last step, "losses": (N ranks, one process), "norms": rank 0's grad norms}."""
    ranks, ones = spawn(_train_rank, world, [(cfg.to_dict(), kw) for cfg, kw in cases], steps, batch, meanwhile=lambda: [
        train(cfg, steps, batch, False, **dict(kw, micro_batches=world * kw.get("micro_batches", 1))) for cfg, kw in cases])
    out = []
    for k, (cfg, kw) in enumerate(cases):
        (losses, w, norms, traffic), (losses1, w1, _, _) = ranks[0][k], ones[k]
        assert all(r[k][0] == losses for r in ranks), "the ranks disagree on the losses"
        out.append(dict(loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, losses1)),
                        weights_rel=weights_rel(w, w1), weights_max=max(float((w[k] - w1[k]).abs().max()) for k in w1),
                        traffic=traffic[-1], losses=(losses, losses1), norms=norms))
    return out


def weights_rel(w, w1):
    """||w - w1|| / ||w1|| over every tensor of two whole models, in fp64."""
    diff = sum(float(((w[k] - w1[k]).double() ** 2).sum()) for k in w1)
    return (diff / sum(float((v.double() ** 2).sum()) for v in w1.values())) ** 0.5
