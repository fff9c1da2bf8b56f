"""What `leaf_stats=True` costs over the default loss-scaled step.

Two measurements, public API only:
- run time: the post-gradient step (unscale, check, adam, skip, adjust,
  `optax.apply_updates`), jitted with `donate_argnums=(0, 1)`, of
  `loss_scale_optimizer(adam)` with `leaf_stats=False` (`default`) and
  `leaf_stats=True` (`leaf_stats`), beside plain adam; interleaved rounds,
  warm-up excluded, medians, ratios to `default`;
- compile time: the same step's lower-and-compile time, the fastest of
  `--compile-repeats` fresh traces (the two variants interleaved), at many
  leaves, ratio to `default`.

  python benchmarks/leaf_stats.py            # 10M params in 50 leaves;
                                             # 1,000 leaves for compile time
  python benchmarks/leaf_stats.py --tiny     # seconds, for the smoke test
  python benchmarks/leaf_stats.py --params 10M --leaves 50 --rounds 40 \\
      --compile-leaves 1000
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import optax_lossscale as ols

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import best_compile

VARIANTS = ("plain", "default", "leaf_stats")


def _parse_count(text: str) -> int:
  text = text.strip().upper()
  mult = {"K": 10**3, "M": 10**6}.get(text[-1:], 1)
  return int(float(text.rstrip("KM")) * mult)


def _tx(variant: str) -> optax.GradientTransformation:
  inner = optax.adam(1e-3)
  if variant == "plain":
    return inner
  return ols.loss_scale_optimizer(inner, leaf_stats=variant == "leaf_stats")


def _step(tx: optax.GradientTransformation):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _trees(n_params: int, n_leaves: int):
  base, extra = divmod(n_params, n_leaves)
  sizes = [base + (i < extra) for i in range(n_leaves)]
  params = [jnp.full((s,), 0.01, jnp.float32) for s in sizes]
  grads = [jnp.full((s,), 0.5, jnp.float32) for s in sizes]
  return params, grads


def run_time(n_params: int, n_leaves: int, rounds: int) -> dict:
  """Median seconds per step of each variant, interleaved."""
  compiled, states, times = {}, {}, {}
  for name in VARIANTS:
    tx = _tx(name)
    params, grads = _trees(n_params, n_leaves)
    state = tx.init(params)
    compiled[name], _ = best_compile(_step(tx), (params, state, grads), 1)
    states[name] = jax.block_until_ready(compiled[name](params, state, grads))
    times[name] = []
  for _ in range(rounds):
    for name in VARIANTS:
      params, state = states[name]
      t0 = time.perf_counter()
      states[name] = jax.block_until_ready(compiled[name](params, state, grads))
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(t) for name, t in times.items()}


def compile_time(n_params: int, n_leaves: int, repeats: int) -> dict:
  """Seconds to lower and compile the step of `default` and `leaf_stats`
  (the fastest of `repeats`, the two interleaved: one compilation's time
  moves with the machine's load), and the fusions in each compiled step
  (XLA on CPU compiles each fusion as a kernel of its own)."""
  seconds = {"default": float("inf"), "leaf_stats": float("inf")}
  fusions = {}
  for _ in range(repeats):
    for name in seconds:
      tx = _tx(name)
      params, grads = _trees(n_params, n_leaves)
      compiled, once = best_compile(
        _step(tx), (params, tx.init(params), grads), 1
      )
      seconds[name] = min(seconds[name], once)
      fusions[name] = _fusions(compiled.as_text())
  return {"seconds": seconds, "fusions": fusions}


def _fusions(hlo: str) -> int:
  """The fusions the compiled program's entry computation calls."""
  entry = hlo[hlo.index("ENTRY") :]
  return entry.count(" fusion(")


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--params", type=_parse_count, default=10_000_000)
  p.add_argument("--leaves", type=int, default=50)
  p.add_argument("--rounds", type=int, default=40)
  p.add_argument("--compile-params", type=_parse_count, default=1_000_000)
  p.add_argument("--compile-leaves", type=int, default=1000)
  p.add_argument("--compile-repeats", type=int, default=2)
  p.add_argument("--tiny", action="store_true", help="seconds: a smoke test")
  args = p.parse_args(argv)
  if args.tiny:
    args.params, args.leaves, args.rounds = 10_000, 5, 3
    args.compile_params, args.compile_leaves = 1_000, 20
    args.compile_repeats = 1
  print(f"device: {jax.devices()[0].platform}, jax {jax.__version__}")
  run = run_time(args.params, args.leaves, args.rounds)
  print(
    f"run time, {args.params:,} params in {args.leaves} leaves, adam,"
    f" median of {args.rounds} interleaved rounds:"
  )
  for name in VARIANTS:
    print(
      f"  {name:<11} {run[name] * 1e3:9.3f} ms"
      f"  {run[name] / run['default']:5.2f}x default"
    )
  comp = compile_time(
    args.compile_params, args.compile_leaves, args.compile_repeats
  )
  print(
    f"compile time, {args.compile_params:,} params in"
    f" {args.compile_leaves} leaves, fastest of {args.compile_repeats}:"
  )
  seconds = comp["seconds"]
  for name in seconds:
    print(
      f"  {name:<11} {seconds[name]:9.3f} s"
      f"  {seconds[name] / seconds['default']:5.2f}x default"
      f"  {comp['fusions'][name]:6d} fusions"
    )
  return {"run_s": run, "compile_s": seconds, "fusions": comp["fusions"]}


if __name__ == "__main__":
  main()
