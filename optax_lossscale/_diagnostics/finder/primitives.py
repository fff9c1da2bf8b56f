"""The classes of jax primitives that the finder tells apart, by object,
built when the finder loads.

Primitives are matched by identity, never by name: names change between jax
versions (`closed_call` is `eval_jaxpr` on jax 0.12), objects are what
`jax.extend.core.primitives` exports for the purpose. The tables are built
here, not when the package is imported: a jax that lacks one of them still
imports the package and trains, and only the finder says what it lacks
(`require`).
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import primitives as _exported

from optax_lossscale._jaxpr import compat

# What this jax lacks of the primitives below, by name.
MISSING: list[str] = []


def _objects(*names: str) -> frozenset[Any]:
  found = []
  for name in names:
    primitive = getattr(_exported, name, None)
    if primitive is None:
      MISSING.append(name)
    else:
      found.append(primitive)
  return frozenset(found)


# Operations that only rearrange their inputs' elements (or copy them): an
# output element is an input element, so an output is finite exactly when
# its inputs are. They are not measured; their facts are their inputs'.
LAYOUT = _objects(
  "broadcast_in_dim_p",
  "concatenate_p",
  "copy_p",
  "device_put_p",
  "pad_p",
  "reshape_p",
  "rev_p",
  "sharding_constraint_p",
  "squeeze_p",
  "stop_gradient_p",
  "transpose_p",
)

# Operations that pick some of their inputs' elements: they make no value
# of their own, but may drop a non-finite one (`where`, a slice), and a
# gather fills NaN where its index is out of range.
PICKERS = _objects(
  "clamp_p",
  "dynamic_slice_p",
  "dynamic_update_slice_p",
  "gather_p",
  "max_p",
  "min_p",
  "reduce_max_p",
  "reduce_min_p",
  "select_n_p",
  "slice_p",
)

# Operations whose output element depends only on the input elements at
# its own position (inputs of the output's shape, or scalars): what an
# element's inputs were is known by position.
ELEMENTWISE = _objects(
  "abs_p", "acos_p", "acosh_p", "add_p", "add_jaxvals_p", "asin_p",
  "asinh_p", "atan2_p", "atan_p", "atanh_p", "cbrt_p", "ceil_p", "clamp_p",
  "complex_p", "conj_p", "convert_element_type_p", "cos_p", "cosh_p",
  "digamma_p", "div_p", "erf_inv_p", "erf_p", "erfc_p", "exp2_p", "exp_p",
  "expm1_p", "floor_p", "imag_p", "integer_pow_p", "lgamma_p", "log1p_p",
  "log_p", "logistic_p", "max_p", "min_p", "mul_p", "neg_p", "nextafter_p",
  "pow_p", "real_p", "reduce_precision_p", "rem_p", "round_p", "rsqrt_p",
  "select_n_p", "sign_p", "sin_p", "sinh_p", "sqrt_p", "square_p", "sub_p",
  "tan_p", "tanh_p",
)  # fmt: skip

# Arithmetic whose float16 result may round to zero where float32's does
# not: the finder recomputes it in float32 from the same inputs to count
# what float16 flushed (casts are counted too, against the value cast).
FLUSHING = _objects("mul_p", "div_p", "integer_pow_p", "square_p")

# Operations whose float32 recomputation would not be the same operation.
NO_REFERENCE = _objects(
  "bitcast_convert_type_p", "reduce_precision_p", "nextafter_p"
)

(CONVERT,) = _objects("convert_element_type_p") or (None,)
(GATHER,) = _objects("gather_p") or (None,)
(ADD,) = _objects("add_p") or (None,)


def require() -> None:
  """Raises, naming them, where this jax lacks primitives the finder
  tells apart: its verdicts would be wrong, not merely less detailed."""
  missing = list(MISSING)
  if compat.remat_p is None:
    missing.append("remat_p")
  if missing:
    raise RuntimeError(
      f"find_overflow does not run on jax {jax.__version__}: it lacks the"
      f" primitives {', '.join(missing)} (jax.extend.core.primitives),"
      " which the finder tells apart. Training is not affected."
    )


def is_layout(eqn: Any) -> bool:
  """Whether `eqn` only rearranges its inputs' elements, a cast to a dtype
  that holds every value of its input's (a widening) included."""
  if eqn.primitive is CONVERT:
    (source,), (target,) = eqn.invars, eqn.outvars
    return widens(source.aval, target.aval)
  return eqn.primitive in LAYOUT


def is_float(aval: Any) -> bool:
  """Whether `aval` (or an array) is of a floating-point or complex dtype
  (an extended dtype, a PRNG key, is neither)."""
  dtype = getattr(aval, "dtype", None)
  return (
    dtype is not None
    and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
    and jnp.issubdtype(dtype, jnp.inexact)
  )


def is_real_float(aval: Any) -> bool:
  return is_float(aval) and jnp.issubdtype(aval.dtype, jnp.floating)


def widens(source: Any, target: Any) -> bool:
  """Whether a cast from `source`'s float dtype to `target`'s holds every
  value (float16 to float32, say), so that it makes no value of its own."""
  if not (is_real_float(source) and is_real_float(target)):
    return False
  small, large = jnp.finfo(source.dtype), jnp.finfo(target.dtype)
  return (
    float(large.max) >= float(small.max)
    and float(large.tiny) <= float(small.tiny)
    and large.nmant >= small.nmant
  )
