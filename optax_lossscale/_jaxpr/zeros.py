"""Which outputs of a function are zero whatever its inputs, as its jaxpr
says: a literal zero, and what only moves, casts or combines zeros (the
updates `optax.set_to_zero` makes for a frozen parameter are
`broadcast_in_dim 0.0`).

A static reading of the program, made while tracing: nothing is computed,
and where it cannot tell (a primitive it does not know), an output is not
zero.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from optax_lossscale._jaxpr import compat as _compat


def _primitives(*names: str) -> frozenset[Any]:
  found = (_compat.policy_primitive(name) for name in names)
  return frozenset(p for p in found if p is not None)


# Zero where their (first) operand is: they move or cast values.
_MOVING = _primitives(
  "broadcast_in_dim_p",
  "convert_element_type_p",
  "copy_p",
  "neg_p",
  "reduce_precision_p",
  "reshape_p",
  "squeeze_p",
  "transpose_p",
)
# Zero where every operand is.
_COMBINING = _primitives("add_p", "sub_p", "concatenate_p")
# Zero where every case is (operand 0 picks one).
_SELECT = _primitives("select_n_p")


def zero_outputs(fun: Callable[..., Any], *args: Any) -> list[bool]:
  """For each leaf of `fun(*args)`'s output, whether it is zero whatever
  the values of `args` (traced, never computed)."""
  closed = jax.make_jaxpr(fun)(*args)
  return _zeros(closed.jaxpr, closed.consts, [False] * len(closed.jaxpr.invars))


def _zeros(jaxpr: Any, consts: Sequence[Any], inputs: list[bool]) -> list[bool]:
  zero: set[Any] = set()
  for var, const in zip(jaxpr.constvars, consts, strict=True):
    if _all_zero(const):
      zero.add(var)
  for var, is_zero in zip(jaxpr.invars, inputs, strict=True):
    if is_zero:
      zero.add(var)
  for eqn in jaxpr.eqns:
    operands = [_is_zero(atom, zero) for atom in eqn.invars]
    outputs = _outputs(eqn, operands)
    zero.update(v for v, z in zip(eqn.outvars, outputs, strict=True) if z)
  return [_is_zero(atom, zero) for atom in jaxpr.outvars]


def _outputs(eqn: Any, operands: list[bool]) -> list[bool]:
  """Which of `eqn`'s outputs are zero, given which operands are."""
  n = len(eqn.outvars)
  body = _compat.call_body(eqn) or _compat.ruled_call_body(eqn)
  if body is not None and len(body.jaxpr.invars) == len(operands):
    return _zeros(body.jaxpr, body.consts, operands)
  if eqn.primitive in _MOVING:
    return [bool(operands) and operands[0]] * n
  if eqn.primitive in _COMBINING:
    return [bool(operands) and all(operands)] * n
  if eqn.primitive in _SELECT:
    return [len(operands) > 1 and all(operands[1:])] * n
  return [False] * n


def _is_zero(atom: Any, zero: set[Any]) -> bool:
  if isinstance(atom, _compat.Literal):
    return _all_zero(_compat.literal_value(atom))
  return atom in zero


def _all_zero(value: Any) -> bool:
  if isinstance(value, jax.core.Tracer):
    return False
  try:
    return bool(np.all(np.asarray(value) == 0))
  except (TypeError, ValueError):  # not an array of numbers (a key, say)
    return False
