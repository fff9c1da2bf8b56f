"""What each value is reduced to, on the device: per value, whether any
element is NaN, infinite, not finite where its float32 shadow is finite,
and so on (bits), four counts and two magnitudes.

Values are reduced in groups: up to `GROUP` values of one size (small ones
padded to a power of two) are stacked, in float32, beside their shadows,
and every per-element comparison is made once on the stack, then reduced
in one variadic reduction. The compiler's work then grows with the number
of groups, not with the number of values times the comparisons: a
reduction per value, or comparisons written per value, cost about as much
to compile as the program itself, ten times over.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The bits a value's elements have, OR'ed together.
NAN = 0  # NaN
INF = 1  # infinite
RANGE = 2  # not finite, though its float32 shadow is
BOTH = 3  # not finite, nor is its shadow
SHADOW_NAN = 4  # its shadow is NaN
ABSORBED = 5  # finite but far from its shadow (`_FAR`), where an input is
# not finite (elementwise): `rsqrt(inf)` is 0 where float32 gives 0.004
# Columns of the counts, and of the magnitudes.
COUNT_NAN, COUNT_INF, COUNT_FLUSHED = range(3)
LARGEST, SMALLEST = range(2)

# A finite value is far from its shadow when by more than this share of
# the shadow's magnitude (or of float16's smallest normal number): far
# more than rounding moves it, as a token's activations zeroed are.
_FAR = 0.25
_FLOOR = 2.0**-14

GROUP = 16  # values reduced together, at most
_GROUP_BYTES = 2**24  # and at most this many bytes per stacked array
_PADDED = 2**16  # values up to this size are padded to a power of two


class Measured(NamedTuple):
  """A value and what it is compared with, raveled, in float32."""

  value: jax.Array  # its largest part's magnitude for a complex one
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
  operation computed in float32 from `value`'s own inputs: where it is
  not zero and `value` is, float16 flushed a value to zero.
  """
  bad = None
  if inputs:
    finite = None
    for x in inputs:
      x_finite = _finite(x)
      finite = x_finite if finite is None else finite & x_finite
    assert finite is not None
    bad = jnp.ravel(jnp.broadcast_to(~finite, value.shape))
  if reference is not None:
    reference = jnp.ravel(_real32(reference))
  return Measured(
    jnp.ravel(_real32(value)), jnp.ravel(_real32(shadow)), bad, reference
  )


def _real32(x: jax.Array) -> jax.Array:
  """`x` in float32; for a complex `x`, its larger part's magnitude (NaN
  or inf where a part is)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return lax.max(lax.abs(lax.real(x)), lax.abs(lax.imag(x))).astype(
      np.float32
    )
  return lax.convert_element_type(x, np.float32)


def _finite(x: jax.Array) -> jax.Array:
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return lax.is_finite(lax.real(x)) & lax.is_finite(lax.imag(x))
  return lax.is_finite(x)


class Groups:
  """Measured values waiting to be reduced, grouped by size; `add` returns
  a row number, `results` the rows' statistics."""

  def __init__(self) -> None:
    self._pending: dict[int, list[tuple[int, Measured]]] = {}
    self._rows = 0
    self._done: list[tuple[list[int], tuple[jax.Array, ...]]] = []

  def add(self, measured: Measured) -> int:
    row = self._rows
    self._rows += 1
    bucket = _bucket(int(measured.value.shape[0]))
    pending = self._pending.setdefault(bucket, [])
    pending.append((row, measured))
    if len(pending) >= min(GROUP, max(1, _GROUP_BYTES // (4 * bucket))):
      self._reduce(bucket)
    return row

  def results(self) -> tuple[jax.Array, jax.Array, jax.Array, np.ndarray]:
    """`(bits, counts, magnitudes, order)`: per row in reduction order, the
    bits its elements have (int32), its counts (int32, 3 columns) and
    magnitudes (float32, 2 columns); `order[k]` is the k-th result's
    row."""
    for bucket in list(self._pending):
      self._reduce(bucket)
    if not self._done:
      return (
        jnp.zeros((0,), jnp.int32),
        jnp.zeros((0, 3), jnp.int32),
        jnp.zeros((0, 2), jnp.float32),
        np.zeros((0,), np.int64),
      )
    order = np.concatenate([np.asarray(rows) for rows, _ in self._done])
    bits, counts, magnitudes = (
      jnp.concatenate([parts[k] for _, parts in self._done]) for k in range(3)
    )
    return bits, counts, magnitudes, order

  def _reduce(self, bucket: int) -> None:
    pending = self._pending.pop(bucket, [])
    if not pending:
      return
    rows = [row for row, _ in pending]
    measured = [m for _, m in pending]
    self._done.append((rows, _reduce_stacked(measured, bucket)))


def _bucket(size: int) -> int:
  if size > _PADDED:
    return size
  return 1 << max(0, (size - 1).bit_length())


def _stack(arrays: list[jax.Array | None], size: int, fill: Any) -> jax.Array:
  """The arrays, each padded to `size` with `fill` (None: all `fill`), as
  one [len, size] array."""
  rows = []
  for x in arrays:
    if x is None:
      rows.append(jnp.full((size,), fill))
    elif x.shape[0] == size:
      rows.append(x)
    else:
      pad = jnp.asarray(fill, x.dtype)
      rows.append(lax.pad(x, pad, [(0, size - x.shape[0], 0)]))
  return jnp.stack(rows)


def _reduce_stacked(
  measured: list[Measured], size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The comparisons, made once on the stacked values, then reduced."""
  a = _stack([m.value for m in measured], size, np.float32(0))
  b = _stack([m.shadow for m in measured], size, np.float32(0))
  bad = _stack([m.inputs_bad for m in measured], size, False)
  checked = any(m.reference is not None for m in measured)
  finite_a, finite_b = lax.is_finite(a), lax.is_finite(b)
  nan_a, nan_b = lax.ne(a, a), lax.ne(b, b)
  magnitude = lax.abs(a)
  far = lax.abs(a - b) > _FAR * lax.max(lax.abs(b), jnp.full_like(b, _FLOOR))

  def bit(mask: jax.Array, k: int) -> jax.Array:
    return lax.select(mask, jnp.full(mask.shape, 1 << k, np.int32),
                      jnp.zeros(mask.shape, np.int32))  # fmt: skip

  not_finite = ~finite_a
  bits = (
    bit(nan_a, NAN)
    + bit(not_finite & ~nan_a, INF)
    + bit(not_finite & finite_b, RANGE)
    + bit(not_finite & ~finite_b, BOTH)
    + bit(nan_b, SHADOW_NAN)
    + bit(finite_a & finite_b & bad & far, ABSORBED)
  )
  operands = [
    bits,
    nan_a.astype(np.int32),
    (not_finite & ~nan_a).astype(np.int32),
    lax.select(finite_a, magnitude, jnp.zeros_like(magnitude)),
    lax.select(finite_a & (magnitude > 0), magnitude,
               jnp.full_like(magnitude, np.inf)),
  ]  # fmt: skip
  inits = [np.int32(0)] * 3 + [np.float32(0), np.float32(np.inf)]
  if checked:
    ref = _stack([m.reference for m in measured], size, np.float32(0))
    operands.append(((a == 0) & (ref != 0)).astype(np.int32))
    inits.append(np.int32(0))
  reduced = lax.reduce(tuple(operands), tuple(inits), _combine, (1,))
  flushed = reduced[5] if checked else jnp.zeros_like(reduced[1])
  counts = jnp.stack([reduced[1], reduced[2], flushed], axis=1)
  magnitudes = jnp.stack([reduced[3], reduced[4]], axis=1)
  return reduced[0], counts, magnitudes


def _combine(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
  out = [
    lax.bitwise_or(a[0], b[0]),
    a[1] + b[1],
    a[2] + b[2],
    lax.max(a[3], b[3]),
    lax.min(a[4], b[4]),
  ]
  if len(a) > 5:
    out.append(a[5] + b[5])
  return tuple(out)
