"""Finding the loss-scale state anywhere in an optimizer state, and reading
or replacing it: `scale_loss`, `loss_scale`, `dynamic_counter`,
`skip_stats`, `set_loss_scale`."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._state import SCALE_DTYPE, LossScaleState, SkipStats
from optax_lossscale._unscale import check_scalar_state


def _is_loss_scale_state(x) -> bool:
  return isinstance(x, LossScaleState)


def find_loss_scale_state(opt_state) -> LossScaleState:
  """The one :class:`LossScaleState` inside `opt_state`, wherever it sits."""
  found = [
      (path, leaf)
      for path, leaf in jax.tree_util.tree_flatten_with_path(
          opt_state, is_leaf=_is_loss_scale_state)[0]
      if _is_loss_scale_state(leaf)
  ]
  if not found:
    raise ValueError(
        "No loss-scale state found in the given optimizer state (of type"
        f" {type(opt_state).__name__}). Pass the state of an optimizer built"
        " with `loss_scale_optimizer` or `unscale_and_check` (the whole"
        " state, or a `TrainState`), not the parameters or a plain optax"
        " state."
    )
  if len(found) > 1:
    paths = ", ".join(jax.tree_util.keystr(path) for path, _ in found)
    raise ValueError(
        f"Found {len(found)} loss-scale states in the optimizer state, at"
        f" {paths}; a loss-scaled optimizer must not wrap another. Keep one"
        " loss scaler."
    )
  state = found[0][1]
  check_scalar_state(state)
  return state


def scale_loss(loss, opt_state) -> jax.Array:
  """Multiplies the loss by the current scale, in the loss's dtype.

  Call it inside the function you differentiate, on the optimizer state of
  the same step, so that the gradients are scaled by the scale that
  ``update`` will divide by.

  Args:
    loss: a floating-point scalar (or array).
    opt_state: the optimizer state, or any pytree holding exactly one
      loss-scale state (a ``TrainState``, a ``chain`` state, ...).

  Returns:
    ``loss * scale``, computed in float32 or better and cast to the loss's
    dtype.

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state, or several.
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
  loss = jnp.asarray(loss)
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(
        f"`loss` must be floating point to be scaled, got dtype {loss.dtype}."
    )
  scale = find_loss_scale_state(opt_state).loss_scale
  compute_dtype = jnp.promote_types(loss.dtype, SCALE_DTYPE)
  return (loss.astype(compute_dtype) * scale.astype(compute_dtype)).astype(
      loss.dtype
  )


def loss_scale(opt_state) -> jax.Array:
  """The current loss scale, a ``float32`` scalar.

  Args:
    opt_state: an optimizer state holding one loss-scale state.

  Returns:
    The scale.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.adam(1e-3), initial_scale=1024)
    >>> ols.loss_scale(tx.init(jnp.zeros(3)))
    Array(1024., dtype=float32)
  """
  return find_loss_scale_state(opt_state).loss_scale


def dynamic_counter(opt_state) -> jax.Array | None:
  """Consecutive finite steps since the scale last changed; None if static.

  This is Keras's ``LossScaleOptimizer.dynamic_counter``: the scale grows
  when it reaches ``dynamic_growth_steps``.

  Args:
    opt_state: an optimizer state holding one loss-scale state.

  Returns:
    An ``int32`` scalar, or ``None`` for a static scale.

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
  return find_loss_scale_state(opt_state).counter


def skip_stats(opt_state) -> SkipStats:
  """The step statistics: skipped in total, skipped in a row, last finite.

  The counters saturate at ``2**31 - 1`` instead of wrapping. Read them at
  logging time to alert on a long streak without a host sync per step.

  Args:
    opt_state: an optimizer state holding one loss-scale state.

  Returns:
    A :class:`SkipStats`.

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
  state = find_loss_scale_state(opt_state)
  return SkipStats(
      total_skipped=state.total_notfinite,
      skipped_in_a_row=state.notfinite_count,
      last_finite=state.last_finite,
  )


def set_loss_scale(opt_state, value):
  """Returns `opt_state` with its loss scale replaced by `value`.

  For checkpoint surgery: restart a run at a chosen scale. The counters are
  left as they are. A concrete value is checked (a finite scalar > 0); a
  traced one is taken as given. Choose it within the optimizer's
  ``[min_scale, max_scale]``: the rule does not clip a value set by hand, so
  below ``min_scale`` the next backoff raises it to ``min_scale``, and a
  value below 1 under a ``min_scale >= 1`` counts as an overflow (the step
  is skipped and backoff brings the scale back to ``min_scale``), because
  the finiteness check there relies on a scale of at least 1.

  Args:
    opt_state: an optimizer state holding one loss-scale state.
    value: the new scale.

  Returns:
    A state of the same structure and dtypes.

  Raises:
    ValueError: for a concrete value that is not finite and > 0.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> state = ols.loss_scale_optimizer(optax.sgd(0.1)).init(jnp.zeros(2))
    >>> ols.loss_scale(ols.set_loss_scale(state, 256.0))
    Array(256., dtype=float32)
  """
  find_loss_scale_state(opt_state)  # exactly one, scalar
  if jnp.shape(value) != ():
    raise ValueError(
        f"`value` must be a scalar loss scale, got shape {jnp.shape(value)}."
    )
  if not isinstance(value, jax.core.Tracer):
    with np.errstate(over="ignore", invalid="ignore"):
      as_f32 = float(np.float32(np.asarray(value)))
    if not (math.isfinite(as_f32) and as_f32 > 0):
      raise ValueError(
          f"`value` must be a finite loss scale > 0 (in float32), got {value!r}."
      )
  new_scale = jnp.asarray(value, SCALE_DTYPE)

  def replace(x):
    if _is_loss_scale_state(x):
      return x._replace(loss_scale=new_scale)
    return x

  return jax.tree.map(replace, opt_state, is_leaf=_is_loss_scale_state)
