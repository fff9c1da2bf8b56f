"""Worker for tests/test_distributed.py: one of two JAX processes on this
machine, 4 CPU devices each, CPU collectives over gloo.

Usage: python _multiprocess_worker.py PORT PROCESS_ID OUT_JSON

Runs a loss-scaled training step over a global 8-device mesh spanning both
processes, with a non-finite gradient produced only in process 1, and writes
what it saw to OUT_JSON.
"""

import json
import sys

import jax

port, process_id, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=60,
)

import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import optax_lossscale as ols  # noqa: E402

result = {
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
    "device_count": jax.device_count(),
    "local_device_count": jax.local_device_count(),
}

mesh = jax.make_mesh((8,), ("data",), devices=jax.devices())
replicated = NamedSharding(mesh, P())
batch_sharding = NamedSharding(mesh, P("data"))


def global_batch(poison_process):
  """8 rows, one per device; row values differ; NaN rows on one process."""
  local = np.arange(4, dtype=np.float32)[:, None] + 4 * process_id + 1.0
  local = np.broadcast_to(local, (4, 3)).copy()
  if poison_process == process_id:
    local[1, 0] = np.nan
  return jax.make_array_from_process_local_data(batch_sharding, local, (8, 3))


def loss_fn(params, x):
  return jnp.mean((x @ params["w"] - 1.0) ** 2)


# ---- 1. jit with NamedSharding: the decision is global, no axis_name. ----
tx = ols.loss_scale_optimizer(optax.sgd(0.01), initial_scale=2.0**8)
params = jax.device_put({"w": jnp.ones((3,), jnp.float32) * 0.1}, replicated)
opt_state = jax.device_put(tx.init(params), replicated)


@jax.jit
def step(params, opt_state, x):
  loss, grads = ols.value_and_grad(loss_fn)(opt_state, params, x)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def fetch(x):
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


params1, state1 = step(params, opt_state, global_batch(poison_process=None))
params2, state2 = step(params1, state1, global_batch(poison_process=1))
result["jit"] = {
    "step1_changed": bool(np.any(fetch(params1["w"]) != fetch(params["w"]))),
    "step2_unchanged": bool(np.array_equal(fetch(params2["w"]),
                                           fetch(params1["w"]))),
    "params2": fetch(params2["w"]).tolist(),
    "scale1": float(fetch(ols.loss_scale(state1))),
    "scale2": float(fetch(ols.loss_scale(state2))),
    "last_finite2": bool(fetch(ols.skip_stats(state2).last_finite)),
}

# ---- 2. shard_map with axis_name, per-device gradients not averaged: only
# the reduced finite flag couples the devices. ----
tx_sm = ols.loss_scale_optimizer(optax.sgd(0.01), initial_scale=2.0**8,
                                 axis_name="data")


def local_step(params, opt_state, x):
  # params arrive with a leading per-device axis of 1 (out_specs P('data')).
  p = jax.tree.map(lambda a: a[0], params)
  grads = jax.grad(lambda p: ols.scale_loss(loss_fn(p, x), opt_state))(p)
  updates, opt_state = tx_sm.update(grads, opt_state, p)
  p = optax.apply_updates(p, updates)
  return jax.tree.map(lambda a: a[None], p), opt_state


sm_step = jax.jit(jax.shard_map(
    local_step, mesh=mesh, in_specs=(P("data"), P(), P("data")),
    out_specs=(P("data"), P()), check_vma=False))

per_dev = jax.device_put({"w": jnp.ones((8, 3), jnp.float32) * 0.1},
                         batch_sharding)
sm_state = jax.device_put(tx_sm.init({"w": jnp.ones((3,))}), replicated)
p1, s1 = sm_step(per_dev, sm_state, global_batch(poison_process=None))
p2, s2 = sm_step(p1, s1, global_batch(poison_process=1))
w0, w1, w2 = fetch(per_dev["w"]), fetch(p1["w"]), fetch(p2["w"])
result["shard_map"] = {
    "step1_changed_all": bool(np.all(np.any(w1 != w0, axis=1))),
    "step2_unchanged_all": bool(np.array_equal(w2, w1)),
    "params2": w2.tolist(),
    "scale2": float(fetch(ols.loss_scale(s2))),
}

with open(out_path, "w") as f:
  json.dump(result, f)
jax.distributed.shutdown()
