"""Meshes of the 8 CPU devices (tests/conftest.py) and trees sharded on
them, shared by the tests of the step on meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# name -> (shape, axis names)
MESHES = {
  "1d": ((8,), ("data",)),
  "2d": ((4, 2), ("data", "model")),
}


def make_mesh(name, axis_type):
  """The mesh `name` of `MESHES`, every axis of `axis_type`."""
  shape, axes = MESHES[name]
  return jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes))


# A tree for the "2d" mesh: leaves sharded on either axis, on both, and
# replicated.
SPECS = {
  "w1": P("data", None),
  "w2": P(None, "model"),
  "w3": P("data", "model"),
  "b": P(),
}


def tree_on(mesh, scale=1.0):
  """`SPECS`' tree on `mesh`: 64x64 leaves (a vector of 64 for `b`), each
  of distinct finite values, times `scale`."""
  return {
    name: jax.device_put(
      scale * jnp.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64) * (i + 1)
      if name != "b"
      else jnp.ones(64) * scale,
      NamedSharding(mesh, spec),
    )
    for i, (name, spec) in enumerate(SPECS.items())
  }


def poisoned(tree, name, index, value):
  """`tree` with `tree[name][index]` set to `value`, sharded as it was."""
  host = np.array(tree[name])
  host[index] = value
  return {**tree, name: jax.device_put(host, tree[name].sharding)}


def step_of(tx):
  """`step(params, state, grads, loss)`: `tx`'s update given the loss as
  `value`, applied, under `jit`."""

  def step(params, state, grads, loss):
    updates, state = tx.update(grads, state, params, value=loss)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)
