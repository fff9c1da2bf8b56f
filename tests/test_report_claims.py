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

PARAMS = {
  "dense": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)},
  "head": jnp.ones(4),
}
LEAVES = ("dense/b", "dense/w", "head")  # tree order
INT32_MAX = 2**31 - 1

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
    assert "static (it never changes by itself)" in text
    for word in ("floor", "coming down", "lower", "finding its level"):
      assert word not in text.replace("a lower static scale", ""), text
    assert report.min_scale is None and not report.at_floor


def test_a_held_scale_is_never_said_to_lower():
  report, text = text_of("fLLLLL", backoff_on_nonfinite_loss=False)
  assert "each of those steps left the scale as it was" in text
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
    "3 of the 3 skipped steps left the scale where it was, held by"
    " hysteresis" in " ".join(report.diagnosis)
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


def test_a_tx_without_a_configuration_is_accepted_and_changes_nothing():
  # A chain or wrapper carries no configuration the report can read (the
  # state records its own); a non-transformation is refused.
  tx, state, _ = run("iii", initial_scale=2.0)
  alone = str(ols.skip_report(state))
  two = optax.chain(
    ols.unscale_and_check(min_scale=2.0), ols.unscale_and_check()
  )
  for other in (optax.sgd(0.1), two, optax.chain(optax.identity(), tx)):
    assert str(ols.skip_report(state, other)) == alone
  with pytest.raises(TypeError, match="`tx` must be an optax transformation"):
    ols.skip_report(state, {"min_scale": 1.0})


@pytest.mark.parametrize(
  "made_by, given, message",
  [
    (dict(), dict(dynamic=False, initial_scale=2.0**15), "dynamic=False"),
    (dict(dynamic=False, initial_scale=8.0), dict(), "dynamic=True"),
    (dict(), dict(leaf_stats=True), "leaf_stats=True"),
    (dict(leaf_stats=True), dict(), "leaf_stats=False"),
    (dict(), dict(min_scale=2.0), "min_scale=2.0"),
    (dict(), dict(dynamic_growth_steps=10), "growth_steps=10"),
    (dict(), dict(growth_factor=4.0), "growth_factor=4.0"),
    (dict(), dict(backoff_factor=0.25), "backoff_factor=0.25"),
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


def test_host_arrays_report_what_the_device_state_does():
  # Whether a NaN was told from an inf is recorded with each skip: the
  # report of the state fetched to the host is the same.
  tx, state, _ = run("iii", initial_scale=2.0)
  on_device = ols.skip_report(state, tx)
  assert on_device.nan_told_apart is True
  assert "overflowed to inf" in on_device.diagnosis[0]
  on_host = ols.skip_report(jax.device_get(state), tx)
  assert on_host == on_device


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


def test_raise_if_stuck_needs_no_tx():
  tx, state, _ = run("iiiii", initial_scale=2.0)
  for passed in (tx, None):
    with pytest.raises(RuntimeError, match="floor of the loss scale"):
      ols.raise_if_stuck(state, passed, max_skips_at_floor=3)


# --- the property: every printed claim is true of the history ---

# A few configurations, each compiled once (per placement): dynamic and
# static, hysteresis 1 to 4, both settings of backoff_on_nonfinite_loss,
# floors 1, 2, 4 and 1/4, scales that reach the floor within a history and
# that do not.
CONFIGS = (
  dict(initial_scale=4.0, dynamic_growth_steps=3),
  dict(initial_scale=8.0, hysteresis=2, backoff_on_nonfinite_loss=False),
  dict(initial_scale=16.0, min_scale=4.0, hysteresis=3, leaf_stats=True),
  dict(initial_scale=2.0**10, min_scale=2.0, hysteresis=4),
  dict(initial_scale=8.0, backoff_on_nonfinite_loss=False, leaf_stats=True),
  dict(initial_scale=2.0, min_scale=0.25, dynamic_growth_steps=2),
  dict(dynamic=False, initial_scale=8.0),
  dict(dynamic=False, initial_scale=2.0, backoff_on_nonfinite_loss=False),
)

# Between steps, a history may set the scale (`set_loss_scale`, above and
# below 1, which the setter may refuse), put a scale below 1 by hand (a
# field replaced, which only the step then sees), or move the run to
# another placement: one device, or replicated on an `Explicit` or an
# `Auto` mesh of the 8 CPU devices (where a NaN counts as an inf).
SETS = (0.5, 2.0, 2.0**12)
PLACEMENTS = ("one device", "Explicit", "Auto")


def model_config(config):
  names = ("initial_scale", "min_scale", "hysteresis", "dynamic")
  kwargs = {k: v for k, v in config.items() if k in names}
  return _model.ModelConfig(
    growth_steps=config.get("dynamic_growth_steps", 2000),
    backoff_on_nonfinite_loss=config.get("backoff_on_nonfinite_loss", True),
    **kwargs,
  )


@functools.cache
def placement(name):
  if name == "one device":
    return jax.devices()[0]
  axis = getattr(jax.sharding.AxisType, name)
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis,) * 2)
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def on_an_auto_mesh(tree):
  """Whether some leaf's type places it on a mesh with `Auto` axes, where
  the check counts a NaN as an inf. The type, not the array's sharding:
  `jax.device_put` from such a mesh to one device keeps the mesh in the
  type (jax 0.10), and the check, traced from the types, is the mesh's."""
  for x in jax.tree.leaves(tree):
    mesh = jax.typeof(x).sharding.mesh
    if any(getattr(t, "name", str(t)) == "Auto" for t in mesh.axis_types):
      return True
  return False


def saturated(state, near):
  """`state` with its step and skip counters `near` saturation."""
  value = jnp.int32(near)
  return state._replace(
    loss_scale_state=state.loss_scale_state._replace(
      steps=value, total_skipped=value, nan_steps=value
    )
  )


def run_ops(ops, config, near=None):
  """Runs `ops` on the library and on the model; returns (tx, state,
  model state, truth, placement name), truth per step `(skipped, scale
  before, scale after)`."""
  tx, step = compiled(**config)
  mc = model_config(config)
  state, model = tx.init(PARAMS), _model.initial(mc)
  if near is not None:
    state = saturated(state, near)
    model.steps = model.total = model.nan_steps = near
  where, truth = "one device", []
  for op in ops:
    if op == "P":  # the next placement, the state moved there
      where = PLACEMENTS[(PLACEMENTS.index(where) + 1) % len(PLACEMENTS)]
      state = jax.device_put(state, placement(where))
    elif op == "B":  # a scale below 1, put there by hand
      state = state._replace(
        loss_scale_state=state.loss_scale_state._replace(
          loss_scale=jax.device_put(jnp.float32(0.5), placement(where))
        )
      )
      model.scale = 0.5
    elif isinstance(op, float):
      floor = mc.min_scale if mc.dynamic else (1.0 if model.scale >= 1 else 0)
      if op < floor:
        with pytest.raises(ValueError, match="`value` must be"):
          ols.set_loss_scale(state, op)
      else:
        state = ols.set_loss_scale(state, op)
        model.scale = op
    else:
      finite, nan, loss_finite = OUTCOMES[op]
      grads, loss = jax.device_put(
        (grads_for(op), jnp.float32({"L": np.nan, "l": np.inf}.get(op, 1.0))),
        placement(where),
      )
      before = model.scale
      told = not on_an_auto_mesh((grads, state))
      state = step(grads, state, loss)
      model = _model.step(model, finite, mc, loss_finite, nan, told=told)
      truth.append((not model.last_finite, before, model.scale))
  return tx, state, model, truth, where


ops = st.lists(
  st.one_of(
    st.sampled_from("fffinLl"),
    st.sampled_from(["P", "B", *SETS]),
  ),
  min_size=1,
  max_size=14,
)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, derandomize=True)
@given(
  ops=ops,
  which=st.integers(0, len(CONFIGS) - 1),
  near=st.sampled_from([None, None, INT32_MAX - 3]),
)
def test_every_printed_claim_is_true_of_the_history(ops, which, near):
  config = CONFIGS[which]
  tx, state, model, truth, _ = run_ops(ops, config, near)
  got = state.loss_scale_state
  # The run follows the rule model, step for step, and records each skip
  # as the model does.
  assert float(got.loss_scale) == model.scale
  assert int(got.total_skipped) == model.total
  assert int(got.skipped_in_a_row) == model.in_a_row
  assert int(got.nan_steps) == model.nan_steps
  assert bool(got.nan_steps_exact) == model.nan_steps_exact
  report = ols.skip_report(state, tx)
  assert [e[:4] for e in recorded(report)] == [
    (e.step, e.causes, e.before, e.after) for e in model.events
  ]
  check_claims(report, model, truth, config)
  # Wherever the state is put, it says the same.
  for where in PLACEMENTS:
    assert ols.skip_report(jax.device_put(state, placement(where))) == report
  # A transformation configured otherwise did not make it.
  liar = dict(config, hysteresis=config.get("hysteresis", 1) + 1)
  if not config.get("dynamic", True):
    liar = dict(initial_scale=8.0)
  with pytest.raises(ValueError, match="`tx` did not make this state"):
    ols.skip_report(state, ols.loss_scale_optimizer(optax.sgd(0.1), **liar))


def recorded(report):
  """The recent-skip lines: (step, causes, before, after, annotations)."""
  found = []
  for line in str(report).splitlines():
    m = re.fullmatch(
      r"  step (\d+)( or later)?: ([^;]+); scale (\S+) -> ([^,]+)(, .*)?",
      line,
    )
    if m:
      causes = tuple(
        "inf" if c == "inf or NaN" else c for c in m.group(3).split(", ")
      )
      step = int(m.group(1))
      before, after = (_unscale(m.group(k)) for k in (4, 5))
      found.append((step, causes, before, after, m.group(6) or ""))
  return found


def _unscale(text):
  """The value `fmt.scale` wrote."""
  return 2.0 ** int(text[3:]) if text.startswith("2**") else float(text)


# Each sentence the diagnosis may say, and the check of its claims.
CLAIMS = []


def claim(pattern):
  def register(check):
    CLAIMS.append((re.compile(pattern), check))
    return check

  return register


def check_claims(report, model, truth, config):
  text = str(report)
  dynamic = config.get("dynamic", True)
  floor = config.get("min_scale", 1.0)
  events = model.events
  kept_all = model.total == len(events)
  in_a_row = model.in_a_row
  streak = events[len(events) - min(in_a_row, len(events)) :]
  facts = dict(
    model=model,
    events=events,
    kept_all=kept_all,
    streak=streak,
    dynamic=dynamic,
    floor=floor,
    truth=truth,
  )
  # The lines: counts, each skip with its annotations, the scale's line.
  assert f"steps: {model.steps} seen; skipped: {model.total} in total" in text
  assert f", {in_a_row} in a row now" in text
  for (*_, notes), event in zip(recorded(report), events, strict=True):
    assert ("held by hysteresis" in notes) == event.hysteresis_held
    assert ("not counted against" in notes) == event.loss_not_blamed
  line = text.splitlines()[0]
  assert ("static" in line) == (not dynamic)
  assert ("now at its floor" in line) == (dynamic and model.scale == floor)
  if model.total:
    assert f"{model.nan_steps} with NaN in the gradients" in text
    assert ("(a lower bound" in text) == (not model.nan_steps_exact)
  if not dynamic:
    words = " ".join(report.diagnosis)
    for word in ("floor", "lowered", "lowering", "finding", "held"):
      assert word not in words, text
  # Each sentence of the diagnosis is one the checks below know.
  for sentence in report.diagnosis:
    matched = [(m, check) for rx, check in CLAIMS if (m := rx.search(sentence))]
    assert matched, sentence
    for m, check in matched:
      check(m, sentence, **facts)


def _gradients_only(e):
  return "loss" not in e.causes and ("inf" in e.causes or "NaN" in e.causes)


@claim(r"^no step was skipped")
def _none(m, s, model, **_):
  assert model.total == 0


@claim(r"^(\d+) steps? skipped \(\d+%\): (.*)\.$")
def _causes(m, s, model, events, kept_all, **_):
  assert int(m.group(1)) == model.total
  parts = dict(
    (why, int(n))
    for n, why in re.findall(
      r"(\d+) (for [^,]+|without a non-finite loss)", m.group(2)
    )
  )
  if "for a non-finite loss" in parts:
    assert parts.pop("for a non-finite loss") == model.nonfinite_loss_steps
  if kept_all:
    below = [
      e
      for e in events
      if "scale below 1" in e.causes
      and "loss" not in e.causes
      and not _gradients_only(e)
    ]
    assert parts.pop("for a scale below 1", 0) == len(below)
    grads = [e for e in events if "loss" not in e.causes and e not in below]
    assert parts.pop("for non-finite gradients", 0) == len(grads)
  assert set(parts) <= {"without a non-finite loss"}


@claim(r"not finite on every one of the (\d+) steps")
def _every_batch(m, s, model, truth, **_):
  assert int(m.group(1)) == len(truth) == model.nonfinite_loss_steps >= 2


@claim(r"^the loss itself was not finite in (\d+) of (\d+) skipped steps")
def _bad_losses(m, s, model, events, **_):
  assert int(m.group(1)) == model.nonfinite_loss_steps
  assert int(m.group(2)) == model.total
  losses = [e for e in events if "loss" in e.causes]
  if "left the scale as it was" in s:
    assert losses and all(
      e.loss_not_blamed and e.before == e.after for e in losses
    )


@claim(r"on (at least )?(\d+) steps? that ran at the floor \((\S+)\)")
def _at_floor_now(m, s, streak, dynamic=True, floor=1.0, **_):
  assert dynamic
  at = [e for e in streak if e.before == e.floor and _gradients_only(e)]
  count = int(m.group(2))
  assert len(at) == count and _unscale(m.group(3)) == floor
  if s.startswith("NaN in the gradients"):
    assert all("NaN" in e.causes for e in at)
  if "overflowed to inf" in s:
    assert all(e.causes == ("inf",) and e.nan_told_apart for e in at)


@claim(r"at every scale down to the floor \((\d+) steps? skipped in a row\)")
def _down(m, s, model, streak, floor=1.0, **_):
  assert int(m.group(1)) == model.in_a_row == len(streak)
  assert all(e.causes == ("NaN",) for e in streak)
  assert streak[0].before != floor and streak[-1].before == floor


@claim(
  r"^(\d+) steps skipped in a row, the last for non-finite gradients,"
  r" lowering the scale from (\S+) to (\S+?)[,:]"
)
def _in_a_row(m, s, model, streak, floor=1.0, **_):
  assert int(m.group(1)) == model.in_a_row >= 2
  last = streak[-1]
  assert _gradients_only(last)
  assert (_unscale(m.group(2)), _unscale(m.group(3))) == (
    last.before,
    last.after,
  )
  assert ("cannot go lower" in s) == (last.after == floor)


@claim(r"skipped steps( kept)? ran at the floor \((\S+)\) and were skipped")
def _at_floor_before(m, s, events, streak, floor=1.0, **_):
  earlier = events[: len(events) - len(streak)]
  at = [e for e in earlier if e.before == e.floor and _gradients_only(e)]
  assert int(s.split(" of the ")[0]) == len(at) > 0
  assert _unscale(m.group(2)) == floor


@claim(
  r"^(\d+) of the (last )?(\d+) skipped steps( kept)? left the scale where"
  r" it was, held"
)
def _held(m, s, events, dynamic=True, **_):
  assert dynamic
  held = [e for e in events if e.hysteresis_held]
  assert int(m.group(1)) == len(held) and int(m.group(3)) == len(events)
  assert all(e.before == e.after for e in held)


@claim(
  r"(each|was|were each) (an overflow \(inf\)|a skip for non-finite"
  r" gradients) that lowered"
)
def _level(m, s, model, events, dynamic=True, **_):
  assert dynamic and model.in_a_row < 2
  grads = [e for e in events if _gradients_only(e)]
  assert grads and all(e.after < e.before for e in grads)
  if m.group(1) != "each":
    assert int(s.split(" of the ")[0]) == len(grads)
  if m.group(2) == "an overflow (inf)":
    assert all(e.causes == ("inf",) and e.nan_told_apart for e in grads)


@claim(r"^(\d+) of (the last )?(\d+) skipped steps had non-finite gradients at")
def _static(m, s, events, dynamic=True, **_):
  assert not dynamic
  grads = [e for e in events if _gradients_only(e)]
  assert int(m.group(1)) == len(grads)
  at = s.split("non-finite gradients at ")[1].split(": a static scale")[0]
  if at.startswith("the static scale "):
    shown = [at.removeprefix("the static scale ")]
  else:
    shown = at.removeprefix("static scales ")
    shown = shown.removesuffix(" (changed by hand)").split(", ")
  scales = sorted({e.before for e in grads}, reverse=True)
  assert [_unscale(x) for x in shown] == scales


@claim(r"ran at a scale below 1 \((\S+)\)")
def _below_one(m, s, events, **_):
  below = [e for e in events if "scale below 1" in e.causes]
  assert int(s.split(" of the ")[0]) == len(below) > 0
  assert _unscale(m.group(1)) == below[-1].before < 1


@claim(r"checked on a mesh with Auto axes")
def _mesh(m, s, events, **_):
  assert any(not e.nan_told_apart and "inf" in e.causes for e in events)


@claim(r"^the NaN count is a lower bound: a skip with non-finite gradients")
def _unkept(m, s, model, events, **_):
  assert not model.nan_steps_exact
  assert all(e.nan_told_apart or "inf" not in e.causes for e in events)


@claim(r"^every parameter's gradient stayed finite on every step")
def _leaves_clean(m, s, truth, events, **_):
  assert all("inf" not in e.causes and "NaN" not in e.causes for e in events)


@claim(r"^the gradients of (\d+) of (\d+) parameters were not finite")
def _leaves_hit(m, s, events, **_):
  assert int(m.group(2)) == len(LEAVES) and int(m.group(1)) == 1
