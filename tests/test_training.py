"""Training-loop integration: flax TrainState, value_and_grad, scan, jit with
donation, vmap over an ensemble."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import optax_lossscale as ols


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, dtype=jnp.float16, param_dtype=jnp.float32)(x)
    x = nn.relu(x)
    return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(x)


def _data(n=64):
  x = jax.random.normal(jax.random.PRNGKey(1), (n, 4))
  y = jnp.sin(x @ jnp.array([1.0, -2.0, 0.5, 1.5]))[:, None]
  return x, y


@pytest.mark.slow
def test_flax_train_state_trains_in_float16():
  model = MLP()
  x, y = _data()
  params = model.init(jax.random.PRNGKey(0), x)
  tx = ols.loss_scale_optimizer(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  )
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=tx
  )
  assert isinstance(state.opt_state, ols.LossScaleOptimizerState)

  def loss_fn(params, x, y):
    pred = state.apply_fn(params, x)
    assert pred.dtype == jnp.float16  # float16 compute
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  # scale_loss accepts the optimizer state or the whole TrainState.
  half = jnp.float16(0.5)
  assert float(ols.scale_loss(half, state)) == float(
    ols.scale_loss(half, state.opt_state)
  )
  assert float(ols.loss_scale(state)) == 2.0**15

  @jax.jit
  def train_step(state, x, y):
    def scaled(params):
      return ols.scale_loss(loss_fn(params, x, y), state)

    grads = jax.grad(scaled)(state.params)
    new_state = state.apply_gradients(grads=grads)
    return new_state, loss_fn(state.params, x, y)

  losses = []
  for _ in range(60):
    state, loss = train_step(state, x, y)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0]
  assert all(np.isfinite(losses))
  assert all(bool(ols.all_finite(p)) for p in jax.tree.leaves(state.params))
  assert int(state.step) == 60  # TrainState counts calls, skipped or not
  # A skipped step through apply_gradients leaves params and inner state.
  bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), state.params)
  new = state.apply_gradients(grads=bad)
  chex.assert_trees_all_equal(new.params, state.params)
  chex.assert_trees_all_equal(
    new.opt_state.inner_state, state.opt_state.inner_state
  )
  assert float(ols.loss_scale(new)) == float(ols.loss_scale(state)) / 2


def _quad(params, x):
  return jnp.sum((params["w"] * x - 1.0) ** 2)


def test_value_and_grad_plain_aux_and_argnums():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=8.0)
  params = {"w": jnp.array([1.0, 2.0])}
  state = tx.init(params)
  x = jnp.array([3.0, -1.0])

  loss, grads = ols.value_and_grad(_quad)(state, params, x)
  ref_loss, ref_grads = jax.value_and_grad(_quad)(params, x)
  assert loss == ref_loss  # unscaled value
  chex.assert_trees_all_equal(grads, jax.tree.map(lambda g: 8.0 * g, ref_grads))

  def with_aux(params, x):
    return _quad(params, x), {"pred": params["w"] * x}

  (loss, aux), grads = ols.value_and_grad(with_aux, has_aux=True)(
    state, params, x
  )
  assert loss == ref_loss
  chex.assert_trees_all_equal(aux["pred"], params["w"] * x)
  chex.assert_trees_all_equal(grads, jax.tree.map(lambda g: 8.0 * g, ref_grads))

  loss, (gp, gx) = ols.value_and_grad(_quad, argnums=(0, 1))(state, params, x)
  _, (rp, rx) = jax.value_and_grad(_quad, argnums=(0, 1))(params, x)
  chex.assert_trees_all_equal(gp, jax.tree.map(lambda g: 8.0 * g, rp))
  chex.assert_trees_all_equal(gx, 8.0 * rx)

  updates, state = tx.update(grads, state, params)
  chex.assert_trees_all_close(
    updates, jax.tree.map(lambda g: -0.1 * g, ref_grads)
  )


def _make_step(tx):
  def step(params, opt_state, x):
    loss, grads = ols.value_and_grad(_quad)(opt_state, params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def test_scan_many_steps():
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), initial_scale=2.0**4, dynamic_growth_steps=10
  )
  params = {"w": jnp.array([0.5, 2.0])}
  step = _make_step(tx)
  xs = jnp.tile(jnp.array([[3.0, -1.0]]), (100, 1))
  xs = xs.at[37, 0].set(jnp.nan).at[71, 1].set(jnp.inf)

  def body(carry, x):
    p, s = carry
    p, s, loss = step(p, s, x)
    return (p, s), loss

  (p_scan, s_scan), losses = jax.jit(
    lambda p, s: jax.lax.scan(body, (p, s), xs)
  )(params, tx.init(params))
  # Same as the Python loop: the loss-scale state exactly; params and adam
  # moments to float32 rounding (XLA fuses the scan body differently).
  p, s = params, tx.init(params)
  jstep = jax.jit(step)
  for x in xs:
    p, s, _ = jstep(p, s, x)
  chex.assert_trees_all_equal(s_scan.loss_scale_state, s.loss_scale_state)
  chex.assert_trees_all_close(
    (p_scan, s_scan.inner_state), (p, s.inner_state), rtol=1e-5, atol=1e-7
  )
  assert int(ols.skip_stats(s_scan).total_skipped) == 2
  assert losses.shape == (100,)
  assert float(losses[-1]) < float(losses[0])


def test_jit_donated_state_no_retrace():
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), initial_scale=2.0**4, dynamic_growth_steps=2
  )

  step = jax.jit(
    chex.assert_max_traces(_make_step(tx), n=1), donate_argnums=(0, 1)
  )
  params = {"w": jnp.array([0.5, 2.0])}
  state = tx.init(params)
  x = jnp.array([3.0, -1.0])
  for i in range(6):  # growth, then a skip (scale and counters change)
    xi = x.at[0].set(jnp.nan) if i == 3 else x
    old_w = params["w"]
    params, state, _ = step(params, state, xi)
    assert old_w.is_deleted()  # the buffers were donated
  assert int(ols.skip_stats(state).total_skipped) == 1


def test_vmap_ensemble_each_member_own_scale():
  n = 4
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), initial_scale=2.0**8)
  params = {"w": jnp.stack([jnp.array([0.5, 2.0]) * (i + 1) for i in range(n)])}
  states = jax.vmap(tx.init)(params)
  assert states.loss_scale_state.loss_scale.shape == (n,)
  step = jax.jit(jax.vmap(_make_step(tx)))
  x = jnp.tile(jnp.array([[3.0, -1.0]]), (n, 1))
  params1, states1, _ = step(params, states, x)
  x_bad = x.at[2, 0].set(jnp.nan)  # only member 2 overflows
  params2, states2, _ = step(params1, states1, x_bad)
  scales = np.asarray(states2.loss_scale_state.loss_scale)
  np.testing.assert_array_equal(scales, [256.0, 256.0, 128.0, 256.0])
  np.testing.assert_array_equal(params2["w"][2], params1["w"][2])
  for i in (0, 1, 3):
    assert not np.array_equal(params2["w"][i], params1["w"][i])
  # scale_loss inside vmap sees each member's own scale.
  scaled = jax.vmap(ols.scale_loss)(jnp.ones(n), states2)
  np.testing.assert_array_equal(scaled, scales)
  # One member, indexed out, is an ordinary state.
  member = jax.tree.map(lambda a: a[2], states2)
  assert float(ols.loss_scale(member)) == 128.0


def test_batched_state_outside_vmap_raises():
  tx = ols.loss_scale_optimizer(optax.adam(1e-2))
  params = {"w": jnp.ones((3, 2))}
  batched = jax.vmap(tx.init)(params)
  with pytest.raises(ValueError, match="vmap"):
    ols.scale_loss(jnp.float32(1.0), batched)
  with pytest.raises(ValueError, match="vmap"):
    tx.update(params, batched, params)
  # The read-outs take it (issue 12): one value per member.
  np.testing.assert_array_equal(ols.loss_scale(batched), [2.0**15] * 3)
