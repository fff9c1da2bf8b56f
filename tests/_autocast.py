"""What the autocast tests share: a walk over every equation of a program
(nested bodies included), counts of equations by primitive and dtype, and
small models written in the styles the policy must read."""

import collections
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core


def enable_x64():
  """`jax.enable_x64(True)` (jax >= 0.8), or `jax.experimental.enable_x64()`
  (jax 0.7)."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(True)
  from jax import experimental

  return experimental.enable_x64()


PRODUCTS = frozenset(
  {"dot_general", "conv_general_dilated", "ragged_dot_general"}
)


def _bodies(value: Any) -> Iterator[Any]:
  if isinstance(value, jex_core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jex_core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _bodies(v)


def equations(jaxpr: Any) -> Iterator[Any]:
  """Every equation of `jaxpr` (a `Jaxpr` or `ClosedJaxpr`), those of the
  bodies of its calls, loops, branches and custom rules included."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for body in _bodies(value):
        yield from equations(body)


def program(fun: Callable[..., Any], *args: Any) -> Any:
  """The jaxpr of `fun` on `args`."""
  return jax.make_jaxpr(fun)(*args)


def dtype_counts(
  jaxpr: Any, names: frozenset[str] | set[str] | None = None
) -> collections.Counter:
  """`(primitive, output dtype) -> count` over every equation (of those
  named in `names`, where given) whose first output is an array."""
  counts: collections.Counter = collections.Counter()
  for eqn in equations(jaxpr):
    name = eqn.primitive.name
    if names is not None and name not in names:
      continue
    aval = eqn.outvars[0].aval
    counts[name, np.dtype(aval.dtype).name] += 1
  return counts


def operand_dtypes(jaxpr: Any, name: str) -> list[tuple[str, ...]]:
  """The operand dtypes of each equation of primitive `name`."""
  return [
    tuple(np.dtype(v.aval.dtype).name for v in eqn.invars)
    for eqn in equations(jaxpr)
    if eqn.primitive.name == name
  ]


def products_by_dtype(jaxpr: Any) -> dict[str, int]:
  """How many products have a result of each dtype."""
  counts: collections.Counter = collections.Counter()
  for (_, dtype), n in dtype_counts(jaxpr, PRODUCTS).items():
    counts[dtype] += n
  return dict(counts)


# A small MLP and a small transformer, float32 parameters, no casts.


def mlp_init(key: jax.Array, sizes=(8, 16, 16, 4)) -> list[dict[str, Any]]:
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {
      "w": jax.random.normal(k, (m, n)) / math.sqrt(m),
      "b": jnp.zeros(n),
    }
    for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def mlp_loss(params: list[dict[str, Any]], x: Any, y: Any) -> jax.Array:
  h = x
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      h = jax.nn.gelu(h)
  logp = jax.nn.log_softmax(h)
  return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


def mlp_loss_by_hand(params: list[dict[str, Any]], x: Any, y: Any) -> jax.Array:
  """`autocast(mlp_loss)`'s policy written by hand: products on float16
  casts, the float32 bias promoting their results to float32."""
  h = x
  for i, layer in enumerate(params):
    h = h.astype(jnp.float16) @ layer["w"].astype(jnp.float16) + layer["b"]
    if i < len(params) - 1:
      h = jax.nn.gelu(h)
  logp = jax.nn.log_softmax(h)
  return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))
