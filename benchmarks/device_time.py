"""Device time per step, from the profiler: what the step costs the device.

On an accelerator a timed step also holds the host's dispatch, which for a
step of many small arrays can exceed the device's own work. This script
traces steps run back to back with `jax.profiler` and sums, per step, the
kernels that ran on the device (on CPU: XLA's thunks), for the post-gradient
step of `overhead.py` (plain, ours, jmp, flax) and the train steps of
`train_step.py`.

  python benchmarks/device_time.py
  python benchmarks/device_time.py --tiny
"""

import argparse
import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData

# The steps of the two other benchmarks, timed here on the device's clock.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import (
  build_variant,
  fmt_count,
  inner_of,
  leaf_sizes,
  make_params,
)
from train_step import batch_of, problems, steps_of

# Profiler bookkeeping on the XLA CPU client's threads, not computation.
_CPU_BOOKKEEPING = ("end: ", "ThreadpoolListener", "ThunkExecutor")


def _kernel_events(path):
  """(name, duration ns) of every device kernel (or CPU thunk) in a trace."""
  data = ProfileData.from_file(path)
  device = [p for p in data.planes if p.name.startswith("/device:")]
  if device:
    return [
      (e.name, e.duration_ns)
      for p in device
      for line in p.lines
      for e in line.events
    ]
  return [
    (e.name, e.duration_ns)
    for p in data.planes
    if p.name == "/host:CPU"
    for line in p.lines
    if line.name.startswith("tf_XLA")
    for e in line.events
    if not e.name.startswith(_CPU_BOOKKEEPING)
  ]


def device_time(step, state, steps):
  """Returns (device seconds per step, kernels per step) for `step`."""
  for _ in range(3):  # warm-up
    state = step(*state)
  jax.block_until_ready(state)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(steps):
        state = step(*state)
      jax.block_until_ready(state)
    events = _kernel_events(
      glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
    )
  return sum(ns for _, ns in events) / steps / 1e9, len(events) / steps


def _post_gradient(n_params, n_leaves, steps):
  inner = inner_of("adam")
  sizes = leaf_sizes(n_params, n_leaves)
  grads = [jnp.full((s,), 0.5, jnp.float32) for s in sizes]
  out = {}
  for name in ("plain", "ours", "jmp", "flax"):
    init, step = build_variant(name, inner)
    params = make_params(sizes)
    state = init(params)
    compiled = (
      jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
    )
    out[name] = device_time(
      lambda p, s, c=compiled: c(p, s, grads), (params, state), steps
    )
  return out


def _train_steps(tiny, steps):
  out = {}
  key = jax.random.PRNGKey(0)
  for model_name, (model, shape) in problems(tiny).items():
    x, y, params0 = batch_of(model, shape, key)
    res = {}
    for name, (tx, step) in steps_of(model, x, y).items():
      params = jax.tree.map(jnp.copy, params0)
      compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(params, tx.init(params))
        .compile()
      )
      res[name] = device_time(
        lambda p, s, c=compiled: c(p, s)[:2], (params, tx.init(params)), steps
      )
    out[model_name] = res
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true")
  p.add_argument(
    "--steps",
    type=int,
    default=None,
    help="traced steps per variant (default 20; 2 with --tiny)",
  )
  args = p.parse_args(argv)
  steps = args.steps or (2 if args.tiny else 20)
  print(
    f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}),"
    f" jax {jax.__version__}; {steps} traced steps back to back"
  )
  print(
    f"{'step':<28} {'variant':<12} {'device us':>10} {'ratio':>6}"
    f" {'kernels':>8}"
  )
  results = {}
  configs = (
    [(100_000, 10)] if args.tiny else [(10_000_000, 50), (100_000_000, 10)]
  )
  for n_params, n_leaves in configs:
    label = f"post-gradient {fmt_count(n_params)}/{n_leaves} adam"
    results[label] = _post_gradient(n_params, n_leaves, steps)
  for model_name, res in _train_steps(args.tiny, steps).items():
    results[f"train step {model_name}"] = res
  for label, res in results.items():
    base = res["plain"][0]
    for name, (seconds, kernels) in res.items():
      print(
        f"{label:<28} {name:<12} {seconds * 1e6:10.1f}"
        f" {seconds / base:6.2f} {kernels:8.1f}",
        flush=True,
      )
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
