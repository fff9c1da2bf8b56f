"""Custom derivative rules, control flow, nested transformations and the
training step (issue 33, point 5): rules keep their derivatives; loop and
branch bodies run under the policy with carries in their own dtypes;
`jit`, `checkpoint` and `vmap` work inside the function and around it; a
jitted step does not retrace."""

import _autocast as helpers
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optax_lossscale as ols

F16, F32 = jnp.float16, jnp.float32
W = jnp.linspace(-0.5, 0.5, 16).reshape(4, 4)
X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def _close_to_float32(fun, *args, atol=5e-3):
  """`fun`'s value and gradient under autocast, close to its own."""
  value16, grads16 = jax.value_and_grad(ols.autocast(fun))(*args)
  value32, grads32 = jax.value_and_grad(fun)(*args)
  np.testing.assert_allclose(value16, value32, rtol=5e-3, atol=atol)
  for g16, g32 in zip(
    jax.tree.leaves(grads16), jax.tree.leaves(grads32), strict=True
  ):
    assert g16.dtype == g32.dtype
    np.testing.assert_allclose(g16, g32, atol=atol)


def _products(fun, *args, grad=True):
  transform = jax.value_and_grad if grad else (lambda f: f)
  program = jax.make_jaxpr(transform(ols.autocast(fun)))(*args)
  return helpers.products_by_dtype(program)


def _eqns(fun, *args, name):
  program = jax.make_jaxpr(ols.autocast(fun))(*args)
  return [e for e in helpers.equations(program) if e.primitive.name == name]


# Custom derivative rules.


def test_relu_keeps_its_derivative_at_zero():
  """jax.nn.relu's rule says 0 at 0 (max(x, 0) alone would say 1/2)."""
  loss = lambda w, x: jnp.sum(jax.nn.relu(x @ w))  # noqa: E731
  zero = jnp.zeros((4, 4))
  grads = jax.grad(ols.autocast(loss))(zero, X)
  np.testing.assert_array_equal(grads, np.zeros((4, 4)))
  assert float(jax.grad(lambda x: jnp.maximum(x, 0.0))(0.0)) == 0.5


@jax.custom_vjp
def _times_three_backward(x):
  return x


_times_three_backward.defvjp(lambda x: (x, None), lambda _, g: (3 * g,))


def test_a_custom_vjp_keeps_scaling_its_cotangent():
  def loss(w, x):
    return jnp.sum(_times_three_backward(jnp.tanh(x @ w)))

  plain = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)))(W, X)
  for fun in (
    jax.grad(ols.autocast(loss)),
    jax.jit(jax.grad(ols.autocast(loss))),
  ):
    np.testing.assert_allclose(fun(W, X), 3 * plain, atol=1e-2)


def test_a_custom_rule_runs_in_its_traced_dtypes_cast_at_its_boundary():
  @jax.custom_jvp
  def f(x):
    return jnp.sin(x)

  f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * t[0]))
  (call,) = _eqns(lambda w, x: f(x @ w), W, X, name="custom_jvp_call")
  assert [np.dtype(v.aval.dtype) for v in call.invars] == [F32]
  _close_to_float32(lambda w, x: jnp.sum(f(x @ w)), W, X)


# Loops and branches.


def test_a_scan_rnn_keeps_its_carry_dtype_and_runs_float16_products():
  def rnn(w, x):
    def cell(h, xi):
      h = jnp.tanh(h @ w + xi)
      return h, jnp.sum(h)

    h, ys = lax.scan(cell, jnp.zeros(4), x)
    return jnp.sum(h) + jnp.sum(ys)

  (scan,) = _eqns(rnn, W, X, name="scan")
  assert np.dtype(scan.outvars[0].aval.dtype) == F32  # the carry
  assert _products(rnn, W, X) == {"float16": 3}
  _close_to_float32(rnn, W, X)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("unroll", [1, 3])
def test_a_scan_keeps_its_parameters(reverse, unroll):
  def cumulative(w, x):
    step = lambda h, xi: (h @ w + xi, h)  # noqa: E731
    return lax.scan(step, jnp.ones(4), x, reverse=reverse, unroll=unroll)

  (scan,) = _eqns(cumulative, W, X, name="scan")
  assert (scan.params["reverse"], scan.params["unroll"]) == (reverse, unroll)
  got, want = ols.autocast(cumulative)(W, X), cumulative(W, X)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype
    np.testing.assert_allclose(g, w, atol=5e-3)


def test_a_scan_over_no_inputs_keeps_its_length():
  power = lambda w: lax.scan(lambda h, _: (h @ w, None), W, length=5)[0]  # noqa: E731
  np.testing.assert_allclose(ols.autocast(power)(W), power(W), atol=1e-3)


def test_a_while_loop_keeps_its_carries():
  def iterate(w, x):
    def body(carry):
      h, i = carry
      return jnp.tanh(h @ w) + x, i + 1

    h, i = lax.while_loop(lambda c: c[1] < 4, body, (x, 0))
    return jnp.sum(h) + i

  (loop,) = _eqns(iterate, W, X, name="while")
  assert [np.dtype(v.aval.dtype) for v in loop.outvars] == [F32, np.int32]
  assert _products(iterate, W, X, grad=False) == {"float16": 1}
  np.testing.assert_allclose(
    ols.autocast(iterate)(W, X), iterate(W, X), rtol=2e-3
  )


@pytest.mark.parametrize("bounds", ["static", "traced"])
def test_fori_loop(bounds):
  def iterate(w, x, n):
    upper = 3 if bounds == "static" else n
    return jnp.sum(lax.fori_loop(0, upper, lambda i, h: jnp.tanh(h @ w), x))

  n = jnp.int32(3)
  np.testing.assert_allclose(
    ols.autocast(iterate)(W, X, n), iterate(W, X, n), rtol=2e-3
  )
  assert _products(iterate, W, X, n, grad=False) == {"float16": 1}
  if bounds == "static":
    _close_to_float32(lambda w, x: iterate(w, x, n), W, X)


def test_cond_and_switch_keep_their_output_dtypes():
  def branchy(w, x, i):
    by_two = lax.cond(i > 0, lambda h: h @ w, lambda h: (h @ w) * 2, x)
    return lax.switch(i, [jnp.sin, lambda h: h @ w, jnp.cos], by_two)

  i = jnp.int32(1)
  (_, switch) = _eqns(branchy, W, X, i, name="cond")
  assert np.dtype(switch.outvars[0].aval.dtype) == F32
  assert _products(branchy, W, X, i, grad=False) == {"float16": 3}
  for index in range(3):
    i = jnp.int32(index)
    np.testing.assert_allclose(
      ols.autocast(branchy)(W, X, i), branchy(W, X, i), atol=5e-3
    )
  _close_to_float32(lambda w, x: jnp.sum(branchy(w, x, jnp.int32(1))), W, X)


# Nested transformations, inside and around.


def test_a_nested_jit_is_evaluated_under_the_policy_and_named():
  @jax.jit
  def layer(h, w):
    return jnp.tanh(h @ w)

  fun = lambda w, x: jnp.sum(layer(layer(x, w), w))  # noqa: E731
  # Forward 2; backward 3 (x is not differentiated).
  assert _products(fun, W, X) == {"float16": 5}
  program = jax.make_jaxpr(ols.autocast(fun))(W, X)
  tanh = [e for e in program.jaxpr.eqns if e.primitive.name == "tanh"]
  assert len(tanh) == 2
  assert all("layer" in str(e.source_info.name_stack) for e in tanh)
  _close_to_float32(fun, W, X)


@pytest.mark.parametrize("how", ["placed", "donated"])
def test_a_jit_that_places_or_donates_runs_as_traced(how):
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if how == "placed":
    inner = jax.jit(lambda h, w: h @ w, out_shardings=sharding)
  else:
    inner = jax.jit(lambda h, w: h @ w, donate_argnums=0)
  fun = lambda w, x: jnp.sum(jnp.tanh(inner(x * 1.0, w) @ w))  # noqa: E731
  assert _products(fun, W, X, grad=False) == {"float32": 1, "float16": 1}
  # Under jit (eagerly, jax's own gradient would read the donated array).
  got = jax.jit(jax.grad(ols.autocast(fun)))(W, X)
  np.testing.assert_allclose(got, jax.jit(jax.grad(fun))(W, X), atol=5e-3)


def test_a_checkpoint_stays_a_checkpoint_with_its_policy():
  policy = jax.checkpoint_policies.nothing_saveable

  def fun(w, x):
    block = jax.checkpoint(lambda h: jnp.tanh(h @ w) @ w, policy=policy)
    return jnp.sum(block(x))

  (remat,) = _eqns(fun, W, X, name="checkpoint") or _eqns(
    fun, W, X, name="remat2"
  )
  assert remat.params["policy"] is policy
  # Forward 2; backward: the first recomputed (the second's result is not
  # needed), and 3 transposes (x is not differentiated).
  assert _products(fun, W, X) == {"float16": 6}
  _close_to_float32(fun, W, X)


def test_checkpoint_around():
  loss = ols.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w) @ w))
  rematted = jax.checkpoint(loss)
  assert _products_of(jax.value_and_grad(rematted), W, X) == {"float16": 6}
  np.testing.assert_allclose(
    jax.grad(rematted)(W, X), jax.grad(loss)(W, X), atol=1e-6
  )


def _products_of(fun, *args):
  return helpers.products_by_dtype(jax.make_jaxpr(fun)(*args))


def test_vmap_inside_and_around():
  inside = lambda w, x: jnp.sum(jax.vmap(lambda r: jnp.tanh(r @ w))(x))  # noqa: E731
  _close_to_float32(inside, W, X)
  per_row = ols.autocast(lambda w, r: jnp.sum(jnp.tanh(r @ w)))
  got = jax.vmap(per_row, in_axes=(None, 0))(W, X)
  want = jnp.sum(jnp.tanh(X @ W), axis=1)
  assert got.dtype == F32
  np.testing.assert_allclose(got, want, atol=5e-3)


def test_jit_and_grad_around():
  loss = ols.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
  grads = jax.jit(jax.grad(loss))(W, X)
  assert grads.dtype == F32
  np.testing.assert_allclose(grads, jax.grad(loss)(W, X), atol=1e-6)
  second = jax.grad(lambda w: jnp.sum(jax.grad(loss)(w, X) ** 2))(W)
  assert second.dtype == F32 and bool(jnp.all(jnp.isfinite(second)))


# The training step.


@pytest.mark.slow
def test_a_jitted_step_with_the_loss_scaler_does_not_retrace():
  tx = ols.loss_scale_optimizer(optax.adam(1e-2))
  loss = ols.autocast(helpers.mlp_loss)
  params = helpers.mlp_init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (16, 8))
  y = jnp.arange(16) % 4

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, opt_state, x, y):
    value, grads = ols.value_and_grad(loss)(opt_state, params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  opt_state = tx.init(params)
  values = []
  for _ in range(3):
    params, opt_state, value = step(params, opt_state, x, y)
    values.append(float(value))
  assert values[2] < values[0]
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype(F32)}
  assert bool(ols.skip_stats(opt_state).last_finite)
