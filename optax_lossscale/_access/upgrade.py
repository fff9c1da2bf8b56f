"""Today's state from a checkpoint of an earlier release.

0.1.0's `LossScaleState` had five fields, two of them under other names
(`notfinite_count`, `total_notfinite`); today's has eleven. `upgrade_state`
takes an old state as a restore gives it (0.1.0's own types, from a pickle;
or the plain nested dicts and lists of `flax.serialization.msgpack_restore`
and of an orbax restore without a target) and returns today's.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import optax_lossscale._state as _v010
from optax_lossscale._core.state import (
  COUNTER_DTYPE,
  SCALE_DTYPE,
  LossScaleOptimizerState,
  LossScaleState,
  init_loss_scale_state,
)

# 0.1.0's counters, by today's names.
_RENAMED = {
  "skipped_in_a_row": "notfinite_count",
  "total_skipped": "total_notfinite",
}
_INT32_MAX = 2**31 - 1


def upgrade_state(
  state: Any, like: Any = None, *, steps: int | None = None
) -> Any:
  """Today's optimizer state from one that an earlier release saved.

  Restores a checkpoint of optax_lossscale 0.1.0 (and passes today's state
  through unchanged). ``state`` is what the restore returned:

  - from a pickle: the state itself, of 0.1.0's types (pickles name them at
    ``optax_lossscale._state``, where they still load);
  - from ``flax.serialization.msgpack_restore`` (bytes ``to_bytes`` wrote),
    or from an orbax restore without a target: nested dicts and lists, whose
    structure ``like`` then gives.

  ``like`` is today's state of the same optimizer (``tx.init(params)``, or
  ``jax.eval_shape`` of it): the result takes its structure, dtypes and,
  where its leaves are arrays, placement. It is needed for plain dicts, and
  where the optimizer counts non-finite steps per leaf (``leaf_stats``):
  those counts start at zero.

  The fields 0.1.0 had keep their values: the scale, its counter, the skips
  in a row and in total, whether the last step was applied. Of the new
  ones, ``overflows_in_a_row`` (the count that hysteresis compares) is the
  skips in a row, as 0.1.0 counted them for hysteresis; ``nan_steps`` and
  ``nonfinite_loss_steps`` (which 0.1.0 did not tell apart) start at zero,
  and ``recent_skips`` empty. ``steps`` (the steps seen, which 0.1.0 did not
  count) is the given number, else the inner state's step count (optax's
  ``count`` fields, which skipped steps leave) plus the skipped steps, else,
  where the inner state keeps no count, the skipped steps alone.

  Args:
    state: the restored optimizer state (or a tree holding it, such as a
      dict of params and optimizer state).
    like: today's state of the same optimizer, or of the same tree; needed
      for plain dicts.
    steps: the steps the old state has seen, where known.

  Returns:
    Today's state: with ``like``, of its structure.

  Raises:
    TypeError: for a plain dict without ``like``.
    ValueError: where ``state`` holds no loss-scale state, or a part that
      ``like`` has is missing from it (the error names the path).

  Examples:

    >>> import optax, jax.numpy as jnp, optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.adam(1e-3))
    >>> params = {'w': jnp.zeros(3)}
    >>> restored = {  # as msgpack_restore returns a 0.1.0 state
    ...   'loss_scale_state': {
    ...     'loss_scale': 1024.0, 'counter': 5, 'notfinite_count': 0,
    ...     'total_notfinite': 2, 'last_finite': True},
    ...   'inner_state': {
    ...     '0': {'count': 40, 'mu': {'w': jnp.zeros(3)},
    ...           'nu': {'w': jnp.zeros(3)}},
    ...     '1': {}}}
    >>> state = ols.upgrade_state(restored, like=tx.init(params))
    >>> float(ols.loss_scale(state)), int(ols.dynamic_counter(state))
    (1024.0, 5)
    >>> int(ols.skip_stats(state).total_skipped), int(
    ...   state.loss_scale_state.steps)
    (2, 42)
  """
  if steps is not None and not (
    isinstance(steps, int) and 0 <= steps <= _INT32_MAX
  ):
    raise ValueError(
      f"`steps` must be None or an int in [0, 2**31 - 1], got {steps!r}."
    )
  if like is None:
    return _upgrade_typed(state, steps)
  return _fill(state, like, steps)


def _is_old_node(x: Any) -> bool:
  """Whether `x` is a loss-scale state of 0.1.0, typed or as a dict."""
  if isinstance(x, _v010.LossScaleState):
    return True
  return isinstance(x, Mapping) and set(x) == set(_v010.LossScaleState._fields)


def _upgrade_typed(state: Any, steps: int | None) -> Any:
  """`state` with each of 0.1.0's typed states replaced by today's."""

  def is_leaf(x: Any) -> bool:
    return isinstance(x, _v010.LossScaleOptimizerState) or _is_old_node(x)

  found: list[Any] = []

  def upgrade(x: Any) -> Any:
    if isinstance(x, _v010.LossScaleOptimizerState):
      found.append(x)
      return LossScaleOptimizerState(
        _upgraded(x.loss_scale_state, None, _steps(state, x, steps)),
        x.inner_state,
      )
    if isinstance(x, _v010.LossScaleState):
      found.append(x)
      return _upgraded(x, None, _steps(state, x, steps))
    if _is_old_node(x):
      raise TypeError(
        "`like` must be given for a state restored as plain dicts (by"
        " `flax.serialization.msgpack_restore`, or an orbax restore without"
        " a target): today's state of the same optimizer, such as"
        " `tx.init(params)`, got None."
      )
    return x

  upgraded = jax.tree.map(upgrade, state, is_leaf=is_leaf)
  if not found and not _holds_today(state):
    raise ValueError(
      "`state` holds no loss-scale state of optax_lossscale, got"
      f" {type(state).__name__}. Pass the restored optimizer state (or a"
      " tree that holds it)."
    )
  return upgraded


def _holds_today(x: Any) -> bool:
  leaves = jax.tree.leaves(x, is_leaf=lambda y: isinstance(y, LossScaleState))
  return any(isinstance(leaf, LossScaleState) for leaf in leaves)


def _field(node: Any, name: str) -> Any:
  if isinstance(node, Mapping):
    return node[name]
  return getattr(node, name)


def _upgraded(
  old: Any, like: LossScaleState | None, steps: int
) -> LossScaleState:
  """Today's `LossScaleState` from 0.1.0's `old` (typed or a dict)."""
  counter = _field(old, "counter")
  leaf_notfinite = None if like is None else like.leaf_notfinite
  if leaf_notfinite is not None:  # counted from zero
    leaf_notfinite = leaf_notfinite._replace(
      counts=jnp.zeros_like(leaf_notfinite.counts)
    )
  fresh = init_loss_scale_state(
    1.0, dynamic=counter is not None, leaf_notfinite=leaf_notfinite
  )
  in_a_row = jnp.asarray(
    _field(old, _RENAMED["skipped_in_a_row"]), COUNTER_DTYPE
  )
  return fresh._replace(
    loss_scale=jnp.asarray(_field(old, "loss_scale"), SCALE_DTYPE),
    counter=None if counter is None else jnp.asarray(counter, COUNTER_DTYPE),
    skipped_in_a_row=in_a_row,
    total_skipped=jnp.asarray(
      _field(old, _RENAMED["total_skipped"]), COUNTER_DTYPE
    ),
    last_finite=jnp.asarray(_field(old, "last_finite"), jnp.bool_),
    # 0.1.0's hysteresis counted every skip in a row, and each was an
    # overflow of the gradients (it checked nothing else).
    overflows_in_a_row=in_a_row,
    steps=jnp.asarray(steps, COUNTER_DTYPE),
  )


def _steps(whole: Any, old: Any, given: int | None) -> int:
  """The steps the typed 0.1.0 state `old` (in `whole`) has seen."""
  if given is not None:
    return given
  if isinstance(old, _v010.LossScaleOptimizerState):
    old = old.loss_scale_state
  counts = [
    leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(whole)[0]
    if _is_count(path)
  ]
  return _steps_from(counts, int(_field(old, "total_notfinite")))


def _is_count(path: Sequence[Any]) -> bool:
  """Whether `path` ends in a field `count` (optax's step counts)."""
  return (
    len(path) > 0
    and isinstance(path[-1], jax.tree_util.GetAttrKey)
    and path[-1].name == "count"
  )


def _steps_from(counts: list[Any], skipped: int) -> int:
  """The inner state's applied steps (its counts, where they agree) plus
  the skipped ones; the skipped ones alone where no count tells."""
  applied = {int(c) for c in counts if c is not None and jnp.ndim(c) == 0}
  if len(applied) != 1:
    return skipped
  return min(applied.pop() + skipped, _INT32_MAX)


def _fill(state: Any, like: Any, steps: int | None) -> Any:
  """`like`'s structure, with the values `state` holds at each path (0.1.0's
  loss-scale states upgraded)."""

  def is_today(x: Any) -> bool:
    return isinstance(x, LossScaleState)

  flat, structure = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_today)
  if not any(is_today(leaf) for _, leaf in flat):
    raise ValueError(
      "`like` must be today's state of the optimizer that saved `state`"
      " (such as `tx.init(params)`): it holds no LossScaleState, got"
      f" {type(like).__name__}."
    )
  counts = [_at(state, path) for path, leaf in flat if _is_count(path)]
  filled = []
  for path, leaf in flat:
    value = _at(state, path)
    if is_today(leaf) and _is_old_node(value):
      given = steps
      if given is None:
        given = _steps_from(counts, int(_field(value, "total_notfinite")))
      value = _upgraded(value, leaf, given)
    filled.append(_like(value, leaf, path))
  return jax.tree_util.tree_unflatten(structure, filled)


def _at(node: Any, path: Sequence[Any]) -> Any:
  """The value at `path` in `node`: by field, index or key, as typed trees,
  flax's state dicts (indices as strings) and orbax's (lists) hold it."""
  for i, key in enumerate(path):
    try:
      node = _child(node, key)
    except (KeyError, IndexError, AttributeError, TypeError):
      node = None
    if node is None:
      raise ValueError(
        "The restored state has nothing at"
        f" {jax.tree_util.keystr(tuple(path[: i + 1]))}, where `like` has"
        " a value: `like` must be today's state of the optimizer (and the"
        " tree) that saved it."
      ) from None
  return node


def _child(node: Any, key: Any) -> Any:
  if isinstance(key, jax.tree_util.GetAttrKey):
    if isinstance(node, Mapping):
      return node[key.name]
    return getattr(node, key.name)
  if isinstance(key, jax.tree_util.DictKey):
    return node[key.key]
  index = key.idx if isinstance(key, jax.tree_util.SequenceKey) else key.key
  return node[str(index)] if isinstance(node, Mapping) else node[index]


def _like(value: Any, like: Any, path: Sequence[Any]) -> Any:
  """`value` as `like` is (its leaves' dtypes, shapes and placement)."""
  if isinstance(like, LossScaleState):
    sub, structure = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(
      structure,
      [_like(_at(value, p), leaf, (*path, *p)) for p, leaf in sub],
    )
  dtype = getattr(like, "dtype", None) or jnp.result_type(like)
  shape = tuple(getattr(like, "shape", jnp.shape(like)))
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return value  # typed PRNG keys restore as they were saved
  if jnp.shape(value) != shape:
    raise ValueError(
      f"The restored state's {jax.tree_util.keystr(tuple(path))} has shape"
      f" {jnp.shape(value)}, where `like` has {shape}."
    )
  array = jnp.asarray(value, dtype)
  sharding = getattr(like, "sharding", None)
  if isinstance(sharding, jax.sharding.Sharding):
    array = jax.device_put(array, sharding)
  return array
