"""On the host, from the nodes and their statistics: which values are masks,
which overflows reach the loss or the gradients (the harmful ones), the
first of those, and the pass each value belongs to.

- A *mask* is an inf written in the code or passed in with the batch, or a
  constant or batch value that only becomes an inf once cast to float16
  (a finite `-2.4e38` in float32). What a mask passes on is not an overflow.
- A value is *made* non-finite by an operation when its inputs were finite
  there (by position for elementwise operations; as a whole for others), or
  when it is a NaN made from infs (a mask's `-inf - -inf`).
- An overflow is *harmful* when it is carried, through values that are not
  finite, to the loss, the scaled loss or a gradient. Others were discarded
  (by a `where`, say) and are only listed.
- The *pass*: the forward pass is what the loss is computed from; the
  backward pass is what is computed from the loss scale (the cotangents); a
  value in neither that the gradients use is a derivative that jax computes
  while tracing the forward pass (rsqrt's derivative, say), named after the
  operation it belongs to.
"""

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from optax_lossscale._diagnostics.finder import graph as _graph
from optax_lossscale._diagnostics.finder.graph import Node
from optax_lossscale._diagnostics.finder.primitives import CONVERT, ELEMENTWISE
from optax_lossscale._diagnostics.finder.statistics import (
  FLUSHED,
  INF,
  LARGEST,
  MADE,
  NAN,
  SMALLEST,
  UNKNOWN,
)
from optax_lossscale._diagnostics.format import FLOAT16_MAX
from optax_lossscale._diagnostics.overflow_report import (
  Overflow,
  OverflowReport,
  ScopeStats,
)

_LISTED = 3  # masks and discarded overflows listed, at most


@dataclasses.dataclass
class Outputs:
  """The program's outputs, as nodes."""

  loss: int
  scaled: int
  grads: list[int]


class Analysis:
  """The facts the report is made of, from the nodes and their statistics."""

  def __init__(
    self,
    nodes: list[Node],
    counts: np.ndarray,
    magnitudes: np.ndarray,
    outputs: Outputs,
  ):
    self.nodes = nodes
    self._counts = counts
    self._magnitudes = magnitudes
    self.outputs = outputs
    n = len(nodes)
    self.nan = np.zeros(n, bool)
    self.nonfinite = np.zeros(n, bool)
    self.largest = np.zeros(n)
    self.made = np.zeros(n, np.int64)
    self.mask = np.zeros(n, bool)
    self.source = np.zeros(n, bool)  # an argument or constant that is bad
    for node in nodes:
      self._judge(node)
    # Non-finite only through masks: a mask, or passed on from masks alone.
    self.from_masks = np.zeros(n, bool)
    for node in nodes:
      i = node.index
      self.from_masks[i] = self.mask[i] or (
        self.nonfinite[i]
        and not self.source[i]
        and self.made[i] == 0
        and all(self.from_masks[k] for k in node.inputs if self.nonfinite[k])
        and any(self.nonfinite[k] for k in node.inputs)
      )
    self.cone = _ancestors(nodes, [outputs.loss])
    self.serves_gradients = _ancestors(nodes, outputs.grads)
    self.tainted = self._tainted()

  # ------------------------------------------------------------- per node

  def _judge(self, node: Node) -> None:
    i = node.index
    floats = [j for j in node.inputs if self.nodes[j].dtype is not None]
    if node.row is not None:
      c, m = self._counts[node.row], self._magnitudes[node.row]
      self.nan[i] = c[NAN] > 0
      self.nonfinite[i] = c[NAN] + c[INF] > 0
      self.largest[i] = m[LARGEST]
    elif node.value is not None:  # a literal
      self.nan[i] = bool(np.isnan(node.value).any())
      self.nonfinite[i] = not bool(np.isfinite(node.value).all())
      finite = node.value[np.isfinite(node.value)]
      self.largest[i] = float(np.abs(finite).max()) if finite.size else 0.0
    elif node.layout and node.dtype is not None:
      self.nan[i] = any(self.nan[j] for j in floats)
      self.nonfinite[i] = any(self.nonfinite[j] for j in floats)
      self.largest[i] = max((self.largest[j] for j in floats), default=0.0)
    if node.kind != _graph.OPERATION:
      self._judge_source(node)
    elif self.nonfinite[i] and not node.layout:
      self._judge_operation(node, floats)

  def _judge_source(self, node: Node) -> None:
    i = node.index
    if not self.nonfinite[i]:
      return
    if node.kind == _graph.PARAMETER:
      self.source[i] = True  # a parameter is never a mask
    elif node.kind in (_graph.INPUT, _graph.CONSTANT) and self.nan[i]:
      self.source[i] = True  # a NaN is bad data, not a mask
    else:
      self.mask[i] = True

  def _judge_operation(self, node: Node, floats: list[int]) -> None:
    i = node.index
    c = self._counts[node.row] if node.row is not None else None
    if c is None:
      return
    if c[MADE] != UNKNOWN:
      made = int(c[MADE])
    elif not any(self.nonfinite[j] for j in floats):
      made = int(c[NAN] + c[INF])
    elif not any(self.nan[j] for j in floats):
      made = int(c[NAN])
    else:
      made = 0
    if made and (node.static or self._mask_cast(node)):
      self.mask[i] = True  # computed from the code alone, or a mask's cast
    else:
      self.made[i] = made

  def _mask_cast(self, node: Node) -> bool:
    """Whether `node` is a cast whose infs all come from masks: every value
    beyond float16's range that it casts (through `where`s and reshapes)
    is a constant, a number in the code or a batch input."""
    if node.primitive is not CONVERT:
      return False
    huge = [
      j
      for j in self._origins(node.inputs)
      if self.largest[j] > FLOAT16_MAX or self.nonfinite[j]
    ]
    return bool(huge) and all(
      self.nodes[j].static or self.nodes[j].kind == _graph.INPUT for j in huge
    )

  def _origins(self, inputs: Iterable[int]) -> set[int]:
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

  def _tainted(self) -> set[int]:
    """The non-finite nodes that carry non-finite values to an output."""
    out = self.outputs
    stack = [j for j in (out.loss, out.scaled, *out.grads) if self.nonfinite[j]]
    seen: set[int] = set()
    while stack:
      j = stack.pop()
      if j in seen:
        continue
      seen.add(j)
      stack += [k for k in self.nodes[j].inputs if self.nonfinite[k]]
    return seen

  # ---------------------------------------------------------------- passes

  def pass_of(self, node: Node) -> tuple[str, str | None]:
    """`(pass, derivative_of)`: the pass `node` belongs to, and for a
    derivative computed in the forward pass, the primitive it is of."""
    if node.kind == _graph.PARAMETER or node.kind == _graph.INPUT:
      return "input", None
    if node.kind in (_graph.CONSTANT, _graph.LITERAL):
      return "constant", None
    assert node.where is not None
    if node.where.scaling:
      return "loss scaling", None
    if node.index in self.cone:
      return "forward", None
    if node.scale_dependent:
      return "backward", None
    if node.index in self.serves_gradients:
      return "backward", self._primal_of(node)
    return "forward", None  # computed, and used by nothing

  def _primal_of(self, node: Node) -> str | None:
    """The primitive whose derivative `node` computes: the latest operation
    of the forward pass, on the same line, that feeds it or shares an input
    with it."""
    line = node.where.line if node.where else None
    feeding = self._origins(node.inputs) | set(node.inputs)
    best: Node | None = None
    for j in sorted(self.cone):
      other = self.nodes[j]
      if j >= node.index or other.where is None or other.where.line != line:
        continue
      if other.layout or other.picker:
        continue
      if j in feeding or set(other.inputs) & set(node.inputs):
        best = other
    if best is None or best.where is None:
      return None
    return best.where.primitive

  def scope_pass(self, node: Node) -> str | None:
    """The pass whose table `node`'s float16 values count in, or None: a
    value counts once, in its own pass (a recomputation under `remat`, a
    mask, the loss scaling are not counted)."""
    if node.dtype != "float16" or node.row is None or node.where is None:
      return None
    if node.layout or node.picker or node.static or self.mask[node.index]:
      return None
    pass_name, _ = self.pass_of(node)
    if pass_name == "loss scaling":
      return None
    if pass_name == "backward" and not node.scale_dependent:
      return None if node.in_remat else "forward"
    return pass_name

  # ---------------------------------------------------------------- report

  def report(
    self, labels: dict[int, str], loss: float, scale: float
  ) -> OverflowReport:
    bad = [
      j for j in sorted(self.tainted) if self.source[j] or self.made[j] > 0
    ]
    first = None
    from_mask = False
    if bad:
      first = bad[0]
    elif self.tainted:  # only masks' infs reach an output
      from_mask = True
      first = self._where_masks_spread()
    discarded = [
      j
      for j, node in enumerate(self.nodes)
      if (self.made[j] > 0 or self.source[j]) and j not in self.tainted
    ]
    return OverflowReport(
      first=None
      if first is None
      else self._overflow(first, labels, from_mask=from_mask),
      nonfinite_operations=int(
        sum(
          1
          for node in self.nodes
          if node.kind == _graph.OPERATION
          and self.nonfinite[node.index]
          and not node.layout
        )
      ),
      loss=loss,
      scale=scale,
      scopes=self._scopes(),
      masks=tuple(self._masks(labels)),
      discarded=tuple(self._overflow(j, labels) for j in discarded[:_LISTED]),
    )

  def _where_masks_spread(self) -> int:
    """Where a mask's inf, carried to an output, first leaves the positions
    it masks: the first operation on its way there that is not elementwise
    (a gather that picks a masked logit, a sum over it)."""
    chain = [
      j
      for j in sorted(self.tainted)
      if self.nodes[j].kind == _graph.OPERATION
      and not (self.mask[j] or self.nodes[j].layout)
    ]
    spread = [j for j in chain if self.nodes[j].primitive not in ELEMENTWISE]
    return (spread or chain or [min(self.tainted)])[0]

  def _overflow(
    self, j: int, labels: dict[int, str], from_mask: bool = False
  ) -> Overflow:
    node = self.nodes[j]
    pass_name, derivative_of = self.pass_of(node)
    c = self._counts[node.row] if node.row is not None else None
    nan = int(c[NAN]) if c is not None else int(self.nan[j])
    inf = int(c[INF]) if c is not None else 0
    w = node.where
    primitive = w.primitive if w else labels.get(j, node.label)
    if derivative_of is not None:
      primitive = f"{derivative_of}'s derivative"
    return Overflow(
      pass_name=pass_name,
      primitive=primitive,
      scope=w.scope if w else "",
      source=w.source if w else None,
      code=w.code if w else None,
      call_path=w.call_path if w else (),
      boundary=w.boundary if w else None,
      dtype=node.dtype or "",
      shape=node.shape,
      nan=nan,
      inf=inf,
      size=node.size,
      largest=float(self.largest[j]),
      derivative_of=derivative_of,
      from_mask=from_mask,
    )

  def _masks(self, labels: dict[int, str]) -> list[str]:
    """Where the masks are that mask something (an inf that some operation
    passes on, not a `-inf` that a `max` drops): each in words, once, in
    program order."""
    consumers: dict[int, list[int]] = {}
    for node in self.nodes:
      for k in node.inputs:
        consumers.setdefault(k, []).append(node.index)
    found: list[str] = []
    for node in self.nodes:
      if not self.mask[node.index]:
        continue
      if node.kind == _graph.OPERATION and any(
        self.mask[k] for k in node.inputs
      ):
        continue  # passed on from a mask already listed
      users = [self.nodes[k] for k in consumers.get(node.index, ())]
      if not any(self._masked_by(u, node.index) for u in users):
        continue  # its infs go no further
      text = _mask_words(node, labels, users)
      if text not in found:
        found.append(text)
    return found

  def _masked_by(self, user: Node, mask: int) -> bool:
    """Whether `user` is not finite because of input `mask`: its other
    floating-point inputs are finite, or not finite through masks only."""
    if not self.nonfinite[user.index] or self.mask[user.index]:
      return False
    others = [
      k for k in user.inputs if k != mask and self.nodes[k].dtype is not None
    ]
    return all(self.from_masks[k] for k in others if self.nonfinite[k])

  def _scopes(self) -> tuple[ScopeStats, ...]:
    """The float16 values' statistics summed per (pass, scope), in the
    order the scopes first appear."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for node in self.nodes:
      pass_name = self.scope_pass(node)
      if pass_name is None:
        continue
      assert node.where is not None and node.row is not None
      c, m = self._counts[node.row], self._magnitudes[node.row]
      g = groups.setdefault(
        (pass_name, node.where.label),
        dict(values=0, largest=0.0, smallest=math.inf, nonfinite=0,
             flushed=0, flush_checked=0),
      )  # fmt: skip
      g["values"] += node.size
      g["largest"] = max(g["largest"], float(m[LARGEST]))
      g["smallest"] = min(g["smallest"], float(m[SMALLEST]))
      g["nonfinite"] += int(self.made[node.index])
      if c[FLUSHED] != UNKNOWN:
        g["flushed"] += int(c[FLUSHED])
        g["flush_checked"] += node.size
    return tuple(
      ScopeStats(pass_name=pass_name, scope=label, **g)
      for (pass_name, label), g in groups.items()
    )


def _mask_words(node: Node, labels: dict[int, str], users: list[Node]) -> str:
  if node.kind in (_graph.INPUT, _graph.PARAMETER):
    return f"the input `{labels.get(node.index, node.label)}`"
  sources = [u.where.source for u in users if u.where and u.where.source]
  if node.where is not None and node.where.source:
    sources.insert(0, node.where.source)
  at = f" at {sources[0]}" if sources else ""
  if node.kind == _graph.LITERAL:
    assert node.value is not None
    return f"{float(node.value.flat[0]):g} written in the code{at}"
  if node.kind == _graph.CONSTANT:
    return f"an array the code closes over, used{at}"
  assert node.where is not None
  if node.primitive is CONVERT:
    return f"a cast to {node.dtype} of a value beyond its range{at}"
  return f"a value computed from constants{at}"


def _ancestors(nodes: list[Node], start: Iterable[int]) -> set[int]:
  seen: set[int] = set()
  stack = list(start)
  while stack:
    j = stack.pop()
    if j in seen:
      continue
    seen.add(j)
    stack += nodes[j].inputs
  return seen
