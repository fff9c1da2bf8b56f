"""Calls, loops, branches, rematerialization and `shard_map` under the
policy.

A call (`jit`) is evaluated in place, under its source information and
its name. A loop, a branch, a `jax.checkpoint` and a `shard_map` are issued
again through public jax (`lax.scan`, `lax.while_loop`, `lax.switch`,
`jax.checkpoint`, `jax.shard_map`) with the equation's own parameters,
around bodies that the interpreter evaluates under the same policy. A
loop's carries, and a branch's outputs, keep the dtypes they were traced
with: cast there where the body's policy changed them.

A `jit` that places or donates its inputs or outputs, and custom
derivative rules (`custom_jvp`, `custom_vjp`), run as they were traced,
their inputs cast back to their traced dtypes (`Evaluator.traced`).
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from optax_lossscale._autocast.values import Constant
from optax_lossscale._jaxpr import compat as _compat

if TYPE_CHECKING:
  from optax_lossscale._autocast.interpreter import Evaluator, Where

Outputs = tuple[list[Any], list[Constant | None]]


def evaluate(
  ev: "Evaluator",
  eqn: Any,
  invals: list[Any],
  incons: list[Constant | None],
  where: "Where",
  kept: bool,
) -> Outputs | None:
  """`eqn`'s outputs if it is a call, a loop, a branch, a remat or a
  `shard_map` (its body evaluated by `ev` inside `where`); None for any
  other equation."""
  handler = _HANDLERS.get(eqn.primitive)
  if handler is None:
    return None
  inner = where.inside(eqn, kept)
  return handler(ev, eqn, invals, incons, inner)


def _none(eqn: Any) -> list[Constant | None]:
  return [None] * len(eqn.outvars)


def _call(
  ev: "Evaluator",
  eqn: Any,
  invals: list[Any],
  incons: list[Constant | None],
  inner: "Where",
) -> Outputs:
  body = _compat.call_body(eqn)
  if body is None:  # it places or donates: bound whole, as traced
    return ev.traced(eqn, invals), _none(eqn)
  with _compat.inlined(eqn):
    return ev.run(body, invals, inner, constants=incons)


def _scan(
  ev: "Evaluator",
  eqn: Any,
  invals: list[Any],
  incons: list[Constant | None],
  inner: "Where",
) -> Outputs:
  params = eqn.params
  n_consts, n_carry = _compat.scan_layout(params)
  body = _compat.closed_jaxpr(params["jaxpr"])
  consts = invals[:n_consts]
  init = invals[n_consts : n_consts + n_carry]
  xs = invals[n_consts + n_carry :]
  carry_dtypes = [
    v.aval.dtype for v in eqn.invars[n_consts : n_consts + n_carry]
  ]
  constants = [
    *incons[:n_consts],
    *[None] * n_carry,
    *incons[n_consts + n_carry :],
  ]
  n_ys = len(body.jaxpr.outvars) - n_carry

  def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
    outs, _ = ev.run(
      body,
      [*consts, *carry, *x],
      inner,
      constants=constants,
      out_dtypes=[*carry_dtypes, *[None] * n_ys],
    )
    return outs[:n_carry], outs[n_carry:]

  with _compat.source_of(eqn), eqn.ctx.manager:
    init = [
      ev.cast_at(x, d, None) for x, d in zip(init, carry_dtypes, strict=True)
    ]
    carry, ys = jax.lax.scan(
      step,
      init,
      xs,
      length=params["length"],
      reverse=params["reverse"],
      unroll=params["unroll"],
    )
  return [*carry, *ys], _none(eqn)


def _while(
  ev: "Evaluator",
  eqn: Any,
  invals: list[Any],
  incons: list[Constant | None],
  inner: "Where",
) -> Outputs:
  params = eqn.params
  n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
  cond = _compat.closed_jaxpr(params["cond_jaxpr"])
  body = _compat.closed_jaxpr(params["body_jaxpr"])
  cond_consts = invals[:n_cond]
  body_consts = invals[n_cond : n_cond + n_body]
  init = invals[n_cond + n_body :]
  carry_dtypes = [v.aval.dtype for v in eqn.invars[n_cond + n_body :]]
  carries: list[Constant | None] = [None] * len(init)

  def cond_fun(carry: list[Any]) -> Any:
    constants = [*incons[:n_cond], *carries]
    (pred,), _ = ev.run(cond, [*cond_consts, *carry], inner, constants)
    return pred

  def body_fun(carry: list[Any]) -> list[Any]:
    constants = [*incons[n_cond : n_cond + n_body], *carries]
    outs, _ = ev.run(
      body, [*body_consts, *carry], inner, constants, out_dtypes=carry_dtypes
    )
    return outs

  with _compat.source_of(eqn), eqn.ctx.manager:
    init = [
      ev.cast_at(x, d, None) for x, d in zip(init, carry_dtypes, strict=True)
    ]
    return jax.lax.while_loop(cond_fun, body_fun, init), _none(eqn)


def _cond(
  ev: "Evaluator",
  eqn: Any,
  invals: list[Any],
  incons: list[Constant | None],
  inner: "Where",
) -> Outputs:
  index, *operands = invals
  out_dtypes = [v.aval.dtype for v in eqn.outvars]

  def branch(jaxpr: Any) -> Callable[..., list[Any]]:
    body = _compat.closed_jaxpr(jaxpr)

    def run(*ops: Any) -> list[Any]:
      outs, _ = ev.run(body, list(ops), inner, incons[1:], out_dtypes)
      return outs

    return run

  branches = [branch(b) for b in eqn.params["branches"]]
  with _compat.source_of(eqn), eqn.ctx.manager:
    return jax.lax.switch(index, branches, *operands), _none(eqn)


def _remat(
  ev: "Evaluator",
  eqn: Any,
  invals: list[Any],
  incons: list[Constant | None],
  inner: "Where",
) -> Outputs:
  body = _compat.ruled_call_body(eqn)

  def rematted(*args: Any) -> list[Any]:
    return ev.run(body, list(args), inner, constants=incons)[0]

  arguments = _compat.remat_arguments(eqn.params)
  with _compat.source_of(eqn), eqn.ctx.manager:
    return jax.checkpoint(rematted, **arguments)(*invals), _none(eqn)


def _shard_map(
  ev: "Evaluator",
  eqn: Any,
  invals: list[Any],
  incons: list[Constant | None],
  inner: "Where",
) -> Outputs:
  body = _compat.closed_jaxpr(eqn.params["jaxpr"])

  def mapped(*args: Any) -> tuple[Any, ...]:
    return tuple(ev.run(body, list(args), inner, constants=incons)[0])

  arguments = _compat.shard_map_arguments(eqn.params)
  with _compat.source_of(eqn), eqn.ctx.manager:
    return list(jax.shard_map(mapped, **arguments)(*invals)), _none(eqn)


_HANDLERS: dict[Any, Callable[..., Outputs]] = {
  **{p: _call for p in _compat.CALLS},
  **{
    p: handler
    for p, handler in (
      (_compat.scan_p, _scan),
      (_compat.while_p, _while),
      (_compat.cond_p, _cond),
      (_compat.remat_p, _remat),
      (_compat.policy_primitive("shard_map_p"), _shard_map),
    )
    if p is not None
  },
}
