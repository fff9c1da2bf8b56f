"""The scaling rule, as one pure function of (state, the step's outcome).

Keras-TF2 is the reference; hysteresis, `max_scale` and
`backoff_on_nonfinite_loss=False` are extensions that reduce to it at their
defaults (hysteresis=1, max_scale=float32 max, backoff on a non-finite loss).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_lossscale._core.config import LossScaleConfig
from optax_lossscale._core.state import (
  CAUSE_INF,
  CAUSE_LOSS,
  CAUSE_NAN,
  CAUSE_SCALE,
  COUNTER_DTYPE,
  RECENT_SKIPS,
  SCALE_DTYPE,
  LeafCounts,
  LossScaleState,
  SkipEvents,
  recorded_config,
)


class Outcome(NamedTuple):
  """What a step's check found, agreed across replicas."""

  grads_finite: jax.Array  # bool[]: every gradient element finite
  grads_nan: jax.Array  # bool[]: some gradient element NaN
  loss_finite: jax.Array  # bool[]: the loss finite (True when not given)
  # With leaf_stats: bool[n], per gradient leaf in `jax.tree.leaves` order.
  leaf_notfinite: jax.Array | None = None
  # bool[]: the check can vouch for the scale the step ran at (False for a
  # scale below 1 where the check reads the gradients before the division).
  scale_usable: jax.Array | bool = True
  # Static: whether the check could tell a NaN from an inf (`finite.check`).
  nan_told_apart: bool = True


def applies(outcome: Outcome) -> jax.Array:
  """Whether the step is applied: its gradients and its loss are finite,
  at a scale the check can vouch for.

  A non-finite loss skips the step whatever the gradients (an inf loss can
  come with finite gradients: a target whose logit is `-inf`); whether it
  also backs the scale off is `config.backoff_on_nonfinite_loss`'s to
  decide (`next_state`)."""
  return outcome.grads_finite & outcome.loss_finite & outcome.scale_usable


def next_state(
  state: LossScaleState, outcome: Outcome, config: LossScaleConfig
) -> LossScaleState:
  """The state after a step with this outcome, which records the step's
  facts (its skip, if it skipped) and the configuration it ran with."""
  # `update` refuses a state of an earlier release, which lacks them.
  assert state.nan_steps_exact is not None and state.config is not None
  assert state.recent_skips.next_slot is not None
  applied = applies(outcome)
  skipped = ~applied
  # The scale is to blame for a skip (it backs off, as on an overflow)
  # unless the loss itself was not finite and the configuration says that
  # is not the scale's fault.
  blamed = skipped
  if not config.backoff_on_nonfinite_loss:
    blamed = skipped & outcome.loss_finite
  overflows_in_a_row = jnp.where(
    applied,
    _zero(),
    _increment_where(blamed, state.overflows_in_a_row),
  )
  counter: jax.Array | None
  held = not_blamed = jnp.zeros([], jnp.bool_)
  if config.dynamic:
    loss_scale, counter, backed_off = _dynamic_scale_and_counter(
      state, applied, blamed, overflows_in_a_row, config
    )
    held, not_blamed = blamed & ~backed_off, skipped & ~blamed
  else:
    loss_scale, counter = state.loss_scale, state.counter
  event = _Event(
    cause=_cause(outcome),
    floor=config.min_scale if config.dynamic else 0.0,
    nan_told_apart=outcome.nan_told_apart,
    hysteresis_held=held,
    loss_not_blamed=not_blamed,
  )
  untold = skipped & ~outcome.grads_finite & (not outcome.nan_told_apart)
  return state._replace(
    loss_scale=loss_scale,
    counter=counter,
    skipped_in_a_row=jnp.where(
      applied, _zero(), optax.safe_increment(state.skipped_in_a_row)
    ),
    total_skipped=_increment_where(skipped, state.total_skipped),
    last_finite=applied,
    overflows_in_a_row=overflows_in_a_row,
    nan_steps=_increment_where(skipped & outcome.grads_nan, state.nan_steps),
    nonfinite_loss_steps=_increment_where(
      skipped & ~outcome.loss_finite, state.nonfinite_loss_steps
    ),
    steps=optax.safe_increment(state.steps),
    recent_skips=_recorded(state, event, skipped, loss_scale),
    leaf_notfinite=_leaf_counts(state.leaf_notfinite, outcome.leaf_notfinite),
    config=_written_over(state.config, recorded_config(config)),
    nan_steps_exact=state.nan_steps_exact & ~untold,
  )


def _written_over(old: Any, new: Any) -> Any:
  """`new` (constants of the step) in `old`'s place, as a select that
  reads `old`: kept where it equals `new`, else `new`. jax returns an
  output that is a constant as a new array at every call, outside the
  compiled step, so that the donated buffer of `old` would go unused (a
  fresh address each step; on GPU, one more command-buffer update:
  tests/test_skip.py); and a constant written into that buffer is a copy
  per field in the compiled step. The select is computed in the buffer."""
  return jax.tree.map(lambda o, n: lax.select(o == n, o, n), old, new)


def _zero() -> jax.Array:
  return jnp.zeros([], COUNTER_DTYPE)


def _increment_where(condition: jax.Array, count: jax.Array) -> jax.Array:
  """`count + 1` where `condition`, saturating; else `count`."""
  return jnp.where(condition, optax.safe_increment(count), count)


def _leaf_counts(
  counts: LeafCounts | None, notfinite: jax.Array | None
) -> LeafCounts | None:
  """Each leaf's count, one more where it was not finite (one operation
  over the vector of counts)."""
  if counts is None or notfinite is None:
    return counts
  held, given = counts.counts.shape[0], notfinite.shape[0]
  if held != given:
    raise ValueError(
      "With `leaf_stats=True` the gradients must have the structure of the"
      f" params given to `init`: the state counts {held} leaves, the"
      f" gradients have {given}."
    )
  return counts._replace(counts=_increment_where(notfinite, counts.counts))


class _Event(NamedTuple):
  """What a skip records beyond its step and scales."""

  cause: jax.Array
  floor: float
  nan_told_apart: bool
  hysteresis_held: jax.Array
  loss_not_blamed: jax.Array


def _cause(outcome: Outcome) -> jax.Array:
  """The bits of why the step was (or would be) skipped: a NaN step is not
  also an inf step in the record, it says NaN."""
  inf = ~outcome.grads_finite & ~outcome.grads_nan
  return (
    jnp.where(inf, CAUSE_INF, 0)
    | jnp.where(outcome.grads_nan, CAUSE_NAN, 0)
    | jnp.where(outcome.loss_finite, 0, CAUSE_LOSS)
    | jnp.where(outcome.scale_usable, 0, CAUSE_SCALE)
  ).astype(COUNTER_DTYPE)


def _recorded(
  state: LossScaleState,
  event: _Event,
  skipped: jax.Array,
  new_scale: jax.Array,
) -> SkipEvents:
  """The ring of recent skips, with this step written in if it skipped, at
  the ring's write position (never a counter: counters saturate)."""
  ring = state.recent_skips
  next_slot = ring.next_slot
  assert next_slot is not None  # today's state (`next_state`)
  # The slot to write, as a mask: a select of each small array, which XLA
  # fuses, rather than a scatter into it.
  write = skipped & (jnp.arange(RECENT_SKIPS, dtype=COUNTER_DTYPE) == next_slot)
  values = {
    "step": state.steps,
    "cause": event.cause,
    "scale_before": state.loss_scale.astype(SCALE_DTYPE),
    "scale_after": new_scale.astype(SCALE_DTYPE),
    "floor": jnp.asarray(event.floor, SCALE_DTYPE),
    "nan_told_apart": jnp.asarray(event.nan_told_apart, jnp.bool_),
    "hysteresis_held": event.hysteresis_held,
    "loss_not_blamed": event.loss_not_blamed,
    "recorded": jnp.ones([], jnp.bool_),
  }
  return ring._replace(
    **{
      name: jnp.where(write, value, getattr(ring, name))
      for name, value in values.items()
    },
    next_slot=jnp.where(
      skipped, (next_slot + 1) % RECENT_SKIPS, next_slot
    ).astype(COUNTER_DTYPE),
  )


def _dynamic_scale_and_counter(
  state: LossScaleState,
  applied: jax.Array,
  blamed: jax.Array,
  overflows_in_a_row: jax.Array,
  config: LossScaleConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The new scale and counter, and whether the rule backed the scale off
  (at the floor too, where the scale stays)."""
  assert state.counter is not None  # dynamic
  scale, counter = state.loss_scale, state.counter
  # `counter < growth_steps` always holds, so `counter + 1` cannot overflow.
  grow = applied & (counter + 1 >= config.growth_steps)
  grown = scale * jnp.asarray(config.growth_factor, SCALE_DTYPE)
  # Keras keeps the old scale when the grown one is not finite; `max_scale`
  # caps growth the same way (the candidate is dropped, not clipped).
  grown_ok = jnp.isfinite(grown) & (grown <= config.max_scale)
  back_off = blamed & (overflows_in_a_row >= config.hysteresis)
  backed_off = jnp.maximum(
    scale * jnp.asarray(config.backoff_factor, SCALE_DTYPE),
    jnp.asarray(config.min_scale, SCALE_DTYPE),
  )
  new_scale = jnp.where(
    grow & grown_ok, grown, jnp.where(back_off, backed_off, scale)
  )
  # Reset on growth (also when growth was refused) and on every skip the
  # scale is blamed for; count an applied step; a skip the scale is not to
  # blame for leaves the counter.
  new_counter = jnp.where(
    applied & ~grow,
    counter + 1,
    jnp.where(blamed | grow, jnp.zeros([], COUNTER_DTYPE), counter),
  )
  return (
    new_scale.astype(SCALE_DTYPE),
    new_counter.astype(COUNTER_DTYPE),
    back_off,
  )
