"""The visitor: every value the gradient program makes becomes a node, with
the nodes it was made from; every floating-point value that an operation
makes is reduced to its statistics where it is made."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._diagnostics.finder import primitives as _prims
from optax_lossscale._diagnostics.finder import source as _source
from optax_lossscale._diagnostics.finder import statistics as _statistics
from optax_lossscale._diagnostics.finder.reference import (
  float32_reference,
  has_body,
)
from optax_lossscale._jaxpr import compat as _compat

# Values of one size made one after the other are reduced together, this
# many at most: fewer kernels to compile, each holding a few values a
# little longer than the program itself does.
GROUP = 8

# What a node is.
PARAMETER = "parameter"  # differentiated
INPUT = "input"  # an array argument held fixed
SCALE = "scale"  # the loss scale
CONSTANT = "constant"  # an array the program closes over
LITERAL = "literal"  # a number written in the code
OPERATION = "operation"


@dataclasses.dataclass
class Node:
  """A value of the program (an equation's output, an argument, a constant)
  and what is known of it while tracing."""

  index: int  # in program order
  kind: str
  label: str  # an argument's name; an operation's primitive
  inputs: tuple[int, ...] = ()  # the nodes it was made from
  where: _source.Where | None = None  # an operation's
  dtype: str | None = None  # a floating-point value's, else None
  shape: tuple[int, ...] = ()
  row: int | None = None  # its row of statistics, when measured
  layout: bool = False  # only rearranges its inputs' elements
  picker: bool = False  # picks some of its inputs' elements
  static: bool = False  # computed from the code alone
  scale_dependent: bool = False  # computed from the loss scale
  in_remat: bool = False  # inside a rematerialized body
  value: np.ndarray | None = None  # a literal's
  primitive: Any = None  # an operation's, the object (names change)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))


class Recorder:
  """The nodes, in program order, and the statistics of those measured."""

  def __init__(self) -> None:
    self.nodes: list[Node] = []
    self._counts: list[jax.Array | None] = []
    self._magnitudes: list[jax.Array | None] = []
    self._pending: list[tuple[int, _statistics.Operands]] = []

  def add(self, node_kind: str, **fields: Any) -> int:
    node = Node(len(self.nodes), node_kind, **fields)
    self.nodes.append(node)
    return node.index

  def source(self, kind: str, label: str, value: Any) -> int:
    """An argument or a constant: a node, measured if floating point."""
    index = self.add(
      kind,
      label=label,
      static=kind == CONSTANT,
      scale_dependent=kind == SCALE,
    )
    if _prims.is_float(value):
      self._measure(self.nodes[index], value, None, None)
    return index

  def literal(self, literal: Any) -> int:
    value = np.asarray(literal.val)
    float_ = _prims.is_float(literal.aval)
    return self.add(
      LITERAL,
      label=repr(literal.val),
      static=True,
      dtype=str(value.dtype) if float_ else None,
      shape=tuple(value.shape),
      value=value if float_ else None,
    )

  def _measure(
    self, node: Node, value: Any, ins: list[Any] | None, reference: Any
  ) -> Any:
    """Records `value`'s statistics as `node`'s; returns `value`."""
    node.dtype = str(value.dtype)
    node.shape = tuple(value.shape)
    node.row = len(self._counts)
    self._counts.append(None)
    self._magnitudes.append(None)
    operands = _statistics.operands(value, ins, reference)
    if self._pending and (
      len(self._pending) == GROUP
      or self._pending[0][1].arrays[0].shape != operands.arrays[0].shape
    ):
      self._flush()
    self._pending.append((node.row, operands))
    return value

  def _flush(self) -> None:
    """Reduces the pending values of one size, together."""
    if not self._pending:
      return
    rows = [row for row, _ in self._pending]
    group = [operands for _, operands in self._pending]
    for row, (counts, magnitudes) in zip(
      rows, _statistics.reduce_group(group), strict=True
    ):
      self._counts[row] = counts
      self._magnitudes[row] = magnitudes
    self._pending = []

  def operation(
    self,
    eqn: Any,
    outs: list[Any],
    ins: list[Any],
    inputs: list[int],
    context: tuple[Any, ...],
  ) -> tuple[list[int], list[Any]]:
    """Nodes for `eqn`'s outputs, made from nodes `inputs`, and the outputs
    to use in their place; the floating-point outputs of an operation that
    makes or picks values measured."""
    layout = _prims.is_layout(eqn)
    picker = _prims.is_picker(eqn)
    where = _source.where(eqn, context, boundary=has_body(eqn))
    common = dict(
      label=where.primitive,
      primitive=eqn.primitive,
      inputs=tuple(inputs),
      where=where,
      layout=layout,
      picker=picker,
      static=all(self.nodes[i].static for i in inputs),
      scale_dependent=any(self.nodes[i].scale_dependent for i in inputs),
      in_remat=any(_prims.is_remat(e) for e in context),
    )
    floats = [_prims.is_float(v.aval) for v in eqn.outvars]
    reference = None
    if any(floats) and not (layout or picker):
      if any(out.dtype == jnp.float16 for out in outs):
        reference = float32_reference(eqn, ins)
    nodes, values = [], []
    for k, out in enumerate(outs):
      index = self.add(OPERATION, **common)
      node = self.nodes[index]
      node.shape = tuple(np.shape(out))
      if floats[k] and layout:
        node.dtype = str(out.dtype)
      elif floats[k]:
        ref = None
        if reference is not None and out.dtype == jnp.float16:
          ref = reference[k]
        out = self._measure(node, out, _positional(eqn, out, ins), ref)
      nodes.append(index)
      values.append(out)
    return nodes, values

  def elements(self) -> int:
    """How many values are measured in all."""
    return sum(node.size for node in self.nodes if node.row is not None)

  def statistics(self) -> tuple[jax.Array, jax.Array]:
    """Every measured value's counts and magnitudes, one row each."""
    self._flush()
    counts = [c for c in self._counts if c is not None]
    magnitudes = [m for m in self._magnitudes if m is not None]
    assert len(counts) == len(magnitudes) == len(self._counts)
    if not counts:
      return jnp.zeros((0, 4), jnp.int32), jnp.zeros((0, 2), jnp.float32)
    return jnp.stack(counts), jnp.stack(magnitudes)


def _positional(eqn: Any, out: Any, ins: list[Any]) -> list[Any] | None:
  """The floating-point inputs of an elementwise `eqn`, when each has
  `out`'s shape or is a scalar; else None."""
  if eqn.primitive not in _prims.ELEMENTWISE:
    return None
  floats = [x for x in ins if _prims.is_float(x)]
  if not all(np.shape(x) in ((), np.shape(out)) for x in floats):
    return None
  return floats


class Measure:
  """The visitor of `_interpret.evaluate`: a node for each value, each
  operation's values measured by the recorder."""

  def __init__(
    self,
    recorder: Recorder,
    env: dict[Any, Any],
    node_of: dict[Any, int],
    context: tuple[Any, ...],
  ):
    self._recorder = recorder
    self._env = env
    self._node_of = node_of
    self._context = context  # the calls this body is inside, outermost first
    self._entered: dict[int, tuple[Any, Measure]] = {}

  def _read(self, v: Any) -> Any:
    # A literal's value with its dtype: a bare Python number would not count
    # as a floating-point input, and the body's cast of a `-inf` passed into
    # a `jit` would seem to make its inf itself, hiding the mask.
    if isinstance(v, _compat.Literal):
      return _compat.literal_value(v)
    return self._env[v]

  def node(self, v: Any) -> int:
    """The node of variable or literal `v`."""
    if isinstance(v, _compat.Literal):
      return self._recorder.literal(v)
    return self._node_of[v]

  def enter(self, eqn: Any, body: Any) -> "Measure":
    jaxpr = body.jaxpr
    env = dict(zip(jaxpr.constvars, body.consts, strict=True))
    env.update(zip(jaxpr.invars, map(self._read, eqn.invars), strict=True))
    node_of = {
      v: self._recorder.source(CONSTANT, "an array the code closes over", c)
      for v, c in zip(jaxpr.constvars, body.consts, strict=True)
    }
    node_of.update(zip(jaxpr.invars, map(self.node, eqn.invars), strict=True))
    inner = Measure(self._recorder, env, node_of, (*self._context, eqn))
    self._entered[id(eqn)] = (body, inner)
    return inner

  def produced(self, eqn: Any, values: list[Any]) -> list[Any]:
    entered = self._entered.pop(id(eqn), None)
    if entered is not None:  # measured inside
      body, inner = entered
      nodes = [inner.node(v) for v in body.jaxpr.outvars]
    else:
      ins = [self._read(v) for v in eqn.invars]
      nodes, values = self._recorder.operation(
        eqn, values, ins, [self.node(v) for v in eqn.invars], self._context
      )
    for v, value, node in zip(eqn.outvars, values, nodes, strict=True):
      if not isinstance(v, _compat.DropVar):
        self._env[v] = value
        self._node_of[v] = node
    return values
