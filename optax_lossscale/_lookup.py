"""Finding the loss-scale state anywhere in an optimizer state, and reading
or replacing it: `scale_loss`, `loss_scale`, `dynamic_counter`,
`skip_stats`, `set_loss_scale`.

The state is found in optax states, a flax `TrainState`, an
`nnx.Optimizer` (its fields are NNX Variables), its `opt_state`, and the
mappings `nnx.state(...)`/`nnx.split(...)` make of it (a `LossScaleState`
becomes a mapping of its field names there). Flax is not imported here:
NNX Variables are recognized only when `flax.nnx` is already loaded.
"""

import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._state import SCALE_DTYPE, LossScaleState, SkipStats
from optax_lossscale._unscale import check_scalar_state

_FIELDS = frozenset(LossScaleState._fields)
# `nnx.state` drops a None field: a static state has no `counter` there.
_REQUIRED_FIELDS = _FIELDS - {"counter"}

ACCEPTED = (
  "the state of an optimizer built with `loss_scale_optimizer` or"
  " `unscale_and_check` (the whole optax state, a flax `TrainState`, an"
  " `nnx.Optimizer`, its `opt_state`, or `nnx.state`/`nnx.split` output of"
  " it)"
)


def _is_loss_scale_node(x: Any) -> bool:
  """A `LossScaleState`, or the mapping `nnx.state` makes of one."""
  if isinstance(x, LossScaleState):
    return True
  if isinstance(x, Mapping):
    try:
      keys = set(x.keys())
    except TypeError:
      return False
    return _REQUIRED_FIELDS <= keys <= _FIELDS
  return False


def _is_nnx_variable(x: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  variable = getattr(nnx, "Variable", None)
  return variable is not None and isinstance(x, variable)


def _unwrap(x):
  """An NNX Variable's value; anything else as it is."""
  if _is_nnx_variable(x):
    # `get_value` in newer flax; `.value` in flax 0.12.0, the newest that
    # installs with the oldest jax supported.
    get_value = getattr(x, "get_value", None)
    return get_value() if get_value is not None else x.value
  return x


def _field(node, name):
  if isinstance(node, LossScaleState):
    return getattr(node, name)
  return node.get(name)


def _find_node(opt_state):
  """The one loss-scale node in `opt_state` (a `LossScaleState` or mapping)."""
  found = [
    (path, leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(
      opt_state, is_leaf=_is_loss_scale_node
    )[0]
    if _is_loss_scale_node(leaf)
  ]
  if not found:
    raise ValueError(
      "No loss-scale state found in the given optimizer state (of type"
      f" {type(opt_state).__name__}). Pass {ACCEPTED}; not the parameters"
      " or a plain optax state."
    )
  if len(found) > 1:
    paths = ", ".join(jax.tree_util.keystr(path) for path, _ in found)
    raise ValueError(
      f"Found {len(found)} loss-scale states in the optimizer state, at"
      f" {paths}; a loss-scaled optimizer must not wrap another. Keep one"
      " loss scaler."
    )
  return found[0][1]


def _read(opt_state: Any) -> LossScaleState:
  """The loss-scale state as plain arrays, possibly stacked (any shape)."""
  node = _find_node(opt_state)
  values = {
    name: _unwrap(_field(node, name)) for name in LossScaleState._fields
  }
  return LossScaleState._make(
    None if value is None else jnp.asarray(value) for value in values.values()
  )


def find_loss_scale_state(opt_state: Any) -> LossScaleState:
  """The one scalar :class:`LossScaleState` inside `opt_state`, as arrays."""
  state = _read(opt_state)
  check_scalar_state(state)
  return state


def _scaled(loss: jax.Array, scale: jax.Array) -> jax.Array:
  compute_dtype = jnp.promote_types(loss.dtype, SCALE_DTYPE)
  return (loss.astype(compute_dtype) * scale.astype(compute_dtype)).astype(
    loss.dtype
  )


def _check_loss(loss: jax.typing.ArrayLike) -> jax.Array:
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
  loss = _check_loss(loss)
  return _scaled(loss, find_loss_scale_state(opt_state).loss_scale)


def loss_scale(opt_state: Any) -> jax.Array:
  """The current loss scale, a ``float32`` array.

  Args:
    opt_state: anything holding one loss-scale state (see
      :func:`scale_loss`). A stacked state (made under ``jax.vmap`` for an
      ensemble, or replicated for ``jax.pmap``) gives one scale per member.

  Returns:
    The scale: a scalar, or one per member of a stacked state.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.adam(1e-3), initial_scale=1024)
    >>> ols.loss_scale(tx.init(jnp.zeros(3)))
    Array(1024., dtype=float32)
    >>> ols.loss_scale(jax.vmap(tx.init)(jnp.zeros((2, 3))))  # an ensemble
    Array([1024., 1024.], dtype=float32)
  """
  return _read(opt_state).loss_scale


def dynamic_counter(opt_state: Any) -> jax.Array | None:
  """Consecutive finite steps since the scale last changed; None if static.

  This is Keras's ``LossScaleOptimizer.dynamic_counter``: the scale grows
  when it reaches ``dynamic_growth_steps``.

  Args:
    opt_state: anything holding one loss-scale state (see
      :func:`loss_scale`; a stacked state gives one value per member).

  Returns:
    An ``int32`` array, or ``None`` for a static scale.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1))
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.ones(2), state)
    >>> ols.dynamic_counter(state)
    Array(1, dtype=int32)
    >>> static = ols.loss_scale_optimizer(optax.sgd(0.1), dynamic=False,
    ...                                   initial_scale=128)
    >>> print(ols.dynamic_counter(static.init(jnp.zeros(2))))
    None
  """
  return _read(opt_state).counter


def skip_stats(opt_state: Any) -> SkipStats:
  """The step statistics: skipped in total, skipped in a row, last finite.

  The counters saturate at ``2**31 - 1`` instead of wrapping. Read them at
  logging time to alert on a long streak without a host sync per step.

  Args:
    opt_state: anything holding one loss-scale state (see
      :func:`loss_scale`; a stacked state gives one value per member).

  Returns:
    A :class:`SkipStats` of plain arrays.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1))
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.array([1.0, jnp.nan]), state)
    >>> stats = ols.skip_stats(state)
    >>> int(stats.total_skipped), int(stats.skipped_in_a_row)
    (1, 1)
    >>> bool(stats.last_finite)
    False
  """
  state = _read(opt_state)
  return SkipStats(
    total_skipped=state.total_notfinite,
    skipped_in_a_row=state.notfinite_count,
    last_finite=state.last_finite,
  )


def _is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_value(
  value: jax.typing.ArrayLike, old: jax.Array, static: bool
) -> None:
  """Refuses a concrete `value` that is not a usable scale for this state."""
  if jnp.shape(value) not in ((), old.shape):
    raise ValueError(
      "`value` must be a scalar loss scale (or one per member of a stacked"
      f" state, shape {old.shape}), got shape {jnp.shape(value)}."
    )
  if not _is_concrete(value):
    return
  with np.errstate(over="ignore", invalid="ignore"):
    as_f32 = np.asarray(value, dtype=np.float32)
  if not np.all(np.isfinite(as_f32) & (as_f32 > 0)):
    raise ValueError(
      f"`value` must be a finite loss scale > 0 (in float32), got {value!r}."
    )
  if (
    static
    and np.any(as_f32 < 1)
    and _is_concrete(old)
    and bool(jnp.all(old >= 1))
  ):
    raise ValueError(
      f"`value` must be >= 1 for this static loss scale (dynamic=False,"
      f" now {_describe(old)}), got {value!r}: its finiteness check"
      " relies on a scale of at least 1, so every step would be skipped,"
      " and a static scale never changes by itself."
    )


def _describe(old: jax.Array) -> str:
  return f"{float(old)}" if old.shape == () else f"shape {old.shape}"


def set_loss_scale(opt_state: Any, value: jax.typing.ArrayLike) -> Any:
  """Sets the loss scale to `value`, for checkpoint surgery or a restart.

  The counters are left as they are. Choose the value within the
  optimizer's ``[min_scale, max_scale]``: the rule does not clip a value
  set by hand, so below ``min_scale`` the next backoff raises it to
  ``min_scale``, and a value below 1 under a ``min_scale >= 1`` counts as an
  overflow (the step is skipped and backoff brings the scale back to
  ``min_scale``), because the finiteness check there relies on a scale of
  at least 1. A static scale never backs off, so there a value below 1 is
  refused (unless the static scale is below 1 already).

  A concrete value that is refused raises; a traced one (under ``jit``)
  that would be refused (not finite, not > 0, or below 1 for a static
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
    ValueError: for a concrete value that is not finite and > 0, or below 1
      for a static scale of at least 1.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> state = ols.loss_scale_optimizer(optax.sgd(0.1)).init(jnp.zeros(2))
    >>> ols.loss_scale(ols.set_loss_scale(state, 256.0))
    Array(256., dtype=float32)
  """
  node = _find_node(opt_state)
  held = _field(node, "loss_scale")
  old = jnp.asarray(_unwrap(held))
  static = _field(node, "counter") is None
  _check_value(value, old, static)
  new = jnp.broadcast_to(jnp.asarray(value, SCALE_DTYPE), old.shape)
  # What a concrete value was checked for, for a traced one (and for a
  # traced old scale): a refused value keeps the old scale. Without it, a
  # NaN set under jit would stay NaN (`max(NaN, min_scale)` is NaN).
  usable = jnp.isfinite(new) & (new > 0)
  if static:
    usable &= (new >= 1) | (old < 1)
  new = jnp.where(usable, new, old.astype(SCALE_DTYPE))

  if _is_nnx_variable(held):
    if hasattr(held, "set_value"):
      held.set_value(new)
    else:  # flax 0.12.0
      held.value = new
    return opt_state

  def replace(x):
    if isinstance(x, LossScaleState):
      return x._replace(loss_scale=new)
    if _is_loss_scale_node(x):
      return type(x)({**x, "loss_scale": new})
    return x

  return jax.tree.map(replace, opt_state, is_leaf=_is_loss_scale_node)
