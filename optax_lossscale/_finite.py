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
  flags = []
  for x in jax.tree.leaves(tree):
    largest = largest_magnitude(x)
    if largest is not None:
      flags.append(jnp.isfinite(largest))
  if not flags:
    return jnp.ones([], jnp.bool_)
  return jnp.all(jnp.stack(flags))


def largest_magnitude(x) -> jax.Array | None:
  """The largest |element| of a floating leaf, NaN if any element is NaN
  (complex leaves: over real and imaginary parts apart); None for leaves that
  cannot be non-finite (integers, booleans, empty arrays).

  One max-reduction decides finiteness, taken over the bit patterns of the
  magnitudes as unsigned integers: for non-negative floats their order is
  the order of the values, with inf above every finite value and every NaN
  above inf. A float `max` would not do: XLA's vectorized max on CPU drops
  NaNs in large arrays. It vectorizes, where a reduction of `isfinite`
  booleans does not.
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.inexact) or x.size == 0:
    return None
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return jnp.maximum(largest_magnitude(jnp.real(x)),
                       largest_magnitude(jnp.imag(x)))
  unsigned = _UNSIGNED[x.dtype.itemsize]
  sign_bit = jnp.asarray(1 << (8 * x.dtype.itemsize - 1), unsigned)
  magnitudes = lax.bitcast_convert_type(x, unsigned) & ~sign_bit
  return lax.bitcast_convert_type(jnp.max(magnitudes), x.dtype)


_UNSIGNED = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def all_finite_across(finite: jax.Array, axis_name) -> jax.Array:
  """Reduces one boolean over `axis_name`, so that every replica agrees."""
  if axis_name is None:
    return finite
  # One int32 scalar per replica crosses the interconnect, not the gradients.
  return lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
