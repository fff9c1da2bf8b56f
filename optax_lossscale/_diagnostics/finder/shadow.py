"""The finder's interpreter: `fun`'s program run operation by operation, in
its own dtypes and in its float32 shadow side by side, forward and then
backward, every value measured where it is made.

The gradient is built here, equation by equation, from each equation's
derivative as jax computes it (`rules`): the forward pass runs each
equation's forward rule (the equation, and the values of its derivative
that the backward pass keeps), the backward pass runs the backward rules
in reverse order and adds the cotangents up. So the pass of every value
comes from the program's structure: an equation of `fun`, its derivative,
its backward rule, the finder's loss scaling. Calls (`jit`, whether it
places or donates its arguments or not) and `jax.checkpoint` are entered;
a custom derivative is run as its rules; `scan`, `while_loop` and `cond`
run whole.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._diagnostics.finder import graph as _graph
from optax_lossscale._diagnostics.finder import primitives as _prims
from optax_lossscale._diagnostics.finder import rules as _rules
from optax_lossscale._diagnostics.finder import source as _source
from optax_lossscale._diagnostics.finder import widen as _widen
from optax_lossscale._jaxpr import compat


class Val(NamedTuple):
  """A value of the program, its float32 shadow, its node, and whether it
  is computed from the differentiated parameters."""

  value: Any
  shadow: Any
  node: int
  tangent: bool = False


@dataclasses.dataclass(frozen=True)
class Context:
  """Where an equation is: the calls it is inside (outermost first), and
  what they make of it."""

  calls: tuple[Any, ...] = ()
  remat: bool = False  # inside `jax.checkpoint`
  scaling: bool = False  # the finder's own loss scaling


@dataclasses.dataclass
class _Entry:
  """An equation whose backward rule the backward pass runs."""

  rule: _rules.Rule
  where: _source.Where
  owner: Any  # the equation
  context: Context
  ins: list[Val]
  outs: list[Val]
  residuals: list[Val]


class Interpreter:
  """Runs a program forward, then backward, into `recorder`'s nodes."""

  def __init__(self, recorder: _graph.Recorder):
    self.recorder = recorder
    self._tape: list[_Entry] = []
    self._where: dict[Any, _source.Where] = {}
    self._rules: dict[Any, _rules.Rule] = {}

  # ---------------------------------------------------------------- forward

  def forward(
    self,
    jaxpr: Any,
    consts: Sequence[Val],
    args: Sequence[Val],
    context: Context,
  ) -> list[Val]:
    """Evaluates `jaxpr` (open) on `consts` and `args`."""
    env: dict[Any, Val] = {}
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
      ins = [self._read(env, v) for v in eqn.invars]
      outs = self._equation(eqn, ins, context)
      for v, out in zip(eqn.outvars, outs, strict=True):
        if not isinstance(v, compat.DropVar):
          env[v] = out
    return [self._read(env, v) for v in jaxpr.outvars]

  def constants(self, values: Sequence[Any], label: str) -> list[Val]:
    """Vals for the arrays a program closes over."""
    vals = []
    for c in values:
      shadow = _widen.widen(c)
      node = self.recorder.source(_graph.CONSTANT, label, c, shadow)
      vals.append(Val(c, shadow, node.index))
    return vals

  def _read(self, env: dict[Any, Val], v: Any) -> Val:
    if isinstance(v, compat.Literal):
      value = compat.literal_value(v)
      node = self.recorder.add(
        _graph.LITERAL,
        label=repr(v.val),
        static=True,
        shape=tuple(np.shape(value)),
        dtype=str(value.dtype) if _prims.is_float(value) else None,
        value=np.asarray(value) if _prims.is_float(value) else None,
      )
      return Val(value, _widen.widen(value), node.index)
    return env[v]

  def _equation(self, eqn: Any, ins: list[Val], context: Context) -> list[Val]:
    tangents = [i for i, x in enumerate(ins) if x.tangent]
    body = compat.call_body(eqn, keep_placement=False)
    if body is not None:
      return self._enter(eqn, body, ins, context)
    body = compat.ruled_call_body(eqn)
    remat = eqn.primitive is compat.remat_p
    if body is not None and (remat or not tangents):
      inner = dataclasses.replace(context, remat=context.remat or remat)
      return self._enter(eqn, body, ins, inner)
    if tangents:
      try:
        rule = _rules.rule_of(eqn, tangents, self._rules)
      except Exception:  # not differentiable here: its outputs carry none
        rule = None
      if rule is not None:
        return self._linearized(eqn, rule, ins, context)
    return self._plain(eqn, ins, context)

  def _enter(
    self, eqn: Any, body: Any, ins: list[Val], context: Context
  ) -> list[Val]:
    consts = self.constants(body.consts, "an array the code closes over")
    inner = dataclasses.replace(context, calls=(*context.calls, eqn))
    return self.forward(body.jaxpr, consts, ins, inner)

  def _plain(self, eqn: Any, ins: list[Val], context: Context) -> list[Val]:
    where = self._where_of(eqn, context)
    return self._operation(
      eqn, ins, where, _graph.FORWARD, eqn, context, tangent=False
    )

  def _linearized(
    self, eqn: Any, rule: _rules.Rule, ins: list[Val], context: Context
  ) -> list[Val]:
    where = self._where_of(eqn, context)
    first = len(self.recorder.nodes)
    forward = rule.forward
    consts = self.constants(forward.consts, "a constant of jax's rule")
    outs = self._run_rule(
      forward.jaxpr, consts, ins, where, _graph.DERIVATIVE, eqn, context
    )
    values, residuals = outs[: rule.outputs], outs[rule.outputs :]
    self._mark_equation(first, [v.node for v in values])
    values = [
      v._replace(tangent=_prims.is_float(v.value)) for v in values
    ]  # fmt: skip
    self._tape.append(_Entry(rule, where, eqn, context, ins, values, residuals))
    return values

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

  def backward(self, seeds: dict[int, Val]) -> dict[int, Val]:
    """Runs the backward rules in reverse order from the cotangents
    `seeds` (by node); returns every node's cotangent."""
    cotangents = dict(seeds)
    for entry in reversed(self._tape):
      floats = [o for o in entry.outs if _prims.is_float(o.value)]
      found = [cotangents.pop(o.node, None) for o in floats]
      if all(c is None for c in found):
        continue
      given = [
        c if c is not None else self._zeros(o, entry)
        for c, o in zip(found, floats, strict=True)
      ]
      backward = entry.rule.backward
      consts = self.constants(backward.consts, "a constant of jax's rule")
      ins_cts = self._run_rule(
        backward.jaxpr,
        consts,
        [*entry.residuals, *given],
        entry.where,
        _graph.BACKWARD,
        entry.owner,
        entry.context,
      )
      for i, ct in zip(entry.rule.differentiated, ins_cts, strict=True):
        self._accumulate(cotangents, entry.ins[i].node, ct, entry)
    return cotangents

  def _zeros(self, like: Val, entry: _Entry) -> Val:
    value = jnp.zeros(np.shape(like.value), like.value.dtype)
    node = self.recorder.add(
      _graph.LITERAL,
      label="0",
      static=True,
      shape=tuple(np.shape(value)),
      dtype=str(value.dtype),
      value=np.zeros((), value.dtype),
    )
    return Val(value, _widen.widen(value), node.index)

  def _accumulate(
    self, cotangents: dict[int, Val], node: int, ct: Val, entry: _Entry
  ) -> None:
    before = cotangents.get(node)
    if before is None:
      cotangents[node] = ct
      return
    value, shadow = lax.add(before.value, ct.value), before.shadow + ct.shadow
    added = self.recorder.add(
      _graph.OPERATION,
      label="add_any",
      inputs=(before.node, ct.node),
      where=dataclasses.replace(entry.where, primitive="add_any"),
      role=_graph.BACKWARD,
      owner=entry.owner.primitive.name,
      primitive=_prims.ADD,
      from_cotangent=True,
    )
    self.recorder.measure(added, value, shadow, [before.value, ct.value])
    cotangents[node] = Val(value, shadow, added.index)

  # ----------------------------------------------------------------- rules

  def _run_rule(
    self,
    jaxpr: Any,
    consts: Sequence[Val],
    args: Sequence[Val],
    where: _source.Where,
    role: str,
    owner: Any,
    context: Context,
  ) -> list[Val]:
    """Evaluates a rule's `jaxpr`, each operation named by `owner`'s
    `where` and its own primitive, calls inlined."""
    env: dict[Any, Val] = {}
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for op in jaxpr.eqns:
      ins = [self._read(env, v) for v in op.invars]
      body = compat.call_body(op, keep_placement=False)
      if body is None:
        body = compat.ruled_call_body(op)
      if body is not None:
        inner = self.constants(body.consts, "a constant of jax's rule")
        outs = self._run_rule(
          body.jaxpr, inner, ins, where, role, owner, context
        )
      else:
        outs = self._operation(op, ins, where, role, owner, context)
      for v, out in zip(op.outvars, outs, strict=True):
        if not isinstance(v, compat.DropVar):
          env[v] = out
    return [self._read(env, v) for v in jaxpr.outvars]

  # ------------------------------------------------------------ operations

  def _operation(
    self,
    op: Any,
    ins: list[Val],
    where: _source.Where,
    role: str,
    owner: Any,
    context: Context,
    tangent: bool = False,
  ) -> list[Val]:
    """Binds `op` in its dtypes and in float32, a node for each output,
    each floating-point one measured."""
    values = compat.bind(op, [x.value for x in ins])
    reference = True
    try:
      shadows = _widen.bind_wide(op, [x.shadow for x in ins])
    except _widen.NoReference:
      shadows, reference = [_widen.widen(v) for v in values], False
    layout, picker = _prims.is_layout(op), op.primitive in _prims.PICKERS
    if op is not owner or compat.bodies(op):
      where = dataclasses.replace(
        where,
        primitive=op.primitive.name,
        boundary=op.primitive.name if compat.bodies(op) else None,
      )
    common = dict(
      label=op.primitive.name,
      primitive=op.primitive,
      inputs=tuple(x.node for x in ins),
      where=where,
      role=role,
      owner=owner.primitive.name,
      layout=layout,
      picker=picker,
      reference=reference,
      static=all(self.recorder.nodes[x.node].static for x in ins),
      from_cotangent=any(
        self.recorder.nodes[x.node].from_cotangent for x in ins
      ),
      recomputed=context.remat and role == _graph.DERIVATIVE,
      custom_rule=_custom_rule(owner),
      host_call=compat.host_call_name(op) if compat.is_host_call(op) else None,
    )
    outs = []
    for k, (value, shadow) in enumerate(zip(values, shadows, strict=True)):
      node = self.recorder.add(_graph.OPERATION, **common)
      node.shape = tuple(np.shape(value))
      if _prims.is_float(value):
        node.dtype = str(value.dtype)
        if not layout:
          self._measure(node, op, k, value, shadow, ins)
      outs.append(Val(value, shadow, node.index, tangent))
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

  def _where_of(self, eqn: Any, context: Context) -> _source.Where:
    key = (id(eqn), tuple(id(c) for c in context.calls), context.scaling)
    found = self._where.get(key)
    if found is None:
      found = _source.where(
        eqn, context.calls, boundary=bool(compat.bodies(eqn))
      )
      if context.scaling:
        found = dataclasses.replace(found, scaling=True)
      self._where[key] = found
    return found


def _own_reference(op: Any, k: int, ins: list[Val]) -> Any:
  """`op`'s `k`-th output computed in float32 from its own inputs (not
  its shadow's): where it is not zero and the float16 output is, float16
  flushed a value to zero."""
  if op.primitive is _prims.CONVERT:
    return ins[0].value  # the value cast
  try:
    return _widen.bind_wide(op, [_widen.widen(x.value) for x in ins])[k]
  except _widen.NoReference:
    return None


def _custom_rule(owner: Any) -> str | None:
  """The name of the function whose custom derivative `owner` calls."""
  if owner.primitive not in (
    compat.custom_jvp_call_p,
    compat.custom_vjp_call_p,
  ):
    return None
  body = compat.ruled_call_body(owner)
  traced = None if body is None else compat.traced_function(body)
  return traced[0] if traced else "a function with a custom derivative"
