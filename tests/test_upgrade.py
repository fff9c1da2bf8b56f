"""Checkpoints of optax_lossscale 0.1.0 and 0.2.0 restore through
`upgrade_state`.

tests/fixtures/v010/ holds one 0.1.0 checkpoint (params and the state of
`loss_scale_optimizer(optax.adam)` after three finite steps and an overflow
that hysteresis had not yet backed off for) in three formats, written by the
0.1.0 code (tests/fixtures/make_v010.py), with what 0.1.0 computed for the
next steps. tests/fixtures/v020/ holds one 0.2.0 checkpoint (sgd with
momentum; hysteresis, per-leaf counts, a bad batch the scale was not blamed
for, the ring of recent skips) the same way (tests/fixtures/make_v020.py).
Each format restores, upgrades, and trains on as its release did: the
scale, its counter and the skip counts carry over exactly, and the 0.2.0
run's parameters, in exact arithmetic, bit for bit.
"""

import importlib.util
import json
import pathlib
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _helpers import assert_trees_equal
from flax import serialization

import optax_lossscale as ols

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
V010 = FIXTURES / "v010"
V020 = FIXTURES / "v020"
EXPECTED = json.loads((V010 / "expected.json").read_text())
EXPECTED_V020 = json.loads((V020 / "expected.json").read_text())


def _generator(name):
  spec = importlib.util.spec_from_file_location(name, FIXTURES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


MAKE = _generator("make_v010")
MAKE_V020 = _generator("make_v020")


def _tx(**kwargs):
  return ols.loss_scale_optimizer(
    optax.adam(MAKE.LEARNING_RATE), **MAKE.CONFIG, **kwargs
  )


def _like(tx):
  params = MAKE.params()
  return {"params": params, "opt_state": tx.init(params)}


def _restored(fmt, where=V010):
  if fmt == "pickle":
    with open(where / "checkpoint.pkl", "rb") as f:
      return pickle.load(f)
  if fmt == "msgpack":
    return serialization.msgpack_restore(
      (where / "checkpoint.msgpack").read_bytes()
    )
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(where / "orbax")  # no target: plain dicts


def _upgraded(fmt, tx):
  restored = _restored(fmt)
  if fmt == "pickle":  # 0.1.0's own types: no `like` needed
    return ols.upgrade_state(restored)
  return ols.upgrade_state(restored, like=_like(tx))


def _fields(state):
  lss = state.loss_scale_state
  return {
    "loss_scale": float(lss.loss_scale),
    "counter": int(lss.counter),
    "notfinite_count": int(lss.skipped_in_a_row),
    "total_notfinite": int(lss.total_skipped),
    "last_finite": bool(lss.last_finite),
    "adam_count": int(state.inner_state[0].count),
  }


@pytest.mark.parametrize("fmt", ["pickle", "msgpack", "orbax"])
def test_a_v010_checkpoint_upgrades_and_trains_on_as_v010_did(fmt):
  tx = _tx()
  checkpoint = _upgraded(fmt, tx)
  params, state = checkpoint["params"], checkpoint["opt_state"]
  assert type(state) is ols.LossScaleOptimizerState
  chex.assert_trees_all_equal_structs(state, tx.init(params))
  assert _fields(state) == EXPECTED["state"]
  lss = state.loss_scale_state
  # New fields: hysteresis's count is 0.1.0's skips in a row; the steps
  # seen are adam's applied steps plus the skipped one.
  assert int(lss.overflows_in_a_row) == EXPECTED["state"]["notfinite_count"]
  assert int(lss.steps) == len(MAKE.HISTORY)
  assert int(lss.nan_steps) == int(lss.nonfinite_loss_steps) == 0
  assert (np.asarray(lss.recent_skips.step) == -1).all()

  start = len(MAKE.HISTORY)
  for n, after in enumerate(EXPECTED["after"], 1):
    p_n, s_n = MAKE.run(tx, params, state, MAKE.CONTINUATION[:n], start)
    # The second overflow in a row backs the scale off (hysteresis 2), as
    # 0.1.0 did; then it grows back after two finite steps.
    assert _fields(s_n) == after["state"], n
    for name, value in after["params"].items():
      np.testing.assert_allclose(p_n[name], value, rtol=1e-6)
    assert int(s_n.loss_scale_state.steps) == start + n


def test_today_restores_of_v010_fail_and_the_docs_say_how():
  # What the restore of today's structure says about a 0.1.0 checkpoint;
  # docs/migration.md restores it raw and upgrades instead.
  like = _like(_tx())
  with pytest.raises(ValueError, match="field names"):
    serialization.from_bytes(like, (V010 / "checkpoint.msgpack").read_bytes())
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with (
    ocp.StandardCheckpointer() as checkpointer,
    pytest.raises(ValueError, match="tree structures do not match"),
  ):
    checkpointer.restore(V010 / "orbax", abstract)
  migration = (
    pathlib.Path(__file__).parents[1] / "docs" / "migration.md"
  ).read_text()
  assert "ols.upgrade_state(" in migration
  assert "msgpack_restore" in migration


def test_a_pickled_v010_state_used_as_it_is_names_the_upgrade():
  checkpoint = _restored("pickle")
  old = checkpoint["opt_state"]
  grads = jax.tree.map(jnp.ones_like, checkpoint["params"])
  with pytest.raises(TypeError, match="the LossScaleOptimizerState that"):
    _tx().update(grads, old, checkpoint["params"])
  with pytest.raises(AttributeError, match="upgrade_state"):
    old.loss_scale_state.skipped_in_a_row  # noqa: B018


def test_plain_dicts_need_like():
  with pytest.raises(TypeError, match="`like` must be given"):
    ols.upgrade_state(_restored("msgpack"))


def test_a_like_of_another_structure_is_named_by_path():
  tx = ols.loss_scale_optimizer(optax.chain(optax.sgd(0.1), optax.adam(0.1)))
  with pytest.raises(
    ValueError, match=r"nothing at \['opt_state'\]\.inner_state\[1\]"
  ):
    ols.upgrade_state(_restored("orbax"), like=_like(tx))


def test_leaf_counts_start_at_zero():
  tx = _tx(leaf_stats=True)
  for fmt in ("pickle", "msgpack"):
    restored = _restored(fmt)
    state = ols.upgrade_state(restored, like=_like(tx))["opt_state"]
    counts = ols.nonfinite_leaves(state)
    assert jax.tree.structure(counts) == jax.tree.structure(MAKE.params())
    assert all(int(c) == 0 for c in jax.tree.leaves(counts))
    assert float(ols.loss_scale(state)) == EXPECTED["state"]["loss_scale"]


def test_steps_can_be_given():
  state = ols.upgrade_state(_restored("pickle"), steps=100)["opt_state"]
  assert int(state.loss_scale_state.steps) == 100
  with pytest.raises(ValueError, match="`steps` must be"):
    ols.upgrade_state(_restored("pickle"), steps=-1)


def test_todays_state_passes_through():
  tx = _tx()
  params = MAKE.params()
  _, state = MAKE.run(tx, params, tx.init(params), [False, True], 0)
  assert_trees_equal(ols.upgrade_state(state), state)
  # Restored raw, as a 0.1.0 one is, it comes back the same.
  raw = serialization.msgpack_restore(serialization.to_bytes(state))
  assert_trees_equal(ols.upgrade_state(raw, like=tx.init(params)), state)
  # And the upgraded state pickles with today's types.
  again = pickle.loads(pickle.dumps(_upgraded("pickle", tx)))
  assert type(again["opt_state"]) is ols.LossScaleOptimizerState


def test_a_tree_without_a_loss_scale_state_is_refused():
  with pytest.raises(ValueError, match="holds no loss-scale state"):
    ols.upgrade_state({"w": jnp.zeros(3)})
  with pytest.raises(ValueError, match="holds no LossScaleState"):
    ols.upgrade_state(_restored("msgpack"), like={"w": jnp.zeros(3)})


def test_a_read_out_of_an_unconverted_pickle_names_upgrade_state():
  with open(V010 / "checkpoint.pkl", "rb") as f:
    old = pickle.load(f)
  with pytest.raises(ValueError, match="upgrade_state"):
    ols.loss_scale(old)


# Issue 34, case 5: what a 0.1.0 state cannot know, the report does not say.


def test_an_upgraded_v010_state_reports_its_new_counts_since_the_upgrade():
  tx = _tx(leaf_stats=True)
  state = ols.upgrade_state(_restored("pickle"), like=_like(tx))["opt_state"]
  text = " ".join(str(ols.skip_report(state, tx)).split())
  # 0.1.0 counted one skip, and neither its NaNs nor its leaves.
  assert "skipped: 1 in total" in text
  assert "stayed finite" not in text
  assert "0 with NaN" not in text
  assert "since step 4" in text
  assert ols.skip_report(state).diagnosis == (
    "no step was skipped since step 4, where this state's counts of why"
    " began (an upgrade from a release that did not count them); 1 step"
    " skipped before it, for causes the state does not know.",
  )


@pytest.mark.parametrize("steps", [0, True])
def test_steps_below_the_skips_or_not_an_int_are_refused(steps):
  with pytest.raises(ValueError, match="`steps` must be"):
    ols.upgrade_state(_restored("pickle"), steps=steps)


# Issue 34, case 23: a `like` that does not fit is refused, not obeyed.


def test_a_like_whose_inner_state_differs_is_refused():
  sgd = ols.loss_scale_optimizer(optax.sgd(0.1), **MAKE.CONFIG)
  for fmt in ("msgpack", "orbax"):
    with pytest.raises(ValueError, match=r"inner_state.*\bmu\b"):
      ols.upgrade_state(_restored(fmt), like=_like(sgd))


def test_a_static_like_for_a_dynamic_state_is_refused():
  static = ols.loss_scale_optimizer(
    optax.adam(MAKE.LEARNING_RATE), dynamic=False, initial_scale=2.0**10
  )
  for fmt in ("msgpack", "orbax"):
    with pytest.raises(ValueError, match="counter"):
      ols.upgrade_state(_restored(fmt), like=_like(static))


def test_todays_state_as_plain_dicts_reads_without_like():
  tx = _tx()
  params = MAKE.params()
  _, state = MAKE.run(tx, params, tx.init(params), [False, True], 0)
  raw = serialization.msgpack_restore(serialization.to_bytes(state))
  read = ols.upgrade_state(raw)
  assert float(ols.loss_scale(read)) == float(ols.loss_scale(state))
  assert str(ols.skip_report(read)) == str(ols.skip_report(state))


# --- 0.2.0 ---


def _v020_like(tx):
  params = MAKE_V020.params()
  return {"params": params, "opt_state": tx.init(params)}


def _v020_fields(state):
  """0.2.0's fields of today's state, as make_v020.py writes them: the ring
  of skips in the order they came (0.2.0 and today lay it out apart)."""
  fields = MAKE_V020.fields(state)
  fields["recent_skips"] = _in_order(fields["recent_skips"])
  return fields


def _in_order(ring):
  """A ring's written skips, by step (their order in 0.2.0, and today)."""
  kept = sorted(i for i, step in enumerate(ring["step"]) if step >= 0)
  order = sorted(kept, key=lambda i: ring["step"][i])
  return {name: [values[i] for i in order] for name, values in ring.items()}


@pytest.mark.parametrize("fmt", ["pickle", "msgpack", "orbax"])
def test_a_v020_checkpoint_upgrades_and_trains_on_as_v020_did(fmt):
  tx = MAKE_V020.make_tx()
  restored = _restored(fmt, V020)
  if fmt == "pickle":  # today's types, the new fields None: no `like`
    checkpoint = ols.upgrade_state(restored)
  else:
    checkpoint = ols.upgrade_state(restored, like=_v020_like(tx))
  params, state = checkpoint["params"], checkpoint["opt_state"]
  assert type(state) is ols.LossScaleOptimizerState
  chex.assert_trees_all_equal_structs(state, tx.init(params))
  expected = dict(EXPECTED_V020["state"])
  expected["recent_skips"] = _in_order(expected["recent_skips"])
  assert _v020_fields(state) == expected
  for name, value in EXPECTED_V020["params"].items():
    np.testing.assert_array_equal(params[name], np.float32(value))
  # What 0.2.0 did not record, the state says it does not know.
  lss = state.loss_scale_state
  assert not bool(lss.config.known)
  assert not np.asarray(lss.recent_skips.recorded).any()
  assert not bool(lss.nan_steps_exact)  # 1 NaN step of 4 skips

  start = len(MAKE_V020.HISTORY)
  for n, after in enumerate(EXPECTED_V020["after"], 1):
    p_n, s_n = MAKE_V020.run(
      tx, params, state, MAKE_V020.CONTINUATION[:n], start
    )
    expected = dict(after["state"])
    expected["recent_skips"] = _in_order(expected["recent_skips"])
    assert _v020_fields(s_n) == expected, n
    for name, value in after["params"].items():
      np.testing.assert_array_equal(p_n[name], np.float32(value))
    assert bool(s_n.loss_scale_state.config.known)


def test_an_upgraded_v020_state_reports_what_0_2_0_recorded_and_no_more():
  state = ols.upgrade_state(_restored("pickle", V020))["opt_state"]
  report = ols.skip_report(state)
  text = " ".join(str(report).split())
  assert report.recent == (
    (2, ("inf",), 2048.0, 2048.0),
    (4, ("NaN", "loss"), 2048.0, 2048.0),
    (5, ("inf",), 2048.0, 2048.0),
    (6, ("inf",), 2048.0, 1024.0),
  )
  # No floor, no hysteresis, and no told NaN claimed for 0.2.0's skips.
  assert report.min_scale is None and "floor not recorded" in text
  assert "`backoff_on_nonfinite_loss=False` keeps" not in text
  assert "held by hysteresis" not in text
  assert "not counted against the scale" not in text
  assert "step 2: inf or NaN; scale 2**11 -> 2**11" in text
  assert "checked on a mesh with Auto axes" not in text
  assert "recorded by an earlier release that did not say where" in text
  # A tx carrying a configuration is not checked against one not recorded.
  ols.skip_report(state, MAKE_V020.make_tx())


def test_a_v020_pickle_used_as_it_is_names_the_upgrade():
  checkpoint = _restored("pickle", V020)
  old = checkpoint["opt_state"]
  assert type(old) is ols.LossScaleOptimizerState  # loaded, today's type
  assert old.loss_scale_state.config is None
  assert float(ols.loss_scale(old)) == EXPECTED_V020["state"]["loss_scale"]
  grads = jax.tree.map(jnp.ones_like, checkpoint["params"])
  with pytest.raises(ValueError, match="upgrade_state"):
    MAKE_V020.make_tx().update(grads, old, checkpoint["params"])
  with pytest.raises(ValueError, match="upgrade_state"):
    ols.skip_report(old)
  # Its dicts, restored without a target, read as the pickle does.
  raw = _restored("msgpack", V020)
  assert float(ols.loss_scale(raw)) == EXPECTED_V020["state"]["loss_scale"]
  assert str(ols.skip_report(ols.upgrade_state(raw))) == str(
    ols.skip_report(ols.upgrade_state(checkpoint))
  )


def test_steps_is_for_v010_only():
  with pytest.raises(ValueError, match="`steps` must be None for a state of"):
    ols.upgrade_state(_restored("pickle", V020), steps=8)
