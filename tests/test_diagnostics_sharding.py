"""The diagnostics on meshes: per-leaf counts and the NaN/loss counters
agree on every device, on `Explicit` and `Auto` meshes and under
`shard_map` with `axis_name`; shardings stay plain optax's, and the per-leaf
codes cross devices in one collective, not one per leaf."""

import _hlo
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_equal
from _meshes import poisoned, step_of, tree_on
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols
from optax_lossscale._core.state import RECENT_SKIPS

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8,
  reason="needs 8 devices (on CPU, the test set-up makes them)",
)


def all_reduces(compiled):
  return _hlo.hlo_opcodes(compiled)["all-reduce"]


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_leaf_counts_on_a_mesh(axis_type):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    params = tree_on(mesh)
    grads = tree_on(mesh, scale=2.0**10)
    tx = ols.loss_scale_optimizer(
      optax.adam(1e-2),
      initial_scale=2.0**10,
      leaf_stats=True,
      backoff_on_nonfinite_loss=False,
    )
    plain = optax.adam(1e-2)
    step = step_of(tx)
    state = tx.init(params)
    # A NaN in the last shard of w3, an inf in the first of w1, then a bad
    # batch, then a finite step.
    one = jnp.float32(1.0)
    p1, state = step(
      params, state, poisoned(grads, "w3", (63, 63), np.nan), one
    )
    p2, state = step(p1, state, poisoned(grads, "w1", (0, 0), np.inf), one)
    p3, state = step(p2, state, grads, jnp.float32(np.nan))
    p4, state = step(p3, state, grads, one)

    counts = {k: int(v) for k, v in ols.nonfinite_leaves(state).items()}
    assert counts == {"b": 0, "w1": 1, "w2": 0, "w3": 1}
    stats = ols.skip_stats(state)
    assert int(stats.total_skipped) == 3
    # On an Auto mesh the check cannot tell a NaN from an inf without
    # copying a leaf (`_finite._reduced_where_it_lives`): it counts an
    # overflow there.
    assert int(stats.nan_steps) == (axis_type == AxisType.Explicit)
    assert int(stats.nonfinite_loss_steps) == 1
    assert float(ols.loss_scale(state)) == 2.0**8  # two backoffs, one held
    assert_trees_equal(p3, params)  # nothing applied before step 4

    # Shardings are plain optax's.
    plain_state = plain.init(params)
    _, plain_state = jax.jit(plain.update)(grads, plain_state, params)
    assert_same_shardings(state.inner_state, plain_state)
    assert_same_shardings(p4, params)


def assert_same_shardings(tree, expected):
  for x, y in zip(
    jax.tree.leaves(tree), jax.tree.leaves(expected), strict=True
  ):
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (
      x.sharding,
      y.sharding,
    )


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_leaf_stats_add_no_collective(axis_type):
  """The per-leaf codes cross devices as one vector: the step with
  `leaf_stats` has no more all-reduces than the step without."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    params = tree_on(mesh)
    counts = {}
    for leaf_stats in (False, True):
      tx = ols.loss_scale_optimizer(
        optax.sgd(1e-2, momentum=0.9), leaf_stats=leaf_stats
      )
      compiled = (
        step_of(tx)
        .lower(params, tx.init(params), params, jnp.float32(1.0))
        .compile()
      )
      counts[leaf_stats] = all_reduces(compiled)
      gathering = _hlo.hlo_opcodes(compiled)
      assert not any(
        gathering[k] for k in ("all-gather", "all-to-all", "collective-permute")
      )
  assert counts[True] <= counts[False], counts


def test_shard_map_with_axis_name_agrees_on_every_shard():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  tx = ols.loss_scale_optimizer(
    optax.sgd(0.1),
    initial_scale=4.0,
    axis_name="d",
    leaf_stats=True,
    backoff_on_nonfinite_loss=False,
  )
  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}

  def local_step(state, grads, loss):
    # Each shard holds its own gradients and loss, as under pmap.
    state, grads = jax.tree.map(lambda x: x[0], (state, grads))
    _, state = tx.update(grads, state, params, value=loss[0])
    return jax.tree.map(lambda x: x[None], state)

  def run(grads, loss):
    state = jax.tree.map(
      lambda x: jnp.broadcast_to(x, (8, *x.shape)), tx.init(params)
    )
    return jax.jit(
      jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P("d"), P("d"), P("d")),
        out_specs=P("d"),
      )
    )(state, grads, loss)

  grads = {"w": jnp.ones((8, 3)), "b": jnp.ones((8, 2))}
  grads["b"] = grads["b"].at[5, 1].set(jnp.nan)  # one shard's NaN
  state = run(grads, jnp.ones(8))
  counts = ols.nonfinite_leaves(state)  # one count per shard
  np.testing.assert_array_equal(counts["b"], np.ones(8))
  np.testing.assert_array_equal(counts["w"], np.zeros(8))
  np.testing.assert_array_equal(ols.skip_stats(state).nan_steps, np.ones(8))
  np.testing.assert_array_equal(ols.loss_scale(state), np.full(8, 2.0))

  loss = jnp.ones(8).at[3].set(jnp.inf)  # one shard's bad batch
  state = run({"w": jnp.ones((8, 3)), "b": jnp.ones((8, 2))}, loss)
  stats = ols.skip_stats(state)
  np.testing.assert_array_equal(stats.nonfinite_loss_steps, np.ones(8))
  np.testing.assert_array_equal(stats.last_finite, np.zeros(8, bool))
  np.testing.assert_array_equal(ols.loss_scale(state), np.full(8, 4.0))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_the_report_says_where_the_mesh_cannot_tell_nan_from_inf(axis_type):
  """NaN at the floor: an `Explicit` mesh sees the NaN, and the report says
  NaN; an `Auto` mesh counts it as an inf, and the report says that it
  cannot tell them apart, never that a NaN is a range problem alone."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    params = tree_on(mesh)
    tx = ols.loss_scale_optimizer(optax.sgd(1e-2), initial_scale=2.0)
    step = step_of(tx)
    state = tx.init(params)
    nan = poisoned(tree_on(mesh), "w3", (63, 63), np.nan)
    for _ in range(3):  # at 2, then twice at the floor
      params, state = step(params, state, nan, jnp.float32(1.0))
    report = ols.skip_report(state, tx)
  text = " ".join(str(report).split())
  assert report.total_skipped == 3 and report.at_floor
  if axis_type == AxisType.Explicit:
    assert report.nan_told_apart is True
    assert "- NaN in the gradients at every scale down to the floor" in text
    assert "cannot tell" not in text and "Auto" not in text
  else:
    assert report.nan_told_apart is False
    assert report.nan_steps == 0  # counted as overflows
    assert "step 2: inf or NaN; scale 1 -> 1" in text
    assert (
      "were not finite on 2 steps that ran at the floor (1) (0 with NaN, 2"
      " with inf (or a NaN on an Auto mesh, which this check cannot tell"
      " apart)): float16's range (65504) exceeded in a value or a derivative"
      " even at that scale, or a bug" in text
    )
    assert "where the check counts a NaN as an inf" in text
    assert "overflowed to inf" not in text


@pytest.mark.parametrize("skips", [2, RECENT_SKIPS + 1])
def test_an_auto_mesh_says_nothing_of_nan_where_no_gradient_was_bad(skips):
  """Skips for the loss alone on an `Auto` mesh: no gradient was ever non-
  finite, so there was no NaN to tell from an inf, and the report says
  nothing of it, whether or not the ring still keeps every skip (the state
  records that the NaN count is exact)."""
  mesh = jax.make_mesh(
    (4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  with jax.set_mesh(mesh):
    params = tree_on(mesh)
    tx = ols.loss_scale_optimizer(optax.sgd(1e-2), initial_scale=2.0**20)
    step = step_of(tx)
    state = tx.init(params)
    for _ in range(skips):
      params, state = step(params, state, tree_on(mesh), jnp.float32(np.inf))
    report = ols.skip_report(state, tx)
  text = " ".join(str(report).split())
  # The checks could not have told a NaN from an inf ...
  assert report.nan_told_apart is False
  assert report.total_skipped == report.nonfinite_loss_steps == skips
  assert all(causes == ("loss",) for _, causes, _, _ in report.recent)
  # ... but had none to tell.
  assert bool(state.loss_scale_state.nan_steps_exact)
  assert "counts a NaN as an inf" not in text and "lower bound" not in text


def _nan_history_on(mesh, tx, steps=3):
  """`steps` steps with a NaN in the last shard of `w3`, on `mesh`."""
  with jax.set_mesh(mesh):
    params = tree_on(mesh)
    step, state = step_of(tx), tx.init(params)
    nan = poisoned(tree_on(mesh), "w3", (63, 63), np.nan)
    for _ in range(steps):
      params, state = step(params, state, nan, jnp.float32(1.0))
  return state


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_nan_told_apart_is_where_each_step_checked_not_where_the_state_is(
  axis_type,
):
  """Issue 34, case 2: whether a NaN was told from an inf is a fact of the
  step that checked, recorded with each skip: moving the state (to one
  device, to a mesh of the other kind) changes nothing the report says."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  tx = ols.loss_scale_optimizer(optax.sgd(1e-2), initial_scale=2.0)
  state = _nan_history_on(mesh, tx)
  here = ols.skip_report(state, tx)
  told = axis_type == AxisType.Explicit
  assert here.nan_told_apart is told
  other_type = AxisType.Auto if told else AxisType.Explicit
  other = jax.make_mesh((4, 2), ("data", "model"), axis_types=(other_type,) * 2)
  for moved in (
    jax.device_put(state, jax.devices()[0]),
    jax.device_put(state, NamedSharding(other, P())),
    jax.device_get(state),
  ):
    report = ols.skip_report(moved, tx)
    assert report.nan_told_apart is told
    assert str(report) == str(here)


@pytest.mark.parametrize(
  "axis_type",
  [
    pytest.param(
      AxisType.Explicit,
      marks=pytest.mark.xfail(
        jax.__version_info__ < (0, 10),
        reason="jax 0.7.1: inside a shard_map manual over one axis of an"
        " Explicit mesh, the skip's select of a zero beside a gradient"
        " sharded over the other axis raises ShardingTypeError"
        " (`_core.skip.zero_unless`); jax 0.10.2 runs it",
        strict=False,
      ),
    ),
    AxisType.Auto,
  ],
)
def test_shard_map_over_the_data_axis_only(axis_type):
  """Issue 34, case 8: a `shard_map` manual over the data axis, the model
  axis left to the mesh inside. On an `Auto` model axis the check counts a
  NaN as an inf, and the report says it cannot tell them apart; on an
  `Explicit` one it sees the NaN."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  tx = ols.loss_scale_optimizer(
    optax.sgd(0.1), initial_scale=2.0, axis_name="data"
  )
  params = {"w": jnp.ones((8, 16))}

  def local_step(state, grads):
    state, grads = jax.tree.map(lambda x: x[0], (state, grads))
    _, state = tx.update(grads, state, params)
    return jax.tree.map(lambda x: x[None], state)

  grads = jnp.ones((4, 8, 16)).at[2, 3, 9].set(jnp.nan)
  with jax.set_mesh(mesh):
    grads = jax.device_put(grads, NamedSharding(mesh, P("data", None, "model")))
    # One state per data shard, placed as the shard_map takes it.
    state = jax.tree.map(
      lambda x: jax.device_put(
        jnp.broadcast_to(x, (4, *x.shape)), NamedSharding(mesh, P("data"))
      ),
      tx.init(params),
    )
    step = jax.jit(
      jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P("data"), P("data")),
        out_specs=P("data"),
        axis_names={"data"},
      )
    )
    for _ in range(3):
      state = step(state, {"w": grads})
  member = jax.tree.map(lambda x: x[0], jax.device_get(state))
  report = ols.skip_report(member, tx)
  words = " ".join(str(report).split())
  assert report.total_skipped == 3 and report.at_floor
  # An `Auto` axis never tells a NaN from an inf; on an `Explicit` one the
  # check may or may not (it copies no leaf to): either way, what the
  # report says agrees with what the check counted.
  if axis_type == AxisType.Auto:
    assert report.nan_told_apart is False
  if report.nan_told_apart:
    assert report.nan_steps == 3
    assert "- NaN in the gradients at every scale down to the floor" in words
  else:
    assert report.nan_told_apart is False
    assert "overflowed to inf" not in words
    assert "step 2: inf or NaN; scale 1 -> 1" in words
    assert "where the check counts a NaN as an inf" in words


def _head_loss(w, x):
  with jax.named_scope("head"):
    z = x.astype(jnp.float16) @ w.astype(jnp.float16)
  return jnp.sum(jnp.exp(z).astype(jnp.float32)) * 2.0**-10


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize(
  "w_value, scale, pass_name",
  [
    (4.0, 1.0, "forward"),
    pytest.param(1.0, 2.0**20, "backward", marks=pytest.mark.slow),
  ],
  ids=["exp(16) forward", "cotangent at 2**20"],
)
def test_the_finder_on_a_mesh_reports_as_on_one_device(
  axis_type, w_value, scale, pass_name
):
  # Parameters sharded by column, the batch by row: the finder measures
  # the same values and names the same operation as unsharded.
  w, x = jnp.full((4, 8), w_value), jnp.ones((16, 4))
  alone = ols.find_overflow(_head_loss, w, x, scale=scale)
  assert alone.first.pass_name == pass_name
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    sharded = ols.find_overflow(_head_loss, ws, xs, scale=scale)
  assert sharded.first == alone.first
  assert str(sharded) == str(alone)
