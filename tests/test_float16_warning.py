"""The float16 master-weights warning: for a float16 parameter that the
optimizer updates, not for one it never updates (issue 34, case 25)."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_lossscale as ols

PARAMS = {"frozen": jnp.ones(3, jnp.float16), "w": jnp.ones(2)}


def _frozen(trained):
  labels = {"frozen": "freeze", "w": "train"}
  return ols.loss_scale_optimizer(
    optax.multi_transform(
      {"train": optax.adam(1e-3), "freeze": trained}, labels
    )
  )


def test_a_frozen_float16_leaf_does_not_warn():
  tx = _frozen(optax.set_to_zero())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = tx.init(PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    updates, _ = jax.jit(tx.update)(grads, state, PARAMS)
  assert not jnp.any(updates["frozen"])


def test_a_trained_float16_leaf_warns():
  tx = _frozen(optax.sgd(0.1))
  with pytest.warns(ols.Float16ParamsWarning, match="1 of 2 parameters"):
    tx.init(PARAMS)


def test_a_frozen_leaf_among_trained_ones_is_not_counted():
  params = {**PARAMS, "trained": jnp.ones(4, jnp.float16)}
  labels = {"frozen": "freeze", "w": "train", "trained": "train"}
  tx = ols.loss_scale_optimizer(
    optax.multi_transform(
      {"train": optax.adam(1e-3), "freeze": optax.set_to_zero()}, labels
    )
  )
  with pytest.warns(ols.Float16ParamsWarning, match="1 of 3 parameters"):
    tx.init(params)


def test_an_update_that_needs_the_step_arguments_warns_as_before():
  # `reduce_on_plateau` needs `value`: the update cannot be read without
  # the step, so each float16 leaf may be updated, the frozen one too, and
  # is warned of.
  labels = {"frozen": "freeze", "w": "train"}
  inner = optax.chain(
    optax.multi_transform(
      {"train": optax.sgd(0.1), "freeze": optax.set_to_zero()}, labels
    ),
    optax.contrib.reduce_on_plateau(),
  )
  with pytest.warns(ols.Float16ParamsWarning, match="1 of 2 parameters"):
    ols.loss_scale_optimizer(inner).init(PARAMS)


def test_the_warning_is_read_while_tracing_and_computes_nothing():
  tx = _frozen(optax.set_to_zero())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.eval_shape(tx.init, PARAMS)
    jax.jit(tx.init)(PARAMS)
