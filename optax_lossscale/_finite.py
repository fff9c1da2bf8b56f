"""One boolean for a whole gradient tree."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def all_finite(tree) -> jax.Array:
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
  leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
  # Integer and boolean leaves are always finite; empty ones hold nothing.
  leaves = [x for x in leaves
            if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
  if not leaves:
    return jnp.ones([], jnp.bool_)
  # Two formulations of one exact check, chosen when the step is lowered
  # (no branch at run time): on CPU, one reduction per leaf (see
  # `_leaf_finite_cpu`); elsewhere, one reduction per group of leaves
  # concatenated, which XLA fuses into one kernel per group instead of one
  # or two per leaf. Measured with
  # `jax.profiler` on an H100, the per-leaf check cost 100 kernel launches
  # for 50 leaves (about the device time of adam itself); on CPU, the
  # concatenation is materialized and runs 6-10x slower.
  return lax.platform_dependent(*leaves, cpu=_per_leaf, default=_concatenated)


def _per_leaf(*leaves) -> jax.Array:
  # `all(isfinite)`, not a max-reduction of magnitudes: XLA's vectorized
  # float max on CPU drops NaNs in large arrays, and the exact alternatives
  # measured (a max over bit patterns, NaN mapped to inf) made XLA
  # materialize a gradient-sized temporary in the optimizer step.
  return jnp.all(jnp.stack([_leaf_finite_cpu(x) for x in leaves]))


# Leaves of at least this many elements are checked in one pass (below).
# Measured on CPU: the one-pass form is 0.4-0.7x the time of the plain one
# from here up; on 1,000 leaves of 1,000 elements it compiled and ran slower.
_ONE_PASS_FROM = 2**14


def _leaf_finite_cpu(x) -> jax.Array:
  finite = jnp.isfinite(x)
  if x.size < _ONE_PASS_FROM:
    return jnp.all(finite)
  # A reduction of two operands at once. XLA on CPU splits a one-operand
  # reduction into a tree of reduce-windows and materializes `isfinite` (a
  # byte per element) in front of it, through a transposing copy when the
  # gradient is a transposed matmul output; it leaves a reduction of two
  # operands whole, with `isfinite` fused in: one pass over the leaf, no
  # temporary. The second operand (is any element not finite?) keeps the
  # reduction variadic; both answers agree, and both are used so that XLA
  # keeps both.
  all_finite, any_not_finite = lax.reduce(
      (finite, ~finite), (np.bool_(True), np.bool_(False)),
      _and_or, tuple(range(x.ndim)))
  return all_finite & ~any_not_finite


def _and_or(a, b):
  return a[0] & b[0], a[1] | b[1]


# Leaves per concatenation: at 1,000 leaves in one concatenation XLA on GPU
# materialized it (a gradient-sized temporary); groups of this size fuse.
_LEAVES_PER_CONCATENATION = 64


def _concatenated(*leaves) -> jax.Array:
  flags = []
  for dtype in sorted({x.dtype for x in leaves}, key=str):
    flat = [x.ravel() for x in leaves if x.dtype == dtype]
    for start in range(0, len(flat), _LEAVES_PER_CONCATENATION):
      group = flat[start:start + _LEAVES_PER_CONCATENATION]
      flags.append(jnp.all(jnp.isfinite(jnp.concatenate(group))))
  return jnp.all(jnp.stack(flags))


def all_finite_across(finite: jax.Array, axis_name) -> jax.Array:
  """Reduces one boolean over `axis_name`, so that every replica agrees."""
  if axis_name is None:
    return finite
  # One int32 scalar per replica crosses the interconnect, not the gradients.
  return lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
