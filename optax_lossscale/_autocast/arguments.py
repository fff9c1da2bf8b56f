"""A call's arguments and results under autocast: which leaves are traced,
which pass as they are, and the Flax NNX modules whose state the call may
change.

Array leaves (jax and NumPy arrays, tracers of an outer trace, PRNG keys)
are traced; every other leaf (an Equinox module's functions and strings, a
Python number, a flag) passes into `fun` as it is, as `equinox.filter_jit`
does, and is part of the trace. An NNX module is a mutable graph: it is
split into its graph and its state, `fun` runs on a module merged from the
traced state, and the state it leaves (BatchNorm's statistics, the RNG
counts) is written back into the caller's module with `nnx.update`. Flax is
never imported here: a module can exist only once `flax.nnx` is loaded.
"""

import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def _loaded_nnx() -> Any:
  return sys.modules.get("flax.nnx")


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


class _Leaves:
  """A list of leaves, the arrays among them traced and the rest kept."""

  def __init__(self, leaves: list[Any]):
    self.leaves = leaves
    self.slots = [i for i, x in enumerate(leaves) if is_array(x)]

  @property
  def arrays(self) -> list[Any]:
    return [self.leaves[i] for i in self.slots]

  def with_arrays(self, arrays: list[Any]) -> list[Any]:
    leaves = list(self.leaves)
    for i, x in zip(self.slots, arrays, strict=True):
      leaves[i] = x
    return leaves


class Arguments:
  """`(args, kwargs)` of one call, split into traced arrays and the rest."""

  def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]):
    # `flax.nnx`, where loaded (typed Any: flax may not be installed).
    self._nnx: Any = _loaded_nnx()
    is_node = self._is_node if self._nnx is not None else None
    leaves, self._def = jax.tree.flatten((args, kwargs), is_leaf=is_node)
    self._node_slots = [i for i, x in enumerate(leaves) if self._is_node(x)]
    self._nodes = [leaves[i] for i in self._node_slots]
    self._leaves = _Leaves(leaves)
    self._state = _Leaves([])
    if self._nodes:
      self._graph, state = self._nnx.split(self._nodes)
      state_leaves, self._state_def = jax.tree.flatten(state)
      self._state = _Leaves(state_leaves)

  def _is_node(self, x: Any) -> bool:
    nnx = self._nnx
    return nnx is not None and bool(nnx.graph.is_graph_node(x))

  @property
  def arrays(self) -> list[Any]:
    """The traced leaves: the arrays of the arguments, then those of the
    NNX modules' state."""
    return self._leaves.arrays + self._state.arrays

  def rebuild(self, arrays: list[Any]) -> tuple[Any, list[Any]]:
    """`(args, kwargs)` with `arrays` in the traced leaves' places, and the
    NNX modules in them (merged anew from their traced state)."""
    n = len(self._leaves.slots)
    leaves = self._leaves.with_arrays(arrays[:n])
    nodes: list[Any] = []
    if self._nodes:
      state = jax.tree.unflatten(
        self._state_def, self._state.with_arrays(arrays[n:])
      )
      nodes = list(self._nnx.merge(self._graph, state))
      for i, node in zip(self._node_slots, nodes, strict=True):
        leaves[i] = node
    return jax.tree.unflatten(self._def, leaves), nodes

  def state_after(self, nodes: list[Any]) -> "Results":
    """The NNX modules' state once `fun` has run on `nodes`."""
    if not self._nodes:
      return Results([])
    return Results(self._nnx.state(nodes))

  def write_back(self, state: Any) -> None:
    """Writes the NNX modules' new state into the caller's modules."""
    if self._nodes:
      self._nnx.update(self._nodes, state)


class Results:
  """What a traced call returns, split into traced arrays and the rest (the
  non-array leaves are kept from the trace)."""

  def __init__(self, tree: Any):
    leaves, self._def = jax.tree.flatten(tree)
    self._leaves = _Leaves(leaves)

  @property
  def arrays(self) -> list[Any]:
    return self._leaves.arrays

  def rebuild(self, arrays: list[Any]) -> Any:
    return jax.tree.unflatten(self._def, self._leaves.with_arrays(arrays))


def trace(
  fun: Callable[..., Any], arguments: Arguments
) -> tuple[Any, Results, Results]:
  """The jaxpr of `fun` on `arguments`' traced leaves, and the structure of
  its results and of the NNX state it leaves, to rebuild them from the
  jaxpr's outputs (`fun`'s arrays first, then the state's)."""
  found: dict[str, Results] = {}

  def traced(*arrays: Any) -> list[Any]:
    (args, kwargs), nodes = arguments.rebuild(list(arrays))
    results = Results(fun(*args, **kwargs))
    state = arguments.state_after(nodes)
    found["results"], found["state"] = results, state
    return results.arrays + state.arrays

  _name_after(traced, fun)
  closed = jax.make_jaxpr(traced)(*arguments.arrays)
  return closed, found["results"], found["state"]


def _name_after(traced: Callable[..., Any], fun: Callable[..., Any]) -> None:
  """Names `traced` after `fun`, for jax's debug information and errors."""
  for attribute in ("__name__", "__qualname__", "__module__"):
    value = getattr(fun, attribute, None)
    if isinstance(value, str):
      setattr(traced, attribute, value)
