"""End-to-end overhead of loss scaling on a full training step.

Forward, backward and update of a small MLP, a transformer block and a
12-block transformer (flax.linen; 206 parameter leaves), float16 compute
with float32 master weights, adam; with loss scaling
(`loss_scale_optimizer` + `scale_loss`) against the same step without it.
Jitted with donated params and optimizer state; interleaved rounds, warm-up
excluded, medians. The compile column is the loss-scaled step's
lower-and-compile time over the plain step's, the fastest of three each.

  python benchmarks/train_step.py
  python benchmarks/train_step.py --tiny
  python benchmarks/train_step.py --chained 10   # also steps back to back

`--chained K` adds the overhead of K steps dispatched back to back with one
`block_until_ready` at the end, as a training loop runs them.
"""

import argparse
import os
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import optax_lossscale as ols

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import best_compile

COMPUTE = jnp.float16


class MLP(nn.Module):
  width: int
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = nn.relu(nn.Dense(self.width, dtype=COMPUTE)(x))
    return nn.Dense(1, dtype=COMPUTE)(x)


class Block(nn.Module):
  """A pre-norm transformer block: self-attention and an MLP."""

  dim: int
  heads: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(dtype=COMPUTE)(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=COMPUTE)(
      h, h
    )
    x = x + h
    h = nn.LayerNorm(dtype=COMPUTE)(x)
    h = nn.Dense(4 * self.dim, dtype=COMPUTE)(h)
    h = nn.Dense(self.dim, dtype=COMPUTE)(nn.gelu(h))
    return x + h


class Transformer(nn.Module):
  """`depth` blocks: hundreds of parameter leaves, as real models have."""

  dim: int
  heads: int
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = Block(self.dim, self.heads)(x)
    return nn.LayerNorm(dtype=COMPUTE)(x)


def problems(tiny):
  if tiny:
    return {
      "mlp": (MLP(width=64, depth=2), (8, 32)),
      "transformer": (Block(dim=32, heads=2), (2, 8, 32)),
      "transformer12": (Transformer(dim=16, heads=2, depth=2), (2, 4, 16)),
    }
  return {
    "mlp": (MLP(width=1024, depth=4), (256, 1024)),
    "transformer": (Block(dim=256, heads=8), (8, 128, 256)),
    "transformer12": (Transformer(dim=128, heads=4, depth=12), (4, 64, 128)),
  }


def batch_of(model, shape, key):
  """Inputs, targets and float32 master params for one problem."""
  kx, ky, kp = jax.random.split(key, 3)
  x = jax.random.normal(kx, shape, jnp.float32)
  y = jax.random.normal(
    ky, (*shape[:-1], 1 if isinstance(model, MLP) else shape[-1]), jnp.float32
  )
  params = model.init(kp, x.astype(COMPUTE))
  return x, y, jax.tree.map(lambda a: a.astype(jnp.float32), params)


def steps_of(model, x, y):
  """Returns {name: (tx, step)} with and without loss scaling."""

  def loss_of(params):
    out = model.apply(
      jax.tree.map(lambda p: p.astype(COMPUTE), params), x.astype(COMPUTE)
    )
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)

  plain_tx = optax.adam(1e-3)

  def plain_step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_of)(params)
    updates, opt_state = plain_tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def scaled_step_with(scaled_tx):
    def scaled_step(params, opt_state):
      def scaled_loss(p):
        loss = loss_of(p)
        return ols.scale_loss(loss, opt_state), loss

      (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
      updates, opt_state = scaled_tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return scaled_tx, scaled_step

  return {
    "plain": (plain_tx, plain_step),
    "loss_scaled": scaled_step_with(ols.loss_scale_optimizer(optax.adam(1e-3))),
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument(
    "--chained",
    type=int,
    default=0,
    metavar="K",
    help="also time K steps back to back (one block at the end)",
  )
  args = p.parse_args(argv)
  rounds = args.rounds or (3 if args.tiny else 30)
  print(
    f"device: {jax.devices()[0].device_kind}, jax {jax.__version__};"
    " float16 compute, float32 master weights, adam; median of"
    f" {rounds} interleaved rounds"
  )
  print(
    f"{'model':<13} {'params':>9} {'leaves':>6} {'plain ms':>9}"
    f" {'scaled ms':>9} {'overhead':>9} {'compile':>7}"
    + (f" {'chained':>8}" if args.chained else "")
  )
  results = {}
  key = jax.random.PRNGKey(0)
  for name, (model, shape) in problems(args.tiny).items():
    x, y, params0 = batch_of(
      model, shape, jax.random.fold_in(key, len(results))
    )
    n = sum(a.size for a in jax.tree.leaves(params0))
    variants = steps_of(model, x, y)
    fns, states, times, compile_s = {}, {}, {}, {}
    for vname, (tx, step) in variants.items():
      params = jax.tree.map(jnp.copy, params0)
      opt_state = tx.init(params)
      fns[vname], compile_s[vname] = best_compile(
        step, (params, opt_state), 1 if args.tiny else 3
      )
      states[vname] = jax.block_until_ready(
        fns[vname](params, opt_state)[:2]
      )  # warm-up
      times[vname] = []
    for _ in range(rounds):
      for vname in variants:
        t0 = time.perf_counter()
        out = fns[vname](*states[vname])
        jax.block_until_ready(out)
        times[vname].append(time.perf_counter() - t0)
        states[vname] = out[:2]
    chained = {vname: [] for vname in variants}
    for _ in range(rounds if args.chained else 0):
      for vname in variants:
        t0 = time.perf_counter()
        state = states[vname]
        for _ in range(args.chained):
          state = fns[vname](*state)[:2]
        jax.block_until_ready(state)
        chained[vname].append((time.perf_counter() - t0) / args.chained)
        states[vname] = state
    plain = statistics.median(times["plain"])
    scaled = statistics.median(times["loss_scaled"])
    compile_ratio = compile_s["loss_scaled"] / compile_s["plain"]
    results[name] = dict(
      params=n,
      plain_s=plain,
      scaled_s=scaled,
      overhead=scaled / plain - 1,
      compile_ratio=compile_ratio,
    )
    leaves = len(jax.tree.leaves(params0))
    results[name]["leaves"] = leaves
    line = (
      f"{name:<13} {n:>9} {leaves:>6} {plain * 1e3:9.2f} {scaled * 1e3:9.2f}"
      f" {(scaled / plain - 1) * 100:8.1f}% {compile_ratio:7.2f}"
    )
    if args.chained:
      overhead = (
        statistics.median(chained["loss_scaled"])
        / statistics.median(chained["plain"])
        - 1
      )
      results[name]["chained_overhead"] = overhead
      line += f" {overhead * 100:7.1f}%"
    print(line, flush=True)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
