"""What each value is reduced to, on the device: counts of NaN, of inf and
of values flushed to zero; whether some value is not finite where its
shadow is finite, or where it is not, whether the shadow holds a NaN, and
whether a value is far from its float32 shadow where an input was not
finite; and two magnitudes (the largest finite, the smallest nonzero).

Values are reduced in groups: up to `GROUP` values of one size (small ones
padded to a power of two) are stacked, in float32, beside their shadows,
every comparison is made once on the stack, and the stack is reduced in
one variadic reduction, the flags as bits of one integer. The compiler's
work then grows with the number of groups and of vectors reduced more than
with the number of values: comparisons written per value cost the compiler
several times the program's own work. The reductions come back as they
are, and are made into the columns below on the host (`columns`): an
operation on them in the program would be a kernel more per group.
"""

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

# Columns of the counts (NaN, inf and FLUSHED are counted; RANGE, BOTH,
# SHADOW_NAN and ABSORBED are 1 where some element is so).
NAN = 0  # NaN
INF = 1  # infinite
RANGE = 2  # not finite, though its float32 shadow is finite
BOTH = 3  # not finite, nor is its float32 shadow
SHADOW_NAN = 4  # NaN in the shadow
ABSORBED = 5  # finite but far from its shadow (`_FAR`) where an input is
# not finite (elementwise): `rsqrt(inf)` is 0 where float32 gives 0.004
FLUSHED = 6  # zero where the same operation in float32 is not
COUNTS = 7
# Columns of the magnitudes.
LARGEST, SMALLEST = range(2)

# A finite value is far from its shadow when by more than this share of
# the shadow's magnitude (or of float16's smallest normal number): far
# more than rounding moves it, as a token's activations zeroed are.
_FAR = 0.25
_FLOOR = 2.0**-14

GROUP = 64  # values reduced together, at most
_GROUP_BYTES = 2**18  # and at most this many bytes per stacked array
_PADDED = 2**16  # values up to this size are padded to a power of two
_SMALL = 2**11  # and at least to this one


class Value(NamedTuple):
  """A value to measure, as `measure` takes it."""

  value: jax.Array
  shadow: jax.Array
  inputs: tuple[jax.Array, ...] | None
  reference: jax.Array | None


class Measured(NamedTuple):
  """A value and what it is compared with, raveled, in float32."""

  value: jax.Array  # its larger part's magnitude, for a complex one
  shadow: jax.Array
  inputs_bad: jax.Array | None  # elementwise: an input is not finite here
  reference: jax.Array | None  # the operation in float32 from its inputs


def measure(
  value: jax.Array,
  shadow: jax.Array,
  inputs: Sequence[jax.Array] | None,
  reference: jax.Array | None,
) -> Measured:
  """`value` beside its float32 `shadow`, to be reduced in a group.

  `inputs`, for an elementwise operation, are its floating-point inputs
  (each of `value`'s shape, or a scalar): where one is not finite, a
  finite value far from its shadow is ABSORBED. `reference` is the
  operation computed in float32 from `value`'s own inputs: where it is not
  zero and `value` is, float16 FLUSHED a value to zero.
  """
  bad = None
  if inputs:
    finite = None
    for x in inputs:
      x_finite = _finite(x)
      if finite is None:
        finite = x_finite
      else:
        finite = lax.bitwise_and(finite, x_finite)
    assert finite is not None
    if finite.shape != value.shape:  # scalar inputs only
      finite = lax.broadcast_in_dim(finite, value.shape, ())
    bad = _flat(lax.bitwise_not(finite))
  if reference is not None:
    reference = _flat(_real32(reference))
  return Measured(_flat(_real32(value)), _flat(_real32(shadow)), bad, reference)


def _flat(x: jax.Array) -> jax.Array:
  return lax.reshape(_gathered(x), (int(np.prod(x.shape, dtype=np.int64)),))


def _gathered(x: jax.Array) -> jax.Array:
  """`x` replicated where it is sharded over an `Explicit` mesh axis: a
  value is reduced whole, and jax types no reshape of such a value into
  one dimension (on an `Auto` mesh the compiler places it)."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  if spec is None or all(axis is None for axis in spec):
    return x
  return jax.sharding.reshard(x, jax.sharding.PartitionSpec())


def _real32(x: jax.Array) -> jax.Array:
  """`x` in float32; for a complex `x`, its larger part's magnitude (NaN
  or inf where a part is)."""
  if np.issubdtype(x.dtype, np.complexfloating):
    return lax.convert_element_type(
      lax.max(lax.abs(lax.real(x)), lax.abs(lax.imag(x))), np.float32
    )
  return lax.convert_element_type(x, np.float32)


def _finite(x: jax.Array) -> jax.Array:
  if np.issubdtype(x.dtype, np.complexfloating):
    return lax.bitwise_and(
      lax.is_finite(lax.real(x)), lax.is_finite(lax.imag(x))
    )
  return lax.is_finite(x)


class Groups:
  """Values waiting to be reduced, grouped; `add` returns a row number,
  `results` the groups' reductions."""

  def __init__(self) -> None:
    # Values of one padded size, stacked together.
    self._pending: dict[int, list[tuple[int, Value]]] = {}
    self._rows = 0
    self._done: list[tuple[list[int], Reduced]] = []

  def add(self, value: Value) -> int:
    row = self._rows
    self._rows += 1
    size = _bucket(int(np.prod(np.shape(value.value), dtype=np.int64)))
    pending = self._pending.setdefault(size, [])
    pending.append((row, value))
    if len(pending) >= min(GROUP, max(1, _GROUP_BYTES // (4 * size))):
      self._reduce(size)
    return row

  def results(self) -> tuple[list["Reduced"], np.ndarray]:
    """`(groups, order)`: each group's reductions, and `order[k]`, the row
    of the k-th value reduced, the groups' values one after the other."""
    for key in list(self._pending):
      self._reduce(key)
    order = [row for rows, _ in self._done for row in rows]
    return [reduced for _, reduced in self._done], np.asarray(order, np.int64)

  def _reduce(self, size: int) -> None:
    pending = self._pending.pop(size, [])
    if pending:
      rows = [row for row, _ in pending]
      values = tuple(value for _, value in pending)
      self._done.append((rows, Reduced(*_reduce_group(values, size))))


def _bucket(size: int) -> int:
  if size > _PADDED:
    return size
  return max(_SMALL, 1 << max(0, (size - 1).bit_length()))


def _stack(
  arrays: list[jax.Array | None], size: int, fill: Any, dtype: Any
) -> jax.Array:
  """The arrays, each padded to `size` with `fill` (None: all `fill`), as
  one [len, size] array."""
  rows = []
  for x in arrays:
    if x is None:
      x = lax.full((size,), fill, dtype)
    elif x.shape[0] != size:
      x = lax.pad(x, np.asarray(fill, x.dtype), [(0, size - x.shape[0], 0)])
    rows.append(x)
  flat = rows[0] if len(rows) == 1 else lax.concatenate(rows, 0)
  return lax.reshape(flat, (len(rows), size))


@functools.partial(jax.jit, static_argnums=1)
def _reduce_group(values: tuple[Value, ...], size: int) -> tuple[Any, ...]:
  """The values measured and reduced, as a nested call: traced once for
  every group alike (the same shapes and dtypes, in any chunk), and lowered
  once per chunk; the compiler inlines it."""
  measured = [measure(v.value, v.shadow, v.inputs, v.reference) for v in values]
  return tuple(_reduce_stacked(measured, size))


def _reduce_stacked(measured: list[Measured], size: int) -> "Reduced":
  """The comparisons, made once on the stacked values, then reduced: one
  vector per count, one of flags (bits, or-ed) and one per magnitude (in
  `lax`, as this runs for every kind of group while the program is
  traced)."""
  a = _stack([m.value for m in measured], size, 0, np.float32)
  b = _stack([m.shadow for m in measured], size, 0, np.float32)
  shape = a.shape
  int32, float32 = np.int32, np.float32
  magnitude = lax.abs(a)
  finite_a, finite_b = lax.is_finite(a), lax.is_finite(b)
  zero = lax.full(shape, 0, float32)
  inf = lax.full(shape, np.inf, float32)

  def bits(where: jax.Array, yes: int, no: int = 0) -> jax.Array:
    return lax.select(
      where, lax.full(shape, yes, int32), lax.full(shape, no, int32)
    )

  flags = lax.select(
    finite_a,
    lax.full(shape, 0, int32),
    bits(finite_b, RANGE_BIT, BOTH_BIT),
  )
  flags = lax.bitwise_or(flags, bits(lax.ne(b, b), SHADOW_NAN_BIT))
  if any(m.inputs_bad is not None for m in measured):
    bad = _stack([m.inputs_bad for m in measured], size, False, np.bool_)
    scale = lax.max(lax.abs(b), lax.full(shape, _FLOOR, float32))
    far = lax.gt(lax.abs(lax.sub(a, b)), lax.mul(scale, float32(_FAR)))
    absorbed = lax.bitwise_and(
      lax.bitwise_and(finite_a, finite_b), lax.bitwise_and(bad, far)
    )
    flags = lax.bitwise_or(flags, bits(absorbed, ABSORBED_BIT))
  operands = [
    lax.convert_element_type(lax.ne(a, a), int32),  # NaN
    lax.convert_element_type(lax.eq(magnitude, inf), int32),  # inf
    flags,
    lax.select(finite_a, magnitude, zero),  # LARGEST
    lax.select(lax.gt(magnitude, zero), magnitude, inf),  # SMALLEST
  ]
  inits = [int32(0), int32(0), int32(0), float32(0), float32(np.inf)]
  combine = [lax.add, lax.add, lax.bitwise_or, lax.max, lax.min]
  checked = any(m.reference is not None for m in measured)
  if checked:
    ref = _stack([m.reference for m in measured], size, 0, float32)
    flushed = lax.bitwise_and(lax.eq(a, zero), lax.ne(ref, zero))
    operands.append(lax.convert_element_type(flushed, int32))
    inits.append(int32(0))
    combine.append(lax.add)

  def reducer(x: tuple[Any, ...], y: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(f(p, q) for f, p, q in zip(combine, x, y, strict=True))

  nan, infs, flag, largest, smallest, *rest = lax.reduce(
    tuple(operands), tuple(inits), reducer, (1,)
  )
  return Reduced(nan, infs, flag, largest, smallest, *rest or [None])


# The flags' bits, one for each column of that name: RANGE_BIT where a
# value is not finite and its shadow is, BOTH_BIT where neither is.
RANGE_BIT, BOTH_BIT, SHADOW_NAN_BIT, ABSORBED_BIT = 1, 2, 4, 8


class Reduced(NamedTuple):
  """A group's reductions: a vector each, an element per value."""

  nan: Any  # how many NaN
  inf: Any  # how many infinite
  flags: Any  # the bits its elements set, or-ed
  largest: Any
  smallest: Any
  flushed: Any  # how many FLUSHED; None where none is checked


def columns(groups: list[Reduced]) -> tuple[np.ndarray, np.ndarray]:
  """`(counts, magnitudes)`, on the host, of the groups' values one after
  the other: the `COUNTS` columns, and the `LARGEST` and `SMALLEST`."""
  counts = [np.zeros((0, COUNTS), np.int64)]
  magnitudes = [np.zeros((0, 2), np.float64)]
  for group in groups:
    flags = np.asarray(group.flags, np.int64)
    c = np.zeros((flags.shape[0], COUNTS), np.int64)
    c[:, NAN], c[:, INF] = group.nan, group.inf
    for column, bit in _BITS.items():
      c[:, column] = (flags & bit) != 0
    if group.flushed is not None:
      c[:, FLUSHED] = group.flushed
    counts.append(c)
    magnitudes.append(np.stack([group.largest, group.smallest], 1))
  return np.concatenate(counts), np.concatenate(magnitudes).astype(np.float64)


_BITS = {
  RANGE: RANGE_BIT,
  BOTH: BOTH_BIT,
  SHADOW_NAN: SHADOW_NAN_BIT,
  ABSORBED: ABSORBED_BIT,
}


def as_reduced(counts: np.ndarray, magnitudes: np.ndarray) -> Reduced:
  """Counts and magnitudes made on the host, as one group's reductions
  (`columns` gives them back)."""
  flags = np.zeros(counts.shape[0], np.int64)
  for column, bit in _BITS.items():
    flags |= np.where(counts[:, column] > 0, bit, 0)
  return Reduced(
    nan=counts[:, NAN],
    inf=counts[:, INF],
    flags=flags,
    largest=magnitudes[:, LARGEST],
    smallest=magnitudes[:, SMALLEST],
    flushed=counts[:, FLUSHED],
  )
