"""megatrain_min.checkpoints.checkpoint: save/load is bit-exact, a resumed run equals a straight one, a bad checkpoint is
refused before anything changes, and a save killed with SIGKILL leaves the previous checkpoint whole.
Reference for "resumed": the same Trainer run straight through, compared bit for bit (CPU, fp32)."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import model
from conftest import ROOT, engine, random_batch
from megatrain_min import data
from megatrain_min.checkpoints import checkpoint, ckpt_read
from megatrain_min.checkpoints.ckpt_read import CheckpointError
from megatrain_min.run.schedule import lr_at

CFG = model.PRESETS["toy"]
HP = dict(lr=1e-2, weight_decay=0.1, grad_clip=1.0, micro_batches=2, skip_nonfinite=True)  # as train.py runs it


def state(t):
    """Everything a checkpoint holds, copied: master, m, v per unit, and the Adam step counts."""
    t.weights()  # waits for pending updates
    units = range(len(t.units))
    return [[t.opt.tensors(u)[s].clone() for u in units] for s in ("master", "m", "v")] + [steps(t)]


def steps(t):
    """The Adam step count of every unit."""
    return [t.opt.steps[u].item() for u in range(len(t.units))]


def same(a, b):
    return all(torch.equal(x, y) if torch.is_tensor(x) else x == y for la, lb in zip(a, b) for x, y in zip(la, lb))


def trained(steps=3, seed=0, cfg=CFG):
    t = engine(cfg, model.init_weights(cfg, seed), device="cpu", **HP)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        t.step(*random_batch(cfg, 4, 16, gen))
    return t


def test_round_trip_is_bit_exact_and_refreshes_the_shadow(tmp_path):
    a = trained(3)
    path = checkpoint.save(a, tmp_path, 3, {"note": "hi"})   # updates still pending: save must wait for them
    assert path == tmp_path / "ckpt-00000003" and ckpt_read.latest(tmp_path) == path
    b = trained(1, seed=1)
    meta = checkpoint.load(b, path)
    assert meta == {"note": "hi", "step": 3}
    assert same(state(a), state(b)) and steps(b) == [3] * len(b.units)
    # a bf16 run resumes from an fp32 one: the compute-dtype shadow is rebuilt from the loaded master
    c = engine(CFG, model.init_weights(CFG, 2), device="cpu", dtype=torch.bfloat16)
    checkpoint.load(c, path)
    assert all(torch.equal(c.opt.shadow[u], a.opt.master[u].to(torch.bfloat16)) for u in range(len(c.units)))
    assert not list(tmp_path.glob(".tmp-*"))


def test_resident_units_round_trip(tmp_path):
    """A checkpoint does not depend on where the units lived or were updated: saved by a trainer with 3 units
    resident on the device (and 2 streamed ones updated there, their step counts on the device), loaded into one
    with none, into one with all of them resident and into one updating every streamed unit on the device, bit
    for bit (state(), on the CPU here; tests/engine/test_gpu.py loads on a GPU)."""
    a = engine(CFG, model.init_weights(CFG, 0), device="cpu", resident_units=3, gpu_updated_units=2, **HP)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        a.step(*random_batch(CFG, 4, 16, gen))
    path = checkpoint.save(a, tmp_path, 2, {})
    for k, g in ((0, 0), (99, 0), (1, 99)):
        b = engine(CFG, model.init_weights(CFG, 1), device="cpu", resident_units=k, gpu_updated_units=g, **HP)
        checkpoint.load(b, path)
        assert same(state(a), state(b))


def test_resume_equals_straight_run(tmp_path):
    """20 steps straight == 10 steps, save, a fresh Trainer (other init, other sampler seed), load, 10 more:
    the losses, master weights, m, v and step counts identical bit for bit."""
    tokens, _ = data.split(data.load_tokens(data.DEFAULT_DATA))

    def run(t, batches, start, stop):
        losses = []
        for step in range(start, stop):
            t.set_lr(lr_at(step, HP["lr"], 20, warmup=3))
            losses.append(t.step(*batches.next()))
        return losses

    straight = engine(CFG, model.init_weights(CFG, 0), device="cpu", **HP)
    want = run(straight, data.Batches(tokens, 4, 32, seed=0), 0, 20)

    first = engine(CFG, model.init_weights(CFG, 0), device="cpu", **HP)
    batches = data.Batches(tokens, 4, 32, seed=0)
    got = run(first, batches, 0, 10)
    checkpoint.save(first, tmp_path, 10, {"data": batches.state_dict(), "rng": checkpoint.rng_state()})
    del first, batches

    resumed = engine(CFG, model.init_weights(CFG, 1), device="cpu", **HP)
    batches = data.Batches(tokens, 4, 32, seed=99)
    meta = checkpoint.load(resumed, ckpt_read.latest(tmp_path))
    batches.load_state_dict(meta["data"])
    checkpoint.set_rng_state(meta["rng"])
    got += run(resumed, batches, meta["step"], 20)
    assert got == want
    assert same(state(resumed), state(straight))


def test_save_and_load_wait_for_updates_in_flight(tmp_path):
    """Optimizer updates still running on the worker thread land before save reads or load writes."""
    def slowed(t):  # every unit's AdamW takes 50 ms more: a step returns with its updates in flight
        step = t.opt.step

        def slow(*args, **kw):
            time.sleep(0.05)
            return step(*args, **kw)
        t.opt.step = slow
        return t

    batch = random_batch(CFG, 4, 16, torch.Generator().manual_seed(5))
    done = trained(1)
    done.step(*batch)
    a = slowed(trained(1))
    a.step(*batch)
    path = checkpoint.save(a, tmp_path, 2)      # must hold the updates of the second step
    b = slowed(trained(1, seed=1))
    b.step(*batch)
    checkpoint.load(b, path)                    # must overwrite b's updates, not be overwritten by them
    assert same(state(b), state(done)) and same(state(a), state(done))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_resume_equals_straight_run_on_gpu_bf16(tmp_path):
    """On a GPU in bf16 (streams, pinned store, bf16 shadow): 6 steps straight == 3 + save/load + 3, bit for bit
    (the engine is deterministic: tests/engine/test_gpu.py holds async == synchronised bit for bit)."""
    gen = torch.Generator().manual_seed(0)
    batches = [random_batch(CFG, 8, 64, gen) for _ in range(6)]
    make = lambda seed: engine(CFG, model.init_weights(CFG, seed), device="cuda", dtype=torch.bfloat16, **HP)  # noqa: E731
    straight = make(0)
    want = [straight.step(*b) for b in batches]
    first = make(0)
    got = [first.step(*b) for b in batches[:3]]
    path = checkpoint.save(first, tmp_path, 3)
    resumed = make(1)
    checkpoint.load(resumed, path)
    got += [resumed.step(*b) for b in batches[3:]]
    assert got == want
    assert same(state(resumed), state(straight))


def test_rng_state_round_trip():
    st = json.loads(json.dumps(checkpoint.rng_state()))
    want = (random.random(), np.random.rand(), torch.rand(3))
    checkpoint.set_rng_state(st)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert want[:2] == got[:2] and torch.equal(want[2], got[2])


def _truncate(p):
    f = p / "layer.1.bin"
    os.truncate(f, f.stat().st_size - 4)


def _flip(p, name="layer.2.bin"):
    f = p / name
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(b)


def _edit_meta(p, **kv):
    doc = json.loads((p / "meta.json").read_text())
    doc.update(kv)
    (p / "meta.json").write_text(json.dumps(doc))


BAD = {  # name: (how to spoil a checkpoint of CFG, words the one-line error must contain)
    "truncated": (_truncate, "truncated"),
    "flipped-byte": (_flip, "CRC-32"),
    "flipped-meta": (lambda p: _flip(p, "meta.json"), "meta.json"),
    "other-format-version": (lambda p: _edit_meta(p, version=3), "format version 3"),
    "missing-file": (lambda p: os.remove(p / "head.bin"), "missing"),
    "not-a-checkpoint": (lambda p: os.remove(p / "meta.json"), "not a checkpoint"),
    "other-config": (None, "n_head=2 in the checkpoint, 4 in this run"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_checkpoint_is_refused_and_trainer_untouched(tmp_path, kind):
    spoil, words = BAD[kind]
    if spoil is None:   # same sizes, another model: only the config tells them apart
        other = model.GPTConfig(**{**CFG.to_dict(), "n_head": 2, "n_kv_head": 2, "head_dim": 0})
        path = checkpoint.save(trained(1, cfg=other), tmp_path, 1)
    else:
        path = checkpoint.save(trained(2), tmp_path, 2)
        spoil(path)
    t = trained(1, seed=5)
    before = state(t)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(t, path)
    print(e.value)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert same(state(t), before)


# The fields of model.GPTConfig at 9d80d23 (main before hidden_act): what meta.json's "config" of a checkpoint
# written then holds. python train.py at 9d80d23 wrote exactly these (checked once by hand: such a run resumed here).
FIELDS_9D80D23 = ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "head_dim", "max_seq_len",
                  "rope_theta", "norm_eps", "qkv_bias", "qk_norm", "tie_embeddings", "rope_scaling", "sliding_window")


def edit_config(path, fn):
    """Edit meta.json's config with fn(config) and recompute its CRC (ckpt_read.doc_crc): a checkpoint as an older
    (or newer) version of the code would have written it."""
    doc = json.loads((path / "meta.json").read_text())
    doc.pop("crc32")
    fn(doc["config"])
    doc["crc32"] = ckpt_read.doc_crc(doc)
    (path / "meta.json").write_text(json.dumps(doc))


def test_a_checkpoint_without_a_newer_field_loads_with_its_default(tmp_path):
    """A field added to GPTConfig with a default since a checkpoint was written (hidden_act since 9d80d23) is missing
    from its meta.json: it takes the default and the checkpoint loads, bit for bit. A field present with another
    value is still refused, naming it; so is a field this code does not have."""
    a = trained(2)
    path = checkpoint.save(a, tmp_path, 2)
    edit_config(path, lambda c: [c.pop(k) for k in list(c) if k not in FIELDS_9D80D23])
    assert "hidden_act" not in json.loads((path / "meta.json").read_text())["config"]
    b = trained(1, seed=1)
    checkpoint.load(b, path)
    assert same(state(a), state(b))
    assert ckpt_read.read_weights(path)[0] == CFG
    for change, words in ((lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu' in the checkpoint, 'silu'"),
                          (lambda c: c.update(gate=True), "gate=True in the checkpoint, a config field this code")):
        edit_config(path, change)
        with pytest.raises(CheckpointError) as e:
            checkpoint.load(b, path)
        print(e.value)
        assert words in str(e.value) and "\n" not in str(e.value)
        edit_config(path, lambda c: [c.pop(k) for k in list(c) if k not in FIELDS_9D80D23])


def test_one_pass_load_checks_crcs_on_the_way(tmp_path):
    """verify_first=False reads each byte once: same result, and damage is still refused (the trainer may
    then be partial, which is why it is not the default)."""
    a = trained(2)
    path = checkpoint.save(a, tmp_path, 2)
    b = trained(1, seed=1)
    assert checkpoint.load(b, path, verify_first=False)["step"] == 2
    assert same(state(a), state(b))
    _flip(path)
    with pytest.raises(CheckpointError, match="layer.2.bin fails its CRC-32 check; the trainer is now partial"):
        checkpoint.load(b, path, verify_first=False)


def test_keep_last_k(tmp_path):
    t = trained(1)
    gone = subprocess.Popen(["true"])
    gone.wait()                                             # a PID that no process has any more
    (tmp_path / f".tmp-ckpt-00000009-{gone.pid}").mkdir()   # debris of an earlier crash
    for step in range(1, 6):
        checkpoint.save(t, tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000004", "ckpt-00000005"]
    assert [s for s, _ in ckpt_read.checkpoints(tmp_path)] == [4, 5]
    checkpoint.save(t, tmp_path, 5, keep=2)                 # the same step again replaces it
    assert checkpoint.load(t, ckpt_read.latest(tmp_path))["step"] == 5
    assert ckpt_read.latest(tmp_path / "nothing-here") is None


# the child: a ~6.6M-param model (79 MB per checkpoint) whose whole state is set to k before save k
CHILD = """
import sys; sys.path.insert(0, {root!r})
import model
from stream import Trainer
from megatrain_min.checkpoints import checkpoint
cfg = model.GPTConfig(n_layer=8, d_model=256, d_ff=704)
t = Trainer(cfg, model.init_weights(cfg, 0), device="cpu")
for k in range(1, 10_000):
    for u in range(len(t.units)):
        for s in t.opt.tensors(u).values():
            s.fill_(k)
        t.opt.steps[u].fill_(k)
    checkpoint.save(t, sys.argv[1], k, {{"k": k}}, keep=2)
    print("saved", k, flush=True)
"""


@pytest.mark.slow
def test_sigkill_during_save_leaves_previous_checkpoint_whole(tmp_path):
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(root=str(ROOT)), str(out)],
                             stdout=subprocess.PIPE, text=True)
    try:
        while child.stdout.readline().split() != ["saved", "2"]:  # two whole checkpoints, then:
            assert child.poll() is None, "the child died"
        deadline = time.time() + 30
        while not any(out.glob(".tmp-ckpt-*/*.bin")):          # save 3 is writing its files: kill it now
            assert time.time() < deadline
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        child.kill()
    assert child.returncode == -signal.SIGKILL
    assert list(out.glob(".tmp-ckpt-*")), "the kill should have landed in the middle of a save"
    path = ckpt_read.latest(out)
    cfg = model.GPTConfig(n_layer=8, d_model=256, d_ff=704)
    t = engine(cfg, model.init_weights(cfg, 1), device="cpu")
    k = checkpoint.load(t, path)["k"]
    assert path.name == f"ckpt-{k:08d}" and k >= 2
    assert all(bool((x == k).all()) for u in range(len(t.units)) for x in t.opt.tensors(u).values())
    assert steps(t) == [k] * len(t.units)
    checkpoint.save(t, out, k + 1, keep=2)                      # the next save clears the debris
    assert not list(out.glob(".tmp-*"))
