"""Smoke tests: each benchmark runs with `--tiny` and reports numbers.

Timings are never asserted (shared, noisy machines); only that the scripts
run end to end and return finite measurements.
"""

import importlib.util
import math
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name):
  spec = importlib.util.spec_from_file_location(
      f"_bench_{name}", BENCH / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_overhead_tiny(capsys):
  results = _load("overhead").main(["--tiny", "--chained", "2"])
  out = capsys.readouterr().out
  assert "device:" in out and "jax" in out
  variants = {r["variant"] for r in results}
  assert {"plain", "ours", "usual_where", "apply_if_finite", "jmp",
          "flax"} <= variants
  for r in results:
    assert r["median_s"] > 0 and math.isfinite(r["ratio"])
    assert math.isfinite(r["compile_ratio"])
    assert math.isfinite(r["chained_ratio"])
    assert r["copies"] >= 0 and r["temp_bytes"] >= 0
  plain = next(r for r in results if r["variant"] == "plain")
  assert plain["ratio"] == pytest.approx(1.0)


def test_train_step_tiny(capsys):
  results = _load("train_step").main(["--tiny", "--chained", "2"])
  out = capsys.readouterr().out
  assert "overhead" in out
  assert set(results) == {"mlp", "transformer"}
  for r in results.values():
    assert r["plain_s"] > 0 and r["scaled_s"] > 0
    assert math.isfinite(r["overhead"]) and r["params"] > 0
    assert math.isfinite(r["chained_overhead"])
    assert r["compile_ratio"] > 0


def test_device_time_tiny(capsys):
  results = _load("device_time").main(["--tiny"])
  out = capsys.readouterr().out
  assert "device us" in out
  assert {"train step mlp", "train step transformer"} <= set(results)
  for res in results.values():
    assert set(res) >= {"plain"} and len(res) >= 2
    for seconds, kernels in res.values():
      assert seconds > 0 and kernels > 0
