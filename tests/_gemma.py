"""A small Gemma-style transformer in plain jax, for the diagnostics' tests.

Written from Gemma's public description (the Gemma papers and model card),
not from its code: a token embedding scaled by the square root of the
model width; pre-norm blocks whose RMSNorm multiplies by ``1 + scale`` and
computes in the model's dtype; RMSNorm on the queries and the keys;
attention masked by ``where`` with a large finite constant (``K_MASK``); a
gated gelu MLP, ``(gelu(x W_gate) * x W_up) W_down`` with the tanh
approximation (which takes a cube); a final norm; and logits decoded with
the embedding table itself (tied). No positional embedding: the tests need
none, and rotary embeddings add nothing float16 can overflow at this size.

Master weights are float32; the loss casts them to the compute dtype
(float16) inside, as a mixed-precision conversion does. ``norms_dtype``
is the fix: the norms compute in float32 and hand float16 back.

The loss never predicts the padding token: its logit is set to ``-inf``,
so a padding target that the batch forgot to mask makes the loss ``inf``
while every gradient stays finite.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

# Gemma's attention mask: finite in float32, -inf once cast to float16.
K_MASK = -2.3819763e38
PAD = 0  # the padding token
EPS = 1e-6  # RMSNorm's epsilon


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  width: int = 32  # d_model
  heads: int = 2
  head_dim: int = 16
  hidden: int = 64  # of the MLP
  layers: int = 2
  batch: int = 32
  seq: int = 16


CONFIG = Config()


def init(key: jax.Array, config: Config = CONFIG) -> dict[str, Any]:
  """float32 parameters: projections scaled by their fan-in (activations
  of order 1), norm scales at 0 (the norms multiply by ``1 + scale``), an
  embedding of standard deviation 0.02."""
  c = config
  keys = iter(jax.random.split(key, 1 + 7 * c.layers))

  def dense(shape: tuple[int, ...], fan_in: int) -> jax.Array:
    return jax.random.normal(next(keys), shape) / math.sqrt(fan_in)

  params: dict[str, Any] = {
    "embed": 0.02 * jax.random.normal(next(keys), (c.vocab, c.width)),
    "final_norm": jnp.zeros(c.width),
  }
  qkv = (c.width, c.heads, c.head_dim)
  for i in range(c.layers):
    params[f"layer_{i}"] = {
      "pre_attention_norm": jnp.zeros(c.width),
      "q": dense(qkv, c.width),
      "k": dense(qkv, c.width),
      "v": dense(qkv, c.width),
      "o": dense((c.heads, c.head_dim, c.width), c.heads * c.head_dim),
      "query_norm": jnp.zeros(c.head_dim),
      "key_norm": jnp.zeros(c.head_dim),
      "pre_ffw_norm": jnp.zeros(c.width),
      "gate": dense((c.width, c.hidden), c.width),
      "up": dense((c.width, c.hidden), c.width),
      "down": dense((c.hidden, c.width), c.hidden),
    }
  return params


def batch(seed: int = 0, config: Config = CONFIG) -> dict[str, np.ndarray]:
  """Tokens, next-token targets (never the padding token) and loss
  weights (all 1)."""
  rng = np.random.default_rng(seed)
  shape = (config.batch, config.seq + 1)
  tokens = rng.integers(1, config.vocab, size=shape).astype(np.int32)
  return {
    "tokens": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "weights": np.ones((config.batch, config.seq), np.float32),
  }


def rms_norm(x: jax.Array, scale: jax.Array, dtype: Any = None) -> jax.Array:
  """``x / rms(x) * (1 + scale)``, computed in ``dtype`` (``x``'s dtype by
  default, as Gemma's norm does), returned in ``x``'s dtype."""
  y = x if dtype is None else x.astype(dtype)
  variance = jnp.mean(jnp.square(y), axis=-1, keepdims=True)
  y = y * jax.lax.rsqrt(variance + EPS)
  return (y * (1 + scale.astype(y.dtype))).astype(x.dtype)


def _attention(
  p: dict[str, jax.Array], x: jax.Array, norms_dtype: Any
) -> jax.Array:
  q = jnp.einsum("bsd,dhk->bshk", x, p["q"])
  k = jnp.einsum("bsd,dhk->bshk", x, p["k"])
  v = jnp.einsum("bsd,dhk->bshk", x, p["v"])
  with jax.named_scope("query_norm"):
    q = rms_norm(q, p["query_norm"], norms_dtype)
  with jax.named_scope("key_norm"):
    k = rms_norm(k, p["key_norm"], norms_dtype)
  q = q * np.asarray(q.shape[-1] ** -0.5, q.dtype)
  logits = jnp.einsum("bqhk,bshk->bhqs", q, k)
  seq = x.shape[1]
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  logits = jnp.where(causal, logits, K_MASK)  # -inf in float16
  probs = jax.nn.softmax(logits, axis=-1)
  mixed = jnp.einsum("bhqs,bshk->bqhk", probs, v)
  return jnp.einsum("bqhk,hkd->bqd", mixed, p["o"])


def _mlp(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  gate = jax.nn.gelu(x @ p["gate"], approximate=True)  # tanh: a cube
  return (gate * (x @ p["up"])) @ p["down"]


def _lookup(embed: jax.Array, tokens: jax.Array) -> jax.Array:
  """``embed[tokens]``. With the tokens sharded on a mesh's ``Explicit``
  axes, jax asks where the gathered rows go: with their tokens."""
  spec = jax.typeof(tokens).sharding.spec
  if all(axis is None for axis in spec):
    return embed[tokens]
  return embed.at[tokens].get(
    out_sharding=jax.sharding.PartitionSpec(*spec, None)
  )


def forward(
  params: dict[str, Any], tokens: jax.Array, norms_dtype: Any = None
) -> jax.Array:
  """Logits, in the parameters' dtype, for ``tokens`` [batch, seq]."""
  embed = params["embed"]
  with jax.named_scope("embed"):
    x = _lookup(embed, tokens)
    x = x * np.asarray(math.sqrt(embed.shape[1]), embed.dtype)
  layer = 0
  while f"layer_{layer}" in params:
    p = params[f"layer_{layer}"]
    with jax.named_scope(f"layer_{layer}"):
      with jax.named_scope("pre_attention_norm"):
        h = rms_norm(x, p["pre_attention_norm"], norms_dtype)
      with jax.named_scope("attn"):
        x = x + _attention(p, h, norms_dtype)
      with jax.named_scope("pre_ffw_norm"):
        h = rms_norm(x, p["pre_ffw_norm"], norms_dtype)
      with jax.named_scope("mlp"):
        x = x + _mlp(p, h)
    layer += 1
  with jax.named_scope("final_norm"):
    x = rms_norm(x, params["final_norm"], norms_dtype)
  with jax.named_scope("decode"):
    return x @ embed.T  # tied: the embedding table decodes


def _loss(
  params: dict[str, Any], batch: dict[str, jax.Array], norms_dtype: Any
) -> jax.Array:
  half = jax.tree.map(lambda a: a.astype(jnp.float16), params)
  logits = forward(half, batch["tokens"], norms_dtype)
  with jax.named_scope("loss"):
    logits = logits.astype(jnp.float32)
    never = jnp.arange(logits.shape[-1]) == PAD  # never predict padding
    logits = jnp.where(never, -jnp.inf, logits)
    logp = jax.nn.log_softmax(logits, axis=-1)
    targets = batch["targets"][..., None]
    nll = -jnp.take_along_axis(logp, targets, axis=-1)[..., 0]
    weights = batch["weights"]
    return jnp.sum(weights * nll) / jnp.sum(weights)


def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
  """The plain float16 conversion: every norm in float16."""
  return _loss(params, batch, None)


def loss_fn_float32_norms(
  params: dict[str, Any], batch: dict[str, jax.Array]
) -> jax.Array:
  """The fixed conversion: the norms compute in float32."""
  return _loss(params, batch, jnp.float32)


# --- training it with the loss scaler ---------------------------------------

TX = ols.loss_scale_optimizer(optax.adam(1e-2))
PARAMS = init(jax.random.key(0))


def batches(steps, nan_at=(), pad=False):
  """`steps` batches; those in `nan_at` hold a NaN in their loss weights;
  with `pad`, the last three targets of a row are padding, weighted 1
  (a padding mask forgotten)."""
  out = []
  for i in range(steps):
    b = batch(seed=i)
    if i in nan_at:
      b["weights"][3, 5] = np.nan
    if pad:
      b["targets"][1, -3:] = PAD
    out.append(b)
  return out


_STEPS: dict[Any, Any] = {}


def _step(loss, tx):
  key = (loss, id(tx))
  if key not in _STEPS:

    @jax.jit
    def step(params, opt_state, batch):
      value, grads = ols.value_and_grad(loss)(opt_state, params, batch)
      updates, opt_state = tx.update(grads, opt_state, params, value=value)
      return optax.apply_updates(params, updates), opt_state, value

    _STEPS[key] = step
  return _STEPS[key]


def train(params, batches, tx=TX, loss_fn=loss_fn):
  """Trains on `batches`; returns the parameters, the state and the
  losses."""
  step = _step(loss_fn, tx)
  opt_state = tx.init(params)
  losses = []
  for b in batches:
    params, opt_state, value = step(params, opt_state, b)
    losses.append(float(value))
  return params, opt_state, losses
