"""megatrain_min.plan against hand arithmetic: parameter counts from formulas written here (and the
published counts of the models the presets copy), host bytes per parameter for every mode, the activation
estimate against what autograd really saves, the acceptance cases (120b lean on an H200 with 1.5 TB fits;
70b in 23 GB refuses in one line), and the throughput model's invariants. CPU only, no model allocated
except the toy-sized ones."""
import dataclasses
import json
import time

import pytest
import torch

import model
from conftest import SPECIAL
from megatrain_min.engine import activations
from megatrain_min import plan as P
from megatrain_min.plan import fit, hardware, memory, report


def hand_params(c):
    """Llama-style count: per layer q, k, v, o (GQA: k and v have n_kv_head heads) + gate, up, down + 2 norms
    (+ Qwen2's q/k/v biases, Qwen3's per-head q/k norms); embedding; untied head; final norm."""
    q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    layer = c.d_model * q + 2 * c.d_model * kv + q * c.d_model + 3 * c.d_model * c.d_ff + 2 * c.d_model
    layer += (q + 2 * kv) * c.qkv_bias + 2 * c.head_dim * c.qk_norm
    return c.n_layer * layer + c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2) + c.d_model


PUBLISHED = {"1b": 1_235_814_400, "7b": 6_738_415_616, "14b": 14_770_033_664,  # Llama-3.2-1B, Llama-2-7B,
             "32b": 32_763_876_352, "70b": 70_553_706_496}                        # Qwen2.5-14B/32B, Llama-3-70B


@pytest.mark.parametrize("name", list(model.PRESETS))
def test_param_counts_match_hand_formula(name):
    cfg = model.PRESETS[name]
    p = P.plan(cfg, "h200", batch_size=8)
    assert p["params"] == model.n_params(cfg) == hand_params(cfg)
    if name in PUBLISHED:
        assert p["params"] == PUBLISHED[name]


@pytest.mark.parametrize("cfg", [model.PRESETS["toy"], SPECIAL], ids=["toy", "gqa-bias-qknorm-tied"])
def test_param_count_equals_init_weights(cfg):
    w = model.init_weights(cfg, seed=0)
    n = sum(t.numel() for t in w.values())
    print(f"init_weights: {n:,} elements, plan: {P.plan(cfg, 'h100', batch_size=8)['params']:,}")
    assert n == P.plan(cfg, "h100", batch_size=8)["params"] == hand_params(cfg)


@pytest.mark.parametrize("mode,dtype,clip,per_param", [
    ("fast", "bf16", True, 18), ("fast", "bf16", False, 14), ("lean", "bf16", True, 16),
    ("lean", "bf16", False, 12), ("fast", "fp32", True, 16), ("lean", "fp32", False, 12)])
def test_host_bytes_per_param_exact(mode, dtype, clip, per_param):
    cfg = model.PRESETS["7b"]
    N = model.n_params(cfg)
    p = P.plan(cfg, "h100", batch_size=8, mode=mode, dtype=dtype, grad_clip=clip, resident_units=0,
               gpu_updated_units=0)   # every unit streamed, updated on the host
    assert p["host_bytes_per_param"] == per_param               # the store: exact, whole bytes
    assert p["host"]["fp32 master"] == p["host"]["AdamW m (fp32)"] == p["host"]["AdamW v (fp32)"] == 4 * N
    assert p["host"].get("bf16 shadow (streamed)", 0) == (2 * N if mode == "fast" and dtype == "bf16" else 0)
    assert p["host"].get("fp32 grad store (global norm first)", 0) == (4 * N if clip else 0)
    assert p["host_bytes"] > per_param * N                      # + staging, runtime: never less
    # page-locked: what the copies read or write (the streamed copy, gradients, buffers), never Adam's m and v
    streamed = 2 * N if mode == "fast" and dtype == "bf16" else 4 * N       # the bf16 shadow, else the master
    slabs = sum(v for k, v in p["host"].items() if k.startswith("fp32 grad slabs"))
    buffers = p["host"]["pinned buffers: embedding rows, dy, targets"]
    assert p["pinned_bytes"] == streamed + (4 * N if clip else 0) + slabs + buffers


def test_the_plan_says_what_clipping_costs_and_when_the_other_mode_is_faster():
    """--plan's last lines, each the plan of the other setting: the step time clipping costs (the updates wait for
    the global norm), and --mode lean where the host's AdamW sets the pace (7B, 3 units resident, on the measured
    H200 with its 134 GB); nothing of the kind where the GPU sets the pace, and nothing on a CPU."""
    cfg = dataclasses.replace(model.PRESETS["7b"], n_layer=8)
    kw = dict(batch_size=4, seq_len=4096, host_mem_gb=134, resident_units=1, gpu_updated_units=0)   # host AdamW
    p = P.plan(cfg, "h200", grad_clip=1.0, **kw)
    free, lean = P.plan(cfg, "h200", grad_clip=0.0, **kw), P.plan(cfg, "h200", grad_clip=1.0, mode="lean", **kw)
    assert p["bottleneck"] == "cpu_adam" and free["step_time_s"] < 0.98 * p["step_time_s"]
    assert lean["step_time_s"] <= 0.95 * p["step_time_s"]
    lines = report.format_plan(p).splitlines()[-2:]
    assert lines == [
        f"clipping costs {p['step_time_s'] - free['step_time_s']:.3g} s/step here: every update waits for the global "
        f"norm (--grad-clip 0: {free['step_time_s']:.3g} s/step)",
        f"faster here: --mode lean, {lean['step_time_s']:.3g} s/step ({p['step_time_s'] / lean['step_time_s'] - 1:.0%}"
        " faster: the host's AdamW moves 6 B/param less; the link carries the fp32 master)"], lines
    resident = P.plan(cfg, "h200", grad_clip=0.0, **dict(kw, resident_units=None))   # every unit on the GPU
    assert resident["bottleneck"] == "compute" and report.alternatives(resident) == []
    assert report.alternatives(P.plan(model.PRESETS["toy"], "local", device="cpu", grad_clip=1.0)) == []


def test_120b_lean_fits_h200_with_1536_gb():
    t0 = time.perf_counter()
    p = P.plan(model.PRESETS["120b"], "h200", mode="lean", host_mem_gb=1536, batch_size=4)
    dt = time.perf_counter() - t0
    print(report.format_plan(p), f"\nplanned in {dt * 1e3:.1f} ms")
    assert p["fits"] and p["fits_host"] and p["fits_gpu"] and not p["offload_activations"]
    assert p["host_bytes_per_param"] == 12 and p["host_bytes"] / p["params"] >= 12
    assert p["host_bytes"] <= 1536e9 and p["mode"] == "lean"
    table = report.format_plan(p)
    assert "fp32 master" in table and "AdamW m" in table and "FITS" in table
    fit.check(p)                                                   # fits: no error
    # 8 x 4096 tokens: the fp32 residual checkpoints (122 GB) leave the GPU for the host, past 1.5 TB; the plan
    # names the nearest setting that fits, and a bf16 residual fits too
    big = P.plan(model.PRESETS["120b"], "h200", mode="lean", host_mem_gb=1536, batch_size=8)
    assert big["offload_activations"] and not big["fits_host"]
    assert "nearest setting that fits: --batch-size 4" in report.format_plan(big)
    assert P.plan(model.PRESETS["120b"], "h200", mode="lean", host_mem_gb=1536, batch_size=8,
                  residual_dtype="bf16")["fits"]
    # with global-norm clipping every fp32 gradient is kept too: 16 B/param, more than 1.5 TB
    clipped = P.plan(model.PRESETS["120b"], "h200", mode="lean", host_mem_gb=1536, batch_size=4, grad_clip=1.0)
    assert not clipped["fits"] and clipped["host_bytes_per_param"] == 16
    with pytest.raises(P.PlanError, match="--grad-clip 0"):
        fit.check(clipped)


def test_70b_in_23_gb_refuses_in_one_line():
    p = P.plan(model.PRESETS["70b"], "local", batch_size=8, host_mem_gb=23)
    assert not p["fits_host"] and not p["fits"]
    with pytest.raises(P.PlanError) as e:
        fit.check(p)
    msg = str(e.value)
    print(msg)
    assert isinstance(e.value, ValueError) and "\n" not in msg
    assert "--config 70b" in msg and "TB of host RAM" in msg and "23 GB" in msg and "Try --config" in msg


def test_check_plans_a_bounded_number_of_settings(monkeypatch):
    """check() searches for the nearest setting that fits by re-planning a bounded list of candidates -- a few dozen
    plans, each arithmetic on the config -- whatever the batch size (its divisors are not all tried). Each model,
    machine and mode once, each with a small batch and one of many divisors."""
    calls = []
    real = P.plan
    monkeypatch.setattr(P, "plan", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for name, hw, mode in (("100b", "h200", "fast"), ("120b", "gh200", "lean")):
        for batch in (8, 2**20 * 3 * 5 * 7):
            calls.clear()
            p = P.plan(model.PRESETS[name], hw, mode=mode, host_mem_gb=1536, grad_clip=True, batch_size=batch)
            try:
                fit.check(p)
            except P.PlanError:
                pass
            assert len(calls) <= 60, (name, hw, mode, batch, len(calls))


def test_gpu_too_small_suggests_a_setting_that_fits():
    p = P.plan(model.PRESETS["32b"], "rtx4090", batch_size=8, host_mem_gb=1536)
    assert p["fits_host"] and not p["fits_gpu"]
    with pytest.raises(P.PlanError, match=r"GPU memory.*Try --(chunk-tokens|micro-batches|batch-size|offload)") as e:
        fit.check(p)
    print(e.value)


def test_gpu_memory_does_not_grow_with_depth():
    # 70b and 100b share the layer; with checkpoints offloaded the GPU holds the same buffers
    a, b = (P.plan(model.PRESETS[n], "h200", batch_size=8, offload_activations=True) for n in ("70b", "100b"))
    assert a["gpu_bytes"] == b["gpu_bytes"]
    assert b["host_bytes"] > a["host_bytes"]


def test_checkpoints_offloaded_only_when_they_do_not_fit():
    """The rule (memory.offload_needed): offload when the boundary activations and one layer's working set
    together exceed the free device memory."""
    assert memory.offload_needed(10, 5, 14) and not memory.offload_needed(10, 4, 14)
    assert not P.plan(model.PRESETS["120b"], "h200", mode="lean", batch_size=4)["offload_activations"]
    p = P.plan(model.PRESETS["120b"], "h100", mode="lean", batch_size=4)
    assert p["offload_activations"] and p["fits_gpu"]
    # an fp32 residual doubles them: at 8 x 4096 tokens 76 layers of checkpoints leave the H200
    assert P.plan(model.PRESETS["120b"], "h200", mode="lean", batch_size=8)["offload_activations"]
    assert not P.plan(model.PRESETS["120b"], "h200", mode="lean", batch_size=8,
                      residual_dtype="bf16")["offload_activations"]


def test_activation_estimate_matches_what_autograd_saves():
    """memory.block_activation_bytes (minus its backward transients) against the bytes of the tensors autograd
    saves when model.block runs with grad on the CPU as the engine runs it: fp32; bf16 autocast on an fp32
    residual (the default); bf16 autocast on a bf16 residual."""
    for cfg in (model.PRESETS["toy"], SPECIAL):
        lay = next(u for u in model.units(cfg) if u.name == "layer.0")
        for dtype, rdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                              (torch.bfloat16, torch.bfloat16)):
            B, T = 2, 32
            cb, rb = dtype.itemsize, rdtype.itemsize
            flat = torch.randn(lay.numel, dtype=dtype) * 0.02
            w = {k: v.detach().requires_grad_() for k, v in lay.views(flat).items()}
            x = torch.randn(B, T, cfg.d_model, dtype=rdtype, requires_grad=True)
            rope = model.rope_cache(cfg, T, dtype=rdtype)
            skip = {t.untyped_storage().data_ptr() for t in (x, flat, *rope)}  # input and weights: not activations
            saved = {}
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), \
                    torch.autograd.graph.saved_tensors_hooks(
                    lambda t: saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t,
                    lambda t: t):
                model.block(cfg, x, w, rope)
            got = sum(v for k, v in saved.items() if k not in skip)
            est = memory.block_activation_bytes(cfg, B * T, cb, rb) - B * T * (2 * cb * cfg.d_ff + 8 * cfg.d_model)
            print(f"{dtype} on a {rdtype} residual: autograd saves {got:,} B, estimate {est:,} B ({est / got - 1:+.1%})")
            assert 0.9 * got <= est <= 1.2 * got


def test_bottleneck_follows_tokens_per_step():
    cfg = model.PRESETS["7b"]
    tiny = dict(batch_size=1, seq_len=128)
    # lean: 8 B/param cross H2D per step (forward + backward) vs 4 B/param of fp32 grads down
    assert P.plan(cfg, "h100", mode="lean", host_bw_gbs=1000, **tiny)["bottleneck"] == "h2d"
    assert P.plan(cfg, "h100", **tiny)["bottleneck"] != "compute"   # PCIe or the CPU AdamW, never the GPU
    # fast: the forward waits on H2D (2 B/param), the backward on D2H (4 B/param of fp32 grads)
    fast = P.plan(cfg, "h100", host_bw_gbs=1000, **tiny)
    assert fast["bottleneck"] == "d2h" and fast["critical_path"]["h2d"] > 0.25
    assert P.plan(cfg, "h100", host_bw_gbs=5, gpu_updated_units=0, **tiny)["bottleneck"] == "cpu_adam"
    # ... unless the plan moves updates onto the link: then the link is what is left
    assert P.plan(cfg, "h100", host_bw_gbs=5, **tiny)["bottleneck"] in ("h2d", "d2h")
    big = P.plan(cfg, "h100", batch_size=64, seq_len=4096, micro_batches=8)
    assert big["bottleneck"] == "compute" and big["utilization"]["compute"] > 0.95
    assert big["tokens_per_step"] > big["min_tokens_per_step"] > 1024
    # with clipping every update waits for the global norm and the next forward for each update
    clipped = P.plan(model.PRESETS["120b"], "h200", mode="lean", batch_size=4, grad_clip=True)
    assert clipped["critical_path"]["cpu_adam"] > 0.3 and clipped["step_time_s"] > \
        P.plan(model.PRESETS["120b"], "h200", mode="lean", batch_size=4)["step_time_s"]


def test_min_tokens_is_design_formula():
    # docs/design.md, section 'The arithmetic': 500 TFLOP/s achieved, bf16 weights, 55 GB/s -> about 9k tokens
    # per step
    hw = dict(hardware.HARDWARE["h100"], name="x", bf16_tflops=500, frac=1.0)
    p = P.plan(model.PRESETS["7b"], hw, batch_size=8)
    assert p["min_tokens"]["h2d"] == pytest.approx(500e12 * 2 / (2 * 55e9))


@pytest.mark.parametrize("hw", list(hardware.HARDWARE))
def test_prediction_within_physical_limits(hw):
    for name in ("1b", "70b", "120b"):
        for mode in ("fast", "lean"):
            p = P.plan(model.PRESETS[name], hw, batch_size=8, mode=mode, micro_batches=4,
                       grad_clip=1.0)
            assert 0 < p["model_tflops"] <= hardware.HARDWARE[hw]["bf16_tflops"] * hardware.HARDWARE[hw]["frac"]
            assert max(p["utilization"].values()) <= 1 + 1e-9
            # the bottleneck is the lane with the most time on the critical path, which spans the whole step
            assert sum(p["critical_path"].values()) == pytest.approx(1.0)
            assert p["critical_path"][p["bottleneck"]] == max(p["critical_path"].values())
            t = p["visit_s"]    # the step can never beat the compute it has to do
            assert p["step_time_s"] >= model.PRESETS[name].n_layer * (t["fwd"] + t["bwd"]) + t["head"]


def test_with_free_transfers_the_step_is_its_compute():
    """Free copies, free AdamW and an instant host (host_speed): nothing is left but the compute."""
    hw = dict(hardware.HARDWARE["h100"], name="x", h2d_gbs=1e9, d2h_gbs=1e9, host_bw_gbs=1e9, hbm_gbs=1e9)
    for clip in (False, True):
        p = P.plan(model.PRESETS["7b"], hw, batch_size=8, grad_clip=clip, host_speed=1e9)
        t = p["visit_s"]
        assert p["step_time_s"] == pytest.approx(32 * (t["fwd"] + t["bwd"]) + t["head"], rel=1e-4)


def test_cpu_run_and_json():
    p = P.plan(model.PRESETS["toy"], "local", batch_size=32, seq_len=128, host_mem_gb=23)
    if p["hardware"]["gpu"] == "cpu":
        assert p["dtype"] == "fp32" and p["fits_gpu"] and p["host"]["device buffers (below)"] == p["gpu_bytes"]
    obj = json.loads(report.plan_json(p))
    for k in ("params", "host_bytes", "gpu_bytes", "fits", "step_time_s", "tokens_per_s", "model_tflops",
              "bottleneck", "mode"):
        assert k in obj
    assert obj["fits"] is True and obj["params"] == 869_504
    with pytest.raises(P.PlanError, match="unknown --hardware"):
        P.plan(model.PRESETS["toy"], "tpu", batch_size=8)


# ----------------------------------------------------------------------------- long context
LONG7B = dataclasses.replace(model.PRESETS["7b"], max_seq_len=524288)


def test_7b_at_512k_tokens_fits_a_gh200_with_480_gb():
    """The paper's claim, planned: Llama-2-7B at 524,288 tokens (batch 1) on one GH200 with its 480 GB of LPDDR5X,
    with train.py's defaults (fast mode, clipping, fp32 residual). Tiled by the planner's choice, the
    checkpoints offloaded through the ring. GPU memory counted by hand: x and dy, the ring and the whole
    sequence's attention are O(T); one tile of the MLP is not."""
    T, d = 524288, 4096
    p = P.plan(LONG7B, "gh200", host_mem_gb=480, seq_len=T, batch_size=1, grad_clip=1.0)
    print(report.format_plan(p))
    assert p["fits"] and p["tile_tokens"] == memory.TILE_TOKENS and p["offload_activations"]
    gpu = p["gpu"]
    assert gpu["residual x and its grad dy"] == 2 * T * d * 4                     # fp32
    assert gpu[f"boundary activations: device ring of {activations.RING}"] == activations.RING * T * d * 4
    # q, k, v, SDPA's output (bf16) + lse (fp32) saved; d(out), dq, dk, dv; the fp32 dq accumulator, row statistic
    assert gpu[f"whole-sequence attention: {T:,} tok"] == T * (2 * 4 * d + 4 * 32 + 2 * d + 2 * 3 * d + 4 * d + 4 * 32)
    assert gpu["token-local activations: tiles of 8,192 tok"] == memory.block_activation_bytes(LONG7B, 8192, 2, 4)
    assert p["host"]["offloaded boundary activations: 32 layers"] == 32 * T * d * 4                # 275 GB
    assert 400e9 < p["host_bytes"] < 430e9                                               # 417 GB: docs/long-context.md
    # untiled it does not fit: the check names the longest context that would, and the tile
    untiled = P.plan(LONG7B, "gh200", host_mem_gb=480, seq_len=T, batch_size=1, grad_clip=1.0, tile_tokens=0)
    assert not untiled["fits_gpu"]
    with pytest.raises(P.PlanError, match=r"longest context that fits at --batch-size 1 is --seq-len \d+\. "
                                          r"Try --tile-tokens 8192") as e:
        fit.check(untiled)
    print(e.value)


def test_max_context_is_the_edge_of_fitting():
    p = P.plan(LONG7B, "gh200", host_mem_gb=480, seq_len=4096, batch_size=1, grad_clip=1.0)
    n, q = fit.max_context(p)
    print(f"7b on gh200 (480 GB): longest context {n:,} tokens, GPU {q['gpu_bytes'] / 1e9:.1f} GB")
    assert n >= 524288 and n % 1024 == 0 and q["fits"] and q["seq_len"] == n
    assert not P.replan(p, seq_len=n + 1024)["fits"]
    assert fit.max_context(P.plan(model.PRESETS["70b"], "gh200", batch_size=1))[0] == 0    # 70b: host too small


def test_tile_is_chosen_only_when_the_untiled_layer_does_not_fit_comfortably():
    """The planner's default tile: 0 at the sizes people train today (what fits untiled stays untiled), tiles where
    the untiled layer's (T, d_ff) activations would crowd the GPU; a tile asked for is kept."""
    assert P.plan(model.PRESETS["7b"], "h100", batch_size=8, seq_len=4096)["tile_tokens"] == 0
    assert P.plan(model.PRESETS["120b"], "h200", mode="lean", batch_size=4, seq_len=4096)["tile_tokens"] == 0
    long = P.plan(LONG7B, "h100", batch_size=1, seq_len=196608)
    assert long["tile_tokens"] == memory.TILE_TOKENS
    assert P.plan(LONG7B, "h100", batch_size=1, seq_len=196608, tile_tokens=0)["gpu_bytes"] > \
        memory.TILE_HEADROOM * 80e9 > long["gpu_bytes"]
    assert P.plan(LONG7B, "h100", batch_size=1, seq_len=196608, tile_tokens=512)["tile_tokens"] == 512


def test_host_lane_names_the_host_where_it_is_the_bottleneck():
    """Issuing ops costs the host hardware.HOST_OP_S each: a small model's step is host-bound, a big one's is not, and
    a faster host (host_speed) moves the bottleneck off it."""
    toy = P.plan(model.PRESETS["toy"], "h100", batch_size=32, seq_len=128)
    assert toy["bottleneck"] == "host" and toy["utilization"]["host"] > 0.9
    fast_host = P.plan(model.PRESETS["toy"], "h100", batch_size=32, seq_len=128, host_speed=100)
    assert fast_host["bottleneck"] != "host" and fast_host["step_time_s"] < toy["step_time_s"] / 5
    big = P.plan(model.PRESETS["7b"], "h100", batch_size=4, seq_len=4096)
    assert big["bottleneck"] == "compute" and big["utilization"]["host"] < 0.1


def test_mfu_only_against_a_known_peak():
    """train.py's mfu: a profiled GPU has a peak, this CPU's numbers are guesses and give none; model_tflops is
    the planner's 6 N per token."""
    assert hardware.peak_tflops(hardware.HARDWARE["h100"], "bf16") == hardware.HARDWARE["h100"]["bf16_tflops"]
    assert hardware.peak_tflops(hardware.local(), "fp32") is None          # the CI machine has no GPU
    cfg = model.PRESETS["toy"]
    assert hardware.model_tflops(cfg, 1000, 2.0) == hardware.flops_per_token(cfg) * 500 / 1e12
    p = P.plan(model.PRESETS["7b"], "h100", batch_size=4, seq_len=4096)
    assert p["mfu"] == pytest.approx(p["model_tflops"] / hardware.HARDWARE["h100"][p["dtype"] + "_tflops"])


def test_120b_clipped_names_grad_clip_0_as_the_way_out():
    """Clipping keeps an fp32 gradient store (+4 B/param) that overflows 1.5 TB; the verdict names
    the nearest setting that fits, --grad-clip 0 (1.46 TB), in the table and in --json's "fix"."""
    p = P.plan(model.PRESETS["120b"], "h200", mode="lean", host_mem_gb=1536, batch_size=4, grad_clip=1.0)
    assert not p["fits_host"] and p["fits_gpu"]
    assert fit.suggest(p) == "--grad-clip 0"
    assert "nearest setting that fits: --grad-clip 0" in report.format_plan(p)
    assert json.loads(report.plan_json(p))["fix"] == "--grad-clip 0"
    assert P.plan(model.PRESETS["120b"], "h200", mode="lean", host_mem_gb=1536, batch_size=4)["fits"]


# ----------------------------------------------------------------------------- N GPUs and K nodes (sharded.py)
def test_sharded_plan_divides_the_store_by_nodes_and_pcie_by_gpus():
    """--gpus N --nodes K: each node holds 1/K of the per-parameter store (up to the padding of each unit to a
    multiple of N ranks); each GPU's PCIe carries 1/(N K) of every unit; the collectives move (R-1)/R of the unit
    over NVLink within a node and over InfiniBand (per GPU) across nodes; per-GPU compute is that of its share."""
    cfg, kw = model.PRESETS["70b"], dict(seq_len=4096, grad_clip=0.0, mode="fast", host_mem_gb=2000, tile_tokens=0,
                                         offload_activations=True, resident_units=0)
    one = P.plan(cfg, "h100", batch_size=4, **kw)
    node = P.plan(cfg, "h100", batch_size=32, gpus=8, **kw)
    two = P.plan(cfg, "h100", batch_size=64, gpus=8, nodes=2, **kw)
    store = lambda p: sum(v for k, v in p["host"].items() if k.startswith(("fp32 master", "Adam", "bf16")))  # noqa
    assert store(one) <= store(node) <= store(one) + 8 * len(model.units(cfg)) * 14        # padding only
    assert abs(store(two) - store(node) / 2) <= 16 * len(model.units(cfg)) * 14
    lay = model.units(cfg)[1].numel                                                       # layer.0
    for p, ranks, bw in ((node, 8, 360), (two, 16, 45)):
        assert p["world"] == ranks and p["tokens_per_step"] == ranks * 4 * 4096
        assert p["visit_s"]["load"] == pytest.approx(one["visit_s"]["load"] / ranks)
        assert p["visit_s"]["grad"] == pytest.approx(one["visit_s"]["grad"] / ranks)
        assert p["visit_s"]["all_gather"] == pytest.approx(lay * (ranks - 1) / ranks * 2 / (bw * hardware.GB))
        assert p["visit_s"]["reduce_scatter"] == pytest.approx(lay * (ranks - 1) / ranks * 4 / (bw * hardware.GB))
        assert p["visit_s"]["fwd"] == pytest.approx(one["visit_s"]["fwd"])                # 4 sequences per GPU
        key = next(k for k in one["gpu"] if k.startswith("recompute"))
        assert p["gpu"][key] == one["gpu"][key]
        assert "embedding rows and dy of the whole step" in p["gpu"] and p["gpu_bytes"] > one["gpu_bytes"]
        # compute-bound here: R GPUs nearly R times one's tokens/s, never more
        speedup = p["tokens_per_s"] / one["tokens_per_s"]
        print(f"{ranks} GPUs: {speedup:.2f}x one GPU's tokens/s; comm lane busy {p['utilization']['comm']:.0%}")
        assert 0.9 * ranks <= speedup <= ranks * 1.001
        assert p["bottleneck"] == "compute"


def test_sharded_plan_with_a_slow_interconnect_is_bound_by_it():
    """The collectives are in the schedule: over 1 GB/s between nodes, the comm lane is the bottleneck."""
    hw = dict(hardware.HARDWARE["h100"], name="slow", ib_gbs=1)
    p = P.plan(model.PRESETS["7b"], hw, batch_size=16, seq_len=4096, grad_clip=0.0, gpus=8, nodes=2)
    fast = P.plan(model.PRESETS["7b"], "h100", batch_size=16, seq_len=4096, grad_clip=0.0, gpus=8, nodes=2)
    assert p["bottleneck"] == "comm" and p["step_time_s"] > 5 * fast["step_time_s"]
    assert "InfiniBand at 1 GB/s" in report.format_plan(p) and "host memory per node" in report.format_plan(p)


def test_sharded_plan_refuses_a_batch_the_gpus_cannot_split():
    with pytest.raises(P.PlanError, match="not divisible by 16 ranks x micro_batches 2"):
        P.plan(model.PRESETS["7b"], "h100", batch_size=16, micro_batches=2, gpus=8, nodes=2)
    with pytest.raises(P.PlanError, match="integers >= 1"):
        P.plan(model.PRESETS["7b"], "h100", batch_size=8, gpus=0)


def test_local_hardware_asks_only_the_run_s_device(monkeypatch):
    """The plan of a run on cuda:2 reads cuda:2's name and free memory, and touches no other GPU (each rank of a
    torchrun would else make a CUDA context on GPU 0); a run on the CPU plans for the CPU even with a GPU."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: asked.append(("name", str(d))) or "NVIDIA H100 80GB")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: asked.append(("free", str(d))) or (70e9, 80e9))
    hw = hardware.local(torch.device("cuda", 2))
    assert asked == [("name", "cuda:2"), ("free", "cuda:2")] and hw["gpu_mem_gb"] == 70 and hw["profiled"]
    asked.clear()
    assert hardware.local("cpu")["gpu"] == "cpu" and asked == []


def test_resident_units_fill_the_gpu_memory_the_step_leaves():
    """By default the plan keeps whole units on the GPU (16 B/param: master, m, v, gradient), in the order the
    forward needs them, as many as fit in RESIDENT_HEADROOM of its memory beside the step's working set; they
    leave the host store and the pinned memory, their updates leave the host, and the step gets no slower. Asked
    for: exactly that many. Sharded runs (one whole unit per process is not there to keep) and CPU runs: none."""
    cfg, units = model.PRESETS["14b"], model.units(model.PRESETS["14b"])
    kw = dict(batch_size=4, seq_len=4096, grad_clip=0.0, skip_nonfinite=False)
    none, auto, three = (P.plan(cfg, "h200", resident_units=k, **kw) for k in (0, None, 3))
    k, order = auto["resident_units"], list(range(len(units)))       # untied: embedding, layers, head
    resident = 16 * sum(units[u].numel for u in order[:k])
    assert 0 < k < len(units) and auto["resident_asked"] is None and three["resident_units"] == 3
    assert auto["gpu"][f"resident units: {k} of {len(units)}, 16 B/param"] == resident
    room = memory.RESIDENT_HEADROOM * auto["gpu_limit_bytes"] - (auto["gpu_bytes"] - resident)
    assert resident <= room < resident + 16 * units[order[k]].numel    # the next unit would not fit
    per_param_host = lambda p: sum(v for key, v in p["host"].items() if key.startswith(("fp32 master", "Adam", "bf16")))
    assert per_param_host(none) - per_param_host(auto) == 14 * sum(units[u].numel for u in order[:k])  # 4+4+4+2
    assert auto["pinned_bytes"] < none["pinned_bytes"] and auto["step_time_s"] <= none["step_time_s"]
    assert three["step_time_s"] <= none["step_time_s"] and auto["step_time_s"] <= three["step_time_s"]
    assert P.plan(cfg, "h200", gpus=2, **dict(kw, batch_size=8))["resident_units"] == 0
    with pytest.raises(P.PlanError, match="--resident-units 3: units kept resident need one process"):
        P.plan(cfg, "h200", gpus=2, resident_units=3, **dict(kw, batch_size=8))     # every sharded run refuses it
    assert P.plan(model.PRESETS["toy"], "local", device="cpu", batch_size=4, seq_len=64)["resident_units"] == 0
    wide = dataclasses.replace(model.PRESETS["7b"], n_layer=24)        # 5.1B fits whole: resident training
    small = P.plan(wide, "h200", **kw)
    assert small["resident_units"] == len(model.units(wide)) and small["bottleneck"] == "compute"
    assert "fp32 grad slabs" not in " ".join(small["host"])            # nothing left to stream, no slabs


def test_slabs_kept_for_the_optimizer_threads_backlog():
    """Where the host's AdamW is slower than the backward (24 layers of 7B width streamed on the measured H200
    profile, 16k tokens), the optimizer thread falls behind and, running the landed unit the next forward needs first,
    holds a slab per unit of its backlog: the plan keeps more slabs than hide one gradient's trip -- each within 1% of
    the step with a slab per streamed unit -- and says why. First come, first served (timing.NEED_FIRST = False), more
    slabs would save nothing: the plan keeps the fewest. Asked for (grad_slabs=3): exactly those, no note."""
    cfg = model.GPTConfig(n_layer=24, vocab_size=32000, n_head=32, n_kv_head=32, d_model=4096, d_ff=11008,
                          max_seq_len=4096)
    hw = dict(hardware.HARDWARE["h200"], host_mem_gb=134, name="h200 (measured)")
    kw = dict(batch_size=4, seq_len=4096, micro_batches=4, dtype="bf16", grad_clip=0.0, skip_nonfinite=False,
              resident_units=2, offload_activations=False, gpu_updated_units=0)   # every streamed unit: host AdamW
    p = P.plan(cfg, hw, **kw)
    unlimited = P.plan(cfg, hw, **kw, grad_slabs=24)
    asked = P.plan(cfg, hw, **kw, grad_slabs=3)
    assert 3 == p["grad_slabs_fewest"] < p["grad_slabs"] < 24
    assert p["step_time_s"] <= 1.01 * unlimited["step_time_s"] < 0.9 * asked["step_time_s"]
    assert f"{p['grad_slabs'] - 3} more hold the optimizer thread's backlog" in report.format_plan(p)
    assert asked["grad_slabs"] == 3 and "backlog" not in report.format_plan(asked)
    assert f"fp32 grad slabs: {p['grad_slabs']}" in p["host"]
    P.timing.NEED_FIRST = False
    try:
        fifo = P.plan(cfg, hw, **kw)
    finally:
        P.timing.NEED_FIRST = True
    assert fifo["grad_slabs"] == fifo["grad_slabs_fewest"] == 3 and "backlog" not in report.format_plan(fifo)


def test_gpu_updated_units_picked_where_they_shorten_the_step():
    """With clipping every update follows the backward, and on the measured H200 the host's AdamW (22 streamed
    layers of 7B width, 28-32 B/param at 101 GB/s) is most of the step. Updating about half of them on the GPU
    (gpu_update.GpuUpdates: 12 B/param each way over PCIe, the host updating the rest meanwhile) brings the step
    under issue 33's 2.2 s. The plan picks the count (the fewest within 1% of the fastest step), prints it and its
    copies, counts the GPU's bytes (4 B/param of gradient, two scratches), the host's (no gradient store for
    them; their m and v page-locked) and keeps the asked count. None with more than one rank, none on a CPU."""
    from megatrain_min.engine import gpu_update
    cfg = model.GPTConfig(n_layer=24, vocab_size=32000, n_head=32, n_kv_head=32, d_model=4096, d_ff=11008,
                          max_seq_len=4096)
    units = model.units(cfg)
    hw = dict(hardware.HARDWARE["h200"], host_mem_gb=134, name="h200 (measured)")
    kw = dict(batch_size=4, seq_len=4096, micro_batches=4, dtype="bf16", grad_clip=1.0, skip_nonfinite=False,
              resident_units=2, offload_activations=False)
    for mode in ("lean", "fast"):
        p, host = P.plan(cfg, hw, mode=mode, **kw), P.plan(cfg, hw, mode=mode, gpu_updated_units=0, **kw)
        g = p["gpu_updated_units"]
        print(f"{mode}: {g} of 24 streamed updated on the GPU: {p['step_time_s']:.3f} s; all on the host "
              f"{host['step_time_s']:.3f} s")
        assert 6 <= g <= 18 and p["gpu_updated_asked"] is None and p["step_time_s"] < 0.8 * host["step_time_s"]
        chosen = gpu_update.chosen(list(range(len(units))), 2, 0, g)
        n = sum(units[u].numel for u in chosen)
        assert chosen[:2] == [2, 4] and 0 not in chosen                        # every other, from layer 1
        assert p["gpu"][f"GPU-updated units: {g}, fp32 grads 4 B/param"] == 4 * n
        shadow = mode == "fast"
        assert p["gpu"]["GPU update scratch: 2 x master, state" + (", shadow" if shadow else "")] == \
            2 * units[chosen[0]].numel * (12 + 2 * shadow)
        grads = "fp32 grad store (global norm first)"
        assert host["host"][grads] - p["host"][grads] == 4 * n
        assert p["pinned_bytes"] - host["pinned_bytes"] == (8 + 4 * shadow) * n - 4 * n   # m, v (+ master) cross
        assert f"of the 24 streamed, {g} updated on the GPU (the plan's pick" in report.format_plan(p)
        assert "GPU-updated unit: master, state H2D" in report.format_plan(p)
    assert p["step_time_s"] > 2.2 >= P.plan(cfg, hw, mode="lean", **kw)["step_time_s"]   # lean meets it, fast not
    asked = P.plan(cfg, hw, mode="lean", gpu_updated_units=3, **kw)
    assert (asked["gpu_updated_units"], asked["gpu_updated_asked"]) == (3, 3)
    assert "(as asked;" in report.format_plan(asked)
    assert P.plan(cfg, hw, mode="lean", **dict(kw, batch_size=8, resident_units=0), gpus=2)["gpu_updated_units"] == 0
    with pytest.raises(P.PlanError, match="one process holding whole units"):
        P.plan(cfg, hw, mode="lean", gpu_updated_units=2, **dict(kw, batch_size=8), gpus=2)
    with pytest.raises(P.PlanError, match="gpu_updated_units must be an integer >= 0"):
        P.plan(cfg, hw, mode="lean", gpu_updated_units=-1, **kw)
    assert P.plan(model.PRESETS["toy"], "local", device="cpu", batch_size=4, seq_len=64)["gpu_updated_units"] == 0


def test_plan_weighs_gpu_updates_against_resident_units():
    """A resident unit takes its AdamW off the host for 16 B/param of GPU memory, a GPU-updated one for 4 (and
    the link's time): where the host sets the pace, the plan tries the updates first and residents in what is
    left, and keeps that where the step is at least 1% shorter than filling the GPU with residents first (32b
    on an H200, clipped, fast). Where residents alone leave nothing on the host's critical path (14b, no
    clipping) it keeps them. Asked for residents, the plan only adds GPU updates beside them."""
    kw = dict(batch_size=4, seq_len=4096, mode="fast")
    big = model.PRESETS["32b"]
    p = P.plan(big, "h200", grad_clip=1.0, **kw)
    residents_first = P.plan(big, "h200", grad_clip=1.0, gpu_updated_units=0, **kw)
    print(f"32b clip 1: {p['resident_units']} resident + {p['gpu_updated_units']} GPU-updated {p['step_time_s']:.2f} s;"
          f" {residents_first['resident_units']} resident alone {residents_first['step_time_s']:.2f} s")
    assert p["resident_units"] < residents_first["resident_units"] and p["gpu_updated_units"] > 0
    assert p["step_time_s"] < 0.9 * residents_first["step_time_s"] and p["fits"]
    assert "as many as fit beside the step and the GPU updates" in report.format_plan(p)
    small = P.plan(model.PRESETS["14b"], "h200", grad_clip=0.0, **kw)
    assert small["gpu_updated_units"] == 0 and small["resident_units"] == P.plan(
        model.PRESETS["14b"], "h200", grad_clip=0.0, gpu_updated_units=0, **kw)["resident_units"]
    asked = P.plan(big, "h200", grad_clip=1.0, resident_units=3, **kw)
    assert asked["resident_units"] == 3 and asked["gpu_updated_units"] > 0


def test_auto_mode_is_the_plans_pick():
    """--mode auto (train.py's default): fast, unless lean is at least 2% faster (the host's AdamW sets the pace:
    24 layers of 7B width with 2 units resident on the measured H200) or is the one that fits (120b on an H200 with
    1.5 TB); with every unit resident lean gains nothing; fp32 compute has one mode. The plan says which and why, and
    the engine is built with the mode picked."""
    from megatrain_min import cli, engine
    assert cli.DEFAULTS["mode"] == "auto"
    cfg = model.GPTConfig(n_layer=24, vocab_size=32000, n_head=32, n_kv_head=32, d_model=4096, d_ff=11008,
                          max_seq_len=4096)
    hw = dict(hardware.HARDWARE["h200"], host_mem_gb=134, name="h200 (measured)")
    kw = dict(batch_size=4, seq_len=4096, micro_batches=4, dtype="bf16", grad_clip=0.0, skip_nonfinite=False,
              gpu_updated_units=0)                                            # every streamed unit: host AdamW
    p = P.plan(cfg, hw, mode="auto", resident_units=2, **kw)
    fast, lean = (P.plan(cfg, hw, mode=m, resident_units=2, **kw) for m in ("fast", "lean"))
    assert lean["step_time_s"] <= P.LEAN_FASTER * fast["step_time_s"]
    assert (p["mode"], p["mode_asked"], p["step_time_s"]) == ("lean", "auto", lean["step_time_s"])
    assert p["mode_why"] == f"{fast['step_time_s'] / lean['step_time_s'] - 1:.0%} faster than fast here"
    assert "--mode lean (auto: " in report.format_plan(p) and engine.arguments(p)["mode"] == "lean"
    assert P.replan(p, batch_size=8)["mode_asked"] == "auto"                      # a replan picks again
    every = P.plan(cfg, hw, mode="auto", resident_units=26, **kw)
    assert (every["mode"], every["mode_why"]) == ("fast", "lean is not 2% faster here")
    big = P.plan(model.PRESETS["120b"], "h200", mode="auto", batch_size=4, seq_len=4096, grad_clip=0.0,
                 host_mem_gb=1536, resident_units=0)
    assert not P.plan(model.PRESETS["120b"], "h200", mode="fast", batch_size=4, seq_len=4096, grad_clip=0.0,
                      host_mem_gb=1536, resident_units=0)["fits"]
    assert (big["mode"], big["mode_why"], big["fits"]) == ("lean", "only lean fits", True)
    toy = P.plan(model.PRESETS["toy"], "local", mode="auto", dtype="fp32")
    assert (toy["mode"], toy["mode_why"]) == ("fast", None) and "(auto" not in report.format_plan(toy)
    ranks = P.plan(cfg, hw, mode="auto", resident_units=0, gpus=2, **dict(kw, batch_size=8))   # apart: fast
    assert (ranks["mode"], ranks["mode_why"]) == ("fast", "more than one rank: every rank streams alike")
    short = P.plan(model.PRESETS["120b"], "h200", mode="auto", batch_size=4, seq_len=4096, grad_clip=0.0,
                   host_mem_gb=1024, resident_units=0)                   # neither fits: fast, and why
    assert (short["mode"], short["mode_why"], short["fits"]) == ("fast", "lean does not fit", False)
