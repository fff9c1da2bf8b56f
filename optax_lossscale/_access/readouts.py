"""Read-outs of the loss-scale state, wherever it sits in an optimizer state:
`loss_scale`, `dynamic_counter`, `skip_stats`."""

from typing import Any

import jax

from optax_lossscale._access import locate as _locate
from optax_lossscale._core.state import SkipStats, leaf_counts_tree


def loss_scale(opt_state: Any) -> jax.Array:
  """The current loss scale, a ``float32`` array.

  Args:
    opt_state: anything holding one loss-scale state (see
      :func:`scale_loss`). A stacked state (made under ``jax.vmap`` for an
      ensemble, or replicated for ``jax.pmap``) gives one scale per member.

  Returns:
    The scale as a ``float32`` array, a scalar or one per member of a
    stacked state.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.adam(1e-3), initial_scale=1024)
    >>> ols.loss_scale(tx.init(jnp.zeros(3)))
    Array(1024., dtype=float32)
    >>> ols.loss_scale(jax.vmap(tx.init)(jnp.zeros((2, 3))))  # an ensemble
    Array([1024., 1024.], dtype=float32)
  """
  return _locate.read(opt_state).loss_scale


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
  return _locate.read(opt_state).counter


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
  state = _locate.read(opt_state)
  return SkipStats(
    total_skipped=state.total_skipped,
    skipped_in_a_row=state.skipped_in_a_row,
    last_finite=state.last_finite,
    nan_steps=state.nan_steps,
    nonfinite_loss_steps=state.nonfinite_loss_steps,
  )


def nonfinite_leaves(opt_state: Any) -> Any:
  """For each gradient leaf, the steps on which it was not finite.

  Needs ``leaf_stats=True`` on :func:`loss_scale_optimizer` (or
  :func:`unscale_and_check`). Gradients flow backward, so an overflow in one
  layer reaches every parameter before it in the forward pass: the
  parameters that never overflow (count 0) sit after where it starts.

  Args:
    opt_state: anything holding one loss-scale state (see
      :func:`loss_scale`; a stacked state gives one count per member).

  Returns:
    A tree shaped like the gradients, of ``int32`` counts (saturating).

  Raises:
    ValueError: when the optimizer was built without ``leaf_stats=True``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> params = {'w': jnp.ones(2), 'b': jnp.ones(1)}
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), leaf_stats=True)
    >>> state = tx.init(params)
    >>> grads = {'w': jnp.array([1.0, jnp.inf]), 'b': jnp.ones(1)}
    >>> _, state = tx.update(grads, state, params)
    >>> ols.nonfinite_leaves(state)
    {'b': Array(0, dtype=int32), 'w': Array(1, dtype=int32)}
  """
  counts = _locate.read(opt_state).leaf_notfinite
  if counts is None:
    raise ValueError(
      "This optimizer keeps no per-leaf statistics: build it with"
      " `leaf_stats=True` (`loss_scale_optimizer(..., leaf_stats=True)` or"
      " `unscale_and_check(..., leaf_stats=True)`) to count, per gradient"
      " leaf, the steps on which it was not finite."
    )
  return leaf_counts_tree(counts)
