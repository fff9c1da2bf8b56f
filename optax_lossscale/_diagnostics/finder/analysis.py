"""On the host, the facts of each node, from its measurements: whether it
is finite, whether its float32 shadow is, what made it not finite (its
*cause*), and which of those causes change the loss or the gradients (are
*harmful*).

Causes, for a value that an operation makes not finite from finite
inputs, or a source (an argument, a constant) that is not finite:
- `range`: finite in float32, not in its own dtype (float16's range);
- `data`: an input argument not finite, or beyond float16's range where it
  is cast to float16;
- `mask`: a ±inf the program writes (a literal, an array it closes over),
  a number beyond float16's range cast to it, or an input marked as a mask;
- `arithmetic`: not finite in float32 either (a log of 0, a division by 0,
  an inf minus an inf);
- `index`: a gather's NaN, filled where its index is out of range;
- `constant`: a NaN the program writes or closes over;
- `callback`, `unknown`: made by a host callback, or by an operation with
  no float32 reference: what made it is not measured.

A cause is harmful when what it changes reaches the loss or a gradient:
through values that are not finite, then, where an operation turns them
into finite values far from its float32 shadow's (`rsqrt(inf)` is 0 where
float32 gives 0.004: a token's activations zeroed), through every value
computed from those. An inf that an operation turns into float32's own
value (`tanh(inf)` is 1, as is float32's `tanh(70000)`) changes nothing
further. A mask's infs are not followed: what a mask does is on purpose.
"""

from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np

from optax_lossscale._diagnostics.finder import graph as _graph
from optax_lossscale._diagnostics.finder import primitives as _prims
from optax_lossscale._diagnostics.finder import statistics as _stats
from optax_lossscale._diagnostics.finder.graph import Node

_SOURCES = {
  _graph.PARAMETER: "data",
  _graph.INPUT: "data",
  _graph.MASK_INPUT: "mask",
  _graph.CONSTANT: "mask",
  _graph.LITERAL: "mask",
}


class Facts:
  """Each node's facts, from the program's measurements (`counts`
  and `magnitudes` by row)."""

  def __init__(
    self, nodes: list[Node], counts: np.ndarray, magnitudes: np.ndarray
  ):
    self.nodes = nodes
    n = len(nodes)
    self.counts = np.zeros((n, _stats.COUNTS), np.int64)
    self.largest = np.zeros(n)
    self.smallest = np.full(n, np.inf)
    self.cause: list[str | None] = [None] * n
    for node in nodes:
      if node.row is not None:
        self.counts[node.index] = counts[node.row]
        self.largest[node.index] = magnitudes[node.row, _stats.LARGEST]
        self.smallest[node.index] = magnitudes[node.row, _stats.SMALLEST]
      elif node.value is not None:
        self._literal(node)
      elif node.layout and node.dtype is not None:
        self._moved(node)
    for node in nodes:
      self.cause[node.index] = self._cause(node)
    # Not finite through masks alone: a mask, or passed on from masks only.
    self.from_masks = np.zeros(n, bool)
    for node in nodes:
      i = node.index
      cause = self.cause[i]
      self.from_masks[i] = cause == "mask" or (
        cause is None
        and self.nonfinite(i)
        and node.kind == _graph.OPERATION
        and all(self.from_masks[k] for k in node.inputs if self.nonfinite(k))
        and any(self.nonfinite(k) for k in node.inputs)
      )
    self.consumers: list[list[int]] = [[] for _ in nodes]
    for node in nodes:
      for k in node.inputs:
        self.consumers[k].append(node.index)

  @property
  def nan(self) -> np.ndarray:
    return self.counts[:, _stats.NAN]

  @property
  def inf(self) -> np.ndarray:
    return self.counts[:, _stats.INF]

  @property
  def flushed(self) -> np.ndarray:
    return self.counts[:, _stats.FLUSHED]

  def has(self, j: int, column: int) -> bool:
    """Whether node `j` has elements counted in `column`."""
    return bool(self.counts[j, column])

  def nonfinite(self, j: int) -> bool:
    return bool(self.nan[j] + self.inf[j])

  def both(self, j: int) -> bool:
    """Whether node `j` has elements not finite in float32 too."""
    return self.has(j, _stats.BOTH)

  def floats(self, node: Node) -> list[int]:
    return [k for k in node.inputs if self.nodes[k].dtype is not None]

  # ---------------------------------------------------------- measurement

  def _literal(self, node: Node) -> None:
    """A number in the program: its shadow is the same number, widened."""
    i, value = node.index, np.asarray(node.value)
    if np.iscomplexobj(value):
      value = np.concatenate([value.real.ravel(), value.imag.ravel()])
    value = value.astype(np.float64)
    nan, finite = np.isnan(value), np.isfinite(value)
    self.counts[i, _stats.NAN] = int(nan.sum())
    self.counts[i, _stats.INF] = int((~finite & ~nan).sum())
    self.counts[i, _stats.SHADOW_NAN] = int(nan.any())
    self.counts[i, _stats.BOTH] = int((~finite).any())
    kept = np.abs(value[finite])
    self.largest[i] = float(kept.max()) if kept.size else 0.0

  def _moved(self, node: Node) -> None:
    """A layout operation: its elements are its inputs'."""
    i = node.index
    for k in self.floats(node):
      self.counts[i] = np.maximum(self.counts[i], self.counts[k])
      self.largest[i] = max(self.largest[i], self.largest[k])

  # ---------------------------------------------------------------- causes

  def _cause(self, node: Node) -> str | None:
    i = node.index
    if not self.nonfinite(i):
      return None
    if node.kind in _SOURCES:
      cause = _SOURCES[node.kind]
      if cause == "mask" and self.nan[i]:  # a NaN is never a mask
        return "constant" if node.kind != _graph.MASK_INPUT else "data"
      return cause
    if node.kind != _graph.OPERATION or node.layout:
      return None
    if not node.reference:
      inputs_finite = not any(self.nonfinite(k) for k in self.floats(node))
      if not inputs_finite:
        return None
      return "callback" if node.host_call else "unknown"
    if self._made_range(node):
      return self._range_cause(node)
    if self._made_arithmetic(node):
      return "index" if node.primitive is _prims.GATHER else "arithmetic"
    return None

  def _made_range(self, node: Node) -> bool:
    """Not finite where float32 is finite, and no input was so: an input
    that was would have passed it on (the first such value is named)."""
    i = node.index
    return self.has(i, _stats.RANGE) and not any(
      self.has(k, _stats.RANGE) for k in self.floats(node)
    )

  def _made_arithmetic(self, node: Node) -> bool:
    """Not finite in float32 too, where no input was (or a NaN where no
    input was NaN: an inf minus an inf)."""
    i = node.index
    if not self.both(i):
      return False
    ins = self.floats(node)
    if not any(self.both(k) for k in ins):
      return True
    return self.has(i, _stats.SHADOW_NAN) and not any(
      self.has(k, _stats.SHADOW_NAN) for k in ins
    )

  def _range_cause(self, node: Node) -> str:
    """A cast of numbers beyond its dtype's range is a mask where they are
    written in the program or marked as masks, data where they come from
    an input; any other value beyond it is float16's range."""
    if node.primitive is not _prims.CONVERT:
      return "range"
    limit = _limit(node.dtype)
    beyond = [
      j
      for j in self.origins(node.inputs)
      if self.largest[j] > limit or self.nonfinite(j)
    ]
    written = [
      self.nodes[j].static or self.nodes[j].kind == _graph.MASK_INPUT
      for j in beyond
    ]
    if beyond and all(written):
      return "mask"
    if {self.nodes[j].kind for j in beyond} & {_graph.INPUT, _graph.PARAMETER}:
      return "data"
    return "range"

  def origins(self, inputs: Iterable[int]) -> set[int]:
    """The nodes that make the values of `inputs`, through operations that
    only rearrange or pick elements."""
    found: set[int] = set()
    stack = list(inputs)
    while stack:
      j = stack.pop()
      node = self.nodes[j]
      if node.dtype is None or j in found:
        continue
      if node.kind == _graph.OPERATION and (node.layout or node.picker):
        stack += node.inputs
      else:
        found.add(j)
    return found

  # ------------------------------------------------------------------ harm

  def reaches(self, start: int, outputs: set[int], infs_only: bool) -> bool:
    """Whether what `start` changes reaches one of `outputs`: through
    values that are not finite, then, from an operation that turns them
    into finite values far from float32's (`ABSORBED`), through every
    value computed from those. With `infs_only`, through infs alone."""
    changed = {start: False}  # node: whether it holds finite changes
    stack = [start]
    while stack:
      j = stack.pop()
      if j in outputs:
        return True
      for c in self.consumers[j]:
        if c in changed or self.nodes[c].kind != _graph.OPERATION:
          continue
        if changed[j]:
          changed[c] = True
        elif self.nonfinite(c):
          changed[c] = False
        elif not infs_only and self.has(c, _stats.ABSORBED):
          changed[c] = True
        else:
          continue
        stack.append(c)
    return False

  def carried_to(self, outputs: Iterable[int]) -> set[int]:
    """The non-finite nodes that carry non-finite values to `outputs`."""
    stack = [j for j in outputs if self.nonfinite(j)]
    seen: set[int] = set()
    while stack:
      j = stack.pop()
      if j in seen:
        continue
      seen.add(j)
      stack += [k for k in self.nodes[j].inputs if self.nonfinite(k)]
    return seen


def _limit(dtype: str | None) -> float:
  """The largest finite number of `dtype`."""
  return np.inf if dtype is None else float(jnp.finfo(dtype).max)
