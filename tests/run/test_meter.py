"""run/meter.py: the numbers of each step's record, as train.py logs them."""
import collections
import types

import pytest

import model
from megatrain_min.plan import hardware
from megatrain_min.run import meter
from megatrain_min.run.meter import Meter


def clock(monkeypatch, *times):
    """meter.py's clock (its module's `time`, no other caller's) reads `times`, one per call."""
    ticks = iter(times)
    monkeypatch.setattr(meter, "time", types.SimpleNamespace(time=lambda: next(ticks)))


def test_a_step_on_a_profiled_gpu_has_its_mfu_against_every_ranks_peak_and_the_bytes_it_moved(monkeypatch):
    cfg = model.PRESETS["toy"]
    trainer = types.SimpleNamespace(traffic=collections.Counter(h2d=10, gather=3))
    clock(monkeypatch, 100.0, 101.0, 103.0)                       # made, start(), record(): a 2 s step
    H100 = hardware.HARDWARE["h100"]
    m = Meter(cfg, {"hardware": H100, "dtype": "bf16"}, 4096, trainer, world=2)
    m.start()
    trainer.traffic.update(h2d=5, gather=7)                       # what the step moved
    rec = m.record(3, 2.5, 1e-4)
    peak = hardware.peak_tflops(H100, "bf16")
    assert rec["tokens_per_s"] == 2048 and rec["model_tflops"] == hardware.model_tflops(cfg, 4096, 2.0)
    assert rec["mfu"] == pytest.approx(rec["model_tflops"] / (2 * peak))
    assert rec["traffic"] == {"h2d": 5, "gather": 7} and (rec["step"], rec["loss"], rec["lr"]) == (3, 2.5, 1e-4)
    assert m.postfix(rec) == {"loss": "2.500", "tok_s": "2,048", "tflops": f"{rec['model_tflops']:.1f}",
                              "mfu": f"{rec['mfu']:.0%}"}
    assert m.started == 100.0


def test_a_step_without_a_known_peak_or_ranks_has_no_mfu_nor_traffic(monkeypatch):
    clock(monkeypatch, 0.0, 0.0, 0.5)
    guessed = dict(hardware.HARDWARE["h100"], profiled=False)     # a CPU, an unprofiled GPU
    m = Meter(model.PRESETS["toy"], {"hardware": guessed, "dtype": "fp32"}, 1000, types.SimpleNamespace(), 1)
    m.start()
    rec = m.record(1, 3.0, 3e-4)
    assert "mfu" not in rec and "traffic" not in rec and rec["tokens_per_s"] == 2000
    assert m.postfix(rec) == {"loss": "3.000", "tok_s": "2,000"}
