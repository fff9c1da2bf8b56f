"""Each equation's derivative as jax computes it, in two small programs that
the finder runs operation by operation:

- its *forward rule*: the equation's outputs, and what the backward pass
  keeps of the forward one (jax's residuals: inputs, outputs, and the
  derivative's own values, rsqrt's `-0.5 * x**-1.5` say);
- its *backward rule*: its inputs' cotangents from its outputs'.

Both are traced from `jax.vjp` of the equation alone, so that their
operations are jax's own (custom derivative rules included), and the
finder knows of each operation which equation it belongs to and which
part it is: the equation itself, its derivative, or its backward rule.
They are traced once per kind of equation (primitive, parameters, input
types) and reused: a model of a hundred identical layers is traced once.
"""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from optax_lossscale._diagnostics.finder.primitives import is_float
from optax_lossscale._jaxpr import compat


class Rule:
  """An equation's derivative, for the inputs in `differentiated`; its
  backward rule is traced when a cotangent first reaches it (a `while`
  loop, say, has a forward rule but none backward)."""

  def __init__(
    self,
    forward: Any,
    outputs: int,
    differentiated: tuple[int, ...],
    trace_backward: Any,
  ):
    self.forward = forward  # ClosedJaxpr: (*inputs) -> (*outputs, *residuals)
    self.outputs = outputs
    self.differentiated = differentiated
    self._trace_backward = trace_backward
    self._backward: Any = None

  @property
  def backward(self) -> Any:
    """ClosedJaxpr: (*residuals, *float cotangents) -> input cotangents."""
    if self._backward is None:
      self._backward = self._trace_backward()
    return self._backward


def rule_of(
  eqn: Any, differentiated: Sequence[int], traced: dict[Any, Rule]
) -> Rule:
  """`eqn`'s rule for its inputs `differentiated` (positions), traced once
  per kind of equation (`traced` holds those traced so far)."""
  avals = tuple(v.aval for v in eqn.invars)
  key = (eqn.primitive, _params_key(eqn.params), avals, tuple(differentiated))
  try:
    found = traced.get(key)
  except TypeError:  # a parameter that does not hash
    return _trace(eqn, avals, tuple(differentiated))
  if found is None:
    found = traced[key] = _trace(eqn, avals, tuple(differentiated))
  return found


def _params_key(params: dict[str, Any]) -> Any:
  return tuple(sorted(params.items()))


def _shape_of(aval: Any) -> jax.ShapeDtypeStruct:
  """`aval` as a shape to trace with, sharded as it is where it is sharded
  over an `Explicit` mesh axis: jax 0.7.1 types a transposed product of
  such values only from their shardings."""
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is not None and any(axis is not None for axis in spec):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _trace(
  eqn: Any, avals: tuple[Any, ...], differentiated: tuple[int, ...]
) -> Rule:
  tree: list[Any] = []

  def forward(*ins: Any) -> tuple[list[Any], list[Any]]:
    def equation(*values: Any) -> list[Any]:
      args = list(ins)
      for i, x in zip(differentiated, values, strict=True):
        args[i] = x
      return compat.bind(eqn, args)

    outs, pullback = jax.vjp(equation, *[ins[i] for i in differentiated])
    leaves, treedef = jax.tree.flatten(pullback)
    tree.append(treedef)
    return outs, leaves

  specs = [_shape_of(a) for a in avals]
  forward_jaxpr, (out_shapes, residual_shapes) = jax.make_jaxpr(
    forward, return_shape=True
  )(*specs)
  (treedef,) = tree
  floats = [is_float(s) for s in out_shapes]

  def backward(residuals: list[Any], cotangents: list[Any]) -> list[Any]:
    given = iter(cotangents)
    full = [
      next(given) if f else np.zeros(s.shape, jax.dtypes.float0)
      for f, s in zip(floats, out_shapes, strict=True)
    ]
    return list(jax.tree.unflatten(treedef, residuals)(full))

  def trace_backward() -> Any:
    return jax.make_jaxpr(backward)(
      list(residual_shapes),
      [s for s, f in zip(out_shapes, floats, strict=True) if f],
    )

  return Rule(forward_jaxpr, len(out_shapes), differentiated, trace_backward)
