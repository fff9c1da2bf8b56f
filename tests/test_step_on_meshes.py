"""The step's diagnosis cases on `Explicit` and `Auto` meshes (8 CPU
devices): a non-finite loss with finite gradients, hysteresis and the
static scale with a NaN on one shard, `raise_if_stuck`, and the
Gemma-style model's inf loss with its batch sharded.

Each case runs on the mesh and, where the report is involved, the same
history on one device, and compares them: the skip statistics, the scales
(powers of two, compared exactly), and the report's diagnosis. On an
`Auto` mesh the check counts a NaN as an inf, and where a NaN was counted
so the report adds one sentence that says so
(tests/test_diagnostics_sharding.py checks its words); every other
sentence is the one device's. Where no gradient was ever non-finite (the
Gemma case), there was no NaN to tell, and the report says nothing of it.
"""

import contextlib
import functools

import _gemma
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_equal
from _meshes import make_mesh, poisoned, step_of, tree_on
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8,
  reason="needs 8 devices (on CPU, the test set-up makes them)",
)

AXIS_TYPES = pytest.mark.parametrize(
  "axis_type", [AxisType.Explicit, AxisType.Auto]
)
SCALE = 2.0**10


def placed_on(mesh):
  """The context a history runs in: the mesh set, or none for one
  device."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def trees(mesh, scale=1.0):
  """`tree_on`'s tree on `mesh`, or the same values on one device."""
  if mesh is not None:
    return tree_on(mesh, scale)
  on_a_mesh = tree_on(make_mesh("2d", AxisType.Auto), scale)
  return jax.device_put(jax.device_get(on_a_mesh), jax.devices()[0])


def replicated(mesh, value):
  """A float32 scalar, replicated on `mesh` (or on one device)."""
  where = jax.devices()[0] if mesh is None else NamedSharding(mesh, P())
  return jax.device_put(jnp.float32(value), where)


def run_history(tx, history, mesh):
  """Runs `history`, a list of "nan" (a NaN in the last shard of `w3`),
  "inf_loss" (finite gradients, an inf loss) and "finite", through the
  jitted step of `tx`, on `mesh` or on one device (`mesh=None`). Returns
  the state after each step."""
  with placed_on(mesh):
    params = trees(mesh)
    grads = trees(mesh, scale=SCALE)
    by_kind = {
      "nan": (poisoned(grads, "w3", (63, 63), np.nan), 1.0),
      "inf_loss": (grads, np.inf),
      "finite": (grads, 1.0),
    }
    step = step_of(tx)
    state = tx.init(params)
    states = []
    for kind in history:
      g, loss = by_kind[kind]
      params, state = step(params, state, g, replicated(mesh, loss))
      states.append(state)
  return states


def assert_same_diagnosis(on_mesh, on_one, axis_type):
  """The mesh's diagnosis is the one device's, and on an `Auto` mesh that
  and one sentence more, last, on what the check cannot tell apart."""
  if axis_type == AxisType.Explicit:
    assert on_mesh == on_one
  else:
    assert on_mesh[:-1] == on_one
    assert on_mesh[-1].startswith(
      "some of these gradients were checked on a mesh with Auto axes"
    )


def stats_of(state, axis_type):
  """The skip statistics, as ints; without `nan_steps` on an `Auto` mesh,
  which counts a NaN as an inf."""
  stats = ols.skip_stats(state)._asdict()
  if axis_type == AxisType.Auto:
    del stats["nan_steps"]
  return {k: int(v) for k, v in stats.items()}


def with_nan_as_inf(recent):
  """The recent skips as an `Auto` mesh's check records them."""
  return tuple(
    (step, tuple("inf" if c == "NaN" else c for c in causes), *scales)
    for step, causes, *scales in recent
  )


# A non-finite loss with finite gradients.


@AXIS_TYPES
@pytest.mark.parametrize("backoff", [True, False])
def test_a_nonfinite_loss_skips_the_step(axis_type, backoff):
  """A replicated inf, then NaN, loss with finite sharded gradients: both
  steps skipped (nothing applied, the inner state kept bit for bit),
  counted as non-finite losses, the loss recorded as their cause; the
  scale halves on each with `backoff_on_nonfinite_loss`, else stays."""
  mesh = make_mesh("2d", axis_type)
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), initial_scale=SCALE, backoff_on_nonfinite_loss=backoff
  )
  with jax.set_mesh(mesh):
    params = tree_on(mesh)
    grads = tree_on(mesh, scale=SCALE)
    assert ols.all_finite(grads)
    step = step_of(tx)
    state = tx.init(params)
    new, state = step(params, state, grads, replicated(mesh, np.inf))
    new, state = step(new, state, grads, replicated(mesh, np.nan))

  assert_trees_equal(new, params)
  assert_trees_equal(state.inner_state, tx.init(params).inner_state)
  stats = ols.skip_stats(state)
  assert int(stats.total_skipped) == int(stats.nonfinite_loss_steps) == 2
  assert int(stats.nan_steps) == 0
  scales = (SCALE, SCALE / 2, SCALE / 4) if backoff else (SCALE,) * 3
  assert float(ols.loss_scale(state)) == scales[2]
  report = ols.skip_report(state, tx)
  assert report.recent == (
    (0, ("loss",), scales[0], scales[1]),
    (1, ("loss",), scales[1], scales[2]),
  )


def per_example_loss(params, batch):
  """Each example's loss: its weight times the parameters' squared norm,
  plus its own offset (data: the gradients never see it)."""
  squares = sum(jnp.sum(leaf * leaf) for leaf in jax.tree.leaves(params))
  return batch["weight"] * squares + batch["offset"]


def mean_loss(params, batch):
  return jnp.mean(per_example_loss(params, batch))


def batch_on(mesh, bad_example=None, value=np.inf):
  """Eight examples, one a device (sharded on both mesh axes); the offset
  of `bad_example` is `value`."""
  offset = np.zeros(8, np.float32)
  if bad_example is not None:
    offset[bad_example] = value
  sharding = NamedSharding(mesh, P(("data", "model")))
  return {
    "weight": jax.device_put(np.full(8, 2.0**-8, np.float32), sharding),
    "offset": jax.device_put(offset, sharding),
  }


@pytest.mark.slow
@AXIS_TYPES
def test_one_examples_nonfinite_loss_on_one_device_skips_everywhere(
  axis_type,
):
  """In a jitted step over a batch sharded one example a device, one
  example's loss inf (then another's NaN) makes the mean loss non-finite
  while the gradients stay finite: each such step is skipped and counted as
  a non-finite loss, the scale halves; a finite batch then applies."""
  mesh = make_mesh("2d", axis_type)
  tx = ols.loss_scale_optimizer(
    optax.sgd(2.0**-4, momentum=0.5), initial_scale=SCALE
  )

  @jax.jit
  def step(params, state, batch):
    loss, grads = ols.value_and_grad(mean_loss)(state, params, batch)
    updates, state = tx.update(grads, state, params, value=loss)
    return optax.apply_updates(params, updates), state, loss, grads

  with jax.set_mesh(mesh):
    params = tree_on(mesh)
    state = tx.init(params)
    new, state, loss, grads = step(params, state, batch_on(mesh, 5))
    assert float(loss) == np.inf and ols.all_finite(grads)
    new, state, loss, grads = step(new, state, batch_on(mesh, 2, np.nan))
    assert np.isnan(float(loss)) and ols.all_finite(grads)
    assert_trees_equal(new, params)
    assert_trees_equal(state.inner_state, tx.init(params).inner_state)
    stats = ols.skip_stats(state)
    assert int(stats.total_skipped) == int(stats.nonfinite_loss_steps) == 2
    assert float(ols.loss_scale(state)) == SCALE / 4
    assert ols.skip_report(state, tx).recent == (
      (0, ("loss",), SCALE, SCALE / 2),
      (1, ("loss",), SCALE / 2, SCALE / 4),
    )

    new, state, loss, _ = step(new, state, batch_on(mesh))
    assert np.isfinite(float(loss))
    assert bool(ols.skip_stats(state).last_finite)
    # Powers of two throughout, and the momentum's first trace is the
    # gradient: the update is exact.
    expected = jax.tree.map(lambda p: p - 2.0**-4 * 2.0**-7 * p, params)
    assert_trees_equal(new, expected)


# Hysteresis and the static scale.


@pytest.mark.slow
@AXIS_TYPES
@pytest.mark.parametrize(
  "config",
  [dict(hysteresis=2), dict(dynamic=False)],
  ids=["hysteresis", "static"],
)
def test_hysteresis_and_the_static_scale_on_a_mesh(axis_type, config):
  """A NaN on one shard: with `hysteresis=2` the first skip leaves the
  scale and the second halves it; a static scale never moves. The scales,
  the statistics and the diagnosis are the same history's on one
  device."""
  tx = ols.loss_scale_optimizer(
    optax.sgd(1e-2, momentum=0.9), initial_scale=SCALE, **config
  )
  history = ["nan", "nan", "finite", "nan"]
  on_mesh = run_history(tx, history, make_mesh("2d", axis_type))
  on_one = run_history(tx, history, None)

  scales = [float(ols.loss_scale(s)) for s in on_mesh]
  if "hysteresis" in config:
    assert scales[:2] == [SCALE, SCALE / 2]
  else:
    assert scales == [SCALE] * 4
  assert scales == [float(ols.loss_scale(s)) for s in on_one]
  for mesh_state, one_state in zip(on_mesh, on_one, strict=True):
    assert stats_of(mesh_state, axis_type) == stats_of(one_state, axis_type)
    mesh_report = ols.skip_report(mesh_state, tx)
    one_report = ols.skip_report(one_state, tx)
    expected = one_report.recent
    if axis_type == AxisType.Auto:
      expected = with_nan_as_inf(expected)
    assert mesh_report.recent == expected
    assert_same_diagnosis(
      mesh_report.diagnosis, one_report.diagnosis, axis_type
    )


# raise_if_stuck.

# name -> (configuration, history, after which steps it raises).
STUCK = {
  # At 2, then at the floor of 1: stuck from the fourth step.
  "floor": (dict(initial_scale=2.0), ["nan"] * 5, [3, 4]),
  # Three inf losses in a row, the scale left; a finite step ends it.
  "losses": (
    dict(initial_scale=SCALE, backoff_on_nonfinite_loss=False),
    ["finite", "inf_loss", "inf_loss", "inf_loss", "finite"],
    [3],
  ),
  # A static scale: stuck at the third skip in a row.
  "static": (
    dict(dynamic=False, initial_scale=SCALE),
    ["nan", "finite", "nan", "nan", "nan"],
    [4],
  ),
}


def stuck_message(state, tx):
  try:
    ols.raise_if_stuck(state, tx, max_skips_at_floor=3, max_nonfinite_losses=3)
  except RuntimeError as stuck:
    return str(stuck)
  return None


@pytest.mark.slow
@AXIS_TYPES
@pytest.mark.parametrize("case", sorted(STUCK))
def test_raise_if_stuck_on_a_mesh_raises_as_on_one_device(axis_type, case):
  """After every step of the history, `raise_if_stuck` raises on the mesh's
  state exactly when it raises on the one device's, for the same reason;
  on an `Explicit` mesh with the same message."""
  config, history, raises_after = STUCK[case]
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), **config)
  on_mesh = run_history(tx, history, make_mesh("2d", axis_type))
  on_one = run_history(tx, history, None)

  mesh_messages = [stuck_message(s, tx) for s in on_mesh]
  one_messages = [stuck_message(s, tx) for s in on_one]
  raised = [m is not None for m in one_messages]
  assert raised == [i in raises_after for i in range(len(history))]
  assert [m is not None for m in mesh_messages] == raised
  if axis_type == AxisType.Explicit:
    assert mesh_messages == one_messages
  else:  # the reason, before the report
    assert [m and m.split("\n\n")[0] for m in mesh_messages] == [
      m and m.split("\n\n")[0] for m in one_messages
    ]


# The Gemma-style model's inf loss with finite gradients, data parallel.

_GEMMA_RUNS = {}


def gemma_pad_run(axis_type):
  """The "pad" case (a padding target whose logit is -inf, in one
  row of each batch) with its batches sharded over 8 devices and the
  parameters replicated; once per axis type."""
  if axis_type not in _GEMMA_RUNS:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    data = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):
      params = jax.device_put(_gemma.PARAMS, NamedSharding(mesh, P()))
      batches = jax.device_put(_gemma.batches(4, pad=True), data)
      _GEMMA_RUNS[axis_type] = _gemma.train(params, batches)
  return _GEMMA_RUNS[axis_type]


@functools.cache
def _one_device_pad_run():
  """The "pad" case on one device."""
  return _gemma.train(_gemma.PARAMS, _gemma.batches(4, pad=True))


@pytest.mark.slow
@AXIS_TYPES
def test_gemma_inf_loss_with_its_batch_sharded_is_skipped(axis_type):
  """Every loss inf, every gradient finite: every step skipped and counted
  as a non-finite loss, nothing applied, the scale halved on each (as on
  one device)."""
  params, state, losses = gemma_pad_run(axis_type)
  assert losses == [np.inf] * 4
  stats = ols.skip_stats(state)
  assert int(stats.total_skipped) == int(stats.nonfinite_loss_steps) == 4
  assert int(stats.nan_steps) == 0
  assert_trees_equal(params, _gemma.PARAMS)
  _, one_state, _ = _one_device_pad_run()
  assert float(ols.loss_scale(state)) == float(ols.loss_scale(one_state))
  assert float(ols.loss_scale(state)) == 2.0**11
  assert (
    ols.skip_report(state, _gemma.TX).recent
    == ols.skip_report(one_state, _gemma.TX).recent
  )


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_gemma_inf_loss_with_its_batch_sharded_diagnosis(axis_type):
  """The diagnosis is the one device's: the loss not finite on every step,
  the forward pass's fault."""
  _, state, _ = gemma_pad_run(axis_type)
  _, one_state, _ = _one_device_pad_run()
  diagnosis = ols.skip_report(state, _gemma.TX).diagnosis
  assert diagnosis == ols.skip_report(one_state, _gemma.TX).diagnosis
  assert diagnosis[0].startswith("the loss was not finite on every one")
