"""The GPU benchmark harness (bench/gpu.py) end to end in --smoke mode: tiny shapes, every case that can
run on this machine (CUDA-only ones record "skipped: no CUDA"), and the three output files with their fields;
`bash bench/gpu_run.sh --quick` likewise (the quick case's tiny shapes). This checks the harness, not the speed:
the numbers only have to exist and be positive. And the bench's own arithmetic, in the fast tier: the bytes a
trainer moves over the link per mode (link_bytes), the steady and the per-step-synced step (time_steps)."""
import importlib.util
import json
import os
import subprocess
import threading
import time

import pytest
import torch

import model
from conftest import ROOT, engine, random_batch, train_py

slow = pytest.mark.slow   # end to end: `python -m pytest -m "not slow"` leaves them out


def bench_gpu():
    """bench/gpu.py as a module (bench/ is never imported by the library: loaded by path)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SUMMARY_KEYS = {"device", "overlap", "vs_resident", "vs_fsdp2_offload", "model_tflops_7b_wide", "gpu_mem_depth_spread"}


def positive_where_measured(r):
    for k in ("step_s", "tokens_per_s", "model_tflops", "hw_tflops", "compute_only_s", "overlap", "rss_gb"):
        assert r[k] > 0, (k, r)
    assert all(t > 0 for t in r["steps_synced_s"]) and r["step_synced_s"] > 0


@slow
def test_bench_smoke(tmp_path):
    out = tmp_path / "bench"
    p = train_py("--smoke", "--profile", "--out", out, script="bench/gpu.py")
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads((out / "results.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary), summary
    assert {"device", "driver", "torch", "date", "command"} <= set(res["meta"])
    assert "overlap" in res["definitions"] and "model_tflops" in res["definitions"]
    c = res["cases"]
    for r in c["sweep"]["depths"].values():
        positive_where_measured(r)
        assert r["h2d_gbs"] > 0 and r["d2h_gbs"] > 0
    positive_where_measured(c["peers"]["stream"])
    positive_where_measured(c["wide"]["at_min_tokens"])
    positive_where_measured(c["wide"]["at_2x_tokens"])
    assert c["wide"]["at_2x_tokens"]["tokens"] == 2 * c["wide"]["at_min_tokens"]["tokens"]
    for key in ("lean_clip_1", "clip_1", "clip_1_host", "lean_clip_0", "at_2x_tokens"):   # each says its engine
        positive_where_measured(c["wide"][key])
        assert "gpu_updated_units" in c["wide"][key] and "grad_slabs" in c["wide"][key], key
    assert c["wide"]["clip_1_host"]["gpu_updated_units"] == 0 and c["wide"]["lean_clip_1"]["mode"] == "lean"
    for peer in ("resident", "fsdp2_offload"):  # on the CPU: fp32 resident, plain FSDP2 on gloo (code paths only)
        assert c["peers"][peer].get("tokens_per_s", 0) > 0, c["peers"][peer]
    assert summary["overlap"] > 0 and summary["vs_fsdp2_offload"] > 0 and summary["vs_resident"] > 0
    assert (out / "trace.json.gz").stat().st_size > 0
    assert "| case |" in (out / "results.md").read_text()
    if res["meta"]["device"] == "cpu":
        assert c["pinned"] == {"skipped": "no CUDA"} and c["peers"]["resident_no_ckpt"] == {"skipped": "no CUDA"}
        assert summary["gpu_mem_depth_spread"] is None and summary["model_tflops_7b_wide"] is None


@slow
def test_multi_gpu_bench_smoke(multi_gpu_smoke):
    """bench/multi_gpu.py --smoke: the harness of gpu_run.sh's multi-GPU case, on the CPU with 2 gloo ranks. Its
    exact case: the losses of torchrun and of one process agree to 1e-5."""
    res = json.loads((multi_gpu_smoke / "multi_gpu.json").read_text())
    exact, scaling = res["cases"]["exact"], res["cases"]["scaling"]
    assert len(exact["losses_1"]) == len(exact["losses_n"]) == 8 and exact["worst_loss_rel"] <= 1e-5
    assert scaling["tokens_per_s_1"] > 0 and scaling["tokens_per_s_n"] > 0 and res["meta"]["world"] == 2


@slow
def test_gpu_run_quick_smoke(tmp_path):
    """`bash bench/gpu_run.sh --quick` on this machine with tiny shapes (BENCH_ARGS=--smoke): the exactness tests
    (skipped without CUDA), the host AdamW's DMA part (its CPU half), bench/gpu.py --quick -- every row of the
    quick case (lean and fast, clip 1 and 0, GPU-updated units and none, both token counts) measured beside its
    plan, results.json and the table written."""
    env = dict(os.environ, OUT=str(tmp_path), BENCH_ARGS="--smoke", ADAMW_ARGS="--smoke --unit 1e5")
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), "--quick"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    q = json.loads((tmp_path / "quick" / "results.json").read_text())
    rows = q["cases"]["quick"]["rows"]
    assert q["meta"]["quick"] and len(rows) == 16 and len(q["cases"]["quick"]["trainers"]) == 8
    for name, r in rows.items():
        positive_where_measured(r)
        assert r["planned_step_s"] > 0 and r["h2d_gbs"] > 0 and r["d2h_gbs"] > 0, name
    assert {(r["mode"], r["grad_clip"], r["gpu_updated_units"] > 0, r["tokens"]) for r in rows.values()} == {
        (m, c, g, t) for m in ("lean", "fast") for c in (0.0, 1.0) for g in (True, False) for t in (256, 192)}
    assert "| lean_clip_1_gpu_1_256 |" in (tmp_path / "quick" / "results.md").read_text()
    assert "lean (no shadow)" in json.loads((tmp_path / "adamw_cpu.json").read_text())["rows"]
    log = (tmp_path / "test_gpu.log").read_text()          # the exactness subset, found by its tests' names
    assert "exactness) exit status: 0" in log and ("22 skipped" in log or "22 passed" in log), log


CFG = model.GPTConfig(vocab_size=64, n_layer=3, n_head=2, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=16)


@pytest.mark.parametrize("mode,resident,gpu_updated,offload", [("fast", 0, 0, False), ("lean", 0, 0, False),
                                                               ("fast", 1, 1, False), ("lean", 1, 1, True)])
def test_link_bytes_per_mode(mode, resident, gpu_updated, offload):
    """bench/gpu.py's link figures from the trainer as built: bf16 weights cross at 2 B/param (fast: the shadow) or
    4 (lean: the fp32 master), a layer twice a step but the last, the head once; a host-updated unit's fp32
    gradient comes back (4 B/param); a GPU-updated one (layer 0 here) moves master, m, v in (12 B/param) and back
    with the shadow (14 fast, 12 lean), no gradient; a resident one (the embedding) nothing, its rows and dy stay
    on the device (its token ids go in). Counted here from the config alone."""
    B, T, d = 4, 16, CFG.d_model
    t = engine(CFG, model.init_weights(CFG, 0), device="cpu", dtype=torch.bfloat16, mode=mode,
               resident_units=resident, gpu_updated_units=gpu_updated, offload_activations=offload)
    n0, n1, n2 = (u.numel for u in model.units(CFG)[1:4])   # layers 0-2 (unit 0: the embedding)
    head = model.units(CFG)[-1].numel
    w = 2 if mode == "fast" else 4                       # the streamed weights' bytes per parameter
    act, ids = B * T * d * 4, B * T * 8                  # fp32 residual: rows, dy, a boundary activation
    h2d = (2 * n0 + 2 * n1 + n2 + head) * w + ids
    d2h = (n1 + n2 + head) * 4
    if gpu_updated:                                      # layer 0: its state both ways, no gradient
        h2d, d2h = h2d + 12 * n0, d2h + (12 + (2 if mode == "fast" else 0)) * n0
    else:
        d2h += 4 * n0
    h2d += ids if resident else act                      # token ids, or the rows gathered on the host
    d2h += 0 if resident else act                        # dy
    if offload:
        h2d, d2h = h2d + 3 * act, d2h + 3 * act
    assert bench_gpu().link_bytes(t, B, T) == (h2d, d2h)
    t.step(*random_batch(CFG, B, T, torch.Generator().manual_seed(0)))   # the trainer as counted runs


def test_time_steps_steady_beside_synced():
    """time_steps: step_s is what train.py sees -- steps issued back to back, one sync around them, the last one's
    deferred work drained inside -- and step_synced_s the per-step-synced median beside it. Here a fake device:
    each step's host part takes 40 ms, then queues 100 ms of device work; a sync waits for the queue. Synced:
    140 ms a step; back to back the host issues under the device: ~100 ms a step, plus 40 / n."""
    g = bench_gpu()
    busy = {"until": 0.0}
    lock = threading.Lock()

    def step(*_):
        time.sleep(0.04)
        with lock:
            busy["until"] = max(busy["until"], time.perf_counter()) + 0.1
        return 1.0

    def sync():
        time.sleep(max(0.0, busy["until"] - time.perf_counter()))
    was = g.sync
    g.sync = sync
    try:
        r = g.time_steps(step, (), warmup=1, steps=2, steady=4)
    finally:
        g.sync = was
    assert r["step_synced_s"] >= 0.14 and len(r["steps_synced_s"]) == 2
    assert 0.1 <= r["step_s"] < 0.85 * r["step_synced_s"], r


@slow
def test_quick_case_keeps_to_its_budget():
    """bench/gpu.py's quick case starts no trainer whose planned cost (its planned steps and what a trainer costs
    besides, QUICK_TRAINER_S) no longer fits its budget: with none left every row is listed with its plan,
    skipped for the budget, and nothing is built."""
    g = bench_gpu()
    q = g.quick_case(g.SMOKE, None, budget_s=0.0)
    assert q["trainers"] == [] and len(q["rows"]) == 16
    assert all(r["skipped"].startswith("the budget") and r["planned_step_s"] > 0 for r in q["rows"].values())


@slow
def test_quick_case_records_a_failed_trainer_and_goes_on(monkeypatch):
    """A trainer that fails (an OOM on the GPU) is its rows' result, "failed: ...", and the quick case goes on."""
    g = bench_gpu()
    built, real = [], g.trainer

    def second_fails(*args, **kw):
        built.append(1)
        if len(built) == 2:
            raise RuntimeError("CUDA out of memory (a test)")
        return real(*args, **kw)
    monkeypatch.setattr(g, "trainer", second_fails)
    q = g.quick_case(g.SMOKE, None, modes=("lean",))        # lean's four trainers: the second fails
    failed = {n for n, r in q["rows"].items() if r.get("skipped")}
    assert failed == {"lean_clip_1_gpu_0_256", "lean_clip_1_gpu_0_192"}, failed
    assert all("step_s" in r for n, r in q["rows"].items() if n not in failed) and len(q["trainers"]) == 4
    assert "CUDA out of memory" in q["rows"]["lean_clip_1_gpu_0_256"]["skipped"] and "failed: " in g.quick_table(q)
