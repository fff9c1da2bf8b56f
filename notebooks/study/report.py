"""The printed tables: the main job's, its scales' actions, and the
sweep's. Plain text, so that a run's output can be pasted into
RESULTS.md and compared line by line with an earlier one."""

from __future__ import annotations

import math
import textwrap

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


def format_runs(result: StudyResult) -> str:
  """The runs by name, in words, for a reader who meets them first."""
  words = []
  for name, r in result.runs.items():
    if r.spec.dtype == "float32":
      what = "float32, the reference"
    elif not r.spec.scaled:
      what = "float16, no loss scale"
    elif r.spec.autocast:
      what = f"the float32 model under ols.autocast, {describe_scaling(r)}"
    else:
      what = f"float16, {describe_scaling(r)}"
    words.append(f"  {name:<{max(map(len, result.runs)) + 2}}{what}")
  return "\n".join(["Runs (same seed, initial weights and batches):", *words])


TABLE_LEGEND = (
  "eval loss: held-out cross-entropy, nats per character (lower is better);"
  " vs fp32:\nthe difference from float32; act/param flushed %: gradients"
  " that float16 rounds\nto zero, mean of the checkpoints below."
)

STEP_NUMBERING = "Steps are numbered from 0, as ols.skip_report numbers them."


def _scale(r: RunResult) -> str:
  """The final scale as ``2**k``, or "-" for a run without one."""
  return pow2(r.final_scale) if r.spec.scaled else "-"


def _flushed(share: float, digits: int) -> str:
  return "-" if np.isnan(share) else f"{100 * share:.{digits}f}"


def format_table(result: StudyResult) -> str:
  """Per run: held-out loss, against float32, accuracy, the shares of
  activation and parameter gradients flushed to zero (activation first,
  here and below), skipped steps, final scale."""
  ref = result.runs.get("fp32")
  width = max(len("run"), *map(len, result.runs)) + 2
  lines = [
    f"{'run':<{width}}{'eval loss':>10}{'vs fp32':>9}{'acc %':>7}"
    f"{'act flushed %':>15}{'param flushed %':>17}{'skipped':>9}"
    f"{'final scale':>13}",
  ]
  for name, r in result.runs.items():
    # A gap below the last digit prints as +0.0000, not -0.0000.
    vs = round(r.eval_loss - ref.eval_loss, 4) + 0.0 if ref else float("nan")
    lines.append(
      f"{name:<{width}}{r.eval_loss:>10.4f}{vs:>+9.4f}"
      f"{100 * r.eval_acc:>7.2f}{_flushed(r.act_flushed_mean, 2):>15}"
      f"{_flushed(r.flushed_mean, 3):>17}{r.skipped_total:>9d}"
      f"{_scale(r):>13}"
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
  """The scale after a few steps, early ones densely: ``step:2**k``
  (steps from 0)."""
  n = len(r.scale)
  at = sorted({0, 1, 2, 4, 8, n // 4, n // 2, 3 * n // 4, n - 1})
  return ", ".join(f"{i}:{pow2(r.scale[i])}" for i in at if i < n)


def _plural(count: int, word: str) -> str:
  return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _actions(r: RunResult) -> str:
  """``7 growths, 2 backoffs, 2 skipped steps``."""
  return (
    f"{_plural(r.growths, 'growth')}, {_plural(r.backoffs, 'backoff')},"
    f" {_plural(r.skipped_total, 'skipped step')}"
  )


def _change_lines(r: RunResult, indent: str) -> list[str]:
  """Every change of the scale, ``step: 2**k``, a backoff marked, a few to
  a line."""
  before = np.concatenate([[r.initial_scale], r.scale[:-1]])
  changes = [
    f"{i}: {pow2(r.scale[i])}" + (" (skipped)" if r.skipped[i] else "")
    for i in np.nonzero(r.scale != before)[0]
  ]
  if not changes:
    return [f"{indent}never changed"]
  per_line = 4
  return [
    indent + ", ".join(changes[k : k + per_line])
    for k in range(0, len(changes), per_line)
  ]


def _flush_cell(checkpoint: dict[str, float]) -> str:
  """``38.18 / 0.017``: activation, then parameter gradients flushed, %."""
  act, param = checkpoint["act_flushed"], checkpoint["flushed"]
  return f"{100 * act:.2f} / {100 * param:.3f}"


def format_scales(result: StudyResult) -> str:
  """What each scaled run's scale did (every change, and the growths,
  backoffs and skipped steps), then the flushed shares of the float16 runs
  at each checkpoint, activation then parameter gradients."""
  scaled = {n: r for n, r in result.runs.items() if r.spec.scaled}
  lines = []
  if scaled:
    width = max(map(len, scaled)) + 2
    indent = " " * (width + 2)
    lines.append('What the scale did (each change written "step: new scale"):')
    for name, r in scaled.items():
      quiet = r.growths == r.backoffs == r.skipped_total == 0
      if quiet:
        lines.append(f"  {name:<{width}}{describe_scaling(r)}")
        lines.append(f"{indent}never changed, no step skipped")
        continue
      lines.append(f"  {name:<{width}}{describe_scaling(r)}")
      lines.append(f"{indent}{_actions(r)}:")
      lines += _change_lines(r, indent=indent)
  f16 = {n: r for n, r in result.runs.items() if r.spec.dtype == "float16"}
  if f16:
    width = max(map(len, f16)) + 2
    checkpoints = [f["step"] for f in next(iter(f16.values())).flush]
    column = 20
    if lines:
      lines.append("")
    lines.append(
      "Gradients flushed to zero in float16 (activation % / parameter %),"
      " on one batch:"
    )
    lines.append(
      " " * (width + 2)
      + "".join(f"{f'after {s} steps':>{column}}" for s in checkpoints)
    )
    for name, r in f16.items():
      cells = "".join(f"{_flush_cell(f):>{column}}" for f in r.flush)
      lines.append(f"  {name:<{width}}{cells}")
  return "\n".join(lines)


def format_conclusion(result: StudyResult) -> str | None:
  """The result in one sentence: float16 with dynamic scaling at the
  defaults against float32, the float32 model under ``ols.autocast`` with
  the same scaling (when the job has it), and what plain float16 did.
  None when the runs it compares are not there."""
  runs = result.runs
  if not {"fp32", "fp16", "fp16_dynamic"} <= runs.keys():
    return None
  ref, plain, dyn = runs["fp32"], runs["fp16"], runs["fp16_dynamic"]
  steps = len(ref.loss)

  def gap(r: RunResult) -> str:
    d = r.eval_loss - ref.eval_loss
    if round(d, 4) == 0:
      return "level with float32"
    side = "behind" if d > 0 else "ahead of"
    return f"{abs(d):.4f} {side} float32"

  def skips(r: RunResult) -> str:
    if r.skipped_total == 0:
      return "no skipped step"
    return _plural(r.skipped_total, "skipped step")

  text = (
    f"Result after {steps} steps: float16 with dynamic loss scaling (the"
    f" defaults) ends {gap(dyn)} ({dyn.eval_loss:.4f} against"
    f" {ref.eval_loss:.4f}), with {skips(dyn)};"
  )
  auto = runs.get("fp16_autocast")
  if auto is not None:
    text += (
      " the float32 model under ols.autocast, with the same scaling, ends"
      f" {gap(auto)} ({auto.eval_loss:.4f}), with {skips(auto)};"
    )
  text += (
    f" plain float16 ends {gap(plain)}, with"
    f" {100 * plain.act_flushed_mean:.0f}% of its activation gradients"
    " flushed to zero."
  )
  return textwrap.fill(text, width=79)


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


def format_main_skip_report(result: StudyResult, name: str) -> str | None:
  """The main job's ``ols.skip_report`` of one run, introduced for a reader
  who meets it first: the library's text as it prints it."""
  r = result.runs.get(name)
  if r is None or r.skip_report is None:
    return None
  intro = f"What ols.skip_report(opt_state, tx) prints for {name} at the end:"
  return "\n".join([textwrap.fill(intro, 79), *_indented(r.skip_report)])


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
