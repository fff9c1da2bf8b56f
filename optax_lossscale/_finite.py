"""One boolean for a whole gradient tree."""

import jax
import jax.numpy as jnp
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
  flags = [_leaf_finite(x) for x in jax.tree.leaves(tree)]
  if not flags:
    return jnp.ones([], jnp.bool_)
  return jnp.all(jnp.stack(flags))


def _leaf_finite(x) -> jax.Array:
  # `all(isfinite)`, not a max-reduction of magnitudes: XLA's vectorized
  # float max on CPU drops NaNs in large arrays, and the exact alternatives
  # measured (a max over bit patterns, NaN mapped to inf) made XLA
  # materialize a gradient-sized temporary in the optimizer step.
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.ones([], jnp.bool_)
  return jnp.all(jnp.isfinite(x))


def all_finite_across(finite: jax.Array, axis_name) -> jax.Array:
  """Reduces one boolean over `axis_name`, so that every replica agrees."""
  if axis_name is None:
    return finite
  # One int32 scalar per replica crosses the interconnect, not the gradients.
  return lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
