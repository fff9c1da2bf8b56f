"""A real float16 training process for tests/test_resume_kill.py.

Usage:
  python tests/_resume_worker.py CKPT_DIR OUT_NPZ --steps N --every K
      [--marker PATH --marker-step S --slow SECONDS] [--nan-from A --nan-to B]

It trains a small MLP (float32 master weights, float16 forward and backward,
scaled loss) with `loss_scale_optimizer(adam)`, checkpoints the whole state
with orbax every `--every` steps, resumes from the latest checkpoint in
`CKPT_DIR` if there is one, and at the end writes every leaf of the final
state to `OUT_NPZ` (keyed by its pytree path).

Everything a step depends on is a function of the step number (the batch is
drawn from `fold_in(key, step)`; steps `--nan-from <= step < --nan-to` get a
NaN in one gradient leaf), so a resumed run must reproduce an uninterrupted
one bit for bit.

With `--marker`, after the checkpoint of step `--marker-step` is committed
the worker writes the marker file and then sleeps `--slow` seconds per step,
so that the test can SIGKILL it mid-run, at a known place, after a
checkpoint exists.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_lossscale as ols

CONFIG = dict(
  initial_scale=2.0**10,
  dynamic_growth_steps=3,
  hysteresis=2,
  growth_factor=4.0,
  backoff_factor=0.25,
  min_scale=2.0,
  max_scale=2.0**12,
)


def init_state():
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {
    "w1": jax.random.normal(k1, (8, 16), jnp.float32) * 0.3,
    "b1": jnp.zeros((16,), jnp.float32),
    "w2": jax.random.normal(k2, (16, 1), jnp.float32) * 0.3,
  }
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), **CONFIG)
  return tx, {
    "params": params,
    "opt_state": tx.init(params),
    "step": jnp.zeros([], jnp.int32),
  }


def make_train_step(tx, nan_from, nan_to):
  def loss_fn(params16, x, y):
    h = jnp.tanh(x @ params16["w1"] + params16["b1"])
    return jnp.mean((h @ params16["w2"] - y) ** 2)

  @jax.jit
  def train_step(state):
    step = state["step"]
    key = jax.random.fold_in(jax.random.key(1), step)
    x = jax.random.normal(key, (32, 8), jnp.float16)
    y = jnp.sum(x, axis=1, keepdims=True) * 0.1
    params16 = jax.tree.map(lambda p: p.astype(jnp.float16), state["params"])
    grads16 = jax.grad(
      lambda p: ols.scale_loss(loss_fn(p, x, y), state["opt_state"])
    )(params16)
    inject = (step >= nan_from) & (step < nan_to)
    grads16["b1"] = (
      grads16["b1"]
      .at[3]
      .set(jnp.where(inject, jnp.float16(jnp.nan), grads16["b1"][3]))
    )
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads16)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {
      "params": optax.apply_updates(state["params"], updates),
      "opt_state": opt_state,
      "step": step + 1,
    }

  return train_step


def flatten(tree):
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out[jax.tree_util.keystr(path)] = np.asarray(leaf)
  return out


def main(argv):
  ap = argparse.ArgumentParser()
  ap.add_argument("ckpt_dir")
  ap.add_argument("out_npz")
  ap.add_argument("--steps", type=int, required=True)
  ap.add_argument("--every", type=int, required=True)
  ap.add_argument("--marker")
  ap.add_argument("--marker-step", type=int, default=-1)
  ap.add_argument("--slow", type=float, default=0.0)
  ap.add_argument("--nan-from", type=int, default=-1)
  ap.add_argument("--nan-to", type=int, default=-1)
  args = ap.parse_args(argv)

  tx, state = init_state()
  manager = ocp.CheckpointManager(
    os.path.abspath(args.ckpt_dir),
    options=ocp.CheckpointManagerOptions(max_to_keep=3),
  )
  latest = manager.latest_step()
  if latest is not None:
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    state = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
    print(f"resumed from step {latest}", flush=True)
  train_step = make_train_step(tx, args.nan_from, args.nan_to)

  slow = False
  while int(state["step"]) < args.steps:
    state = train_step(state)
    step = int(state["step"])
    if step % args.every == 0:
      manager.save(step, args=ocp.args.StandardSave(state))
      manager.wait_until_finished()
      if args.marker and step == args.marker_step:
        with open(args.marker, "w") as f:
          f.write(str(step))
        slow = True
    if slow:
      time.sleep(args.slow)
  manager.wait_until_finished()
  manager.close()
  np.savez(args.out_npz, **flatten(state))
  print("done", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
