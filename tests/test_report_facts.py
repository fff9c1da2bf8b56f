"""The skip report says only what the state recorded (issue 34, cases 1, 3,
4, 6, 7, 9, 10 and 11): the scale each skip ran at, the floor it was checked
against, whether hysteresis held the scale, what each cause counted, in the
order the skips came, and never a current setting or a prediction as a fact
about the past."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

PARAMS = {"w": jnp.ones(3), "b": jnp.zeros(2)}
INT32_MAX = 2**31 - 1

# A step's gradients (finite, an inf, a NaN) and loss, by code.
LOSSES = {"L": np.nan, "l": np.inf}
POISON = {"i": np.inf, "n": np.nan, "L": np.nan}


def grads_for(code, scale=1.0):
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * scale, PARAMS)
  if code in POISON:
    grads["w"] = grads["w"].at[0].set(POISON[code])
  return grads


@functools.cache
def compiled(**config):
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), **config)
  step = jax.jit(
    lambda grads, state, loss: tx.update(grads, state, PARAMS, value=loss)[1]
  )
  return tx, step


def run(codes, state=None, **config):
  """One step per code ("f" finite, "i" inf, "n" NaN, "L" a NaN loss with
  NaN gradients, "l" an inf loss with finite gradients)."""
  tx, step = compiled(**config)
  state = tx.init(PARAMS) if state is None else state
  for code in codes:
    loss = jnp.float32(LOSSES.get(code, 1.0))
    state = step(grads_for(code), state, loss)
  return tx, state


def words_of(report):
  return " ".join(str(report).split())


# Case 1: a static scale changed by hand.


def test_a_static_scale_set_by_hand_reports_the_scale_the_skips_ran_at():
  tx, state = run("iii", dynamic=False, initial_scale=2.0**15)
  state = ols.set_loss_scale(state, 8.0)
  report = ols.skip_report(state, tx)
  diagnosis = " ".join(report.diagnosis)
  assert "static scale 2**15" in diagnosis
  assert "scale 8" not in diagnosis
  # The skips ran at 2**15; at 8 the next step may apply: not stuck.
  ols.raise_if_stuck(state, tx, max_skips_at_floor=3)
  tx, state = run("i", state=state, dynamic=False, initial_scale=2.0**15)
  ols.raise_if_stuck(state, tx, max_skips_at_floor=3)
  with pytest.raises(RuntimeError, match=r"static\sloss scale \(8\)"):
    ols.raise_if_stuck(state, tx, max_skips_at_floor=1)


# Case 3: a `tx` configured otherwise than the run.


@pytest.mark.parametrize(
  "other, name",
  [
    (dict(initial_scale=8.0, min_scale=4.0), "min_scale"),
    (dict(initial_scale=2.0, hysteresis=2), "hysteresis"),
    (dict(initial_scale=2.0, backoff_on_nonfinite_loss=False), "backoff_on"),
    (dict(initial_scale=2.0, max_scale=2.0**20), "max_scale"),
  ],
)
def test_a_tx_configured_otherwise_than_the_run_is_refused(other, name):
  _, state = run("iiii", initial_scale=2.0)
  liar = ols.loss_scale_optimizer(optax.sgd(0.1), **other)
  with pytest.raises(ValueError, match=name):
    ols.skip_report(state, liar)
  with pytest.raises(ValueError, match=name):
    ols.raise_if_stuck(state, liar)


def test_the_report_needs_no_tx_for_the_floor():
  _, state = run("iiii", initial_scale=2.0)
  report = ols.skip_report(state)
  assert report.min_scale == 1.0 and report.at_floor
  assert "on 3 steps that ran at the floor (1)" in words_of(report)


# Case 4: a dynamic scale below its floor.


def test_the_setter_refuses_a_dynamic_scale_below_its_floor():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1))
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=r"min_scale.*1\.0"):
    ols.set_loss_scale(state, 0.5)
  kept = jax.jit(ols.set_loss_scale)(state, 0.5)  # traced: left as it was
  assert float(ols.loss_scale(kept)) == 2.0**15
  # A floor below 1 takes it, and a finite step applies there.
  low = ols.loss_scale_optimizer(optax.sgd(0.1), min_scale=0.25)
  state = ols.set_loss_scale(low.init(PARAMS), 0.5)
  _, state = low.update(grads_for("f", 0.5), state, PARAMS)
  assert bool(ols.skip_stats(state).last_finite)
  report = ols.skip_report(state, low)
  assert "no step was skipped" in report.diagnosis[0]
  ols.raise_if_stuck(state, low)


def test_a_scale_below_one_put_there_by_hand_is_recorded_as_such():
  """A state changed without the setter (its fields replaced): the check,
  which reads the gradients before the division, cannot vouch for a scale
  below 1. The step is skipped, and recorded as that, not as an inf."""
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), leaf_stats=True)
  state = tx.init(PARAMS)
  state = state._replace(
    loss_scale_state=state.loss_scale_state._replace(
      loss_scale=jnp.float32(0.5)
    )
  )
  before = ols.skip_report(state, tx)
  assert not before.at_floor
  assert "at its floor" not in str(before)
  _, state = tx.update(grads_for("f", 0.5), state, PARAMS)
  report = ols.skip_report(state, tx)
  words = words_of(report)
  assert report.total_skipped == 1
  assert "inf" not in words and "overflow" not in words
  assert "below 1" in words
  ols.raise_if_stuck(state, tx, max_skips_at_floor=1)
  _, state = tx.update(grads_for("f", 1.0), state, PARAMS)  # at the floor
  assert bool(ols.skip_stats(state).last_finite)


# Case 6: hysteresis, with a non-finite loss that does not count between.


def test_hysteresis_with_a_loss_between_says_what_the_lines_show():
  tx, state = run("iLi", hysteresis=2, backoff_on_nonfinite_loss=False)
  report = ols.skip_report(state, tx)
  assert report.loss_scale == 2.0**14
  lines = str(report).splitlines()
  assert any(
    line.startswith("  step 0: inf;") and "held by hysteresis" in line
    for line in lines
  )
  assert any(
    line.startswith("  step 1: NaN, loss;")
    and "not counted against the scale" in line
    for line in lines
  )
  assert "come in a row" not in words_of(report)


# Case 7: counters saturated.


def test_saturated_counters_keep_the_skips_in_order():
  tx, _ = compiled(initial_scale=2.0**10)
  state = tx.init(PARAMS)
  near = jnp.int32(INT32_MAX - 2)
  state = state._replace(
    loss_scale_state=state.loss_scale_state._replace(
      steps=near, total_skipped=near
    )
  )
  _, state = run("iinnLLLL", state=state, initial_scale=2.0**10)
  report = ols.skip_report(state, tx)
  causes = [causes for _, causes, _, _ in report.recent]
  assert causes == [("inf",)] * 2 + [("NaN",)] * 2 + [("NaN", "loss")] * 4
  befores = [before for _, _, before, _ in report.recent]
  assert befores == sorted(befores, reverse=True)  # each backed off
  with pytest.raises(RuntimeError, match="not finite on each of the last 4"):
    ols.raise_if_stuck(state, tx, max_nonfinite_losses=4)


# Case 9: mixed causes.


def test_mixed_causes_are_each_named_with_their_count():
  tx, state = run("ifififLf")
  report = ols.skip_report(state, tx)
  diagnosis = " ".join(report.diagnosis)
  assert "none of the cases" not in diagnosis
  assert "3 for non-finite gradients" in diagnosis
  assert "1 for a non-finite loss" in diagnosis


# Case 10: skips in a row above the floor.


def test_skips_in_a_row_above_the_floor_are_facts_then_advice():
  tx, state = run("iiii")
  words = words_of(ols.skip_report(state, tx))
  assert "still coming down" not in words
  assert "if the scale reaches its floor (1) and steps still skip" in words
  assert "`ols.find_overflow`" in words


# Case 11: inside `jit`.


@pytest.mark.parametrize("call", ["skip_report", "raise_if_stuck"])
def test_inside_jit_the_report_says_to_call_it_outside(call):
  tx, state = run("ii")
  function = getattr(ols, call)
  with pytest.raises(TypeError, match="outside the jitted"):
    jax.jit(lambda s: function(s, tx))(state)


def test_the_report_reads_a_state_under_inject_hyperparams_outside():
  tx = optax.inject_hyperparams(
    lambda learning_rate: ols.loss_scale_optimizer(
      optax.sgd(learning_rate), initial_scale=2.0
    )
  )(learning_rate=0.1)
  state, update = tx.init(PARAMS), jax.jit(tx.update)
  for _ in range(4):
    _, state = update(grads_for("i"), state, PARAMS)
  report = ols.skip_report(state, tx)
  assert report.at_floor and report.total_skipped == 4
  with pytest.raises(RuntimeError, match="floor of the loss scale"):
    ols.raise_if_stuck(state, tx, max_skips_at_floor=3)
