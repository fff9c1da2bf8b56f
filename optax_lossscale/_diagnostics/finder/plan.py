"""The program as a flat list of steps, before anything runs: `fun`'s
equations with its calls entered (`jit`, whether it places or donates its
arguments or not; `jax.checkpoint`; a custom derivative's call that nothing
differentiates), each with the values it reads and makes (by number), the
calls it is inside, and, where it is differentiated, its derivative's
rules (`rules`)."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from optax_lossscale._diagnostics.finder import rules as _rules
from optax_lossscale._diagnostics.finder.primitives import is_float
from optax_lossscale._jaxpr import compat


@dataclasses.dataclass(frozen=True)
class Context:
  """Where an equation is: the calls it is inside (outermost first), and
  what they make of it."""

  calls: tuple[Any, ...] = ()
  remat: bool = False  # inside `jax.checkpoint`
  scaling: bool = False  # the finder's own loss scaling


@dataclasses.dataclass
class Value:
  """A value of the program, before it exists."""

  aval: Any
  tangent: bool  # computed from the differentiated parameters
  array: Any = None  # a constant's, known before the run


@dataclasses.dataclass
class Step:
  """One equation to run: the values it reads (numbers, or a literal) and
  makes, and its derivative's rules where it is differentiated."""

  eqn: Any
  context: Context
  ins: list[Any]  # value numbers, or `compat.Literal`s
  outs: list[int]
  rule: _rules.Rule | None
  scope: str  # its outermost name scope, where the program splits


class Plan:
  """The steps of a program, and its values."""

  def __init__(self) -> None:
    self.values: list[Value] = []
    self.steps: list[Step] = []
    self._rules: dict[Any, _rules.Rule] = {}

  def value(self, aval: Any, tangent: bool, array: Any = None) -> int:
    self.values.append(Value(aval, tangent, array))
    return len(self.values) - 1

  def constants(self, arrays: Sequence[Any]) -> list[int]:
    return [self.value(_aval(c), False, c) for c in arrays]

  def add(
    self,
    jaxpr: Any,
    consts: Sequence[int],
    args: Sequence[Any],
    context: Context,
  ) -> list[Any]:
    """The steps of `jaxpr` (open) on values `consts` and `args`; returns
    its outputs (value numbers, or literals)."""
    env: dict[Any, Any] = {}
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
      ins = [v if isinstance(v, compat.Literal) else env[v] for v in eqn.invars]
      outs = self._equation(eqn, ins, context)
      for v, out in zip(eqn.outvars, outs, strict=True):
        if not isinstance(v, compat.DropVar):
          env[v] = out
    return [
      v if isinstance(v, compat.Literal) else env[v] for v in jaxpr.outvars
    ]

  def _tangent(self, x: Any) -> bool:
    return not isinstance(x, compat.Literal) and self.values[x].tangent

  def _equation(self, eqn: Any, ins: list[Any], context: Context) -> list[Any]:
    tangents = [i for i, x in enumerate(ins) if self._tangent(x)]
    body = compat.call_body(eqn, keep_placement=False)
    if body is not None:
      return self._enter(eqn, body, ins, context)
    body = compat.ruled_call_body(eqn)
    remat = eqn.primitive is compat.remat_p
    if body is not None and (remat or not tangents):
      inner = dataclasses.replace(context, remat=context.remat or remat)
      return self._enter(eqn, body, ins, inner)
    rule = None
    if tangents:
      try:
        rule = _rules.rule_of(eqn, tangents, self._rules)
      except Exception:  # not differentiable here: its outputs carry none
        rule = None
    outs = [
      self.value(v.aval, rule is not None and is_float(v.aval))
      for v in eqn.outvars
    ]
    self.steps.append(
      Step(eqn, context, ins, outs, rule, _outer_scope(eqn, context))
    )
    return list(outs)

  def _enter(
    self, eqn: Any, body: Any, ins: list[Any], context: Context
  ) -> list[Any]:
    consts = self.constants(body.consts)
    inner = dataclasses.replace(context, calls=(*context.calls, eqn))
    return self.add(body.jaxpr, consts, ins, inner)


def _aval(x: Any) -> Any:
  return jax.typeof(x)


def _outer_scope(eqn: Any, context: Context) -> str:
  """The outermost name scope the equation is in (`layer_3`), or ''."""
  for e in (*context.calls, eqn):
    names, _ = compat.name_scopes(e)
    if names:
      return names[0]
  return ""
