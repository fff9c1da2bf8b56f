"""The classes of jax primitives that the finder tells apart, by object.

Primitives are matched by identity, never by name: names change between jax
versions (`closed_call` is `eval_jaxpr` on jax 0.12), objects are what
`jax.extend.core.primitives` exports for the purpose.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import primitives as _p

from optax_lossscale._jaxpr import compat

# Operations that only rearrange their inputs' elements (or copy them): an
# output element is an input element, so an output is finite exactly when
# its inputs are. They are not measured; the finder derives their
# finiteness from their inputs'.
LAYOUT = frozenset(
  {
    _p.broadcast_in_dim_p,
    _p.concatenate_p,
    _p.copy_p,
    _p.device_put_p,
    _p.pad_p,
    _p.reshape_p,
    _p.rev_p,
    _p.sharding_constraint_p,
    _p.squeeze_p,
    _p.stop_gradient_p,
    _p.transpose_p,
  }
)

# Operations that pick some of their inputs' elements: they make no value
# of their own, but may drop a non-finite one (`where`, a slice). They are
# measured for infs and NaNs only (a gather with an index out of range
# fills NaN: that is made there).
PICKERS = frozenset(
  {
    _p.clamp_p,
    _p.dynamic_slice_p,
    _p.dynamic_update_slice_p,
    _p.gather_p,
    _p.max_p,
    _p.min_p,
    _p.reduce_max_p,
    _p.reduce_min_p,
    _p.select_n_p,
    _p.slice_p,
  }
)

# Operations whose output element depends only on the input elements at
# its own position (inputs of the output's shape, or scalars): an element
# made non-finite is known by position.
ELEMENTWISE = frozenset(
  {
    _p.abs_p, _p.acos_p, _p.acosh_p, _p.add_p, _p.add_jaxvals_p, _p.asin_p,
    _p.asinh_p, _p.atan2_p, _p.atan_p, _p.atanh_p, _p.cbrt_p, _p.ceil_p,
    _p.clamp_p, _p.convert_element_type_p, _p.cos_p, _p.cosh_p, _p.digamma_p,
    _p.div_p, _p.erf_inv_p, _p.erf_p, _p.erfc_p, _p.exp2_p, _p.exp_p,
    _p.expm1_p, _p.floor_p, _p.integer_pow_p, _p.lgamma_p, _p.log1p_p,
    _p.log_p, _p.logistic_p, _p.max_p, _p.min_p, _p.mul_p, _p.neg_p,
    _p.nextafter_p, _p.pow_p, _p.reduce_precision_p, _p.rem_p, _p.round_p,
    _p.rsqrt_p, _p.select_n_p, _p.sign_p, _p.sin_p, _p.sinh_p, _p.sqrt_p,
    _p.square_p, _p.sub_p, _p.tan_p, _p.tanh_p,
  }
)  # fmt: skip

# A float32 recomputation would not mean the same thing for these.
NO_REFERENCE = frozenset(
  {_p.bitcast_convert_type_p, _p.reduce_precision_p, _p.nextafter_p}
)

CONVERT = _p.convert_element_type_p


# `remat_p` lives where each jax has it (compat).
REMAT = compat.remat_p


def is_layout(eqn: Any) -> bool:
  """Whether `eqn` only rearranges its inputs' elements, a cast to a dtype
  that holds every value of its input's (a widening) included."""
  if eqn.primitive is CONVERT:
    (source,), (target,) = eqn.invars, eqn.outvars
    return widens(source.aval, target.aval)
  return eqn.primitive in LAYOUT


def is_picker(eqn: Any) -> bool:
  return eqn.primitive in PICKERS


def is_remat(eqn: Any) -> bool:
  return eqn.primitive is REMAT


def is_float(aval: Any) -> bool:
  """Whether `aval` (or an array) is of a real floating-point dtype."""
  dtype = getattr(aval, "dtype", None)
  return (
    dtype is not None
    and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
    and jnp.issubdtype(dtype, jnp.floating)
  )


def widens(source: Any, target: Any) -> bool:
  """Whether a cast from `source`'s float dtype to `target`'s holds every
  value (float16 to float32, say), so that it makes no value of its own."""
  if not (is_float(source) and is_float(target)):
    return False
  small, large = jnp.finfo(source.dtype), jnp.finfo(target.dtype)
  return (
    float(large.max) >= float(small.max)
    and float(large.tiny) <= float(small.tiny)
    and large.nmant >= small.nmant
  )
