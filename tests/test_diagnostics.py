"""Why steps skip: NaN against inf, a non-finite loss, per-leaf counts, the
scale kept on bad batches (`backoff_on_nonfinite_loss=False`), and the
report read at logging time."""

import functools

import _model
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_equal
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_lossscale as ols

# PARAMS hold a float16 leaf on purpose (a model's float16 buffers).
pytestmark = pytest.mark.filterwarnings("ignore:float16 master weights")

PARAMS = {
  "dense": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3, jnp.float16)},
  "head": jnp.ones(4),
}
INT32_MAX = 2**31 - 1


def grads_with(leaf=None, poison=None):
  """Finite gradients, or with one element of `leaf` set to `poison`."""
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  if leaf is None:
    return grads
  flat, treedef = jax.tree.flatten(grads)
  flat[leaf] = flat[leaf].ravel().at[0].set(poison).reshape(flat[leaf].shape)
  return jax.tree.unflatten(treedef, flat)


@functools.cache
def compiled(**kwargs):
  tx = ols.loss_scale_optimizer(optax.adam(1e-3), **kwargs)

  @jax.jit
  def step(params, state, grads, loss):
    updates, state = tx.update(grads, state, params, value=loss)
    return optax.apply_updates(params, updates), state

  return tx, step


def run(steps, **kwargs):
  """Runs `(leaf, poison, loss)` steps; returns (tx, params, state)."""
  tx, step = compiled(**kwargs)
  params, state = PARAMS, tx.init(PARAMS)
  for leaf, poison, loss in steps:
    params, state = step(params, state, grads_with(leaf, poison), loss)
  return tx, params, state


FINITE = (None, None, 1.0)
INF = (0, np.inf, 1.0)
NAN = (2, np.nan, 1.0)
BAD_BATCH = (1, np.nan, np.nan)  # a NaN loss, and NaN gradients with it


# --- the counters ---


def test_nan_and_nonfinite_loss_steps_are_counted():
  _, _, state = run([FINITE, INF, NAN, BAD_BATCH, FINITE, INF])
  stats = ols.skip_stats(state)
  assert int(stats.total_skipped) == 4
  assert int(stats.nan_steps) == 2  # NAN and BAD_BATCH, not the infs
  assert int(stats.nonfinite_loss_steps) == 1
  assert int(stats.skipped_in_a_row) == 1
  assert int(state.loss_scale_state.steps) == 6


def test_without_value_nothing_changes():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1))
  state = tx.init(PARAMS)
  _, with_value = tx.update(grads_with(), state, PARAMS, value=jnp.ones([]))
  _, without = tx.update(grads_with(), state, PARAMS)
  assert_trees_equal(with_value, without)


def test_a_nonfinite_loss_with_finite_gradients_is_skipped_by_default():
  """With `value` given, a non-finite loss skips the step whatever the
  gradients; under the defaults the scale backs off as for an overflow."""
  _, params, state = run([(None, None, np.nan)])
  assert not bool(ols.skip_stats(state).last_finite)
  assert int(ols.skip_stats(state).nonfinite_loss_steps) == 1
  assert int(ols.skip_stats(state).total_skipped) == 1
  assert_trees_equal(params, PARAMS)
  assert float(ols.loss_scale(state)) == 2.0**14


# --- no collapse ---


def test_bad_batches_do_not_lower_the_scale_when_told():
  burst = [FINITE] * 3 + [BAD_BATCH] * 15 + [FINITE]
  _, _, keras = run(burst, dynamic_growth_steps=100)
  _, _, held = run(
    burst, dynamic_growth_steps=100, backoff_on_nonfinite_loss=False
  )
  assert float(ols.loss_scale(keras)) == 2.0**15 / 2**15  # down to 1
  assert float(ols.loss_scale(held)) == 2.0**15
  # The counter went on from where it was: 3 finite, 15 held, 1 finite.
  assert int(ols.dynamic_counter(held)) == 4
  for state in (keras, held):
    assert int(ols.skip_stats(state).total_skipped) == 15
    assert int(ols.skip_stats(state).nonfinite_loss_steps) == 15


def test_bad_batches_are_skipped_even_with_finite_gradients_when_told():
  _, params, state = run(
    [(None, None, np.inf)], backoff_on_nonfinite_loss=False
  )
  assert not bool(ols.skip_stats(state).last_finite)
  assert int(ols.skip_stats(state).nonfinite_loss_steps) == 1
  assert int(ols.skip_stats(state).nan_steps) == 0
  np.testing.assert_array_equal(params["head"], PARAMS["head"])
  assert float(ols.loss_scale(state)) == 2.0**15


def test_a_finite_loss_with_nonfinite_gradients_still_backs_off():
  _, _, state = run([INF], backoff_on_nonfinite_loss=False)
  assert float(ols.loss_scale(state)) == 2.0**14


def test_hysteresis_is_not_spent_on_bad_batches():
  steps = [INF, BAD_BATCH, INF]
  _, _, held = run(steps, hysteresis=2, backoff_on_nonfinite_loss=False)
  # Two gradient overflows in a row (the bad batch between them does not
  # count, nor reset): the second backs off.
  assert float(ols.loss_scale(held)) == 2.0**14
  assert int(held.loss_scale_state.overflows_in_a_row) == 2
  assert int(ols.skip_stats(held).skipped_in_a_row) == 3


loss_step = st.tuples(
  st.booleans(),  # gradients finite
  st.booleans(),  # NaN (not inf) when not finite
  st.booleans(),  # loss finite
)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
  steps=st.lists(loss_step, min_size=1, max_size=16),
  backoff=st.booleans(),
  hysteresis=st.sampled_from([1, 2]),
)
def test_random_sequences_with_losses_follow_the_rule(
  steps, backoff, hysteresis
):
  kwargs = dict(
    initial_scale=2.0**6,
    dynamic_growth_steps=2,
    hysteresis=hysteresis,
    backoff_on_nonfinite_loss=backoff,
  )
  tx, step = compiled(**kwargs)
  config = _model.ModelConfig(
    initial_scale=2.0**6,
    growth_steps=2,
    hysteresis=hysteresis,
    backoff_on_nonfinite_loss=backoff,
  )
  params, state = PARAMS, tx.init(PARAMS)
  expected = _model.initial(config)
  for finite, nan, loss_finite in steps:
    poison = np.nan if nan else np.inf
    grads = grads_with(None if finite else 1, poison)
    loss = 1.0 if loss_finite else np.nan
    new_params, state = step(params, state, grads, loss)
    expected = _model.step(
      expected, finite, config, loss_finite=loss_finite, nan=nan and not finite
    )
    got = state.loss_scale_state
    assert float(got.loss_scale) == expected.scale
    assert int(got.counter) == expected.counter
    assert int(got.overflows_in_a_row) == expected.overflows_in_a_row
    stats = ols.skip_stats(state)
    assert int(stats.total_skipped) == expected.total
    assert int(stats.skipped_in_a_row) == expected.in_a_row
    assert bool(stats.last_finite) == expected.last_finite
    assert int(stats.nan_steps) == expected.nan_steps
    assert int(stats.nonfinite_loss_steps) == expected.nonfinite_loss_steps
    if not expected.last_finite:
      assert_trees_equal(new_params, params)
    params = new_params


# --- value reaches the inner transformation ---


def test_value_is_forwarded_to_the_inner_transformation():
  inner = optax.chain(
    optax.sgd(1.0),
    optax.contrib.reduce_on_plateau(patience=0, factor=0.5, cooldown=0),
  )
  tx = ols.loss_scale_optimizer(inner, initial_scale=1.0)
  params = jnp.ones(2)
  state = tx.init(params)
  for loss in (1.0, 2.0, 3.0):
    _, state = tx.update(jnp.ones(2), state, params, value=jnp.float32(loss))
  plateau = state.inner_state[1]
  assert float(plateau.scale) < 1.0  # it saw the losses rise


# --- per-leaf counts ---


def test_nonfinite_leaves_counts_each_leaf():
  _, _, state = run([INF, NAN, FINITE, (2, np.inf, 1.0)], leaf_stats=True)
  counts = ols.nonfinite_leaves(state)
  assert jax.tree.structure(counts) == jax.tree.structure(PARAMS)
  flat = [int(c) for c in jax.tree.leaves(counts)]
  # Leaves in order: dense/b, dense/w, head.
  assert flat == [1, 0, 2]
  assert all(c.dtype == jnp.int32 for c in jax.tree.leaves(counts))


def test_nonfinite_leaves_needs_leaf_stats():
  _, _, state = run([INF])
  with pytest.raises(ValueError, match="leaf_stats=True"):
    ols.nonfinite_leaves(state)


def test_leaf_stats_change_no_update():
  steps = [FINITE, INF, FINITE, NAN, FINITE]
  _, plain_params, plain = run(steps)
  _, params, state = run(steps, leaf_stats=True)
  assert_trees_equal(params, plain_params)
  assert ols.skip_stats(state) == ols.skip_stats(plain)


def test_leaf_stats_found_through_wrappers():
  tx = optax.MultiSteps(
    ols.loss_scale_optimizer(
      optax.inject_hyperparams(optax.adam)(1e-3), leaf_stats=True
    ),
    every_k_schedule=1,
  )
  state = tx.init(PARAMS)
  _, state = tx.update(grads_with(2, np.inf), state, PARAMS)
  assert int(jax.tree.leaves(ols.nonfinite_leaves(state))[2]) == 1


def test_leaf_stats_in_nnx_and_train_state():
  from flax import nnx
  from flax.training import train_state

  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), leaf_stats=True)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grads = nnx.state(model, nnx.Param)
  grads = jax.tree.map(lambda g: jnp.full_like(g, jnp.inf), grads)
  optimizer.update(model, grads)
  counts = ols.nonfinite_leaves(optimizer)
  assert sorted(int(c) for c in jax.tree.leaves(counts)) == [1, 1]
  assert int(ols.skip_stats(optimizer).total_skipped) == 1
  # Every view NNX gives of the optimizer keeps the counts' names: the
  # tree they are counted by holds no arrays, and is not dropped.
  bias_only = jax.tree_util.tree_map_with_path(
    lambda path, g: (
      g if "bias" in jax.tree_util.keystr(path) else jnp.zeros_like(g)
    ),
    grads,
  )
  optimizer.update(model, bias_only)
  views = [optimizer.opt_state, nnx.state(optimizer), nnx.split(optimizer)[1]]
  for view in (optimizer, *views):
    counts = ols.nonfinite_leaves(view)
    assert {k: int(v) for k, v in counts.items()} == {"bias": 2, "kernel": 1}
    text = str(ols.skip_report(view, tx))
    assert "2 steps  bias" in text and "1 step   kernel" in text, text

  ts = train_state.TrainState.create(
    apply_fn=None,
    params=PARAMS,
    tx=ols.loss_scale_optimizer(optax.sgd(0.1), leaf_stats=True),
  )
  ts = ts.apply_gradients(grads=grads_with(0, np.nan))
  assert [int(c) for c in jax.tree.leaves(ols.nonfinite_leaves(ts))] == [
    1,
    0,
    0,
  ]


def test_the_counters_saturate():
  tx, step = compiled(leaf_stats=True)
  state = tx.init(PARAMS)
  full = jnp.asarray(INT32_MAX, jnp.int32)
  ls = state.loss_scale_state._replace(
    total_skipped=full,
    skipped_in_a_row=full,
    overflows_in_a_row=full,
    nan_steps=full,
    nonfinite_loss_steps=full,
    steps=full,
    leaf_notfinite=state.loss_scale_state.leaf_notfinite._replace(
      counts=jnp.full([len(jax.tree.leaves(PARAMS))], INT32_MAX, jnp.int32)
    ),
  )
  state = state._replace(loss_scale_state=ls)
  _, state = step(PARAMS, state, grads_with(1, np.nan), jnp.float32(np.nan))
  got = state.loss_scale_state
  for value in (
    got.total_skipped,
    got.skipped_in_a_row,
    got.overflows_in_a_row,
    got.nan_steps,
    got.nonfinite_loss_steps,
    got.steps,
    *got.leaf_notfinite.counts,
  ):
    assert int(value) == INT32_MAX


def test_no_retrace_with_the_new_state():
  tx, step = compiled(leaf_stats=True, backoff_on_nonfinite_loss=False)
  params, state = PARAMS, tx.init(PARAMS)
  for leaf, poison, loss in [FINITE, INF, BAD_BATCH, FINITE, NAN]:
    params, state = step(params, state, grads_with(leaf, poison), loss)
  assert step._cache_size() == 1


def test_the_recent_skips_ring():
  steps = [FINITE] + [INF] * 3 + [FINITE] * 2 + [NAN] * 7 + [BAD_BATCH]
  _, _, state = run(steps, dynamic_growth_steps=100)
  report = ols.skip_report(state)
  # The last 8 of 11 skips, oldest first.
  assert [event[0] for event in report.recent] == [6, 7, 8, 9, 10, 11, 12, 13]
  assert report.recent[0][1] == ("NaN",)
  assert report.recent[-1][1] == ("NaN", "loss")
  scale = 2.0**15 / 2**10  # after 3 + 7 backoffs ...
  assert report.recent[-1][2] == scale and report.recent[-1][3] == scale / 2


@pytest.mark.parametrize("bad", ["leaf_stats", "backoff_on_nonfinite_loss"])
def test_the_new_keywords_take_bools_only(bad):
  with pytest.raises(TypeError, match=f"`{bad}` must be a bool"):
    ols.loss_scale_optimizer(optax.sgd(0.1), **{bad: 1})
  with pytest.raises(TypeError, match=f"`{bad}` must be a bool"):
    ols.unscale_and_check(**{bad: "yes"})


def test_unscale_and_check_takes_value_and_leaf_stats():
  tx = optax.chain(
    ols.unscale_and_check(leaf_stats=True, backoff_on_nonfinite_loss=False),
    optax.sgd(0.1),
  )
  state = tx.init(PARAMS)
  updates, state = tx.update(grads_with(), state, PARAMS, value=jnp.nan)
  assert all(not np.any(u) for u in jax.tree.leaves(updates))
  assert int(ols.skip_stats(state).nonfinite_loss_steps) == 1
  assert float(ols.loss_scale(state)) == 2.0**15
  assert all(int(c) == 0 for c in jax.tree.leaves(ols.nonfinite_leaves(state)))


# --- the report ---


def report_of(steps, **kwargs):
  tx, _, state = run(steps, **kwargs)
  return ols.skip_report(state, tx)


def test_a_healthy_run_reports_nothing_wrong():
  report = report_of([FINITE] * 3)
  assert report.total_skipped == 0
  assert report.diagnosis == (
    "no step was skipped: the gradients of every step were finite at the"
    " scale it ran at.",
  )


def test_bad_batches_are_diagnosed_as_such():
  report = report_of([FINITE] + [BAD_BATCH] * 4)
  text = " ".join(str(report).split())
  assert "the loss itself was not finite in 4 of 4 skipped steps" in text
  assert "which no loss scale fixes" in text
  assert "backoff_on_nonfinite_loss=False" in text


def test_nan_down_to_the_floor_is_float16_range_or_a_bug():
  report = report_of([NAN] * 17)
  assert report.at_floor and report.loss_scale == 1.0
  (sentence,) = report.diagnosis
  assert sentence.startswith("NaN in the gradients on 2 steps that ran at")
  assert "float16's range exceeded in a value or a derivative" in sentence
  assert "or a bug" in sentence and "not float16's range" not in sentence
  assert "now at its floor" in str(report).splitlines()[0]


def test_inf_down_to_the_floor_is_called_a_range_problem():
  report = report_of([INF] * 17)
  assert report.diagnosis[0].startswith(
    "the gradients overflowed to inf on 2 steps that ran at the floor (1): a"
    " value or a derivative beyond float16's range (65504)"
  )


def test_skips_in_a_row_say_what_happened_and_what_to_do_if_they_go_on():
  report = report_of([INF] * 4)
  assert report.diagnosis == (
    "4 steps skipped in a row, the last for non-finite gradients, lowering"
    " the scale from 2**12 to 2**11: if the scale reaches its floor (1) and"
    " steps still skip, the overflow does not depend on the scale: run"
    " `ols.find_overflow` on a skipped step's batch.",
  )


def test_the_report_names_the_parameters():
  report = report_of([INF, INF, (2, np.inf, 1.0)], leaf_stats=True)
  assert report.leaves == (("dense/b", 2), ("head", 1), ("dense/w", 0))
  text = str(report)
  assert "parameters whose gradients were not finite, most often first:" in (
    text
  )
  assert "  2 steps  dense/b\n  1 step   head\n" in text
  assert "parameters whose gradients stayed finite: dense/w" in text
  assert "1 stayed finite on every step (`dense/w`)" in " ".join(text.split())


def test_the_report_refuses_what_is_no_transformation():
  _, _, state = run([FINITE])
  with pytest.raises(TypeError, match="`tx` must be an optax transformation"):
    ols.skip_report(state, "adam")
  # A transformation that carries no configuration is accepted as it is.
  assert ols.skip_report(state, optax.sgd(0.1)) == ols.skip_report(state)


def test_keras_export_refuses_what_keras_cannot_do():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), backoff_on_nonfinite_loss=False)
  with pytest.raises(ValueError, match="backoff_on_nonfinite_loss"):
    ols.to_keras_config(tx)
  counted = ols.loss_scale_optimizer(optax.sgd(0.1), leaf_stats=True)
  assert ols.to_keras_config(counted)["dynamic"] is True


def test_leaf_stats_name_what_they_count_by():
  # The counts are named by the params' tree with `()` for each leaf: an
  # empty tuple in the params themselves is refused at `init`, not taken
  # for a leaf (None, the other empty subtree, is counted past).
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), leaf_stats=True)
  with pytest.raises(ValueError, match=r"hold an empty tuple `\(\)`"):
    tx.init({"w": jnp.ones(2), "none_yet": ()})
  params = {"w": jnp.ones(2), "none_yet": None, "b": jnp.ones(1)}
  state = tx.init(params)
  grads = {"w": jnp.array([1.0, jnp.inf]), "none_yet": None, "b": jnp.ones(1)}
  _, state = tx.update(grads, state, params)
  assert jax.tree.map(int, ols.nonfinite_leaves(state)) == {
    "b": 0,
    "none_yet": None,
    "w": 1,
  }
