"""The scaling rule, as one pure function of (state, finite).

Keras-TF2 is the reference; hysteresis and `max_scale` are extensions that
reduce to it at their defaults (hysteresis=1, max_scale=float32 max).
"""

import jax
import jax.numpy as jnp
import optax
from jax import lax

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
    last_finite=_reading(state.last_finite, finite),
  )


def _reading(old_flag: jax.Array, finite: jax.Array) -> jax.Array:
  """`finite`, computed so that it reads `old_flag` where that matters.

  `jit` drops an input that the step never reads, and a donated state leaf
  that is dropped cannot lend its buffer to its successor: that output then
  gets a fresh buffer every step. On GPU a fresh address makes XLA update its
  command buffer (CUDA graph) on every call, which slowed a small step's
  wall-clock; there the flag is computed from the old one too, which XLA
  folds away. On CPU the read itself slowed the adam step, and the input
  stays in the program all the same (the branch is chosen when the step is
  compiled), so its buffer is reused either way (benchmarks/README.md).
  """
  return lax.platform_dependent(
    old_flag, finite, cpu=_finite_alone, default=_finite_reading_old
  )


def _finite_alone(old_flag: jax.Array, finite: jax.Array) -> jax.Array:
  del old_flag
  return finite


def _finite_reading_old(old_flag: jax.Array, finite: jax.Array) -> jax.Array:
  return finite & (old_flag | finite)


def _dynamic_scale_and_counter(state, finite, notfinite_count, config):
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
