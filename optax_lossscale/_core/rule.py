"""The scaling rule, as one pure function of (state, the step's outcome).

Keras-TF2 is the reference; hysteresis, `max_scale` and
`backoff_on_nonfinite_loss=False` are extensions that reduce to it at their
defaults (hysteresis=1, max_scale=float32 max, backoff on a non-finite loss).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._core.config import LossScaleConfig
from optax_lossscale._core.state import (
  CAUSE_INF,
  CAUSE_LOSS,
  CAUSE_NAN,
  COUNTER_DTYPE,
  RECENT_SKIPS,
  SCALE_DTYPE,
  LeafCounts,
  LossScaleState,
  SkipEvents,
)


class Outcome(NamedTuple):
  """What a step's check found, agreed across replicas."""

  grads_finite: jax.Array  # bool[]: every gradient element finite
  grads_nan: jax.Array  # bool[]: some gradient element NaN
  loss_finite: jax.Array  # bool[]: the loss finite (True when not given)
  # With leaf_stats: bool[n], per gradient leaf in `jax.tree.leaves` order.
  leaf_notfinite: jax.Array | None = None


def outcome_of(finite: jax.typing.ArrayLike) -> Outcome:
  """The outcome of a step known only by whether its gradients were finite
  (an overflow to inf, no NaN, and a finite loss otherwise)."""
  finite = jnp.asarray(finite, jnp.bool_)
  return Outcome(finite, jnp.zeros([], jnp.bool_), jnp.ones([], jnp.bool_))


def applies(outcome: Outcome) -> jax.Array:
  """Whether the step is applied: its gradients and its loss are finite.

  A non-finite loss skips the step whatever the gradients (an inf loss can
  come with finite gradients: a target whose logit is `-inf`); whether it
  also backs the scale off is `config.backoff_on_nonfinite_loss`'s to
  decide (`next_state`)."""
  return outcome.grads_finite & outcome.loss_finite


def next_state(
  state: LossScaleState, outcome: Outcome, config: LossScaleConfig
) -> LossScaleState:
  """The state after a step with this outcome."""
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
  if config.dynamic:
    loss_scale, counter = _dynamic_scale_and_counter(
      state, applied, blamed, overflows_in_a_row, config
    )
  else:
    loss_scale, counter = state.loss_scale, state.counter
  return LossScaleState(
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
    recent_skips=_recorded(state, outcome, skipped, loss_scale),
    leaf_notfinite=_leaf_counts(state.leaf_notfinite, outcome.leaf_notfinite),
  )


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


def _recorded(
  state: LossScaleState,
  outcome: Outcome,
  skipped: jax.Array,
  new_scale: jax.Array,
) -> SkipEvents:
  """The ring of recent skips, with this step written in if it skipped."""
  cause = (
    jnp.where(outcome.grads_finite, 0, CAUSE_INF)
    | jnp.where(outcome.grads_nan, CAUSE_NAN, 0)
    | jnp.where(outcome.loss_finite, 0, CAUSE_LOSS)
  )
  # A NaN step is not also an inf step in the record: it says NaN.
  cause = jnp.where(outcome.grads_nan, cause & ~CAUSE_INF, cause)
  # The slot to write, as a mask: a select of each small array, which XLA
  # fuses, rather than a scatter into it.
  slot = state.total_skipped % RECENT_SKIPS
  write = skipped & (jnp.arange(RECENT_SKIPS, dtype=COUNTER_DTYPE) == slot)
  event = (
    state.steps,
    cause.astype(COUNTER_DTYPE),
    state.loss_scale.astype(SCALE_DTYPE),
    new_scale.astype(SCALE_DTYPE),
  )
  return SkipEvents._make(
    jnp.where(write, value, ring)
    for ring, value in zip(state.recent_skips, event, strict=True)
  )


def _dynamic_scale_and_counter(
  state: LossScaleState,
  applied: jax.Array,
  blamed: jax.Array,
  overflows_in_a_row: jax.Array,
  config: LossScaleConfig,
) -> tuple[jax.Array, jax.Array]:
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
  return new_scale.astype(SCALE_DTYPE), new_counter.astype(COUNTER_DTYPE)
