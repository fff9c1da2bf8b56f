"""One boolean for a whole gradient tree."""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale import _compat, _config, _placement


def all_finite(tree: Any) -> jax.Array:
  """Returns a boolean scalar: whether every element of every leaf is finite.

  ``None`` leaves and empty subtrees (such as ``optax.MaskedNode``) are
  ignored; integer and boolean leaves are always finite.

  Args:
    tree: a pytree of arrays.

  Returns:
    A ``bool[]`` array, ``True`` for an empty tree.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> ols.all_finite({'w': jnp.ones(3), 'b': jnp.array([1.0, jnp.inf])})
    Array(False, dtype=bool)
    >>> ols.all_finite({'w': jnp.ones(3), 'b': None})
    Array(True, dtype=bool)
  """
  leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
  # Integer and boolean leaves are always finite; empty ones hold nothing.
  leaves = [
    x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact) and x.size
  ]
  if not leaves:
    return jnp.ones([], jnp.bool_)
  local, explicit, auto = _by_placement(leaves)
  flags = [_all_finite_here(*local)] if local else []
  # On a mesh the flag is reduced where each leaf lives, and only scalars
  # cross devices: combining leaves sharded differently (a concatenation, an
  # element-wise max) would make XLA gather or reshard the gradients.
  flags += [
    _all_finite_on_mesh(mesh, group) for mesh, group in explicit.items()
  ]
  flags += [_reduced_where_it_lives(x) for x in auto]
  return flags[0] if len(flags) == 1 else jnp.all(jnp.stack(flags))


def _all_finite_here(*leaves: jax.Array) -> jax.Array:
  """The check of leaves that live whole on one device (or are one shard)."""
  # Two formulations of one exact check, chosen when the step is lowered
  # (no branch at run time). On CPU (`_on_cpu`): large leaves of one shape
  # read together, a few reductions in all, small leaves concatenated.
  # Elsewhere (`_concatenated`): one reduction per group of leaves
  # concatenated, which XLA fuses into one kernel per group, where one
  # reduction per leaf costs two kernel launches per leaf. On CPU,
  # concatenating large leaves is materialized.
  return lax.platform_dependent(*leaves, cpu=_on_cpu, default=_concatenated)


def _by_placement(
  leaves: list[jax.Array],
) -> tuple[list[jax.Array], dict[Any, list[jax.Array]], list[jax.Array]]:
  """Splits the leaves by where they live, as their types say.

  Returns `(local, explicit, auto)`: leaves on one device or inside
  `shard_map` (whole where they are checked); leaves sharded over an
  `Explicit` mesh, by mesh (their specs are known while tracing); and
  leaves on a mesh with `Auto` axes, whose sharding XLA picks later.
  """
  local: list[jax.Array] = []
  explicit: dict[Any, list[jax.Array]] = {}
  auto: list[jax.Array] = []
  for x in leaves:
    mesh = _placement.mesh_of(x)
    if _placement.on_one_device(mesh):
      local.append(x)
    elif _placement.all_axes_are(mesh, "Explicit"):
      explicit.setdefault(mesh, []).append(x)
    else:
      auto.append(x)
  return local, explicit, auto


def _all_finite_on_mesh(mesh: Any, leaves: list[jax.Array]) -> jax.Array:
  """Each device checks its own shards; one boolean is reduced over the mesh.

  Inside `shard_map` every leaf is a local block, so the single-device
  check applies as it is (concatenations included), and the only traffic
  is one int32 scalar per device, over the axes that some leaf is sharded
  on (the flag is the same along the others; newer jax refuses a reduction
  over an axis along which a value does not vary).
  """
  specs = tuple(jax.typeof(x).sharding.spec for x in leaves)
  sharded_on = {
    axis
    for spec in specs
    for entry in spec
    for axis in (entry if isinstance(entry, tuple) else (entry,))
    if axis is not None
  }
  axes = tuple(a for a in mesh.axis_names if a in sharded_on)

  def check_shards(*shards: jax.Array) -> jax.Array:
    finite = _all_finite_here(*shards)
    if not axes:
      return finite
    return lax.pmin(finite.astype(jnp.int32), axes).astype(jnp.bool_)

  out_spec = jax.sharding.PartitionSpec()
  return _compat.shard_map(check_shards, mesh, specs, out_spec)(*leaves)


def _reduced_where_it_lives(x: jax.Array) -> jax.Array:
  """Whether one leaf, whose sharding XLA picks later, is finite.

  `sum(x - x)` is 0 for finite `x` and NaN otherwise, exactly. XLA's SPMD
  partitioner splits this one-operand sum into one sum per shard and an
  all-reduce of a scalar; a two-operand reduction (`_one_pass`) it gathers
  first. The difference, unlike `x * 0`, needs no broadcast zeros, which
  XLA on CPU materialized.
  """
  if x.dtype not in _EXPONENT_MASKS:  # complex and float8
    return jnp.all(jnp.isfinite(x))
  zeros = lax.sub(x, x)
  return lax.is_finite(lax.reduce_sum(zeros, tuple(range(x.ndim))))


def _on_cpu(*leaves: jax.Array) -> jax.Array:
  # Each reduction is a kernel of its own, and XLA on CPU compiles a
  # reduction kernel slowly: leaves of one shape are read together.
  small = [x for x in leaves if x.size < _CONCATENATE_BELOW]
  large = [x for x in leaves if x.size >= _CONCATENATE_BELOW]
  flags = [_one_pass(group) for group in _groups_of_one_shape(large)]
  flags += [
    _one_pass([jnp.concatenate(flat)]) for flat in _raveled_by_dtype(small)
  ]
  return jnp.all(jnp.stack(flags))


def _raveled_by_dtype(
  leaves: Sequence[jax.Array],
) -> list[list[jax.Array]]:
  """The leaves raveled, one list per dtype (a concatenation needs one)."""
  return [
    [x.ravel() for x in leaves if x.dtype == dtype]
    for dtype in sorted({x.dtype for x in leaves}, key=str)
  ]


# Leaves under this many elements are checked together, concatenated (a
# small copy): many small reductions compile and run slower on CPU than one
# (benchmarks/README.md). Larger leaves are not copied.
_CONCATENATE_BELOW = 2**12


def _groups_of_one_shape(leaves: list[jax.Array]) -> list[list[jax.Array]]:
  """The leaves in groups of one shape and dtype, each group one reduction.

  A group holds up to `_ELEMENTS_PER_GROUP` elements (at least one leaf, at
  most `_MAX_GROUP`). Leaves without an exponent mask (complex, float8) stay
  alone.
  """
  by_kind: dict[Any, list[jax.Array]] = {}
  for i, x in enumerate(leaves):
    # By position, not `id(x)`: one array may be passed twice.
    kind = (x.shape, x.dtype) if x.dtype in _EXPONENT_MASKS else i
    by_kind.setdefault(kind, []).append(x)
  groups = []
  for same in by_kind.values():
    per_group = min(max(1, _ELEMENTS_PER_GROUP // same[0].size), _MAX_GROUP)
    count = -(-len(same) // per_group)
    groups += [same[i::count] for i in range(count)]  # near-equal sizes
  return groups


# Grouped: XLA on CPU compiles each reduction kernel on its own, and slowly,
# so one reduction per leaf compiles slowly at many leaves. Larger leaves
# stay alone: their reductions run in parallel on XLA's thread pool
# (benchmarks/README.md).
_ELEMENTS_PER_GROUP = 2**20
_MAX_GROUP = 64

# The bits of the exponent, by dtype, as the unsigned integer of that width.
# The exponent is all ones exactly for infinities and NaNs (IEEE 754).
_EXPONENT_MASKS: dict[np.dtype, np.unsignedinteger] = {
  jnp.dtype(jnp.float16): np.uint16(0x7C00),
  jnp.dtype(jnp.bfloat16): np.uint16(0x7F80),
  jnp.dtype(jnp.float32): np.uint32(0x7F80_0000),
  jnp.dtype(jnp.float64): np.uint64(0x7FF0_0000_0000_0000),
}


def _one_pass(leaves: Sequence[jax.Array]) -> jax.Array:
  """Whether every element of `leaves` (of one shape and dtype) is finite."""
  mask = _EXPONENT_MASKS.get(leaves[0].dtype)
  if mask is None:  # complex or float8 (in whose e4m3fn NaN is not all ones)
    (leaf,) = leaves
    finite = jnp.isfinite(leaf)
  else:
    # The largest exponent over the leaves is all ones exactly where one of
    # them is not finite. Integer arithmetic: no conversion of float16
    # (which slowed an `x * 0` sum on float16 leaves), and no float max
    # (XLA's vectorized float max on CPU drops NaNs in large arrays).
    exponent = _exponent(leaves[0], mask)
    for x in leaves[1:]:
      exponent = lax.max(exponent, _exponent(x, mask))
    finite = lax.ne(exponent, mask)  # scalars broadcast
  # A reduction of two operands at once. XLA on CPU splits a one-operand
  # reduction into a tree of reduce-windows and materializes its input (a
  # byte per element) in front of it, through a transposing copy when the
  # gradient is a transposed matmul output; it leaves a reduction of two
  # operands whole, with its input fused in: one pass over the leaves, no
  # temporary. The second operand (is any element not finite?) keeps the
  # reduction variadic; both answers agree, and both are used so that XLA
  # keeps both.
  all_finite, any_not_finite = lax.reduce(
    (finite, ~finite),
    (np.bool_(True), np.bool_(False)),
    _and_or,
    tuple(range(finite.ndim)),
  )
  return all_finite & ~any_not_finite


def _exponent(x: jax.Array, mask: np.unsignedinteger) -> jax.Array:
  return lax.bitwise_and(lax.bitcast_convert_type(x, mask.dtype), mask)


def _and_or(
  a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  return a[0] & b[0], a[1] | b[1]


# Leaves per concatenation: at 1,000 leaves in one concatenation XLA on GPU
# materialized it (a gradient-sized temporary); groups of this size fuse.
_LEAVES_PER_CONCATENATION = 64


def _concatenated(*leaves: jax.Array) -> jax.Array:
  flags = []
  for flat in _raveled_by_dtype(leaves):
    for start in range(0, len(flat), _LEAVES_PER_CONCATENATION):
      group = flat[start : start + _LEAVES_PER_CONCATENATION]
      flags.append(jnp.all(jnp.isfinite(jnp.concatenate(group))))
  return jnp.all(jnp.stack(flags))


def all_finite_across(
  finite: jax.Array, axis_name: _config.AxisName
) -> jax.Array:
  """Reduces one boolean over `axis_name`, so that every replica agrees."""
  if axis_name is None:
    return finite
  # One int32 scalar per replica crosses the interconnect, not the gradients.
  return lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
