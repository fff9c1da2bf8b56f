"""Scaling out: pmap, shard_map, sharded jit, and two processes.

Under pmap/shard_map each replica computes its own gradients, so the skip
decision must be reduced over `axis_name`; under jit with shardings the
program is global and the decision is one decision with no axis_name.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_equal, load_file, loss_step
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

N = 8


def _loss(params, x):
  return jnp.mean((x @ params["w"] + params["b"] - 1.0) ** 2)


def _batch(poison_replica=None):
  x = np.arange(N * 2 * 3, dtype=np.float32).reshape(N, 2, 3) / 10.0
  if poison_replica is not None:
    x[poison_replica, 0, 0] = np.nan
  return jnp.asarray(x)


def _params():
  return {
    "w": jnp.full((3,), 0.1, jnp.float32),
    "b": jnp.zeros((), jnp.float32),
  }


def _replicate(tree):
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), tree)


def _same_across_replicas(tree):
  return all(
    bool(np.all(np.asarray(a) == np.asarray(a)[0]))
    for a in jax.tree.leaves(tree)
  )


def _mesh(name):
  return jax.make_mesh((N,), (name,), axis_types=(jax.sharding.AxisType.Auto,))


def _pmap_step(tx, average_grads):
  def step(params, opt_state, x):
    grads = jax.grad(lambda p: ols.scale_loss(_loss(p, x), opt_state))(params)
    if average_grads:
      grads = jax.lax.pmean(grads, "i")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.pmap(step, axis_name="i")


@pytest.mark.slow
def test_pmap_axis_name_every_replica_skips():
  assert jax.device_count() >= N
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), initial_scale=2.0**10, axis_name="i"
  )
  params = _replicate(_params())
  opt_state = _replicate(tx.init(_params()))
  # Per-replica gradients are not averaged: only the reduced finite flag
  # couples the replicas.
  step = _pmap_step(tx, average_grads=False)
  p1, s1 = step(params, opt_state, _batch())
  assert not np.array_equal(p1["w"], params["w"])
  p2, s2 = step(p1, s1, _batch(poison_replica=3))
  assert_trees_equal(p2, p1, bitwise=False)  # every replica skipped
  assert_trees_equal(s2.inner_state, s1.inner_state, bitwise=False)
  np.testing.assert_array_equal(s2.loss_scale_state.loss_scale, 2.0**9)
  assert not np.any(s2.loss_scale_state.last_finite)
  assert _same_across_replicas(s2.loss_scale_state)


def test_pmap_averaged_grads_params_stay_identical():
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), initial_scale=2.0**10, axis_name="i"
  )
  step = _pmap_step(tx, average_grads=True)
  params, state = _replicate(_params()), _replicate(tx.init(_params()))
  for poison in (None, 5, None, 0, None):
    params, state = step(params, state, _batch(poison))
    assert _same_across_replicas(params)
    assert _same_across_replicas(state)
  assert np.all(np.isfinite(params["w"]))
  # A pmap-stacked state has a leading replica axis: the read-outs give one
  # value per replica, and one replica reads as a scalar.
  assert ols.skip_stats(state).total_skipped.tolist() == [2] * N
  one = jax.tree.map(lambda a: a[0], state)
  assert int(ols.skip_stats(one).total_skipped) == 2


def test_pmap_without_axis_name_replicas_diverge():
  """The failure axis_name prevents: only the poisoned replica skips."""
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), initial_scale=2.0**10)
  params, state = _replicate(_params()), _replicate(tx.init(_params()))
  # Replica-local batch shared by all replicas except the NaN: identical
  # gradients everywhere else, so a divergence is due to the skip alone.
  x = jnp.broadcast_to(_batch()[0], (N, 2, 3))
  x = x.at[3, 0, 0].set(jnp.nan)
  p1, s1 = _pmap_step(tx, average_grads=False)(params, state, x)
  assert not _same_across_replicas(p1)  # diverged
  np.testing.assert_array_equal(p1["w"][3], params["w"][3])  # skipped
  assert not np.array_equal(p1["w"][0], params["w"][0])  # applied
  scales = np.asarray(s1.loss_scale_state.loss_scale)
  assert scales[3] == 2.0**9 and scales[0] == 2.0**10  # scales differ


def _shard_map_step(tx, mesh, average_grads):
  def local(params, opt_state, x):
    p = jax.tree.map(lambda a: a[0], params)
    grads = jax.grad(lambda p: ols.scale_loss(_loss(p, x[0]), opt_state))(p)
    if average_grads:
      grads = jax.lax.pmean(grads, "d")
    updates, opt_state = tx.update(grads, opt_state, p)
    p = optax.apply_updates(p, updates)
    return jax.tree.map(lambda a: a[None], p), opt_state

  # Params carry a per-device leading axis so that divergence is visible;
  # the optimizer state is replicated (P()), which is only correct when the
  # flag is reduced: check_vma=False lets us also show the wrong case.
  f = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(P("d"), P(), P("d")),
      out_specs=(P("d"), P()),
      check_vma=False,
    )
  )
  shard = NamedSharding(mesh, P("d"))
  rep = NamedSharding(mesh, P())
  return lambda p, s, x: f(
    jax.device_put(p, shard), jax.device_put(s, rep), jax.device_put(x, shard)
  )


def _shard_map_start(average_grads):
  """`(step, params, state)`: `_shard_map_step` of adam from `2**10` with
  `axis_name`, the parameters on every device, and the initial state."""
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), initial_scale=2.0**10, axis_name="d"
  )
  step = _shard_map_step(tx, _mesh("d"), average_grads)
  return step, _replicate(_params()), tx.init(_params())


def test_shard_map_axis_name_every_shard_skips():
  step, params, state = _shard_map_start(average_grads=False)
  p1, s1 = step(params, state, _batch())
  assert not np.array_equal(p1["w"], params["w"])
  p2, s2 = step(p1, s1, _batch(poison_replica=6))
  assert_trees_equal(p2, p1, bitwise=False)
  assert float(ols.loss_scale(s2)) == 2.0**9
  assert int(ols.skip_stats(s2).total_skipped) == 1


def test_shard_map_averaged_grads_params_identical():
  step, params, state = _shard_map_start(average_grads=True)
  for poison in (None, 2, None):
    params, state = step(params, state, _batch(poison))
    assert _same_across_replicas(params)
  assert int(ols.skip_stats(state).total_skipped) == 1


def test_shard_map_without_axis_name_shards_diverge():
  mesh = _mesh("d")
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), initial_scale=2.0**10)

  def local(params, opt_state, x):
    p = jax.tree.map(lambda a: a[0], params)
    s = jax.tree.map(lambda a: a[0], opt_state)
    grads = jax.grad(lambda p: ols.scale_loss(_loss(p, x[0]), s))(p)
    updates, s = tx.update(grads, s, p)
    p = optax.apply_updates(p, updates)
    return jax.tree.map(lambda a: a[None], (p, s))

  f = jax.jit(
    jax.shard_map(
      local, mesh=mesh, in_specs=(P("d"), P("d"), P("d")), out_specs=P("d")
    )
  )

  def step(*a):
    return f(*jax.device_put(a, NamedSharding(mesh, P("d"))))

  x = jnp.broadcast_to(_batch()[0], (N, 2, 3)).at[6, 0, 0].set(jnp.nan)
  params = _replicate(_params())
  p1, s1 = step(params, _replicate(tx.init(_params())), x)
  assert not _same_across_replicas(p1)
  np.testing.assert_array_equal(p1["w"][6], params["w"][6])
  scales = np.asarray(s1.loss_scale_state.loss_scale)
  assert scales[6] == 2.0**9 and scales[0] == 2.0**10


def test_jit_named_sharding_data_parallel_global_skip():
  mesh = _mesh("data")
  rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), initial_scale=2.0**10
  )  # no axis_name
  params = jax.device_put(_params(), rep)
  state = jax.device_put(tx.init(_params()), rep)
  step = jax.jit(loss_step(tx, _loss))

  def xs(poison):
    return jax.device_put(_batch(poison).reshape(N * 2, 3), data)

  p1, s1 = step(params, state, xs(None))
  p2, s2 = step(p1, s1, xs(4))  # NaN lives in one shard only
  assert_trees_equal(p2, p1, bitwise=False)
  for a in jax.tree.leaves(p2):
    assert a.sharding.is_fully_replicated
    # every device's copy equals the others
    shards = [np.asarray(s.data) for s in a.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards)
  assert float(ols.loss_scale(s2)) == 2.0**9
  assert not bool(ols.skip_stats(s2).last_finite)


def test_jit_sharded_params_and_optimizer_state():
  mesh = _mesh("model")
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), initial_scale=2.0**10)
  w = jnp.linspace(0.0, 1.0, N * 4, dtype=jnp.float32)
  params = {"w": jax.device_put(w, NamedSharding(mesh, P("model")))}
  # Shard the inner state like the params; the scalars are replicated.
  state = jax.tree.map(
    lambda a: jax.device_put(
      a, NamedSharding(mesh, P("model") if a.ndim else P())
    ),
    tx.init(params),
  )
  assert state.inner_state[0].mu["w"].sharding.spec == P("model")

  def loss(p, x):
    return jnp.sum((p["w"] * x) ** 2)

  step = jax.jit(loss_step(tx, loss))

  x = jax.device_put(jnp.ones(N * 4), NamedSharding(mesh, P("model")))
  p1, s1 = step(params, state, x)
  assert not np.array_equal(p1["w"], params["w"])
  x_bad = jax.device_put(
    jnp.ones(N * 4).at[N * 4 - 1].set(jnp.inf), NamedSharding(mesh, P("model"))
  )  # last shard only
  p2, s2 = step(p1, s1, x_bad)
  np.testing.assert_array_equal(p2["w"], p1["w"])  # all shards skipped
  assert_trees_equal(s2.inner_state, s1.inner_state, bitwise=False)
  assert p2["w"].sharding.spec == P("model")
  assert s2.inner_state[0].mu["w"].sharding.spec == P("model")
  assert float(ols.loss_scale(s2)) == 2.0**9


def test_axis_name_under_plain_jit_is_an_error():
  """Under jit there is no bound axis: axis_name is for pmap/shard_map."""
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), axis_name="i")
  p = jnp.ones(2)
  with pytest.raises(NameError, match="unbound axis name"):
    jax.jit(tx.update)(p, tx.init(p), p)


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


_WORKER = os.path.join(os.path.dirname(__file__), "_multiprocess_worker.py")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  """Runs the two gloo workers once; their results, one dict per process."""
  tmp_path = tmp_path_factory.mktemp("two_processes")
  port = _free_port()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the worker sets its own device count
  env["PYTHONPATH"] = os.pathsep.join(
    [os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")]
  )
  outs = [tmp_path / f"out{i}.json" for i in range(2)]
  procs = [
    subprocess.Popen(
      [sys.executable, _WORKER, str(port), str(i), str(outs[i])],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      env=env,
    )
    for i in range(2)
  ]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=180)[0].decode(errors="replace"))
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail("multi-process workers timed out")
  for p, log in zip(procs, logs, strict=True):
    assert p.returncode == 0, log[-3000:]
  return [json.loads(o.read_text()) for o in outs]


@pytest.mark.slow
def test_two_processes_skip_together(two_processes):
  r0, r1 = two_processes
  for i, r in enumerate((r0, r1)):
    assert r["process_index"] == i
    assert r["process_count"] == 2 and r["device_count"] == 8
    assert r["local_device_count"] == 4
    for kind in ("jit", "shard_map"):
      assert r[kind]["scale2"] == 128.0  # backed off from 256 in both
    assert r["jit"]["step1_changed"] and r["jit"]["step2_unchanged"]
    assert not r["jit"]["last_finite2"]
    assert r["shard_map"]["step1_changed_all"]
    assert r["shard_map"]["step2_unchanged_all"]
  assert r0["jit"]["params2"] == r1["jit"]["params2"]
  assert r0["shard_map"]["params2"] == r1["shard_map"]["params2"]


def _worker_module():
  # Defines the FSDP problem; starts nothing.
  return load_file(_WORKER, "_multiprocess_worker")


@pytest.mark.slow
def test_two_processes_fsdp_explicit_mesh(two_processes):
  """FSDP on an Explicit mesh over both processes (4 devices each): params
  and adam state P('data', None), a NaN in one element of one gradient shard
  on process 1. Both processes skip, their scales agree, the outputs keep
  their shardings, and the result is the single-process one on 8 devices."""
  r0, r1 = (r["fsdp"] for r in two_processes)
  for r in (r0, r1):
    assert "error" not in r, r.get("error")
  # The NaN is in process 1's shards only: process 0's gradients are finite.
  assert r0["local_grads_finite_at_poison"] is True
  assert r1["local_grads_finite_at_poison"] is False
  for r in (r0, r1):
    assert r["step1_changed"] and r["step3_changed"]
    assert r["step2_params_unchanged"] and r["step2_inner_state_unchanged"]
    assert r["scales"] == [256.0, 128.0, 128.0]
    assert r["total_skipped"] == 1
    assert set(r["param_specs"].values()) == {str(P("data", None))}
    assert set(r["mu_specs"].values()) == {str(P("data", None))}
  assert r0["params3"] == r1["params3"] and r0["state3"] == r1["state3"]

  worker = _worker_module()
  single = worker.fsdp_run(worker.fsdp_mesh(), np.asarray)
  assert single["local_grads_finite_at_poison"] is False
  assert single["scales"] == r0["scales"]
  assert single["param_specs"] == r0["param_specs"]
  assert single["mu_specs"] == r0["mu_specs"]
  for key in ("params3", "state3"):
    assert len(single[key]) == len(r0[key])
    for a, b in zip(single[key], r0[key], strict=True):
      # Collectives over gloo sum in another order than in-process ones
      # (a few ulps apart after three steps); a step taken or skipped
      # differently would move params by about the learning rate, 1e-2.
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
