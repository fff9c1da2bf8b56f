"""The float16 master-weights warning: `init` was given float16 parameters
that the optimizer updates, so their updates are computed and applied in
float16, which no loss scale protects."""

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


class Float16ParamsWarning(UserWarning):
  """The warning `init` gives for float16 parameters (master weights) that
  the optimizer updates: their updates are computed and applied in
  float16.

  Examples:
    >>> import warnings
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   _ = ols.loss_scale_optimizer(optax.sgd(0.1)).init(
    ...     jnp.ones(2, jnp.float16))
    >>> caught[0].category is ols.Float16ParamsWarning
    True
  """


def warn_of_float16_params(
  params: Any, updated: Callable[[], list[bool] | None] | None
) -> None:
  """Warns once per `init` where some parameter that the optimizer updates
  is float16: the inner update then runs in float16, where an update
  smaller than half a float16 step of its parameter rounds away (a
  learning rate of 1e-4 times a gradient of 1 leaves a weight of 1 as it
  was), and a large one becomes inf. The loss scale protects the
  gradients, not the update. A parameter the optimizer never updates (a
  frozen one, `optax.set_to_zero`) is not warned of."""
  leaves = jax.tree.leaves(params)
  float16 = [getattr(x, "dtype", None) == jnp.float16 for x in leaves]
  if not any(float16):
    return
  which = updated() if updated is not None else None
  if which is None or len(which) != len(leaves):
    which = [True] * len(leaves)  # unknown: each may be updated
  named = sum(f and u for f, u in zip(float16, which, strict=True))
  if not named:
    return
  warnings.warn(
    f"float16 master weights: {named} of {len(leaves)} parameters given to"
    " `init` are float16 and updated by the optimizer, so their update is"
    " computed and applied in float16, where updates smaller than half a"
    " float16 step of the weight become zeros and large ones inf, whatever"
    " the loss scale. Keep the parameters in float32 and cast them to"
    " float16 inside the loss (`jax.tree.map(lambda p:"
    " p.astype(jnp.float16), params)`); to silence this warning,"
    ' `warnings.filterwarnings("ignore", message="float16 master'
    ' weights")`.',
    Float16ParamsWarning,
    stacklevel=4,
  )
