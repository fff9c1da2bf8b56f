"""Interruption: SIGKILL a real training process after a checkpoint, resume
from the latest orbax checkpoint, and get the uninterrupted result bit for bit.

Each case runs three processes: the uninterrupted reference and the run to
be killed (started together), then the resumed run.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _helpers import assert_trees_equal

WORKER = os.path.join(os.path.dirname(__file__), "_resume_worker.py")
STEPS, EVERY = 24, 4
TIMEOUT_S = 240


def _env():
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = os.pathsep.join(
    [os.path.dirname(os.path.dirname(WORKER)), env.get("PYTHONPATH", "")]
  )
  return env


def _start(ckpt, out, *extra):
  return subprocess.Popen(
    [
      sys.executable,
      WORKER,
      str(ckpt),
      str(out),
      "--steps",
      str(STEPS),
      "--every",
      str(EVERY),
      *map(str, extra),
    ],
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _finish(proc):
  try:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
    pytest.fail(f"worker timed out:\n{out[-3000:]}")
  assert proc.returncode == 0, out[-3000:]
  return out


def _load(path):
  with np.load(path) as data:
    return {k: data[k] for k in data.files}


@pytest.mark.slow  # a process killed and resumed: about 8 s a case
@pytest.mark.parametrize(
  "kill_after, nan_range",
  [
    pytest.param(8, (-1, -1), id="clean-run"),
    # The NaN streak (steps 10..15) spans the checkpoint at step 12 and
    # the kill that follows it: the checkpoint holds a streak in
    # progress (hysteresis=2, skip counters mid-count).
    pytest.param(12, (10, 16), id="kill-during-overflow-streak"),
  ],
)
def test_sigkill_then_resume_equals_uninterrupted(
  tmp_path, kill_after, nan_range
):
  nan = ["--nan-from", nan_range[0], "--nan-to", nan_range[1]]
  marker = tmp_path / "marker"
  reference = _start(tmp_path / "ref_ckpt", tmp_path / "ref.npz", *nan)
  victim = _start(
    tmp_path / "ckpt",
    tmp_path / "victim.npz",
    *nan,
    "--marker",
    marker,
    "--marker-step",
    kill_after,
    "--slow",
    2.0,
  )
  deadline = time.monotonic() + TIMEOUT_S
  while not marker.exists():
    if victim.poll() is not None or time.monotonic() > deadline:
      victim.kill()
      out, _ = victim.communicate()
      pytest.fail(f"no marker from the worker:\n{out[-3000:]}")
    time.sleep(0.05)
  # The worker sleeps 2 s after each step from here on: the kill lands
  # mid-run, after the checkpoint of `kill_after`, before the next one.
  time.sleep(0.3)
  victim.send_signal(signal.SIGKILL)
  victim.communicate(timeout=60)
  assert victim.returncode == -signal.SIGKILL
  assert not (tmp_path / "victim.npz").exists()
  checkpoints = sorted(
    int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()
  )
  assert checkpoints and checkpoints[-1] == kill_after, checkpoints

  resumed = _start(tmp_path / "ckpt", tmp_path / "resumed.npz", *nan)
  out = _finish(resumed)
  assert f"resumed from step {kill_after}" in out
  _finish(reference)

  ref, res = _load(tmp_path / "ref.npz"), _load(tmp_path / "resumed.npz")
  assert_trees_equal(ref, res)
  assert int(res["['step']"]) == STEPS
  lss = "['opt_state'].loss_scale_state"
  if nan_range[0] >= 0:
    # Six NaN steps in all were skipped, across the kill.
    assert int(res[f"{lss}.total_skipped"]) == nan_range[1] - nan_range[0]
    assert int(res["['opt_state'].inner_state[0].count"]) == (
      STEPS - (nan_range[1] - nan_range[0])
    )
  for key, value in res.items():
    if np.issubdtype(value.dtype, np.floating):
      assert np.all(np.isfinite(value)), key
