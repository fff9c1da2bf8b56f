"""`skip_report`: what the loss scaler did, and why steps skipped, in words.

Everything here runs on the host, at logging time: the state is read once
(one transfer of a few scalars), never per step.
"""

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from optax_lossscale._access import locate as _locate
from optax_lossscale._core.config import LossScaleConfig
from optax_lossscale._core.state import (
  CAUSE_INF,
  CAUSE_LOSS,
  CAUSE_NAN,
  RECENT_SKIPS,
  LossScaleState,
)

FLOAT16_MAX = 65504.0
# Parameters named in the report, most often not finite first.
_LEAVES_SHOWN = 5
# Above this share of skipped steps, a cause is the cause.
_MOSTLY = 0.5


@dataclasses.dataclass(frozen=True)
class SkipReport:
  """What :func:`skip_report` returns: the numbers, and ``str()`` of them in
  words (a few lines that read the same in a terminal and a notebook).

  Attributes:
    loss_scale: the scale now.
    min_scale: the floor, when known (from ``tx``), else None.
    at_floor: whether the scale sits at the floor (known floor), or at 1
      or below (unknown floor).
    steps: steps seen.
    skipped: steps skipped in total.
    skipped_in_a_row: steps skipped in a row, up to now.
    nan_steps: skipped steps whose gradients held a NaN.
    nonfinite_loss_steps: skipped steps whose loss was not finite (counted
      only where ``update`` was given ``value=loss``).
    recent: the last skipped steps, oldest first: ``(step, causes,
      scale_before, scale_after)``, causes a tuple of ``"inf"``, ``"NaN"``,
      ``"loss"``.
    leaves: with ``leaf_stats``, ``(path, steps not finite)`` for every
      gradient leaf, most first; None without.
    diagnosis: the plain-words conclusions, one per line of the text.
  """

  loss_scale: float
  min_scale: float | None
  at_floor: bool
  steps: int
  skipped: int
  skipped_in_a_row: int
  nan_steps: int
  nonfinite_loss_steps: int
  recent: tuple[tuple[int, tuple[str, ...], float, float], ...]
  leaves: tuple[tuple[str, int], ...] | None
  diagnosis: tuple[str, ...]

  def __str__(self) -> str:
    return "\n".join(_lines(self))

  def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
    # IPython and Jupyter show the text itself, not the dataclass repr.
    printer.text(str(self))


def skip_report(opt_state: Any, tx: Any = None) -> SkipReport:
  """A report of what the loss scale did and why steps were skipped.

  Call it at logging time (it reads the state once, on the host) and print
  it. It gives the scale and whether it sits at its floor; the skipped steps
  in total, in a row, with NaN (not only inf) in the gradients, and with a
  non-finite loss (counted where ``update`` is given ``value=loss``); the
  last few skips with their scales; with ``leaf_stats=True``, the
  parameters whose gradients were not finite most often; and a diagnosis in
  plain words: a forward overflow or bad data (a non-finite loss, which no
  loss scale fixes), NaN down to the floor (a bug, not float16's range), a
  scale still settling, or nothing wrong.

  Args:
    opt_state: anything holding one scalar loss-scale state (see
      :func:`loss_scale`).
    tx: the transformation :func:`loss_scale_optimizer` made, optional: its
      ``min_scale`` and ``backoff_on_nonfinite_loss`` sharpen the diagnosis.

  Returns:
    A ``SkipReport``: ``print`` it, or read its fields.

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state, several, or
      a stacked one (read one member of an ensemble at a time).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=4.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.array([1.0, jnp.nan]), state,
    ...                      value=jnp.float32(jnp.nan))
    >>> _, state = tx.update(jnp.ones(2), state, value=jnp.float32(1.0))
    >>> print(ols.skip_report(state, tx))
    loss scale 2 (floor 1)
    steps: 2 seen, 1 skipped (50%), 0 in a row now
      gradients with NaN: 1 of the skipped; non-finite loss: 1
    recent skips:
      step 0: NaN, loss; scale 4 -> 2
    diagnosis:
      - the loss itself was not finite in 1 of 1 skipped steps: a forward
        overflow or bad data, which no loss scale fixes. Find where with
        `ols.find_overflow` on a skipped step's batch;
        `backoff_on_nonfinite_loss=False` keeps such steps from lowering
        the scale.
  """
  state = _locate.find_loss_scale_state(opt_state)
  config = _config_of(tx)
  return _report(jax.device_get(state), config)


def _config_of(tx: Any) -> LossScaleConfig | None:
  if tx is None:
    return None
  config = getattr(tx, "loss_scale_config", None)
  if not isinstance(config, LossScaleConfig):
    raise TypeError(
      "`tx` must be the transformation `loss_scale_optimizer` (or"
      f" `from_keras_config`) made, or None, got {type(tx).__name__}."
    )
  return config


def _report(
  state: LossScaleState, config: LossScaleConfig | None
) -> SkipReport:
  scale = float(state.loss_scale)
  min_scale = None if config is None else config.min_scale
  at_floor = scale <= (1.0 if min_scale is None else min_scale)
  leaves = None
  if state.leaf_notfinite is not None:
    counted = [
      (_path_name(path), int(count))
      for path, count in jax.tree_util.tree_flatten_with_path(
        state.leaf_notfinite
      )[0]
    ]
    leaves = tuple(sorted(counted, key=lambda item: -item[1]))
  report = SkipReport(
    loss_scale=scale,
    min_scale=min_scale,
    at_floor=at_floor,
    steps=int(state.steps),
    skipped=int(state.total_skipped),
    skipped_in_a_row=int(state.skipped_in_a_row),
    nan_steps=int(state.nan_steps),
    nonfinite_loss_steps=int(state.nonfinite_loss_steps),
    recent=_recent(state),
    leaves=leaves,
    diagnosis=(),
  )
  return dataclasses.replace(report, diagnosis=_diagnosis(report, config))


def _path_name(path: Any) -> str:
  """`blocks/3/attn/kernel` for a key path."""
  parts = []
  for key in path:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        parts.append(str(getattr(key, attribute)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts) or "(the gradient)"


def _recent(
  state: LossScaleState,
) -> tuple[tuple[int, tuple[str, ...], float, float], ...]:
  events = state.recent_skips
  order = np.argsort(np.asarray(events.step), kind="stable")
  recent = []
  for i in order:
    step = int(events.step[i])
    if step < 0:
      continue  # a slot not written yet
    recent.append(
      (
        step,
        _causes(int(events.cause[i])),
        float(events.scale_before[i]),
        float(events.scale_after[i]),
      )
    )
  return tuple(recent[-RECENT_SKIPS:])


def _causes(bits: int) -> tuple[str, ...]:
  names = ((CAUSE_INF, "inf"), (CAUSE_NAN, "NaN"), (CAUSE_LOSS, "loss"))
  return tuple(name for bit, name in names if bits & bit)


def _diagnosis(
  report: SkipReport, config: LossScaleConfig | None
) -> tuple[str, ...]:
  skipped = report.skipped
  if skipped == 0:
    return ("no step was skipped: float16 stays in range at this scale.",)
  found = []
  if report.nonfinite_loss_steps >= _MOSTLY * skipped:
    advice = (
      "`backoff_on_nonfinite_loss=False` keeps such steps from lowering the"
      " scale."
    )
    if config is not None and not config.backoff_on_nonfinite_loss:
      advice = "The scale was left as it was on those steps."
    found.append(
      f"the loss itself was not finite in {report.nonfinite_loss_steps} of"
      f" {skipped} skipped steps: a forward overflow or bad data, which no"
      " loss scale fixes. Find where with `ols.find_overflow` on a skipped"
      f" step's batch; {advice[0].lower()}{advice[1:]}"
    )
  in_a_row = report.skipped_in_a_row
  if report.at_floor and in_a_row > 0:
    last_causes = report.recent[-1][1] if report.recent else ()
    if "NaN" in last_causes and "loss" not in last_causes:
      found.append(
        f"NaN in the gradients at every scale down to the floor ({in_a_row}"
        " skipped in a row): a bug (a log or square root of 0, a division by"
        " zero, bad data), not float16's range."
      )
    elif "loss" not in last_causes:
      found.append(
        f"the gradients overflow even at the floor ({in_a_row} skipped in a"
        " row): values beyond float16's range (65504) that no scale avoids;"
        " compute that part in float32, and find it with `ols.find_overflow`."
      )
  elif in_a_row >= 3:
    found.append(
      f"{in_a_row} steps skipped in a row: the scale is still coming down"
      " to a level the gradients fit in; if it keeps on, watch for the floor."
    )
  if report.leaves:
    found.append(_where(report.leaves, skipped))
  if not found:
    share = skipped / max(report.steps, 1)
    found.append(
      f"{_steps(skipped)} skipped ({share:.0%}), each an overflow that"
      " lowered the scale: the dynamic scale finding its level, as designed."
    )
  return tuple(found)


def _where(leaves: tuple[tuple[str, int], ...], skipped: int) -> str:
  """Which parameters overflow, and which stayed finite."""
  hit = [(name, count) for name, count in leaves if count]
  clean = [name for name, count in leaves if not count]
  if not hit:
    return (
      "every parameter's gradient stayed finite: the skips came from the"
      " loss or the scale alone."
    )
  names = ", ".join(f"`{name}`" for name, _ in hit[:2])
  text = (
    f"overflows reach {len(hit)} of {len(leaves)} parameters, most often"
    f" {names} ({hit[0][1]} of {skipped} skipped steps)"
  )
  if clean:
    text += (
      f"; {len(clean)} never did (e.g. `{clean[0]}`): the non-finite values"
      " are made near the parameters that overflow, and never flowed back"
      " to these"
    )
  return text + "."


def _lines(report: SkipReport) -> list[str]:
  floor = (
    f"floor {_number(report.min_scale)}"
    if report.min_scale is not None
    else "floor unknown: pass `tx`"
  )
  scale = f"loss scale {_number(report.loss_scale)} ({floor})"
  if report.at_floor:
    scale += ", at the floor"
  lines = [scale]
  share = report.skipped / max(report.steps, 1)
  lines.append(
    f"steps: {report.steps} seen, {report.skipped} skipped ({share:.0%}),"
    f" {report.skipped_in_a_row} in a row now"
  )
  if report.skipped:
    lines.append(
      f"  gradients with NaN: {report.nan_steps} of the skipped;"
      f" non-finite loss: {report.nonfinite_loss_steps}"
    )
  if report.recent:
    lines.append("recent skips:")
    lines += [
      f"  step {step}: {', '.join(causes) or 'overflow'}; scale"
      f" {_number(before)} -> {_number(after)}"
      for step, causes, before, after in report.recent
    ]
  if report.leaves:
    hit = [(name, count) for name, count in report.leaves if count]
    if hit:
      lines.append("parameters not finite most often:")
      width = max(len(name) for name, _ in hit[:_LEAVES_SHOWN])
      lines += [
        f"  {name:<{width}}  {_steps(count)}"
        for name, count in hit[:_LEAVES_SHOWN]
      ]
  lines.append("diagnosis:")
  for item in report.diagnosis:
    lines += _wrapped(f"- {item}", indent="  ", hang="    ")
  return lines


def _steps(count: int) -> str:
  return f"{count} step" if count == 1 else f"{count} steps"


def _number(x: float) -> str:
  """`32768`, `0.5` or `3.4e+38`: short, and exact for powers of two."""
  if math.isfinite(x) and x == int(x) and abs(x) < 1e15:
    return str(int(x))
  return f"{x:.6g}"


def _wrapped(text: str, indent: str, hang: str, width: int = 78) -> list[str]:
  lines, line = [], indent
  for word in text.split():
    if len(line) + len(word) + 1 > width and line.strip():
      lines.append(line.rstrip())
      line = hang
    line += word + " "
  lines.append(line.rstrip())
  return lines
