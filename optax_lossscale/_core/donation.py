"""Keeping a donated state buffer in use from one step to the next.

The rule (`_rule`) is a pure function of (state, finite); what is here only
changes how XLA allocates the flag it computes, never its value.
"""

import jax
from jax import lax

from optax_lossscale._jaxpr import compat as _compat


def last_finite_flag(old_flag: jax.Array, finite: jax.Array) -> jax.Array:
  """`finite`, computed so that it reads `old_flag` where that matters.

  `jit` drops an input that the step never reads, and a donated state leaf
  that is dropped cannot lend its buffer to its successor: that output then
  gets a fresh buffer every step. On GPU a fresh address makes XLA update its
  command buffer (CUDA graph) on every call, which slowed a small step's
  wall-clock; there the flag is computed from the old one too, which XLA
  folds away. On CPU the read itself slowed the adam step, and the input
  stays in the program all the same (the branch is chosen when the step is
  compiled), so its buffer is reused either way (benchmarks/README.md).
  """
  # Inside `shard_map` a state that differs by shard varies over its axes,
  # and the flag (agreed by every shard) does not: both branches must give
  # one type.
  finite = _compat.varying_like(finite, old_flag)
  return lax.platform_dependent(
    old_flag, finite, cpu=_finite_alone, default=_finite_reading_old
  )


def _finite_alone(old_flag: jax.Array, finite: jax.Array) -> jax.Array:
  del old_flag
  return finite


def _finite_reading_old(old_flag: jax.Array, finite: jax.Array) -> jax.Array:
  return finite & (old_flag | finite)
