"""Overhead of the loss-scaled post-gradient step over the plain optax step.

Each variant is one jitted function `(params, opt_state, grads) -> (params,
opt_state)` with `donate_argnums=(0, 1)`: unscale, check, inner update, skip,
adjust and `optax.apply_updates`. Variants run side by side in interleaved
rounds (warm-up excluded, `block_until_ready` inside the timed region); the
table shows medians as ratios to the plain step, copy-op counts in the
compiled HLO, `memory_analysis()` temp sizes and compile-time ratios.

  python benchmarks/overhead.py            # the default grid (a few minutes)
  python benchmarks/overhead.py --tiny     # seconds, for the smoke test
  python benchmarks/overhead.py --params 10M --leaves 50 --opt adam \\
      --grad-dtype float32
  python benchmarks/overhead.py --full     # the whole product (long on CPU)
  python benchmarks/overhead.py --chained 10   # also steps back to back

`--chained K` adds a column: the median per-step time of K steps dispatched
back to back with one `block_until_ready` at the end, as a training loop runs
them. On an accelerator a single blocked step also times the host's dispatch
and the wait for the result; back to back, dispatch overlaps device work.
"""

import argparse
import itertools
import os
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jmp
import optax
from flax.training import dynamic_scale as flax_dynamic_scale

import optax_lossscale as ols

SCALE = 2.0**15

VARIANTS = (
  "plain",
  "ours",
  "ours_select_after",
  "usual_where",
  "apply_if_finite",
  "jmp",
  "flax",
)
DEFAULT_GRID = (
  # (params, leaves, opt, grad dtype): each axis covered, not the product.
  (10_000_000, 50, "adam", "float32"),
  (10_000_000, 50, "adam", "float16"),
  (1_000_000, 10, "adam", "float32"),
  (1_000_000, 1000, "sgdm", "float32"),
  (10_000_000, 1000, "sgdm", "float32"),
  (10_000_000, 50, "sgdm", "float16"),
  (100_000_000, 10, "adam", "float32"),
)


def _parse_count(text: str) -> int:
  text = text.strip().upper()
  mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
  return int(float(text.rstrip("KMG")) * mult)


def inner_of(opt: str):
  """The inner optax transformation named by `--opt`."""
  if opt == "adam":
    return optax.adam(1e-3)
  if opt == "sgdm":
    return optax.sgd(1e-2, momentum=0.9)
  raise ValueError(f"unknown --opt {opt!r}")


class SelectAfterState(NamedTuple):
  """The state of `select_after`: the scaler's and the inner one."""

  loss_scale_state: ols.LossScaleState
  inner_state: optax.OptState


def select_after(inner):
  """`(init, step(params, state, grads))`: the package's unscale, check and
  rule (`unscale_and_check`), the inner update, and the skip a plain select
  after it (`jnp.where` over the updates and the inner state): the step of
  `loss_scale_optimizer(inner)` without the skip's rewrite, made of public
  pieces (tests/test_benchmarks.py checks that it compiles to that step)."""
  scaler = ols.unscale_and_check()

  def init(params):
    return SelectAfterState(scaler.init(params), inner.init(params))

  def step(params, state, grads):
    # Zeros where the step skips, so that the inner update sees finite
    # values only.
    unscaled, scaler_state = scaler.update(
      grads, state.loss_scale_state, params
    )
    finite = ols.skip_stats(scaler_state).last_finite
    updates, inner_state = inner.update(unscaled, state.inner_state, params)
    updates = jax.tree.map(
      lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates
    )
    inner_state = jax.tree.map(
      lambda n, o: jnp.where(finite, n, o).astype(o.dtype),
      inner_state,
      state.inner_state,
    )
    return optax.apply_updates(params, updates), SelectAfterState(
      scaler_state, inner_state
    )

  return init, step


class UsualState(NamedTuple):
  """The state of the usual `where` skip: the inner state, the loss scale
  and the count of finite steps since the scale last changed."""

  inner_state: optax.OptState
  scale: jax.Array
  counter: jax.Array


def _usual_rule(scale, counter, finite, growth_steps=2000):
  """The Keras rule, written out as users write it: grow by 2 after
  `growth_steps` finite steps in a row (if the result is finite), halve on a
  non-finite step (not below 1)."""
  grow = counter + 1 >= growth_steps
  grown = jnp.where(jnp.isfinite(scale * 2), scale * 2, scale)
  finite_scale = jnp.where(grow, grown, scale)
  new_scale = jnp.where(finite, finite_scale, jnp.maximum(scale / 2, 1.0))
  new_counter = jnp.where(finite & ~grow, counter + 1, 0)
  return new_scale, new_counter


def usual_where(inner):
  """`(init, step(params, state, grads))`: the skip as usually written:
  divide, `all(isfinite)` per leaf on the unscaled gradients, inner update,
  `jnp.where` over updates and inner state, the scale rule written out.
  `state.scale` is what the loss is multiplied by."""

  def init(params):
    return UsualState(
      inner.init(params), jnp.float32(SCALE), jnp.zeros([], jnp.int32)
    )

  def step(params, state, grads):
    unscaled = jax.tree.map(
      lambda g: (g.astype(jnp.float32) / state.scale).astype(g.dtype), grads
    )
    finite = jnp.all(
      jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(unscaled)])
    )
    updates, inner_state = inner.update(unscaled, state.inner_state, params)
    updates = jax.tree.map(lambda u: jnp.where(finite, u, 0), updates)
    inner_state = jax.tree.map(
      lambda n, o: jnp.where(finite, n, o).astype(o.dtype),
      inner_state,
      state.inner_state,
    )
    scale, counter = _usual_rule(state.scale, state.counter, finite)
    return optax.apply_updates(params, updates), UsualState(
      inner_state, scale, counter
    )

  return init, step


def optax_step(tx):
  """`(init, step(params, state, grads))` of an optax transformation."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def build_variant(name: str, inner):
  """Returns (init(params) -> state, step(params, state, grads))."""
  if name == "plain":
    return optax_step(inner)
  if name == "ours":
    return optax_step(ols.loss_scale_optimizer(inner))
  if name == "ours_select_after":
    # The package's unscale, check and scale rule; the skip a plain select
    # after the inner update: what the rewrite alone buys.
    return select_after(inner)
  if name == "apply_if_finite":
    return optax_step(optax.apply_if_finite(inner, max_consecutive_errors=5))
  if name == "usual_where":
    return usual_where(inner)
  if name == "jmp":
    # jmp's loss-scale pytree cannot be passed to `jit(...).lower`, so the
    # state carries its two arrays and the object is rebuilt inside the step.
    def init(params):
      ls = jmp.DynamicLossScale(jnp.float32(SCALE))
      return inner.init(params), (ls.loss_scale, ls.counter)

    def step(params, state, grads):
      opt_state, (scale, counter) = state
      loss_scale = jmp.DynamicLossScale(scale, counter)
      grads = loss_scale.unscale(grads)
      finite = jmp.all_finite(grads)
      loss_scale = loss_scale.adjust(finite)
      updates, new_opt_state = inner.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      params = jmp.select_tree(finite, new_params, params)
      opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
      return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))

    return init, step
  if name == "flax":

    def init(params):
      return inner.init(params), flax_dynamic_scale.DynamicScale(
        scale=jnp.float32(SCALE)
      )

    def step(params, state, grads):
      # The post-gradient part of `DynamicScale.value_and_grad` (its unscale,
      # finite check and adjustment), then the select of params and opt
      # state as the flax examples write it.
      opt_state, ds = state
      grads = jax.tree.map(
        lambda g: jnp.asarray(g, jnp.float32) / ds.scale, grads
      )
      finite = jnp.array(True)
      for g in jax.tree.leaves(grads):
        finite &= jnp.all(jax.lax.is_finite(g))
      grow = ds.fin_steps == ds.growth_interval
      fin_scale = jnp.where(
        grow & finite,
        jnp.minimum(ds.scale * ds.growth_factor, jnp.finfo(jnp.float32).max),
        ds.scale,
      )
      inf_scale = ds.scale * ds.backoff_factor
      if ds.minimum_scale is not None:
        inf_scale = jnp.maximum(inf_scale, ds.minimum_scale)
      ds = ds.replace(
        scale=jnp.where(finite, fin_scale, inf_scale),
        fin_steps=jnp.where(grow | (~finite), 0, ds.fin_steps + 1),
      )
      updates, new_opt_state = inner.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      params = jax.tree.map(
        lambda n, o: jnp.where(finite, n, o), new_params, params
      )
      opt_state = jax.tree.map(
        lambda n, o: jnp.where(finite, n, o), new_opt_state, opt_state
      )
      return params, (opt_state, ds)

    return init, step
  raise ValueError(f"unknown variant {name!r}")


def leaf_sizes(n_params: int, n_leaves: int):
  base, extra = divmod(n_params, n_leaves)
  return [base + (i < extra) for i in range(n_leaves)]


def make_params(sizes):
  return [jnp.full((s,), 0.01, jnp.float32) for s in sizes]


def best_compile(step, args, repeats):
  """`(compiled, seconds)`: the fastest of `repeats` lowerings and
  compilations of `jit(step, donate_argnums=(0, 1))`, each traced afresh
  (`jit` caches traces on the function object, so each gets a new one).
  One compilation's time moved by up to 50% between runs on shared cores."""
  best = float("inf")
  for _ in range(repeats):
    fn = jax.jit(lambda *a: step(*a), donate_argnums=(0, 1))
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    best = min(best, time.perf_counter() - t0)
  return compiled, best


def run_config(
  n_params,
  n_leaves,
  opt,
  grad_dtype,
  variants,
  rounds,
  out=print,
  chained=0,
  compile_repeats=3,
  make_variant=None,
):
  """Benchmarks one configuration; returns {variant: result dict}.

  `make_variant(name, inner) -> (init, step)` builds the variants (default:
  this script's).
  """
  make_variant = make_variant or build_variant
  inner = inner_of(opt)
  sizes = leaf_sizes(n_params, n_leaves)
  grads = [jnp.full((s,), 0.5, grad_dtype) for s in sizes]
  compiled, states, results = {}, {}, {}
  for name in list(variants):
    init, step = make_variant(name, inner)
    params = make_params(sizes)
    state = init(params)
    try:
      c, compile_s = best_compile(step, (params, state, grads), compile_repeats)
    except Exception as e:  # reported in its row, not raised
      # optax.apply_if_finite with float16 gradients and float32 params:
      # its cond branches disagree on dtypes (an optax limitation).
      out(f"  {name}: not run ({type(e).__name__}: {str(e).splitlines()[0]})")
      variants.remove(name)
      continue
    text = c.as_text()
    mem = c.memory_analysis()
    temp = (
      getattr(mem, "temp_size_in_bytes", float("nan")) if mem else float("nan")
    )
    compiled[name] = c
    # Warm-up, excluded from timing.
    states[name] = jax.block_until_ready(c(params, state, grads))
    results[name] = dict(
      compile_s=compile_s,
      copies=text.count(" copy("),
      temp_bytes=temp,
      times=[],
    )
  for _ in range(rounds):
    for name in variants:
      params, state = states[name]
      t0 = time.perf_counter()
      new = compiled[name](params, state, grads)
      jax.block_until_ready(new)
      results[name]["times"].append(time.perf_counter() - t0)
      states[name] = new
  for name in variants:
    results[name]["chained"] = []
  for _ in range(rounds if chained else 0):
    for name in variants:
      params, state = states[name]
      t0 = time.perf_counter()
      for _ in range(chained):
        params, state = compiled[name](params, state, grads)
      jax.block_until_ready((params, state))
      results[name]["chained"].append((time.perf_counter() - t0) / chained)
      states[name] = (params, state)
  base = (
    statistics.median(results["plain"]["times"]) if "plain" in results else None
  )
  base_chained = (
    statistics.median(results["plain"]["chained"])
    if chained and "plain" in results
    else None
  )
  base_compile = results.get("plain", {}).get("compile_s")
  for name in variants:
    r = results[name]
    r["median_s"] = statistics.median(r["times"])
    r["ratio"] = r["median_s"] / base if base else float("nan")
    r["chained_ratio"] = (
      statistics.median(r["chained"]) / base_chained
      if base_chained
      else float("nan")
    )
    r["compile_ratio"] = (
      r["compile_s"] / base_compile if base_compile else float("nan")
    )
  del states, compiled
  return results


def fmt_count(n):
  for unit, div in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
    if n >= div and n % div == 0:
      return f"{n // div}{unit}"
  return str(n)


def _affinity() -> int | str:
  """How many cores this process may run on, where the OS says."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return "?"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--tiny",
    action="store_true",
    help="one tiny configuration, a few rounds (seconds)",
  )
  p.add_argument(
    "--full",
    action="store_true",
    help="the whole product of --params x --leaves x --opt x"
    " --grad-dtype (default: a grid covering each axis)",
  )
  p.add_argument(
    "--params",
    nargs="+",
    default=None,
    help="parameter counts, e.g. 1M 10M 100M",
  )
  p.add_argument("--leaves", nargs="+", type=int, default=None)
  p.add_argument("--opt", nargs="+", choices=("adam", "sgdm"), default=None)
  p.add_argument(
    "--grad-dtype", nargs="+", choices=("float32", "float16"), default=None
  )
  p.add_argument(
    "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS)
  )
  p.add_argument(
    "--all-recipes",
    action="store_true",
    help="also run the jmp and flax recipes above 100 leaves"
    " (their compile time grows steeply: minutes at 1000 leaves)",
  )
  p.add_argument(
    "--chained",
    type=int,
    default=0,
    metavar="K",
    help="also time K steps back to back (one block at the end)",
  )
  p.add_argument(
    "--compile-repeats",
    type=int,
    default=None,
    help="compilations per variant, the fastest counts"
    " (default 3; 1 with --tiny)",
  )
  p.add_argument(
    "--rounds",
    type=int,
    default=None,
    help="timed rounds per configuration (default 15; 5 at"
    " 100M params; 3 with --tiny)",
  )
  args = p.parse_args(argv)
  variants = list(args.variants)
  if "plain" not in variants:
    variants.insert(0, "plain")

  if args.tiny:
    grid = [(100_000, 10, "adam", "float32")]
  elif args.full or any(
    x is not None for x in (args.params, args.leaves, args.opt, args.grad_dtype)
  ):
    grid = list(
      itertools.product(
        [_parse_count(x) for x in (args.params or ["1M", "10M", "100M"])],
        args.leaves or [10, 50, 1000],
        args.opt or ["adam", "sgdm"],
        args.grad_dtype or ["float32", "float16"],
      )
    )
  else:
    grid = list(DEFAULT_GRID)

  print(
    f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}),"
    f" jax {jax.__version__}, optax {optax.__version__},"
    f" cpu threads: {os.cpu_count()} (affinity {_affinity()})"
  )
  print(
    "time: median ratio to plain; compile: ratio of the fastest of"
    " several lowerings and compilations; copies: ' copy(' ops in the"
    " compiled HLO; temp: memory_analysis() temp MB"
    + (
      f"; chained: ratio for {args.chained} steps back to back"
      if args.chained
      else ""
    )
  )
  header = (
    f"{'params':>6} {'leaves':>6} {'opt':>4} {'grad':>7}"
    f" {'variant':<17} {'ms':>8} {'time':>6} {'compile':>7}"
    f" {'copies':>6} {'temp MB':>8}"
    + (f" {'chained':>7}" if args.chained else "")
  )
  print(header)
  all_results = []
  for n_params, n_leaves, opt, grad_dtype in grid:
    rounds = args.rounds or (
      3 if args.tiny else 5 if n_params >= 50_000_000 else 15
    )
    ran = list(variants)
    if n_leaves > 100 and not args.all_recipes:
      for name in ("jmp", "flax"):
        if name in ran:
          ran.remove(name)
          print(
            f"  {name}: not run above 100 leaves (compile takes minutes;"
            " --all-recipes runs it)"
          )
    res = run_config(
      n_params,
      n_leaves,
      opt,
      grad_dtype,
      ran,
      rounds,
      chained=args.chained,
      compile_repeats=args.compile_repeats or (1 if args.tiny else 3),
    )
    for name in ran:
      r = res[name]
      print(
        f"{fmt_count(n_params):>6} {n_leaves:>6} {opt:>4}"
        f" {grad_dtype:>7} {name:<17} {r['median_s'] * 1e3:8.2f}"
        f" {r['ratio']:6.2f} {r['compile_ratio']:7.2f}"
        f" {r['copies']:6d} {r['temp_bytes'] / 1e6:8.1f}"
        + (f" {r['chained_ratio']:7.2f}" if args.chained else ""),
        flush=True,
      )
      all_results.append(
        dict(
          params=n_params,
          leaves=n_leaves,
          opt=opt,
          grad_dtype=grad_dtype,
          variant=name,
          **{k: v for k, v in r.items() if k not in ("times", "chained")},
        )
      )
  return all_results


if __name__ == "__main__":
  main(sys.argv[1:])
