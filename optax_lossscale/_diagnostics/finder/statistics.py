"""What each value is reduced to, on the device: six counts (NaN, inf, not
finite where its float32 shadow is finite, NaN in the shadow, changed far
from the shadow where an input was not finite, flushed to zero) and two
magnitudes (the largest finite, the smallest nonzero).

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

# Columns of the counts.
NAN = 0  # NaN
INF = 1  # infinite
RANGE = 2  # not finite, though its float32 shadow is finite
SHADOW_NAN = 3  # NaN in the shadow
ABSORBED = 4  # finite but far from its shadow (`_FAR`) where an input is
# not finite (elementwise): `rsqrt(inf)` is 0 where float32 gives 0.004
FLUSHED = 5  # zero where the same operation in float32 is not
COUNTS = 6
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
  return lax.reshape(x, (int(np.prod(x.shape, dtype=np.int64)),))


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
  vector per count and magnitude (in `lax`, as this runs for every group
  while the program is traced)."""
  a = _stack([m.value for m in measured], size, 0, np.float32)
  b = _stack([m.shadow for m in measured], size, 0, np.float32)
  shape = a.shape
  int32 = np.int32
  finite_a, finite_b = lax.is_finite(a), lax.is_finite(b)
  nan_a = lax.ne(a, a)
  not_finite = lax.bitwise_not(finite_a)
  magnitude = lax.abs(a)
  zero = lax.full(shape, 0, np.float32)
  none = lax.full((len(measured),), 0, int32)
  operands = [
    lax.convert_element_type(nan_a, int32),
    lax.convert_element_type(
      lax.bitwise_and(not_finite, lax.bitwise_not(nan_a)), int32
    ),
    lax.convert_element_type(lax.bitwise_and(not_finite, finite_b), int32),
    lax.convert_element_type(lax.ne(b, b), int32),
  ]
  positional = any(m.inputs_bad is not None for m in measured)
  checked = any(m.reference is not None for m in measured)
  if positional:
    bad = _stack([m.inputs_bad for m in measured], size, False, np.bool_)
    scale = lax.max(lax.abs(b), lax.full(shape, _FLOOR, np.float32))
    far = lax.gt(lax.abs(lax.sub(a, b)), lax.mul(scale, np.float32(_FAR)))
    absorbed = lax.bitwise_and(
      lax.bitwise_and(finite_a, finite_b), lax.bitwise_and(bad, far)
    )
    operands.append(lax.convert_element_type(absorbed, int32))
  if checked:
    ref = _stack([m.reference for m in measured], size, 0, np.float32)
    flushed = lax.bitwise_and(lax.eq(a, zero), lax.ne(ref, zero))
    operands.append(lax.convert_element_type(flushed, int32))
  counted = len(operands)
  operands.append(lax.select(finite_a, magnitude, zero))
  operands.append(
    lax.select(
      lax.bitwise_and(finite_a, lax.gt(magnitude, zero)),
      magnitude,
      lax.full(shape, np.inf, np.float32),
    )
  )
  inits = [int32(0)] * counted + [np.float32(0), np.float32(np.inf)]

  def combine(x: tuple[Any, ...], y: tuple[Any, ...]) -> tuple[Any, ...]:
    sums = [
      lax.add(p, q) for p, q in zip(x[:counted], y[:counted], strict=True)
    ]
    return (*sums, lax.max(x[counted], y[counted]), lax.min(x[-1], y[-1]))

  reduced = list(lax.reduce(tuple(operands), tuple(inits), combine, (1,)))
  counts = reduced[:4]
  counts.append(reduced[4] if positional else none)
  counts.append(reduced[5 if positional else 4] if checked else none)
  return [*counts, reduced[counted], reduced[counted + 1]]
