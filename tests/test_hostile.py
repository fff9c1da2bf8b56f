"""Hostile input that is accepted, and errors pinned beyond their message.

The error every bad argument and every misuse raises (its type and whole
message) is pinned by docs/errors.md: docs/_errors.py runs each case and
writes the page, and tests/test_errors_page.py checks the page against the
library. Here: the forms of arguments that are accepted, the errors' timing
(at construction, at trace time), and behaviour on unusual gradient leaves.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

NAN, INF = float("nan"), float("inf")
SGD = optax.sgd(0.1)
PARAMS = {"a": jnp.ones(3), "b": jnp.ones(2)}


def lso(**kwargs):
  return ols.loss_scale_optimizer(SGD, **kwargs)


def _update_foreign_state():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  jax.eval_shape(tx.update, PARAMS, optax.adam(1e-3).init(PARAMS), PARAMS)


@pytest.mark.parametrize("value", [np.float32(8.0), np.int64(8), 8, 2.0**-10])
def test_accepted_scalar_forms(value):
  tx = lso(initial_scale=value, min_scale=2.0**-10)
  assert float(ols.loss_scale(tx.init(PARAMS))) == float(value)


@pytest.mark.parametrize("value", [np.array(8.0), np.array(8, np.int32)])
def test_zero_dim_numpy_array_accepted(value):
  tx = lso(initial_scale=value, growth_factor=np.array(3.0))
  assert float(ols.loss_scale(tx.init(PARAMS))) == 8.0


@pytest.mark.parametrize("name", ["batch", ("data", "model"), 0])
def test_accepted_axis_names(name):
  assert lso(axis_name=name).loss_scale_config.axis_name == name


def test_bad_configuration_never_reaches_jit():
  """Construction validates eagerly: nothing is traced before the error."""
  traced = []

  def inner_init(params):
    traced.append(params)
    return ()

  inner = optax.GradientTransformation(inner_init, lambda u, s, p=None: (u, s))
  with pytest.raises(ValueError):
    ols.loss_scale_optimizer(inner, initial_scale=NAN)
  assert not traced


def test_update_with_mismatched_tree_raises_even_when_inner_ignores_params():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1))
  with pytest.raises(ValueError, match="structure"):
    jax.eval_shape(tx.update, {"a": jnp.ones(3)}, tx.init(PARAMS), PARAMS)


def test_update_with_foreign_state_gives_clear_error():
  with pytest.raises(TypeError, match="LossScaleOptimizerState"):
    _update_foreign_state()


# --- Pinned behaviour on unusual leaves ---


def test_integer_gradient_leaves_pass_through_unscaled():
  """Integer leaves carry no scaled gradient: they are not divided by the
  scale, never make a step non-finite, and on a skipped step their updates
  are zeros like every other leaf's."""
  tx = ols.loss_scale_optimizer(optax.sgd(0.5), initial_scale=4.0)
  params = {"w": jnp.ones(2), "n": jnp.array([3, 5], jnp.int32)}
  state = tx.init(params)
  grads = {"w": jnp.full(2, 4.0), "n": jnp.array([8, 8], jnp.int32)}
  updates, new_state = tx.update(grads, state, params)
  np.testing.assert_array_equal(updates["w"], [-0.5, -0.5])  # 4 / 4 * 0.5
  np.testing.assert_array_equal(updates["n"], [-4.0, -4.0])  # 8 * 0.5
  assert bool(ols.skip_stats(new_state).last_finite)
  new_params = optax.apply_updates(params, updates)
  assert new_params["n"].dtype == jnp.int32
  np.testing.assert_array_equal(new_params["n"], [-1, 1])

  grads["w"] = jnp.array([jnp.nan, 1.0])
  updates, new_state = tx.update(grads, state, params)
  np.testing.assert_array_equal(updates["n"], [0, 0])
  assert not bool(ols.skip_stats(new_state).last_finite)
  assert bool(ols.all_finite({"n": jnp.array([1, 2], jnp.int32)}))


def test_complex_gradients_divided_and_both_parts_checked():
  tx = ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=4.0)
  params = jnp.array([1 + 1j, 2 - 2j], jnp.complex64)
  state = tx.init(params)
  updates, new_state = tx.update(
    jnp.array([4 + 8j, 4 - 4j], jnp.complex64), state, params
  )
  assert updates.dtype == jnp.complex64
  np.testing.assert_array_equal(updates, [-1 - 2j, -1 + 1j])
  assert bool(ols.skip_stats(new_state).last_finite)
  for bad in [
    complex(1, INF),
    complex(NAN, 1),
    complex(-INF, 0),
    complex(0, NAN),
  ]:
    updates, new_state = tx.update(
      jnp.array([bad, 4], jnp.complex64), state, params
    )
    assert not bool(ols.skip_stats(new_state).last_finite), bad
    np.testing.assert_array_equal(updates, [0, 0])
    assert updates.dtype == jnp.complex64
    assert not bool(ols.all_finite(jnp.array([bad], jnp.complex64)))


# --- Issue 22: values that float32 would make unusable ---

TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal


@pytest.mark.parametrize(
  "kwargs",
  [
    {"initial_scale": 2.0**-127, "min_scale": 2.0**-127},
    {"min_scale": 1e-40},
    {"initial_scale": 1e-40, "min_scale": 1e-40},
    {"initial_scale": 2.0**-130, "max_scale": 2.0**-130, "min_scale": TINY},
  ],
)
def test_subnormal_scales_and_bounds_are_refused(kwargs):
  """A float32 subnormal flushes to 0 in XLA on CPU: one backoff to such a
  floor gave a scale of 0, and every later step was skipped."""
  name = next(k for k, v in kwargs.items() if v < TINY)
  with pytest.raises(ValueError, match=rf"`{name}` must be .*2\*\*-126"):
    lso(**kwargs)


def test_the_smallest_normal_float32_is_a_usable_floor():
  tx = lso(initial_scale=2.0 * TINY, min_scale=TINY)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(3):
    _, state = update({"w": jnp.array([NAN, 1.0])}, state, params)
  assert float(ols.loss_scale(state)) == TINY
  updates, state = update({"w": jnp.array([TINY, -TINY])}, state, params)
  assert bool(ols.skip_stats(state).last_finite)
  tenth = np.float32(0.1)  # sgd(0.1) of the unscaled [1, -1]
  np.testing.assert_array_equal(updates["w"], [-tenth, tenth])


# --- float8 gradients (issue 22) ---

FLOAT8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


@pytest.mark.parametrize("dtype", FLOAT8, ids=lambda d: d.__name__)
@pytest.mark.parametrize(
  "inner",
  [lambda: optax.sgd(0.5), lambda: optax.adam(0.1)],
  ids=["sgd", "adam"],
)
def test_float8_gradients_unscale_as_plain_optax_steps(dtype, inner):
  """Unscaled in float32 (jax promotes no 8-bit float implicitly), then
  back in the gradient's dtype: a power-of-two scale is exact, so a finite
  step is the plain step, bit for bit."""
  params = jnp.linspace(-1.0, 1.0, 6).astype(dtype)
  grads = jnp.array([1.0, -2.0, 4.0, 0.5, 1.5, 8.0], dtype)
  tx = ols.loss_scale_optimizer(inner(), initial_scale=4.0)
  plain = inner()
  for update in (tx.update, jax.jit(tx.update)):
    updates, state = update((grads * 4).astype(dtype), tx.init(params), params)
    want, want_state = plain.update(grads, plain.init(params), params)
    assert updates.dtype == want.dtype == dtype
    np.testing.assert_array_equal(
      np.asarray(updates, np.float32), np.asarray(want, np.float32)
    )
    for ours, theirs in zip(
      jax.tree.leaves(state.inner_state),
      jax.tree.leaves(want_state),
      strict=True,
    ):
      assert ours.dtype == theirs.dtype
      assert np.asarray(ours).tobytes() == np.asarray(theirs).tobytes()
    assert bool(ols.skip_stats(state).last_finite)


@pytest.mark.parametrize("dtype", FLOAT8, ids=lambda d: d.__name__)
def test_float8_gradients_with_a_nan_or_inf_are_skipped(dtype):
  params = jnp.ones(3, dtype)
  tx = ols.loss_scale_optimizer(optax.adam(0.1), initial_scale=4.0)
  state = tx.init(params)
  # float8_e4m3fn has no inf: casting one gives NaN.
  for bad in (NAN, INF):
    grads = jnp.array([4.0, bad, 8.0], jnp.float32).astype(dtype)
    for update in (tx.update, jax.jit(tx.update)):
      updates, new_state = update(grads, state, params)
      assert updates.dtype == dtype
      np.testing.assert_array_equal(np.asarray(updates, np.float32), 0.0)
      assert not bool(ols.skip_stats(new_state).last_finite)
      assert float(ols.loss_scale(new_state)) == 2.0
      for old, new in zip(
        jax.tree.leaves(state.inner_state),
        jax.tree.leaves(new_state.inner_state),
        strict=True,
      ):
        assert np.asarray(old).tobytes() == np.asarray(new).tobytes()


def test_float8_gradients_of_float32_params_unscale_into_float32():
  params = jnp.ones(2, jnp.float32)
  tx = ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=4.0)
  grads = jnp.array([4.0, 2.0], jnp.float8_e4m3fn)
  updates, _ = tx.update(grads, tx.init(params), params)
  assert updates.dtype == jnp.float32
  np.testing.assert_array_equal(updates, [-1.0, -0.5])


@pytest.mark.parametrize("dtype", FLOAT8, ids=lambda d: d.__name__)
def test_a_float8_loss_is_scaled_in_float32(dtype):
  state = lso(initial_scale=4.0).init(PARAMS)
  scaled = ols.scale_loss(jnp.array(1.5, dtype), state)
  assert scaled.dtype == dtype
  assert float(scaled) == 6.0


# --- factors checked as the float32 values the rule uses (issue 22) ---


@pytest.mark.parametrize(
  "name, value",
  [
    ("backoff_factor", 0.99999999),  # 1.0 in float32: never backs off
    ("backoff_factor", 1e-50),  # 0.0 in float32
    ("backoff_factor", 1e-40),  # subnormal: 0 on CPU, not on GPU
    ("growth_factor", 1e39),  # inf in float32
    ("growth_factor", 1.00000001),  # 1.0 in float32: never grows
  ],
)
def test_factors_are_checked_in_float32(name, value):
  with pytest.raises(ValueError) as info:
    lso(**{name: value})
  message = str(info.value)
  assert f"`{name}` must be" in message and repr(value) in message, message
  assert "float32" in message, message


def test_factors_next_to_the_float32_limits_are_accepted():
  c = lso(growth_factor=1 + 2.0**-23, backoff_factor=1 - 2.0**-24)
  assert c.loss_scale_config.growth_factor == 1 + 2.0**-23
  assert c.loss_scale_config.backoff_factor == 1 - 2.0**-24
  c = lso(growth_factor=float(np.finfo(np.float32).max), backoff_factor=TINY)
  assert c.loss_scale_config.backoff_factor == TINY


@pytest.mark.parametrize(
  "name",
  [
    "initial_scale",
    "growth_factor",
    "backoff_factor",
    "min_scale",
    "max_scale",
  ],
)
@pytest.mark.parametrize(
  "value", [2**1100, -(2**1100)], ids=["2**1100", "-2**1100"]
)
def test_an_int_beyond_float_range_is_a_value_error(name, value):
  """`float(2**1100)` raises OverflowError: out of range, not a crash."""
  with pytest.raises(ValueError, match=f"`{name}` must be"):
    lso(**{name: value})


# --- small input gaps (issue 22) ---


@pytest.mark.parametrize(
  "inner",
  [lambda: optax.sgd(0.1), lambda: optax.adam(0.1)],
  ids=["sgd", "adam"],
)
def test_a_python_float_gradient_leaf_eagerly_and_under_jit(inner):
  """Plain optax takes a Python float leaf; eagerly ours raised
  AttributeError ('float' object has no attribute 'dtype')."""
  params = {"a": jnp.ones(2), "b": 1.0}
  grads = {"a": jnp.array([2.0, -4.0]), "b": 3.0}
  plain = inner()
  want, _ = plain.update(grads, plain.init(params), params)
  tx = ols.loss_scale_optimizer(inner(), initial_scale=1.0)
  for update in (tx.update, jax.jit(tx.update)):
    updates, state = update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["a"], want["a"], rtol=1e-6)
    np.testing.assert_allclose(updates["b"], want["b"], rtol=1e-6)
    assert bool(ols.skip_stats(state).last_finite)
    updates, state = update(dict(grads, b=NAN), tx.init(params), params)
    assert float(updates["b"]) == 0.0
    assert not bool(ols.skip_stats(state).last_finite)


@pytest.mark.parametrize(
  "value", ["8", True, np.bool_(True), None, 1 + 0j, jnp.array(True), [8.0]]
)
def test_set_loss_scale_refuses_a_value_of_the_wrong_type(value):
  state = lso().init(PARAMS)
  with pytest.raises(TypeError, match="`value` must be"):
    ols.set_loss_scale(state, value)


@pytest.mark.parametrize(
  "value", [2**1100, -(2**1100)], ids=["2**1100", "-2**1100"]
)
def test_set_loss_scale_out_of_float_range_is_a_value_error(value):
  with pytest.raises(ValueError, match="`value` must be"):
    ols.set_loss_scale(lso().init(PARAMS), value)


@pytest.mark.parametrize(
  "value", [8, 8.0, np.float32(8.0), np.int64(8), np.array(8.0), jnp.int32(8)]
)
def test_set_loss_scale_takes_python_and_numpy_numbers(value):
  state = ols.set_loss_scale(lso().init(PARAMS), value)
  assert ols.loss_scale(state) == 8.0


def test_foreign_state_error_points_to_a_page_that_has_the_recipe():
  """It pointed to a README section that does not exist (issue 22)."""
  with pytest.raises(TypeError) as info:
    _update_foreign_state()
  assert "docs/composition.md, section Checkpoints" in str(info.value)
  page = pathlib.Path(__file__).resolve().parents[1] / "docs/composition.md"
  assert "\n## Checkpoints\n" in page.read_text()


# --- a state and a transformation that disagree, and a bad `value` ---


def _made_by(make, **kwargs):
  if make == "unscale_and_check":
    return ols.unscale_and_check(**kwargs)
  return ols.loss_scale_optimizer(SGD, **kwargs)


@pytest.mark.parametrize("make", ["loss_scale_optimizer", "unscale_and_check"])
@pytest.mark.parametrize("state_dynamic", [True, False])
def test_a_state_of_the_other_mode_is_refused_while_tracing(
  make, state_dynamic
):
  """A static state under a dynamic transformation (or the reverse) is a
  clear error naming both modes and what to do, raised while tracing."""
  static = dict(dynamic=False, initial_scale=4.0)
  made = _made_by(make, **({} if state_dynamic else static))
  used = _made_by(make, **(static if state_dynamic else {}))
  state = made.init(PARAMS)
  with pytest.raises(ValueError, match=r"dynamic=") as raised:
    jax.eval_shape(used.update, PARAMS, state, PARAMS)
  message = str(raised.value)
  assert "static" in message and "dynamic" in message
  assert "set_loss_scale" in message


@pytest.mark.parametrize("make", ["loss_scale_optimizer", "unscale_and_check"])
@pytest.mark.parametrize("state_counts", [True, False])
def test_switching_leaf_stats_during_a_run_is_refused(make, state_counts):
  """Per-leaf counts that would not cover the run are refused, both ways,
  while tracing, naming `leaf_stats` and both settings."""
  made = _made_by(make, leaf_stats=state_counts)
  used = _made_by(make, leaf_stats=not state_counts)
  state = made.init(PARAMS)
  with pytest.raises(ValueError, match="leaf_stats") as raised:
    jax.eval_shape(used.update, PARAMS, state, PARAMS)
  message = str(raised.value)
  assert f"leaf_stats={state_counts}" in message
  assert f"leaf_stats={not state_counts}" in message


@pytest.mark.parametrize(
  "value",
  [
    "nan",
    jnp.ones(2),
    jnp.ones((1,)),
    [1.0],
    1j,
    jnp.ones((), jnp.complex64),
    1,
    jnp.ones((), jnp.int32),
    True,
    object(),
  ],
  # An object's repr holds its address, which differs between xdist's
  # workers: its id is its type's name.
  ids=lambda v: "object" if type(v) is object else repr(v),
)
def test_a_value_that_is_not_a_real_float_scalar_is_refused(value):
  tx = lso()
  state = tx.init(PARAMS)
  with pytest.raises(TypeError, match="`value`"):
    tx.update(PARAMS, state, PARAMS, value=value)
  # at trace time too, where the value is abstract
  if hasattr(value, "shape"):
    with pytest.raises(TypeError, match="`value`"):
      jax.jit(tx.update)(PARAMS, state, PARAMS, value=value)


@pytest.mark.parametrize(
  "value", [1.0, np.float32(1.0), jnp.float16(1.0), jnp.ones([]), NAN]
)
def test_real_float_scalars_are_accepted_as_value(value):
  tx = lso()
  state = tx.init(PARAMS)
  _, state = jax.jit(tx.update)(PARAMS, state, PARAMS, value=value)
  assert bool(ols.skip_stats(state).last_finite) == (value == value)


# --- float16 master weights ---


@pytest.mark.parametrize("make", ["loss_scale_optimizer", "unscale_and_check"])
def test_float16_params_warn_once_per_init_saying_how_to_silence_it(make):
  tx = _made_by(make)
  params = {"a": jnp.ones(3, jnp.float16), "b": jnp.ones(2, jnp.float16)}
  with pytest.warns(UserWarning, match="float16 master weights") as caught:
    tx.init(params)
  assert len(caught) == 1
  message = str(caught[0].message)
  assert "float32" in message and "filterwarnings" in message
  assert caught[0].filename == __file__  # points at the caller's `init`
  import warnings

  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="float16 master weights")
    tx.init(params)  # silenced as the message says


@pytest.mark.parametrize(
  "params",
  [
    {"a": jnp.ones(3), "b": jnp.ones(2, jnp.bfloat16)},
    {"a": jnp.ones(3), "i": jnp.ones(2, jnp.int32)},
    {"a": jax.ShapeDtypeStruct((3,), jnp.float32)},
  ],
)
def test_other_params_do_not_warn(params):
  lso().init(params)  # the suite turns warnings into errors
