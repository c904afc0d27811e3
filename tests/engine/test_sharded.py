"""megatrain_min/engine/sharded.py: N ranks (gloo, local processes) train exactly what one process trains on the same global
batches. Reference: stream.Trainer in one process, itself held to plain PyTorch by tests/core/test_stream.py.
Tolerances: per-step loss <= 1e-6 relative, weights after 5 steps <= 1e-5 relative (||w_N - w_1|| / ||w_1||).
The one process runs N x M micro-batches, the ranks' micro-batch size: both then compute the same matmuls and only
the order of the fp32 sums of the gradients (gloo's reduce_scatter against the accumulation in one grad slot) differs.
One spawn per world size runs every case (a spawn costs seconds of imports on 2 cores)."""
import functools
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import weakref

from pathlib import Path

import pytest
import torch

import cuda_doubles
import model
from conftest import ROOT, SPECIAL, engine, random_batch, train_py, wait_for_training
import ranks
from megatrain_min.checkpoints import checkpoint, ckpt_read
from megatrain_min.engine import sharded

pytestmark = pytest.mark.slow   # the whole module: `python -m pytest -m "not slow"` leaves it out

UNTIED = model.GPTConfig(vocab_size=101, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=32)
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 0.5      # below the toy's gradient norms (asserted): clipping happens
CASES = [(cfg, dict(HP, micro_batches=M, grad_clip=clip))
         for cfg in (UNTIED, SPECIAL) for M in (1, 2) for clip in (0.0, CLIP)]
IDS = [f"{'tied' if cfg.tie_embeddings else 'untied'}-M{kw['micro_batches']}-{'clip' if kw['grad_clip'] else 'noclip'}"
       for cfg, kw in CASES]
BATCH = (8, 8)  # the global batch: 8 sequences of 8 tokens; N=4, M=2 leaves one sequence per micro-batch
# N = 2: every case; N = 4: a pairwise cover of them (tied x M x clip, each pair of values once), for time
PICK = {2: list(range(len(CASES))), 4: [i for i, (cfg, kw) in enumerate(CASES)
                                        if (kw["micro_batches"] == 2) == (bool(kw["grad_clip"]) != cfg.tie_embeddings)]}


@functools.cache
def compared(world):
    """{case: ranks.compare's result} of the cases PICK[world], from one spawn of `world` ranks."""
    return dict(zip(PICK[world], ranks.compare([CASES[i] for i in PICK[world]], world, steps=5, batch=BATCH)))


@pytest.mark.parametrize("world,case", [(w, i) for w in PICK for i in PICK[w]],
                         ids=[f"N{w}-{IDS[i]}" for w in PICK for i in PICK[w]])
def test_n_ranks_train_what_one_process_trains(world, case):
    r, (_, kw) = compared(world)[case], CASES[case]
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


# ----------------------------------------------------------------------------- checkpoints across world sizes
CK_CFG, CK_KW = SPECIAL, dict(HP, micro_batches=1, grad_clip=CLIP)


def _batches(cfg, n=5):
    gen = torch.Generator().manual_seed(11)
    return [random_batch(cfg, *BATCH, gen) for _ in range(n)]


def _shard_states(t):
    """Rank t's [lo, hi) of master, m, v of every unit, and the step counts."""
    out = []
    for u in range(len(t.units)):
        lo, hi = t.placement.part(t.units[u])
        out.append(({s: v[:hi - lo].clone() for s, v in t.opt.tensors(u).items()},
                    t.opt.steps[u].item()))
    return out


def _ckpt_rank(cfg_dict, kw, out):
    """On each rank: train 3 steps, save ckpt n2 (the parts), train steps 4-5; a second trainer (other init) loads
    n2 and trains 4-5; a third loads n1 (one process wrote it) and trains 4-5."""
    cfg, batches = model.GPTConfig(**cfg_dict), _batches(model.GPTConfig(**cfg_dict))
    t = sharded.ShardedTrainer(cfg, model.init_weights(cfg, 0), device="cpu", **kw)
    for x, y in batches[:3]:
        t.step(x, y)
    checkpoint.save(t, f"{out}/n2", 3, {"run": "n2"})
    at3, states3 = t.weights(), _shard_states(t)
    first = [t.step(x, y) for x, y in batches[3:]]
    res = {"at3": at3, "states3": states3, "first": (first, t.weights())}
    for name in ("n2", "n1"):
        r = sharded.ShardedTrainer(cfg, model.init_weights(cfg, 1), device="cpu", **kw)
        checkpoint.load(r, ckpt_read.latest(f"{out}/{name}"))
        res[f"from_{name}_states"] = _shard_states(r)
        res[f"from_{name}"] = ([r.step(x, y) for x, y in batches[3:]], r.weights())
    return res


def test_checkpoints_resume_bit_exact_and_reshard_1_to_2_and_2_to_1(tmp_path):
    """2 ranks save at step 3 (parts); 2 fresh ranks load it and train on bit for bit; one process loads it
    (resharded: the ranks' shards end to end) and trains on; 2 ranks load one process's checkpoint (each its
    slice). Training on from a resharded checkpoint agrees with the other world size to the tolerances above."""
    cfg, kw, batches = CK_CFG, CK_KW, _batches(CK_CFG)
    one_kw = dict(kw, micro_batches=2 * kw["micro_batches"])          # the ranks' micro-batch size (see compare)
    one = engine(cfg, model.init_weights(cfg, 0), device="cpu", **one_kw)
    for x, y in batches[:3]:
        one.step(x, y)
    checkpoint.save(one, tmp_path / "n1", 3, {"run": "n1"})
    one_at3, one_states3 = one.weights(), _shard_states(one)
    one_rest = ([one.step(x, y) for x, y in batches[3:]], one.weights())

    got, _ = ranks.spawn(_ckpt_rank, 2, cfg.to_dict(), kw, str(tmp_path))
    r0 = got[0]
    n2 = ckpt_read.latest(tmp_path / "n2")
    doc = ckpt_read.read_meta(n2)
    assert doc["version"] == ckpt_read.SHARDED and all(len(u["parts"]) == 2 for u in doc["units"])
    assert not list((tmp_path / "n2").glob(".tmp-*"))
    # same world size: bit-exact
    assert r0["from_n2"][0] == r0["first"][0]
    assert all(torch.equal(r0["from_n2"][1][k], r0["first"][1][k]) for k in r0["first"][1])
    for r in got:                                                   # every rank's master, m, v and step counts
        for (a, na), (b, nb) in zip(r["from_n2_states"], r["states3"]):
            assert na == nb and all(torch.equal(a[s], b[s]) for s in a)
    # 1 -> 2: each rank holds exactly its slice of the one process's master, m and v
    for rank, r in enumerate(got):
        for u, (st, n) in enumerate(r["from_n1_states"]):
            numel = one.units[u].numel
            lo = min(rank * sharded.shard_numel(numel, 2), numel)
            hi = min(lo + sharded.shard_numel(numel, 2), numel)
            assert n == one_states3[u][1] and all(torch.equal(st[k], one_states3[u][0][k][lo:hi]) for k in st)
    # 2 -> 1: the one process holds the ranks' shards end to end
    back = engine(cfg, model.init_weights(cfg, 1), device="cpu", **one_kw)
    checkpoint.load(back, n2)
    for u in range(len(back.units)):
        for s in back.opt.tensors(u):
            assert torch.equal(back.opt.tensors(u)[s], torch.cat([r["states3"][u][0][s] for r in got]))
    assert all(torch.equal(back.weights()[k], r0["at3"][k]) for k in r0["at3"])
    back_rest = ([back.step(x, y) for x, y in batches[3:]], back.weights())
    # and training on from either agrees with the other world size as closely as test_n_ranks_... demands
    for (l_a, w_a), (l_b, w_b) in ((r0["from_n1"], one_rest), (back_rest, r0["first"])):
        assert max(abs(a - b) / abs(b) for a, b in zip(l_a, l_b)) <= 1e-6
        assert ranks.weights_rel(w_a, w_b) <= 1e-5
    assert ranks.weights_rel(one_at3, r0["at3"]) <= 1e-5
    # complete only when every part and the meta are there: a lost part is refused, naming it
    lost = tmp_path / "lost" / n2.name
    shutil.copytree(n2, lost)
    (lost / "layer.1.part1.bin").unlink()
    with pytest.raises(ckpt_read.CheckpointError, match=r"layer\.1\.part1\.bin is missing"):
        checkpoint.load(engine(cfg, model.init_weights(cfg, 1), device="cpu", **one_kw), lost)


# ----------------------------------------------------------------------------- train.py under torchrun
FLAGS = ["--config", "toy", "--n-kv-head", "2", "--batch-size", "8", "--seq-len", "64", "--micro-batches", "2",
         "--grad-clip", "1.0", "--steps", "8", "--save-every", "4", "--sample-tokens", "0"]


def torchrun_env(world, local, rank=0):
    """The environment torchrun gives rank `rank` of `world` (`local` per node): what train.py reads."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local), LOCAL_WORLD_SIZE=str(local),
                MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")


def _run(tmp, out, *extra, world=1, check=True, env=None):
    """python train.py, or torchrun --standalone with `world` CPU ranks (python -m torch.distributed.run), forked
    by conftest's runner; returns the CompletedProcess. One OpenMP thread per process, as torchrun sets it."""
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    if world == 1:
        r = train_py(*FLAGS, "--out", tmp / out, *extra, cwd=tmp, env=env)
    else:
        r = train_py("--standalone", "--nproc-per-node", world, ROOT / "train.py", *FLAGS, "--out", tmp / out, *extra,
                     cwd=tmp, env=env, module="torch.distributed.run")
    assert r.returncode == 0 or not check, r.stderr[-3000:]
    return r


def _losses(path):
    return {rec["step"]: rec["loss"] for rec in map(json.loads, path.read_text().splitlines())}


def _close(a, b):
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


def test_train_py_under_torchrun_writes_the_losses_of_one_process(tmp_path, multi_gpu_smoke):
    """torchrun --nproc-per-node 2 train.py ... on the CPU writes the per-step losses of python train.py with the
    same flags (<= 1e-5 relative) to one metrics.jsonl; only rank 0 prints. Checkpoints made by train.py resume
    at the same world size bit for bit, and at another (2 -> 1) to 1e-5. The two runs are bench/multi_gpu.py's
    exact case (the multi_gpu_smoke fixture): FLAGS with --device cpu --dtype fp32, the defaults here."""
    for n in (1, 2):                                          # the bench ran train.py with exactly these flags
        assert " ".join(FLAGS) in (multi_gpu_smoke / f"exact-{n}.log").read_text().splitlines()[0]
    for name in ("one", "two"):
        shutil.copytree(multi_gpu_smoke / f"exact-{1 if name == 'one' else 2}", tmp_path / name)
    stdout = {name: (multi_gpu_smoke / f"exact-{n}.log").read_text() for name, n in (("one", 1), ("two", 2))}
    l1, l2 = _losses(tmp_path / "one" / "metrics.jsonl"), _losses(tmp_path / "two" / "metrics.jsonl")
    print(f"torchrun 2 ranks vs one process: worst loss rel {_close(l2, l1):.1e}")
    assert sorted(l2) == list(range(1, 9)) and _close(l2, l1) <= 1e-5
    assert stdout["two"].count("done: 8 steps") == 1 and stdout["one"].count("done: 8 steps") == 1
    assert not list((tmp_path / "two").glob("**/*.tmp*")) and json.loads(
        (tmp_path / "two" / "config.json").read_text())["world_size"] == 2
    for src, out, world in (("two", "2to2", 2), ("two", "2to1", 1)):   # 1 -> 2: the checkpoint test above
        (tmp_path / out).mkdir()
        shutil.copytree(tmp_path / src / "ckpt-00000004", tmp_path / out / "ckpt-00000004")
        _run(tmp_path, out, "--resume", world=world)
        got, want = _losses(tmp_path / out / "metrics.jsonl"), _losses(tmp_path / src / "metrics.jsonl")
        assert sorted(got) == [5, 6, 7, 8]
        print(f"resume {out}: worst loss rel {_close(got, want):.1e}")
        if world == 2 and src == "two":
            assert got == {s: want[s] for s in got}                      # bit for bit
        else:
            assert _close(got, want) <= 1e-5


def test_the_plan_under_torchrun_is_for_its_ranks(tmp_path, multi_gpu_smoke):
    """Under torchrun the plan is made for the run's ranks (LOCAL_WORLD_SIZE GPUs per node, WORLD_SIZE in all):
    host memory per node, the device's per GPU -- not for one GPU (which refuses runs that fit on N)."""
    r = _run(tmp_path, "o", "--plan", "--json", env=torchrun_env(world=4, local=2))
    p = json.loads(r.stdout)
    assert (p["gpus"], p["nodes"], p["world"]) == (2, 2, 4), r.stdout[:300]
    one = json.loads(_run(tmp_path, "o", "--plan", "--json").stdout)
    master, master1 = p["host"]["fp32 master"], one["host"]["fp32 master"]
    assert one["world"] == 1 and master1 / 2 <= master <= master1 / 2 + 4 * 4 * 10   # half the store per node
    log = (multi_gpu_smoke / "exact-2.log").read_text()
    assert "plan for 2 ranks (2 per node): --mode fast, host" in log and "per GPU" in log, log[:2000]


@pytest.mark.parametrize("local,seen,want", [(1, 4, "cuda:1"), (1, 1, "cuda:0"), (3, 1, "cuda:0"), (5, 4, None)])
def test_rank_device_from_local_rank(monkeypatch, local, seen, want):
    """torchrun's LOCAL_RANK picks the GPU; a launcher that gives each rank one visible GPU (CUDA_VISIBLE_DEVICES)
    leaves cuda:0; a LOCAL_RANK past the GPUs this process sees is refused in one line. The GPU is made current
    (through a set_device double that refuses what the real one refuses: tests/cuda_doubles.py)."""
    gpu = cuda_doubles.install(monkeypatch, devices=seen)
    monkeypatch.setenv("LOCAL_RANK", str(local))
    if want is None:
        with pytest.raises(ValueError, match=f"LOCAL_RANK {local} but this process sees {seen} CUDA devices"):
            sharded.rank_device("cuda")
    else:
        assert str(sharded.rank_device("cuda")) == want and [f"cuda:{d}" for _, d in gpu.set_device_calls] == [want]
        assert torch.cuda.current_device() == torch.device(want).index


def _export_rank():
    """A 2-rank ShardedTrainer's weights(to=0): every tensor on rank 0, nothing on the others; and the message
    of a batch of 4 with 4 micro-batches per rank (each rank's 2 sequences cannot make 4)."""
    cfg = UNTIED
    t = sharded.ShardedTrainer(cfg, model.init_weights(cfg, 0), device="cpu")
    four = sharded.ShardedTrainer(cfg, model.init_weights(cfg, 0), device="cpu", micro_batches=4)
    x = torch.zeros(4, 8, dtype=torch.long)
    try:
        four.step(x, x)
        refused = None
    except ValueError as e:
        refused = str(e)
    return {k: v.shape for k, v in t.weights(to=0).items()}, sorted(t.weights()), refused


def test_an_export_gathers_the_weights_on_rank_0_alone():
    """... and a batch the ranks cannot split into their micro-batches is refused before any work."""
    (w0, every0, refused), (w1, every1, _) = ranks.spawn(_export_rank, 2)[0]
    assert refused == ("batch size 4 is not divisible by 2 ranks x micro_batches 4 (each rank computes batch size / "
                       "2 sequences in micro_batches micro-batches)")
    keys = sorted(model.init_weights(UNTIED, 0))
    assert sorted(w0) == keys == every0 == every1 and w1 == {}
    assert all(tuple(w0[k]) == tuple(v.shape) for k, v in model.init_weights(UNTIED, 0).items())


def test_train_py_under_torchrun_refuses_a_batch_the_ranks_cannot_split(tmp_path):
    """Checked before the ranks join (so torchrun's environment alone shows it): one line, exit 2, nothing made."""
    r = _run(tmp_path, "o", "--batch-size", "6", check=False, env=torchrun_env(world=2, local=2))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: --batch-size 6 is not divisible by 2 ranks x --micro-batches 2 (each rank computes --batch-size / 2 "
        "sequences in --micro-batches micro-batches)"]
    assert not (tmp_path / "o").exists()
    r = _run(tmp_path, "o", "--batch-size", "6", check=False, env=torchrun_env(world=2, local=2, rank=1))
    assert r.returncode == 2 and r.stderr == "" and r.stdout == ""    # rank 1 finds the same and leaves it to rank 0


def _launch(cli, tmp, out, *extra, steps="8"):
    """python train.py --nproc-per-node 2 (launch.py) with FLAGS on CPU ranks, started (conftest.TrainCLI)."""
    return cli.start("--nproc-per-node", "2", *FLAGS, "--steps", steps, "--out", tmp / out, *extra, cwd=tmp,
                     env={"OMP_NUM_THREADS": "1"})


def test_train_py_nproc_per_node_checks_first_then_trains_as_torchrun(tmp_path, multi_gpu_smoke, cli):
    """python train.py --nproc-per-node 2: a bad input is refused in one line with exit 2 before any rank starts
    (torchrun: exit 1 after its report); a good run writes torchrun's losses (bench/multi_gpu.py's exact case, the
    same flags) and prints once; a SIGTERM to it stops the ranks with a save and exit 0, resumable; a rank killed
    is named, exit 128 + 9. The bad and the good run at once, then the stopped and the killed one."""
    bad, good = _launch(cli, tmp_path, "bad", "--batch-size", "6"), _launch(cli, tmp_path, "good")
    r = cli.wait(bad)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: --batch-size 6 is not divisible by 2 ranks x --micro-batches 2 (each rank computes --batch-size / 2 "
        "sequences in --micro-batches micro-batches)"] and not (tmp_path / "bad").exists()
    r = cli.wait(good)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = _losses(tmp_path / "good" / "metrics.jsonl"), _losses(multi_gpu_smoke / "exact-2" / "metrics.jsonl")
    print(f"--nproc-per-node 2 vs torchrun: worst loss rel {_close(got, want):.1e}")
    assert sorted(got) == list(range(1, 9)) and _close(got, want) <= 1e-5
    assert r.stdout.count("done: 8 steps") == 1
    stop, lost = (_launch(cli, tmp_path, name, "--save-every", "100000", steps="100000") for name in ("stop", "lost"))
    signalled = False
    try:
        wait_for_training(tmp_path / "stop")
        wait_for_training(tmp_path / "lost")
        os.kill(stop.pid, signal.SIGTERM)
        ranks_of = [int(p) for f in (Path("/proc") / str(lost.pid) / "task").glob("*/children")
                    for p in f.read_text().split()]
        assert len(ranks_of) == 2
        os.kill(ranks_of[1], signal.SIGKILL)
        signalled = True
    finally:                        # should the above fail, neither leaves its ranks training (SIGTERM: passed on)
        for run in (stop, lost) if not signalled else ():
            os.kill(run.pid, signal.SIGTERM)
        stopped, killed = cli.wait(stop), cli.wait(lost)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    saved = ckpt_read.latest(tmp_path / "stop")
    assert saved is not None and f"checkpoint {saved}; continue with --resume" in stopped.stdout
    assert [p.name for p in (tmp_path / "stop").iterdir() if p.name.startswith("ckpt-")] == [saved.name]
    assert killed.returncode == 128 + signal.SIGKILL and "was killed (signal 9)" in killed.stderr.splitlines()[-1], \
        killed.stderr


def test_a_rank_that_exits_any_way_destroys_its_process_group_first(tmp_path):
    """A gloo rank joined by init_from_env leaves the group at exit whatever the way out (a stop's sys.exit in the
    training loop, a refusal): torch does not, and a gloo group torn down by the finalizing interpreter aborts
    the process (exit 134, "terminate called without an active exception": a SIGTERM-stopped run that saved,
    reported as killed). An atexit handler registered before init_from_env runs after its own (last in, first
    out) and sees the group gone."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import atexit, sys\n"
            "import torch.distributed as dist\n"
            "from megatrain_min.engine import sharded\n"
            "atexit.register(lambda: print('group at exit:', dist.is_initialized()))\n"
            "sharded.init_from_env('cpu')\n"
            "dist.all_reduce(__import__('torch').ones(3))\n"
            "sys.exit(0)\n")
    env = {**os.environ, **torchrun_env(world=1, local=1), "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0 and r.stdout.splitlines() == ["group at exit: False"], r.stdout + r.stderr[-2000:]


def test_the_trainer_holds_no_process_group_past_its_destruction():
    """dist.destroy_process_group frees the default group while Python is whole: the trainer looks it up and
    never holds it, so its backend's threads are not torn down at interpreter exit (where gloo can abort the
    process after a finished run: "terminate called without an active exception")."""
    dist = sharded.dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = sharded.ShardedTrainer(UNTIED, model.init_weights(UNTIED, 0), device="cpu")
        group = weakref.ref(dist.group.WORLD)
        assert t.placement.group is group()
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert group() is None and t.world == 1
