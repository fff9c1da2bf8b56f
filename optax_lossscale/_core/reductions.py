"""The reductions that read gradient leaves where they live whole (on one
device, or as one shard inside `shard_map`).

Three forms, each kept for a measurement (benchmarks/README.md, "The
check's forms"):

- `on_accelerators` (GPU and TPU), the tree: leaves concatenated by dtype,
  in groups, each group one reduction, which XLA on GPU fuses into one
  kernel (a reduction per leaf costs two kernel launches each);
- `on_cpu`, the tree: small leaves concatenated by dtype, large ones read
  together by shape, without a copy (XLA on CPU materializes a
  concatenation of large leaves);
- `leaf_codes`, each leaf's code, one form on every platform (`leaf_stats`).

`whole_tree` picks the first two by the platform the step is lowered for,
with no branch at run time.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_lossscale._core import codes as _codes

# The tuning constants, each with the measurement that set it
# (benchmarks/README.md, "The check's forms", the row named).
#
# Leaves under this many elements are copied together: concatenated by
# `on_cpu`, stacked by `leaf_codes` ("Small leaves copied together").
SMALL_BELOW = 2**12
# `on_cpu` reads large leaves of one shape together, up to this many
# elements a group ("Large leaves grouped").
ELEMENTS_PER_GROUP = 2**20
# Leaves per concatenation on accelerators, and per stack of `leaf_codes`:
# XLA on GPU materialized one concatenation of 1,000 leaves ("Elsewhere than
# CPU").
LEAVES_PER_CONCATENATION = 64
# Operands of one reduction in `leaf_codes` ("Leaves per variadic
# reduction").
LEAVES_PER_REDUCTION = 32


# --- the tree -------------------------------------------------------------

_cpu_runs_the_accelerators_form = False


def lower_cpu_as_accelerators(on: bool) -> None:
  """From now on, a tree checked for CPU takes the accelerators' form (`on`)
  or its own.

  The test suite runs with `on` (tests/conftest.py), so that the check it
  tests is the one that users run on GPU and TPU. jax caches what it
  traced, with the form it was traced with: a change clears jax's caches.
  """
  global _cpu_runs_the_accelerators_form
  if on != _cpu_runs_the_accelerators_form:
    _cpu_runs_the_accelerators_form = on
    jax.clear_caches()


def whole_tree(leaves: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of `leaves`, in the form of the platform lowered for."""
  cpu = on_accelerators if _cpu_runs_the_accelerators_form else on_cpu
  return lax.platform_dependent(*leaves, cpu=cpu, default=on_accelerators)


def on_accelerators(*leaves: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of `leaves`: the largest magnitude of each group of
  concatenated leaves, in a one-operand reduction that XLA on GPU and TPU
  fuses with the reading of the bits."""
  flags = []
  for flat in _raveled_by_dtype(leaves):
    for start in range(0, len(flat), LEAVES_PER_CONCATENATION):
      group = flat[start : start + LEAVES_PER_CONCATENATION]
      flags.append(_largest_magnitude(jnp.concatenate(group)))
  return _all_and_any(flags)


def on_cpu(*leaves: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of `leaves`: each reduction is a kernel that XLA on CPU
  compiles on its own, and slowly, so small leaves are concatenated and
  large ones of one shape read together."""
  small = [x for x in leaves if x.size < SMALL_BELOW]
  large = [x for x in leaves if x.size >= SMALL_BELOW]
  flags = [_one_pass(group) for group in _groups_of_one_kind(large)]
  flags += [
    _one_pass([jnp.concatenate(flat)]) for flat in _raveled_by_dtype(small)
  ]
  return _all_and_any(flags)


def _groups_of_one_kind(leaves: list[jax.Array]) -> list[list[jax.Array]]:
  """The leaves in groups of one shape and dtype, each up to
  `ELEMENTS_PER_GROUP` elements (at least one leaf), of near-equal sizes;
  a leaf without a magnitude (complex, float8) alone."""
  groups = []
  for indices in _indices_by_kind(leaves):
    same = [leaves[i] for i in indices]
    per_group = max(1, ELEMENTS_PER_GROUP // same[0].size)
    count = -(-len(same) // per_group)
    groups += [same[i::count] for i in range(count)]
  return groups


def _largest_magnitude(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  if not _codes.has_magnitude(x.dtype):
    return _codes.unmasked_flags(x)
  largest = lax.reduce_max(_codes.magnitude(x), tuple(range(x.ndim)))
  return _codes.magnitude_flags(largest, x.dtype)


def _one_pass(leaves: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of `leaves` (of one shape and dtype), in one pass: the
  element-wise largest magnitude over the leaves, its flags reduced."""
  if not _codes.has_magnitude(leaves[0].dtype):
    (leaf,) = leaves
    return _codes.unmasked_flags(leaf)
  largest = _balanced_max([_codes.magnitude(x) for x in leaves])
  finite, nan = _codes.magnitude_flags(largest, leaves[0].dtype)
  return every_and_some(finite, nan, tuple(range(largest.ndim)))


def _balanced_max(values: list[jax.Array]) -> jax.Array:
  """The element-wise max of `values`, as a balanced tree of maxima.

  Not a chain: XLA's simplifier moves the transposes of matmul gradients
  through the maxima one level per iteration of its fixed point, and ran a
  chain over a group of weight gradients to its iteration limit ("A
  balanced tree of maxima"); a tree's depth is the logarithm of the group's
  size.
  """
  while len(values) > 1:
    # An odd one out waits for the next level.
    pairs = zip(values[::2], values[1::2], strict=False)
    paired = [lax.max(a, b) for a, b in pairs]
    values = paired + values[len(paired) * 2 :]
  return values[0]


def every_and_some(
  every: jax.Array, some: jax.Array, dimensions: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
  """`(all(every), any(some))` over `dimensions`, in one reduction of the
  two booleans at once.

  XLA on CPU splits a one-operand reduction into a tree of reduce-windows
  and materializes its input in front of it, through a transposing copy
  when the gradient is a transposed matmul output (it did the same to a
  variadic max of the magnitudes, and split a max of the per-leaf codes
  through their concatenation); it leaves this reduction whole, with its
  input fused in: one pass, no temporary ("One variadic reduction").
  """
  return lax.reduce(
    (every, some), (np.bool_(True), np.bool_(False)), _and_or, dimensions
  )


def _and_or(
  a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  return a[0] & b[0], a[1] | b[1]


def _all_and_any(
  flags: Sequence[tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
  """`(all finite, any NaN)` over `(finite, nan)` pairs."""
  finites, nans = zip(*flags, strict=True)
  return jnp.all(jnp.stack(finites)), jnp.any(jnp.stack(nans))


def _raveled_by_dtype(leaves: Sequence[jax.Array]) -> list[list[jax.Array]]:
  """The leaves raveled, one list per dtype (a concatenation needs one)."""
  return [
    [x.ravel() for x in leaves if x.dtype == dtype]
    for dtype in sorted({x.dtype for x in leaves}, key=str)
  ]


# --- each leaf ------------------------------------------------------------


def leaf_codes(leaves: Sequence[jax.Array]) -> jax.Array:
  """The code of each leaf, in order, as one vector.

  Leaves of one shape and dtype are read together: small ones stacked (a
  small copy) and reduced into a vector of codes, `LEAVES_PER_CONCATENATION`
  at a time; larger ones, which a stack would copy, `LEAVES_PER_REDUCTION`
  at a time, in one reduction with one operand per leaf. The fewer
  reductions, operands and scalars, the faster XLA compiles a step of many
  leaves. A leaf without a magnitude (complex, float8) is read alone.
  """
  pieces, order = [], []
  for same in _indices_by_kind(leaves):
    first = leaves[same[0]]
    stacked = _codes.has_magnitude(first.dtype) and first.size < SMALL_BELOW
    read = _read_stacked if stacked else _read_together
    per_read = LEAVES_PER_CONCATENATION if stacked else LEAVES_PER_REDUCTION
    for start in range(0, len(same), per_read):
      group = same[start : start + per_read]
      pieces.append(read([leaves[i] for i in group]))
      order += group
  return in_leaf_order(pieces, order)


def _read_stacked(leaves: Sequence[jax.Array]) -> jax.Array:
  """The code of each of `leaves` (of one shape, with a magnitude), in one
  reduction of the leaves stacked."""
  magnitudes = _codes.magnitude(jnp.stack(leaves))
  finite, nan = every_and_some(
    *_codes.magnitude_flags(magnitudes, leaves[0].dtype),
    tuple(range(1, magnitudes.ndim)),
  )
  return _codes.code_of(finite, nan)


def _read_together(leaves: Sequence[jax.Array]) -> jax.Array:
  """The code of each of `leaves` (of one shape and dtype), in one
  reduction: per leaf the largest of its elements' codes."""
  if len(leaves) == 1 or not _codes.has_magnitude(leaves[0].dtype):
    # XLA on CPU hands a one-operand reduction to a library kernel that
    # takes its input materialized (a byte per element); one of two
    # booleans it keeps whole, as `every_and_some` says.
    flags = _one_pass(leaves)
    return _codes.code_of(*flags)[None]
  operands = tuple(
    _codes.magnitude_codes(_codes.magnitude(x), x.dtype) for x in leaves
  )
  zero = np.zeros([], _codes.CODE_DTYPE)
  reduced = lax.reduce(
    operands,
    (zero,) * len(operands),
    _pairwise_max,
    tuple(range(leaves[0].ndim)),
  )
  return jnp.stack(reduced)


def _pairwise_max(
  a: Sequence[jax.Array], b: Sequence[jax.Array]
) -> tuple[jax.Array, ...]:
  return tuple(lax.max(x, y) for x, y in zip(a, b, strict=True))


def _indices_by_kind(leaves: Sequence[jax.Array]) -> list[list[int]]:
  """The positions of `leaves`, in groups of one shape and dtype (a leaf
  without a magnitude in a group of its own)."""
  by_kind: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    # By position, not `id(x)`: one array may be passed twice.
    kind = (x.shape, x.dtype) if _codes.has_magnitude(x.dtype) else i
    by_kind.setdefault(kind, []).append(i)
  return list(by_kind.values())


def in_leaf_order(pieces: list[Any], order: list[int]) -> jax.Array:
  """One vector of `pieces` (vectors) concatenated, whose elements are
  those of the leaves `order` names, rearranged into leaf order (by a
  gather of constant indices, where the order differs)."""
  values = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
  if order == sorted(order):
    return values
  return values[np.argsort(order)]
