"""A small GPT in Flax NNX: float16, loss scaling, a data x model mesh.

A decoder-only transformer language model at the character level, trained
on the Zen of Python (``this.s``, rot13-decoded: text that ships with
Python), its parameters sharded with ``nnx.with_partitioning`` over a 4x2
``("data", "model")`` mesh in the style of the JAX AI Stack's miniGPT
tutorial. The model is written in float32 (Flax's layers as they come);
float16 is one line, ``ols.autocast`` around the loss. Where each part
computes then (``docs/autocast.md`` has the policy, primitive by
primitive):

- float16: every matrix product, forward and backward (the q/k/v and
  output projections, the attention's two products, the MLP, the
  language-model head);
- float32: the master weights and the optimizer state, the embedding
  lookup, the layer norms' statistics, the attention softmax (its
  exponentials and sums, and the masked logits: the mask's fill value is
  beyond float16's range), the gelu's cube, and the loss; the residual
  stream too, where a float16 product meets a float32 bias.

The same model, initialization and batches are then trained in float32
with the plain optimizer, and the two runs' losses are printed side by
side, with what the loss scale did (backoffs, growths, skipped steps).

On CPU the script asks for 8 host-platform devices before jax starts; with
8 or more accelerators it uses them instead.

Run: ``python examples/nnx_gpt_fp16.py [--tiny]``.
"""

import os

# Before jax starts its backend: 8 CPU devices for the 4x2 mesh.
if "--xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )

import argparse
import codecs
import collections
import contextlib
import io
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols

MESH_SHAPE = (4, 2)  # ("data", "model")


def load_text() -> str:
  """The Zen of Python; `import this` prints it, so its output is dropped."""
  with contextlib.redirect_stdout(io.StringIO()):
    import this
  return codecs.decode(this.s, "rot13")


def make_mesh() -> jax.sharding.Mesh:
  n = MESH_SHAPE[0] * MESH_SHAPE[1]
  devices = jax.devices()
  if len(devices) < n:  # one GPU, say: the host's CPU devices instead
    devices = jax.devices("cpu")
  return jax.make_mesh(
    MESH_SHAPE,
    ("data", "model"),
    axis_types=(AxisType.Auto, AxisType.Auto),
    devices=devices[:n],
  )


def sharded(init, *names):
  """An initializer whose Variable carries its mesh axes."""
  return nnx.with_partitioning(init, names)


DENSE = nnx.initializers.lecun_normal()
ONES, ZEROS = nnx.initializers.ones_init(), nnx.initializers.zeros_init()


def layer_norm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(
    d,
    scale_init=sharded(ONES, "model"),
    bias_init=sharded(ZEROS, "model"),
    rngs=rngs,
  )


def linear(din, dout, axes, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(
    din,
    dout,
    kernel_init=sharded(DENSE, *axes),
    bias_init=sharded(ZEROS, "model"),
    rngs=rngs,
  )


class Block(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
    self.norm1 = layer_norm(d, rngs)
    self.attn = nnx.MultiHeadAttention(
      num_heads=heads,
      in_features=d,
      kernel_init=sharded(DENSE, None, "model", None),  # heads on "model"
      out_kernel_init=sharded(DENSE, "model", None, None),
      bias_init=sharded(ZEROS, "model", None),
      out_bias_init=sharded(ZEROS, "model"),
      decode=False,
      rngs=rngs,
    )
    self.norm2 = layer_norm(d, rngs)
    # Megatron-style: the first layer split by columns, the second by rows.
    self.up = linear(d, 4 * d, (None, "model"), rngs)
    self.down = linear(4 * d, d, ("model", None), rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class GPT(nnx.Module):
  def __init__(self, vocab, block_size, d, heads, layers, *, rngs: nnx.Rngs):
    embed = nnx.initializers.normal(0.02)
    self.tokens = nnx.Embed(
      vocab, d, embedding_init=sharded(embed, None, "model"), rngs=rngs
    )
    self.positions = nnx.Embed(
      block_size, d, embedding_init=sharded(embed, None, "model"), rngs=rngs
    )
    self.blocks = nnx.List([Block(d, heads, rngs=rngs) for _ in range(layers)])
    self.norm = layer_norm(d, rngs)
    self.head = linear(d, vocab, (None, "model"), rngs)

  def __call__(self, tokens):
    mask = nnx.make_causal_mask(tokens, dtype=jnp.bool_)
    x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[-1]))
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


def loss_fn(model: GPT, inputs, targets):
  logits = model(inputs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def product_dtypes(jaxpr) -> dict[str, int]:
  """The matrix products of a program (nested ones too), counted by dtype."""
  counts = collections.Counter()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      counts[eqn.outvars[0].aval.dtype.name] += 1
    for param in eqn.params.values():  # the bodies of calls, loops, rules
      for body in param if isinstance(param, tuple) else (param,):
        if isinstance(body, jax.extend.core.ClosedJaxpr):
          body = body.jaxpr
        if isinstance(body, jax.extend.core.Jaxpr):
          counts.update(product_dtypes(body))
  return dict(counts)


def make_batches(ids: np.ndarray, steps, batch, block_size, seed=0):
  """Random windows of the text: (inputs, next characters), per step."""
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(ids) - block_size - 1, size=(steps, batch))
  windows = starts[..., None] + np.arange(block_size + 1)
  seqs = ids[windows]  # [steps, batch, block_size + 1]
  return seqs[..., :-1], seqs[..., 1:]


def train(config, tx, batches, mesh, *, float16: bool):
  """Trains a fresh GPT (the same initialization for every call), in
  float16 (under autocast, loss-scaled) or in float32; returns the model,
  the optimizer, the loss of each step, and in float16 the scale before the
  first step and after each, and the step's matrix products by dtype."""
  with jax.set_mesh(mesh):

    @nnx.jit
    def create():
      # Each Variable is placed on the mesh by its axes as it is created;
      # under jit, in one compiled program rather than op by op.
      model = GPT(**config, rngs=nnx.Rngs(0))
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    model, optimizer = create()

    @nnx.jit
    def train_step(model, optimizer, inputs, targets):
      if float16:
        grad_fn = ols.value_and_grad(
          ols.autocast(loss_fn), grad_fn=nnx.value_and_grad
        )
        loss, grads = grad_fn(optimizer, model, inputs, targets)
      else:
        loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
      optimizer.update(model, grads)
      return loss

    data = NamedSharding(mesh, P("data", None))  # batch split over "data"
    losses, scales, products = [], [], {}
    for inputs, targets in zip(*batches, strict=True):
      if float16:
        scales.append(float(ols.loss_scale(optimizer)))
      inputs, targets = jax.device_put((inputs, targets), data)
      losses.append(float(train_step(model, optimizer, inputs, targets)))
    if float16:
      scales.append(float(ols.loss_scale(optimizer)))
      # What ran in which dtype: every product, forward and backward.
      program = jax.make_jaxpr(train_step)(model, optimizer, inputs, targets)
      products = product_dtypes(program.jaxpr)
  return model, optimizer, losses, scales, products


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="a quick run")
  args = parser.parse_args(argv)
  steps, batch, block_size, d, layers = (
    (120, 16, 32, 64, 2) if args.tiny else (600, 32, 64, 128, 4)
  )
  text = load_text()
  chars = sorted(set(text))
  ids = np.array([chars.index(c) for c in text], np.int32)
  # The vocabulary padded to a multiple of the "model" axis, so that the
  # head's columns split evenly.
  vocab = -(-len(chars) // MESH_SHAPE[1]) * MESH_SHAPE[1]
  config = dict(vocab=vocab, block_size=block_size, d=d, heads=4, layers=layers)
  batches = make_batches(ids, steps, batch, block_size)
  mesh = make_mesh()

  # Grows after 50 finite steps in a row instead of Keras's 2000, so that a
  # run this short shows the rule at work.
  tx16 = ols.loss_scale_optimizer(optax.adam(3e-3), dynamic_growth_steps=50)
  model, optimizer, losses, scales, products = train(
    config, tx16, batches, mesh, float16=True
  )
  _, _, losses32, _, _ = train(
    config, optax.adam(3e-3), batches, mesh, float16=False
  )

  report_every = max(steps // 5, 1)
  for step in range(steps):
    if step % report_every == 0 or step == steps - 1:
      print(
        f"step {step:4d}  loss {losses[step]:.4f}"
        f"  float32 {losses32[step]:.4f}  scale {scales[step + 1]:.0f}"
      )
  growths = sum(b > a for a, b in itertools.pairwise(scales))
  backoffs = sum(b < a for a, b in itertools.pairwise(scales))
  stats = ols.skip_stats(optimizer)
  print(
    f"loss scale {scales[0]:.0f} -> {scales[-1]:.0f}: {backoffs} backoffs,"
    f" {growths} growths, {int(stats.total_skipped)} of {steps} steps"
    " skipped"
  )
  print(
    f"last 10 steps' mean loss: float16 {np.mean(losses[-10:]):.4f},"
    f" float32 {np.mean(losses32[-10:]):.4f}"
  )
  print(f"matrix products in the training step, by dtype: {products}")
  kernel = model.blocks[0].up.kernel
  result = {
    "first_loss": float(np.mean(losses[:10])),
    "last_loss": float(np.mean(losses[-10:])),
    "float32_first_loss": float(np.mean(losses32[:10])),
    "float32_last_loss": float(np.mean(losses32[-10:])),
    "loss_scale": scales[-1],
    "skipped": int(stats.total_skipped),
    "backoffs": backoffs,
    "growths": growths,
    "optimizer_step": int(optimizer.step[...]),
    "master_dtype": str(kernel[...].dtype),
    "products": products,
    "kernel_spec": [str(a) for a in kernel[...].sharding.spec],
    "steps": steps,
  }
  print("RESULT " + json.dumps(result))
  return result


if __name__ == "__main__":
  main()
