"""Worker for tests/test_distributed.py: one of two JAX processes on this
machine, 4 CPU devices each, CPU collectives over gloo.

Usage: python _multiprocess_worker.py PORT PROCESS_ID OUT_JSON

Runs loss-scaled training steps over a global 8-device mesh spanning both
processes, with a non-finite gradient produced only in process 1, and writes
what it saw to OUT_JSON:

- `jit`: replicated params, the batch sharded;
- `shard_map`: per-device gradients, the flag reduced over `axis_name`;
- `fsdp`: an FSDP step on an `Explicit` mesh (params and adam state
  `P("data", None)`, gathered for the matmuls by `reshard`), defined by
  `fsdp_run`, which the test also runs in one process on 8 devices to compare.

Importing this module defines the FSDP problem and starts nothing.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

# ---- The FSDP problem, shared with the single-process reference. ----

FSDP_SPEC = P("data", None)
FSDP_INITIAL_SCALE = 2.0**8
# The element of the poisoned step's `noise` (shaped and sharded like w1)
# that is NaN: in the last row block, which lives on process 1.
FSDP_POISON = (15, 3)


def fsdp_mesh():
  return jax.make_mesh(
    (8,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()
  )


def _put(mesh, tree):
  """Global numpy arrays as global jax arrays sharded `FSDP_SPEC`, each
  process filling its own shards (works in one process or several)."""
  sharding = NamedSharding(mesh, FSDP_SPEC)
  return jax.tree.map(
    lambda a: jax.make_array_from_callback(
      a.shape, sharding, lambda idx: a[idx]
    ),
    tree,
  )


def fsdp_loss(params, batch):
  # FSDP: each weight is gathered where it is used; its gradient goes back
  # sharded. The noise term puts one NaN in one element of w1's gradient
  # when the batch carries one, leaving every other element finite.
  w1 = jax.sharding.reshard(params["w1"], P())
  w2 = jax.sharding.reshard(params["w2"], P())
  y = jnp.tanh(batch["x"] @ w1) @ w2
  return jnp.mean((y - batch["y"]) ** 2) + 1e-3 * jnp.mean(
    params["w1"] * batch["noise"]
  )


def _fsdp_data(step, poison):
  rng = np.random.default_rng(100 + step)
  noise = np.zeros((16, 32), np.float32)
  if poison:
    noise[FSDP_POISON] = np.nan
  return {
    "x": rng.normal(size=(16, 16)).astype(np.float32),
    "y": rng.normal(size=(16, 8)).astype(np.float32),
    "noise": noise,
  }


def fsdp_run(mesh, fetch):
  """Three loss-scaled adam steps (finite, NaN in one element of w1's
  gradient, finite) on `mesh`; every array read back with `fetch` (global
  numpy). Returns a JSON-able dict."""
  rng = np.random.default_rng(0)
  init = {
    "w1": 0.1 * rng.normal(size=(16, 32)).astype(np.float32),
    "w2": 0.1 * rng.normal(size=(32, 8)).astype(np.float32),
  }
  tx = ols.loss_scale_optimizer(
    optax.adam(1e-2), initial_scale=FSDP_INITIAL_SCALE
  )

  @jax.jit
  def step(params, opt_state, batch):
    _, grads = ols.value_and_grad(fsdp_loss)(opt_state, params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def to_list(tree):
    return [fetch(a).tolist() for a in jax.tree.leaves(tree)]

  with (
    jax.sharding.use_mesh(mesh)
    if not hasattr(jax, "set_mesh")
    else jax.set_mesh(mesh)
  ):
    params = _put(mesh, init)
    opt_state = jax.jit(tx.init)(params)
    history, local_finite = [params], None
    for i, poison in enumerate((False, True, False)):
      batch = _put(mesh, _fsdp_data(i, poison))
      if poison:
        # Which process's shards of the scaled gradient hold the NaN.
        grads = jax.jit(
          jax.grad(lambda p, b, s: ols.scale_loss(fsdp_loss(p, b), s))
        )(params, batch, opt_state)
        local_finite = all(
          bool(np.all(np.isfinite(np.asarray(shard.data))))
          for g in jax.tree.leaves(grads)
          for shard in g.addressable_shards
        )
      params, opt_state = step(params, opt_state, batch)
      history.append((params, opt_state))
    (p1, s1), (p2, s2), (p3, s3) = history[1:]
    mu = s3.inner_state[0].mu
    return {
      "local_grads_finite_at_poison": local_finite,
      "step1_changed": any(
        not np.array_equal(fetch(a), fetch(b))
        for a, b in zip(
          jax.tree.leaves(p1), jax.tree.leaves(history[0]), strict=True
        )
      ),
      "step2_params_unchanged": all(
        np.array_equal(fetch(a), fetch(b))
        for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p1), strict=True)
      ),
      "step2_inner_state_unchanged": all(
        np.array_equal(fetch(a), fetch(b))
        for a, b in zip(
          jax.tree.leaves(s2.inner_state),
          jax.tree.leaves(s1.inner_state),
          strict=True,
        )
      ),
      "step3_changed": any(
        not np.array_equal(fetch(a), fetch(b))
        for a, b in zip(jax.tree.leaves(p3), jax.tree.leaves(p2), strict=True)
      ),
      "scales": [float(fetch(ols.loss_scale(s))) for s in (s1, s2, s3)],
      "total_skipped": int(fetch(ols.skip_stats(s3).total_skipped)),
      "param_specs": {k: str(v.sharding.spec) for k, v in p3.items()},
      "mu_specs": {k: str(v.sharding.spec) for k, v in mu.items()},
      "params3": to_list(p3),
      "state3": to_list(s3),
    }


# ---- Two processes. ----


def main(port, process_id, out_path):
  jax.config.update("jax_num_cpu_devices", 4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=60,
  )

  def fetch(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  result = {
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
    "device_count": jax.device_count(),
    "local_device_count": jax.local_device_count(),
  }
  # Explicit: jax.make_mesh's default axis type.
  mesh = jax.make_mesh(
    (8,), ("data",), devices=jax.devices(), axis_types=(AxisType.Explicit,)
  )
  result["jit"] = _jit_run(mesh, process_id, fetch)
  result["shard_map"] = _shard_map_run(mesh, process_id, fetch)
  try:
    result["fsdp"] = fsdp_run(fsdp_mesh(), fetch)
  except Exception as e:
    # Reported, not raised: the other parts' results still come back.
    result["fsdp"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
  with open(out_path, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


def _global_batch(mesh, process_id, poison_process):
  """8 rows, one per device; row values differ; NaN rows on one process."""
  local = np.arange(4, dtype=np.float32)[:, None] + 4 * process_id + 1.0
  local = np.broadcast_to(local, (4, 3)).copy()
  if poison_process == process_id:
    local[1, 0] = np.nan
  return jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("data")), local, (8, 3)
  )


def _loss(params, x):
  return jnp.mean((x @ params["w"] - 1.0) ** 2)


def _jit_run(mesh, process_id, fetch):
  """jit with NamedSharding: the decision is global, no axis_name."""
  replicated = NamedSharding(mesh, P())
  tx = ols.loss_scale_optimizer(optax.sgd(0.01), initial_scale=2.0**8)
  params = jax.device_put({"w": jnp.ones((3,), jnp.float32) * 0.1}, replicated)
  opt_state = jax.device_put(tx.init(params), replicated)

  @jax.jit
  def step(params, opt_state, x):
    _, grads = ols.value_and_grad(_loss)(opt_state, params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params1, state1 = step(
    params, opt_state, _global_batch(mesh, process_id, None)
  )
  params2, state2 = step(params1, state1, _global_batch(mesh, process_id, 1))
  return {
    "step1_changed": bool(np.any(fetch(params1["w"]) != fetch(params["w"]))),
    "step2_unchanged": bool(
      np.array_equal(fetch(params2["w"]), fetch(params1["w"]))
    ),
    "params2": fetch(params2["w"]).tolist(),
    "scale1": float(fetch(ols.loss_scale(state1))),
    "scale2": float(fetch(ols.loss_scale(state2))),
    "last_finite2": bool(fetch(ols.skip_stats(state2).last_finite)),
  }


def _shard_map_run(mesh, process_id, fetch):
  """shard_map with axis_name, per-device gradients not averaged: only the
  reduced finite flag couples the devices."""
  tx = ols.loss_scale_optimizer(
    optax.sgd(0.01), initial_scale=2.0**8, axis_name="data"
  )

  def local_step(params, opt_state, x):
    # params arrive with a leading per-device axis of 1 (out_specs P('data')).
    p = jax.tree.map(lambda a: a[0], params)
    grads = jax.grad(lambda p: ols.scale_loss(_loss(p, x), opt_state))(p)
    updates, opt_state = tx.update(grads, opt_state, p)
    p = optax.apply_updates(p, updates)
    return jax.tree.map(lambda a: a[None], p), opt_state

  step = jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(P("data"), P(), P("data")),
      out_specs=(P("data"), P()),
      check_vma=False,
    )
  )

  per_dev = jax.device_put(
    {"w": jnp.ones((8, 3), jnp.float32) * 0.1}, NamedSharding(mesh, P("data"))
  )
  state = jax.device_put(
    tx.init({"w": jnp.ones((3,))}), NamedSharding(mesh, P())
  )
  p1, s1 = step(per_dev, state, _global_batch(mesh, process_id, None))
  p2, s2 = step(p1, s1, _global_batch(mesh, process_id, 1))
  w0, w1, w2 = fetch(per_dev["w"]), fetch(p1["w"]), fetch(p2["w"])
  return {
    "step1_changed_all": bool(np.all(np.any(w1 != w0, axis=1))),
    "step2_unchanged_all": bool(np.array_equal(w2, w1)),
    "params2": w2.tolist(),
    "scale2": float(fetch(ols.loss_scale(s2))),
  }


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
