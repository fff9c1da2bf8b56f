"""Compile time of a training step with loss scaling, by phase.

The step: forward, backward and update of a pure-jax residual MLP (three
leaves per layer: a weight matrix, a bias and a gain), float16 compute,
float32 master weights, adam, jitted with params and optimizer state
donated. For each number of layers, each variant is traced
(`jax.jit(f).trace`), lowered (`.lower()`) and compiled (`.compile()`)
afresh `--repeats` times, the variants interleaved. `wall` is the fastest
total (trace + lower + compile) in wall-clock seconds, `cpu` the fastest in
process CPU seconds (XLA compiles kernels on two threads), and the phases
are the fastest of each in CPU seconds: on cores shared with other jobs,
CPU time moves less between repeats than wall time. Ratios are to the
plain step of the same run. `post` rows: the post-gradient step alone
(gradients given: the steps of `overhead.py`), measured the same way.

Sizes, to relate compile time to what a variant adds: `eqns`, the jaxpr's
equations (those of nested jaxprs included); `hlo`, the instructions of
the lowered (unoptimized) HLO module; `opt`, those of the compiled module
(fused computations included); `kern`, the compiled entry computation's
instructions other than parameters, constants, tuples and bitcasts.
`--ops` prints the lowered HLO's instructions by opcode beside the plain
step's. `--passes` compiles each variant once more under `jax.profiler`
and prints where XLA spent that compilation (its passes and code
generation, from XLA's own trace events).

Variants (the post-gradient steps of `overhead.py` after `jax.grad`):

- `plain`: `optax.adam`;
- `ours`: `loss_scale_optimizer(optax.adam)`, with `scale_loss`;
- `ours_select_after`: the same, its skip a plain select after the inner
  update (the package's `rewrite=False`, through `overhead.select_after`);
- `usual_where`: divide, `all(isfinite)` per leaf, inner update,
  `jnp.where` over updates and inner state.

Pieces of `ours`, each alone on the plain step (`--variants`), to bisect:

- `scale_only`: `scale_loss` and the package's unscale (a product per leaf),
  no check, no skip;
- `check_only`: the package's check of the gradients (`all_finite`), its
  flag written to the state, no scaling, no skip;
- `skip_only`, `skip_after_only`: the package's skip of adam on a flag read
  from the state (no gradient read), rewritten or a select after it;
- `unscale_and_check`: `optax.chain(unscale_and_check(), adam)`: ours
  without the skip.

Other forms of parts of `ours` (`--variants`):

- `ours_check_*`: the check traced in another form in place of the
  package's CPU check (see `CHECKS`; `ours_check_none` reads no
  gradient: the floor of everything else in `ours`);
- `ours_one_multiply`: the unscale as one product by `1 / scale`
  (`alternatives.py`'s `one_multiply`: wrong above 2**126, measured for
  what the package's second factor costs);
- `ours_static`: `loss_scale_optimizer(adam, dynamic=False,
  initial_scale=2**15)`: no growth or backoff of the scale (what the
  dynamic rule's scalar bookkeeping costs);
- `ours_cond`: the skip as a `lax.cond` around the inner update instead of
  selects (not the package's design; what a skip without selects would
  cost to compile).

  python benchmarks/compile_time.py                 # a few minutes
  python benchmarks/compile_time.py --tiny          # seconds, smoke test
  python benchmarks/compile_time.py --layers 48 --kinds whole --passes \\
      --variants plain ours scale_only check_only skip_only
"""

import argparse
import collections
import contextlib
import functools
import glob
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.profiler import ProfileData

import optax_lossscale as ols
from optax_lossscale._core import finite as _finite
from optax_lossscale._core import step as _unscale

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import alternatives
import overhead

COMPUTE = jnp.float16
VARIANTS = ("plain", "ours", "ours_select_after", "usual_where")
PIECES = (
  "scale_only",
  "check_only",
  "skip_only",
  "skip_after_only",
  "unscale_and_check",
)


def _adam():
  return optax.adam(1e-3)


# --- the check in other forms ----------------------------------------------


def _exponent_flags(leaves):
  """`magnitude < inf`, read as integers, per leaf: True where finite."""
  magnitude, inf = _finite._MASKS[leaves[0].dtype]
  return [lax.lt(_finite._magnitude_bits(x, magnitude), inf) for x in leaves]


def _all_of(finite):
  """The package's one-pass reduction of a predicate (`_finite._one_pass`)."""
  all_finite, any_not_finite = lax.reduce(
    (finite, ~finite),
    (np.bool_(True), np.bool_(False)),
    _finite._and_or,
    tuple(range(finite.ndim)),
  )
  return all_finite & ~any_not_finite


def _check_per_leaf(leaves):
  """One reduction per leaf (the package's one-pass reduction)."""
  return jnp.all(jnp.stack([_one_pass([x]) for x in leaves]))


def _one_pass(group):
  """The package's one-pass reduction of a group, as one flag (both of its
  answers used, so that XLA keeps the reduction whole)."""
  finite, nan = _finite._one_pass(group)
  return finite & ~nan


def _check_variadic(leaves):
  """The package's CPU grouping, each group one reduction whose operands are
  two predicates a leaf (finite, NaN): no element-wise combination of the
  leaves at all."""

  def one_pass(group):
    if group[0].dtype not in _finite._MASKS:
      return _one_pass(group)
    magnitude, inf = _finite._MASKS[group[0].dtype]
    bits = [_finite._magnitude_bits(x, magnitude) for x in group]
    operands = [lax.lt(b, inf) for b in bits] + [lax.gt(b, inf) for b in bits]
    count = len(bits)
    reduced = lax.reduce(
      tuple(operands),
      (np.bool_(True),) * count + (np.bool_(False),) * count,
      lambda a, b: tuple(
        x & y if i < count else x | y
        for i, (x, y) in enumerate(zip(a, b, strict=True))
      ),
      tuple(range(bits[0].ndim)),
    )
    finite = functools.reduce(lax.bitwise_and, reduced[:count])
    nan = functools.reduce(lax.bitwise_or, reduced[count:])
    return finite & ~nan

  return _grouped(leaves, one_pass)


def _check_max_chain(leaves):
  """The package's CPU grouping, the exponents of a group combined by a
  chain of element-wise maxima, not a balanced tree (the package's form
  before the tree)."""

  def one_pass(group):
    if group[0].dtype not in _finite._MASKS:
      return _one_pass(group)
    magnitude, inf = _finite._MASKS[group[0].dtype]
    largest = _finite._magnitude_bits(group[0], magnitude)
    for x in group[1:]:
      largest = lax.max(largest, _finite._magnitude_bits(x, magnitude))
    return _all_of(lax.lt(largest, inf))

  return _grouped(leaves, one_pass)


def _all_of_flags(flags):
  finite, nan = flags
  return finite & ~nan


def _grouped(leaves, one_pass):
  """`_finite._on_cpu` with `one_pass` for each group."""
  small = [x for x in leaves if x.size < _finite._CONCATENATE_BELOW]
  large = [x for x in leaves if x.size >= _finite._CONCATENATE_BELOW]
  flags = [one_pass(g) for g in _finite._groups_of_one_shape(large)]
  flags += [
    one_pass([jnp.concatenate(flat)])
    for flat in _finite._raveled_by_dtype(small)
  ]
  return jnp.all(jnp.stack(flags))


CHECKS = {
  # The package's form elsewhere than on CPU: groups of up to 64 leaves
  # concatenated, one `all(isfinite)` each.
  "ours_check_concatenated": lambda leaves: _all_of_flags(
    _finite._concatenated(*leaves)
  ),
  "ours_check_per_leaf": _check_per_leaf,
  "ours_check_variadic": _check_variadic,
  "ours_check_max_chain": _check_max_chain,
  # A check that reads no gradient (always finite, and the scale is still
  # checked): what the rest of `ours` costs to compile.
  "ours_check_none": lambda leaves: jnp.ones([], bool),
}


FORMS = ("ours_one_multiply", "ours_static", "ours_cond")


def _skipped_by_cond(finite, update, old_state):
  """The package's skip as a `lax.cond`: the inner update in one branch,
  zero updates and the old state in the other (not the package's design:
  measured for what a skip without selects would cost to compile)."""

  def keep(state):
    updates, _ = jax.eval_shape(update, state)
    zeros = jax.tree.map(lambda u: jnp.zeros(u.shape, u.dtype), updates)
    return zeros, state

  return lax.cond(finite, update, keep, old_state)


@contextlib.contextmanager
def _check_traced_as(check):
  """Traces the package's check of local leaves as `check(leaves)` while
  inside (replacing `_finite._check_here`, whose platform-dependent
  branches jax caches by function: the package's own stay as they are)."""
  original = _finite._check_here

  def checked_here(leaves, per_leaf):
    return _finite.Verdict(check(list(leaves)), jnp.zeros([], bool), None)

  _finite._check_here = checked_here
  try:
    yield
  finally:
    _finite._check_here = original


# --- the post-gradient steps -----------------------------------------------


def _make_post(name, inner):
  """`(init, step(params, state, grads))` for a variant or piece."""
  if name in VARIANTS:
    return overhead._make_variant(name, inner)
  tx = ols.loss_scale_optimizer(inner)
  if name in CHECKS:
    init, step = overhead._make_variant("ours", inner)

    def checked(params, state, grads):
      with _check_traced_as(CHECKS[name]):
        return step(params, state, grads)

    return init, checked
  if name == "ours_one_multiply":
    return alternatives._make_variant("one_multiply", inner)
  if name == "ours_static":
    static = ols.loss_scale_optimizer(inner, False, 2.0**15)
    return static.init, _optax_step(static)
  if name == "ours_cond":
    by_cond = overhead.skip_traced_as(tx, _skipped_by_cond)
    return by_cond.init, _optax_step(by_cond)
  if name == "unscale_and_check":
    chained = optax.chain(ols.unscale_and_check(), inner)
    return chained.init, _optax_step(chained)

  def step(params, state, grads):
    ls_state, inner_state = state.loss_scale_state, state.inner_state
    if name == "scale_only":
      grads = _unscale.unscale(grads, ls_state.loss_scale, params)
    if name == "check_only":
      ls_state = ls_state._replace(last_finite=ols.all_finite(grads))
    if name in ("skip_only", "skip_after_only"):
      # A flag that reads no gradient: the skip's selects alone.
      updates, inner_state = overhead.update_unless(
        ls_state.last_finite,
        lambda s: inner.update(grads, s, params),
        inner_state,
        rewrite=name == "skip_only",
      )
    else:
      updates, inner_state = inner.update(grads, inner_state, params)
    return optax.apply_updates(params, updates), state._replace(
      loss_scale_state=ls_state, inner_state=inner_state
    )

  if name not in PIECES:
    raise ValueError(f"unknown variant {name!r}")
  return tx.init, step


def _optax_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


# Variants whose gradients are of the scaled loss.
_UNSCALED = ("plain", "check_only", "skip_only", "skip_after_only")


# --- the model -------------------------------------------------------------


def _params(layers, width, key):
  keys = jax.random.split(key, layers)
  return [
    {
      "w": jax.random.normal(k, (width, width), jnp.float32) / width**0.5,
      "b": jnp.zeros((width,), jnp.float32),
      "g": jnp.full((width,), 0.5, jnp.float32),
    }
    for k in keys
  ]


def _loss(params, x, y):
  h = x.astype(COMPUTE)
  for layer in params:
    w, b, g = (layer[k].astype(COMPUTE) for k in ("w", "b", "g"))
    h = h + jax.nn.relu(h @ w + b) * g
  return jnp.mean((h.astype(jnp.float32) - y) ** 2)


def _whole_step(name, inner):
  """`(init, step(params, state, x, y))`: the gradient, then the variant's
  post-gradient step."""
  init, post = _make_post(name, inner)

  def step(params, state, x, y):
    if name in _UNSCALED:
      grads = jax.grad(_loss)(params, x, y)
    else:
      grads = jax.grad(lambda p: ols.scale_loss(_loss(p, x, y), state))(params)
    return post(params, state, grads)

  return init, step


# --- measuring -------------------------------------------------------------


def _phases(step, args):
  """`(wall seconds by phase, cpu seconds by phase, traced, lowered,
  compiled)` of one fresh compilation (`jit` caches traces on the function
  object: a new one each time)."""
  fn = jax.jit(lambda *a: step(*a), donate_argnums=(0, 1))
  clocks = [(time.perf_counter(), time.process_time())]
  traced = fn.trace(*args)
  clocks.append((time.perf_counter(), time.process_time()))
  lowered = traced.lower()
  clocks.append((time.perf_counter(), time.process_time()))
  compiled = lowered.compile()
  clocks.append((time.perf_counter(), time.process_time()))
  wall, cpu = (
    {
      phase: clocks[i + 1][k] - clocks[i][k]
      for i, phase in enumerate(("trace", "lower", "compile"))
    }
    for k in (0, 1)
  )
  return wall, cpu, traced, lowered, compiled


def _count_eqns(jaxpr):
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple | list) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          n += _count_eqns(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          n += _count_eqns(sub)
  return n


# `[ROOT] [%]name = TYPE opcode(...)`; TYPE may be a tuple with spaces.
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?(?<![\w.\-])([a-z][a-z0-9\-]*)\("
)
# Entry instructions that are no kernel of their own.
_NOT_KERNELS = frozenset(
  {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
)


def _opcodes(text):
  """`(all opcodes, the entry computation's)` of an HLO module's text."""
  every, entry = collections.Counter(), collections.Counter()
  in_entry = False
  for line in text.splitlines():
    if line.startswith("ENTRY"):
      in_entry = True
    elif line.startswith("}"):
      in_entry = False
    match = _INSTRUCTION.match(line)
    if match:
      every[match[1]] += 1
      if in_entry:
        entry[match[1]] += 1
  return every, entry


def _sizes(traced, lowered, compiled):
  hlo, _ = _opcodes(lowered.as_text(dialect="hlo"))
  opt, entry = _opcodes(compiled.as_text())
  mem = compiled.memory_analysis()
  return dict(
    eqns=_count_eqns(traced.jaxpr.jaxpr),
    hlo=sum(hlo.values()),
    opt=sum(opt.values()),
    kernels=sum(n for op, n in entry.items() if op not in _NOT_KERNELS),
    temp_bytes=getattr(mem, "temp_size_in_bytes", float("nan")),
    hlo_ops=hlo,
  )


# XLA's trace events (CPU compiler), as `jax.profiler` records them.
_PASSES_BEFORE = "HLO passes through layout assignment"
_PASSES_AFTER = "HLO passes after layout assignment"
_SIMPLIFY = "simplification"  # one event per iteration of the fixed point
_SIMPLIFY_AGAIN = "post_scatter_expansion_simplification"


def compile_profile(lowered):
  """Compiles `lowered` under `jax.profiler`; returns seconds (and counts)
  of XLA's phases: HLO passes before and after layout assignment, the
  iterations of its simplification fixed point, code generation (kernels
  compiled on XLA's codegen threads, their summed thread time) and the
  rest of the backend."""
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      t0 = time.perf_counter()
      lowered.compile()
      wall = time.perf_counter() - t0
    (path,) = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    data = ProfileData.from_file(path)
  seconds, counts = collections.Counter(), collections.Counter()
  kernel_s = collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      for e in line.events:
        # Pipeline events carry the module's name: `name (jit_...)`.
        name = re.sub(r" \(jit_[^)]*\)$", "", e.name)
        seconds[name] += e.duration_ns / 1e9
        counts[name] += 1
        if name == "FusionCompiler::Compile":
          module = dict(e.stats).get("module", "")
          kind = "reduce" if "reduce" in module else "other"
          kernel_s[kind] += e.duration_ns / 1e9
  return dict(
    wall=wall,
    passes_before=seconds[_PASSES_BEFORE],
    passes_after=seconds[_PASSES_AFTER],
    simplify=seconds[_SIMPLIFY],
    # The whole-module event and one per iteration share the name.
    simplify_iterations=counts[_SIMPLIFY] - 1,
    simplify_again=seconds[_SIMPLIFY_AGAIN],
    simplify_again_iterations=counts[_SIMPLIFY_AGAIN] - 1,
    copy_insertion=seconds["copy-insertion"],
    backend=seconds["CpuCompiler::RunBackend"],
    codegen=seconds["Codegen"],
    kernels_compiled=counts["FusionCompiler::Compile"],
    kernel_thread_s=sum(kernel_s.values()),
    reduce_kernel_thread_s=kernel_s["reduce"],
    thunks=seconds["ThunkEmitter::EmitEntryComputation"],
  )


def measure(builds, args_of, repeats, passes=False):
  """Compiles each `builds[name]() -> (init, step)` `repeats` times,
  interleaved; returns {name: result dict}: the fastest of each phase, the
  fastest total, the sizes of the last compilation and, with `passes`, a
  profile of one more compilation."""
  steps, args, times = {}, {}, {}
  for name, build in builds.items():
    init, steps[name] = build()
    args[name] = args_of(init)
    times[name] = []
  results = {}
  for _ in range(repeats):
    for name in builds:
      wall, cpu, traced, lowered, compiled = _phases(steps[name], args[name])
      times[name].append((wall, cpu))
      results[name] = _sizes(traced, lowered, compiled)
      del traced, lowered, compiled
  for name, r in results.items():
    for phase in ("trace", "lower", "compile"):
      r[phase] = min(cpu[phase] for _, cpu in times[name])
      r[f"{phase}_wall"] = min(wall[phase] for wall, _ in times[name])
    for key, clock in (("total", 0), ("cpu", 1)):
      totals = [sum(t[clock].values()) for t in times[name]]
      r[key] = min(totals)
      r[f"{key}_all"] = totals
      # (slowest - fastest) / fastest: the noise of the run.
      r[f"{key}_spread"] = (max(totals) - min(totals)) / min(totals)
  if passes:
    for name in builds:
      fn = jax.jit(lambda *a, step=steps[name]: step(*a), donate_argnums=(0, 1))
      results[name]["profile"] = compile_profile(fn.lower(*args[name]))
  return results


_RATIOS = ("total", "cpu", "trace", "lower", "compile", "eqns", "hlo", "opt")


def _report(kind, leaves, results, out, ops):
  base = results.get("plain")
  for name, r in results.items():
    ratio = {k: (r[k] / base[k] if base else float("nan")) for k in _RATIOS}
    r["ratios"] = ratio
    out(
      f"{kind:<5} {leaves:>6} {name:<23} {r['total']:6.2f}"
      f" {ratio['total']:5.2f} {r['total_spread']:5.0%} {r['cpu']:6.2f}"
      f" {ratio['cpu']:5.2f} {r['cpu_spread']:5.0%} {r['trace']:5.2f}"
      f" {r['lower']:5.2f} {r['compile']:6.2f} {ratio['compile']:5.2f}"
      f" {r['eqns']:6d} {ratio['eqns']:5.2f} {r['hlo']:6d}"
      f" {ratio['hlo']:5.2f} {r['opt']:6d} {ratio['opt']:5.2f}"
      f" {r['kernels']:5d} {r['temp_bytes'] / 1e6:6.1f}",
      flush=True,
    )
  if ops and base:
    for name, r in results.items():
      if name == "plain":
        continue
      diff = {
        op: r["hlo_ops"][op] - base["hlo_ops"][op]
        for op in r["hlo_ops"] | base["hlo_ops"]
        if r["hlo_ops"][op] != base["hlo_ops"][op]
      }
      listed = ", ".join(
        f"{op} {n:+d}"
        for op, n in sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0]))
      )
      out(f"      {name}: lowered HLO, beside plain's: {listed}")
  for name, r in results.items():
    p = r.get("profile")
    if p is None:
      continue
    out(
      f"      {name}: profiled compile {p['wall']:.2f} s: passes"
      f" {p['passes_before']:.2f} + {p['passes_after']:.2f} s"
      f" (simplification {p['simplify']:.2f} s in"
      f" {p['simplify_iterations']} iterations, again"
      f" {p['simplify_again']:.2f} s in {p['simplify_again_iterations']};"
      f" copy insertion {p['copy_insertion']:.2f} s); backend"
      f" {p['backend']:.2f} s (codegen {p['codegen']:.2f} s,"
      f" {p['kernels_compiled']} kernels compiled in"
      f" {p['kernel_thread_s']:.2f} s of thread time, reductions"
      f" {p['reduce_kernel_thread_s']:.2f} s; thunks {p['thunks']:.2f} s)"
    )


def run(layers, width, variants, repeats, kinds, out=print, **options):
  """Measures one model size; returns {kind: {variant: result}}."""
  key = jax.random.PRNGKey(0)
  params0 = _params(layers, width, key)
  leaves = len(jax.tree.leaves(params0))
  x = jax.random.normal(jax.random.fold_in(key, 1), (8, width), jnp.float32)
  y = jnp.zeros_like(x)
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params0)
  found = {}
  for kind in kinds:
    make = _whole_step if kind == "whole" else _make_post
    builds = {
      name: (lambda name=name, make=make: make(name, _adam()))
      for name in variants
    }

    def args_of(init, kind=kind):
      params = jax.tree.map(jnp.copy, params0)
      data = (x, y) if kind == "whole" else (grads,)
      return (params, init(params), *data)

    found[kind] = measure(
      builds, args_of, repeats, passes=options.get("passes", False)
    )
    _report(kind, leaves, found[kind], out, options.get("ops", False))
  return found


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true", help="seconds, smoke test")
  p.add_argument(
    "--layers",
    nargs="+",
    type=int,
    default=None,
    help="residual layers, 3 leaves each (default 12 48 96)",
  )
  p.add_argument("--width", type=int, default=None, help="default 128")
  p.add_argument(
    "--variants",
    nargs="+",
    choices=VARIANTS + PIECES + tuple(CHECKS) + FORMS,
    default=list(VARIANTS),
  )
  p.add_argument(
    "--kinds",
    nargs="+",
    choices=("whole", "post"),
    default=["whole", "post"],
    help="the whole training step, the post-gradient step, or both",
  )
  p.add_argument(
    "--repeats",
    type=int,
    default=None,
    help="fresh compilations per variant, the fastest counts (default 3)",
  )
  p.add_argument(
    "--ops", action="store_true", help="lowered HLO opcodes beside plain's"
  )
  p.add_argument(
    "--passes",
    action="store_true",
    help="profile one more compilation: XLA's passes and code generation",
  )
  args = p.parse_args(argv)
  variants = list(dict.fromkeys(["plain", *args.variants]))
  layers = args.layers or ([2] if args.tiny else [12, 48, 96])
  # At 64, a weight matrix has 2**12 elements: the check groups it.
  width = args.width or (64 if args.tiny else 128)
  repeats = args.repeats or (1 if args.tiny else 3)
  print(
    f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}),"
    f" jax {jax.__version__}, optax {optax.__version__}, cpu threads:"
    f" {os.cpu_count()}; residual MLP of width {width}, float16 compute,"
    f" float32 master weights, adam; fastest of {repeats} interleaved"
    " compilations"
  )
  print(
    "wall: seconds of trace + lower + compile, ratio to plain, spread"
    " ((slowest - fastest) / fastest); cpu: the same in process CPU time,"
    " and trace, lower, compile in CPU seconds (fastest each), compile's"
    " ratio; eqns: jaxpr equations; hlo: lowered HLO instructions; opt:"
    " compiled HLO instructions; kern: compiled entry instructions; temp:"
    " memory_analysis() temp MB"
  )
  print(
    f"{'step':<5} {'leaves':>6} {'variant':<23} {'wall':>6} {'ratio':>5}"
    f" {'sprd':>5} {'cpu':>6} {'ratio':>5} {'sprd':>5} {'trace':>5}"
    f" {'lower':>5} {'compile':>6} {'ratio':>5} {'eqns':>6} {'ratio':>5}"
    f" {'hlo':>6} {'ratio':>5} {'opt':>6} {'ratio':>5} {'kern':>5}"
    f" {'temp':>6}"
  )
  return {
    n: run(
      n,
      width,
      variants,
      repeats,
      args.kinds,
      ops=args.ops,
      passes=args.passes,
    )
    for n in layers
  }


if __name__ == "__main__":
  main(sys.argv[1:])
