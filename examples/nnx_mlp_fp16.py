"""Flax NNX, functional style: float16 compute, float32 master weights.

A regression MLP (with BatchNorm and Dropout), written in float32, trained
with ``nnx.split``/``nnx.merge`` under ``jax.jit``: the optimizer travels as
a graph definition plus a state, which is also the form a checkpoint has.
The read-outs and ``set_loss_scale`` take that state directly. The loss
runs under ``ols.autocast``: the products in float16, forward and backward,
the norm's statistics and the mean in float32.

Run: ``python examples/nnx_mlp_fp16.py [--tiny]``.
"""

import argparse
import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_lossscale as ols


class MLP(nnx.Module):
  def __init__(self, din: int, width: int, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(din, width, rngs=rngs)
    self.norm = nnx.BatchNorm(width, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(width, 1, rngs=rngs)

  def __call__(self, x):
    h = self.dropout(nnx.relu(self.norm(self.hidden(x))))
    return self.out(h)


def loss_fn(model: MLP, x, y):
  return jnp.mean((model(x) - y) ** 2)


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


def make_data(n: int, din: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, din)).astype(np.float32)
  w = rng.normal(size=(din, 1)).astype(np.float32) / np.sqrt(din)
  y = np.tanh(2 * x @ w) + 0.05 * rng.normal(size=(n, 1)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(y)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="a quick run")
  args = parser.parse_args(argv)
  steps, batch, din = (150, 64, 8) if args.tiny else (2000, 256, 32)
  x, y = make_data(batch * 16, din)

  model = MLP(din, 64, rngs=nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(
    model, ols.loss_scale_optimizer(optax.adam(3e-3)), wrt=nnx.Param
  )
  graphdef, state = nnx.split((model, optimizer))

  @jax.jit
  def train_step(state, xb, yb):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = ols.value_and_grad(
      ols.autocast(loss_fn), grad_fn=nnx.value_and_grad
    )(optimizer, model, xb, yb)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  losses = []
  for step in range(steps):
    i = step % 16
    state, loss = train_step(
      state, x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]
    )
    losses.append(float(loss))
    if step % max(steps // 5, 1) == 0 or step == steps - 1:
      # Read-outs take the split state; they return plain arrays.
      print(
        f"step {step:5d}  loss {loss:.4f}"
        f"  scale {ols.loss_scale(state):.0f}"
        f"  skipped {int(ols.skip_stats(state).total_skipped)}"
      )

  # What ran in which dtype: every product of the step, forward and backward.
  program = jax.make_jaxpr(train_step)(state, x[:batch], y[:batch])
  products = product_dtypes(program.jaxpr)
  print(f"matrix products in the training step, by dtype: {products}")

  # Checkpoint surgery on the split state, then back into objects.
  state = ols.set_loss_scale(state, 1024.0)
  model, optimizer = nnx.merge(graphdef, state)
  result = {
    "first_loss": float(np.mean(losses[:10])),
    "last_loss": float(np.mean(losses[-10:])),
    "loss_scale": float(ols.loss_scale(optimizer)),
    "skipped": int(ols.skip_stats(optimizer).total_skipped),
    "master_dtype": str(model.hidden.kernel[...].dtype),
    "products": products,
    "steps": steps,
  }
  print("RESULT " + json.dumps(result))
  return result


if __name__ == "__main__":
  main()
