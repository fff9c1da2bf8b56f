"""Where an array lives, as its type says: on one device, or on a mesh
whose axes are `Explicit` (the sharding is known while tracing), `Auto`
(XLA picks it later) or `Manual` (inside `shard_map`)."""

import math
from typing import Any

import jax


def mesh_of(x: Any) -> Any:
  """The (abstract) mesh in `x`'s type, or None."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  return getattr(sharding, "mesh", None)


def on_one_device(mesh: Any) -> bool:
  """Whether an array of this mesh is whole where it is computed on."""
  return (
    mesh is None
    or not mesh.axis_names
    or math.prod(mesh.axis_sizes) == 1
    or all_axes_are(mesh, "Manual")
  )


def all_axes_are(mesh: Any, kind: str) -> bool:
  """Whether every axis of `mesh` is of `kind` ("Explicit", "Auto", ...)."""
  types = getattr(mesh, "axis_types", None) or ()
  return bool(types) and all(getattr(t, "name", str(t)) == kind for t in types)


def any_axis_is(mesh: Any, kind: str) -> bool:
  """Whether some axis of `mesh` (None: no mesh) is of `kind`."""
  types = getattr(mesh, "axis_types", None) or ()
  return any(getattr(t, "name", str(t)) == kind for t in types)
