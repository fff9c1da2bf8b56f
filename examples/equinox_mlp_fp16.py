"""Equinox: float16 compute, float32 master weights, the standard loop.

The model is written in float32, as Equinox's documentation writes it; the
loss runs under ``ols.autocast``, which computes its products in float16,
forward and backward, and its mean in float32. The loop is the one
Equinox's documentation shows (``eqx.filter_jit``,
``eqx.filter_value_and_grad``, ``optim.update(grads, opt_state,
eqx.filter(model, eqx.is_inexact_array))``), with three changes: the optax
optimizer is wrapped in ``loss_scale_optimizer``, the loss in
``ols.autocast``, and the gradient comes from ``ols.value_and_grad(...,
grad_fn=eqx.filter_value_and_grad)``.

Run: ``python examples/equinox_mlp_fp16.py [--tiny]``.
"""

import argparse
import collections
import json
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols


class MLP(eqx.Module):
  layers: list
  activation: Callable  # a non-array field

  def __init__(self, din: int, width: int, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.layers = [
      eqx.nn.Linear(din, width, key=k1),
      eqx.nn.Linear(width, width, key=k2),
      eqx.nn.Linear(width, 1, key=k3),
    ]
    self.activation = jax.nn.gelu

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = self.activation(layer(x))
    return self.layers[-1](x)


def loss_fn(model: MLP, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


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

  model = MLP(din, 64, jax.random.key(0))
  optim = ols.loss_scale_optimizer(optax.adam(3e-3))
  opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def make_step(model, opt_state, xb, yb):
    loss, grads = ols.value_and_grad(
      ols.autocast(loss_fn), grad_fn=eqx.filter_value_and_grad
    )(opt_state, model, xb, yb)
    updates, opt_state = optim.update(
      grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
    )
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss

  losses = []
  for step in range(steps):
    i = step % 16
    model, opt_state, loss = make_step(
      model,
      opt_state,
      x[i * batch : (i + 1) * batch],
      y[i * batch : (i + 1) * batch],
    )
    losses.append(float(loss))
    if step % max(steps // 5, 1) == 0 or step == steps - 1:
      print(
        f"step {step:5d}  loss {loss:.4f}"
        f"  scale {ols.loss_scale(opt_state):.0f}"
        f"  skipped {int(ols.skip_stats(opt_state).total_skipped)}"
      )

  # What ran in which dtype: every product of the step, forward and backward.
  xb, yb = x[:batch], y[:batch]
  program, _, _ = eqx.filter_make_jaxpr(make_step)(model, opt_state, xb, yb)
  products = product_dtypes(program.jaxpr)
  print(f"matrix products in the training step, by dtype: {products}")

  result = {
    "first_loss": float(np.mean(losses[:10])),
    "last_loss": float(np.mean(losses[-10:])),
    "loss_scale": float(ols.loss_scale(opt_state)),
    "skipped": int(ols.skip_stats(opt_state).total_skipped),
    "master_dtype": str(model.layers[0].weight.dtype),
    "products": products,
    "steps": steps,
  }
  print("RESULT " + json.dumps(result))
  return result


if __name__ == "__main__":
  main()
