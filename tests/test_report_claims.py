"""Every sentence `skip_report` prints is a claim about the run: each test
runs the real transformation on crafted gradients (finite, inf, NaN) and
losses, and checks that a sentence appears where it is true, and only there.
A property test generates skip histories over the rule model
(`tests/_model.py`) and checks every printed claim against them."""

import functools
import re

import _model
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_lossscale as ols
from optax_lossscale._diagnostics import format as fmt

PARAMS = {
  "dense": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)},
  "head": jnp.ones(4),
}
LEAVES = ("dense/b", "dense/w", "head")  # tree order

# A step's outcome: the gradients (finite, an inf or a NaN) and the loss.
OUTCOMES = {
  "f": (True, False, True),  # finite
  "i": (False, False, True),  # an inf in the gradients, the loss finite
  "n": (False, True, True),  # a NaN in the gradients, the loss finite
  "L": (False, True, False),  # a bad batch: NaN loss, NaN gradients
  "l": (True, False, False),  # an inf loss, the gradients finite
}


def grads_for(code, leaf=0):
  finite, nan, _ = OUTCOMES[code]
  flat, treedef = jax.tree.flatten(jax.tree.map(jnp.ones_like, PARAMS))
  if not finite:
    flat[leaf] = flat[leaf].ravel().at[0].set(np.nan if nan else np.inf)
    flat[leaf] = flat[leaf].reshape(jax.tree.leaves(PARAMS)[leaf].shape)
  return jax.tree.unflatten(treedef, flat)


@functools.cache
def compiled(**config):
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), **config)
  step = jax.jit(
    lambda grads, state, loss: tx.update(grads, state, PARAMS, value=loss)[1]
  )
  return tx, step


def run(codes, leaf=0, **config):
  """Runs one step per code; returns (tx, state, truth): truth is, per
  step, (skipped, scale before, scale after)."""
  tx, step = compiled(**config)
  state, truth = tx.init(PARAMS), []
  for code in codes:
    before = float(ols.loss_scale(state))
    loss = jnp.float32({"L": np.nan, "l": np.inf}.get(code, 1.0))
    state = step(grads_for(code, leaf), state, loss)
    skipped = not bool(ols.skip_stats(state).last_finite)
    truth.append((skipped, before, float(ols.loss_scale(state))))
  return tx, state, truth


def text_of(codes, **config):
  """The report of a run, and its text with line breaks as spaces."""
  tx, state, _ = run(codes, **config)
  report = ols.skip_report(state, tx)
  return report, " ".join(str(report).split())


# --- a static scale, a held scale, hysteresis ---


def test_a_static_scale_never_comes_down_nor_has_a_floor():
  for codes in ("iiii", "iiiiL", "nnnnn", "fiif"):
    report, text = text_of(codes, dynamic=False, initial_scale=2.0**10)
    assert "static (it never changes)" in text
    for word in ("floor", "coming down", "lower", "finding its level"):
      assert word not in text.replace("a lower static scale", ""), text
    assert report.min_scale is None and not report.at_floor


def test_a_held_scale_is_never_said_to_lower():
  report, text = text_of("fLLLLL", backoff_on_nonfinite_loss=False)
  assert "the scale was left as it was on those steps" in text
  assert "coming down" not in text and "lowered" not in text
  assert report.loss_scale == 2.0**15


def test_a_bad_batch_run_is_not_a_scale_coming_down():
  _, text = text_of("fLLLL")  # backing off on them, as Keras
  assert "coming down" not in text
  assert "`backoff_on_nonfinite_loss=False` keeps such steps" in text


def test_hysteresis_skips_are_not_each_an_overflow_that_lowered():
  report, text = text_of("iiif", hysteresis=4)
  assert report.loss_scale == 2.0**15
  assert "each an overflow" not in text and "lowered" not in text
  assert (
    "3 of the 3 skipped steps had non-finite gradients and left the scale"
    " where it was: `hysteresis=4`" in " ".join(report.diagnosis)
  )
  # The fourth in a row backs off: now one of four lowered it.
  report, text = text_of("iiii", hysteresis=4)
  assert report.loss_scale == 2.0**14
  assert "3 of the 4 skipped steps" in " ".join(report.diagnosis)
  assert "each an overflow" not in text


def test_overflows_that_each_lowered_the_scale_say_so():
  report, _ = text_of("fiffif")
  assert report.diagnosis == (
    "2 steps skipped (33%), each an overflow (inf) that lowered the scale:"
    " the dynamic scale finding its level, as designed.",
  )


# --- the floor: where a skipped step ran ---


def test_the_step_that_reaches_the_floor_did_not_run_there():
  report, text = text_of("n", initial_scale=2.0)
  assert report.recent == ((0, ("NaN",), 2.0, 1.0),)
  assert report.at_floor  # it is there now ...
  assert "ran at the floor" not in text  # ... but no skip ran there
  report, text = text_of("nn", initial_scale=2.0)
  assert "- NaN in the gradients at every scale down to the floor" in text
  assert "on 1 step that ran at the floor (1)" in text
  report, text = text_of("ii", initial_scale=2.0)
  assert "overflowed to inf on 1 step that ran at the floor (1)" in text


def test_nan_at_the_floor_is_float16_range_or_a_bug():
  report, _ = text_of("nnnnn", initial_scale=4.0)
  (sentence,) = report.diagnosis
  assert sentence.startswith(
    "NaN in the gradients at every scale down to the floor (5 steps skipped"
    " in a row), on 3 steps that ran at the floor (1), with no non-finite"
    " loss recorded: float16's range exceeded in a value or a derivative (a"
    " norm of tiny values, rsqrt's derivative, a cube), or a bug"
  )
  assert "`ols.find_overflow`" in sentence
  assert "not float16's range" not in sentence


def test_a_floor_above_one_says_a_lower_one_may_help():
  _, text = text_of("iii", initial_scale=8.0, min_scale=4.0)
  assert "ran at the floor (4)" in text
  assert "a `min_scale` below 4 may avoid it" in text


def test_a_long_run_at_the_floor_is_counted_as_far_as_the_state_keeps():
  report, _ = text_of("n" * 12, initial_scale=2.0)
  assert "on at least 8 steps that ran at the floor" in report.diagnosis[0]
  report, _ = text_of("n" * 12, initial_scale=2.0**5)
  # The oldest skip kept ran above the floor: the count is exact.
  assert "on 7 steps that ran at the floor" in report.diagnosis[0]


# --- the loss ---


def test_a_nonfinite_loss_on_every_step_is_the_forward_pass():
  report, _ = text_of("LLL")
  assert (
    "every batch: the model's forward pass, not the data" in report.diagnosis[0]
  )
  _, text = text_of("fLLL")  # a finite batch: the data may be to blame
  assert "every batch" not in text
  assert "a forward overflow or bad data" in text


# --- leaf_stats adds lines, and says which parameters locate the fault ---


@pytest.mark.parametrize("codes", ["iff", "fiffif", "iiii", "nnnnn", "fLLL"])
def test_leaf_stats_add_lines_and_remove_none(codes):
  plain, _ = text_of(codes, initial_scale=4.0)
  counted, _ = text_of(codes, initial_scale=4.0, leaf_stats=True)
  assert set(plain.diagnosis) <= set(counted.diagnosis)
  assert len(counted.diagnosis) == len(plain.diagnosis) + 1


def test_parameters_tied_share_a_row_and_the_finite_are_all_listed():
  tx, step = compiled(leaf_stats=True)
  state = tx.init(PARAMS)
  both = jax.tree.map(lambda g: g.at[..., 0].set(np.inf), grads_for("f"))
  both["head"] = jnp.ones(4)
  for grads in (both, both, grads_for("i", leaf=0)):
    state = step(grads, state, jnp.float32(1.0))
  text = str(ols.skip_report(state, tx))
  assert "  3 steps  dense/b\n  2 steps  dense/w\n" in text
  assert "parameters whose gradients stayed finite: head" in text
  assert "1 stayed finite on every step (`head`)" in " ".join(text.split())

  state = step(both, tx.init(PARAMS), jnp.float32(1.0))
  text = str(ols.skip_report(state, tx))
  # Equal counts: one row, in tree order, no ranking the state cannot make.
  assert "  1 step  dense/b, dense/w\n" in text


def test_no_parameter_hit_says_the_loss():
  tx, step = compiled(leaf_stats=True, backoff_on_nonfinite_loss=False)
  state = step(grads_for("f"), tx.init(PARAMS), jnp.float32(np.inf))
  report = ols.skip_report(state, tx)
  assert report.total_skipped == 1
  assert (
    "every parameter's gradient stayed finite on every step"
    in (report.diagnosis[-1])
  )


# --- the vocabulary ---


def test_the_counters_are_named_as_the_state_names_them():
  report, text = text_of("fiif")
  stats = ols.skip_stats(run("fiif")[1])
  assert report.total_skipped == int(stats.total_skipped) == 2
  assert report.skipped_in_a_row == int(stats.skipped_in_a_row) == 0
  assert "steps: 4 seen; skipped: 2 in total (50%), 0 in a row now" in text


# --- the configuration, from any transformation that holds one ---


def test_the_floor_of_unscale_and_check_in_a_chain():
  scaler = ols.unscale_and_check(initial_scale=8.0, min_scale=4.0)
  tx = optax.chain(scaler, optax.sgd(0.1))
  state, update = tx.init(PARAMS), jax.jit(tx.update)
  for _ in range(3):
    _, state = update(grads_for("n"), state, PARAMS)
  report = ols.skip_report(state, tx)
  assert report.min_scale == 4.0 and report.at_floor
  assert "on 2 steps that ran at the floor (4)" in " ".join(str(report).split())
  assert ols.skip_report(state, scaler).min_scale == 4.0


def test_the_configuration_inside_wrappers():
  lso = ols.loss_scale_optimizer(optax.sgd(0.1), min_scale=2.0)
  for tx in (
    optax.MultiSteps(lso, 2),
    optax.chain(optax.identity(), lso),
    optax.named_chain(("scaled", lso)),
    lso._replace(init=lso.init),
  ):
    state = tx.init(PARAMS)
    assert ols.skip_report(state, tx).min_scale == 2.0


def test_a_tx_without_a_configuration_or_with_two_is_refused():
  state = ols.loss_scale_optimizer(optax.sgd(0.1)).init(PARAMS)
  with pytest.raises(TypeError, match="`tx` must be the transformation"):
    ols.skip_report(state, optax.sgd(0.1))
  two = optax.chain(
    ols.unscale_and_check(min_scale=2.0), ols.unscale_and_check()
  )
  with pytest.raises(TypeError, match="`tx` must hold one loss-scale"):
    ols.skip_report(state, two)


@pytest.mark.parametrize(
  "made_by, given, message",
  [
    (dict(), dict(dynamic=False, initial_scale=2.0**15), "dynamic=False"),
    (dict(dynamic=False, initial_scale=8.0), dict(), "dynamic=True"),
    (dict(), dict(leaf_stats=True), "leaf_stats=True"),
    (dict(leaf_stats=True), dict(), "leaf_stats=False"),
  ],
)
def test_a_tx_that_did_not_make_the_state_is_refused(made_by, given, message):
  state = ols.loss_scale_optimizer(optax.sgd(0.1), **made_by).init(PARAMS)
  other = ols.loss_scale_optimizer(optax.sgd(0.1), **given)
  with pytest.raises(ValueError, match="`tx` did not make this state") as e:
    ols.skip_report(state, other)
  assert message in str(e.value)
  ols.skip_report(state)  # the state alone is reported


def test_a_scale_set_by_hand_is_reported_not_refused():
  # `set_loss_scale` may put a scale outside `[min_scale, max_scale]`, or
  # change a static one: the transformation still made the state.
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), max_scale=2.0**16)
  state = ols.set_loss_scale(tx.init(PARAMS), 2.0**20)
  assert ols.skip_report(state, tx).loss_scale == 2.0**20
  static = ols.loss_scale_optimizer(
    optax.sgd(0.1), dynamic=False, initial_scale=8.0
  )
  state = ols.set_loss_scale(static.init(PARAMS), 4.0)
  assert "static" in str(ols.skip_report(state, static))


# --- where the check cannot tell a NaN from an inf ---


def test_host_arrays_leave_nan_against_inf_unknown():
  tx, state, _ = run("iii", initial_scale=2.0)
  on_device = ols.skip_report(state, tx)
  assert on_device.nan_told_apart is True
  assert "overflowed to inf" in on_device.diagnosis[0]
  on_host = ols.skip_report(jax.device_get(state), tx)
  assert on_host.nan_told_apart is None
  assert (
    "2 with inf (or a NaN on an Auto mesh, which this check cannot tell"
    " apart)" in on_host.diagnosis[0]
  )
  assert "or a bug" in on_host.diagnosis[0]


# --- stopping a run ---


def test_raise_if_stuck_at_the_floor():
  tx, step = compiled(initial_scale=4.0)
  state = tx.init(PARAMS)
  raised_at = None
  for i in range(8):
    state = step(grads_for("i"), state, jnp.float32(1.0))
    try:
      ols.raise_if_stuck(state, tx, max_skips_at_floor=3)
    except RuntimeError as stuck:
      raised_at, message = i, str(stuck)
      break
  # Steps 0 and 1 ran at 4 and 2; 2, 3 and 4 at the floor.
  assert raised_at == 4
  assert message.startswith(
    "The run cannot recover: the last 3 steps were skipped, and each ran at"
    " the\nfloor of the loss scale (1)"
  )
  assert str(ols.skip_report(state, tx)) in message


def test_raise_if_stuck_on_nonfinite_losses():
  tx, step = compiled(backoff_on_nonfinite_loss=False)
  state = tx.init(PARAMS)
  for i in range(5):
    state = step(grads_for("L"), state, jnp.float32(np.nan))
    if i < 3:
      ols.raise_if_stuck(state, tx, max_nonfinite_losses=4)
  with pytest.raises(RuntimeError, match="not finite on each of the last 4"):
    ols.raise_if_stuck(state, tx, max_nonfinite_losses=4)
  # A scale held high: no floor in sight, the losses alone stop it.
  assert float(ols.loss_scale(state)) == 2.0**15


def test_raise_if_stuck_at_a_static_scale_and_not_on_a_healthy_run():
  tx, state, _ = run("fiiii", dynamic=False, initial_scale=8.0)
  with pytest.raises(RuntimeError, match=r"at the static\sloss scale \(8\)"):
    ols.raise_if_stuck(state, tx, max_skips_at_floor=4)
  tx, state, _ = run("iiiiiiif")
  ols.raise_if_stuck(state, tx, max_skips_at_floor=1, max_nonfinite_losses=1)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(max_skips_at_floor=0), ValueError, "`max_skips_at_floor` must be"),
    (dict(max_skips_at_floor=9), ValueError, "from 1 to 8"),
    (dict(max_nonfinite_losses=True), TypeError, "`max_nonfinite_losses`"),
    (dict(max_nonfinite_losses=2.0), TypeError, "got 2.0 of type float"),
    (
      dict(max_skips_at_floor=None, max_nonfinite_losses=None),
      ValueError,
      "must not both be None",
    ),
  ],
)
def test_raise_if_stuck_refuses_bad_arguments(kwargs, error, match):
  tx = ols.loss_scale_optimizer(optax.sgd(0.1))
  with pytest.raises(error, match=match):
    ols.raise_if_stuck(tx.init(PARAMS), tx, **kwargs)


def test_raise_if_stuck_needs_tx():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1))
  with pytest.raises(TypeError, match="`tx` must be the transformation"):
    ols.raise_if_stuck(tx.init(PARAMS), None)


# --- the property: every printed claim is true of the history ---

# A few configurations, each compiled once: dynamic and static, hysteresis
# 1 to 4, both settings of backoff_on_nonfinite_loss, floors 1, 2 and 4,
# scales that reach the floor within a history and that do not.
CONFIGS = (
  dict(initial_scale=4.0, dynamic_growth_steps=3),
  dict(initial_scale=8.0, hysteresis=2, backoff_on_nonfinite_loss=False),
  dict(initial_scale=16.0, min_scale=4.0, hysteresis=3, leaf_stats=True),
  dict(initial_scale=2.0**10, min_scale=2.0, hysteresis=4),
  dict(initial_scale=8.0, backoff_on_nonfinite_loss=False, leaf_stats=True),
  dict(dynamic=False, initial_scale=8.0),
  dict(dynamic=False, initial_scale=2.0, backoff_on_nonfinite_loss=False),
)


def model_config(config):
  names = ("initial_scale", "min_scale", "hysteresis", "dynamic")
  kwargs = {k: v for k, v in config.items() if k in names}
  return _model.ModelConfig(
    growth_steps=config.get("dynamic_growth_steps", 2000),
    backoff_on_nonfinite_loss=config.get("backoff_on_nonfinite_loss", True),
    **kwargs,
  )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
  codes=st.lists(st.sampled_from("fffinLl"), min_size=1, max_size=14),
  which=st.integers(0, len(CONFIGS) - 1),
)
def test_every_printed_claim_is_true_of_the_history(codes, which):
  config = CONFIGS[which]
  tx, state, truth = run(codes, **config)
  # The run follows the rule model, step for step. An inf loss with finite
  # gradients under `backoff_on_nonfinite_loss=True` is left out of the
  # comparison: whether such a step skips is the step's to decide (the
  # claims below are checked against what the run did, `truth`).
  outcomes = [OUTCOMES[c] for c in codes]
  if "l" not in codes or not config.get("backoff_on_nonfinite_loss", True):
    assert truth == _model.history(model_config(config), outcomes)
  report = ols.skip_report(state, tx)
  check_claims(str(report), report, codes, truth, config)


def check_claims(text, report, codes, truth, config):
  dynamic = config.get("dynamic", True)
  floor = config.get("min_scale", 1.0)
  skips = [
    (i, before, after) for i, (s, before, after) in enumerate(truth) if s
  ]
  in_a_row = len(truth) - max(
    [i + 1 for i, (s, _, _) in enumerate(truth) if not s], default=0
  )
  words = " ".join(text.split())

  # The counts are the history's.
  assert f"steps: {len(codes)} seen; skipped: {len(skips)} in total" in text
  assert f", {in_a_row} in a row now" in text
  # Each recent skip: its step, causes, and the scales it ran at and left.
  recent = re.findall(r"  step (\d+): ([^;]+); scale (\S+) -> (\S+)", text)
  assert len(recent) == min(len(skips), 8)
  for (step, causes, before, after), (i, b, a) in zip(
    recent, skips[-8:], strict=True
  ):
    assert int(step) == i
    assert (before, after) == (fmt.scale(b), fmt.scale(a))
    assert ("loss" in causes) == (codes[i] in "Ll")
    assert ("NaN" in causes) == (codes[i] in "nL")

  if not skips:
    assert "no step was skipped" in words
  if not dynamic:
    for word in ("floor", "coming down", "lowered", "lowering", "finding"):
      assert word not in words, text
  if "each an overflow (inf) that lowered the scale" in words or (
    "each a skip for non-finite gradients that lowered" in words
  ):
    shown = skips[-8:]
    assert all(a < b for _, b, a in shown)
    assert all(codes[i] in "in" for i, _, _ in shown)
  if "the last lowering the scale from" in words:
    assert in_a_row >= 2 and skips[-1][2] < skips[-1][1]
  if "it has now reached its floor" in words:
    assert skips[-1][2] == floor
  found = re.search(r"on (at least )?(\d+) steps? that ran at the floor", words)
  if found:
    assert dynamic
    streak = skips[len(skips) - in_a_row :]
    at_floor = [i for i, b, _ in streak if b == floor and codes[i] in "in"]
    count = int(found.group(2))
    assert len(at_floor) >= count if found.group(1) else len(at_floor) == count
    if "- NaN in the gradients" in words:
      assert all(codes[i] == "n" for i in at_floor[-count:])
  held = re.search(
    r"(\d+) of the (last )?(\d+) skipped steps had non-finite gradients and"
    r" left the scale where it was",
    words,
  )
  if held:
    shown = skips[-int(held.group(3)) :]
    left = [
      i for i, b, a in shown if a == b and b != floor and codes[i] in "in"
    ]
    assert len(left) == int(held.group(1))
    assert dynamic
  down = re.search(
    r"at every scale down to the floor \((\d+) steps? skipped in a row\)", words
  )
  if down:
    streak = skips[len(skips) - in_a_row :]
    assert int(down.group(1)) == in_a_row
    assert all(codes[i] == "n" for i, _, _ in streak)
    assert streak[0][1] != floor and streak[-1][1] == floor
  static = re.search(
    r"(\d+) of (the last )?(\d+) skipped steps had non-finite gradients at"
    r" the static scale",
    words,
  )
  if static:
    assert not dynamic
    shown = skips[-int(static.group(3)) :]
    assert int(static.group(1)) == sum(codes[i] in "in" for i, _, _ in shown)
  if "the scale was left as it was on those steps" in words:
    assert all(a == b for i, b, a in skips if codes[i] in "Ll")
  if "every batch" in words:
    assert set(codes) <= {"L", "l"}
  losses = re.search(r"not finite in (\d+) of (\d+) skipped steps", words)
  if losses:
    assert int(losses.group(1)) == sum(codes[i] in "Ll" for i, _, _ in skips)
    assert int(losses.group(2)) == len(skips)
