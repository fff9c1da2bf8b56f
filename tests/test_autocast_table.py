"""The policy table, row by row: each primitive it lists, bound by the jax
function that binds it on a value the policy holds in float16 (a
product's result), gets its operands in the dtypes its row says. And each
name the table and the policy's compat entries use resolves on the running
jax."""

import pathlib

import _autocast as helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import optax_lossscale as ols
from optax_lossscale._autocast import table
from optax_lossscale._jaxpr import compat

Rule = table.Rule
F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)

# Names that appeared in a jax newer than the oldest supported (0.7.1).
NEW_IN = {
  "log2_p": (0, 12),
  "one_minus_square_p": (0, 12),
  "polynomial_p": (0, 12),
}
# Primitives that bind only under a manual mesh axis, or need a mesh:
# tests/test_autocast_sharding.py binds them.
ON_MESHES = {
  "reshard_p",
  "pvary_p",
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
}
_I = jnp.array([0, 2])


def _window(init, op):
  return lambda h: lax.reduce_window(h, init, op, (2, 2), (1, 1), "VALID")


# One function per primitive: `h` is float16 under the policy.
MAKERS = {
  "dot_general_p": lambda h: h @ h,
  "conv_general_dilated_p": lambda h: lax.conv(
    h[None, None], jnp.ones((1, 1, 2, 2)), (1, 1), "VALID"
  ),
  "ragged_dot_general_p": lambda h: lax.ragged_dot(
    h, jnp.ones((2, 4, 3)), jnp.array([2, 2], jnp.int32)
  ),
  "exp_p": jnp.exp,
  "exp2_p": jnp.exp2,
  "expm1_p": jnp.expm1,
  "log_p": jnp.log,
  "log1p_p": jnp.log1p,
  "log2_p": lambda h: lax.log2(h),
  "pow_p": lambda h: lax.pow(h, h),
  "integer_pow_p": lambda h: h**3,
  "square_p": lax.square,
  "one_minus_square_p": lambda h: lax.one_minus_square(h),
  "polynomial_p": lambda h: lax.polynomial(h, [1.0, 2.0, 3.0]),
  "rsqrt_p": lax.rsqrt,
  "reduce_sum_p": jnp.sum,
  "reduce_prod_p": jnp.prod,
  "cumsum_p": lax.cumsum,
  "cumprod_p": lax.cumprod,
  "cumlogsumexp_p": lax.cumlogsumexp,
  "reduce_window_sum_p": _window(0.0, lax.add),
  "tan_p": lax.tan,
  "acos_p": lax.acos,
  "asin_p": lax.asin,
  "acosh_p": lax.acosh,
  "atanh_p": lax.atanh,
  "cosh_p": lax.cosh,
  "sinh_p": lax.sinh,
  "erf_inv_p": lax.erf_inv,
  "lgamma_p": lax.lgamma,
  "digamma_p": lax.digamma,
  "polygamma_p": lambda h: lax.polygamma(jnp.ones_like(h), h),
  "igamma_p": lambda h: lax.igamma(h, h),
  "igammac_p": lambda h: lax.igammac(h, h),
  "igamma_grad_a_p": lambda h: lax.igamma_grad_a(h, h),
  "zeta_p": lambda h: lax.zeta(h, h),
  "bessel_i0e_p": lax.bessel_i0e,
  "bessel_i1e_p": lax.bessel_i1e,
  "regularized_incomplete_beta_p": lambda h: lax.betainc(h, h, h),
  "add_p": lambda h: h + h,
  "sub_p": lambda h: h - h,
  "mul_p": lambda h: h * h,
  "div_p": lambda h: h / h,
  "rem_p": lambda h: lax.rem(h, h),
  "neg_p": lambda h: -h,
  "abs_p": jnp.abs,
  "sign_p": lax.sign,
  "max_p": lambda h: jnp.maximum(h, h.T),
  "min_p": lambda h: jnp.minimum(h, h.T),
  "clamp_p": lambda h: lax.clamp(h.T, h, h.T),
  "floor_p": jnp.floor,
  "ceil_p": jnp.ceil,
  "round_p": jnp.round,
  "nextafter_p": lambda h: lax.nextafter(h, h.T),
  "is_finite_p": jnp.isfinite,
  "sqrt_p": jnp.sqrt,
  "cbrt_p": jnp.cbrt,
  "tanh_p": jnp.tanh,
  "logistic_p": lax.logistic,
  "sin_p": jnp.sin,
  "cos_p": jnp.cos,
  "atan_p": jnp.arctan,
  "atan2_p": lambda h: lax.atan2(h, h.T),
  "asinh_p": lax.asinh,
  "erf_p": lax.erf,
  "erfc_p": lax.erfc,
  "eq_p": lambda h: h == h.T,
  "ne_p": lambda h: h != h.T,
  "lt_p": lambda h: h < h.T,
  "le_p": lambda h: h <= h.T,
  "gt_p": lambda h: h > h.T,
  "ge_p": lambda h: h >= h.T,
  "select_n_p": lambda h: lax.select(h > 0, h, h.T),
  "complex_p": lambda h: lax.complex(h, h.T),
  "broadcast_in_dim_p": lambda h: lax.broadcast_in_dim(h, (2, 4, 4), (1, 2)),
  "reshape_p": lambda h: h.reshape(16),
  "squeeze_p": lambda h: lax.squeeze(h[None], (0,)),
  "transpose_p": lambda h: h.T,
  "rev_p": lambda h: lax.rev(h, (0,)),
  "slice_p": lambda h: lax.slice(h, (0, 0), (2, 2)),
  "dynamic_slice_p": lambda h: lax.dynamic_slice(h, (1, 0), (2, 4)),
  "dynamic_update_slice_p": lambda h: lax.dynamic_update_slice(
    h, h.T[:1], (0, 0)
  ),
  "concatenate_p": lambda h: jnp.concatenate([h, h.T]),
  "pad_p": lambda h: lax.pad(h, jnp.float32(0), [(1, 1, 0), (0, 0, 0)]),
  "gather_p": lambda h: h[_I],
  "scatter_p": lambda h: h.at[_I].set(h.T[:2]),
  "split_p": lambda h: lax.split(h, (2, 2))[0],
  "copy_p": lambda h: lax.copy_p.bind(h),
  "stop_gradient_p": lax.stop_gradient,
  "reduce_max_p": jnp.max,
  "reduce_min_p": jnp.min,
  "argmax_p": jnp.argmax,
  "argmin_p": jnp.argmin,
  "cummax_p": lax.cummax,
  "cummin_p": lax.cummin,
  "reduce_window_max_p": _window(-jnp.inf, lax.max),
  "reduce_window_min_p": _window(jnp.inf, lax.min),
  "top_k_p": lambda h: lax.top_k(h, 2)[0],
  "sharding_constraint_p": lambda h: lax.with_sharding_constraint(
    h, jax.sharding.SingleDeviceSharding(jax.devices()[0])
  ),
  "sort_p": jnp.sort,
  "optimization_barrier_p": lambda h: lax.optimization_barrier(h),
  "convert_element_type_p": lambda h: h.astype(jnp.bfloat16),
}


def _listed() -> list[tuple[Rule, str]]:
  return [(rule, name) for rule, _, names in table.ROWS for name in names]


def _on_this_jax(name: str) -> bool:
  return name not in NEW_IN or jax.__version_info__ >= NEW_IN[name]


def test_every_listed_primitive_has_a_maker_or_a_mesh_test():
  assert {n for _, n in _listed()} == set(MAKERS) | ON_MESHES


@pytest.mark.parametrize("name", sorted({n for _, n in _listed()}))
def test_each_listed_name_resolves_from_the_jax_that_has_it(name):
  found = compat.policy_primitive(name)
  if _on_this_jax(name):
    assert isinstance(found, compat.Primitive), (name, jax.__version__)
    assert found in table.RULES
  else:
    assert found is None


def test_the_private_primitives_resolve_from_their_modules():
  for name, (_, since) in compat.PRIVATE_PRIMITIVES.items():
    if jax.__version_info__ >= since:
      assert isinstance(compat.policy_primitive(name), compat.Primitive), name


def _floats(eqn):
  return [
    np.dtype(v.aval.dtype)
    for v in eqn.invars
    if jnp.issubdtype(v.aval.dtype, jnp.floating)
  ]


def _first(jaxpr, primitive):
  """The first equation of `primitive` on floating-point operands (of a
  cast: the cast to bfloat16, not the policy's own casts)."""
  for eqn in helpers.equations(jaxpr):
    if eqn.primitive is primitive and _floats(eqn):
      if eqn.params.get("new_dtype", jnp.bfloat16) == jnp.bfloat16:
        return eqn
  raise AssertionError(f"no {primitive} in {jaxpr}")


# What each rule gives the float operand that comes from `h`.
EXPECTED = {
  Rule.PRODUCT: F16,
  Rule.FLOAT32: F32,
  Rule.FOLLOW: F16,
  Rule.EACH: F16,
  Rule.CAST: F16,  # as it comes: the cast is to bfloat16, as written
}


@pytest.mark.parametrize(
  "rule, name",
  [(r, n) for r, n in _listed() if n in MAKERS and _on_this_jax(n)],
  ids=lambda x: x if isinstance(x, str) else x.value,
)
def test_each_row_gives_its_operands_their_dtype(rule, name):
  primitive = compat.policy_primitive(name)
  maker = MAKERS[name]
  # h = x @ eye runs in float16 under the policy; positive, below 1.
  fun = ols.autocast(lambda x: maker(x @ jnp.eye(4)))
  x = jnp.linspace(0.1, 0.9, 16).reshape(4, 4)
  eqn = _first(jax.make_jaxpr(fun)(x), primitive)
  floats = _floats(eqn)
  assert set(floats) == {EXPECTED[rule]}, (name, floats)
  out = np.dtype(eqn.outvars[0].aval.dtype)
  if rule is Rule.PRODUCT:
    assert out == F16
  if name == "convert_element_type_p":
    assert out == np.dtype(jnp.bfloat16)
  # And it runs: the values match float32's to float16's precision.
  got = jax.tree.leaves(fun(x))
  want = jax.tree.leaves(maker(x))
  for g, w in zip(got, want, strict=True):
    assert g.dtype == w.dtype
    if jnp.issubdtype(w.dtype, jnp.inexact):
      np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2)


def test_a_scatter_that_combines_runs_as_traced():
  # `.at[].add` binds scatter_add, whose combiner is a jaxpr typed float32.
  fun = ols.autocast(lambda x: (x @ jnp.eye(4)).at[_I].add(1.0))
  x = jnp.ones((4, 4))
  eqn = next(
    e
    for e in helpers.equations(jax.make_jaxpr(fun)(x))
    if e.primitive.name == "scatter-add"
  )
  assert np.dtype(eqn.invars[0].aval.dtype) == F32
  np.testing.assert_array_equal(fun(x), x.at[_I].add(1.0))


# docs/autocast.md shows the table: it must be this module's, row by row.

RUNS_IN = {
  Rule.PRODUCT: "`dtype`",
  Rule.FLOAT32: "float32",
  Rule.FOLLOW: "its operands' dtypes",
  Rule.EACH: "each operand's own dtype",
  Rule.CAST: "as written",
}


def _page_table() -> list[str]:
  lines = ["| runs in | primitives | why |", "| --- | --- | --- |"]
  for rule, why, names in table.ROWS:
    found = ", ".join(f"`{name.removesuffix('_p')}`" for name in names)
    lines.append(f"| {RUNS_IN[rule]} | {found} | {why} |")
  return lines


def test_the_docs_page_shows_this_table():
  page = (
    pathlib.Path(__file__).parents[1] / "docs" / "autocast.md"
  ).read_text()
  expected = "\n".join(_page_table())
  assert expected in page, "docs/autocast.md's table should read:\n" + expected
