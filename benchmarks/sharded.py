"""The loss-scaled post-gradient step on sharded meshes, against plain optax
and against jmp's and flax's recipes, all on the same mesh.

Runs on 8 devices (on CPU: 8 host-platform devices, set before the backend
starts). For each mesh type (`Auto`, `Explicit`), layout and optimizer, each
recipe is one jitted `(params, opt_state, grads) -> (params, opt_state)`
with `donate_argnums=(0, 1)`, compiled and run under `jax.set_mesh(mesh)`
with params, gradients and inner optimizer state placed alike:

- `fsdp`: a 1-D mesh `("data",)` of 8, every leaf `P("data", None)`;
- `tp`: a 2-D mesh `("data", "model")` of 2x4, leaves alternately
  `P(None, "model")` and `P("model", None)` (replicated over `data`).

Recipes (built by `benchmarks/overhead.py`): `plain` (the inner optax step),
`ours` (`loss_scale_optimizer`), `jmp` (`jmp.DynamicLossScale`,
`jmp.all_finite`, `jmp.select_tree`) and `flax` (the post-gradient part of
`flax.training.dynamic_scale.DynamicScale` and the `jnp.where` select of the
flax examples). Per recipe: `time` (median ratio to plain over interleaved
rounds), `compile` (ratio of the fastest of several lowerings and
compilations), the collectives in the compiled HLO by kind, the all-reduces
that are not of scalars, temp bytes per device
(`memory_analysis().temp_size_in_bytes`), and whether every output (params
and inner optimizer state) keeps the sharding that plain optax gives it. A
recipe that fails on a mesh reports its error in its row.

  python benchmarks/sharded.py           # four 1024x1024 leaves (minutes)
  python benchmarks/sharded.py --tiny    # four 256x256 leaves (seconds)
"""

import argparse
import os
import re
import statistics
import sys
import time

import jax

# Before the backend starts; a no-op where it already has (the test suite
# starts it with 8 devices).
if "--xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )
if jax.config.jax_num_cpu_devices != 8:  # older jax refuses even a no-op
  jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead

RECIPES = ("plain", "ours", "jmp", "flax")
MESHES = ("auto", "explicit")
LAYOUTS = ("fsdp", "tp")
OPTS = ("adam", "sgdm")
COLLECTIVES = (
  "all-gather",
  "all-reduce",
  "all-to-all",
  "collective-permute",
  "reduce-scatter",
)
N_DEVICES = 8

# An instruction `%name = TYPE OPCODE(...)`; async pairs count once (the
# `-start`). Op kinds are counted, the text around them is not relied on.
_COLLECTIVE_OP = re.compile(
  r"= (\S.*?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\("
)


def collectives(hlo_text: str):
  """`({kind: count}, non-scalar all-reduces)` in compiled HLO text."""
  counts = dict.fromkeys(COLLECTIVES, 0)
  wide = 0
  for line in hlo_text.splitlines():
    m = _COLLECTIVE_OP.search(line)
    if not m:
      continue
    counts[m.group(2)] += 1
    if m.group(2) == "all-reduce" and any(
      dims for dims in re.findall(r"\[([^\]]*)\]", m.group(1))
    ):
      wide += 1
  return counts, wide


def set_mesh(mesh):
  """The context that makes `mesh` current (`jax.set_mesh`, or
  `jax.sharding.use_mesh` in older jax)."""
  if hasattr(jax, "set_mesh"):
    return jax.set_mesh(mesh)
  return jax.sharding.use_mesh(mesh)


def devices():
  """8 devices of the default backend, else 8 CPU devices (one GPU)."""
  for backend in (None, "cpu"):
    found = jax.devices(backend)
    if len(found) >= N_DEVICES:
      return found[:N_DEVICES]
  raise SystemExit(
    f"needs {N_DEVICES} devices, found {jax.device_count()}:"
    " start it in a fresh process"
  )


def make_mesh(mesh_type: str, layout: str):
  axis_type = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[mesh_type]
  if layout == "fsdp":
    return jax.make_mesh(
      (N_DEVICES,), ("data",), axis_types=(axis_type,), devices=devices()
    )
  return jax.make_mesh(
    (2, N_DEVICES // 2),
    ("data", "model"),
    axis_types=(axis_type, axis_type),
    devices=devices(),
  )


def leaf_specs(layout: str, n_leaves: int):
  if layout == "fsdp":
    return {f"w{i}": P("data", None) for i in range(n_leaves)}
  return {
    f"w{i}": P(None, "model") if i % 2 == 0 else P("model", None)
    for i in range(n_leaves)
  }


def _state_shardings(state_shape, specs, mesh):
  """Each state leaf whose path ends at a param's key is sharded like that
  param (moments, momentum); the rest (counts, scales) is replicated."""

  def sharding(path, leaf):
    key = getattr(path[-1], "key", None) if path else None
    if key in specs and len(leaf.shape) == 2:
      return NamedSharding(mesh, specs[key])
    return NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(sharding, state_shape)


def _inner_state(recipe: str, state):
  """The inner optax state within a recipe's state."""
  if recipe == "plain":
    return state
  if recipe == "ours":
    return state.inner_state
  return state[0]  # jmp and flax: (opt_state, loss-scale state)


def _shardings_kept(recipe, out, plain_out):
  """`(kept, n_leaves, differing paths)`: whether params and inner state
  leave the step with the shardings plain optax gives them."""
  mine = (out[0], _inner_state(recipe, out[1]))
  ref = (plain_out[0], plain_out[1])
  mine_l = jax.tree_util.tree_leaves_with_path(mine)
  ref_l = jax.tree.leaves(ref)
  if len(mine_l) != len(ref_l):
    return False, len(ref_l), ["(structure differs)"]
  differ = [
    jax.tree_util.keystr(path)
    for (path, a), b in zip(mine_l, ref_l, strict=True)
    if not a.sharding.is_equivalent_to(b.sharding, b.ndim)
  ]
  return not differ, len(ref_l), differ


def _first_line(e: Exception) -> str:
  text = str(e).strip().splitlines()
  text = re.sub(
    r"AbstractMesh\((?:[^()]|\([^()]*\))*\)",
    "AbstractMesh(...)",
    text[0] if text else "",
  )
  return f"{type(e).__name__}: {text}"[:200]


def run_case(
  mesh_type,
  layout,
  opt,
  size,
  n_leaves,
  recipes,
  rounds,
  compile_repeats,
  grad_dtype="float32",
):
  """One mesh, layout and optimizer; returns {recipe: result dict}."""
  mesh = make_mesh(mesh_type, layout)
  specs = leaf_specs(layout, n_leaves)
  inner = overhead.inner_of(opt)
  results, live = {}, {}
  with set_mesh(mesh):
    for recipe in recipes:
      r = results[recipe] = dict(
        mesh=mesh_type, layout=layout, opt=opt, recipe=recipe, error=None
      )
      try:
        init, step = overhead.build_variant(recipe, inner)

        params = {
          k: jax.device_put(
            np.full((size, size), 0.01, np.float32), NamedSharding(mesh, spec)
          )
          for k, spec in specs.items()
        }
        state = jax.jit(
          init,
          out_shardings=_state_shardings(
            jax.eval_shape(init, params), specs, mesh
          ),
        )(params)
        grads = {
          k: jax.device_put(
            np.full((size, size), 0.5, grad_dtype), NamedSharding(mesh, spec)
          )
          for k, spec in specs.items()
        }
        compiled, compile_s = overhead.best_compile(
          step, (params, state, grads), compile_repeats
        )
        counts, wide = collectives(compiled.as_text())
        mem = compiled.memory_analysis()
        r.update(
          compile_s=compile_s,
          collectives=counts,
          wide_all_reduces=wide,
          temp_bytes=int(mem.temp_size_in_bytes) if mem else -1,
        )
        out = jax.block_until_ready(compiled(params, state, grads))  # warm-up
        live[recipe] = (compiled, out, grads)
      except Exception as e:  # reported in its row, not raised
        r["error"] = _first_line(e)
        live.pop(recipe, None)
    plain_out = live["plain"][1] if "plain" in live else None
    for recipe in live:
      if plain_out is None:
        break
      kept, n, differ = _shardings_kept(recipe, live[recipe][1], plain_out)
      results[recipe].update(
        shardings_kept=kept, sharded_leaves=n, differing=differ
      )
    times = {recipe: [] for recipe in live}
    for _ in range(rounds):
      for recipe, (compiled, (params, state), grads) in list(live.items()):
        t0 = time.perf_counter()
        new = jax.block_until_ready(compiled(params, state, grads))
        times[recipe].append(time.perf_counter() - t0)
        live[recipe] = (compiled, new, grads)
  base = statistics.median(times["plain"]) if "plain" in times else None
  base_compile = results["plain"].get("compile_s")
  plain = results["plain"]
  for recipe in live:
    r = results[recipe]
    r["median_s"] = statistics.median(times[recipe])
    r["ratio"] = r["median_s"] / base if base else float("nan")
    r["compile_ratio"] = (
      r["compile_s"] / base_compile if base_compile else float("nan")
    )
    r["extra_collectives"] = (
      {k: r["collectives"][k] - plain["collectives"][k] for k in COLLECTIVES}
      if plain["error"] is None
      else None
    )
    r["extra_temp_bytes"] = (
      r["temp_bytes"] - plain["temp_bytes"] if plain["error"] is None else None
    )
  live.clear()
  return results


_ABBREV = {
  "all-gather": "ag",
  "all-reduce": "ar",
  "all-to-all": "a2a",
  "collective-permute": "cp",
  "reduce-scatter": "rs",
}


def _fmt_collectives(counts):
  return " ".join(f"{_ABBREV[k]}{counts[k]}" for k in COLLECTIVES)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--tiny",
    "--smoke",
    action="store_true",
    help="256x256 leaves, a few rounds, one compilation (seconds)",
  )
  p.add_argument(
    "--size",
    type=int,
    default=None,
    help="each leaf is SIZE x SIZE float32 (default 1024)",
  )
  p.add_argument("--leaves", type=int, default=4)
  p.add_argument("--mesh", nargs="+", choices=MESHES, default=list(MESHES))
  p.add_argument("--layout", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
  p.add_argument("--opt", nargs="+", choices=OPTS, default=list(OPTS))
  p.add_argument(
    "--grad-dtype",
    choices=("float32", "float16"),
    default="float32",
    help="params are float32",
  )
  p.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
  p.add_argument(
    "--rounds",
    type=int,
    default=None,
    help="timed interleaved rounds (default 31; 3 with --tiny)",
  )
  p.add_argument(
    "--compile-repeats",
    type=int,
    default=None,
    help="compilations per recipe, the fastest counts"
    " (default 3; 1 with --tiny)",
  )
  args = p.parse_args(argv)
  size = args.size or (256 if args.tiny else 1024)
  rounds = args.rounds or (3 if args.tiny else 31)
  repeats = args.compile_repeats or (1 if args.tiny else 3)
  recipes = list(args.recipes)
  if "plain" not in recipes:
    recipes.insert(0, "plain")
  device = devices()[0]
  print(
    f"device: {N_DEVICES} x {device.device_kind}"
    f" ({device.platform}), jax {jax.__version__},"
    f" optax {optax.__version__}; {args.leaves} leaves of"
    f" {size}x{size} float32, {args.grad_dtype} gradients,"
    f" {rounds} interleaved rounds"
  )
  print(
    "time, compile: ratios to plain; collectives in the compiled HLO"
    " (ag all-gather, ar all-reduce, a2a all-to-all, cp"
    " collective-permute, rs reduce-scatter), wide: non-scalar"
    " all-reduces; temp: memory_analysis() temp KB per device;"
    " shardings: outputs keep plain optax's"
  )
  print(
    f"{'mesh':<8} {'layout':<6} {'opt':<4} {'recipe':<6}"
    f" {'ms':>7} {'time':>5} {'compile':>7}"
    f" {'collectives':<22} {'wide':>4} {'temp KB':>8} shardings"
  )
  all_results = []
  for mesh_type in args.mesh:
    for layout in args.layout:
      for opt in args.opt:
        res = run_case(
          mesh_type,
          layout,
          opt,
          size,
          args.leaves,
          recipes,
          rounds,
          repeats,
          args.grad_dtype,
        )
        for recipe in recipes:
          r = res[recipe]
          head = f"{mesh_type:<8} {layout:<6} {opt:<4} {recipe:<6}"
          if r["error"] is not None:
            print(f"{head} error: {r['error']}", flush=True)
          else:
            kept = r.get("shardings_kept")
            shard = (
              "n/a"
              if kept is None
              else "kept"
              if kept
              else f"differ: {', '.join(r['differing'][:3])}"
            )
            print(
              f"{head} {r['median_s'] * 1e3:7.2f} {r['ratio']:5.2f}"
              f" {r['compile_ratio']:7.2f}"
              f" {_fmt_collectives(r['collectives']):<22}"
              f" {r['wide_all_reduces']:4d}"
              f" {r['temp_bytes'] / 1e3:8.1f} {shard}",
              flush=True,
            )
          all_results.append(
            dict(size=size, leaves=args.leaves, grad_dtype=args.grad_dtype, **r)
          )
  return all_results


if __name__ == "__main__":
  main(sys.argv[1:])
