"""Issue 12's smaller defects: extra args through every form of `inner`,
`optax.lookahead`, the config surviving `_replace`, `set_loss_scale` values
that would skip forever, and read-outs on stacked states."""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_equal

import optax_lossscale as ols

PARAMS = {"w": jnp.array([1.0, -2.0])}
GRADS = {"w": jnp.array([1.0, 1.0])}


# --- extra args reach the inner transformation ---


def _plateau_chain():
  return optax.chain(optax.sgd(0.5), optax.contrib.reduce_on_plateau())


def test_extra_args_reach_inner_through_multisteps_object():
  tx = ols.loss_scale_optimizer(
    optax.MultiSteps(_plateau_chain(), 1), initial_scale=1.0
  )
  state = tx.init(PARAMS)
  updates, state = tx.update(GRADS, state, PARAMS, value=jnp.float32(2.0))
  plain = optax.MultiSteps(_plateau_chain(), 1)
  expected, _ = plain.update(
    GRADS, plain.init(PARAMS), PARAMS, value=jnp.float32(2.0)
  )
  np.testing.assert_array_equal(updates["w"], expected["w"])
  np.testing.assert_array_equal(updates["w"], [-0.5, -0.5])


class _DuckTyped:
  """An object with `init` and `update` that needs an extra arg."""

  def init(self, params):
    return jnp.zeros([], jnp.float32)

  def update(self, updates, state, params=None, *, factor, **extra_args):
    del params, extra_args
    return jax.tree.map(lambda g: g * factor, updates), state + factor


def test_extra_args_reach_a_duck_typed_inner():
  tx = ols.loss_scale_optimizer(_DuckTyped(), initial_scale=2.0)
  state = tx.init(PARAMS)
  scaled = jax.tree.map(lambda g: g * 2.0, GRADS)
  updates, state = tx.update(scaled, state, PARAMS, factor=4.0, unused=1)
  np.testing.assert_array_equal(updates["w"], [4.0, 4.0])
  assert state.inner_state == 4.0


def test_plain_transformation_without_kwargs_is_given_none():
  plain = optax.sgd(0.5)
  inner = optax.GradientTransformation(plain.init, plain.update)
  tx = ols.loss_scale_optimizer(inner, initial_scale=1.0)
  updates, _ = tx.update(GRADS, tx.init(PARAMS), PARAMS, value=1.0)
  np.testing.assert_array_equal(updates["w"], [-0.5, -0.5])


# --- optax.lookahead ---


def test_lookahead_end_to_end():
  """Gradients for `params.fast` alongside `LookaheadParams`, as optax's
  own contract; finite steps match plain lookahead, a NaN step is skipped."""
  inner = optax.lookahead(optax.sgd(0.25), sync_period=2, slow_step_size=0.5)
  tx = ols.loss_scale_optimizer(inner, initial_scale=8.0)
  params = optax.LookaheadParams.init_synced(PARAMS)
  plain_params, plain_state = params, inner.init(params)
  state = tx.init(params)

  def loss(p):
    return jnp.sum(p["w"] ** 2)

  def scaled_loss(p, state):
    return ols.scale_loss(loss(p), state)

  for _ in range(3):
    grads = jax.grad(scaled_loss)(params.fast, state)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    plain_grads = jax.grad(loss)(plain_params.fast)
    plain_updates, plain_state = inner.update(
      plain_grads, plain_state, plain_params
    )
    plain_params = optax.apply_updates(plain_params, plain_updates)
  assert_trees_equal(params, plain_params, bitwise=False)

  nan_grads = {"w": jnp.array([jnp.nan, 1.0])}
  updates, new_state = tx.update(nan_grads, state, params)
  assert_trees_equal(
    updates, jax.tree.map(jnp.zeros_like, params), bitwise=False
  )
  assert_trees_equal(new_state.inner_state, state.inner_state, bitwise=False)
  assert ols.loss_scale(new_state) == 4.0


def test_lookahead_gradients_of_the_wrong_tree_are_still_refused():
  inner = optax.lookahead(optax.sgd(0.25), sync_period=2, slow_step_size=0.5)
  tx = ols.loss_scale_optimizer(inner)
  params = optax.LookaheadParams.init_synced(PARAMS)
  with pytest.raises(
    ValueError, match=r"`params\.fast` for `optax\.lookahead`"
  ):
    tx.update({"v": jnp.ones(2)}, tx.init(params), params)


# --- loss_scale_config survives the tuple's own operations ---


def test_config_survives_replace_copy_and_pickle():
  tx = ols.loss_scale_optimizer(
    optax.sgd(0.1), initial_scale=256.0, dynamic_growth_steps=10
  )
  config = tx.loss_scale_config
  replaced = tx._replace(init=tx.init)
  assert replaced.loss_scale_config == config
  assert ols.to_keras_config(replaced) == {
    "dynamic": True,
    "initial_scale": 256.0,
    "dynamic_growth_steps": 10,
  }
  assert copy.deepcopy(tx).loss_scale_config == config
  assert pickle.loads(pickle.dumps(config)) == config


def test_config_travels_in_update_not_in_an_instance_dict():
  # Issue 35, point 4: the configuration is `update`'s; it survives what
  # rebuilds the pair, and nothing is kept beside the two fields.
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), min_scale=2.0, hysteresis=3)
  config = tx.loss_scale_config
  for other in (
    jax.tree.map(lambda x: x, tx),
    copy.copy(tx),
    copy.deepcopy(tx),
    tx._replace(init=tx.init),
    type(tx)(*tx),
  ):
    assert type(other) is ols.LossScaledTransformation
    assert other.loss_scale_config == config and other.skips_inner
    assert vars(other) == {}
  assert vars(tx) == {}
  assert not ols.unscale_and_check().skips_inner
  # It is still optax's pair, and `update` still takes the extra args.
  init, update = tx
  state = init(PARAMS)
  update(GRADS, state, PARAMS, value=jnp.float32(1.0))


def test_the_transformation_says_it_does_not_pickle():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1))
  with pytest.raises(TypeError, match="does not pickle: its `init` and"):
    pickle.dumps(tx)
  with pytest.raises(TypeError, match=r"`tx\.loss_scale_config`"):
    pickle.dumps(ols.unscale_and_check())
  assert pickle.loads(pickle.dumps(tx.loss_scale_config)) == (
    tx.loss_scale_config
  )


def test_config_is_gone_with_a_replaced_update():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1))
  other = tx._replace(update=optax.sgd(0.1).update)
  with pytest.raises(AttributeError, match="has no `loss_scale_config`"):
    other.loss_scale_config  # noqa: B018
  with pytest.raises(TypeError, match="`tx` must be made by"):
    ols.to_keras_config(other)


# --- set_loss_scale: no value that skips forever, no NaN under jit ---


def _static(scale=4.0):
  return ols.loss_scale_optimizer(
    optax.sgd(0.5), dynamic=False, initial_scale=scale, min_scale=min(scale, 1)
  )


def test_static_scale_refuses_a_value_below_one():
  state = _static().init(PARAMS)
  with pytest.raises(
    ValueError,
    match=r"`value` must be >= 1 for this"
    r" static loss scale \(dynamic=False, now 4.0\), got 0.5",
  ):
    ols.set_loss_scale(state, 0.5)
  assert ols.loss_scale(ols.set_loss_scale(state, 1.0)) == 1.0


def test_static_scale_below_one_from_its_config_stays_settable():
  tx = _static(0.5)
  state = ols.set_loss_scale(tx.init(PARAMS), 0.25)
  updates, state = tx.update(GRADS, state, PARAMS)
  np.testing.assert_array_equal(updates["w"], [-2.0, -2.0])
  assert bool(ols.skip_stats(state).last_finite)


def test_static_scale_traced_value_below_one_keeps_the_scale():
  tx = _static()
  state = jax.jit(ols.set_loss_scale)(tx.init(PARAMS), jnp.float32(0.5))
  assert ols.loss_scale(state) == 4.0
  _, state = tx.update(GRADS, state, PARAMS)
  assert bool(ols.skip_stats(state).last_finite)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 0.0, -2.0])
def test_traced_bad_value_keeps_the_scale(bad):
  tx = ols.loss_scale_optimizer(optax.sgd(0.5), initial_scale=8.0)
  state = jax.jit(ols.set_loss_scale)(tx.init(PARAMS), jnp.float32(bad))
  assert ols.loss_scale(state) == 8.0
  _, state = tx.update(GRADS, state, PARAMS)
  assert ols.loss_scale(state) == 8.0
  assert bool(ols.skip_stats(state).last_finite)


def test_traced_good_value_is_set():
  tx = ols.loss_scale_optimizer(optax.sgd(0.5))
  state = jax.jit(ols.set_loss_scale)(tx.init(PARAMS), jnp.float32(64.0))
  assert ols.loss_scale(state) == 64.0


# --- read-outs on stacked states; scale_loss and update refuse them ---


@pytest.mark.slow
def test_readouts_on_a_vmap_ensemble_give_one_value_per_member():
  tx = ols.loss_scale_optimizer(optax.sgd(0.5), initial_scale=8.0)
  stacked_params = {"w": jnp.ones((3, 2))}
  states = jax.vmap(tx.init)(stacked_params)
  grads = {"w": jnp.array([[1.0, 1.0], [jnp.nan, 1.0], [1.0, 1.0]])}
  _, states = jax.vmap(tx.update)(grads, states, stacked_params)
  np.testing.assert_array_equal(ols.loss_scale(states), [8.0, 4.0, 8.0])
  np.testing.assert_array_equal(ols.dynamic_counter(states), [1, 0, 1])
  stats = ols.skip_stats(states)
  np.testing.assert_array_equal(stats.total_skipped, [0, 1, 0])
  np.testing.assert_array_equal(stats.last_finite, [True, False, True])
  with pytest.raises(ValueError, match="must hold a scalar scale"):
    ols.scale_loss(1.0, states)
  with pytest.raises(ValueError, match="must hold a scalar scale"):
    tx.update(grads, states, stacked_params)
  reset = ols.set_loss_scale(states, 16.0)
  np.testing.assert_array_equal(ols.loss_scale(reset), [16.0] * 3)


def test_readouts_on_a_replicated_state_give_one_value_per_replica():
  tx = ols.loss_scale_optimizer(optax.sgd(0.5), initial_scale=8.0)
  devices = jax.local_devices()
  state = tx.init(PARAMS)
  replicated = jax.pmap(lambda _: state)(jnp.arange(len(devices)))
  np.testing.assert_array_equal(
    ols.loss_scale(replicated), [8.0] * len(devices)
  )
  with pytest.raises(ValueError, match="must hold a scalar scale"):
    ols.scale_loss(1.0, replicated)


# --- set_loss_scale: no subnormal scale (issue 22) ---


@pytest.mark.parametrize("value", [1e-40, 2.0**-127, np.float32(1e-45)])
def test_a_subnormal_value_is_refused(value):
  state = ols.loss_scale_optimizer(optax.sgd(0.5)).init(PARAMS)
  with pytest.raises(ValueError, match=r"`value` must be .*2\*\*-126"):
    ols.set_loss_scale(state, value)


def test_a_traced_subnormal_value_keeps_the_scale():
  # The floor as low as a scale goes: the smallest normal float32.
  tx = ols.loss_scale_optimizer(
    optax.sgd(0.5), initial_scale=8.0, min_scale=np.finfo(np.float32).tiny
  )
  state = tx.init(PARAMS)
  for value in (np.float32(2.0**-127), np.float32(2.0**-149)):
    new = jax.jit(ols.set_loss_scale)(state, value)
    assert ols.loss_scale(new) == 8.0
  smallest = np.finfo(np.float32).tiny
  new = jax.jit(ols.set_loss_scale)(state, smallest)
  assert ols.loss_scale(new) == smallest
