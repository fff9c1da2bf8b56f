"""Whether a gradient tree is finite, and how not: each leaf checked where
it lives, and only scalars (or, per leaf, one vector) cross devices.

The verdict is in the codes of `codes` (`FINITE`, `INF`, `NAN`, re-exported
here for the step); the reductions that read the leaves are in
`reductions`.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_lossscale._core import codes as _codes
from optax_lossscale._core import config as _config
from optax_lossscale._core import placement as _placement
from optax_lossscale._core import reductions as _reductions
from optax_lossscale._core.codes import CODE_DTYPE as CODE_DTYPE
from optax_lossscale._core.codes import FINITE as FINITE
from optax_lossscale._core.codes import INF as INF
from optax_lossscale._core.codes import NAN as NAN
from optax_lossscale._core.codes import code_of as code_of
from optax_lossscale._jaxpr import compat as _compat


class Verdict(NamedTuple):
  """The check of a tree, and whether each leaf was not finite when asked
  for."""

  finite: jax.Array  # bool[]: every element finite
  nan: jax.Array  # bool[]: some element NaN
  # bool[n], per leaf in `jax.tree.leaves` order: one vector from the check
  # to the counts, since a scalar per leaf made XLA compile a step of a
  # thousand leaves slowly (benchmarks/README.md, "`leaf_stats`: one vector
  # of counts").
  leaf_notfinite: jax.Array | None
  # Whether every leaf was checked where a NaN can be told from an inf: a
  # static fact of the program (False where some leaf lives on a mesh with
  # `Auto` axes, inside `shard_map` too, where a NaN counts as an inf).
  nan_told_apart: bool = True

  @property
  def code(self) -> jax.Array:
    return code_of(self.finite, self.nan)


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
  verdict = check(tree)
  # Both answers are used, so that XLA keeps each reduction of two operands
  # whole (a NaN is never finite: the second changes nothing).
  return verdict.finite & ~verdict.nan


def check(tree: Any, per_leaf: bool = False) -> Verdict:
  """The check of `tree` (the worst of its leaves), and with `per_leaf`
  whether each leaf was not finite (False for leaves that cannot hold a
  non-finite value)."""
  leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
  # Integer and boolean leaves are always finite; empty ones hold nothing.
  checked = [
    i
    for i, x in enumerate(leaves)
    if jnp.issubdtype(x.dtype, jnp.inexact) and x.size
  ]
  if not checked:
    never = jnp.zeros([len(leaves)], jnp.bool_)
    return Verdict(
      jnp.ones([], jnp.bool_),
      jnp.zeros([], jnp.bool_),
      never if per_leaf else None,
    )
  local, explicit, auto = _by_placement(checked, leaves)
  # On a mesh each leaf is checked where it lives, and only scalars cross
  # devices: combining leaves sharded differently (a concatenation, an
  # element-wise max) would make XLA gather or reshard the gradients.
  parts: list[tuple[list[int], Verdict]] = []
  if local:
    parts.append((local, _check_here([leaves[i] for i in local], per_leaf)))
  for mesh, group in explicit.items():
    parts.append(
      (group, _check_on_mesh(mesh, [leaves[i] for i in group], per_leaf))
    )
  for i in auto:
    finite, nan = _reduced_where_it_lives(leaves[i])
    notfinite = (~finite)[None] if per_leaf else None
    parts.append(([i], Verdict(finite, nan, notfinite)))
  # Booleans, not codes, are combined: XLA copies this small computation
  # into every select that reads the flag, so it is kept to one op a part.
  finite, nan = parts[0][1].finite, parts[0][1].nan
  for _, verdict in parts[1:]:
    finite, nan = finite & verdict.finite, nan | verdict.nan
  told = not auto
  if not per_leaf:
    return Verdict(finite, nan, None, told)
  pieces = [verdict.leaf_notfinite for _, verdict in parts]
  order = [i for indices, _ in parts for i in indices]
  unchecked = sorted(set(range(len(leaves))) - set(checked))
  if unchecked:
    pieces.append(jnp.zeros([len(unchecked)], jnp.bool_))
    order += unchecked
  leaf_notfinite = _reductions.in_leaf_order(pieces, order)
  return Verdict(finite, nan, leaf_notfinite, told)


def _by_placement(
  checked: list[int], leaves: list[jax.Array]
) -> tuple[list[int], dict[Any, list[int]], list[int]]:
  """Splits the `checked` leaves (by index) by where they live, as their
  types say.

  Returns `(local, explicit, auto)`: leaves on one device or inside
  `shard_map` (whole where they are checked); leaves sharded over an
  `Explicit` mesh, by mesh (their specs are known while tracing); and
  leaves on a mesh with `Auto` axes, whose sharding XLA picks later.
  """
  local: list[int] = []
  explicit: dict[Any, list[int]] = {}
  auto: list[int] = []
  for i in checked:
    mesh = _placement.mesh_of(leaves[i])
    if _placement.on_one_device(mesh):
      local.append(i)
    elif _placement.all_axes_are(mesh, "Explicit"):
      explicit.setdefault(mesh, []).append(i)
    else:
      auto.append(i)
  return local, explicit, auto


def _check_here(leaves: list[jax.Array], per_leaf: bool) -> Verdict:
  """The check of leaves that live whole on one device (or are one shard)."""
  if per_leaf:
    codes = _reductions.leaf_codes(leaves)
    finite, nan = _reductions.every_and_some(
      codes == FINITE, codes == NAN, (0,)
    )
    return Verdict(finite, nan, codes != FINITE)
  return Verdict(*_reductions.whole_tree(leaves), None)


def _check_on_mesh(
  mesh: Any, leaves: list[jax.Array], per_leaf: bool
) -> Verdict:
  """Each device checks its own shards; the codes are reduced over the mesh.

  Inside `shard_map` every leaf is a local block, so the single-device
  check applies as it is (concatenations included), and the only traffic
  is one int32 vector per device (a scalar, unless per leaf), over the axes
  that some leaf is sharded on (the codes are the same along the others;
  newer jax refuses a reduction over an axis along which a value does not
  vary).
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
    # A scalar crosses devices, or with `per_leaf` one vector of codes.
    if per_leaf:
      codes = _reductions.leaf_codes(list(shards))
    else:
      codes = _check_here(list(shards), per_leaf).code
    return lax.pmax(codes, axes) if axes else codes

  out_spec = jax.sharding.PartitionSpec()
  codes = _compat.shard_map(check_shards, mesh, specs, out_spec)(*leaves)
  leaf_notfinite = codes != FINITE if per_leaf else None
  return Verdict(*_codes.flags_of(codes), leaf_notfinite)


def _reduced_where_it_lives(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of one leaf whose sharding XLA picks later; `nan` is
  False there (an unknown NaN counts as an overflow).

  `sum(x - x)` is 0 for finite `x` and NaN otherwise, exactly. XLA's SPMD
  partitioner splits this one-operand sum into one sum per shard and an
  all-reduce of a scalar; a two-operand reduction (`every_and_some`) it
  gathers first. The difference, unlike `x * 0`, needs no broadcast zeros,
  which XLA on CPU materialized. Telling a NaN from an inf here costs more
  than it is worth: a select in front of the sum (`|x|` where `x` is not
  finite) made XLA on CPU materialize the leaf, and a second reduction (a
  max) added an all-reduce per leaf and, on CPU, dropped the NaN.
  """
  if not _codes.has_magnitude(x.dtype):  # complex and float8
    return _codes.unmasked_flags(x)
  zeros = lax.sub(x, x)
  total = lax.reduce_sum(zeros, tuple(range(x.ndim)))
  return lax.is_finite(total), jnp.zeros([], jnp.bool_)


def reduce_across(codes: jax.Array, axis_name: _config.AxisName) -> jax.Array:
  """Reduces codes over `axis_name`, so that every replica agrees: one
  int32 vector per replica crosses the interconnect, not the gradients."""
  if axis_name is None:
    return codes
  return lax.pmax(codes, axis_name)
