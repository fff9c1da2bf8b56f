"""`set_loss_scale`: the scale set by hand, and the checks on its value."""

import numbers
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._access import locate as _locate
from optax_lossscale._access import nnx as _nnx
from optax_lossscale._core.config import (
  FLOAT32_TINY,
  NORMAL_FLOAT32,
  as_real_scalar,
)
from optax_lossscale._core.state import SCALE_DTYPE


def _is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_value(
  value: jax.typing.ArrayLike, old: jax.Array, floor: jax.Array | None
) -> None:
  """Refuses a concrete `value` that is not a usable scale for this state:
  `floor` is the lowest a dynamic one takes, None for a static one."""
  _check_type(value)
  if jnp.shape(value) not in ((), old.shape):
    raise ValueError(
      "`value` must be a scalar loss scale (or one per member of a stacked"
      f" state, shape {old.shape}), got shape {jnp.shape(value)}."
    )
  if not _is_concrete(value):
    return
  # A Python int beyond float's range becomes inf (refused), not an
  # OverflowError.
  scalar = as_real_scalar(value) if isinstance(value, numbers.Real) else None
  with np.errstate(over="ignore", invalid="ignore"):
    as_f32 = np.asarray(value if scalar is None else scalar, np.float32)
  if not np.all(np.isfinite(as_f32) & (as_f32 >= FLOAT32_TINY)):
    raise ValueError(
      f"`value` must be a loss scale that is {NORMAL_FLOAT32}, got {value!r}."
    )
  if floor is not None:
    if _is_concrete(floor) and np.any(as_f32 < np.asarray(floor)):
      raise ValueError(
        "`value` must be at least the floor of this dynamic loss scale"
        f" (its `min_scale` as the state recorded it, or 1 where it has not"
        f" recorded one yet: {_describe(floor)}), got {value!r}: the rule"
        " never takes the scale below its floor, and the step's finiteness"
        " check may rely on it."
      )
    return
  if np.any(as_f32 < 1) and _is_concrete(old) and bool(jnp.all(old >= 1)):
    raise ValueError(
      f"`value` must be >= 1 for this static loss scale (dynamic=False,"
      f" now {_describe(old)}), got {value!r}: its finiteness check"
      " relies on a scale of at least 1, so every step would be skipped,"
      " and a static scale never changes by itself."
    )


def _floor_of(state: Any) -> jax.Array | None:
  """The lowest scale a dynamic state takes: its recorded `min_scale`, or
  1 where it records none (an upgraded state, not updated since: a scale
  of at least 1 suits every check); None for a static state."""
  if state.counter is None:
    return None
  config = state.config
  one = jnp.ones_like(jnp.asarray(state.loss_scale, SCALE_DTYPE))
  if config is None:
    return one
  return jnp.where(config.known, config.min_scale, one)


def _check_type(value: Any) -> None:
  """A real number, or an array of floats or ints; not a bool or a str,
  which `jnp.asarray` would turn into a scale silently."""
  if isinstance(value, bool | np.bool_):
    real = False
  elif isinstance(value, numbers.Real):
    real = True
  else:
    dtype = getattr(value, "dtype", None)
    real = dtype is not None and (
      jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    )
  if not real:
    raise TypeError(
      "`value` must be a real number (or an array of floats or ints), got"
      f" {value!r} of type {type(value).__name__}."
    )


def _describe(x: jax.Array) -> str:
  x = jnp.asarray(x)
  return f"{float(x)}" if x.shape == () else f"shape {x.shape}"


# Whatever state comes in, the same kind goes out.
OptState = TypeVar("OptState")


def set_loss_scale(
  opt_state: OptState, value: jax.typing.ArrayLike
) -> OptState:
  """Sets the loss scale to `value`, for checkpoint surgery or a restart.

  The counters are left as they are. A dynamic scale takes a value from
  its floor up: below ``min_scale`` (as the state records it, from its
  last update; 1 where it records none yet, in a state upgraded and not
  updated since) is refused, since the rule never takes the scale there
  and the finiteness check of a ``min_scale >= 1`` relies on a scale of at
  least 1. Above ``max_scale`` is accepted: growth stops there, and
  backoff brings the scale down. A static scale never backs off, so there
  a value below 1 is refused (unless the static scale is below 1
  already).

  A concrete value that is refused raises; a traced one (under ``jit``)
  that would be refused (not finite, below the smallest normal float32
  ``2**-126``, below the floor of a dynamic scale, or below 1 for a static
  scale >= 1) leaves the scale as it was.

  NNX: where the scale sits in an NNX Variable (an ``nnx.Optimizer``, its
  ``opt_state``, ``nnx.state``/``nnx.split`` output), the Variable is set in
  place, as NNX objects are, and the same object is returned:
  ``ols.set_loss_scale(optimizer, 1024.0)`` is the whole call, and the next
  ``optimizer.update`` uses the new scale. Every other state is returned as
  a new state and left unchanged.

  Args:
    opt_state: anything holding one loss-scale state (see
      :func:`scale_loss`); a stacked (ensemble) state sets every member.
    value: the new scale, a scalar (or one per member of a stacked state).

  Returns:
    A state of the same structure and dtypes with the new scale.

  Raises:
    TypeError: for a value that is not a real number or an array of floats
      or ints (a bool or a str, say).
    ValueError: for a concrete value that is not a finite float32 of at
      least ``2**-126`` (the smallest normal one), below the floor of a
      dynamic scale, or below 1 for a static scale of at least 1.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> state = ols.loss_scale_optimizer(optax.sgd(0.1)).init(jnp.zeros(2))
    >>> ols.loss_scale(ols.set_loss_scale(state, 256.0))
    Array(256., dtype=float32)
  """
  node = _locate.find_node(opt_state)
  held = _locate.field(node, "loss_scale")
  old = jnp.asarray(_nnx.unwrap(held))
  floor = _floor_of(_locate.typed(node))
  _check_value(value, old, floor)
  new = jnp.broadcast_to(jnp.asarray(value, SCALE_DTYPE), old.shape)
  # What a concrete value was checked for, for a traced one (and for a
  # traced old scale): a refused value keeps the old scale. Without it, a
  # NaN set under jit would stay NaN (`max(NaN, min_scale)` is NaN).
  # Not `new > 0`: a subnormal is > 0 in the comparison, and 0 once XLA on
  # CPU flushes it in arithmetic.
  usable = jnp.isfinite(new) & (new >= FLOAT32_TINY)
  if floor is None:
    usable &= (new >= 1) | (old < 1)
  else:
    usable &= new >= floor
  new = jnp.where(usable, new, old.astype(SCALE_DTYPE))

  if _nnx.is_variable(held):
    _nnx.set_value(held, new)
    return opt_state
  return _locate.replace_node(opt_state, loss_scale=new)
