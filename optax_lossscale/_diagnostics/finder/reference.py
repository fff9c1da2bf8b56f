"""An operation recomputed in float32 from the same inputs: where float16
rounds a value to zero and float32 does not, float16 flushed it."""

from typing import Any

import jax.numpy as jnp
import numpy as np

from optax_lossscale._diagnostics.finder.primitives import NO_REFERENCE
from optax_lossscale._jaxpr import compat as _compat


def float32_reference(eqn: Any, ins: list[Any]) -> list[Any] | None:
  """`eqn`'s outputs computed in float32 from the same inputs (float16
  inputs and dtype parameters widened), or None where that would not be
  the same operation: control flow, bit casts, precision casts."""
  if eqn.primitive in NO_REFERENCE or has_body(eqn):
    return None
  subfuns, params = _compat.bind_args(eqn)
  if subfuns:
    return None
  widened = {key: _widen_dtype(value) for key, value in params.items()}
  wide_ins = [
    x.astype(jnp.float32) if hasattr(x, "dtype") and x.dtype == jnp.float16
    else x
    for x in ins
  ]  # fmt: skip
  try:
    outs = eqn.primitive.bind(*wide_ins, **widened)
  except Exception:  # a primitive that takes no float32: no reference
    return None
  outs = list(outs) if eqn.primitive.multiple_results else [outs]
  for out, v in zip(outs, eqn.outvars, strict=True):
    if jnp.shape(out) != v.aval.shape:
      return None
  return outs


def _widen_dtype(value: Any) -> Any:
  if isinstance(value, np.dtype | type) and value in (
    np.float16,
    jnp.float16,
  ):
    return np.dtype(np.float32)
  return value


def has_body(eqn: Any) -> bool:
  """Whether `eqn` holds a jaxpr (control flow, a call not entered)."""

  def is_body(value: Any) -> bool:
    if isinstance(value, _compat.Jaxpr | _compat.ClosedJaxpr):
      return True
    return isinstance(value, tuple | list) and any(map(is_body, value))

  return any(is_body(value) for value in eqn.params.values())
