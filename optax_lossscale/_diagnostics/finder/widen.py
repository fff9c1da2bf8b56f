"""The float32 shadow of an operation: the same equation, its floating-point
dtypes narrower than float32 (float16, bfloat16, the float8s) widened to
float32, bound on the shadow's inputs.

Where an equation cannot be widened (a host callback or an FFI call, which
must run once and as written; a body that will not trace in float32), the
shadow takes the operation's own outputs, widened, and says it has no
reference: the finder then says less about that value.
"""

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._diagnostics.finder import primitives as _prims
from optax_lossscale._jaxpr import compat

WIDE = np.dtype(np.float32)


def widen_dtype(dtype: Any) -> Any:
  """float32 for a real floating-point dtype narrower than it; `dtype`
  otherwise."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return dtype  # a PRNG key's, say
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
    return WIDE
  return dtype


def widen(x: Any) -> Any:
  """`x` in its wide dtype (itself where that is its own)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or widen_dtype(dtype) == dtype:
    return x
  return jax.lax.convert_element_type(x, WIDE)


class NoReference(Exception):
  """The equation cannot be computed in float32: its shadow is its own
  output."""


def bind_wide(eqn: Any, ins: Sequence[Any]) -> list[Any]:
  """`eqn` bound on the shadow inputs `ins`, widened; raises `NoReference`
  where it cannot be."""
  if eqn.primitive in _prims.NO_REFERENCE or holds_host_call(eqn):
    raise NoReference(eqn.primitive)
  try:
    return compat.bind(eqn, list(ins), map_params=_widen_params)
  except NoReference:
    raise
  except Exception as e:  # a parameter this jax will not widen
    raise NoReference(eqn.primitive) from e


def holds_host_call(eqn: Any) -> bool:
  """Whether `eqn` is, or holds in a body, a host callback or an FFI call:
  those run once, as written, never again in another dtype."""
  if compat.is_host_call(eqn):
    return True
  return any(
    holds_host_call(inner)
    for body in compat.bodies(eqn)
    for inner in body.jaxpr.eqns
  )


def _widen_params(params: dict[str, Any]) -> dict[str, Any]:
  return {key: _widen_param(value) for key, value in params.items()}


def _widen_param(value: Any) -> Any:
  if isinstance(value, compat.ClosedJaxpr):
    return _widened_body(value)
  if isinstance(value, compat.Jaxpr):
    raise NoReference("an open body")  # entered or bound, never widened
  if isinstance(value, tuple) and any(
    isinstance(v, compat.ClosedJaxpr | compat.Jaxpr) for v in value
  ):
    return tuple(_widen_param(v) for v in value)
  if isinstance(value, np.dtype) or (
    isinstance(value, type) and issubclass(value, np.generic)
  ):
    try:
      return widen_dtype(value)
    except TypeError:  # not a dtype numpy knows (an extended one)
      return value
  return value


@functools.lru_cache(maxsize=256)
def _widened_body(body: Any) -> Any:
  """`body` (a `ClosedJaxpr`) traced again with its narrow floats wide."""
  avals = [
    jax.ShapeDtypeStruct(v.aval.shape, widen_dtype(v.aval.dtype))
    for v in body.jaxpr.invars
  ]
  widened = jax.make_jaxpr(functools.partial(evaluate_wide, body))(*avals)
  if widened.consts:  # a constant array the body's parameters cannot hold
    raise NoReference("a body with constants")
  return widened


def evaluate_wide(body: Any, *args: Any) -> list[Any]:
  """`body` (a `ClosedJaxpr`) evaluated on wide `args`, each equation
  widened, calls inlined."""
  jaxpr = body.jaxpr
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    if isinstance(v, compat.Literal):
      return widen(compat.literal_value(v))
    return env[v]

  for v, c in zip(jaxpr.constvars, body.consts, strict=True):
    env[v] = widen(c)
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = compat.call_body(eqn, keep_placement=False)
    if inner is None:
      inner = compat.ruled_call_body(eqn)
    if inner is not None:
      outs = evaluate_wide(inner, *ins)
    else:
      outs = bind_wide(eqn, ins)
    for v, out in zip(eqn.outvars, outs, strict=True):
      if not isinstance(v, compat.DropVar):
        env[v] = out
  return [read(v) for v in jaxpr.outvars]
