"""Scaling the loss: `scale_loss`, and the product `value_and_grad` uses."""

from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._access.locate import find_loss_scale_state
from optax_lossscale._core.state import SCALE_DTYPE
from optax_lossscale._core.step import wider_dtype


def scaled(loss: jax.Array, scale: jax.Array) -> jax.Array:
  """`loss * scale`, computed in float32 or better, in the loss's dtype."""
  compute_dtype = wider_dtype(loss.dtype, SCALE_DTYPE)
  return (loss.astype(compute_dtype) * scale.astype(compute_dtype)).astype(
    loss.dtype
  )


def checked_loss(loss: jax.typing.ArrayLike) -> jax.Array:
  """`loss` as an array, refused unless floating point."""
  loss = jnp.asarray(loss)
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(
      f"`loss` must be floating point to be scaled, got dtype {loss.dtype}."
    )
  return loss


def scale_loss(loss: jax.typing.ArrayLike, opt_state: Any) -> jax.Array:
  """Multiplies the loss by the current scale, in the loss's dtype.

  Call it inside the function you differentiate, on the optimizer state of
  the same step, so that the gradients are scaled by the scale that
  ``update`` will divide by. (:func:`value_and_grad` does this for you.)

  Args:
    loss: a floating-point scalar (or array).
    opt_state: the optimizer state, or anything holding exactly one
      loss-scale state: a ``chain`` state, a flax ``TrainState``, an
      ``nnx.Optimizer``, its ``opt_state``, ``nnx.state`` output, ...

  Returns:
    ``loss * scale``, computed in float32 or better and cast to the loss's
    dtype.

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state, or several,
      or a stacked (vmapped or replicated) one.
    TypeError: when ``loss`` is not floating point.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> opt_state = ols.loss_scale_optimizer(optax.sgd(0.1)).init(jnp.zeros(2))
    >>> ols.scale_loss(jnp.float32(0.5), opt_state)
    Array(16384., dtype=float32)
    >>> ols.scale_loss(jnp.float16(0.5), opt_state).dtype
    dtype('float16')
  """
  loss = checked_loss(loss)
  return scaled(loss, find_loss_scale_state(opt_state).loss_scale)
