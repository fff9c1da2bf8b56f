"""Peak memory of `find_overflow` against a plain `jax.value_and_grad` on the
same batch, through an MLP in float16 (float32 master weights): how far
the process's peak resident memory rises above its resident memory before
the function is traced, until its result is on the host (tracing,
compiling and running included), each variant in a fresh process so that
neither sees the other's allocations. Public API only; Linux (the peak is
read from /proc/self/status and started over there).

  python benchmarks/finder_memory.py            # batch 4096, 16 x 512
  python benchmarks/finder_memory.py --tiny     # seconds, for the smoke test
  python benchmarks/finder_memory.py --batch 1024 --depth 8 --width 256
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp


def mlp_loss(params, x):
  for w in params:
    x = jnp.tanh(x @ w.astype(jnp.float16))
  return jnp.mean(x.astype(jnp.float32) ** 2)


def _problem(args):
  keys = jax.random.split(jax.random.key(0), args.depth + 1)
  params = [
    jax.random.normal(k, (args.width, args.width)) / args.width**0.5
    for k in keys[1:]
  ]
  x = jax.random.normal(keys[0], (args.batch, args.width), jnp.float16)
  return params, x


def _status_bytes(field):
  """A memory figure of this process from /proc/self/status (Linux)."""
  with open("/proc/self/status") as status:
    for line in status:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024  # kB
  raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss():
  """Starts the peak (VmHWM) over from the resident memory now, so that
  what importing jax and making the problem peaked at is not counted: a
  run whose peak stayed below it would otherwise measure 0."""
  with open("/proc/self/clear_refs", "w") as clear_refs:
    clear_refs.write("5")


def _measure(variant, args):
  """One variant, in this process: its compiled buffers, RSS growth and
  wall time."""
  import optax_lossscale as ols

  params, x = _problem(args)
  jax.block_until_ready((params, x))
  _reset_peak_rss()
  before = _status_bytes("VmRSS")
  start = time.perf_counter()
  if variant == "plain":
    jax.block_until_ready(jax.jit(jax.value_and_grad(mlp_loss))(params, x))
  else:
    report = ols.find_overflow(mlp_loss, params, x)
    assert not report, str(report)
  seconds = time.perf_counter() - start
  return {
    "variant": variant,
    "rss_growth_bytes": _status_bytes("VmHWM") - before,
    "seconds": seconds,
  }


def _in_fresh_process(variant, argv):
  """`_measure(variant)` in a new process, importing this repository's
  package."""
  root = str(pathlib.Path(__file__).resolve().parents[1])
  path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
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
  p.add_argument("--batch", type=int, default=4096)
  p.add_argument("--depth", type=int, default=16)
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--tiny", action="store_true", help="batch 64, 2 x 32")
  p.add_argument(
    "--variant", choices=["plain", "finder"], help=argparse.SUPPRESS
  )
  return p


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  args = _parser().parse_args(argv)
  if args.tiny:
    args.batch, args.depth, args.width = 64, 2, 32
  if args.variant:
    print(json.dumps(_measure(args.variant, args)))
    return None
  size = ["--batch", str(args.batch), "--depth", str(args.depth)]
  size += ["--width", str(args.width)]
  results = [_in_fresh_process(v, size) for v in ("plain", "finder")]
  print(
    f"device: {jax.devices()[0].device_kind}, jax {jax.__version__};"
    f" batch {args.batch} through {args.depth} x {args.width}"
  )
  print(f"{'variant':8} {'RSS growth MB':>14} {'s':>7}")
  for r in results:
    print(
      f"{r['variant']:8} {r['rss_growth_bytes'] / 2**20:14.1f}"
      f" {r['seconds']:7.2f}"
    )
  plain, finder = results
  ratio = finder["rss_growth_bytes"] / max(plain["rss_growth_bytes"], 1)
  print(f"finder / plain, rss_growth_bytes: {ratio:.2f}x")
  return results


if __name__ == "__main__":
  main()
