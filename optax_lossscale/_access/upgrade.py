"""Today's state from a checkpoint of an earlier release (0.1.0, 0.2.0):
`upgrade_state` takes an old state as a restore gives it (its own types,
from a pickle; or the plain nested dicts and lists of
`flax.serialization.msgpack_restore` and of an orbax restore without a
target) and returns today's (`releases` converts each loss-scale state).
"""

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import optax_lossscale._state as _v010
from optax_lossscale._access import releases as _releases
from optax_lossscale._core.state import (
  LossScaleOptimizerState,
  LossScaleState,
)


def upgrade_state(
  state: Any, like: Any = None, *, steps: int | None = None
) -> Any:
  """Today's optimizer state from one that an earlier release saved.

  Restores a checkpoint of optax_lossscale 0.1.0 or 0.2.0 (and passes
  today's state through unchanged). ``state`` is what the restore
  returned:

  - from a pickle: the state itself, of the release's own types (0.1.0's
    load from ``optax_lossscale._state``; 0.2.0's are today's types, whose
    fields added since load as None);
  - from ``flax.serialization.msgpack_restore`` (bytes ``to_bytes`` wrote),
    or from an orbax restore without a target: nested dicts and lists, whose
    structure ``like`` then gives.

  ``like`` is today's state of the same optimizer (``tx.init(params)``, or
  ``jax.eval_shape`` of it): the result takes its structure, dtypes and,
  where its leaves are arrays, placement. It is needed for the plain dicts
  of a 0.1.0 state, and where the optimizer counts non-finite steps per
  leaf (``leaf_stats``) while 0.1.0 did not: those counts start at zero.
  Without it, the plain dicts of a 0.2.0 state or of today's become
  today's loss-scale state (which the read-outs and :func:`skip_report`
  read), the rest of the tree as it was restored.

  What the old state recorded keeps its value; what it did not, today's
  state says it does not know, and :func:`skip_report` says less:

  - 0.1.0: the scale, its counter, the skips in a row and in total, and
    whether the last step was applied carry over; ``overflows_in_a_row``
    (hysteresis's count) is the skips in a row, as 0.1.0 counted them. NaN
    steps, non-finite losses, per-leaf counts and recent skips count from
    the upgrade on (``counted_since``). ``steps`` (which 0.1.0 did not
    count) is the given number, else the inner state's step count (optax's
    ``count`` fields, which skipped steps leave) plus the skipped steps;
    where neither tells, it must be given.
  - 0.2.0: every field carries over; the skips it kept are marked as
    recorded by 0.2.0 (``recorded`` False: no floor or hysteresis claimed),
    and ``nan_steps`` counts as exact only where every skip had a NaN (0.2.0
    did not record where its checks ran).
  - Both: the configuration (``config``) is unknown until the next
    ``update`` records it.

  Args:
    state: the restored optimizer state (or a tree holding it, such as a
      dict of params and optimizer state).
    like: today's state of the same optimizer, or of the same tree; needed
      for the plain dicts of a 0.1.0 state.
    steps: the steps a 0.1.0 state has seen (at least its skipped steps),
      where its inner state keeps no count; None for a later release's.

  Returns:
    Today's state: with ``like``, of its structure.

  Raises:
    TypeError: for the plain dicts of a 0.1.0 state without ``like``.
    ValueError: where ``state`` holds no loss-scale state; where it holds a
      part that ``like`` lacks (it would be dropped), or lacks one that
      ``like`` has, or a loss-scale state of another kind (static against
      dynamic, per-leaf counts against none) (the error names the path);
      for a ``steps`` that is not an int, is below the skipped steps, or is
      given for a state that counts its own; where a 0.1.0 state's steps
      cannot be told and ``steps`` is not given.

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
  _check_steps(steps)
  if like is None:
    return _upgrade_alone(state, steps)
  return _fill(state, like, steps)


def _check_steps(steps: Any) -> None:
  if steps is not None and not (
    isinstance(steps, int)
    and not isinstance(steps, bool)
    and 0 <= steps <= _releases.INT32_MAX
  ):
    raise ValueError(
      "`steps` must be None or an int in [0, 2**31 - 1] (the steps the old"
      f" run had seen), got {steps!r}."
    )


def _upgrade_alone(state: Any, steps: int | None) -> Any:
  """`state` with each loss-scale state of an earlier release (and of
  today's, restored as dicts) made today's, typed."""

  def is_leaf(x: Any) -> bool:
    return (
      isinstance(x, _v010.LossScaleOptimizerState)
      or _releases.release_of(x) is not None
    )

  found: list[Any] = []

  def upgrade(x: Any) -> Any:
    if isinstance(x, _v010.LossScaleOptimizerState):
      found.append(x)
      old = x.loss_scale_state
      return LossScaleOptimizerState(
        _releases.from_v010(old, None, _v010_steps(state, old, steps)),
        x.inner_state,
      )
    release = _releases.release_of(x)
    if release is None:
      return x
    found.append(x)
    if release == "0.1.0":
      if isinstance(x, Mapping):
        raise TypeError(
          "`like` must be given for a state of 0.1.0 restored as plain dicts"
          " (by `flax.serialization.msgpack_restore`, or an orbax restore"
          " without a target): today's state of the same optimizer, such as"
          " `tx.init(params)`, got None."
        )
      return _releases.from_v010(x, None, _v010_steps(state, x, steps))
    _refuse_steps_for(release, steps)
    if release == "0.2.0":
      return _releases.from_v020(x)
    return _releases.today(x)

  upgraded = jax.tree.map(upgrade, state, is_leaf=is_leaf)
  if not found:
    raise ValueError(
      "`state` holds no loss-scale state of optax_lossscale, got"
      f" {type(state).__name__}. Pass the restored optimizer state (or a"
      " tree that holds it)."
    )
  return upgraded


def _refuse_steps_for(release: str, steps: int | None) -> None:
  if steps is not None:
    raise ValueError(
      f"`steps` must be None for a state of {release}, which counts its own"
      f" steps; got {steps!r}. `steps` is for a state of 0.1.0."
    )


def _v010_steps(whole: Any, old: Any, given: int | None) -> int:
  """The steps the 0.1.0 state `old` (in `whole`) has seen."""
  counts = [
    leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(whole)[0]
    if _is_count(path)
  ]
  return _steps_from(counts, _releases.skipped_of_v010(old), given)


def _is_count(path: Sequence[Any]) -> bool:
  """Whether `path` ends in a field `count` (optax's step counts)."""
  return len(path) > 0 and _key(path[-1]) == "count"


def _steps_from(counts: list[Any], skipped: int, given: int | None) -> int:
  """The steps a 0.1.0 state has seen: `given`, else the inner state's
  applied steps (its counts, where they agree) plus the skipped ones.
  Where neither tells, `steps` must be given: no default is filled in."""
  if given is not None:
    if given < skipped:
      raise ValueError(
        f"`steps` must be at least the steps the old state skipped"
        f" ({skipped}), got {given}."
      )
    return given
  applied = {int(c) for c in counts if c is not None and jnp.ndim(c) == 0}
  if len(applied) != 1:
    found = (
      f"step counts that disagree ({sorted(applied)})"
      if applied
      else "no step count (optax's `count`)"
    )
    raise ValueError(
      "`steps` must be given for this state of 0.1.0 (the steps its run had"
      " seen, as the training loop counts them): 0.1.0 did not count them,"
      f" and the inner state holds {found} to tell."
    )
  return min(applied.pop() + skipped, _releases.INT32_MAX)


def _fill(state: Any, like: Any, steps: int | None) -> Any:
  """`like`'s structure, with the values `state` holds at each path (each
  loss-scale state made today's); refused where `state` holds what `like`
  has no place for, or a loss-scale state `like` contradicts."""

  def is_today(x: Any) -> bool:
    return isinstance(x, LossScaleState)

  flat, structure = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_today)
  if not any(is_today(leaf) for _, leaf in flat):
    raise ValueError(
      "`like` must be today's state of the optimizer that saved `state`"
      " (such as `tx.init(params)`): it holds no LossScaleState, got"
      f" {type(like).__name__}."
    )
  values = [_at(state, path) for path, _ in flat]  # nothing missing
  _refuse_leftovers(state, flat)  # nothing left over
  pairs = zip(flat, values, strict=True)
  counts = [v for (path, _), v in pairs if _is_count(path)]
  filled = []
  for (path, leaf), value in zip(flat, values, strict=True):
    if is_today(leaf):
      value = _node_like(value, leaf, path, counts, steps)
    filled.append(_like(value, leaf, path))
  return jax.tree_util.tree_unflatten(structure, filled)


def _node_like(
  value: Any,
  like: LossScaleState,
  path: Sequence[Any],
  counts: list[Any],
  steps: int | None,
) -> LossScaleState:
  """The restored loss-scale state at `path`, today's, as `like` has it."""
  release = _releases.release_of(value)
  where = jax.tree_util.keystr(tuple(path))
  if release is None:
    raise ValueError(
      f"The restored state has no loss-scale state at {where}, where `like`"
      " has one: `like` must be today's state of the optimizer that saved"
      " it."
    )
  if release == "0.1.0":
    skipped = _releases.skipped_of_v010(value)
    node = _releases.from_v010(
      value, like.leaf_notfinite, _steps_from(counts, skipped, steps)
    )
  else:
    _refuse_steps_for(release, steps)
    node = (
      _releases.from_v020(value)
      if release == "0.2.0"
      else _releases.today(value)
    )
    if (node.leaf_notfinite is None) != (like.leaf_notfinite is None):
      counted = node.leaf_notfinite is not None
      raise ValueError(
        f"The restored loss-scale state at {where}"
        f" {'holds' if counted else 'holds no'} per-leaf counts, and"
        f" `like`'s {'does not' if counted else 'does'}: `like` must be"
        " today's state of the optimizer that saved it (the same"
        " `leaf_stats`)."
      )
  if (node.counter is None) != (like.counter is None):
    made = (
      "static (no `counter`)"
      if node.counter is None
      else "dynamic (it has a `counter`)"
    )
    given = "dynamic" if node.counter is None else "static"
    raise ValueError(
      f"The restored loss-scale state at {where} is {made}, and `like`'s is"
      f" {given}: `like` must be today's state of the optimizer that saved"
      " it (the same `dynamic`)."
    )
  return node


def _refuse_leftovers(state: Any, like_flat: list[Any]) -> None:
  """Refuses a restored state that holds values `like` has no place for
  (an adam state under an sgd `like`): they would be dropped silently."""
  wanted = {tuple(_key(k) for k in path) for path, _ in like_flat}

  restored = jax.tree_util.tree_flatten_with_path(
    state, is_leaf=lambda x: _releases.release_of(x) is not None
  )[0]
  extra = [
    jax.tree_util.keystr(tuple(path))
    for path, _ in restored
    if tuple(_key(k) for k in path) not in wanted
  ]
  if extra:
    shown = ", ".join(extra[:4]) + (
      f" and {len(extra) - 4} more" if len(extra) > 4 else ""
    )
    raise ValueError(
      f"The restored state holds {shown}, where `like` has nothing: `like`"
      " must be today's state of the optimizer (and the tree) that saved"
      " it, or these would be dropped."
    )


def _key(key: Any) -> str:
  """A path entry as a name, the same for a field, a dict key and an
  index (flax and orbax restore a tuple as a dict or a list)."""
  for attribute in ("name", "key", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


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
