"""The NaN/inf vocabulary: how a value is not finite, as one code.

A code says it of anything checked (an element, a leaf, a tree, a
replica's verdict): `FINITE` (0), `INF` (1: an overflow to inf, and no NaN)
or `NAN` (2). Codes combine by `max`, so one reduction carries any number
of them, across elements, leaves or devices. A reduction over gradients
computes the same facts as two booleans, `(finite, nan)` (XLA on CPU keeps
a two-boolean reduction whole where it splits a max, see
`reductions.every_and_some`); `code_of` and `flags_of` go between the two.

A float is read through its magnitude, the bits of all but its sign as an
unsigned integer: magnitudes order as the floats do, and every NaN lies
above inf (IEEE 754). No float is converted, and no float max is taken
(XLA's vectorized float max on CPU drops NaNs in large arrays).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FINITE, INF, NAN = 0, 1, 2
# One dtype for every code, from an element's to what crosses devices: an
# `int8` for each leaf's was no faster (benchmarks/README.md, "The check's
# forms", "One code dtype").
CODE_DTYPE = jnp.int32

# By dtype, as unsigned integers of its width: the bits of the magnitude,
# and the magnitude of inf. Complex and float8 (in whose e4m3fn NaN is not
# all ones) have none, and are read by `unmasked_flags`.
_MASKS: dict[np.dtype, tuple[np.unsignedinteger, np.unsignedinteger]] = {
  jnp.dtype(jnp.float16): (np.uint16(0x7FFF), np.uint16(0x7C00)),
  jnp.dtype(jnp.bfloat16): (np.uint16(0x7FFF), np.uint16(0x7F80)),
  jnp.dtype(jnp.float32): (np.uint32(0x7FFF_FFFF), np.uint32(0x7F80_0000)),
  jnp.dtype(jnp.float64): (
    np.uint64(0x7FFF_FFFF_FFFF_FFFF),
    np.uint64(0x7FF0_0000_0000_0000),
  ),
}


def code_of(finite: jax.Array, nan: jax.Array) -> jax.Array:
  """The codes of `finite` and `nan`, booleans of one shape (a NaN is never
  finite): `not finite + nan`."""
  return lax.add(
    lax.convert_element_type(lax.bitwise_not(finite), CODE_DTYPE),
    lax.convert_element_type(nan, CODE_DTYPE),
  )


def flags_of(codes: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of the worst of `codes` (any shape)."""
  worst = jnp.max(codes)
  return worst == FINITE, worst == NAN


def has_magnitude(dtype: Any) -> bool:
  """Whether values of `dtype` are read through their magnitude bits."""
  return jnp.dtype(dtype) in _MASKS


def magnitude(x: jax.Array) -> jax.Array:
  """The magnitude of each element of `x` (a dtype `has_magnitude`)."""
  mask, _ = _MASKS[x.dtype]
  return lax.bitwise_and(lax.bitcast_convert_type(x, mask.dtype), mask)


def magnitude_flags(
  magnitudes: jax.Array, dtype: Any
) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of each of `magnitudes` of values of `dtype`."""
  _, inf = _MASKS[jnp.dtype(dtype)]
  return lax.lt(magnitudes, inf), lax.gt(magnitudes, inf)


def magnitude_codes(magnitudes: jax.Array, dtype: Any) -> jax.Array:
  """The code of each of `magnitudes` of values of `dtype`."""
  _, inf = _MASKS[jnp.dtype(dtype)]
  return lax.add(
    lax.convert_element_type(lax.ge(magnitudes, inf), CODE_DTYPE),
    lax.convert_element_type(lax.gt(magnitudes, inf), CODE_DTYPE),
  )


def unmasked_flags(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(finite, nan)` of all of `x`, of a dtype without a magnitude (complex:
  each part; float8)."""
  return jnp.all(jnp.isfinite(x)), jnp.any(jnp.isnan(x))
