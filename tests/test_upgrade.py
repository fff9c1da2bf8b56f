"""Checkpoints of optax_lossscale 0.1.0 restore through `upgrade_state`.

tests/fixtures/v010/ holds one 0.1.0 checkpoint (params and the state of
`loss_scale_optimizer(optax.adam)` after three finite steps and an overflow
that hysteresis had not yet backed off for) in three formats, written by the
0.1.0 code (tests/fixtures/make_v010.py), with what 0.1.0 computed for the
next steps. Each format restores, upgrades, and trains on as 0.1.0 did: the
scale, its counter and the skip counts carry over exactly.
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
EXPECTED = json.loads((V010 / "expected.json").read_text())


def _generator():
  spec = importlib.util.spec_from_file_location(
    "make_v010", FIXTURES / "make_v010.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


MAKE = _generator()


def _tx(**kwargs):
  return ols.loss_scale_optimizer(
    optax.adam(MAKE.LEARNING_RATE), **MAKE.CONFIG, **kwargs
  )


def _like(tx):
  params = MAKE.params()
  return {"params": params, "opt_state": tx.init(params)}


def _restored(fmt):
  if fmt == "pickle":
    with open(V010 / "checkpoint.pkl", "rb") as f:
      return pickle.load(f)
  if fmt == "msgpack":
    return serialization.msgpack_restore(
      (V010 / "checkpoint.msgpack").read_bytes()
    )
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(V010 / "orbax")  # no target: plain dicts


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


@pytest.mark.xfail(strict=True, reason="issue 34, case 5")
def test_an_upgraded_v010_state_reports_its_new_counts_since_the_upgrade():
  tx = _tx(leaf_stats=True)
  state = ols.upgrade_state(_restored("pickle"), like=_like(tx))["opt_state"]
  text = " ".join(str(ols.skip_report(state, tx)).split())
  # 0.1.0 counted one skip, and neither its NaNs nor its leaves.
  assert "skipped: 1 in total" in text
  assert "stayed finite" not in text
  assert "0 with NaN" not in text
  assert "since step 4" in text


@pytest.mark.xfail(strict=True, reason="issue 34, case 5")
@pytest.mark.parametrize("steps", [0, True])
def test_steps_below_the_skips_or_not_an_int_are_refused(steps):
  with pytest.raises(ValueError, match="`steps` must be"):
    ols.upgrade_state(_restored("pickle"), steps=steps)


# Issue 34, case 23: a `like` that does not fit is refused, not obeyed.


@pytest.mark.xfail(strict=True, reason="issue 34, case 23")
def test_a_like_whose_inner_state_differs_is_refused():
  sgd = ols.loss_scale_optimizer(optax.sgd(0.1), **MAKE.CONFIG)
  for fmt in ("msgpack", "orbax"):
    with pytest.raises(ValueError, match=r"inner_state.*\bmu\b"):
      ols.upgrade_state(_restored(fmt), like=_like(sgd))


@pytest.mark.xfail(strict=True, reason="issue 34, case 23")
def test_a_static_like_for_a_dynamic_state_is_refused():
  static = ols.loss_scale_optimizer(
    optax.adam(MAKE.LEARNING_RATE), dynamic=False, initial_scale=2.0**10
  )
  for fmt in ("msgpack", "orbax"):
    with pytest.raises(ValueError, match="counter"):
      ols.upgrade_state(_restored(fmt), like=_like(static))


@pytest.mark.xfail(strict=True, reason="issue 34, case 23")
def test_todays_state_as_plain_dicts_reads_without_like():
  tx = _tx()
  params = MAKE.params()
  _, state = MAKE.run(tx, params, tx.init(params), [False, True], 0)
  raw = serialization.msgpack_restore(serialization.to_bytes(state))
  read = ols.upgrade_state(raw)
  assert float(ols.loss_scale(read)) == float(ols.loss_scale(state))
  assert str(ols.skip_report(read)) == str(ols.skip_report(state))
