"""Hostile input, one case at a time: the error type and a fragment of its
message are pinned for every bad argument and every misuse.

`docs/errors.md` is generated from these cases (from the messages actually
raised):  python tests/test_hostile.py
and `test_errors_doc_is_current` checks that it is up to date.
"""

import os
import re

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


# (description shown in docs, thunk, error type, message fragment)
CONSTRUCTOR_CASES = [
  # inner
  (
    "inner=None",
    lambda: ols.loss_scale_optimizer(None),
    TypeError,
    "`inner` must be an optax transformation",
  ),
  (
    "inner='adam'",
    lambda: ols.loss_scale_optimizer("adam"),
    TypeError,
    "got 'adam' of type str",
  ),
  (
    "inner=optax.adam (the factory, not a transformation)",
    lambda: ols.loss_scale_optimizer(optax.adam),
    TypeError,
    "`inner` must be an optax transformation",
  ),
  (
    "inner=loss_scale_optimizer(...)",
    lambda: ols.loss_scale_optimizer(lso()),
    ValueError,
    "`inner` is already loss-scaled",
  ),
  (
    "inner=chain(unscale_and_check(), sgd), at init",
    lambda: ols.loss_scale_optimizer(
      optax.chain(ols.unscale_and_check(), SGD)
    ).init(PARAMS),
    ValueError,
    "`inner` already contains a loss scaler",
  ),
  # dynamic
  (
    "dynamic='yes'",
    lambda: lso(dynamic="yes"),
    TypeError,
    "`dynamic` must be a bool (True or False), got 'yes' of type str",
  ),
  (
    "dynamic=1",
    lambda: lso(dynamic=1),
    TypeError,
    "`dynamic` must be a bool (True or False), got 1 of type int",
  ),
  (
    "dynamic=None",
    lambda: lso(dynamic=None),
    TypeError,
    "`dynamic` must be a bool",
  ),
  (
    "dynamic=np.bool_(True)",
    lambda: lso(dynamic=np.bool_(True)),
    TypeError,
    "of type bool",
  ),
  (
    "dynamic=False, no initial_scale",
    lambda: lso(dynamic=False),
    ValueError,
    "`initial_scale` must be given when `dynamic=False`",
  ),
  (
    "dynamic=False, dynamic_growth_steps=10",
    lambda: lso(dynamic=False, initial_scale=8.0, dynamic_growth_steps=10),
    ValueError,
    "`dynamic_growth_steps` must be None when `dynamic=False`",
  ),
  # initial_scale
  (
    "initial_scale='1024'",
    lambda: lso(initial_scale="1024"),
    TypeError,
    "`initial_scale` must be a real number",
  ),
  (
    "initial_scale=True",
    lambda: lso(initial_scale=True),
    TypeError,
    "got True of type bool",
  ),
  (
    "initial_scale=1+0j",
    lambda: lso(initial_scale=1 + 0j),
    TypeError,
    "of type complex",
  ),
  (
    "initial_scale=np.ones(2)",
    lambda: lso(initial_scale=np.ones(2)),
    TypeError,
    "of type ndarray",
  ),
  (
    "initial_scale=0",
    lambda: lso(initial_scale=0),
    ValueError,
    "`initial_scale` must be finite and > 0, representable in float32, got 0.",
  ),
  ("initial_scale=-1", lambda: lso(initial_scale=-1), ValueError, "got -1."),
  (
    "initial_scale=nan",
    lambda: lso(initial_scale=NAN),
    ValueError,
    "`initial_scale` must be finite and > 0, representable in float32, got nan",
  ),
  ("initial_scale=inf", lambda: lso(initial_scale=INF), ValueError, "got inf"),
  (
    "initial_scale=1e39 (overflows float32)",
    lambda: lso(initial_scale=1e39),
    ValueError,
    "got 1e+39",
  ),
  (
    "initial_scale=1e-46 (underflows float32 to 0)",
    lambda: lso(initial_scale=1e-46),
    ValueError,
    "got 1e-46",
  ),
  (
    "initial_scale=0.5 (below min_scale=1)",
    lambda: lso(initial_scale=0.5),
    ValueError,
    "`min_scale <= initial_scale <= max_scale` must hold, got"
    " min_scale=1.0, initial_scale=0.5",
  ),
  (
    "initial_scale=2**20, max_scale=2**16",
    lambda: lso(initial_scale=2.0**20, max_scale=2.0**16),
    ValueError,
    "max_scale=65536.0",
  ),
  # dynamic_growth_steps
  (
    "dynamic_growth_steps=0",
    lambda: lso(dynamic_growth_steps=0),
    ValueError,
    "`dynamic_growth_steps` must be an int >= 1 and <= 2**31 - 1, got 0",
  ),
  (
    "dynamic_growth_steps=-5",
    lambda: lso(dynamic_growth_steps=-5),
    ValueError,
    "got -5",
  ),
  (
    "dynamic_growth_steps=2**31",
    lambda: lso(dynamic_growth_steps=2**31),
    ValueError,
    "got 2147483648",
  ),
  (
    "dynamic_growth_steps=10.0",
    lambda: lso(dynamic_growth_steps=10.0),
    TypeError,
    "got 10.0 of type float",
  ),
  (
    "dynamic_growth_steps=nan",
    lambda: lso(dynamic_growth_steps=NAN),
    TypeError,
    "got nan of type float",
  ),
  (
    "dynamic_growth_steps=inf",
    lambda: lso(dynamic_growth_steps=INF),
    TypeError,
    "got inf of type float",
  ),
  (
    "dynamic_growth_steps=True",
    lambda: lso(dynamic_growth_steps=True),
    TypeError,
    "of type bool",
  ),
  (
    "dynamic_growth_steps='10'",
    lambda: lso(dynamic_growth_steps="10"),
    TypeError,
    "of type str",
  ),
  # growth_factor
  (
    "growth_factor=1.0",
    lambda: lso(growth_factor=1.0),
    ValueError,
    "`growth_factor` must be finite and > 1, got 1.0",
  ),
  ("growth_factor=0.5", lambda: lso(growth_factor=0.5), ValueError, "got 0.5"),
  (
    "growth_factor=nan",
    lambda: lso(growth_factor=NAN),
    ValueError,
    "`growth_factor` must be finite and > 1, got nan",
  ),
  ("growth_factor=inf", lambda: lso(growth_factor=INF), ValueError, "got inf"),
  (
    "growth_factor='2'",
    lambda: lso(growth_factor="2"),
    TypeError,
    "`growth_factor` must be a real number",
  ),
  (
    "growth_factor=None",
    lambda: lso(growth_factor=None),
    TypeError,
    "of type NoneType",
  ),
  # backoff_factor
  (
    "backoff_factor=1.0",
    lambda: lso(backoff_factor=1.0),
    ValueError,
    "`backoff_factor` must be in the open interval (0, 1), got 1.0",
  ),
  ("backoff_factor=0", lambda: lso(backoff_factor=0), ValueError, "got 0."),
  (
    "backoff_factor=-0.5",
    lambda: lso(backoff_factor=-0.5),
    ValueError,
    "got -0.5",
  ),
  (
    "backoff_factor=2.0",
    lambda: lso(backoff_factor=2.0),
    ValueError,
    "got 2.0",
  ),
  (
    "backoff_factor=nan",
    lambda: lso(backoff_factor=NAN),
    ValueError,
    "got nan",
  ),
  (
    "backoff_factor=inf",
    lambda: lso(backoff_factor=INF),
    ValueError,
    "got inf",
  ),
  (
    "backoff_factor=None",
    lambda: lso(backoff_factor=None),
    TypeError,
    "`backoff_factor` must be a real number",
  ),
  # min_scale
  (
    "min_scale=0",
    lambda: lso(min_scale=0),
    ValueError,
    "`min_scale` must be finite and > 0, representable in float32, got 0.",
  ),
  ("min_scale=-1", lambda: lso(min_scale=-1), ValueError, "got -1."),
  ("min_scale=nan", lambda: lso(min_scale=NAN), ValueError, "got nan"),
  ("min_scale=inf", lambda: lso(min_scale=INF), ValueError, "got inf"),
  (
    "min_scale=None",
    lambda: lso(min_scale=None),
    TypeError,
    "`min_scale` must be a real number",
  ),
  (
    "min_scale=2**16 (above initial_scale=2**15)",
    lambda: lso(min_scale=2.0**16),
    ValueError,
    "`min_scale <= initial_scale <= max_scale` must hold",
  ),
  # max_scale
  (
    "max_scale=0",
    lambda: lso(max_scale=0),
    ValueError,
    "`max_scale` must be finite and > 0, representable in float32, got 0.",
  ),
  ("max_scale=nan", lambda: lso(max_scale=NAN), ValueError, "got nan"),
  ("max_scale=inf", lambda: lso(max_scale=INF), ValueError, "got inf"),
  (
    "max_scale=1e39 (overflows float32)",
    lambda: lso(max_scale=1e39),
    ValueError,
    "got 1e+39",
  ),
  (
    "max_scale='big'",
    lambda: lso(max_scale="big"),
    TypeError,
    "`max_scale` must be a real number",
  ),
  (
    "max_scale=1024 (below initial_scale=2**15)",
    lambda: lso(max_scale=1024),
    ValueError,
    "`min_scale <= initial_scale <= max_scale` must hold",
  ),
  # hysteresis
  (
    "hysteresis=0",
    lambda: lso(hysteresis=0),
    ValueError,
    "`hysteresis` must be an int >= 1 and <= 2**31 - 1, got 0",
  ),
  ("hysteresis=-1", lambda: lso(hysteresis=-1), ValueError, "got -1"),
  (
    "hysteresis=2**31",
    lambda: lso(hysteresis=2**31),
    ValueError,
    "got 2147483648",
  ),
  (
    "hysteresis=1.5",
    lambda: lso(hysteresis=1.5),
    TypeError,
    "`hysteresis` must be an int",
  ),
  (
    "hysteresis=nan",
    lambda: lso(hysteresis=NAN),
    TypeError,
    "got nan of type float",
  ),
  ("hysteresis=True", lambda: lso(hysteresis=True), TypeError, "of type bool"),
  # axis_name
  (
    "axis_name=3.5",
    lambda: lso(axis_name=3.5),
    TypeError,
    "`axis_name` must be None, an axis name (a str), or a tuple of axis"
    " names, got 3.5",
  ),
  ("axis_name=()", lambda: lso(axis_name=()), TypeError, "got ()"),
  (
    "axis_name=('batch', None)",
    lambda: lso(axis_name=("batch", None)),
    TypeError,
    "got ('batch', None)",
  ),
  ("axis_name=True", lambda: lso(axis_name=True), TypeError, "got True"),
  (
    "axis_name=['batch'] (a list)",
    lambda: lso(axis_name=["batch"]),
    TypeError,
    "got ['batch']",
  ),
  # unscale_and_check validates the same way
  (
    "unscale_and_check(hysteresis=0)",
    lambda: ols.unscale_and_check(hysteresis=0),
    ValueError,
    "`hysteresis` must be an int >= 1",
  ),
  (
    "unscale_and_check(initial_scale=nan)",
    lambda: ols.unscale_and_check(initial_scale=NAN),
    ValueError,
    "`initial_scale` must be finite and > 0",
  ),
]


def _state(tx=None, params=PARAMS):
  tx = tx or lso()
  return tx.init(params)


def _update_mismatched_adam():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  # eval_shape only traces: the error is a trace-time error.
  jax.eval_shape(tx.update, {"a": jnp.ones(3)}, tx.init(PARAMS), PARAMS)


def _update_foreign_state():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  jax.eval_shape(tx.update, PARAMS, optax.adam(1e-3).init(PARAMS), PARAMS)


def _two_scalers():
  state = optax.chain(ols.unscale_and_check(), ols.unscale_and_check()).init(
    PARAMS
  )
  ols.scale_loss(jnp.float32(1.0), state)


def _batched_scale():
  tx = lso()
  states = jax.vmap(tx.init)(jnp.ones((4, 3)))
  ols.scale_loss(jnp.float32(1.0), states)


MISUSE_CASES = [
  (
    "update(grads missing a leaf of params), inner=adam",
    _update_mismatched_adam,
    ValueError,
    "The gradient tree must have the structure of `params`",
  ),
  (
    "scale_loss(loss, optax.adam(...).init(params)) (no loss scaling)",
    lambda: ols.scale_loss(jnp.float32(1.0), optax.adam(1e-3).init(PARAMS)),
    ValueError,
    "No loss-scale state found in the given optimizer state",
  ),
  (
    "scale_loss(loss, params)",
    lambda: ols.scale_loss(jnp.float32(1.0), PARAMS),
    ValueError,
    "No loss-scale state found",
  ),
  (
    "scale_loss(loss, state with two loss scalers)",
    _two_scalers,
    ValueError,
    "Found 2 loss-scale states in the optimizer state",
  ),
  (
    "scale_loss(loss, state made under jax.vmap)",
    _batched_scale,
    ValueError,
    "The loss-scale state must hold a scalar scale",
  ),
  (
    "scale_loss(int32 loss, state)",
    lambda: ols.scale_loss(jnp.int32(3), _state()),
    TypeError,
    "`loss` must be floating point to be scaled, got dtype int32",
  ),
  (
    "loss_scale(optax.sgd(...).init(params))",
    lambda: ols.loss_scale(SGD.init(PARAMS)),
    ValueError,
    "No loss-scale state found",
  ),
  (
    "set_loss_scale(state, nan)",
    lambda: ols.set_loss_scale(_state(), NAN),
    ValueError,
    "`value` must be a finite loss scale > 0 (in float32), got nan",
  ),
  (
    "set_loss_scale(state, 0.0)",
    lambda: ols.set_loss_scale(_state(), 0.0),
    ValueError,
    "got 0.0",
  ),
  (
    "set_loss_scale(state, 1e39)",
    lambda: ols.set_loss_scale(_state(), 1e39),
    ValueError,
    "got 1e+39",
  ),
  (
    "update(grads, optax.adam(...).init(params)) (a foreign state)",
    _update_foreign_state,
    TypeError,
    "`state` must be the LossScaleOptimizerState that this optimizer's"
    " `init` returned, got tuple",
  ),
]

ALL_CASES = CONSTRUCTOR_CASES + MISUSE_CASES


def _ids(cases):
  return [c[0] for c in cases]


@pytest.mark.parametrize(
  "desc, thunk, exc, fragment", CONSTRUCTOR_CASES, ids=_ids(CONSTRUCTOR_CASES)
)
def test_bad_constructor_argument(desc, thunk, exc, fragment):
  with pytest.raises(exc) as info:
    thunk()
  assert type(info.value) is exc, desc
  assert fragment in str(info.value), (desc, str(info.value))


@pytest.mark.parametrize(
  "desc, thunk, exc, fragment", MISUSE_CASES, ids=_ids(MISUSE_CASES)
)
def test_misuse(desc, thunk, exc, fragment):
  with pytest.raises(exc) as info:
    thunk()
  assert type(info.value) is exc, desc
  assert fragment in str(info.value), (desc, str(info.value))


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


# --- docs/errors.md ---

DOC_PATH = os.path.join(
  os.path.dirname(os.path.dirname(__file__)), "docs", "errors.md"
)


def _cell(text):
  text = re.sub(r" at 0x[0-9a-f]+", " at 0x...", text)
  text = re.sub(r"\s+", " ", text)
  return text.replace("|", "\\|").replace("\n", " ")


def render_errors_doc():
  lines = [
    "# Errors raised by optax_lossscale",
    "",
    "Generated from `tests/test_hostile.py` (`python tests/test_hostile.py`)"
    " with the messages the library actually raises;"
    " `test_errors_doc_is_current` keeps this file in sync. Calls are"
    " written with `lso(...)` for `loss_scale_optimizer(optax.sgd(0.1),"
    " ...)`.",
    "",
    "Configuration errors are raised when the transformation is built,"
    " never inside `jit`. Non-finite gradients are not errors: they are"
    " skipped and counted (see `skip_stats`).",
    "",
  ]
  for title, cases in [
    ("Constructor arguments", CONSTRUCTOR_CASES),
    ("Misuse", MISUSE_CASES),
  ]:
    lines += [
      f"## {title}",
      "",
      "| input | error | message |",
      "| --- | --- | --- |",
    ]
    for desc, thunk, exc, _ in cases:
      try:
        thunk()
      except exc as e:
        message = str(e).strip()
      else:
        raise AssertionError(f"{desc} raised nothing")
      if len(message) > 400:
        message = message[:400] + " ..."
      lines.append(f"| `{_cell(desc)}` | `{exc.__name__}` | {_cell(message)} |")
    lines.append("")
  lines += [
    "## Behaviour pinned without an error",
    "",
    "- Integer gradient leaves are passed to the inner transformation"
    " unscaled and never make a step non-finite; on a skipped step their"
    " updates are zeros.",
    "- Complex gradients are divided by the scale (the dtype is kept); a"
    " NaN or inf in either the real or the imaginary part makes the step"
    " non-finite.",
    "- `update` with a gradient tree that does not match the parameters"
    " raises only if the inner transformation combines the two trees"
    " (adam: the `ValueError` above, at trace time); with `sgd` nothing is"
    " checked until `optax.apply_updates`.",
    "- A foreign optimizer state passed to `update` raises the"
    " `AttributeError` above at trace time.",
    "",
  ]
  return "\n".join(lines)


def test_errors_doc_is_current():
  with open(DOC_PATH) as f:
    assert f.read() == render_errors_doc(), (
      "docs/errors.md is stale: run `python tests/test_hostile.py`"
    )


if __name__ == "__main__":
  with open(DOC_PATH, "w") as f:
    f.write(render_errors_doc())
  print(f"wrote {DOC_PATH}")
