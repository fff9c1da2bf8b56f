"""The model: an MLP over the previous ``context`` characters (Bengio et al.
style), embedding -> ``depth`` tanh layers -> logits over the vocabulary.
Small enough for a CPU, and its loss is a mean over many tokens, which is
where float16's underflow comes from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]


def init_params(
  key: jax.Array, vocab: int, context: int, embed: int, width: int, depth: int
) -> Params:
  """float32 parameters: ``embed``, then ``h0`` .. ``h{depth-1}`` and
  ``out``, each ``{"w", "b"}``, scaled by 1/sqrt(fan-in) so that the tanh
  layers start unsaturated."""
  keys = jax.random.split(key, depth + 2)
  params: Params = {"embed": 0.5 * jax.random.normal(keys[0], (vocab, embed))}
  fan_in = context * embed
  for i in range(depth):
    params[f"h{i}"] = {
      "w": jax.random.normal(keys[i + 1], (fan_in, width)) / np.sqrt(fan_in),
      "b": jnp.zeros((width,)),
    }
    fan_in = width
  params["out"] = {
    "w": jax.random.normal(keys[-1], (fan_in, vocab)) / np.sqrt(fan_in),
    "b": jnp.zeros((vocab,)),
  }
  return params


def apply(
  params: Params,
  x: jax.Array,
  depth: int,
  taps: Sequence[jax.Array] | None = None,
  corrupt: jax.Array | None = None,
) -> jax.Array:
  """Logits, in the params' dtype; ``x`` is ``[batch, context]`` int32.
  ``taps`` (zeros, one per pre-activation and one for the logits) exist only
  so that the gradients w.r.t. activations can be read off. ``corrupt``
  (a bool scalar) makes the batch a corrupted one: one NaN in its embedded
  activations (``corrupted_embedding``)."""
  dtype = params["embed"].dtype

  def tap(i: int) -> jax.Array | int:
    return 0 if taps is None else taps[i].astype(dtype)

  h = params["embed"][x].reshape(x.shape[0], -1)
  if corrupt is not None:
    h = corrupted_embedding(h, corrupt)
  for i in range(depth):
    layer = params[f"h{i}"]
    h = jnp.tanh(h @ layer["w"] + layer["b"] + tap(i))
  return h @ params["out"]["w"] + params["out"]["b"] + tap(depth)


def corrupted_embedding(h: jax.Array, corrupt: jax.Array) -> jax.Array:
  """The embedded activations ``h`` with a NaN in their first element where
  ``corrupt``, unchanged elsewhere (``0`` added). The token ids are int32
  and cannot hold a NaN; a record that decodes to garbage does the same one
  layer later, and one NaN is enough: it spreads to every logit of its row,
  to the loss, and through the backward pass to every gradient.

  >>> h = jnp.ones((2, 3), jnp.float16)
  >>> corrupted_embedding(h, jnp.bool_(True))[0].tolist()
  [nan, 1.0, 1.0]
  >>> bool(jnp.all(corrupted_embedding(h, jnp.bool_(False)) == h))
  True
  """
  poison = jnp.where(corrupt, jnp.nan, 0.0).astype(h.dtype)
  return h.at[0, 0].add(poison)


def loss_fn(
  params: Params,
  x: jax.Array,
  y: jax.Array,
  taps: Sequence[jax.Array] | None = None,
  *,
  depth: int,
  compute_dtype: Any,
  replicas: int = 1,
  corrupt: jax.Array | None = None,
) -> jax.Array:
  """Token-level mean cross-entropy. The float32 master params are cast to
  ``compute_dtype`` here, inside the differentiated function, so that the
  backward pass runs (and rounds) in ``compute_dtype``; the logits go back
  to float32 for the softmax and the mean.

  With ``replicas = R > 1`` this is one data-parallel replica's share of a
  global token mean: its tokens' summed loss divided by ``R`` times its own
  token count (the global count when every replica holds as many).
  ``corrupt``: see ``apply``."""
  p = jax.tree.map(lambda a: a.astype(compute_dtype), params)
  logits = apply(p, x, depth, taps, corrupt).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, y[:, None], axis=1)
  return jnp.sum(nll) / (nll.size * replicas)


def zero_taps(params: Params, x: jax.Array, depth: int) -> list[jax.Array]:
  """Zeros shaped like every pre-activation and the logits of a batch
  ``x``: differentiating the loss w.r.t. them gives the activation
  gradients, per token."""
  width = params["h0"]["w"].shape[1]
  vocab = params["out"]["w"].shape[1]
  return [jnp.zeros((x.shape[0], width))] * depth + [
    jnp.zeros((x.shape[0], vocab))
  ]


def evaluate(
  params: Params, x: jax.Array, y: jax.Array, depth: int
) -> tuple[jax.Array, jax.Array]:
  """Held-out loss in float32 (nats per char) and next-char accuracy: every
  run is judged in the same precision, whatever it trained in."""
  logits = apply(params, x, depth)
  logp = jax.nn.log_softmax(logits)
  loss = -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
  acc = jnp.mean(jnp.argmax(logits, -1) == y)
  return loss, acc
