"""Flax's NNX MNIST tutorial, converted to float16 with dynamic loss scaling.

Source: ``docs_nnx/mnist_tutorial.md`` in https://github.com/google/flax
(last changed in commit 83e3c21b, 2026-04-23; read at 18f8f311), the
"MNIST tutorial" of the Flax NNX documentation. Rewritten here, section by
section, with these changes:

- float16 (the point of this example; ``docs/frameworks.md`` lists the
  lines): the model stays as the tutorial writes it, in float32; the loss
  runs under ``ols.autocast``, in training and in evaluation (the
  convolutions' and the dense layers' products in float16, forward and
  backward; the norms' statistics, the pooling's sums and the
  cross-entropy in float32); the optimizer is wrapped in
  ``ols.loss_scale_optimizer``; the gradient comes from
  ``ols.value_and_grad(..., grad_fn=nnx.value_and_grad)``; the loss scale
  and skipped steps are logged.
- offline (no downloads here): scikit-learn's bundled 8x8 digits instead of
  MNIST from Hugging Face ``datasets``, so ``linear1`` takes 2*2*64
  features instead of 7*7*64, batches cycle over epochs, and TensorBoard,
  the prediction plots and the Orbax export are left out.

Run: ``python examples/nnx_mnist_tutorial_fp16.py [--tiny]``.
"""

import argparse
import collections
import json
from functools import partial

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import optax_lossscale as ols

# 2. Load the dataset (bundled digits, scaled to [0, 1], NHWC).


def load_dataset(seed: int = 0):
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  images, labels = images[order], labels[order]
  train = {"image": images[:1500], "label": labels[:1500]}
  test = {"image": images[1500:], "label": labels[1500:]}
  return train, test


def make_batches(ds, batch_size, *, epochs=1, seed=0):
  """Yield batches of (image, label) numpy arrays, reshuffled per epoch."""
  rng = np.random.default_rng(seed)
  n = len(ds["label"])
  for epoch in range(epochs):
    order = rng.permutation(n) if epoch else np.arange(n)
    for i in range(0, n - batch_size + 1, batch_size):  # drop the last
      idx = order[i : i + batch_size]
      yield {"image": ds["image"][idx], "label": ds["label"][idx]}


# 3. Define the model with Flax NNX.


class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(2 * 2 * 64, 256, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(
      nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs)))
    )
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x


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


# 5. Define training step functions.


@ols.autocast  # float16 products, float32 where float16 is not safe
def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
  logits = model(batch["image"], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch["label"]
  ).mean()
  return loss, logits


@nnx.jit
def train_step(
  model: CNN,
  optimizer: nnx.Optimizer,
  metrics: nnx.MultiMetric,
  rngs: nnx.Rngs,
  batch,
):
  """Train for a single step."""
  grad_fn = ols.value_and_grad(
    loss_fn, has_aux=True, grad_fn=nnx.value_and_grad
  )
  (loss, logits), grads = grad_fn(optimizer, model, batch, rngs)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)  # unscale, check, skip or apply, adjust


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="a quick run")
  args = parser.parse_args(argv)
  train_steps, eval_every = (150, 50) if args.tiny else (1200, 200)
  batch_size = 32
  train_ds, test_ds = load_dataset()

  model = CNN(rngs=nnx.Rngs(0))
  # 4. Create the optimizer and define some metrics.
  learning_rate = 0.005
  momentum = 0.9
  optimizer = nnx.Optimizer(
    model,
    ols.loss_scale_optimizer(optax.adamw(learning_rate, momentum)),
    wrt=nnx.Param,
  )
  metrics = nnx.MultiMetric(
    accuracy=nnx.metrics.Accuracy(),
    loss=nnx.metrics.Average("loss"),
  )

  # 6. Views: dropout and batch statistics on for training, off for eval.
  train_model = nnx.view(model, deterministic=False, use_running_average=False)
  eval_model = nnx.view(model, deterministic=True, use_running_average=True)

  # 7. Train and evaluate the model.
  history = []
  rngs = nnx.Rngs(0)
  epochs = train_steps // (len(train_ds["label"]) // batch_size) + 1
  for step, batch in enumerate(
    make_batches(train_ds, batch_size, epochs=epochs)
  ):
    if step >= train_steps:
      break
    train_step(train_model, optimizer, metrics, rngs, batch)
    if step > 0 and (step % eval_every == 0 or step == train_steps - 1):
      train = {k: float(v) for k, v in metrics.compute().items()}
      metrics.reset()
      for test_batch in make_batches(test_ds, batch_size):
        eval_step(eval_model, metrics, test_batch)
      test = {k: float(v) for k, v in metrics.compute().items()}
      metrics.reset()
      history.append(
        {
          "step": step,
          "train_loss": train["loss"],
          "test_loss": test["loss"],
          "test_accuracy": test["accuracy"],
        }
      )
      print(
        f"step {step:5d}  train_loss {train['loss']:.4f}"
        f"  test_loss {test['loss']:.4f}"
        f"  test_accuracy {test['accuracy']:.3f}"
        f"  loss_scale {ols.loss_scale(optimizer):.0f}"
        f"  skipped {int(ols.skip_stats(optimizer).total_skipped)}"
      )

  # What ran in which dtype: every product of the step, forward and backward.
  program = jax.make_jaxpr(train_step)(
    train_model, optimizer, metrics, rngs, batch
  )
  products = product_dtypes(program.jaxpr)
  print(f"matrix products in the training step, by dtype: {products}")

  result = {
    "first_train_loss": history[0]["train_loss"],
    "last_train_loss": history[-1]["train_loss"],
    "test_accuracy": history[-1]["test_accuracy"],
    "loss_scale": float(ols.loss_scale(optimizer)),
    "skipped": int(ols.skip_stats(optimizer).total_skipped),
    "master_dtype": str(model.linear1.kernel[...].dtype),
    "products": products,
    "steps": train_steps,
  }
  print("RESULT " + json.dumps(result))
  return result


if __name__ == "__main__":
  main()
