"""The loss-scale state: fixed-dtype NamedTuples, so that jitted steps never
retrace and checkpoints carry named fields."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

SCALE_DTYPE = jnp.float32
COUNTER_DTYPE = jnp.int32


class LossScaleState(NamedTuple):
  """State of :func:`unscale_and_check`: the scale and its bookkeeping.

  Attributes:
    loss_scale: the scale that multiplies the loss, ``float32[]``.
    counter: consecutive finite steps since the scale last grew or backed
      off, ``int32[]`` (Keras's ``dynamic_counter``); ``None`` when the
      scale is static.
    notfinite_count: non-finite (skipped) steps in a row, ``int32[]``,
      saturating.
    total_notfinite: non-finite (skipped) steps in total, ``int32[]``,
      saturating.
    last_finite: whether the last step's gradients were all finite,
      ``bool[]``.
  """

  loss_scale: jax.Array
  counter: jax.Array | None
  notfinite_count: jax.Array
  total_notfinite: jax.Array
  last_finite: jax.Array


class LossScaleOptimizerState(NamedTuple):
  """State of :func:`loss_scale_optimizer`.

  Attributes:
    loss_scale_state: the :class:`LossScaleState`.
    inner_state: the state of the wrapped transformation, left exactly as it
      was on skipped steps.
  """

  loss_scale_state: LossScaleState
  inner_state: Any


class SkipStats(NamedTuple):
  """Step statistics read by :func:`skip_stats`.

  Attributes:
    total_skipped: non-finite steps skipped in total (saturates at 2**31-1).
    skipped_in_a_row: non-finite steps skipped in a row (saturates).
    last_finite: whether the last step was finite (and so applied).
  """

  total_skipped: jax.Array
  skipped_in_a_row: jax.Array
  last_finite: jax.Array


def init_loss_scale_state(
  initial_scale: float, dynamic: bool
) -> LossScaleState:
  return LossScaleState(
    loss_scale=jnp.asarray(initial_scale, SCALE_DTYPE),
    counter=jnp.zeros([], COUNTER_DTYPE) if dynamic else None,
    notfinite_count=jnp.zeros([], COUNTER_DTYPE),
    total_notfinite=jnp.zeros([], COUNTER_DTYPE),
    last_finite=jnp.ones([], jnp.bool_),
  )


def check_scalar_state(state: LossScaleState) -> None:
  """`update` and `scale_loss` need one scale; the read-outs take any."""
  shape = jnp.shape(state.loss_scale)
  if shape != ():
    raise ValueError(
      "The loss-scale state must hold a scalar scale, got shape"
      f" {shape}. This happens when a state made under `jax.vmap` (an"
      " ensemble of optimizer states) is used outside of it: call"
      " `update`/`scale_loss` inside the same `jax.vmap`, or index one"
      " member of the ensemble. A state replicated for `jax.pmap` is the"
      " same: use it inside `pmap`, or index one replica. The read-outs"
      " (`loss_scale`, `dynamic_counter`, `skip_stats`) accept such a"
      " state and give one value per member."
    )
