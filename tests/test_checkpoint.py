"""Checkpoints: orbax save/restore mid-run is bit-identical, flax
serialization has named fields, and a plain-optax checkpoint migrates."""

import chex
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from _helpers import assert_trees_equal, loss_step
from flax import serialization

import optax_lossscale as ols

N_STEPS = 12
BAD = {4, 5, 6, 9}  # an overflow streak (4-6) and a lone overflow


def _tx():
  return ols.loss_scale_optimizer(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    initial_scale=2.0**6,
    dynamic_growth_steps=2,
    hysteresis=2,
  )


def _params():
  return {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.zeros((), jnp.float32)}


def _loss(params, x):
  return jnp.sum((params["w"] * x + params["b"] - 1.0) ** 2)


def _x(i):
  x = jnp.array([1.0, 2.0, -1.0]) * (1.0 + 0.1 * i)
  return x.at[1].set(jnp.inf) if i in BAD else x


@pytest.fixture(scope="module")
def step():
  return jax.jit(loss_step(_tx(), _loss))


def _run(step, params, opt_state, start, stop):
  for i in range(start, stop):
    params, opt_state = step(params, opt_state, _x(i))
  return params, opt_state


@pytest.mark.parametrize("save_at", [3, 5])  # 5: inside the overflow streak
def test_orbax_resume_is_bit_identical(tmp_path, step, save_at):
  tx = _tx()
  params0 = _params()
  full = _run(step, params0, tx.init(params0), 0, N_STEPS)

  params, opt_state = _run(step, params0, tx.init(params0), 0, save_at)
  if save_at == 5:
    assert int(ols.skip_stats(opt_state).skipped_in_a_row) == 1
    assert not bool(ols.skip_stats(opt_state).last_finite)
  ckpt = {"params": params, "opt_state": opt_state}
  path = tmp_path / f"ckpt_{save_at}"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, ckpt)
    ckptr.wait_until_finished()
  del params, opt_state, ckpt

  # Restore into a fresh process-like target: the structure of a new init.
  abstract = jax.tree.map(
    ocp.utils.to_shape_dtype_struct,
    {"params": params0, "opt_state": tx.init(params0)},
  )
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, abstract)
  assert isinstance(restored["opt_state"], ols.LossScaleOptimizerState)
  resumed = _run(
    step, restored["params"], restored["opt_state"], save_at, N_STEPS
  )
  assert_trees_equal(resumed, full)
  # The run really exercised the rule: backoffs, growth, skips.
  assert int(ols.skip_stats(full[1]).total_skipped) == len(BAD)


def test_pytree_checkpointer_roundtrip(tmp_path, step):
  tx = _tx()
  _, opt_state = _run(step, _params(), tx.init(_params()), 0, 5)
  ckptr = ocp.PyTreeCheckpointer()
  ckptr.save(tmp_path / "pt", {"opt_state": opt_state})
  target = {"opt_state": tx.init(_params())}
  restored = ckptr.restore(
    tmp_path / "pt",
    item=target,
    restore_args=ocp.checkpoint_utils.construct_restore_args(target),
  )["opt_state"]
  assert_trees_equal(restored, opt_state)
  assert type(restored) is ols.LossScaleOptimizerState
  assert float(ols.loss_scale(restored)) == float(ols.loss_scale(opt_state))


def test_flax_state_dict_named_fields(step):
  tx = _tx()
  _, opt_state = _run(step, _params(), tx.init(_params()), 0, 6)
  d = serialization.to_state_dict(opt_state)
  assert set(d) == {"loss_scale_state", "inner_state"}
  assert set(d["loss_scale_state"]) == {
    "loss_scale",
    "counter",
    "skipped_in_a_row",
    "total_skipped",
    "last_finite",
    "overflows_in_a_row",
    "nan_steps",
    "nonfinite_loss_steps",
    "steps",
    "recent_skips",
    "leaf_notfinite",
    "config",
    "counted_since",
    "nan_steps_exact",
  }
  assert set(d["loss_scale_state"]["config"]) == set(ols.RecordedConfig._fields)
  assert float(d["loss_scale_state"]["loss_scale"]) == float(
    ols.loss_scale(opt_state)
  )
  # And back, through msgpack bytes.
  blob = serialization.to_bytes(opt_state)
  back = serialization.from_bytes(tx.init(_params()), blob)
  assert_trees_equal(back, opt_state)


def test_static_scale_state_checkpoints(tmp_path):
  tx = ols.loss_scale_optimizer(
    optax.sgd(0.1), dynamic=False, initial_scale=128.0
  )
  state = tx.init(_params())
  assert ols.dynamic_counter(state) is None
  back = serialization.from_bytes(
    tx.init(_params()), serialization.to_bytes(state)
  )
  assert ols.dynamic_counter(back) is None
  assert_trees_equal(back, state)


@pytest.mark.slow
def test_migrate_plain_optax_checkpoint(tmp_path):
  """A checkpoint of a plain optax state, taken before loss scaling was
  added, restores into the loss-scaled optimizer with one line."""
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  params = _params()
  plain_state = inner.init(params)
  for i in range(3):
    grads = jax.grad(_loss)(params, _x(i))
    updates, plain_state = inner.update(grads, plain_state, params)
    params = optax.apply_updates(params, updates)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "old", {"params": params, "opt_state": plain_state})
    ckptr.wait_until_finished()

  tx = ols.loss_scale_optimizer(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  )
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(
      tmp_path / "old",
      jax.tree.map(
        ocp.utils.to_shape_dtype_struct,
        {"params": _params(), "opt_state": inner.init(_params())},
      ),
    )
  # The documented one-liner:
  opt_state = tx.init(restored["params"])._replace(
    inner_state=restored["opt_state"]
  )
  # ... and its spelled-out equivalent:
  alt = ols.LossScaleOptimizerState(
    loss_scale_state=tx.init(restored["params"]).loss_scale_state,
    inner_state=restored["opt_state"],
  )
  assert_trees_equal(alt, opt_state)
  assert float(ols.loss_scale(opt_state)) == 2.0**15
  assert int(ols.dynamic_counter(opt_state)) == 0

  # Continuing matches continuing the plain run (power-of-two scale: exact).
  grads = jax.grad(_loss)(restored["params"], _x(3))
  ref_updates, ref_state = inner.update(grads, plain_state, params)
  scaled = jax.grad(lambda p: ols.scale_loss(_loss(p, _x(3)), opt_state))(
    restored["params"]
  )
  updates, opt_state = tx.update(scaled, opt_state, restored["params"])
  chex.assert_trees_all_equal(updates, ref_updates)
  chex.assert_trees_all_equal(opt_state.inner_state, ref_state)
  assert int(ols.dynamic_counter(opt_state)) == 1


def _leaf_stats_run():
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), leaf_stats=True)
  step = jax.jit(loss_step(tx, _loss))
  params, opt_state = _run(step, _params(), tx.init(_params()), 0, 6)
  return tx, step, params, opt_state


def _restore(fmt, tmp_path, tx, opt_state):
  """`opt_state` saved in `fmt` and restored into `tx.init`'s structure."""
  if fmt == "msgpack":
    blob = serialization.to_bytes(opt_state)
    return serialization.from_bytes(tx.init(_params()), blob)
  if fmt == "pickle":
    import pickle

    return pickle.loads(pickle.dumps(jax.device_get(opt_state)))
  path = tmp_path / fmt
  if fmt == "orbax":
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(path, opt_state)
      ckptr.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(_params()))
    with ocp.StandardCheckpointer() as ckptr:
      return ckptr.restore(path, abstract)
  ckptr = ocp.PyTreeCheckpointer()
  ckptr.save(path, {"opt_state": opt_state})
  target = {"opt_state": tx.init(_params())}
  return ckptr.restore(
    path,
    item=target,
    restore_args=ocp.checkpoint_utils.construct_restore_args(target),
  )["opt_state"]


@pytest.mark.parametrize("fmt", ["orbax", "pytree", "msgpack", "pickle"])
def test_leaf_counts_checkpoint_and_resume(tmp_path, fmt):
  # The per-leaf counts are one vector beside the tree it counts the
  # leaves of; both come back, and the run goes on counting.
  tx, step, params, opt_state = _leaf_stats_run()
  counts = ols.nonfinite_leaves(opt_state)
  bad = sum(i in BAD for i in range(6))
  assert {k: int(v) for k, v in counts.items()} == {"w": bad, "b": bad}
  restored = _restore(fmt, tmp_path, tx, opt_state)
  assert_trees_equal(restored, opt_state)
  assert jax.tree.structure(restored) == jax.tree.structure(opt_state)
  assert ols.nonfinite_leaves(restored).keys() == counts.keys()
  _, resumed = _run(step, params, restored, 6, N_STEPS)
  _, full = _run(step, params, opt_state, 6, N_STEPS)
  assert_trees_equal(resumed, full)
  assert int(ols.nonfinite_leaves(resumed)["w"]) == len(BAD)


def test_leaf_counts_restored_raw_by_msgpack_keep_their_names():
  # Issue 34, case 24: `msgpack_restore` without a target gives `{}` for
  # each `()` that names a counted leaf; the counts still read by name.
  _, _, _, opt_state = _leaf_stats_run()
  raw = serialization.msgpack_restore(serialization.to_bytes(opt_state))
  counts = {k: int(v) for k, v in ols.nonfinite_leaves(raw).items()}
  assert counts == {
    k: int(v) for k, v in ols.nonfinite_leaves(opt_state).items()
  }
  assert str(ols.skip_report(raw)) == str(ols.skip_report(opt_state))
