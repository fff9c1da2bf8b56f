"""Whether a gradient tree is finite, and how not: one pass over the leaves.

The check gives a code per tree (and, asked for, per leaf): `FINITE` (0),
`INF` (1, an overflow to inf and no NaN) or `NAN` (2). The codes of several
trees, replicas or leaves combine by `max`, so that one reduction across
devices carries them all.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._core import config as _config
from optax_lossscale._core import placement as _placement
from optax_lossscale._jaxpr import compat as _compat

FINITE, INF, NAN = 0, 1, 2
CODE_DTYPE = jnp.int32


class Verdict(NamedTuple):
  """The check of a tree, and whether each leaf was not finite when asked
  for."""

  finite: jax.Array  # bool[]: every element finite
  nan: jax.Array  # bool[]: some element NaN
  # bool[n], per leaf in `jax.tree.leaves` order: one vector from the check
  # to the counts, since a scalar per leaf made XLA compile a step of a
  # thousand leaves slowly (benchmarks/README.md).
  leaf_notfinite: jax.Array | None
  # Whether every leaf was checked where a NaN can be told from an inf: a
  # static fact of the program (False where some leaf lives on a mesh with
  # `Auto` axes, inside `shard_map` too, where a NaN counts as an inf).
  nan_told_apart: bool = True

  @property
  def code(self) -> jax.Array:
    return code_of(self.finite, self.nan)


def code_of(finite: jax.Array, nan: jax.Array) -> jax.Array:
  """The code of a check that found `finite` and `nan`."""
  return lax.select(
    nan, _code(NAN), lax.select(finite, _code(FINITE), _code(INF))
  )


def _flags_of(codes: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of the worst of `codes` (any shape)."""
  worst = jnp.max(codes)
  return worst == FINITE, worst == NAN


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
  return Verdict(finite, nan, _in_leaf_order(pieces, order), told)


def _in_leaf_order(pieces: list[Any], order: list[int]) -> jax.Array:
  """One vector of `pieces` (vectors) concatenated, whose elements are
  those of the leaves `order` names, rearranged into leaf order (by a
  gather of constant indices, where the order differs)."""
  values = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
  if order == sorted(order):
    return values
  return values[np.argsort(order)]


def _code(value: int) -> jax.Array:
  return jnp.asarray(value, CODE_DTYPE)


def _check_here(leaves: list[jax.Array], per_leaf: bool) -> Verdict:
  """The check of leaves that live whole on one device (or are one shard).

  Per leaf, one form everywhere (`_leaf_codes`). For the tree alone, the
  accelerators' form (`_concatenated`: one reduction per group of leaves
  concatenated, which XLA on GPU fuses into one kernel, where a reduction
  per leaf costs two kernel launches each), and on CPU, where XLA
  materializes a concatenation of large leaves, `_on_cpu`; the platform is
  chosen when the step is lowered, with no branch at run time.
  """
  if per_leaf:
    codes = _leaf_codes(leaves)
    finite, nan = _every_and_some(codes == FINITE, codes == NAN, (0,))
    return Verdict(finite, nan, codes != FINITE)
  finite, nan = lax.platform_dependent(
    *leaves, cpu=_on_cpu, default=_concatenated
  )
  return Verdict(finite, nan, None)


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
      codes = _leaf_codes(list(shards)).astype(CODE_DTYPE)
    else:
      codes = _check_here(list(shards), per_leaf).code
    return lax.pmax(codes, axes) if axes else codes

  out_spec = jax.sharding.PartitionSpec()
  codes = _compat.shard_map(check_shards, mesh, specs, out_spec)(*leaves)
  leaf_notfinite = codes != FINITE if per_leaf else None
  return Verdict(*_flags_of(codes), leaf_notfinite)


def _reduced_where_it_lives(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of one leaf whose sharding XLA picks later; `nan` is
  False there (an unknown NaN counts as an overflow).

  `sum(x - x)` is 0 for finite `x` and NaN otherwise, exactly. XLA's SPMD
  partitioner splits this one-operand sum into one sum per shard and an
  all-reduce of a scalar; a two-operand reduction (`_one_pass`) it gathers
  first. The difference, unlike `x * 0`, needs no broadcast zeros, which
  XLA on CPU materialized. Telling a NaN from an inf here costs more than it
  is worth: a select in front of the sum (`|x|` where `x` is not finite)
  made XLA on CPU materialize the leaf, and a second reduction (a max)
  added an all-reduce per leaf and, on CPU, dropped the NaN.
  """
  if x.dtype not in _MASKS:  # complex and float8
    return _flags_of_unmasked(x)
  zeros = lax.sub(x, x)
  total = lax.reduce_sum(zeros, tuple(range(x.ndim)))
  return lax.is_finite(total), jnp.zeros([], jnp.bool_)


def _largest_magnitude(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of a leaf that lives whole here, in one one-operand
  reduction: the largest magnitude read as an integer (every NaN lies above
  inf), where XLA on GPU and TPU fuses the reading into the reduction."""
  masks = _MASKS.get(x.dtype)
  if masks is None:  # complex and float8
    return _flags_of_unmasked(x)
  magnitude, inf = masks
  bits = _magnitude_bits(x, magnitude)
  largest = lax.reduce_max(bits, tuple(range(x.ndim)))
  return lax.lt(largest, inf), lax.gt(largest, inf)


def _on_cpu(*leaves: jax.Array) -> tuple[jax.Array, jax.Array]:
  # Each reduction is a kernel of its own, and XLA on CPU compiles a
  # reduction kernel slowly: leaves of one shape are read together.
  small = [x for x in leaves if x.size < _CONCATENATE_BELOW]
  large = [x for x in leaves if x.size >= _CONCATENATE_BELOW]
  flags = [_one_pass(group) for group in _groups_of_one_shape(large)]
  flags += [
    _one_pass([jnp.concatenate(flat)]) for flat in _raveled_by_dtype(small)
  ]
  return _all_and_any(flags)


def _leaf_codes(leaves: Sequence[jax.Array]) -> jax.Array:
  """The code of each leaf, in order, as one `int8[n]` vector.

  Leaves of one shape and dtype are read together. Small ones are stacked
  (a small copy) and reduced into a vector of codes, up to
  `_LEAVES_PER_STACK` at a time; larger ones, which a stack would copy,
  are read up to `_LEAVES_PER_REDUCTION` at a time in one reduction with
  one operand per leaf. The fewer reductions, operands and scalars, the
  faster XLA compiles a step of many leaves. Leaves without an exponent
  mask (complex, float8) are checked alone.
  """
  pieces, order = [], []
  for same in _indices_by_kind(leaves):
    first = leaves[same[0]]
    stacked = first.dtype in _MASKS and first.size < _CONCATENATE_BELOW
    read = _read_stacked if stacked else _read_together
    per_read = _LEAVES_PER_STACK if stacked else _LEAVES_PER_REDUCTION
    for start in range(0, len(same), per_read):
      group = same[start : start + per_read]
      pieces.append(read([leaves[i] for i in group]))
      order += group
  return _in_leaf_order(pieces, order)


def _indices_by_kind(leaves: Sequence[jax.Array]) -> list[list[int]]:
  """The positions of `leaves`, in groups of one shape and dtype (a leaf
  without an exponent mask in a group of its own)."""
  by_kind: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    # By position, not `id(x)`: one array may be passed twice.
    kind = (x.shape, x.dtype) if x.dtype in _MASKS else i
    by_kind.setdefault(kind, []).append(i)
  return list(by_kind.values())


# Leaves per reduction of large leaves in `_leaf_codes`, and per stack of
# small ones (benchmarks/README.md).
_LEAVES_PER_REDUCTION = 32
_LEAVES_PER_STACK = 64
_LEAF_CODE_DTYPE = jnp.int8


def _read_stacked(leaves: Sequence[jax.Array]) -> jax.Array:
  """The code of each of `leaves` (of one shape and a masked dtype), as a
  vector: one reduction of the leaves stacked."""
  magnitude, inf = _MASKS[leaves[0].dtype]
  bits = _magnitude_bits(jnp.stack(leaves), magnitude)
  finite, nan = _every_and_some(
    lax.lt(bits, inf), lax.gt(bits, inf), tuple(range(1, bits.ndim))
  )
  # A NaN is not finite either: 1 + 1 is `NAN`.
  return lax.add(
    lax.convert_element_type(lax.bitwise_not(finite), _LEAF_CODE_DTYPE),
    lax.convert_element_type(nan, _LEAF_CODE_DTYPE),
  )


def _read_together(leaves: Sequence[jax.Array]) -> jax.Array:
  """The code of each of `leaves` (of one shape and dtype), as a vector: in
  one reduction, per leaf the largest of its elements' codes."""
  masks = _MASKS.get(leaves[0].dtype)
  if masks is None:  # complex or float8 (in whose e4m3fn NaN is not all ones)
    (leaf,) = leaves
    code = code_of(*_flags_of_unmasked(leaf))
    return code.astype(_LEAF_CODE_DTYPE)[None]
  if len(leaves) == 1:
    # A reduction of one operand XLA on CPU hands to a library kernel that
    # takes its input materialized (a byte per element); one of two
    # booleans it keeps whole, as `_one_pass` says.
    return code_of(*_one_pass(leaves)).astype(_LEAF_CODE_DTYPE)[None]
  magnitude, inf = masks
  operands = tuple(_element_codes(x, magnitude, inf) for x in leaves)
  zero = np.zeros([], _LEAF_CODE_DTYPE)
  reduced = lax.reduce(
    operands,
    (zero,) * len(operands),
    _pairwise_max,
    tuple(range(leaves[0].ndim)),
  )
  return jnp.stack(reduced)


def _element_codes(
  x: jax.Array, magnitude: np.unsignedinteger, inf: np.unsignedinteger
) -> jax.Array:
  """Each element's code, from its magnitude read as an integer (every NaN
  lies above inf): no conversion of float16, and no float max (XLA's
  vectorized float max on CPU drops NaNs in large arrays)."""
  bits = _magnitude_bits(x, magnitude)
  return lax.add(
    lax.convert_element_type(lax.ge(bits, inf), _LEAF_CODE_DTYPE),
    lax.convert_element_type(lax.gt(bits, inf), _LEAF_CODE_DTYPE),
  )


def _pairwise_max(
  a: Sequence[jax.Array], b: Sequence[jax.Array]
) -> tuple[jax.Array, ...]:
  return tuple(lax.max(x, y) for x, y in zip(a, b, strict=True))


def _all_and_any(
  flags: Sequence[tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
  """`(all finite, any NaN)` over `(finite, nan)` pairs, each one reduction
  of a stack."""
  finites, nans = zip(*flags, strict=True)
  return jnp.all(jnp.stack(finites)), jnp.any(jnp.stack(nans))


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
  groups = []
  for indices in _indices_by_kind(leaves):
    same = [leaves[i] for i in indices]
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

# By dtype, as unsigned integers of its width: the bits of the magnitude (all
# but the sign), and the magnitude of inf. Read as integers, magnitudes order
# as the floats do, and every NaN lies above inf (IEEE 754).
_MASKS: dict[np.dtype, tuple[np.unsignedinteger, np.unsignedinteger]] = {
  jnp.dtype(jnp.float16): (np.uint16(0x7FFF), np.uint16(0x7C00)),
  jnp.dtype(jnp.bfloat16): (np.uint16(0x7FFF), np.uint16(0x7F80)),
  jnp.dtype(jnp.float32): (np.uint32(0x7FFF_FFFF), np.uint32(0x7F80_0000)),
  jnp.dtype(jnp.float64): (
    np.uint64(0x7FFF_FFFF_FFFF_FFFF),
    np.uint64(0x7FF0_0000_0000_0000),
  ),
}


def _one_pass(leaves: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of `leaves` (of one shape and dtype), in one pass."""
  masks = _MASKS.get(leaves[0].dtype)
  if masks is None:  # complex or float8 (in whose e4m3fn NaN is not all ones)
    (leaf,) = leaves
    return _flags_of_unmasked(leaf)
  magnitude, inf = masks
  # The largest magnitude over the leaves, element by element, read as
  # integers: no conversion of float16 (which slowed an `x * 0` sum on
  # float16 leaves), and no float max (XLA's vectorized float max on CPU
  # drops NaNs in large arrays).
  largest = _balanced_max([_magnitude_bits(x, magnitude) for x in leaves])
  return _every_and_some(
    lax.lt(largest, inf), lax.gt(largest, inf), tuple(range(largest.ndim))
  )


def _every_and_some(
  every: jax.Array, some: jax.Array, dimensions: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
  """`(all(every), any(some))` over `dimensions`, in one reduction of the
  two booleans at once (here: is every element finite, is any NaN).

  XLA on CPU splits a one-operand reduction into a tree of reduce-windows
  and materializes its input in front of it, through a transposing copy
  when the gradient is a transposed matmul output (and it did the same to
  a variadic max of the integers, and split a max of the per-leaf codes
  through their concatenation); it leaves this reduction whole, with its
  input fused in: one pass, no temporary.
  """
  return lax.reduce(
    (every, some), (np.bool_(True), np.bool_(False)), _and_or, dimensions
  )


def _balanced_max(values: list[jax.Array]) -> jax.Array:
  """The element-wise max of `values`, as a balanced tree of maxima.

  Not a chain: XLA's simplifier moves the transposes of matmul gradients
  through the maxima one level per iteration of its fixed point, so a chain
  over a group of weight gradients ran it to its iteration limit, twice
  (benchmarks/README.md); a tree's depth is the logarithm of the group's
  size.
  """
  while len(values) > 1:
    # An odd one out waits for the next level.
    pairs = zip(values[::2], values[1::2], strict=False)
    paired = [lax.max(a, b) for a, b in pairs]
    values = paired + values[len(paired) * 2 :]
  return values[0]


def _magnitude_bits(x: jax.Array, mask: np.unsignedinteger) -> jax.Array:
  return lax.bitwise_and(lax.bitcast_convert_type(x, mask.dtype), mask)


def _flags_of_unmasked(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of a leaf of a dtype without a magnitude mask (complex,
  or float8, in whose e4m3fn NaN is not all ones)."""
  return jnp.all(jnp.isfinite(x)), jnp.any(jnp.isnan(x))


def _and_or(
  a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  return a[0] & b[0], a[1] | b[1]


# Leaves per concatenation: one concatenation of many leaves XLA on GPU
# materialized (a gradient-sized temporary); groups of this size fuse
# (benchmarks/README.md).
_LEAVES_PER_CONCATENATION = 64


def _concatenated(*leaves: jax.Array) -> tuple[jax.Array, jax.Array]:
  flags = []
  for flat in _raveled_by_dtype(leaves):
    for start in range(0, len(flat), _LEAVES_PER_CONCATENATION):
      group = flat[start : start + _LEAVES_PER_CONCATENATION]
      flags.append(_largest_magnitude(jnp.concatenate(group)))
  return _all_and_any(flags)


def reduce_across(codes: jax.Array, axis_name: _config.AxisName) -> jax.Array:
  """Reduces codes over `axis_name`, so that every replica agrees: one
  int32 vector per replica crosses the interconnect, not the gradients."""
  if axis_name is None:
    return codes
  return lax.pmax(codes, axis_name)
