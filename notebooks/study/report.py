"""The printed tables: the main job's, its scales' actions, and the
sweep's. Plain text, so that a run's output can be pasted into
RESULTS.md and compared line by line with an earlier one."""

from __future__ import annotations

import math

import numpy as np

from .config import Config
from .results import BadBatchResult, RunResult, StudyResult, SweepResult
from .runs import DEFAULT_GROWTH_STEPS, Scaling


def pow2(x: float) -> str:
  """A power of two as ``2**k``.

  >>> pow2(1024.0), pow2(1.0)
  ('2**10', '2**0')
  """
  return f"2**{math.log2(x):g}"


def _percent(share: float, digits: int = 2) -> str:
  """A share in %, or "-" where it is not measured (float32 runs)."""
  return "-" if np.isnan(share) else f"{100 * share:.{digits}f}"


def format_header(config: Config) -> str:
  """One line on the task, the model and the training."""
  c = config
  return (
    f"char-MLP LM on {c.corpus_chars} chars of stdlib source, "
    f"vocab {c.vocab}, context {c.context}, depth "
    f"{c.depth}x{c.width}, {c.batch} tokens/batch "
    f"(token-mean loss), Adam lr {c.lr}, {c.steps} steps, "
    f"seed {c.seed}; eval on {c.eval_tokens} held-out tokens"
  )


def format_replicas_note(config: Config) -> str | None:
  """The main job's note on a global mean over replicas, if it has one."""
  if config.replicas <= 1:
    return None
  return (
    f"loss of {config.batch} tokens divided by "
    f"{config.replicas} x {config.batch} (replicas)"
  )


def format_table(result: StudyResult) -> str:
  """Per run: held-out loss, against float32, accuracy, flushed shares,
  skipped steps, final scale."""
  ref = result.runs.get("fp32")
  lines = [
    f"{'run':<14}{'eval loss':>10}{'vs fp32':>9}{'acc %':>7}"
    f"{'flushed % (param / act)':>25}{'skipped':>9}{'final scale':>13}",
  ]
  for name, r in result.runs.items():
    vs = r.eval_loss - ref.eval_loss if ref else float("nan")
    flushed = (
      "-"
      if np.isnan(r.flushed_mean)
      else f"{100 * r.flushed_mean:.3f} / {100 * r.act_flushed_mean:.2f}"
    )
    lines.append(
      f"{name:<14}{r.eval_loss:>10.4f}{vs:>+9.4f}"
      f"{100 * r.eval_acc:>7.2f}{flushed:>25}{r.skipped_total:>9d}"
      f"{r.final_scale:>13g}"
    )
  return "\n".join(lines)


def describe_scaling(r: RunResult) -> str:
  """How a scaled run scales, in words."""
  if r.spec.scaling is Scaling.DYNAMIC:
    growth = r.spec.growth_steps or DEFAULT_GROWTH_STEPS
    hold = "" if r.spec.backoff_on_nonfinite_loss else ", no NaN-loss backoff"
    return (
      f"dynamic from {pow2(r.initial_scale)}, growth every "
      f"{growth} finite steps{hold}"
    )
  return f"static {pow2(r.initial_scale)}"


def format_trajectory(r: RunResult) -> str:
  """The scale after a few steps, early ones densely: ``step:2**k``."""
  n = len(r.scale)
  at = sorted({0, 1, 2, 4, 8, n // 4, n // 2, 3 * n // 4, n - 1})
  return ", ".join(f"{i + 1}:{pow2(r.scale[i])}" for i in at if i < n)


def format_scales(result: StudyResult) -> str:
  """What each scaled run's scale did, and the flushed shares of the
  float16 runs at each checkpoint."""
  lines = []
  for name, r in result.runs.items():
    if not r.spec.scaled:
      continue
    lines.append(
      f"{name} ({describe_scaling(r)}): scale after step {format_trajectory(r)}"
    )
    lines.append(
      f"  backoffs {r.backoffs}, growths {r.growths},"
      f" skipped steps {r.skipped_total}"
    )
  lines.append(
    "flushed % of activation (param) gradients per checkpoint,"
    " fp16 / static / dynamic / dynamic_g5:"
  )
  f16 = [r for r in result.runs.values() if r.spec.dtype == "float16"]
  if f16:
    for i, f in enumerate(f16[0].flush):
      vals = " / ".join(
        f"{100 * r.flush[i]['act_flushed']:.2f}"
        f" ({100 * r.flush[i]['flushed']:.3f})"
        for r in f16
      )
      lines.append(f"  step {f['step']}: {vals}")
  return "\n".join(lines)


def _grid_lines(result: SweepResult) -> list[str]:
  ref = result.runs["fp32"].eval_loss
  lines = [
    f"{'run':<16}{'eval loss':>10}{'vs fp32':>9}{'act flushed %':>14}"
    f"{'act overflow %':>15}{'skipped %':>10}{'final scale':>12}"
    f"{'backoffs':>9}{'growths':>8}",
  ]
  for name, r in result.runs.items():
    lines.append(
      f"{name:<16}{r.eval_loss:>10.4f}{r.eval_loss - ref:>+9.4f}"
      f"{_percent(r.act_flushed_mean):>14}"
      f"{_percent(r.act_nonfinite_mean):>15}"
      f"{r.skipped_percent:>10.1f}"
      f"{pow2(r.final_scale):>12}{r.backoffs:>9}{r.growths:>8}"
    )
  return lines


def _window_lines(result: SweepResult) -> list[str]:
  w = result.window
  if w is None:
    return ["no static scale is usable"]
  assert result.best_static is not None and result.landing is not None
  lines = [
    f"window: {pow2(w[0])} .. {pow2(w[1])} "
    f"({math.log2(w[1] / w[0]):g} octaves); best static "
    f"{pow2(result.best_static)}"
  ]
  for name, land in result.landing.items():
    r = result.runs[name]
    if land is None:
      lines.append(
        f"  {name}: never in the window (ends at {pow2(r.final_scale)})"
      )
    else:
      lines.append(
        f"  {name}: in the window after {land.steps} steps "
        f"({land.skips} skipped), stays {100 * land.stays:.0f}% of"
        f" the rest; {r.skipped_total} skipped in all"
      )
  return lines


def _sawtooth_lines(saw: dict[str, RunResult]) -> list[str]:
  ref = saw["fp32"].eval_loss
  lines = [f"sawtooth, {len(saw['fp32'].loss)} steps:"]
  for name, r in saw.items():
    lines.append(
      f"  {name:<16} eval {r.eval_loss:.4f}"
      f" ({r.eval_loss - ref:+.4f}); skipped {r.skipped_total},"
      f" backoffs {r.backoffs}, growths {r.growths}, final scale"
      f" {pow2(r.final_scale)}, skipped at steps "
      f"{(np.nonzero(r.skipped)[0] + 1).tolist()}"
    )
  return lines


def _replica_lines(result: SweepResult) -> list[str]:
  assert result.replicas is not None
  n, batch = result.plan.replicas, result.config.batch
  lines = [
    f"data-parallel token mean: each of {n} replicas divides "
    f"its {batch} tokens' loss by {n * batch}"
  ]
  ref = result.replicas["fp32"].eval_loss
  for name, r in result.replicas.items():
    lo = r.loss
    lines.append(
      f"  {name:<13} eval {r.eval_loss:.4f}"
      f" ({r.eval_loss - ref:+.4f})"
      f", train loss min {lo.min():.4f} at step {int(lo.argmin()) + 1},"
      f" last {lo[-1]:.4f}; act flushed {_percent(r.act_flushed_mean)}%,"
      f" final scale {pow2(r.final_scale)}"
    )
  return lines


def format_sweep(result: SweepResult) -> str:
  """The grid's table, the window and the dynamic runs' landings, then the
  sawtooth and the replicas when the sweep has them."""
  c = result.config
  lines = [
    f"{c.steps} steps, {c.batch} tokens per mean; usable:"
    f" held-out loss within {result.plan.tol} of fp32"
    f" ({result.runs['fp32'].eval_loss:.4f})",
    *_grid_lines(result),
    *_window_lines(result),
  ]
  if result.sawtooth is not None:
    lines += _sawtooth_lines(result.sawtooth)
  if result.replicas is not None:
    lines += _replica_lines(result)
  return "\n".join(lines)


def format_changes(r: RunResult) -> str:
  """Every change of the scale, ``step:2**k`` (steps from 1), or "none".

  >>> import numpy as np
  >>> from notebooks.study import runs
  >>> r = RunResult(runs.dynamic(4.0, 20, "d"), np.zeros(4),
  ...               np.array([2.0, 2.0, 4.0, 4.0]), np.zeros(4, bool),
  ...               0.0, 0.0, [], initial_scale=4.0)
  >>> format_changes(r)
  '1:2**1, 3:2**2'
  """
  before = np.concatenate([[r.initial_scale], r.scale[:-1]])
  changed = np.nonzero(r.scale != before)[0]
  return ", ".join(f"{i + 1}:{pow2(r.scale[i])}" for i in changed) or "none"


def _indented(text: str) -> list[str]:
  return [f"  {line}" for line in text.splitlines()]


def format_bad_batches(result: BadBatchResult) -> str:
  """``--corrupt``: which steps were corrupted; per run the held-out loss
  against float32, the skips (those with a NaN loss apart), the flushed
  share and the scale; each scaled run's scale changes and its
  ``skip_report``."""
  c, plan = result.config, result.plan
  steps = result.corrupted_steps
  lines = [
    f"bad batches: each batch corrupted (one NaN in its embedded"
    f" activations) with probability {plan.share:g}: {len(steps)} of"
    f" {c.steps} steps, at steps {steps}",
    f"each of {c.replicas} replicas divides its {c.batch} tokens' loss by"
    f" {c.replicas * c.batch}",
    f"{'run':<19}{'eval loss':>10}{'vs fp32':>9}{'acc %':>7}"
    f"{'skipped':>9}{'NaN loss':>10}{'act flushed %':>15}{'final scale':>13}",
  ]
  ref = result.runs["fp32"].eval_loss
  for name, r in result.runs.items():
    lines.append(
      f"{name:<19}{r.eval_loss:>10.4f}{r.eval_loss - ref:>+9.4f}"
      f"{100 * r.eval_acc:>7.2f}{r.skipped_total:>9d}"
      f"{r.nonfinite_loss_skips:>10d}{_percent(r.act_flushed_mean):>15}"
      f"{pow2(r.final_scale):>13}"
    )
  for name, r in result.runs.items():
    if not r.spec.scaled:
      continue
    lines.append(
      f"{name} ({describe_scaling(r)}): scale changes (step:scale)"
      f" {format_changes(r)}"
    )
  lines += skip_report_lines(result.runs)
  return "\n".join(lines)


def skip_report_lines(
  runs: dict[str, RunResult], names: tuple[str, ...] | None = None
) -> list[str]:
  """The ``ols.skip_report`` text of the named runs (default: every run
  that has one), each under its name, indented."""
  lines = []
  for name in names or tuple(runs):
    text = runs[name].skip_report if name in runs else None
    if text is not None:
      lines.append(f"ols.skip_report for {name}:")
      lines += _indented(text)
  return lines
