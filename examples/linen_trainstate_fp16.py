"""Flax Linen with a ``TrainState``: float16 compute, float32 master weights.

A small classifier with BatchNorm, written in float32, trained through
``TrainState`` (extended with ``batch_stats``, as Flax's own examples do)
under ``jax.jit``. The loss, which calls ``apply``, runs under
``ols.autocast``: the products in float16, forward and backward, the
norm's statistics and the cross-entropy in float32. The loss-scaled
optimizer is the ``tx``; ``apply_gradients`` takes the scaled gradients and
does the rest.

Run: ``python examples/linen_trainstate_fp16.py [--tiny]``.
"""

import argparse
import collections
import json
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import optax_lossscale as ols


class Classifier(nn.Module):
  num_classes: int = 4

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(64)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    return nn.Dense(self.num_classes)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any


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


def make_data(n: int, din: int, classes: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  centers = rng.normal(size=(classes, din)).astype(np.float32) * 2
  labels = rng.integers(0, classes, size=n)
  x = centers[labels] + rng.normal(size=(n, din)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(labels)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="a quick run")
  args = parser.parse_args(argv)
  steps, batch, din = (100, 64, 16) if args.tiny else (1500, 256, 64)
  x, labels = make_data(batch * 8, din, 4)

  model = Classifier()
  variables = model.init(jax.random.key(0), x[:2], train=False)
  state = TrainState.create(
    apply_fn=model.apply,
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=ols.loss_scale_optimizer(optax.adam(1e-3)),
  )

  def loss_fn(params, batch_stats, xb, yb):
    logits, updates = state.apply_fn(
      {"params": params, "batch_stats": batch_stats},
      xb,
      train=True,
      mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
    return loss, updates["batch_stats"]

  @jax.jit
  def train_step(state, xb, yb):
    # `state` is where the loss-scale state sits: the TrainState itself.
    (loss, batch_stats), grads = ols.value_and_grad(
      ols.autocast(loss_fn), has_aux=True
    )(state, state.params, state.batch_stats, xb, yb)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return state, loss

  @jax.jit
  def accuracy(state, xb, yb):
    logits = state.apply_fn(
      {"params": state.params, "batch_stats": state.batch_stats},
      xb,
      train=False,
    )
    return jnp.mean(jnp.argmax(logits, -1) == yb)

  losses = []
  for step in range(steps):
    i = step % 8
    state, loss = train_step(
      state, x[i * batch : (i + 1) * batch], labels[i * batch : (i + 1) * batch]
    )
    losses.append(float(loss))
    if step % max(steps // 5, 1) == 0 or step == steps - 1:
      print(
        f"step {step:5d}  loss {loss:.4f}"
        f"  scale {ols.loss_scale(state):.0f}"
        f"  skipped {int(ols.skip_stats(state).total_skipped)}"
      )

  # What ran in which dtype: every product of the step, forward and backward.
  xb, yb = x[:batch], labels[:batch]
  products = product_dtypes(jax.make_jaxpr(train_step)(state, xb, yb).jaxpr)
  print(f"matrix products in the training step, by dtype: {products}")

  result = {
    "first_loss": float(np.mean(losses[:10])),
    "last_loss": float(np.mean(losses[-10:])),
    "accuracy": float(accuracy(state, x, labels)),
    "loss_scale": float(ols.loss_scale(state)),
    "skipped": int(ols.skip_stats(state).total_skipped),
    "master_dtype": str(jax.tree.leaves(state.params)[0].dtype),
    "products": products,
    "steps": steps,
  }
  print("RESULT " + json.dumps(result))
  return result


if __name__ == "__main__":
  main()
