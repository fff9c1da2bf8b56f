"""The report, from the facts: the first harmful cause in program order,
the masks that mask something, the causes that reach nothing, and each
scope's float16 values, per pass."""

import dataclasses
import math
from typing import Any

from optax_lossscale._diagnostics.finder import graph as _graph
from optax_lossscale._diagnostics.finder.analysis import Facts
from optax_lossscale._diagnostics.finder.graph import Node
from optax_lossscale._diagnostics.finder.primitives import ELEMENTWISE
from optax_lossscale._diagnostics.overflow_report import (
  Overflow,
  OverflowReport,
  ScopeStats,
)

_LISTED = 3  # masks and discarded values listed, at most


@dataclasses.dataclass
class Outputs:
  """What the program's run gives back: the loss and gradient nodes, and
  the loss with its float32 reference."""

  loss: int
  grads: list[int]
  loss_value: float
  reference_loss: float
  labels: dict[int, str]  # the arguments' nodes, by name


def report(facts: Facts, out: Outputs, scale: float) -> OverflowReport:
  outputs = {out.loss, *out.grads}
  first, from_mask = None, False
  discarded: list[int] = []
  for j, cause in enumerate(facts.cause):
    if cause is None or cause == "mask":
      continue
    if facts.reaches(j, outputs, infs_only=False):
      first = j
      break
    discarded.append(j)
  carried = facts.carried_to(outputs)
  if first is None and carried:  # only masks' infs reach an output
    first, from_mask = _where_masks_spread(facts, carried), True
  return OverflowReport(
    first=None
    if first is None
    else _overflow(facts, first, out.labels, from_mask),
    nonfinite_operations=sum(
      1
      for node in facts.nodes
      if node.kind == _graph.OPERATION
      and not node.layout
      and facts.nonfinite(node.index)
    ),
    loss=out.loss_value,
    scale=scale,
    scopes=_scopes(facts),
    masks=tuple(_masks(facts, out.labels)),
    discarded=tuple(
      _overflow(facts, j, out.labels) for j in discarded[:_LISTED]
    ),
    reference_loss=out.reference_loss,
  )


def _where_masks_spread(facts: Facts, carried: set[int]) -> int:
  """Where a mask's inf, carried to an output, first leaves the positions
  it masks: the first operation on its way that is not elementwise (a
  gather that picks a masked logit, a sum over it)."""
  chain = [
    j
    for j in sorted(carried)
    if facts.nodes[j].kind == _graph.OPERATION
    and facts.cause[j] != "mask"
    and not facts.nodes[j].layout
  ]
  spread = [j for j in chain if facts.nodes[j].primitive not in ELEMENTWISE]
  return (spread or chain or [min(carried)])[0]


def _overflow(
  facts: Facts, j: int, labels: dict[int, str], from_mask: bool = False
) -> Overflow:
  node = facts.nodes[j]
  w = node.where
  pass_name, derivative_of = _pass(node)
  primitive = w.primitive if w else labels.get(j, node.label)
  if derivative_of is not None:
    primitive = f"{derivative_of}'s derivative"
  source = _from_input(facts, node, labels)
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
    nan=int(facts.nan[j]),
    inf=int(facts.inf[j]),
    size=node.size,
    largest=float(facts.largest[j]),
    derivative_of=derivative_of,
    from_mask=from_mask,
    cause="mask" if from_mask else facts.cause[j],
    depends_on_scale=node.from_cotangent,
    recomputed=node.recomputed,
    custom_rule=node.custom_rule,
    from_input=source[0] if source else None,
    host_call=node.host_call,
    from_parameter=source is not None and source[1],
  )


def _pass(node: Node) -> tuple[str, str | None]:
  """`(pass, derivative_of)`, from the node's place in the program."""
  if node.kind in (_graph.PARAMETER, _graph.INPUT, _graph.MASK_INPUT):
    return "input", None
  if node.kind in (_graph.CONSTANT, _graph.LITERAL):
    return "constant", None
  if node.where is not None and node.where.scaling:
    return "loss scaling", None
  if node.role == _graph.DERIVATIVE:
    return "backward", node.owner
  if node.role == _graph.BACKWARD:
    return "backward", None
  return "forward", None


def _from_input(
  facts: Facts, node: Node, labels: dict[int, str]
) -> tuple[str, bool] | None:
  """The input whose values a data cause carries (or whose indices an
  index cause uses), by name, and whether it is a parameter (one of the
  differentiated arguments) rather than held fixed."""
  cause = facts.cause[node.index]
  inputs: list[int]
  if cause == "index":
    inputs = [k for k in node.inputs if facts.nodes[k].dtype is None]
  elif cause == "data":
    inputs = [node.index] if node.kind != _graph.OPERATION else [*node.inputs]
  else:
    return None
  found = sorted(
    (labels[k], facts.nodes[k].kind == _graph.PARAMETER)
    for k in _origins_any(facts, inputs)
    if k in labels
  )
  return found[0] if found else None


def _origins_any(facts: Facts, inputs: Any) -> set[int]:
  """Like `Facts.origins`, through values of any dtype (indices too)."""
  found: set[int] = set()
  stack = list(inputs)
  while stack:
    j = stack.pop()
    node = facts.nodes[j]
    if j in found:
      continue
    found.add(j)
    if node.kind == _graph.OPERATION:
      stack += node.inputs
  return found


def _masks(facts: Facts, labels: dict[int, str]) -> list[str]:
  """The masks that mask something (an inf that an operation passes on
  where its other inputs are finite, not a `-inf` that a `max` drops):
  each in words, once, in program order."""
  found: list[str] = []
  for node in facts.nodes:
    j = node.index
    if facts.cause[j] != "mask":
      continue
    users = [facts.nodes[c] for c in facts.consumers[j]]
    if not any(_masked_by(facts, user, j) for user in users):
      continue
    text = _mask_words(node, labels, users)
    if text not in found:
      found.append(text)
  return found


def _masked_by(facts: Facts, user: Node, mask: int) -> bool:
  if not facts.nonfinite(user.index) or facts.cause[user.index] == "mask":
    return False
  return all(
    facts.from_masks[k]
    for k in facts.floats(user)
    if k != mask and facts.nonfinite(k)
  )


def _mask_words(node: Node, labels: dict[int, str], users: list[Node]) -> str:
  if node.kind in (_graph.INPUT, _graph.MASK_INPUT, _graph.PARAMETER):
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
  return f"a cast to {node.dtype} of a value beyond its range{at}"


def _scopes(facts: Facts) -> tuple[ScopeStats, ...]:
  """The float16 values' statistics summed per (pass, scope), in the
  order the scopes first appear: cotangents (computed from the loss
  scale) in the backward table, every other value in the forward one."""
  groups: dict[tuple[str, str], dict[str, Any]] = {}
  for node in facts.nodes:
    if not _counted(facts, node):
      continue
    assert node.where is not None
    pass_name = "backward" if node.from_cotangent else "forward"
    g = groups.setdefault(
      (pass_name, node.where.label),
      dict(values=0, largest=0.0, smallest=math.inf, nonfinite=0,
           flushed=0, flush_checked=0),
    )  # fmt: skip
    j = node.index
    g["values"] += node.size
    g["largest"] = max(g["largest"], float(facts.largest[j]))
    g["smallest"] = min(g["smallest"], float(facts.smallest[j]))
    if facts.cause[j] is not None:  # made here (a mask's are not counted)
      g["nonfinite"] += int(facts.nan[j] + facts.inf[j])
    if node.flush_checked:
      g["flushed"] += int(facts.flushed[j])
      g["flush_checked"] += node.size
  return tuple(
    ScopeStats(pass_name=pass_name, scope=label, **g)
    for (pass_name, label), g in groups.items()
  )


def _counted(facts: Facts, node: Node) -> bool:
  return (
    node.dtype == "float16"
    and node.kind == _graph.OPERATION
    and node.row is not None
    and node.where is not None
    and not (node.layout or node.picker or node.static)
    and not node.where.scaling
    and facts.cause[node.index] != "mask"
  )
