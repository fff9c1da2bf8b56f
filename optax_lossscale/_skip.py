"""The skip: keep the inner state and zero the updates on non-finite steps.

A select with `jnp.where` on a device boolean: no host round trip, no Python
branch on a traced value, correct under jit, pmap, shard_map, scan and vmap.
"""

import jax
import jax.numpy as jnp


def keep_unless(finite: jax.Array, new, old):
  """`new` where `finite`, else `old`, leaf by leaf in `old`'s dtype.

  The cast back matters: `jnp.where` promotes, and a state whose dtypes drift
  retraces the step and breaks checkpoints.
  """
  return jax.tree.map(
      lambda n, o: jnp.where(finite, n, o).astype(jnp.result_type(o)),
      new, old,
  )
