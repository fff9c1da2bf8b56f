"""`skip_report`: what the loss scaler did, and why steps skipped, in words;
`raise_if_stuck`: the same report as an error, when a run cannot recover.

Both run on the host, at logging time: the state is read once (one
transfer of a few scalars), never per step. Every sentence follows from
what the state recorded at each step (`facts`), by a predicate
(`diagnosis`); what the state cannot prove, the report does not say.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from optax_lossscale._core.state import RECENT_SKIPS
from optax_lossscale._diagnostics import format as _format
from optax_lossscale._diagnostics.report import diagnosis as _diagnosis
from optax_lossscale._diagnostics.report import facts as _facts
from optax_lossscale._diagnostics.report import stuck as _stuck
from optax_lossscale._diagnostics.report import text as _text

# A skip as the report keeps it: (step, causes, scale before, scale after).
Event = tuple[int, tuple[str, ...], float, float]


@dataclasses.dataclass(frozen=True)
class SkipReport:
  """What :func:`skip_report` returns: the numbers the state holds, and
  ``str()`` of them in words (a few lines that read the same in a terminal
  and a notebook).

  Attributes:
    loss_scale: the scale now.
    dynamic: whether the scale is dynamic (it has a counter) or static.
    min_scale: the dynamic scale's floor, as the state recorded it at its
      last update; None for a static scale, or where the state has not
      recorded one (upgraded, and not updated since).
    at_floor: whether the scale now sits at that floor (False where the
      floor is unknown or there is none).
    steps: steps seen, applied and skipped.
    total_skipped: steps skipped in total.
    skipped_in_a_row: steps skipped in a row, up to now.
    nan_steps: skipped steps whose gradients held a NaN (not only infs),
      since ``counted_since``.
    nonfinite_loss_steps: skipped steps whose loss was not finite (counted
      only where ``update`` was given ``value=loss``), since
      ``counted_since``.
    nan_told_apart: whether the recorded checks could tell a NaN in the
      gradients from an inf: False where some kept skip was checked where
      a NaN counts as an inf (a mesh with ``Auto`` axes), or the NaN count
      is not exact; True where every kept skip's check could; None where
      no skip is kept.
    recent: the last skipped steps (up to 8), oldest first: ``(step,
      causes, scale_before, scale_after)``, causes a tuple of ``"inf"``,
      ``"NaN"``, ``"loss"`` and ``"scale below 1"``; ``scale_before`` is
      the scale the step ran at.
    leaves: with ``leaf_stats``, ``(path, steps not finite)`` for every
      gradient leaf, most first and in tree order among equals; None
      without.
    diagnosis: the conclusions in plain words, one sentence each.
    counted_since: the step from which ``nan_steps``,
      ``nonfinite_loss_steps``, ``recent`` and ``leaves`` count: 0, but in
      a state upgraded from 0.1.0 (which did not count them).
    text: the report in words, as ``str()`` gives it.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=8.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.array([1.0, jnp.inf]), state)
    >>> report = ols.skip_report(state)
    >>> report.total_skipped, report.loss_scale, report.recent
    (1, 4.0, ((0, ('inf',), 8.0, 4.0),))
    >>> print(report.diagnosis[0])  # doctest: +NORMALIZE_WHITESPACE
    1 step skipped (100%), each an overflow (inf) that lowered the scale:
    the dynamic scale finding its level, as designed.
  """

  loss_scale: float
  dynamic: bool
  min_scale: float | None
  at_floor: bool
  steps: int
  total_skipped: int
  skipped_in_a_row: int
  nan_steps: int
  nonfinite_loss_steps: int
  nan_told_apart: bool | None
  recent: tuple[Event, ...]
  leaves: tuple[tuple[str, int], ...] | None
  diagnosis: tuple[str, ...]
  counted_since: int = 0
  text: str = dataclasses.field(default="", repr=False)

  def __str__(self) -> str:
    return self.text

  def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
    # IPython and Jupyter show the text itself, not the dataclass repr.
    printer.text(str(self))


def skip_report(opt_state: Any, tx: Any = None) -> SkipReport:
  """A report of what the loss scale did and why steps were skipped.

  Call it at logging time, outside the jitted step, on the state the step
  returned (it reads the state once, on the host) and print it. It gives
  the scale (dynamic or static, and the floor); the steps skipped in total
  and in a row, with NaN in the gradients, and with a non-finite loss
  (counted where ``update`` is given ``value=loss``); the last few skips
  with the scale each ran at and left, and whether hysteresis held the
  scale; with ``leaf_stats=True``, which parameters' gradients were not
  finite and which stayed finite; and a diagnosis in plain words.

  Each sentence follows from what the state recorded at each step: the
  scale a skip ran at, the floor it was checked against, whether its check
  could tell a NaN from an inf (not on a mesh with ``Auto`` axes), and
  the configuration of the state's last update. A static scale is never
  said to come down, a skip at the floor is one that ran there, and
  advice comes as a condition, never as a prediction.

  Args:
    opt_state: anything holding one scalar loss-scale state (see
      :func:`loss_scale`).
    tx: optional, and not needed: the state records its configuration. A
      transformation that :func:`loss_scale_optimizer` or
      :func:`unscale_and_check` made is checked against the state, and
      refused where it contradicts it (it did not make the state). Any
      other optax transformation (a chain or wrapper around one, such as
      ``optax.chain`` or ``optax.inject_hyperparams``) carries no
      configuration the report can read, and is accepted as it is.

  Returns:
    A :class:`SkipReport`: ``print`` it, or read its fields.

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state, several, a
      stacked one (read one member of an ensemble at a time), or one of an
      earlier release (pass it through :func:`upgrade_state`); when
      ``tx``'s configuration contradicts the state's.
    TypeError: when the state holds traced values (called inside
      ``jax.jit``: call it outside, on the state the step returns), or
      ``tx`` is not a transformation.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=4.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.array([1.0, jnp.nan]), state,
    ...                      value=jnp.float32(jnp.nan))
    >>> _, state = tx.update(jnp.ones(2), state, value=jnp.float32(1.0))
    >>> print(ols.skip_report(state))
    loss scale 2: dynamic, floor 1
    steps: 2 seen; skipped: 1 in total (50%), 0 in a row now
      of the skipped: 1 with NaN in the gradients, 1 with a non-finite loss
    recent skips:
      step 0: NaN, loss; scale 4 -> 2
    diagnosis:
      - the loss itself was not finite in 1 of 1 skipped steps: a forward
        overflow or bad data, which no loss scale fixes. Find where with
        `ols.find_overflow` on a skipped step's batch;
        `backoff_on_nonfinite_loss=False` keeps such steps from lowering the
        scale.
  """
  return _report(_facts.read(opt_state, tx))


def raise_if_stuck(
  opt_state: Any,
  tx: Any = None,
  *,
  max_skips_at_floor: int | None = RECENT_SKIPS,
  max_nonfinite_losses: int | None = RECENT_SKIPS,
) -> None:
  """Raises a ``RuntimeError`` whose message is the :func:`skip_report`,
  when the run cannot recover; returns None otherwise.

  Call it from the training loop, after a (jitted) step or at logging
  time, outside the step: it reads the state on the host (a few scalars).
  A run cannot recover when:

  - the last ``max_skips_at_floor`` steps were all skipped, each ran at the
    floor of a dynamic scale (``min_scale``, as the state recorded it with
    each skip), which cannot go lower, or at a static scale, which never
    changes by itself, and the scale is still that one;
  - the loss (``value=loss``) was not finite on each of the last
    ``max_nonfinite_losses`` steps, which no loss scale fixes.

  Args:
    opt_state: anything holding one scalar loss-scale state (see
      :func:`loss_scale`).
    tx: optional, as for :func:`skip_report`: checked against the state,
      never needed.
    max_skips_at_floor: how many skipped steps in a row at the floor (or
      at a static scale) stop the run: an int from 1 to 8 (the skips the
      state keeps), or None not to check.
    max_nonfinite_losses: how many steps in a row with a non-finite loss
      stop the run: an int from 1 to 8, or None not to check.

  Raises:
    RuntimeError: when the run cannot recover; its message says which case
      holds and then gives the report.
    TypeError, ValueError: on bad arguments, naming them; as
      :func:`skip_report` on a state or ``tx`` it cannot read.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> step = jax.jit(tx.update)
    >>> try:
    ...   for _ in range(4):  # at 2, then at the floor three times
    ...     _, state = step(jnp.array([1.0, jnp.inf]), state)
    ...     ols.raise_if_stuck(state, max_skips_at_floor=3)
    ... except RuntimeError as stuck:
    ...   print(stuck)
    The run cannot recover: the last 3 steps were skipped, and each ran at the
    floor of the loss scale (1), which cannot go lower.
    <BLANKLINE>
    loss scale 1: dynamic, now at its floor (1)
    steps: 4 seen; skipped: 4 in total (100%), 4 in a row now
      of the skipped: 0 with NaN in the gradients, 0 with a non-finite loss
    recent skips:
      step 0: inf; scale 2 -> 1
      step 1: inf; scale 1 -> 1
      step 2: inf; scale 1 -> 1
      step 3: inf; scale 1 -> 1
    diagnosis:
      - the gradients overflowed to inf on 3 steps that ran at the floor (1): a
        value or a derivative beyond float16's range (65504) even at that scale:
        `ols.find_overflow` on a skipped step's batch names the operation and
        how to compute it in float32 (an `ols.autocast` call where it can).
  """
  _check_limit("max_skips_at_floor", max_skips_at_floor)
  _check_limit("max_nonfinite_losses", max_nonfinite_losses)
  if max_skips_at_floor is None and max_nonfinite_losses is None:
    raise ValueError(
      "`max_skips_at_floor` and `max_nonfinite_losses` must not both be"
      " None: with neither, nothing is checked."
    )
  facts = _facts.read(opt_state, tx)
  reason = _stuck.nonfinite_losses(
    facts, max_nonfinite_losses
  ) or _stuck.skips_at_floor(facts, max_skips_at_floor)
  if reason is not None:
    text = "\n".join(_format.wrap(f"The run cannot recover: {reason}"))
    raise RuntimeError(f"{text}\n\n{_report(facts)}")


def _check_limit(name: str, value: Any) -> None:
  accepted = f"an int from 1 to {RECENT_SKIPS} (the skips the state keeps)"
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
      f"`{name}` must be {accepted}, or None, got {value!r} of type"
      f" {type(value).__name__}."
    )
  if not 1 <= int(value) <= RECENT_SKIPS:
    raise ValueError(f"`{name}` must be {accepted}, or None, got {value!r}.")


def _report(facts: _facts.Facts) -> SkipReport:
  floor = facts.floor
  said = _diagnosis.diagnosis(facts)
  return SkipReport(
    loss_scale=facts.scale,
    dynamic=facts.dynamic,
    min_scale=floor,
    at_floor=floor is not None and facts.scale == floor,
    steps=facts.steps,
    total_skipped=facts.total_skipped,
    skipped_in_a_row=facts.in_a_row,
    nan_steps=facts.nan_steps,
    nonfinite_loss_steps=facts.nonfinite_loss_steps,
    nan_told_apart=facts.nan_told_apart,
    recent=tuple(e.as_tuple for e in facts.events),
    leaves=facts.leaves,
    diagnosis=said,
    counted_since=facts.since_steps,
    text="\n".join(_text.lines(facts, said)),
  )
