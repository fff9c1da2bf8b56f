"""Every script in examples/ runs at `--tiny` and trains in float16 with the
loss scale reported (each well under a minute on a laptop CPU): a float32
model under `ols.autocast`, whose training step's matrix products, forward
and backward, are all float16, with float32 master weights."""

import functools
import importlib
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

# The converted Flax tutorial is written against the current flax, whose
# `nnx.view` flax 0.12.0 (the newest that installs with jax 0.7) lacks.
_needs_nnx_view = pytest.mark.skipif(
  not hasattr(importlib.import_module("flax.nnx"), "view"),
  reason="the converted tutorial uses nnx.view, which this flax lacks",
)


@functools.cache
def _run(script: pathlib.Path) -> tuple[str, dict]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
  )
  proc = subprocess.run(
    [sys.executable, str(script), "--tiny"],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    check=False,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[-1].startswith("RESULT "), proc.stdout
  return proc.stdout, json.loads(lines[-1].removeprefix("RESULT "))


def test_the_five_examples_are_there():
  names = [p.name for p in EXAMPLES]
  assert any(n.startswith("nnx_") and "mnist" not in n for n in names)
  assert any(n.startswith("linen_trainstate_") for n in names)
  assert any(n.startswith("equinox_") for n in names)
  assert "nnx_mnist_tutorial_fp16.py" in names
  assert "nnx_gpt_fp16.py" in names


# The examples whose runs take longer than a few seconds (a sharded GPT,
# the digits tutorial, a TrainState and an Equinox run); nnx_mlp_fp16 stays
# in the fast subset, which so runs one example end to end.
SLOW_EXAMPLES = (
  "nnx_gpt_fp16",
  "nnx_mnist_tutorial_fp16",
  "linen_trainstate_fp16",
  "equinox_mlp_fp16",
)


def _marks(script):
  marks = [_needs_nnx_view] if "tutorial" in script.stem else []
  if script.stem in SLOW_EXAMPLES:
    marks.append(pytest.mark.slow)
  return marks


@pytest.mark.parametrize(
  "script",
  [pytest.param(p, marks=_marks(p)) for p in EXAMPLES],
  ids=lambda p: p.stem,
)
def test_example_trains_in_float16(script):
  stdout, result = _run(script)
  first = result.get("first_loss", result.get("first_train_loss"))
  last = result.get("last_loss", result.get("last_train_loss"))
  assert last < first / 2, stdout
  scale = result["loss_scale"]
  assert scale >= 1 and scale == 2.0 ** round(math.log2(scale))
  assert result["skipped"] >= 0
  assert "scale" in stdout.splitlines()[0]  # logged while training
  assert result["master_dtype"] == "float32"
  # Counted in the step's program: every product in float16, none other.
  products = result["products"]
  assert list(products) == ["float16"] and products["float16"] > 0, stdout


@pytest.mark.slow
@_needs_nnx_view
def test_converted_tutorial_learns_the_digits():
  _, result = _run(ROOT / "examples" / "nnx_mnist_tutorial_fp16.py")
  assert result["test_accuracy"] > 0.8  # chance is 0.1
  # Two convolutions and two dense layers forward; backward, the gradients
  # of their weights and of their inputs (but the image's).
  assert result["products"] == {"float16": 4 + 4 + 3}


def test_nnx_example_sets_the_scale_on_the_split_state():
  _, result = _run(ROOT / "examples" / "nnx_mlp_fp16.py")
  assert result["loss_scale"] == 1024.0


@pytest.mark.slow
def test_gpt_example_trains_sharded_and_tracks_float32():
  stdout, result = _run(ROOT / "examples" / "nnx_gpt_fp16.py")
  # The MLP's first kernel is split by columns over the mesh's "model" axis.
  assert result["kernel_spec"] == ["None", "model"]
  # Same initialization and batches: float16 with loss scaling ends within
  # a few percent of float32 (they differ by rounding and skipped steps).
  f32 = result["float32_last_loss"]
  assert abs(result["last_loss"] - f32) < 0.05 * f32, stdout
  assert result["first_loss"] == pytest.approx(
    result["float32_first_loss"], rel=0.01
  )
  # What the scale did is reported; with hysteresis 1 every skipped step
  # is one backoff (the scale stays far above its minimum here).
  assert result["backoffs"] == result["skipped"]
  assert result["growths"] >= 1  # grows every 50 finite steps
  # nnx.Optimizer.step counts every call, skipped or not.
  assert result["optimizer_step"] == result["steps"]
  assert "backoffs" in stdout and "growths" in stdout
