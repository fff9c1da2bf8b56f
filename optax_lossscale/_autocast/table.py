"""Which jax primitive runs in which dtype under the policy, and why.

Each primitive is matched by object (`compat.policy_primitive`). The rows
are torch.autocast's CUDA lists (`docs/autocast.md` has the table, and
`tests/test_autocast_table.py` checks that the page and this module agree)
mapped to the primitives that jax's own functions bind: softmax is
`reduce_max`, `sub`, `exp`, `reduce_sum`, `div`; a norm is `square` or
`integer_pow`, a summing reduction, `rsqrt`. A primitive not listed here
runs in the dtypes it was traced with, its inputs cast back to them: host
callbacks, FFI calls, Pallas kernels and whatever a new jax adds.
"""

import enum
from typing import Any

from optax_lossscale._jaxpr import compat as _compat


class Rule(enum.Enum):
  """How an equation's floating-point operands are cast."""

  PRODUCT = "product"  # to the compute dtype; the result in it too
  FLOAT32 = "float32"  # float16 and bfloat16 operands to float32
  FOLLOW = "follow"  # as they come; mixed dtypes to one (`Policy.mixed`)
  EACH = "each"  # each operand as it comes, none cast to another's dtype
  CAST = "cast"  # `convert_element_type`: the cast as written
  TRACED = "traced"  # back to the dtypes the equation was traced with


# (rule, why, primitive names); a name that the running jax lacks is left
# out (`log2_p`, `one_minus_square_p` and `polynomial_p` are new in jax
# 0.12).
ROWS: tuple[tuple[Rule, str, tuple[str, ...]], ...] = (
  (
    Rule.PRODUCT,
    "two thirds of a step's arithmetic, and what float16 hardware is fast"
    " at; backward, their transposes are products in the compute dtype too",
    ("dot_general_p", "conv_general_dilated_p", "ragged_dot_general_p"),
  ),
  (
    Rule.FLOAT32,
    "exponentials overflow float16 early (exp above 11) and their"
    " derivatives with them",
    ("exp_p", "exp2_p", "expm1_p"),
  ),
  (
    Rule.FLOAT32,
    "near 0 a logarithm's derivative `1/x` overflows float16 (below `2**-16`)",
    ("log_p", "log1p_p", "log2_p"),
  ),
  (
    Rule.FLOAT32,
    "powers overflow float16 early: a norm's square of activations above"
    " 256, the cube of tanh-gelu above 40",
    (
      "pow_p",
      "integer_pow_p",
      "square_p",
      "one_minus_square_p",
      "polynomial_p",
    ),
  ),
  (
    Rule.FLOAT32,
    "rsqrt's derivative `-x**-1.5/2` overflows float16 below about"
    " `2**-11`,"
    " the variance of a quiet token",
    ("rsqrt_p",),
  ),
  (
    Rule.FLOAT32,
    "a sum over many values overflows float16 and drops the small ones",
    (
      "reduce_sum_p",
      "reduce_prod_p",
      "cumsum_p",
      "cumprod_p",
      "cumlogsumexp_p",
      "reduce_window_sum_p",
    ),
  ),
  (
    Rule.FLOAT32,
    "torch.autocast's float32 list: results or derivatives that grow"
    " without bound near a point (tan near pi/2, acos near 1)",
    (
      "tan_p",
      "acos_p",
      "asin_p",
      "acosh_p",
      "atanh_p",
      "cosh_p",
      "sinh_p",
      "erf_inv_p",
    ),
  ),
  (
    Rule.FLOAT32,
    "jax has no 16-bit complex type: a complex number is built from float32",
    ("complex_p",),
  ),
  (
    Rule.FLOAT32,
    "special functions, whose series and expansions are written for float32",
    (
      "lgamma_p",
      "digamma_p",
      "polygamma_p",
      "igamma_p",
      "igammac_p",
      "igamma_grad_a_p",
      "zeta_p",
      "bessel_i0e_p",
      "bessel_i1e_p",
      "regularized_incomplete_beta_p",
    ),
  ),
  (
    Rule.FOLLOW,
    "torch.autocast runs them in their inputs' dtype: arithmetic,"
    " comparisons, bounded functions, selections; `div` runs in float32"
    " where its dividend is a constant (torch's reciprocal: `1/x`'s"
    " derivative `-1/x**2` overflows float16 below `2**-8`)",
    (
      "add_p",
      "sub_p",
      "mul_p",
      "div_p",
      "rem_p",
      "neg_p",
      "abs_p",
      "sign_p",
      "max_p",
      "min_p",
      "clamp_p",
      "floor_p",
      "ceil_p",
      "round_p",
      "nextafter_p",
      "is_finite_p",
      "sqrt_p",
      "cbrt_p",
      "tanh_p",
      "logistic_p",
      "sin_p",
      "cos_p",
      "atan_p",
      "atan2_p",
      "asinh_p",
      "erf_p",
      "erfc_p",
      "eq_p",
      "ne_p",
      "lt_p",
      "le_p",
      "gt_p",
      "ge_p",
      "select_n_p",
    ),
  ),
  (
    Rule.FOLLOW,
    "move or pick values without computing new ones",
    (
      "broadcast_in_dim_p",
      "reshape_p",
      "squeeze_p",
      "transpose_p",
      "rev_p",
      "slice_p",
      "dynamic_slice_p",
      "dynamic_update_slice_p",
      "concatenate_p",
      "pad_p",
      "gather_p",
      "scatter_p",
      "split_p",
      "copy_p",
      "stop_gradient_p",
      "reduce_max_p",
      "reduce_min_p",
      "argmax_p",
      "argmin_p",
      "cummax_p",
      "cummin_p",
      "reduce_window_max_p",
      "reduce_window_min_p",
      "top_k_p",
      "sharding_constraint_p",
      "reshard_p",
      "pvary_p",
    ),
  ),
  (
    Rule.EACH,
    "take several arrays of any dtypes at once: communication runs in the"
    " dtype it is given (half the bytes of float32)",
    (
      "sort_p",
      "optimization_barrier_p",
      "psum_p",
      "psum_invariant_p",
      "pmax_p",
      "pmin_p",
      "ppermute_p",
      "pbroadcast_p",
      "all_gather_p",
      "all_gather_invariant_p",
      "all_to_all_p",
      "reduce_scatter_p",
    ),
  ),
  (
    Rule.CAST,
    "a cast in the program (a user's `astype`, jnp's own upcasts) is kept"
    " as written; one that changes no dtype is not a cast",
    ("convert_element_type_p",),
  ),
)


def _rules() -> dict[Any, Rule]:
  found = {}
  for rule, _, names in ROWS:
    for name in names:
      primitive = _compat.policy_primitive(name)
      if primitive is not None:
        found[primitive] = rule
  return found


RULES: dict[Any, Rule] = _rules()

PRODUCTS = frozenset(p for p, r in RULES.items() if r is Rule.PRODUCT)
DIV = _compat.policy_primitive("div_p")
SCATTER = _compat.policy_primitive("scatter_p")

# Operations whose output holds only values of their floating-point inputs
# (moved, repeated, picked, or negated): made from constants alone, their
# output is a constant of the same range (`values.Constant`).
MOVES = frozenset(
  p
  for p in map(
    _compat.policy_primitive,
    (
      "broadcast_in_dim_p",
      "reshape_p",
      "squeeze_p",
      "transpose_p",
      "rev_p",
      "slice_p",
      "dynamic_slice_p",
      "dynamic_update_slice_p",
      "concatenate_p",
      "pad_p",
      "gather_p",
      "copy_p",
      "stop_gradient_p",
      "reduce_max_p",
      "reduce_min_p",
      "max_p",
      "min_p",
      "neg_p",
      "abs_p",
      "select_n_p",
      "convert_element_type_p",
      "sharding_constraint_p",
      "reshard_p",
      "pvary_p",
    ),
  )
  if p is not None
)


def rule(eqn: Any) -> Rule:
  """The rule of `eqn`: its primitive's row, or `TRACED` for a primitive
  the table does not list. A scatter that holds a combiner (a jaxpr typed
  for its traced dtypes; `.at[].add` binds `scatter_add`, which the table
  leaves out for that reason) runs traced."""
  if eqn.primitive is SCATTER and eqn.params.get("update_jaxpr") is not None:
    return Rule.TRACED
  return RULES.get(eqn.primitive, Rule.TRACED)


def runs_in_float32(name: str) -> bool:
  """Whether the policy runs the primitive called `name` (`"exp"`) in
  float32, as the overflow finder names primitives.

  Example:
    >>> runs_in_float32("rsqrt"), runs_in_float32("dot_general")
    (True, False)
  """
  return any(
    rule is Rule.FLOAT32 and f"{name}_p" in names for rule, _, names in ROWS
  )
