"""A jaxpr interpreter that hands every value it makes to its caller.

`evaluate` re-binds a jaxpr's equations one by one, under the equations' own
source information, and calls a `Visitor` with each equation's outputs. The
visitor may replace them (the skip selects inner-state values where they are
made) or only look at them (the overflow finder measures them). Calls
(`jit`, `closed_call`) can be entered, so that what a visitor does inside
them is seen by the rest of the computation; every other primitive is bound
as it is, control flow included.

Under a trace (`jit`, `make_jaxpr`) the result is a new program; eagerly,
each equation runs as it is bound.
"""

from collections.abc import Sequence
from typing import Any, Protocol

import jax

from optax_lossscale._core import compat as _compat

# Primitives whose equation holds a closed jaxpr that runs exactly once.
_CALLS = ("jit", "pjit", "closed_call")

# Primitives whose equation holds a jaxpr that runs exactly once, under a
# rule of its own: rematerialization, a custom derivative. Entered, the rule
# is lost, so only a caller whose result is neither differentiated nor
# compiled for its memory use may enter them (the overflow finder does).
_RULED_CALLS = (
  "checkpoint",
  "remat2",
  "custom_jvp_call",
  "custom_vjp_call",
  "custom_vjp_call_jaxpr",
)


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
  *,
  ruled_calls: bool = False,
) -> list[Any]:
  """Evaluates `jaxpr` (an open `Jaxpr`) on `consts` and `args`, handing
  every equation's outputs to `visitor`; returns the jaxpr's outputs.

  With `ruled_calls`, the bodies of remat and of custom-derivative calls
  are offered to `visitor.enter` too (see `_RULED_CALLS`).
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
    body = call_body(eqn)
    if body is None and ruled_calls:
      body = ruled_call_body(eqn)
    inner = None if body is None else visitor.enter(eqn, body)
    if inner is not None:
      with _compat.source_of(eqn, inlined=True):
        outvals = evaluate(
          body.jaxpr, body.consts, invals, inner, ruled_calls=ruled_calls
        )
    else:
      outvals = bind(eqn, invals)
    write(eqn.outvars, visitor.produced(eqn, outvals))
  return [read(v) for v in jaxpr.outvars]


def bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
  """Binds `eqn`'s primitive on `invals`, as the equation does; a list of
  its outputs."""
  subfuns, params = _compat.bind_args(eqn)
  with _compat.source_of(eqn), eqn.ctx.manager:
    outvals = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(outvals) if eqn.primitive.multiple_results else [outvals]


def call_body(eqn: Any) -> Any:
  """The body of a call equation (a `ClosedJaxpr`) that may be evaluated in
  its caller's place, or None.

  A `jit` that places its inputs or outputs (`in_shardings`,
  `out_shardings`) or donates them is not: entered, those would be lost.
  """
  if eqn.primitive.name not in _CALLS:
    return None
  body = eqn.params.get("jaxpr")
  if body is None:
    body = eqn.params.get("call_jaxpr")
  if not isinstance(body, _compat.ClosedJaxpr):
    return None
  placed = [
    s
    for key in ("in_shardings", "out_shardings")
    for s in eqn.params.get(key, ())
    if isinstance(s, jax.sharding.Sharding)
  ]
  if placed or any(eqn.params.get("donated_invars", ())):
    return None
  return body


def ruled_call_body(eqn: Any) -> Any:
  """The body of a remat or custom-derivative call (a `ClosedJaxpr`), or
  None; evaluated in the call's place it computes the call's outputs."""
  if eqn.primitive.name not in _RULED_CALLS:
    return None
  for key in ("call_jaxpr", "fun_jaxpr", "jaxpr"):
    body = eqn.params.get(key)
    if isinstance(body, _compat.ClosedJaxpr):
      return body
    if isinstance(body, _compat.Jaxpr) and not body.constvars:
      return _compat.ClosedJaxpr(body, [])  # remat's body is open
  return None


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
