"""The few numbers each value is reduced to, on the device, where it is
made: counts of NaNs, infs, elements made non-finite there, and elements
flushed to zero; its largest and smallest nonzero finite magnitudes.

A value is reduced soon after it is made, together with the few values of
its size made just before it (`graph.GROUP` at most), in one variadic
reduction: the program holds no value much longer than the gradient
program itself does, so the finder's memory stays near a plain
`value_and_grad`'s, and compiles one kernel per group.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# Columns of the counts.
NAN, INF, MADE, FLUSHED = range(4)
UNKNOWN = -1  # a count that this value has no way to know
# Columns of the magnitudes.
LARGEST, SMALLEST = range(2)


class Operands(NamedTuple):
  """A value's per-element operands of the reduction (raveled), and whether
  its `made` and `flushed` counts mean anything."""

  arrays: tuple[jax.Array, ...]
  made_known: bool
  flushed_known: bool


def value_statistics(
  out: jax.Array, ins: list[jax.Array] | None, reference: Any
) -> tuple[jax.Array, jax.Array]:
  """`[nan, inf, made, flushed]` counts (int32) and `[largest, smallest
  nonzero]` finite magnitudes (float32) of `out` (see `operands`)."""
  ((counts, magnitudes),) = reduce_group([operands(out, ins, reference)])
  return counts, magnitudes


def operands(
  out: jax.Array, ins: list[jax.Array] | None, reference: Any
) -> Operands:
  """Per element of `out` (raveled), what its statistics sum or bound.

  `ins` are the floating-point inputs of an elementwise operation (each of
  `out`'s shape, or a scalar): an element is *made* non-finite there when
  it is an inf or a NaN although every input's element at its position is
  finite, or a NaN although none is a NaN (an inf minus an inf). Without
  `ins`, `made` is `UNKNOWN`: the host decides from the inputs' counts.
  `reference`, the same operation in float32, gives `flushed`: elements
  that are zero although the reference's are not (else `UNKNOWN`).
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
  arrays = (
    nan.astype(jnp.int32),
    (~finite & ~nan).astype(jnp.int32),
    made,
    flushed,
    jnp.where(finite, magnitude, 0.0),
    jnp.where(finite & (magnitude > 0), magnitude, jnp.inf),
  )
  return Operands(
    tuple(jnp.ravel(a) for a in arrays), ins is not None, reference is not None
  )


def reduce_group(
  group: list[Operands],
) -> list[tuple[jax.Array, jax.Array]]:
  """The statistics of values of one size, as one variadic reduction into
  which the compiler fuses the elementwise work: one kernel for the group,
  and no full-size temporary per statistic."""
  arrays = [a for arrays, _, _ in group for a in arrays]
  zero, inf = jnp.int32(0), jnp.float32(jnp.inf)
  init = (zero, zero, zero, zero, jnp.float32(0), inf) * len(group)
  reduced = jax.lax.reduce(tuple(arrays), init, _combine, (0,))
  unknown = jnp.int32(UNKNOWN)
  results = []
  for k, (_, made_known, flushed_known) in enumerate(group):
    nan, inf_, made, flushed, largest, smallest = reduced[6 * k : 6 * k + 6]
    counts = jnp.stack(
      [
        nan,
        inf_,
        made if made_known else unknown,
        flushed if flushed_known else unknown,
      ]
    )
    results.append((counts, jnp.stack([largest, smallest])))
  return results


def _combine(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
  out = []
  for k in range(0, len(a), 6):
    out += [
      a[k] + b[k],
      a[k + 1] + b[k + 1],
      a[k + 2] + b[k + 2],
      a[k + 3] + b[k + 3],
      jnp.maximum(a[k + 4], b[k + 4]),
      jnp.minimum(a[k + 5], b[k + 5]),
    ]
  return tuple(out)
