"""The cost of one `find_overflow` call against a plain
`jax.jit(jax.value_and_grad(loss))` first call (trace, compile and run) on
the same model and batch.

Each measurement runs in a fresh process, so that no compilation is
cached from another, and the variants alternate: plain, finder, plain,
finder, ... `--rounds` times. Both wall time and the process's CPU time
(all threads) are measured; on a shared machine the CPU time moves less.
Public API only.

Models:
- `mlp`: `--depth` layers of `tanh(x @ w)` in float16 (float32 master
  weights cast inside the loss), `--width` wide, on `--batch` rows;
- `gemma`: the Gemma-style transformer of tests/_gemma.py at `--layers`
  layers, width 256, 4 heads of 64, an MLP of 896, a vocabulary of 4096
  (2.95M parameters at 2 layers), on 16 sequences of 64 tokens.

The finder runs at `--scale` (1 by default). At `--scale 16777216` (2**24)
the Gemma-style model's backward pass overflows, and the finder names it:
the cost of a call that finds something.

  python benchmarks/finder_cost.py --model mlp --depth 100
  python benchmarks/finder_cost.py --model gemma --layers 2
  python benchmarks/finder_cost.py --model gemma --layers 2 --scale 16777216
  python benchmarks/finder_cost.py --tiny      # seconds, the smoke test
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mlp(args):
  import jax
  import jax.numpy as jnp

  def loss(params, x):
    for w in params:
      x = jnp.tanh(x @ w.astype(jnp.float16))
    return jnp.mean(x.astype(jnp.float32) ** 2)

  keys = jax.random.split(jax.random.key(0), args.depth + 1)
  params = [
    jax.random.normal(k, (args.width, args.width)) / args.width**0.5
    for k in keys[1:]
  ]
  x = jax.random.normal(keys[0], (args.batch, args.width), jnp.float16)
  return loss, params, x


def _gemma(args):
  import jax

  sys.path.insert(0, str(ROOT / "tests"))
  import _gemma  # the tests' model, by path

  config = _gemma.Config(
    vocab=4096,
    width=256,
    heads=4,
    head_dim=64,
    hidden=896,
    layers=args.layers,
    batch=16,
    seq=64,
  )
  params = _gemma.init(jax.random.key(0), config)
  return _gemma.loss_fn, params, _gemma.batch(0, config)


def _measure(variant, args):
  """One variant, in this process: seconds of wall and of CPU time."""
  import jax

  import optax_lossscale as ols

  fun, params, batch = (_mlp if args.model == "mlp" else _gemma)(args)
  jax.block_until_ready((params, batch))
  count = sum(x.size for x in jax.tree.leaves(params))
  wall, cpu = time.perf_counter(), time.process_time()
  if variant == "plain":
    jax.block_until_ready(jax.jit(jax.value_and_grad(fun))(params, batch))
    found = None
  else:
    found = bool(ols.find_overflow(fun, params, batch, scale=args.scale))
  return {
    "variant": variant,
    "wall": time.perf_counter() - wall,
    "cpu": time.process_time() - cpu,
    "parameters": count,
    "found": found,
  }


def _in_fresh_process(variant, argv):
  paths = [str(ROOT), os.environ.get("PYTHONPATH")]
  path = os.pathsep.join(filter(None, paths))
  out = subprocess.run(
    [sys.executable, __file__, *argv, "--variant", variant],
    check=True,
    capture_output=True,
    text=True,
    env={**os.environ, "PYTHONPATH": path},
  ).stdout
  return json.loads(out.strip().splitlines()[-1])


def _parser():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=["mlp", "gemma"], default="mlp")
  p.add_argument("--depth", type=int, default=100)
  p.add_argument("--width", type=int, default=128)
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--scale", type=float, default=1.0, help="the finder's")
  p.add_argument("--tiny", action="store_true", help="a 3-layer MLP, once")
  p.add_argument(
    "--variant", choices=["plain", "finder"], help=argparse.SUPPRESS
  )
  return p


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  args = _parser().parse_args(argv)
  if args.tiny:
    args.model, args.depth, args.width, args.batch, args.rounds = (
      "mlp", 3, 32, 16, 1,
    )  # fmt: skip
  if args.variant:
    print(json.dumps(_measure(args.variant, args)))
    return None
  size = ["--model", args.model, "--depth", str(args.depth)]
  size += ["--width", str(args.width), "--batch", str(args.batch)]
  size += ["--layers", str(args.layers), "--scale", repr(args.scale)]
  runs = {"plain": [], "finder": []}
  for _ in range(args.rounds):
    for variant in ("plain", "finder"):
      runs[variant].append(_in_fresh_process(variant, size))
  what = (
    f"MLP, {args.depth} layers of {args.width}, batch {args.batch}"
    if args.model == "mlp"
    else f"Gemma-style, {args.layers} layers"
  )
  count = runs["plain"][0]["parameters"]
  found = runs["finder"][0]["found"]
  print(
    f"{what}: {count:,} parameters; {args.rounds} rounds; the finder at"
    f" scale {args.scale:g} found {'an overflow' if found else 'none'}"
  )
  print(f"{'variant':8} {'wall s':>8} {'cpu s':>8}  (medians)")
  medians = {}
  for variant, results in runs.items():
    medians[variant] = {
      key: statistics.median(r[key] for r in results) for key in ("wall", "cpu")
    }
    print(
      f"{variant:8} {medians[variant]['wall']:8.2f}"
      f" {medians[variant]['cpu']:8.2f}"
    )
  for key in ("wall", "cpu"):
    ratio = medians["finder"][key] / medians["plain"][key]
    print(f"finder / plain, {key}: {ratio:.2f}x")
  return runs


if __name__ == "__main__":
  main()
