"""The policy (issue 33, points 1 to 4): products in the compute dtype
forward and backward, the float32 list in float32, everything else in its
operands' dtypes (mixed floats promoted, constants never cast into an
inf), and outputs in the dtypes the function returns."""

import collections

import _autocast as helpers
import _hlo
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols
from optax_lossscale import _autocast
from optax_lossscale._autocast import table

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
# The float32 list, by primitive name, as the program prints them.
FLOAT32_LIST = {
  compat_primitive.name
  for rule, _, names in table.ROWS
  if rule is table.Rule.FLOAT32
  for compat_primitive in filter(
    None, map(_autocast.table._compat.policy_primitive, names)
  )
}


@pytest.fixture(scope="module")
def mlp():
  params = helpers.mlp_init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (5, 8))
  y = jnp.array([0, 1, 2, 3, 0])
  return params, x, y


def test_every_product_of_the_gradient_program_is_float16(mlp):
  grad = jax.value_and_grad(ols.autocast(helpers.mlp_loss))
  program = jax.make_jaxpr(grad)(*mlp)
  products = helpers.dtype_counts(program, helpers.PRODUCTS)
  # Three layers: three products forward, two transposes each backward but
  # the first layer's input gradient (x is not differentiated).
  assert products == {("dot_general", "float16"): 8}
  for dtypes in helpers.operand_dtypes(program, "dot_general"):
    assert dtypes == ("float16", "float16")


def test_the_float32_list_runs_in_float32_forward_and_backward(mlp):
  for transform in (lambda f: f, jax.value_and_grad):
    program = jax.make_jaxpr(transform(ols.autocast(helpers.mlp_loss)))(*mlp)
    listed = helpers.dtype_counts(program, FLOAT32_LIST - {"reduce_sum"})
    assert listed and {dtype for _, dtype in listed} == {"float32"}
  # Forward, every sum too.
  program = jax.make_jaxpr(ols.autocast(helpers.mlp_loss))(*mlp)
  sums = helpers.dtype_counts(program, {"reduce_sum"})
  assert sums and {dtype for _, dtype in sums} == {"float32"}


def _typed_ops(compiled):
  return collections.Counter(
    (i.opcode, i.arrays[0][0] if i.arrays else None)
    for i in _hlo.hlo_instructions(compiled)
  )


@pytest.mark.slow
def test_the_compiled_step_is_the_hand_conversion_op_for_op(mlp):
  """No cost beyond the casts a hand conversion writes: the two gradient
  programs compile to the same operations, kind by kind and dtype by
  dtype, and lower to the same float16 products."""

  def lowered(loss):
    return jax.jit(jax.value_and_grad(loss)).lower(*mlp)

  ours, theirs = (
    lowered(ols.autocast(helpers.mlp_loss)),
    lowered(helpers.mlp_loss_by_hand),
  )
  assert _typed_ops(ours.compile()) == _typed_ops(theirs.compile())

  def products(low):
    return collections.Counter(
      op.tensors[-1][0]
      for op in _hlo.mlir_ops(low.as_text())
      if op.name == "dot_general"
    )

  assert products(ours) == products(theirs) == {"f16": 8}


def test_a_backward_sum_over_a_broadcast_float16_value_is_float16():
  """jax sums the cotangents of a broadcast where it transposes it: in the
  dtype the forward value had."""

  def fun(w, x):
    h = x @ w  # float16
    return jnp.sum(jnp.tanh(jnp.broadcast_to(h, (5, *h.shape))))

  program = jax.make_jaxpr(jax.grad(ols.autocast(fun)))(W, X)
  sums = helpers.dtype_counts(program, {"reduce_sum"})
  assert sums[("reduce_sum", "float16")] == 1


def test_gradients_are_float32_and_close_to_float32s(mlp):
  loss32, grads32 = jax.value_and_grad(helpers.mlp_loss)(*mlp)
  loss16, grads16 = jax.value_and_grad(ols.autocast(helpers.mlp_loss))(*mlp)
  assert loss16.dtype == F32
  np.testing.assert_allclose(loss16, loss32, rtol=2e-3)
  for g16, g32 in zip(
    jax.tree.leaves(grads16), jax.tree.leaves(grads32), strict=True
  ):
    assert g16.dtype == F32
    np.testing.assert_allclose(g16, g32, atol=3e-3 * float(jnp.abs(g32).max()))


def _program_dtypes(fun, *args, names):
  return helpers.dtype_counts(jax.make_jaxpr(ols.autocast(fun))(*args), names)


X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
W = jnp.full((4, 4), 0.25)


def test_a_float32_operand_promotes_a_float16_one():
  # A float16 product plus a float32 bias: float32, as torch does.
  counts = _program_dtypes(
    lambda x, w, b: x @ w + b, X, W, jnp.ones(4), names={"add"}
  )
  assert counts == {("add", "float32"): 1}


def test_mixed_cast_keeps_the_compute_dtype():
  fun = ols.autocast(lambda x, w, b: x @ w + b, mixed="cast")
  program = jax.make_jaxpr(fun)(X, W, jnp.ones(4))
  assert helpers.dtype_counts(program, {"add"}) == {("add", "float16"): 1}
  np.testing.assert_allclose(fun(X, W, jnp.ones(4)), X @ W + 1, rtol=1e-3)


@pytest.mark.parametrize(
  "constant",
  [0.5, np.float32(0.5), jnp.float32(0.5), np.array(0.5, np.float32)],
  ids=["python", "numpy scalar", "jax scalar", "numpy 0-d"],
)
def test_a_scalar_constant_takes_the_dtype_it_meets(constant):
  counts = _program_dtypes(lambda x, w: (x @ w) * constant, X, W, names={"mul"})
  assert counts == {("mul", "float16"): 1}


def test_a_filler_made_from_a_scalar_takes_the_dtype_it_meets():
  fun = lambda x, w: jnp.where(x @ w > 0, x @ w, 0.0)  # noqa: E731
  counts = _program_dtypes(fun, X, W, names={"select_n"})
  assert counts == {("select_n", "float16"): 1}


def test_a_constant_array_promotes_like_any_float32_value():
  table_ = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
  counts = _program_dtypes(lambda x, w: x @ w + table_, X, W, names={"add"})
  assert counts == {("add", "float32"): 1}


MASKS = [-1e9, float(jnp.finfo(F32).min), -2.3819763e38]


@pytest.mark.parametrize("mask", MASKS)
def test_a_mask_value_float16_cannot_hold_stays_finite(mask):
  """`jnp.where(causal, logits, -1e9)`: the select runs in float32, the mask
  value is the one written, and the softmax after it matches float32's."""
  causal = jnp.tril(jnp.ones((4, 4), bool))

  def attention(x, w):
    logits = jnp.where(causal, x.T @ (x @ w), mask)
    return jax.nn.softmax(logits, axis=-1)

  x = X[:, :4]
  counts = _program_dtypes(attention, x, W, names={"select_n"})
  assert counts == {("select_n", "float32"): 1}
  probs = ols.autocast(attention)(x, W)
  assert bool(jnp.all(jnp.isfinite(probs)))
  np.testing.assert_allclose(probs, attention(x, W), atol=2e-3)
  masked = ols.autocast(lambda x, w: jnp.where(causal, x.T @ (x @ w), mask))
  assert float(masked(x, W)[0, 3]) == float(np.float32(mask))


@pytest.mark.parametrize("scale", [1e5, 1e-9])
def test_a_product_with_a_constant_float16_cannot_hold_runs_as_traced(scale):
  """A closed-over matrix beyond float16's range (or below its smallest
  number) keeps its product in float32: no inf, no zero."""
  w = np.full((4, 4), scale, np.float32)
  fun = lambda x: x @ w  # noqa: E731
  counts = _program_dtypes(fun, X, names=helpers.PRODUCTS)
  assert counts == {("dot_general", "float32"): 1}
  np.testing.assert_allclose(ols.autocast(fun)(X), X @ w, rtol=1e-6)


_EDGES = [65504.0, 65519.0, 65520.0, 1e5, 2.0**-24, 2.0**-25, 2.0**-26, 3e-8]


@hypothesis.settings(deadline=None, max_examples=40)
@hypothesis.given(
  st.one_of(
    st.sampled_from(_EDGES + [-e for e in _EDGES]),
    # Normal float32 products (XLA on CPU flushes subnormal ones).
    st.floats(-(2.0**100), 2.0**100, width=32).filter(
      lambda c: c == 0 or abs(c) > 2.0**-100
    ),
  )
)
def test_a_scalar_adapts_exactly_where_float16_holds_it(c):
  """`h * c` with `h` float16 runs in float16 exactly when float16 holds `c`
  (it does not round to an inf, nor a nonzero value to zero), else in
  float32; either way its value is the product in that dtype."""
  c = np.float32(c)
  with np.errstate(over="ignore"):
    held = np.float16(c)
  holds = bool(np.isfinite(held)) and (c == 0 or held != 0)
  fun = ols.autocast(lambda x: (x @ jnp.eye(2)) * c)
  x = jnp.array([[1.0, -0.5], [0.25, 2.0]])
  program = jax.make_jaxpr(fun)(x)
  expected = "float16" if holds else "float32"
  assert helpers.dtype_counts(program, {"mul"}) == {("mul", expected): 1}
  h = np.asarray(x, np.float16)
  with np.errstate(over="ignore"):
    want = (h * held) if holds else (h.astype(np.float32) * c)
  np.testing.assert_array_equal(fun(x), want.astype(np.float32))


def test_outputs_come_back_in_the_dtypes_fun_returns():
  def fun(x, w, n, key):
    h = x @ w
    return {
      "f32": jnp.tanh(h),
      "f16": h.astype(F16),
      "int": n * 2,
      "bool": h > 0,
      "key": jax.random.split(key)[0],
      "noise": jax.random.normal(key, (3,)),
    }

  key = jax.random.key(0)
  n = jnp.arange(3)
  x = X + 2  # no product near 0, where float16 and float32 differ in sign
  got = ols.autocast(fun)(x, W, n, key)
  want = fun(x, W, n, key)
  assert jax.tree.map(lambda a: a.dtype, got) == jax.tree.map(
    lambda a: a.dtype, want
  )
  np.testing.assert_array_equal(got["int"], want["int"])
  np.testing.assert_array_equal(got["bool"], want["bool"])
  np.testing.assert_array_equal(got["noise"], want["noise"])
  assert jnp.all(
    jax.random.key_data(got["key"]) == jax.random.key_data(want["key"])
  )


def test_outputs_that_are_constants_come_back_as_written():
  # An output the program holds as a literal (a flag that a layer resets,
  # as Equinox's BatchNorm returns its first-time flag in its state).
  def fun(x):
    return jnp.sum(x @ W), jnp.zeros((), bool), 1.5

  total, flag, number = ols.autocast(fun)(X)
  assert (total.dtype, flag.dtype) == (F32, jnp.bool_)
  assert (bool(flag), float(number)) == (False, 1.5)
  assert jnp.asarray(number).dtype == F32


def test_gradients_come_back_in_each_input_dtype():
  def loss(w32, w16, wbf):
    h = X @ w32 + X @ w16.astype(F32) + X @ wbf.astype(F32)
    return jnp.sum(jnp.tanh(h))

  args = (W, W.astype(F16), W.astype(BF16))
  grads = jax.grad(ols.autocast(loss), argnums=(0, 1, 2))(*args)
  assert [g.dtype for g in grads] == [F32, F16, BF16]


def test_a_cast_the_user_wrote_is_kept():
  # 1 + 2**-10 is a float16 number, and rounds to 1 in bfloat16.
  x = jnp.full((2,), 1 + 2.0**-10)
  kept = ols.autocast(lambda x: x.astype(BF16).astype(F32) * 2)(x)
  np.testing.assert_array_equal(kept, [2.0, 2.0])
  program = jax.make_jaxpr(ols.autocast(lambda x: x.astype(BF16) * 2))(x)
  assert helpers.dtype_counts(program, {"mul"}) == {("mul", "bfloat16"): 1}


def test_bfloat16_runs_the_same_policy_in_bfloat16(mlp):
  grad = jax.value_and_grad(ols.autocast(helpers.mlp_loss, dtype=BF16))
  program = jax.make_jaxpr(grad)(*mlp)
  assert helpers.dtype_counts(program, helpers.PRODUCTS) == {
    ("dot_general", "bfloat16"): 8
  }
  listed = helpers.dtype_counts(program, FLOAT32_LIST)
  assert {dtype for _, dtype in listed} == {"float32"}


@pytest.mark.parametrize(
  "dtype", [F16, np.float16, "float16", np.dtype("float16"), "bfloat16"]
)
def test_every_spelling_of_the_compute_dtype(dtype):
  program = jax.make_jaxpr(ols.autocast(lambda x, w: x @ w, dtype=dtype))(X, W)
  ((_, found),) = helpers.dtype_counts(program, helpers.PRODUCTS)
  assert found == np.dtype(dtype).name


def test_float64_products_run_as_traced():
  """As torch.autocast: float64 is not cast (only float16, bfloat16 and
  float32 operands are)."""
  with helpers.enable_x64():
    x = np.ones((2, 2), np.float64)
    program = jax.make_jaxpr(ols.autocast(lambda x: x @ x))(x)
    assert helpers.dtype_counts(program, helpers.PRODUCTS) == {
      ("dot_general", "float64"): 1
    }


def test_the_policies_applied_are_recorded_while_asked():
  loss = ols.autocast(helpers.mlp_loss, keep_float32=("head", "a/b"))
  inner = ols.autocast(lambda x: x @ x, dtype=BF16)
  params = helpers.mlp_init(jax.random.key(0))
  x, y = jnp.ones((2, 8)), jnp.array([0, 1])
  loss(params, x, y)  # not recorded: nobody asks
  with _autocast.recording() as policies:
    jax.jit(jax.grad(loss))(params, x, y)
    ols.autocast(lambda x: inner(x @ x))(jnp.ones((2, 2)))
  # In the order the calls began: an outer call before the one inside it.
  assert [(p.dtype, p.keep_float32) for p in policies] == [
    (np.dtype(F16), (("head",), ("a", "b"))),
    (np.dtype(F16), ()),
    (np.dtype(BF16), ()),
  ]
  with _autocast.recording() as after:
    pass
  assert after == []
