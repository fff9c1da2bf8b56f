"""A chunk of the program run in its own dtypes and in its float32 shadow
side by side, operation by operation, forward or backward, every value
measured where it is made: traced once per kind of chunk (`chunks`), into
a template of the nodes it makes.

Forward, a step runs its equation (or, where it is differentiated, its
forward rule: the equation and the values of its derivative that the
backward pass keeps); backward, the differentiated steps run their
backward rules in reverse order, and the cotangents of a value used more
than once are added up. The pass of every value comes from that structure.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._diagnostics.finder import graph as _graph
from optax_lossscale._diagnostics.finder import primitives as _prims
from optax_lossscale._diagnostics.finder import widen as _widen
from optax_lossscale._diagnostics.finder.plan import Step
from optax_lossscale._jaxpr import compat


class Val(NamedTuple):
  """A value, its float32 shadow, and its node (in the template)."""

  value: Any
  shadow: Any
  node: int


class Tracer:
  """Traces steps into `recorder` (a chunk's template): nodes carry their
  step's position, and are named where the chunk is instantiated."""

  def __init__(self, recorder: _graph.Recorder):
    self.recorder = recorder

  def external(
    self, value: Any, shadow: Any, k: int, cotangent: bool = False
  ) -> Val:
    """The chunk's `k`-th input, made outside it (a cotangent, or not)."""
    node = self.recorder.add(
      _graph.EXTERNAL, label="", external=k, from_cotangent=cotangent
    )
    node.shape = tuple(np.shape(value))
    if _prims.is_float(value):
      node.dtype = str(value.dtype)
    return Val(value, shadow, node.index)

  def read(self, env: dict[Any, Val], ref: Any) -> Val:
    if not isinstance(ref, compat.Literal):
      return env[ref]
    value = compat.literal_value(ref)
    node = self.recorder.add(
      _graph.LITERAL,
      label=repr(ref.val),
      static=True,
      shape=tuple(np.shape(value)),
      dtype=str(value.dtype) if _prims.is_float(value) else None,
      value=np.asarray(value) if _prims.is_float(value) else None,
    )
    return Val(value, _widen.widen(value), node.index)

  # ---------------------------------------------------------------- forward

  def forward(
    self, position: int, step: Step, ins: list[Val]
  ) -> tuple[list[Val], list[Val]]:
    """The step's outputs, and its residuals (none where it is not
    differentiated)."""
    if step.rule is None:
      outs = self._operation(step.eqn, ins, _graph.FORWARD, step, position)
      return outs, []
    first = len(self.recorder.nodes)
    forward = step.rule.forward
    consts = self._constants(forward.consts)
    outs = self.rule(
      forward.jaxpr, consts, ins, _graph.DERIVATIVE, step, position
    )
    values = outs[: step.rule.outputs]
    self._mark_equation(first, [v.node for v in values])
    return values, outs[step.rule.outputs :]

  def _constants(self, arrays: Sequence[Any]) -> list[Val]:
    """A rule's constants: numbers in jax's rule, written as literals."""
    vals = []
    for c in arrays:
      node = self.recorder.add(
        _graph.LITERAL,
        label="a constant of jax's rule",
        static=True,
        shape=tuple(np.shape(c)),
        dtype=str(c.dtype) if _prims.is_float(c) else None,
        value=np.asarray(c) if _prims.is_float(c) else None,
      )
      vals.append(Val(c, _widen.widen(c), node.index))
    return vals

  def _mark_equation(self, first: int, outputs: list[int]) -> None:
    """Of the nodes from `first` on (a forward rule's), those the outputs
    are computed from are the equation itself; the rest are its
    derivative's."""
    nodes = self.recorder.nodes
    stack = [j for j in outputs if j >= first]
    while stack:
      node = nodes[stack.pop()]
      if node.role == _graph.FORWARD:
        continue
      node.role, node.recomputed = _graph.FORWARD, False
      stack += [k for k in node.inputs if k >= first]

  # -------------------------------------------------------------- backward

  def backward(
    self,
    position: int,
    step: Step,
    residuals: list[Val],
    cotangents: list[Val | None],
    outs: list[Any],
  ) -> list[Val]:
    """The cotangents of the step's differentiated inputs, from those of
    its outputs (None: zero)."""
    assert step.rule is not None
    floats = [
      (ct, aval) for ct, aval in zip(cotangents, outs, strict=True)
      if _prims.is_float(aval)
    ]  # fmt: skip
    given = [ct if ct is not None else self._zeros(aval) for ct, aval in floats]
    backward = step.rule.backward
    return self.rule(
      backward.jaxpr,
      self._constants(backward.consts),
      [*residuals, *given],
      _graph.BACKWARD,
      step,
      position,
    )

  def _zeros(self, aval: Any) -> Val:
    value = jnp.zeros(aval.shape, aval.dtype)
    node = self.recorder.add(
      _graph.LITERAL,
      label="0",
      static=True,
      shape=tuple(aval.shape),
      dtype=str(value.dtype),
      value=np.zeros((), value.dtype),
    )
    return Val(value, _widen.widen(value), node.index)

  def add(self, before: Val, ct: Val, step: Step, position: int) -> Val:
    """`before + ct`, two cotangents of one value, measured."""
    value, shadow = lax.add(before.value, ct.value), before.shadow + ct.shadow
    added = self.recorder.add(
      _graph.OPERATION,
      label="add_any",
      inputs=(before.node, ct.node),
      role=_graph.BACKWARD,
      owner=step.eqn.primitive.name,
      primitive=_prims.ADD,
      from_cotangent=True,
      step=position,
    )
    self.recorder.measure(added, value, shadow, [before.value, ct.value])
    return Val(value, shadow, added.index)

  # ----------------------------------------------------------------- rules

  def rule(
    self,
    jaxpr: Any,
    consts: Sequence[Val],
    args: Sequence[Val],
    role: str,
    step: Step,
    position: int,
  ) -> list[Val]:
    """Evaluates a rule's `jaxpr`, calls inlined; each operation is named
    by its step and its own primitive."""
    env: dict[Any, Val] = {}
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for op in jaxpr.eqns:
      ins = [self.read(env, v) for v in op.invars]
      body = compat.call_body(op, keep_placement=False)
      if body is None:
        body = compat.ruled_call_body(op)
      if body is not None:
        inner = self._constants(body.consts)
        outs = self.rule(body.jaxpr, inner, ins, role, step, position)
      else:
        outs = self._operation(op, ins, role, step, position)
      for v, out in zip(op.outvars, outs, strict=True):
        if not isinstance(v, compat.DropVar):
          env[v] = out
    return [self.read(env, v) for v in jaxpr.outvars]

  # ------------------------------------------------------------ operations

  def _operation(
    self, op: Any, ins: list[Val], role: str, step: Step, position: int
  ) -> list[Val]:
    """Binds `op` in its dtypes and in float32, a node for each output,
    each floating-point one measured."""
    values = compat.bind(op, [x.value for x in ins])
    reference = True
    try:
      shadows = _widen.bind_wide(op, [x.shadow for x in ins])
    except _widen.NoReference:
      shadows, reference = [_widen.widen(v) for v in values], False
    layout = _prims.is_layout(op)
    nodes = self.recorder.nodes
    common = dict(
      label=op.primitive.name,
      primitive=op.primitive,
      inputs=tuple(x.node for x in ins),
      role=role,
      owner=step.eqn.primitive.name,
      layout=layout,
      picker=op.primitive in _prims.PICKERS,
      reference=reference,
      static=all(nodes[x.node].static for x in ins),
      from_cotangent=any(nodes[x.node].from_cotangent for x in ins),
      recomputed=step.context.remat and role == _graph.DERIVATIVE,
      custom_rule=_custom_rule(step.eqn),
      host_call=compat.host_call_name(op) if compat.is_host_call(op) else None,
      step=position,
    )
    outs = []
    for k, (value, shadow) in enumerate(zip(values, shadows, strict=True)):
      node = self.recorder.add(_graph.OPERATION, **common)
      node.shape = tuple(np.shape(value))
      node.boundary = bool(compat.bodies(op))
      if _prims.is_float(value):
        node.dtype = str(value.dtype)
        if not layout:
          self._measure(node, op, k, value, shadow, ins)
      outs.append(Val(value, shadow, node.index))
    return outs

  def _measure(
    self, node: Any, op: Any, k: int, value: Any, shadow: Any, ins: list[Val]
  ) -> None:
    positional = None
    reference = None
    if op.primitive in _prims.ELEMENTWISE:
      floats = [x for x in ins if _prims.is_float(x.value)]
      if all(np.shape(x.value) in ((), np.shape(value)) for x in floats):
        positional = [x.value for x in floats]
        if value.dtype == jnp.float16 and node.reference:
          reference = _own_reference(op, k, ins)
    self.recorder.measure(node, value, shadow, positional, reference)


def _own_reference(op: Any, k: int, ins: list[Val]) -> Any:
  """`op`'s `k`-th output computed in float32 from its own inputs (not
  its shadow's), for a cast and for arithmetic: where it is not zero and
  the float16 output is, float16 flushed a value to zero."""
  if op.primitive is _prims.CONVERT:
    return ins[0].value  # the value cast
  if op.primitive not in _prims.FLUSHING:
    return None
  try:
    return _widen.bind_wide(op, [_widen.widen(x.value) for x in ins])[k]
  except _widen.NoReference:
    return None


def _custom_rule(eqn: Any) -> str | None:
  """The name of the function whose custom derivative `eqn` calls."""
  if eqn.primitive not in (compat.custom_jvp_call_p, compat.custom_vjp_call_p):
    return None
  body = compat.ruled_call_body(eqn)
  traced = None if body is None else compat.traced_function(body)
  return traced[0] if traced else "a function with a custom derivative"


@dataclasses.dataclass
class Template:
  """What tracing a chunk made: its nodes (EXTERNAL ones stand for its
  inputs), and which of them are its outputs."""

  nodes: list[_graph.Node]
  outputs: list[int]  # template nodes, in the order the chunk returns them
  extra: Any = None  # what else the chunk's driver needs to know
