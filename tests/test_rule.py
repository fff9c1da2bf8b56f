"""Step-by-step trajectories of the scaling rule against hand-derived values.

Scales are powers of two, so every comparison is exact."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_equal

import optax_lossscale as ols

FINITE = {"w": jnp.array([2.0, -4.0], jnp.float32)}
NONFINITE = {"w": jnp.array([jnp.nan, 1.0], jnp.float32)}


def run(tx, pattern):
  """Runs `pattern` ('F' finite, 'N' non-finite); returns (scale, counter)s."""
  state = tx.init({"w": jnp.zeros(2)})
  update = jax.jit(tx.update)
  out = []
  for ch in pattern:
    _, state = update(FINITE if ch == "F" else NONFINITE, state)
    counter = ols.dynamic_counter(state)
    out.append(
      (float(ols.loss_scale(state)), None if counter is None else int(counter))
    )
  return out, state


def scales(trajectory):
  return [s for s, _ in trajectory]


def test_defaults_are_keras():
  tx = ols.loss_scale_optimizer(optax.sgd(1.0))
  state = tx.init({"w": jnp.zeros(2)})
  assert ols.loss_scale(state) == 2.0**15
  assert ols.loss_scale(state).dtype == jnp.float32
  assert ols.dynamic_counter(state) == 0
  assert tx.loss_scale_config.growth_steps == 2000


def test_growth_on_the_growth_steps_th_finite_step():
  # Keras-TF2: grows when counter + 1 >= growth_steps, i.e. on step 3 and 6.
  trajectory, _ = run(
    ols.loss_scale_optimizer(
      optax.sgd(1.0), initial_scale=1.0, dynamic_growth_steps=3
    ),
    "FFFFFF",
  )
  assert trajectory == [
    (1.0, 1),
    (1.0, 2),
    (2.0, 0),
    (2.0, 1),
    (2.0, 2),
    (4.0, 0),
  ]


def test_growth_steps_one_grows_every_finite_step():
  trajectory, _ = run(
    ols.loss_scale_optimizer(
      optax.sgd(1.0), initial_scale=1.0, dynamic_growth_steps=1
    ),
    "FFNF",
  )
  assert trajectory == [(2.0, 0), (4.0, 0), (2.0, 0), (4.0, 0)]


def test_nonfinite_resets_counter_and_halves():
  trajectory, _ = run(
    ols.loss_scale_optimizer(
      optax.sgd(1.0), initial_scale=64.0, dynamic_growth_steps=3
    ),
    "FFNFFF",
  )
  assert trajectory == [
    (64.0, 1),
    (64.0, 2),
    (32.0, 0),
    (32.0, 1),
    (32.0, 2),
    (64.0, 0),
  ]


def test_backoff_to_the_floor_and_stays_there():
  trajectory, _ = run(
    ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=8.0), "NNNNNN"
  )
  assert scales(trajectory) == [4.0, 2.0, 1.0, 1.0, 1.0, 1.0]


def test_custom_floor():
  trajectory, _ = run(
    ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=8.0, min_scale=0.25),
    "NNNNNNN",
  )
  assert scales(trajectory) == [4.0, 2.0, 1.0, 0.5, 0.25, 0.25, 0.25]


def test_growth_capped_below_inf_resets_counter():
  top = 2.0**127  # the largest power of two in float32; doubling is inf
  trajectory, _ = run(
    ols.loss_scale_optimizer(
      optax.sgd(1.0), initial_scale=top, dynamic_growth_steps=2
    ),
    "FFFF",
  )
  assert trajectory == [(top, 1), (top, 0), (top, 1), (top, 0)]


def test_max_scale_refuses_growth_beyond_it():
  trajectory, _ = run(
    ols.loss_scale_optimizer(
      optax.sgd(1.0), initial_scale=4.0, dynamic_growth_steps=1, max_scale=16.0
    ),
    "FFFF",
  )
  assert scales(trajectory) == [8.0, 16.0, 16.0, 16.0]


def test_max_scale_not_a_power_of_two_drops_the_candidate():
  trajectory, _ = run(
    ols.loss_scale_optimizer(
      optax.sgd(1.0), initial_scale=4.0, dynamic_growth_steps=1, max_scale=12.0
    ),
    "FF",
  )
  assert scales(trajectory) == [8.0, 8.0]


def test_custom_factors():
  trajectory, _ = run(
    ols.loss_scale_optimizer(
      optax.sgd(1.0),
      initial_scale=16.0,
      dynamic_growth_steps=1,
      growth_factor=4.0,
      backoff_factor=0.125,
    ),
    "FNNF",
  )
  assert scales(trajectory) == [64.0, 8.0, 1.0, 4.0]


def test_hysteresis_backs_off_after_k_in_a_row():
  trajectory, state = run(
    ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=64.0, hysteresis=3),
    "NNNNFNNN",
  )
  # Streak 1: steps 1-2 absorbed, 3 and 4 back off. A finite step refills.
  assert scales(trajectory) == [64.0, 64.0, 32.0, 16.0, 16.0, 16.0, 16.0, 8.0]
  stats = ols.skip_stats(state)
  assert int(stats.total_skipped) == 7
  assert int(stats.skipped_in_a_row) == 3


def test_hysteresis_still_skips_every_nonfinite_step():
  tx = ols.loss_scale_optimizer(optax.sgd(1.0), hysteresis=5)
  params = {"w": jnp.array([1.0, 2.0])}
  state = tx.init(params)
  updates, state = tx.update(NONFINITE, state, params)
  assert (updates["w"] == 0).all()
  assert ols.loss_scale(state) == 2.0**15


def test_static_mode_never_changes_and_still_skips():
  tx = ols.loss_scale_optimizer(
    optax.sgd(1.0), dynamic=False, initial_scale=128.0
  )
  trajectory, state = run(tx, "FFNNFN")
  assert trajectory == [(128.0, None)] * 6
  stats = ols.skip_stats(state)
  assert int(stats.total_skipped) == 3
  params = {"w": jnp.ones(2)}
  updates, _ = tx.update(NONFINITE, tx.init(params), params)
  assert (updates["w"] == 0).all()


def test_unscales_with_the_scale_before_the_step():
  # The growth step must still divide by the old scale.
  tx = ols.loss_scale_optimizer(
    optax.sgd(1.0), initial_scale=4.0, dynamic_growth_steps=1
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  updates, state = tx.update({"w": jnp.array([8.0, 4.0])}, state, params)
  np.testing.assert_array_equal(updates["w"], [-2.0, -1.0])
  assert ols.loss_scale(state) == 8.0
  updates, _ = tx.update({"w": jnp.array([8.0, 4.0])}, state, params)
  np.testing.assert_array_equal(updates["w"], [-1.0, -0.5])


def test_huge_scale_divides_rather_than_multiplies_by_reciprocal():
  # 1 / 2**127 is subnormal in float32 and flushes to zero on XLA CPU.
  scale = 2.0**127
  tx = ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=scale)
  params = {"w": jnp.zeros(1)}
  grads = {"w": jnp.array([2.0**127], jnp.float32)}
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["w"], [-1.0])


@pytest.mark.filterwarnings("ignore:float16 master weights")
@pytest.mark.parametrize("poison", [jnp.nan, jnp.inf, -jnp.inf])
def test_skip_keeps_inner_state_bit_for_bit(poison):
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), initial_scale=4.0)
  params = {
    "a": jnp.ones(3, jnp.float16),
    "b": jnp.ones(2, jnp.bfloat16),
    "c": jnp.ones(4),
  }
  state = tx.init(params)
  grads = jax.tree.map(lambda x: x * 4, params)
  update = jax.jit(tx.update)
  _, state = update(grads, state, params)
  bad = dict(grads, c=grads["c"].at[1].set(poison))
  updates, new_state = update(bad, state, params)
  for u, p in zip(
    jax.tree.leaves(updates), jax.tree.leaves(params), strict=True
  ):
    assert u.dtype == p.dtype
    np.testing.assert_array_equal(u, np.zeros_like(u))
  assert_trees_equal(new_state.inner_state, state.inner_state)


def test_finite_step_equals_plain_inner_update():
  inner = optax.adam(1e-2)
  tx = ols.loss_scale_optimizer(inner, initial_scale=2.0**10)
  params = {"w": jnp.linspace(-1, 1, 7), "b": jnp.ones(3)}
  grads = {"w": jnp.linspace(0.5, 2, 7), "b": jnp.full(3, 0.25)}
  scaled = jax.tree.map(lambda g: g * 2.0**10, grads)
  ours, our_state = tx.update(scaled, tx.init(params), params)
  plain, plain_state = inner.update(grads, inner.init(params), params)
  chex.assert_trees_all_equal(ours, plain, strict=True)
  chex.assert_trees_all_equal(our_state.inner_state, plain_state, strict=True)


def test_skipped_step_does_not_advance_inner_count():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  _, state = tx.update(FINITE, state, params)
  _, state = tx.update(NONFINITE, state, params)
  assert int(state.inner_state[0].count) == 1


def test_unscale_and_check_alone_zeroes_nonfinite_steps():
  tx = optax.chain(ols.unscale_and_check(initial_scale=2.0), optax.sgd(1.0))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  updates, state = tx.update(FINITE, state, params)
  np.testing.assert_array_equal(updates["w"], [-1.0, 2.0])
  updates, state = tx.update(NONFINITE, state, params)
  np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
  assert ols.loss_scale(state) == 1.0


# --- a static scale below 1 (issue 22) ---


@pytest.mark.filterwarnings("ignore:float16 master weights")
def test_static_scale_below_one_runs_and_checks_the_unscaled_values():
  """Dividing by 0.5 doubles a gradient: a finite float16 one can overflow,
  so the check runs on the values passed on. `min_scale` and `max_scale`
  bound the dynamic scale only, and are not compared with a static one."""
  tx = ols.loss_scale_optimizer(
    optax.sgd(1.0), dynamic=False, initial_scale=0.5
  )
  assert tx.loss_scale_config.min_scale == 1.0
  params = {"w": jnp.zeros(2, jnp.float16)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  updates, state = update({"w": jnp.array([1.0, -3.0], jnp.float16)}, state)
  np.testing.assert_array_equal(updates["w"], [-2.0, 6.0])
  assert bool(ols.skip_stats(state).last_finite)
  for bad in ([40000.0, 1.0], [jnp.nan, 1.0], [jnp.inf, 1.0]):
    # 40000 is finite in float16, 80000 is not.
    updates, state = update({"w": jnp.array(bad, jnp.float16)}, state)
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
    assert not bool(ols.skip_stats(state).last_finite), bad
    assert ols.loss_scale(state) == 0.5
  assert int(ols.skip_stats(state).total_skipped) == 3
  wide = ols.loss_scale_optimizer(
    optax.sgd(1.0), dynamic=False, initial_scale=2.0**20, max_scale=2.0**16
  )
  assert wide.loss_scale_config.initial_scale == 2.0**20


@pytest.mark.parametrize("loss", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("make", [ols.loss_scale_optimizer, None])
def test_a_nonfinite_loss_with_finite_gradients_is_skipped_and_backs_off(
  loss, make
):
  """With `value` given, a non-finite loss skips the step whatever the
  gradients (a target whose logit is -inf has an inf loss and finite
  gradients), and under the defaults backs the scale off as an overflow."""
  if make is None:
    tx = ols.unscale_and_check(initial_scale=8.0, dynamic_growth_steps=2)
  else:
    tx = make(optax.adam(1.0), initial_scale=8.0, dynamic_growth_steps=2)
  params = {"w": jnp.zeros(2)}
  update = jax.jit(tx.update)
  state = tx.init(params)
  _, state = update(FINITE, state, params, value=jnp.float32(1.0))
  updates, skipped = update(FINITE, state, params, value=jnp.float32(loss))
  assert_trees_equal(updates, {"w": jnp.zeros(2)})
  stats = ols.skip_stats(skipped)
  assert not bool(stats.last_finite)
  assert int(stats.total_skipped) == 1 and int(stats.skipped_in_a_row) == 1
  assert int(stats.nonfinite_loss_steps) == 1 and int(stats.nan_steps) == 0
  assert float(ols.loss_scale(skipped)) == 4.0
  assert int(ols.dynamic_counter(skipped)) == 0
  if make is not None:  # the inner state is kept, its count too
    assert_trees_equal(skipped.inner_state, state.inner_state)


def test_a_nonfinite_loss_held_leaves_scale_counter_and_hysteresis():
  """With `backoff_on_nonfinite_loss=False` such a step is skipped and
  counted, and the scale, its counter and the hysteresis count stay."""
  tx = ols.loss_scale_optimizer(
    optax.sgd(1.0),
    initial_scale=8.0,
    dynamic_growth_steps=3,
    hysteresis=2,
    backoff_on_nonfinite_loss=False,
  )
  params = {"w": jnp.zeros(2)}
  update = jax.jit(tx.update)
  state = tx.init(params)
  _, state = update(FINITE, state, params, value=jnp.float32(1.0))
  _, state = update(NONFINITE, state, params, value=jnp.float32(1.0))
  before = state.loss_scale_state
  updates, state = update(FINITE, state, params, value=jnp.float32(np.inf))
  after = state.loss_scale_state
  assert_trees_equal(updates, {"w": jnp.zeros(2)})
  assert not bool(after.last_finite)
  assert int(after.total_skipped) == 2 and int(after.nonfinite_loss_steps) == 1
  assert float(after.loss_scale) == float(before.loss_scale) == 8.0
  assert int(after.counter) == int(before.counter) == 0
  assert int(after.overflows_in_a_row) == int(before.overflows_in_a_row) == 1
