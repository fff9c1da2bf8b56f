"""The scaling rule, as one pure function of (state, finite).

Keras-TF2 is the reference; hysteresis and `max_scale` are extensions that
reduce to it at their defaults (hysteresis=1, max_scale=float32 max).
"""

import jax
import jax.numpy as jnp
import optax

from optax_lossscale._config import LossScaleConfig
from optax_lossscale._state import COUNTER_DTYPE, SCALE_DTYPE, LossScaleState


def next_state(
  state: LossScaleState, finite: jax.Array, config: LossScaleConfig
) -> LossScaleState:
  """The state after a step whose unscaled gradients were `finite` or not."""
  finite = jnp.asarray(finite, jnp.bool_)
  notfinite_count = jnp.where(
    finite,
    jnp.zeros([], COUNTER_DTYPE),
    optax.safe_increment(state.notfinite_count),
  )
  total_notfinite = jnp.where(
    finite,
    state.total_notfinite,
    optax.safe_increment(state.total_notfinite),
  )
  counter: jax.Array | None
  if config.dynamic:
    loss_scale, counter = _dynamic_scale_and_counter(
      state, finite, notfinite_count, config
    )
  else:
    loss_scale, counter = state.loss_scale, state.counter
  return LossScaleState(
    loss_scale=loss_scale,
    counter=counter,
    notfinite_count=notfinite_count,
    total_notfinite=total_notfinite,
    last_finite=finite,
  )


def _dynamic_scale_and_counter(
  state: LossScaleState,
  finite: jax.Array,
  notfinite_count: jax.Array,
  config: LossScaleConfig,
) -> tuple[jax.Array, jax.Array]:
  assert state.counter is not None  # dynamic
  scale, counter = state.loss_scale, state.counter
  # `counter < growth_steps` always holds, so `counter + 1` cannot overflow.
  grow = finite & (counter + 1 >= config.growth_steps)
  grown = scale * jnp.asarray(config.growth_factor, SCALE_DTYPE)
  # Keras keeps the old scale when the grown one is not finite; `max_scale`
  # caps growth the same way (the candidate is dropped, not clipped).
  grown_ok = jnp.isfinite(grown) & (grown <= config.max_scale)
  back_off = ~finite & (notfinite_count >= config.hysteresis)
  backed_off = jnp.maximum(
    scale * jnp.asarray(config.backoff_factor, SCALE_DTYPE),
    jnp.asarray(config.min_scale, SCALE_DTYPE),
  )
  new_scale = jnp.where(
    grow & grown_ok, grown, jnp.where(back_off, backed_off, scale)
  )
  # Reset on growth (also when growth was refused) and on every non-finite
  # step; otherwise count the finite step.
  new_counter = jnp.where(
    finite & ~grow, counter + 1, jnp.zeros([], COUNTER_DTYPE)
  )
  return new_scale.astype(SCALE_DTYPE), new_counter.astype(COUNTER_DTYPE)
