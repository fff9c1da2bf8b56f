"""Compile time of a float16 GPT training step, with and without a skip.

The step: forward, backward and update of a GPT-style model in pure jax
(pre-norm blocks of causal self-attention and an MLP, token and position
embeddings, the output layer tied to the token embedding: 12 leaves a
block and 4 more, 148 leaves at 12 blocks), float32 master weights cast to
float16 for compute, a float32 cross-entropy, adam; jitted with params and
optimizer state donated. Variants:

- `plain`: `optax.adam`, no loss scaling;
- `ours`: `loss_scale_optimizer(optax.adam)`, the loss through
  `scale_loss`;
- `apply_if_finite`: `optax.apply_if_finite(optax.adam, 5)`, optax's own
  skip of non-finite steps (it does not scale the loss);
- `usual_where`: the skip as usually written (`overhead.py`'s): the loss
  times a scale, the gradients divided, `all(isfinite)` per leaf, adam,
  `jnp.where` over updates and adam's state, the scale rule written out.

Each variant is traced, lowered and compiled afresh (a new function each
time, so no cache is hit) `--repeats` times, the variants interleaved (in
a rotated order each repeat). `cpu` is the fastest trace + lower + compile
in process CPU seconds (XLA compiles on several threads; on cores shared
with other jobs CPU time moves less between repeats than wall time),
`ratio` its ratio to `plain` of the same run, `spread` (slowest - fastest)
/ fastest of the repeats, the noise of the run. `wall` is the fastest in
wall-clock seconds.

  python benchmarks/compile_time.py                  # 12 blocks, 3 repeats
  python benchmarks/compile_time.py --blocks 12 24 --repeats 5
  python benchmarks/compile_time.py --tiny           # seconds, smoke test
"""

import argparse
import gc
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax

import optax_lossscale as ols

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead

COMPUTE = jnp.float16
VARIANTS = ("plain", "ours", "apply_if_finite", "usual_where")
# The compile-time target of the package's loss-scaled step (issue 27):
# within this much of `apply_if_finite`'s ratio, and at most `_MOST` plain.
_WITHIN = 0.15
_MOST = 1.5


# --- the model -------------------------------------------------------------


def gpt_params(key, *, blocks, width, vocab, context):
  """float32 parameters: 12 leaves a block, plus the token and position
  embeddings and the final norm's scale and bias."""

  def dense(k, fan_in, fan_out):
    return jax.random.normal(k, (fan_in, fan_out), jnp.float32) * fan_in**-0.5

  def norm():
    return {"scale": jnp.ones([width]), "bias": jnp.zeros([width])}

  keys = jax.random.split(key, blocks + 2)
  params = {
    "tokens": jax.random.normal(keys[0], (vocab, width)) * 0.02,
    "positions": jax.random.normal(keys[1], (context, width)) * 0.02,
    "norm": norm(),
    "blocks": [],
  }
  for k in keys[2:]:
    k1, k2, k3, k4 = jax.random.split(k, 4)
    params["blocks"].append(
      {
        "norm1": norm(),
        "qkv": {"w": dense(k1, width, 3 * width), "b": jnp.zeros([3 * width])},
        "proj": {"w": dense(k2, width, width), "b": jnp.zeros([width])},
        "norm2": norm(),
        "up": {"w": dense(k3, width, 4 * width), "b": jnp.zeros([4 * width])},
        "down": {"w": dense(k4, 4 * width, width), "b": jnp.zeros([width])},
      }
    )
  return params


def _layer_norm(x, p):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _dense(x, p):
  return x @ p["w"] + p["b"]


def _attention(x, p, heads):
  batch, length, width = x.shape
  qkv = _dense(x, p["qkv"]).reshape(batch, length, 3, heads, -1)
  q, k, v = (qkv[:, :, i] for i in range(3))
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (width // heads) ** 0.5
  causal = jnp.tril(jnp.ones((length, length), bool))
  logits = jnp.where(causal, logits, jnp.finfo(x.dtype).min)
  weights = jax.nn.softmax(logits.astype(jnp.float32), -1).astype(x.dtype)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
  return _dense(out, p["proj"])


def gpt_loss(params, tokens, targets, heads=4):
  """Mean next-token cross-entropy (float32) of a float16 forward pass."""
  p = jax.tree.map(lambda w: w.astype(COMPUTE), params)
  x = p["tokens"][tokens] + p["positions"][: tokens.shape[1]]
  for block in p["blocks"]:
    x = x + _attention(_layer_norm(x, block["norm1"]), block, heads)
    h = jax.nn.gelu(_dense(_layer_norm(x, block["norm2"]), block["up"]))
    x = x + _dense(h, block["down"])
  logits = _layer_norm(x, p["norm"]) @ p["tokens"].T
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  picked = jnp.take_along_axis(log_probs, targets[..., None], -1)
  return -picked.mean()


# --- the variants ----------------------------------------------------------


def _post_step(name, inner):
  """`(init, post(params, state, grads), scale_of(loss, state))`."""
  if name == "plain":
    init, post = overhead.optax_step(inner)
    return init, post, lambda loss, state: loss
  if name == "ours":
    init, post = overhead.optax_step(ols.loss_scale_optimizer(inner))
    return init, post, ols.scale_loss
  if name == "apply_if_finite":
    tx = optax.apply_if_finite(inner, max_consecutive_errors=5)
    init, post = overhead.optax_step(tx)
    return init, post, lambda loss, state: loss
  if name == "usual_where":
    init, post = overhead.usual_where(inner)
    return init, post, lambda loss, state: loss * state.scale
  raise ValueError(f"unknown variant {name!r}")


def train_step(name):
  """`(init, step(params, state, tokens, targets))`: the gradient of the
  (scaled) loss, then the variant's update and `optax.apply_updates`."""
  init, post, scaled = _post_step(name, optax.adam(1e-3))

  def step(params, state, tokens, targets):
    grads = jax.grad(lambda p: scaled(gpt_loss(p, tokens, targets), state))(
      params
    )
    return post(params, state, grads)

  return init, step


# --- measuring -------------------------------------------------------------


def _compile_seconds(step, args):
  """`(cpu seconds, wall seconds)` of one fresh trace, lowering and
  compilation of `jit(step, donate_argnums=(0, 1))`."""
  fn = jax.jit(lambda *a: step(*a), donate_argnums=(0, 1))
  gc.collect()
  cpu, wall = time.process_time(), time.perf_counter()
  fn.lower(*args).compile()
  return time.process_time() - cpu, time.perf_counter() - wall


def measure(blocks, variants, repeats, *, width, batch, context, vocab):
  """Compiles each variant's step `repeats` times, interleaved; returns
  `(leaves, {variant: result})` with the fastest CPU and wall times, the
  spread of CPU times and the ratios to `plain`."""
  key = jax.random.PRNGKey(0)
  params = gpt_params(
    key, blocks=blocks, width=width, vocab=vocab, context=context
  )
  tokens = jax.random.randint(key, (batch, context), 0, vocab)
  targets = jnp.roll(tokens, -1, axis=1)
  steps, args, times = {}, {}, {}
  for name in variants:
    init, steps[name] = train_step(name)
    args[name] = (params, init(params), tokens, targets)
    times[name] = []
  for r in range(repeats):
    # A rotated order each repeat: no variant always follows the same one.
    for name in variants[r % len(variants) :] + variants[: r % len(variants)]:
      times[name].append(_compile_seconds(steps[name], args[name]))
  results = {}
  for name, runs in times.items():
    cpu = [c for c, _ in runs]
    results[name] = dict(
      cpu=min(cpu),
      wall=min(w for _, w in runs),
      spread=(max(cpu) - min(cpu)) / min(cpu),
      cpu_all=cpu,
    )
  for r in results.values():
    r["ratio"] = r["cpu"] / results["plain"]["cpu"]
  return len(jax.tree.leaves(params)), results


def target_met(results):
  """Whether `ours` is within `_WITHIN` of `apply_if_finite`'s ratio and at
  most `_MOST` times `plain`; None where either was not measured."""
  if not {"ours", "apply_if_finite"} <= set(results):
    return None
  ours = results["ours"]["ratio"]
  return ours - results["apply_if_finite"]["ratio"] <= _WITHIN and (
    ours <= _MOST
  )


def _report(blocks, leaves, results, out):
  for name, r in results.items():
    out(
      f"{blocks:>6} {leaves:>6} {name:<16} {r['cpu']:7.2f} {r['ratio']:6.2f}"
      f" {r['spread']:7.0%} {r['wall']:7.2f}",
      flush=True,
    )
  met = target_met(results)
  if met is not None:
    gap = results["ours"]["ratio"] - results["apply_if_finite"]["ratio"]
    out(
      f"       ours - apply_if_finite: {gap:+.2f} (target <= {_WITHIN});"
      f" ours / plain: {results['ours']['ratio']:.2f} (target <= {_MOST}):"
      f" {'met' if met else 'NOT met'}"
    )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true", help="seconds, smoke test")
  p.add_argument(
    "--blocks",
    nargs="+",
    type=int,
    default=None,
    help="transformer blocks, 12 leaves each (default 12; 1 with --tiny)",
  )
  p.add_argument(
    "--repeats",
    type=int,
    default=None,
    help="compilations per variant, the fastest counts (default 3; 1"
    " with --tiny)",
  )
  p.add_argument(
    "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS)
  )
  args = p.parse_args(argv)
  variants = list(dict.fromkeys(["plain", *args.variants]))
  blocks = args.blocks or ([1] if args.tiny else [12])
  repeats = args.repeats or (1 if args.tiny else 3)
  sizes = (
    dict(width=32, batch=2, context=8, vocab=64)
    if args.tiny
    else dict(width=256, batch=8, context=128, vocab=512)
  )
  print(
    f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}),"
    f" jax {jax.__version__}, optax {optax.__version__}, cpu threads:"
    f" {os.cpu_count()}; GPT of width {sizes['width']}, float16 compute,"
    " float32 master weights, adam; trace + lower + compile, the fastest"
    f" of {repeats} interleaved compilations"
  )
  print(
    "cpu: process CPU seconds; ratio: to plain, this run; spread:"
    " (slowest - fastest) / fastest CPU time; wall: wall-clock seconds"
  )
  print(
    f"{'blocks':>6} {'leaves':>6} {'variant':<16} {'cpu':>7} {'ratio':>6}"
    f" {'spread':>7} {'wall':>7}"
  )
  found = {}
  for n in blocks:
    leaves, results = measure(n, variants, repeats, **sizes)
    _report(n, leaves, results, print)
    found[n] = dict(leaves=leaves, results=results)
  return found


if __name__ == "__main__":
  main(sys.argv[1:])
