"""The figures: the main job's (gap to float32, the scale), the sweep's six
panels, and the panels the notebook draws one by one. Matplotlib is
imported by the functions that make a figure, so that the rest of the
study runs without it."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .results import BadBatchResult, RunResult, StudyResult, SweepResult
from .runs import Scaling

Window = tuple[float, float] | None


def _pyplot() -> Any:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def _steps(curve: np.ndarray) -> np.ndarray:
  return np.arange(1, len(curve) + 1)


def save_figure(result: StudyResult, path: str | os.PathLike) -> None:
  """The main job's figure: gap to float32 per step, and the scale."""
  plt = _pyplot()
  fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
  ref = result.runs["fp32"].loss
  for name, r in result.runs.items():
    # Same seed, same batches: the per-step difference to fp32 is the
    # effect of float16 alone.
    a.plot(_steps(ref), r.loss - ref, label=name, lw=1.2)
  a.axhline(0, color="k", lw=0.5)
  a.set(
    xlabel="step",
    ylabel="train loss - fp32 train loss",
    title=f"char-LM, mean over {result.config.batch} tokens",
  )
  a.legend(fontsize=8)
  plot_scales(b, {k: r for k, r in result.runs.items() if r.spec.scaled})
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def _shade(ax: Any, window: Window, axis: str = "x") -> None:
  """The usable window as a green band along ``axis`` (log2 scale)."""
  if window is not None:
    lo, hi = np.log2(window[0]), np.log2(window[1])
    span = ax.axvspan if axis == "x" else ax.axhspan
    span(lo, hi, color="green", alpha=0.12, label="usable window")


def plot_window(ax: Any, result: SweepResult) -> None:
  """Held-out loss against float32 per static scale, the window shaded, the
  dynamic runs marked at their final scale."""
  ref = result.runs["fp32"].eval_loss
  static = result.by_scaling(Scaling.STATIC).values()
  x = [np.log2(r.initial_scale) for r in static]
  y = [r.eval_loss - ref for r in static]
  ax.plot(x, y, "o-", color="k", ms=4, label="static scale")
  ax.axhline(
    result.runs["fp16"].eval_loss - ref,
    color="C1",
    ls="--",
    label="fp16, no scaling",
  )
  ax.axhline(0, color="k", lw=0.5)
  _shade(ax, result.window)
  for i, (k, r) in enumerate(dynamic_runs(result).items()):
    ax.plot(
      np.log2(r.final_scale),
      r.eval_loss - ref,
      "*",
      ms=11,
      color=f"C{i + 2}",
      label=f"{k} (final scale)",
    )
  ax.set(
    xlabel="log2 loss scale",
    ylabel="held-out loss - fp32",
    yscale="symlog",
    title="the window",
  )
  ax.set_yscale("symlog", linthresh=1e-3)
  ax.legend(fontsize=6)


def plot_shares(ax: Any, result: SweepResult) -> None:
  """Flushed activation gradients, overflowed activation gradients and
  skipped steps, in % against the static scale."""
  static = list(result.by_scaling(Scaling.STATIC).values())
  x = [np.log2(r.initial_scale) for r in static]
  shares = (
    ("o-", "activation grads flushed to 0", lambda r: r.act_flushed_mean),
    ("s-", "activation grads inf/NaN", lambda r: r.act_nonfinite_mean),
    ("d-", "parameter grads inf/NaN", lambda r: r.flush_mean("nonfinite")),
  )
  for style, label, share in shares:
    ax.plot(x, [100 * share(r) for r in static], style, ms=4, label=label)
  ax.plot(
    x,
    [r.skipped_percent for r in static],
    "^-",
    ms=4,
    label="steps skipped",
  )
  _shade(ax, result.window)
  ax.set(xlabel="log2 loss scale", ylabel="%", title="underflow, overflow")
  ax.legend(fontsize=6)


def plot_scales(
  ax: Any, runs: dict[str, RunResult], window: Window = None
) -> None:
  """log2 scale after each step, skipped steps marked."""
  for i, (name, r) in enumerate(runs.items()):
    steps = _steps(r.scale)
    ax.step(steps, np.log2(r.scale), where="post", label=name, color=f"C{i}")
    sk = np.nonzero(r.skipped)[0]
    ax.plot(steps[sk], np.log2(r.scale[sk]), "x", color=f"C{i}", ms=5)
  if window is not None:
    _shade(ax, window, axis="y")
  ax.set(
    xlabel="step (x: skipped)",
    ylabel="log2 loss scale after step",
    title="loss scale",
  )
  ax.legend(fontsize=6)


def plot_loss_gap(
  ax: Any, runs: dict[str, RunResult], ref: RunResult, title: str
) -> None:
  """Each run's training loss minus the reference's, step by step."""
  for i, (name, r) in enumerate(runs.items()):
    ax.plot(_steps(r.loss), r.loss - ref.loss, label=name, lw=1, color=f"C{i}")
  ax.axhline(0, color="k", lw=0.5)
  ax.set(xlabel="step", ylabel="train loss - fp32", title=title)
  ax.legend(fontsize=6)


def dynamic_runs(result: SweepResult) -> dict[str, RunResult]:
  """The grid's dynamically scaled runs."""
  return result.by_scaling(Scaling.DYNAMIC)


def plot_sawtooth(a: Any, b: Any, result: SweepResult) -> None:
  """The longer runs' scales (skips marked) and their loss against
  float32's."""
  assert result.sawtooth is not None
  saw = {k: r for k, r in result.sawtooth.items() if r.spec.scaled}
  plot_scales(a, saw)
  a.set_title("sawtooth: growth every 20 finite steps vs 2000")
  plot_loss_gap(b, saw, result.sawtooth["fp32"], "the loss beside it")


def plot_replicas(ax: Any, result: SweepResult, **legend: Any) -> None:
  """Training loss of the runs with a global mean over replicas."""
  assert result.replicas is not None
  for name, r in result.replicas.items():
    ax.plot(_steps(r.loss), r.loss, label=name)
  ax.set(
    xlabel="step",
    ylabel="train loss",
    title=f"loss / global count, {result.plan.replicas} replicas",
  )
  ax.legend(**legend)


def save_sweep_figure(result: SweepResult, path: str | os.PathLike) -> None:
  """The sweep's figure: the window, the shares, the dynamic scales, and
  the sawtooth and the replicas where the sweep has them."""
  plt = _pyplot()
  fig, ax = plt.subplots(2, 3, figsize=(15, 7.5), dpi=80)
  plot_window(ax[0, 0], result)
  plot_shares(ax[0, 1], result)
  plot_scales(ax[0, 2], dynamic_runs(result), result.window)
  if result.sawtooth is not None:
    plot_sawtooth(ax[1, 0], ax[1, 1], result)
  if result.replicas is not None:
    plot_replicas(ax[1, 2], result, fontsize=7)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def save_bad_batch_figure(
  result: BadBatchResult, path: str | os.PathLike
) -> None:
  """``--corrupt``'s figure: the dynamic runs' scales, and every run's
  training loss against float32's (a gap on each corrupted step, whose
  loss is NaN); the corrupted steps as grey lines."""
  plt = _pyplot()
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4), dpi=80)
  scaled = {k: r for k, r in result.runs.items() if r.spec.scaled}
  plot_scales(a, scaled)
  a.set_title(f"loss scale, {result.plan.share:g} of batches corrupted")
  plot_loss_gap(
    b, scaled, result.runs["fp32"], f"{result.config.replicas} replicas"
  )
  for ax in (a, b):
    for step in result.corrupted_steps:
      ax.axvline(step, color="grey", lw=0.5, alpha=0.5)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
