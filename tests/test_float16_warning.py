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


@pytest.mark.xfail(strict=True, reason="issue 34, case 25")
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
