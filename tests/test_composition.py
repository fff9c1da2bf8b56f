"""Composition with optax: chain, named_chain, inject_hyperparams, masked,
multi_transform, MultiSteps, in both nesting directions."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_equal

import optax_lossscale as ols

S = 2.0**10


def _params():
  return {"a": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array([[0.5, 0.25]])}


def _grads(scale=1.0, big=False):
  g = {"a": jnp.array([3.0, 4.0, -12.0]), "b": jnp.array([[0.5, -1.5]])}
  if big:
    g = jax.tree.map(lambda x: x * 100.0, g)
  return jax.tree.map(lambda x: x * scale, g)


def _bad(scale=1.0):
  return jax.tree.map(lambda x: x.at[..., 0].set(jnp.nan), _grads(scale))


def _assert_trees_close(a, b):
  ja, jb = jax.tree.structure(a), jax.tree.structure(b)
  assert ja == jb, (ja, jb)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def _run(tx, grads_seq, params=None, scaled=True):
  """Runs `tx` on gradient functions of the current scale."""
  params = _params() if params is None else params
  state = tx.init(params)
  # One jit for the loop: `jax.jit` of a fresh bound method (MultiSteps's
  # update) finds no cached trace and compiles again.
  update = jax.jit(tx.update)
  for g in grads_seq:
    grads = g(ols.loss_scale(state)) if scaled else g(1.0)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


# ---------------------------------------------------------------- clipping ---


def test_clip_inside_sees_unscaled_gradients():
  def inner():
    return optax.chain(
      optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-2)
    )

  tx = ols.loss_scale_optimizer(inner(), initial_scale=S)
  seq = [lambda s: _grads(s, big=True)] * 3
  got_params, got_state = _run(tx, seq)
  ref_params, ref_state = _run(
    inner(), [lambda s: _grads(big=True)] * 3, scaled=False
  )
  # S is a power of two: unscaling is exact, so the results are identical.
  assert_trees_equal(got_params, ref_params, bitwise=False)
  assert_trees_equal(got_state.inner_state, ref_state, bitwise=False)


def test_clip_inside_with_non_power_of_two_scale_f32_close():
  def inner():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))

  tx = ols.loss_scale_optimizer(inner(), initial_scale=1000.0)
  got, _ = _run(tx, [lambda s: _grads(s, big=True)] * 3)
  ref, _ = _run(inner(), [lambda s: _grads(big=True)] * 3, scaled=False)
  _assert_trees_close(got, ref)


def test_clip_inside_never_sees_nonfinite():
  seen = []

  def spy_update(updates, state, params=None):
    seen.append(updates)
    return updates, state

  spy = optax.GradientTransformation(lambda p: optax.EmptyState(), spy_update)
  tx = ols.loss_scale_optimizer(
    optax.chain(spy, optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
    initial_scale=S,
  )
  params = _params()
  state = tx.init(params)
  updates, state = tx.update(_bad(S), state, params)
  assert all(bool(ols.all_finite(t)) for t in seen)
  assert_trees_equal(
    updates, jax.tree.map(jnp.zeros_like, params), bitwise=False
  )


def test_clip_outside_is_wrong_order():
  """chain(clip, loss_scale_optimizer(...)) clips the *scaled* gradients:
  the norm is S times too large, so the effective step is S times too small."""
  tx_wrong = optax.chain(
    optax.clip_by_global_norm(1.0),
    ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=S),
  )
  tx_right = ols.loss_scale_optimizer(
    optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), initial_scale=S
  )
  params = _params()
  uw, _ = tx_wrong.update(_grads(S), tx_wrong.init(params), params)
  ur, _ = tx_right.update(_grads(S), tx_right.init(params), params)

  def norm(t):
    return float(optax.tree.norm(t))

  assert norm(ur) == pytest.approx(1.0, rel=1e-6)
  assert norm(uw) == pytest.approx(1.0 / S, rel=1e-5)


# ------------------------------------------------- chain / named_chain ------


def test_chain_outside_post_transform_and_lookup():
  tx = optax.chain(
    ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=S), optax.scale(0.5)
  )
  params = _params()
  state = tx.init(params)
  assert float(ols.loss_scale(state)) == S
  assert float(ols.scale_loss(jnp.float32(2.0), state)) == 2 * S
  updates, state = tx.update(_grads(S), state, params)
  assert_trees_equal(
    updates, jax.tree.map(lambda g: -0.5 * g, _grads()), bitwise=False
  )
  updates, state = tx.update(_bad(S), state, params)
  assert float(ols.loss_scale(state)) == S / 2
  assert int(ols.skip_stats(state).total_skipped) == 1
  assert int(ols.dynamic_counter(state)) == 0
  state = ols.set_loss_scale(state, 64.0)
  assert float(ols.loss_scale(state)) == 64.0


def test_named_chain_both_directions():
  inner = optax.named_chain(
    ("clip", optax.clip_by_global_norm(1.0)), ("opt", optax.adam(1e-2))
  )
  tx_in = ols.loss_scale_optimizer(inner, initial_scale=S)
  tx_out = optax.named_chain(
    ("ls", ols.loss_scale_optimizer(optax.adam(1e-2), initial_scale=S)),
    ("post", optax.scale(1.0)),
  )
  for tx in (tx_in, tx_out):
    _, state = _run(tx, [lambda s: _grads(s), _bad, lambda s: _grads(s)])
    assert float(ols.loss_scale(state)) == S / 2
    assert int(ols.skip_stats(state).total_skipped) == 1
    assert float(ols.scale_loss(jnp.float16(1.0), state)) == S / 2
  # The named entries stay reachable by name.
  state = tx_in.init(_params())
  assert set(state.inner_state.keys()) == {"clip", "opt"}
  assert isinstance(tx_out.init(_params())["ls"], ols.LossScaleOptimizerState)


# --------------------------------------------------------- inject_hyperparams


def test_inject_hyperparams_inside_learning_rate_get_and_set():
  tx = ols.loss_scale_optimizer(
    optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), initial_scale=S
  )
  params = _params()
  state = tx.init(params)
  assert float(optax.tree.get(state, "learning_rate")) == pytest.approx(0.1)
  assert float(
    optax.tree_utils.tree_get(state, "learning_rate")
  ) == pytest.approx(0.1)
  state = optax.tree.set(state, learning_rate=jnp.asarray(0.5))
  assert float(optax.tree.get(state, "learning_rate")) == 0.5
  assert isinstance(state, ols.LossScaleOptimizerState)
  updates, state = tx.update(_grads(S), state, params)
  _assert_trees_close(updates, jax.tree.map(lambda g: -0.5 * g, _grads()))
  # A skipped step leaves the hyperparameters and the inner count alone.
  before = state.inner_state
  _, state = tx.update(_bad(S), state, params)
  assert_trees_equal(state.inner_state, before, bitwise=False)
  # And it works under jit, with the learning rate changed between calls.
  step = jax.jit(tx.update)
  state = optax.tree_utils.tree_set(state, learning_rate=jnp.asarray(0.25))
  updates, state = step(_grads(ols.loss_scale(state)), state, params)
  _assert_trees_close(updates, jax.tree.map(lambda g: -0.25 * g, _grads()))


def test_inject_hyperparams_outside_factory():
  tx = optax.inject_hyperparams(
    lambda learning_rate: ols.loss_scale_optimizer(
      optax.sgd(learning_rate), initial_scale=S
    )
  )(learning_rate=0.1)
  params = _params()
  state = tx.init(params)
  assert float(optax.tree.get(state, "learning_rate")) == pytest.approx(0.1)
  state = optax.tree.set(state, learning_rate=jnp.asarray(0.5))
  updates, state = tx.update(_grads(S), state, params)
  _assert_trees_close(updates, jax.tree.map(lambda g: -0.5 * g, _grads()))
  _, state = tx.update(_bad(S), state, params)
  assert float(ols.loss_scale(state)) == S / 2
  assert float(ols.scale_loss(jnp.float32(1.0), state)) == S / 2


# -------------------------------------------------- masked / multi_transform

MASK = {"a": True, "b": False}


def test_masked_inside_is_right():
  tx = ols.loss_scale_optimizer(
    optax.masked(optax.sgd(1.0), MASK), initial_scale=S
  )
  params = _params()
  state = tx.init(params)
  updates, state = tx.update(_grads(S), state, params)
  np.testing.assert_array_equal(updates["a"], -_grads()["a"])
  # optax.masked passes unmasked leaves through unchanged: here they are
  # already unscaled, since the scaler is outermost.
  np.testing.assert_array_equal(updates["b"], _grads()["b"])
  _, state = tx.update(_bad(S), state, params)
  assert float(ols.loss_scale(state)) == S / 2


def test_masked_outside_leaves_unmasked_gradients_scaled():
  """masked(loss_scale_optimizer(...)) is the wrong order: the scaler only
  sees the masked leaves; the others pass through still multiplied by S."""
  tx = optax.masked(
    ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=S), MASK
  )
  params = _params()
  state = tx.init(params)
  assert float(ols.loss_scale(state)) == S  # the lookup still finds it
  updates, _ = tx.update(_grads(S), state, params)
  np.testing.assert_array_equal(updates["a"], -_grads()["a"])
  np.testing.assert_array_equal(updates["b"], _grads(S)["b"])  # scaled!


def test_multi_transform_inside_is_right():
  labels = {"a": "fast", "b": "slow"}
  tx = ols.loss_scale_optimizer(
    optax.multi_transform(
      {"fast": optax.sgd(1.0), "slow": optax.sgd(0.1)}, labels
    ),
    initial_scale=S,
  )
  params, state = _run(tx, [lambda s: _grads(s), _bad])
  ref, _ = _run(
    optax.multi_transform(
      {"fast": optax.sgd(1.0), "slow": optax.sgd(0.1)}, labels
    ),
    [lambda s: _grads()],
    scaled=False,
  )
  assert_trees_equal(params, ref, bitwise=False)
  assert float(ols.loss_scale(state)) == S / 2


def test_multi_transform_outside_two_scalers_is_refused_by_lookup():
  labels = {"a": "x", "b": "y"}
  tx = optax.multi_transform(
    {
      "x": ols.loss_scale_optimizer(optax.sgd(1.0)),
      "y": ols.loss_scale_optimizer(optax.sgd(1.0)),
    },
    labels,
  )
  state = tx.init(_params())
  with pytest.raises(ValueError, match="2 loss-scale states"):
    ols.scale_loss(jnp.float32(1.0), state)


def test_multi_transform_outside_one_scaler_other_group_stays_scaled():
  labels = {"a": "x", "b": "y"}
  tx = optax.multi_transform(
    {
      "x": ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=S),
      "y": optax.sgd(1.0),
    },
    labels,
  )
  params = _params()
  state = tx.init(params)
  updates, _ = tx.update(_grads(ols.loss_scale(state)), state, params)
  np.testing.assert_array_equal(updates["a"], -_grads()["a"])
  np.testing.assert_array_equal(updates["b"], -_grads(S)["b"])  # wrong


# ------------------------------------------------------------- MultiSteps ---

K = 3


def _ms_state(state):
  """The MultiSteps state inside loss_scale_optimizer(MultiSteps(...))."""
  return state.inner_state


def test_multisteps_inside_overflowing_microbatch_skipped_entirely():
  tx = ols.loss_scale_optimizer(
    optax.MultiSteps(optax.adam(1e-2), K), initial_scale=S
  )
  params = _params()
  state = tx.init(params)
  assert float(ols.scale_loss(jnp.float32(1.0), state)) == S
  micro = [
    _grads(),
    jax.tree.map(lambda g: g * 2, _grads()),
    jax.tree.map(lambda g: -g, _grads()),
  ]

  update = jax.jit(tx.update)  # once: see _run
  # micro-batch 0: good
  u, state = update(
    jax.tree.map(lambda g: g * ols.loss_scale(state), micro[0]), state, params
  )
  after_good = _ms_state(state)
  assert int(after_good.mini_step) == 1
  # an overflowing micro-batch: skipped entirely, the scale backs off
  u, state = update(_bad(ols.loss_scale(state)), state, params)
  assert_trees_equal(_ms_state(state), after_good, bitwise=False)
  assert float(ols.loss_scale(state)) == S / 2
  assert_trees_equal(u, jax.tree.map(jnp.zeros_like, params), bitwise=False)
  # micro-batches 1 and 2, at the new scale: the window completes
  for m in micro[1:]:
    scale = ols.loss_scale(state)
    u, state = update(
      jax.tree.map(lambda g, scale=scale: g * scale, m), state, params
    )
  assert int(_ms_state(state).mini_step) == 0
  assert int(_ms_state(state).gradient_step) == 1
  # ... with exactly the update of MultiSteps on the unscaled micro-batches,
  # although they were scaled by different scales.
  ref = optax.MultiSteps(optax.adam(1e-2), K)
  rstate, ref_update = ref.init(params), jax.jit(ref.update)
  for m in micro:
    ru, rstate = ref_update(m, rstate, params)
  assert_trees_equal(u, ru, bitwise=False)
  assert_trees_equal(_ms_state(state), rstate, bitwise=False)


def test_multisteps_inside_never_stalls_never_poisons():
  """The recommended nesting, on a long random good/bad sequence."""
  tx = ols.loss_scale_optimizer(
    optax.MultiSteps(optax.adam(1e-2), K),
    initial_scale=S,
    dynamic_growth_steps=4,
  )
  params = _params()
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  rng = np.random.default_rng(0)
  bad = rng.random(60) < 0.3
  good_seen = 0
  for is_bad in bad:
    scale = ols.loss_scale(state)
    grads = _bad(scale) if is_bad else _grads(scale)
    u, state = step(grads, state, params)
    params = optax.apply_updates(params, u)
    good_seen += int(not is_bad)
    ms = _ms_state(state)
    assert bool(ols.all_finite(ms.acc_grads))  # never poisoned
    assert bool(ols.all_finite(params))
    assert int(ms.mini_step) == good_seen % K  # counts good ones only
    assert int(ms.gradient_step) == good_seen // K  # never stalls
  assert int(ols.skip_stats(state).total_skipped) == int(bad.sum())


def test_multisteps_outside_nan_poisons_accumulator_forever():
  """optax.MultiSteps(loss_scale_optimizer(...), k), pinned as it really is
  (optax 0.2.8): the NaN micro-batch enters the running mean; at the end of
  the window the scaler skips and backs off, but MultiSteps resets the
  accumulator as `(1 - emit) * acc`, and 0 * NaN is NaN: the accumulator
  stays NaN, every later window is skipped too, and the scale backs off to
  min_scale. The run stalls for good."""
  tx = optax.MultiSteps(
    ols.loss_scale_optimizer(optax.adam(1e-2), initial_scale=S), K
  )
  params = _params()
  state = tx.init(params)
  assert float(ols.loss_scale(state)) == S  # lookup through MultiSteps
  seq = [False, True, False] + [False] * (3 * K)
  start, update = params, jax.jit(tx.update)  # once: see _run
  for i, is_bad in enumerate(seq):
    scale = ols.loss_scale(state)
    grads = _bad(scale) if is_bad else _grads(scale)
    u, state = update(grads, state, params)
    params = optax.apply_updates(params, u)
    if i >= 1:
      assert not bool(ols.all_finite(state.acc_grads))  # poisoned
  assert_trees_equal(params, start, bitwise=False)  # nothing ever applied
  n_windows = len(seq) // K
  assert int(state.gradient_step) == n_windows  # MultiSteps counts on
  assert int(ols.skip_stats(state).total_skipped) == n_windows
  assert float(ols.loss_scale(state)) == S / 2**n_windows


def test_multisteps_outside_scale_constant_within_window():
  """Without overflow the outside nesting is correct: the scale only moves at
  the end of a window, so the accumulated gradients share one scale."""
  tx = optax.MultiSteps(
    ols.loss_scale_optimizer(
      optax.adam(1e-2), initial_scale=S, dynamic_growth_steps=1
    ),
    K,
  )
  params = _params()
  state = tx.init(params)
  scales, update = [], jax.jit(tx.update)  # once: see _run
  for _ in range(2 * K):
    scales.append(float(ols.loss_scale(state)))
    u, state = update(_grads(ols.loss_scale(state)), state, params)
  assert scales == [S] * K + [2 * S] * K
  ref = optax.MultiSteps(optax.adam(1e-2), K)
  rstate, ref_update = ref.init(params), jax.jit(ref.update)
  for _ in range(2 * K):
    ru, rstate = ref_update(_grads(), rstate, params)
  assert_trees_equal(u, ru, bitwise=False)


def test_multisteps_outside_with_skip_not_finite_never_backs_off():
  """optax's own remedy, should_skip_update_fn=optax.skip_not_finite, keeps
  the accumulator clean, but the scaler never sees the overflow, so the
  scale never backs off: a scale that is too large overflows forever."""
  tx = optax.MultiSteps(
    ols.loss_scale_optimizer(optax.adam(1e-2), initial_scale=S),
    K,
    should_skip_update_fn=optax.skip_not_finite,
  )
  params = _params()
  state, update = tx.init(params), jax.jit(tx.update)  # once: see _run
  for _ in range(2 * K):
    _, state = update(_bad(ols.loss_scale(state)), state, params)
  assert float(ols.loss_scale(state)) == S  # never backed off
  assert int(ols.skip_stats(state).total_skipped) == 0
  assert int(state.gradient_step) == 0  # stalled
  assert bool(ols.all_finite(state.acc_grads))


def test_nested_loss_scaler_refused():
  with pytest.raises(ValueError):
    ols.loss_scale_optimizer(ols.loss_scale_optimizer(optax.sgd(1.0)))
  tx = ols.loss_scale_optimizer(
    optax.chain(ols.unscale_and_check(), optax.sgd(1.0))
  )
  with pytest.raises(ValueError, match="must not wrap another"):
    tx.init(_params())
