"""Finding the one loss-scale state anywhere in an optimizer state.

The state is found in optax states, a flax `TrainState`, an
`nnx.Optimizer` (its fields are NNX Variables), its `opt_state`, and the
mappings `nnx.state(...)`/`nnx.split(...)` make of it (a `LossScaleState`
becomes a mapping of its field names there).
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from optax_lossscale._access import nnx as _nnx
from optax_lossscale._core.state import (
  CountedSince,
  LeafCounts,
  LossScaleState,
  RecordedConfig,
  SkipEvents,
  check_scalar_state,
  is_placeholder,
)

_FIELDS = frozenset(LossScaleState._fields)
# `nnx.state` drops a None field: a static state has no `counter` there, and
# one without leaf statistics no `leaf_notfinite`. A state of 0.2.0 (plain
# dicts of one, restored without a target) lacks the fields added since.
_ADDED_SINCE_0_2_0 = frozenset({"config", "counted_since", "nan_steps_exact"})
_REQUIRED_FIELDS = _FIELDS - {"counter", "leaf_notfinite"} - _ADDED_SINCE_0_2_0

ACCEPTED = (
  "the state of an optimizer built with `loss_scale_optimizer` or"
  " `unscale_and_check` (the whole optax state, a flax `TrainState`, an"
  " `nnx.Optimizer`, its `opt_state`, or `nnx.state`/`nnx.split` output of"
  " it)"
)

# A `LossScaleState`, or the mapping `nnx.state` makes of one.
Node = LossScaleState | Mapping[str, Any]


def is_node(x: Any) -> bool:
  """Whether `x` is a `LossScaleState`, or the mapping `nnx.state` makes of
  one."""
  if isinstance(x, LossScaleState):
    return True
  if isinstance(x, Mapping):
    try:
      keys = set(x.keys())
    except TypeError:
      return False
    return _REQUIRED_FIELDS <= keys <= _FIELDS
  return False


def field(node: Node, name: str) -> Any:
  """Field `name` of a node, as it is held (an NNX Variable, say)."""
  if isinstance(node, LossScaleState):
    return getattr(node, name)
  return node.get(name)


def _holds_an_old_release_state(opt_state: Any) -> bool:
  # The types `optax_lossscale._state` keeps for 0.1.0's pickles, told by
  # their module so that this floor does not import them.
  leaves = jax.tree_util.tree_leaves(
    opt_state, is_leaf=lambda x: _is_old_release_state(x)
  )
  return any(_is_old_release_state(x) for x in leaves)


def _is_old_release_state(x: Any) -> bool:
  return type(x).__module__ == "optax_lossscale._state"


def find_node(opt_state: Any) -> Node:
  """The one loss-scale node in `opt_state`."""
  found = [
    (path, leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(
      opt_state, is_leaf=is_node
    )[0]
    if is_node(leaf)
  ]
  if not found and _holds_an_old_release_state(opt_state):
    raise ValueError(
      "The optimizer state holds the loss-scale state of an earlier"
      " release (optax_lossscale 0.1.0, from a pickle, say): pass it"
      " through `optax_lossscale.upgrade_state` first, which returns"
      " today's state with the new fields filled."
    )
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


def read(opt_state: Any) -> LossScaleState:
  """The loss-scale state as plain arrays, possibly stacked (any shape)."""
  return typed(find_node(opt_state))


def typed(node: Node) -> LossScaleState:
  """A node as a `LossScaleState` of arrays, its parts typed (a mapping of
  fields, from `nnx.state` or a restore without a target, included);
  fields a node lacks (a state of 0.2.0) are None."""
  state = LossScaleState._make(
    _as_arrays(field(node, name)) for name in LossScaleState._fields
  )
  parts = {
    "recent_skips": SkipEvents,
    "leaf_notfinite": LeafCounts,
    "config": RecordedConfig,
    "counted_since": CountedSince,
  }
  state = state._replace(
    **{
      name: kind(**getattr(state, name))
      for name, kind in parts.items()
      if isinstance(getattr(state, name), Mapping)
    }
  )
  if state.leaf_notfinite is not None:
    state = state._replace(
      leaf_notfinite=with_placeholders(state.leaf_notfinite)
    )
  return state


def with_placeholders(counts: LeafCounts) -> LeafCounts:
  """`counts` with each leaf's placeholder `()`, where a restore without a
  target gave `{}` for it (`flax.serialization.msgpack_restore`): an empty
  mapping stands for a leaf when, and only when, the count of empty
  mappings is the count of leaves (an empty subtree of the params also
  restores as `{}`; where both are there, the names are not restored)."""
  structure = counts.structure
  n = jnp.shape(counts.counts)[-1]
  if len(jax.tree.leaves(structure, is_leaf=is_placeholder)) == n:
    return counts
  empty = jax.tree.leaves(structure, is_leaf=_is_empty_mapping)
  if sum(_is_empty_mapping(x) for x in empty) != n:
    return counts  # `leaf_counts_tree` says what does not fit
  return counts._replace(
    structure=jax.tree.map(
      lambda x: () if _is_empty_mapping(x) else x,
      structure,
      is_leaf=_is_empty_mapping,
    )
  )


def _is_empty_mapping(x: Any) -> bool:
  return isinstance(x, Mapping) and not x


def _as_arrays(value: Any) -> Any:
  """A field's value as plain arrays (a tree for the per-leaf counts), NNX
  Variables unwrapped; the placeholders of `LeafCounts.structure` kept."""

  def as_array(x: Any) -> Any:
    x = _nnx.unwrap(x)
    return x if is_placeholder(x) else jnp.asarray(x)

  return jax.tree.map(
    as_array, value, is_leaf=lambda x: _nnx.is_variable(x) or is_placeholder(x)
  )


def find_loss_scale_state(opt_state: Any) -> LossScaleState:
  """The one scalar :class:`LossScaleState` inside `opt_state`, as arrays."""
  state = read(opt_state)
  check_scalar_state(state)
  return state


def replace_node(opt_state: Any, **fields: Any) -> Any:
  """`opt_state` with the loss-scale node's `fields` replaced; a new state."""

  def replace(x: Any) -> Any:
    if isinstance(x, LossScaleState):
      return x._replace(**fields)
    if is_node(x):
      return type(x)({**x, **fields})
    return x

  return jax.tree.map(replace, opt_state, is_leaf=is_node)
