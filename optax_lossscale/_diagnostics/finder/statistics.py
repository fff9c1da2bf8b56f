"""What each value is reduced to, on the device: counts of NaN and inf, of
values changed far from the float32 shadow where an input was not finite,
and of values flushed to zero; whether some value is not finite where its
shadow is finite, or where it is not, and whether the shadow holds a NaN;
and two magnitudes (the largest finite, the smallest nonzero).

Values are reduced in groups: up to `GROUP` values of one size (small ones
padded to a power of two) are stacked, in float32, beside their shadows,
every comparison is made once on the stack, and the stack is reduced in
one variadic reduction. The compiler's work then grows with the number of
groups more than with the number of values: comparisons written per value
cost the compiler several times the program's own work.
"""

from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

# Columns of the counts (NaN and inf are counted; RANGE, BOTH and
# SHADOW_NAN are 1 where some element is so).
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


class Measured(NamedTuple):
  """A value and what it is compared with, raveled, in float32."""

  value: jax.Array  # its larger part's magnitude, for a complex one
  shadow: jax.Array
  inputs_bad: jax.Array | None  # elementwise: an input is not finite here
  reference: jax.Array | None  # the operation in float32 from its inputs


def measure(
  value: jax.Array,
  shadow: jax.Array,
  inputs: list[jax.Array] | None,
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
  """Measured values waiting to be reduced, grouped; `add` returns a row
  number, `results` the rows' statistics."""

  def __init__(self) -> None:
    # Values of one padded size, stacked together.
    self._pending: dict[int, list[tuple[int, Measured]]] = {}
    self._rows = 0
    self._done: list[tuple[list[int], list[jax.Array]]] = []

  def add(self, measured: Measured) -> int:
    row = self._rows
    self._rows += 1
    size = _bucket(int(measured.value.shape[0]))
    pending = self._pending.setdefault(size, [])
    pending.append((row, measured))
    if len(pending) >= min(GROUP, max(1, _GROUP_BYTES // (4 * size))):
      self._reduce(size)
    return row

  def results(self) -> tuple[jax.Array, jax.Array, np.ndarray]:
    """`(counts, magnitudes, order)`: per row in reduction order, its
    counts (int32, `COUNTS` columns) and magnitudes (float32, 2 columns);
    `order[k]` is the k-th result's row."""
    for key in list(self._pending):
      self._reduce(key)
    if not self._done:
      return (
        lax.full((0, COUNTS), 0, np.int32),
        lax.full((0, 2), 0, np.float32),
        np.zeros((0,), np.int64),
      )
    order = np.concatenate([np.asarray(rows) for rows, _ in self._done])
    columns = [
      lax.concatenate([parts[k] for _, parts in self._done], 0)
      for k in range(COUNTS + 2)
    ]
    counts = lax.concatenate([_column(c) for c in columns[:COUNTS]], 1)
    magnitudes = lax.concatenate([_column(c) for c in columns[COUNTS:]], 1)
    return counts, magnitudes, order

  def _reduce(self, size: int) -> None:
    pending = self._pending.pop(size, [])
    if pending:
      rows = [row for row, _ in pending]
      measured = [m for _, m in pending]
      self._done.append((rows, _reduce_stacked(measured, size)))


def _column(x: jax.Array) -> jax.Array:
  return lax.broadcast_in_dim(x, (x.shape[0], 1), (0,))


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


def _reduce_stacked(measured: list[Measured], size: int) -> list[jax.Array]:
  """The comparisons, made once on the stacked values, then reduced: one
  vector per count and magnitude. Flags come from NaN-propagating maxima
  (`max |a|` is NaN where some element is, inf where one is infinite), so
  that each element costs a few operations (in `lax`, as this runs for
  every group while the program is traced)."""
  a = _stack([m.value for m in measured], size, 0, np.float32)
  b = _stack([m.shadow for m in measured], size, 0, np.float32)
  shape = a.shape
  int32, float32 = np.int32, np.float32
  magnitude = lax.abs(a)
  finite_a, finite_b = lax.is_finite(a), lax.is_finite(b)
  zero = lax.full(shape, 0, float32)
  inf = lax.full(shape, np.inf, float32)
  operands = [
    lax.convert_element_type(lax.ne(a, a), int32),  # NaN
    lax.convert_element_type(lax.eq(magnitude, inf), int32),  # inf
    lax.select(finite_b, magnitude, zero),  # not finite: RANGE
    lax.select(finite_b, zero, magnitude),  # not finite: BOTH
    lax.abs(b),  # NaN: SHADOW_NAN
    lax.select(finite_a, magnitude, zero),  # LARGEST
    lax.select(lax.gt(magnitude, zero), magnitude, inf),  # SMALLEST
  ]
  inits = [int32(0), int32(0)] + [float32(0)] * 4 + [float32(np.inf)]
  kinds = ["sum", "sum", "max", "max", "max", "max", "min"]
  positional = any(m.inputs_bad is not None for m in measured)
  checked = any(m.reference is not None for m in measured)
  if positional:
    bad = _stack([m.inputs_bad for m in measured], size, False, np.bool_)
    scale = lax.max(lax.abs(b), lax.full(shape, _FLOOR, float32))
    far = lax.gt(lax.abs(lax.sub(a, b)), lax.mul(scale, float32(_FAR)))
    absorbed = lax.bitwise_and(
      lax.bitwise_and(finite_a, finite_b), lax.bitwise_and(bad, far)
    )
    operands.append(lax.convert_element_type(absorbed, int32))
    inits.append(int32(0))
    kinds.append("sum")
  if checked:
    ref = _stack([m.reference for m in measured], size, 0, float32)
    flushed = lax.bitwise_and(lax.eq(a, zero), lax.ne(ref, zero))
    operands.append(lax.convert_element_type(flushed, int32))
    inits.append(int32(0))
    kinds.append("sum")
  combine = {"sum": lax.add, "max": lax.max, "min": lax.min}

  def reducer(x: tuple[Any, ...], y: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(combine[k](p, q) for k, p, q in zip(kinds, x, y, strict=True))

  reduced = list(lax.reduce(tuple(operands), tuple(inits), reducer, (1,)))
  nan, infs, in_range, in_both, shadow, largest, smallest = reduced[:7]
  rest = iter(reduced[7:])
  none = lax.full((len(measured),), 0, int32)
  absorbed_count = next(rest) if positional else none
  flushed_count = next(rest) if checked else none

  def not_finite(maximum: jax.Array) -> jax.Array:
    """Where a maximum of magnitudes is not finite, some one is not."""
    return lax.convert_element_type(
      lax.bitwise_not(lax.is_finite(maximum)), int32
    )

  shadow_nan = lax.convert_element_type(lax.ne(shadow, shadow), int32)
  return [
    nan,
    infs,
    not_finite(in_range),
    not_finite(in_both),
    shadow_nan,
    absorbed_count,
    flushed_count,
    largest,
    smallest,
  ]
