"""The few numbers each value is reduced to, on the device, where it is
made: counts of NaNs, infs, elements made non-finite there, and elements
flushed to zero; its largest and smallest nonzero finite magnitudes.

Each value is reduced as soon as it exists, so the program holds no value
longer than the gradient program itself does: the finder's memory stays
that of a plain `value_and_grad` plus a few numbers per value.
"""

from typing import Any

import jax
import jax.numpy as jnp

# Columns of the counts.
NAN, INF, MADE, FLUSHED = range(4)
UNKNOWN = -1  # a count that this value has no way to know
# Columns of the magnitudes.
LARGEST, SMALLEST = range(2)


def value_statistics(
  out: jax.Array, ins: list[jax.Array] | None, reference: Any
) -> tuple[jax.Array, jax.Array]:
  """`[nan, inf, made, flushed]` counts (int32) and `[largest, smallest
  nonzero]` finite magnitudes (float32) of `out`.

  `ins` are the floating-point inputs of an elementwise operation (each of
  `out`'s shape, or a scalar): an element is *made* non-finite there when
  it is an inf or a NaN although every input's element at its position is
  finite, or a NaN although none is a NaN (an inf minus an inf). Without
  `ins`, `made` is `UNKNOWN`: the host decides from the inputs' counts.
  `reference`, the same operation in float32, gives `flushed`: elements
  that are zero although the reference's are not (else `UNKNOWN`).

  All six are one variadic reduction, into which the compiler fuses the
  elementwise work: no full-size temporary per statistic.
  """
  nan = jnp.isnan(out)
  finite = jnp.isfinite(out)
  zeros = jnp.zeros(out.shape, jnp.int32)
  if ins is None:
    made = zeros
  else:
    inputs_finite = jnp.ones(out.shape, bool)
    inputs_no_nan = jnp.ones(out.shape, bool)
    for x in ins:
      inputs_finite = inputs_finite & jnp.isfinite(x)
      inputs_no_nan = inputs_no_nan & ~jnp.isnan(x)
    made = ((~finite & inputs_finite) | (nan & inputs_no_nan)).astype(jnp.int32)
  if reference is None:
    flushed = zeros
  else:
    flushed = ((reference != 0) & (out == 0)).astype(jnp.int32)
  magnitude = jnp.abs(out).astype(jnp.float32)
  operands = (
    nan.astype(jnp.int32),
    (~finite & ~nan).astype(jnp.int32),
    made,
    flushed,
    jnp.where(finite, magnitude, 0.0),
    jnp.where(finite & (magnitude > 0), magnitude, jnp.inf),
  )
  zero, inf = jnp.int32(0), jnp.float32(jnp.inf)
  nan_, inf_, made_, flushed_, largest, smallest = jax.lax.reduce(
    operands,
    (zero, zero, zero, zero, jnp.float32(0), inf),
    _combine,
    tuple(range(out.ndim)),
  )
  unknown = jnp.int32(UNKNOWN)
  counts = jnp.stack(
    [
      nan_,
      inf_,
      unknown if ins is None else made_,
      unknown if reference is None else flushed_,
    ]
  )
  return counts, jnp.stack([largest, smallest])


def _combine(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
  return (
    a[0] + b[0],
    a[1] + b[1],
    a[2] + b[2],
    a[3] + b[3],
    jnp.maximum(a[4], b[4]),
    jnp.minimum(a[5], b[5]),
  )
