"""The GPU benchmark harness (bench/gpu.py) end to end in --smoke mode: tiny shapes, every case that can
run on this machine (CUDA-only ones record "skipped: no CUDA"), and the three output files with their fields.
This checks the harness, not the speed: the numbers only have to exist and be positive."""
import json

import pytest

from conftest import train_py

pytestmark = pytest.mark.slow   # the whole module: `python -m pytest -m "not slow"` leaves it out

SUMMARY_KEYS = {"device", "overlap", "vs_resident", "vs_fsdp2_offload", "model_tflops_7b_wide", "gpu_mem_depth_spread"}


def positive_where_measured(r):
    for k in ("step_s", "tokens_per_s", "model_tflops", "hw_tflops", "compute_only_s", "overlap", "rss_gb"):
        assert r[k] > 0, (k, r)
    assert all(t > 0 for t in r["steps_s"])


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


def test_multi_gpu_bench_smoke(multi_gpu_smoke):
    """bench/multi_gpu.py --smoke: the harness of gpu_run.sh's multi-GPU case, on the CPU with 2 gloo ranks. Its
    exact case: the losses of torchrun and of one process agree to 1e-5."""
    res = json.loads((multi_gpu_smoke / "multi_gpu.json").read_text())
    exact, scaling = res["cases"]["exact"], res["cases"]["scaling"]
    assert len(exact["losses_1"]) == len(exact["losses_n"]) == 8 and exact["worst_loss_rel"] <= 1e-5
    assert scaling["tokens_per_s_1"] > 0 and scaling["tokens_per_s_n"] > 0 and res["meta"]["world"] == 2
