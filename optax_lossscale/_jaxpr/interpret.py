"""A jaxpr interpreter that hands every value it makes to its caller.

`evaluate` re-binds a jaxpr's equations one by one, under the equations' own
source information, and calls a `Visitor` with each equation's outputs. The
visitor may replace them (the skip selects inner-state values where they are
made) or only look at them. Calls
(`jit`, `closed_call`) can be entered, so that what a visitor does inside
them is seen by the rest of the computation; every other primitive is bound
as it is, control flow included.

Under a trace (`jit`, `make_jaxpr`) the result is a new program; eagerly,
each equation runs as it is bound.

Which primitives are calls, where their bodies are and how an equation is
re-bound are jax internals: `compat` holds them.
"""

from collections.abc import Sequence
from typing import Any, Protocol

from optax_lossscale._jaxpr import compat as _compat


class Visitor(Protocol):
  """What `evaluate` asks of its caller."""

  def enter(self, eqn: Any, body: Any) -> "Visitor | None":
    """The visitor for the body of call `eqn` (a `ClosedJaxpr`), to evaluate
    it equation by equation; None binds the call whole."""
    ...

  def produced(self, eqn: Any, values: list[Any]) -> list[Any]:
    """`eqn`'s output values, or what to use in their place. Called for every
    equation, a call that was entered included (after its body)."""
    ...


def evaluate(
  jaxpr: Any,
  consts: Sequence[Any],
  args: Sequence[Any],
  visitor: Visitor,
) -> list[Any]:
  """Evaluates `jaxpr` (an open `Jaxpr`) on `consts` and `args`, handing
  every equation's outputs to `visitor`; returns the jaxpr's outputs.

  The bodies of `compat.CALLS` are offered to `visitor.enter`.
  """
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    if isinstance(v, _compat.Literal):
      return v.val
    return env[v]

  def write(variables: Sequence[Any], values: Sequence[Any]) -> None:
    for v, val in zip(variables, values, strict=True):
      if not isinstance(v, _compat.DropVar):
        env[v] = val

  write(jaxpr.constvars, consts)
  write(jaxpr.invars, args)
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    body = _compat.call_body(eqn)
    inner = None if body is None else visitor.enter(eqn, body)
    if inner is not None:
      with _compat.inlined(eqn):
        outvals = evaluate(body.jaxpr, body.consts, invals, inner)
    else:
      outvals = _compat.bind(eqn, invals)
    write(eqn.outvars, visitor.produced(eqn, outvals))
  return [read(v) for v in jaxpr.outvars]


def produced_inside(body: Any) -> list[bool]:
  """For each output of `body`, whether an equation of `body` makes it (not a
  literal, an input or a constant passed through) and no other output is the
  same value: only then can a visitor of the body stand in for the call's
  visitor on that output."""
  passed_through = set(body.jaxpr.invars) | set(body.jaxpr.constvars)
  outvars = body.jaxpr.outvars
  return [
    isinstance(v, _compat.Var)
    and v not in passed_through
    and sum(w is v for w in outvars) == 1
    for v in outvars
  ]
