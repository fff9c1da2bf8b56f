"""``--sweep``: the static window, dynamic scaling from both sides, the
sawtooth, and a data-parallel token mean (notebooks/RESULTS.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from . import runs, train
from .config import Config, SweepPlan
from .results import Landing, RunResult, SweepResult
from .runs import RunSpec, Scaling


def grid_specs(plan: SweepPlan) -> tuple[RunSpec, ...]:
  """The runs of the window's grid: float32, plain float16, the static
  scales, then the dynamic runs.

  >>> [s.name for s in grid_specs(SweepPlan(static_log2=(0, 4),
  ...                                       dynamic=((2.0**15, None),)))]
  ['fp32', 'fp16', 'static 2**0', 'static 2**4', 'dyn 2**15 g2000']
  """
  return (
    runs.fp32(),
    runs.fp16(),
    *(runs.static(2.0**e) for e in plan.static_log2),
    *(runs.dynamic(s, g) for s, g in plan.dynamic),
  )


def sawtooth_specs(plan: SweepPlan) -> tuple[RunSpec, ...]:
  """The sawtooth's runs: float32 and the dynamic pairs."""
  return (runs.fp32(), *(runs.dynamic(s, g) for s, g in plan.sawtooth))


def replica_specs(plan: SweepPlan, config: Config) -> tuple[RunSpec, ...]:
  """The main job's runs named in ``plan.divergence``, each dividing its
  loss by the token count of ``plan.replicas`` replicas."""
  config = dataclasses.replace(config, replicas=plan.replicas)
  specs = {s.name: s for s in runs.main_specs(config)}
  return tuple(specs[name] for name in plan.divergence)


def total_steps(plan: SweepPlan) -> int:
  """Training steps in all (the progress bar's length).

  >>> total_steps(SweepPlan(steps=10, static_log2=(0,), dynamic=(),
  ...                       replicas=0, sawtooth_steps=30))
  120
  """
  n = len(grid_specs(plan))
  if plan.replicas:
    n += len(plan.divergence)
  return n * plan.steps + (1 + len(plan.sawtooth)) * plan.sawtooth_steps


def find_window(
  losses: Mapping[float, float], ref: float, tol: float
) -> tuple[float, float] | None:
  """The usable window: the longest run of consecutive grid scales whose
  held-out loss is within ``tol`` of float32's ``ref`` (``losses``: scale ->
  held-out loss, scales increasing). None if no scale is usable.

  >>> find_window({1.0: 2.5, 4.0: 2.004, 16.0: 1.999, 64.0: 2.5}, 2.0, 0.005)
  (4.0, 16.0)
  """
  best: list[float] = []
  cur: list[float] = []
  for s, loss in losses.items():
    if abs(loss - ref) <= tol:
      cur.append(s)
      if len(cur) > len(best):
        best = list(cur)
    else:
      cur = []
  return (best[0], best[-1]) if best else None


def landing(
  scale: np.ndarray, skipped: np.ndarray, window: tuple[float, float]
) -> Landing | None:
  """When a scale curve first lies in the window, the skipped steps until
  then, and the share of the later steps it stays; None if never.

  >>> landing(np.array([32.0, 16.0, 8.0]), np.array([1, 1, 0]), (4.0, 16.0))
  Landing(steps=2, skips=2, stays=1.0)
  """
  lo, hi = window
  inside = (scale >= lo) & (scale <= hi)
  if not inside.any():
    return None
  first = int(np.argmax(inside))
  return Landing(
    steps=first + 1,
    skips=int(skipped[: first + 1].sum()),
    stays=float(inside[first:].mean()),
  )


def finish(result: SweepResult) -> SweepResult:
  """The result with its window, best static scale and the dynamic runs'
  landings, derived from its runs."""
  static = {
    r.initial_scale: r for r in result.by_scaling(Scaling.STATIC).values()
  }
  static = dict(sorted(static.items()))
  if not static:
    return dataclasses.replace(
      result, window=None, best_static=None, landing=None
    )
  window = find_window(
    {s: r.eval_loss for s, r in static.items()},
    result.runs["fp32"].eval_loss,
    result.plan.tol,
  )
  lands = None
  if window is not None:
    lands = {
      name: landing(r.scale, r.skipped, window)
      for name, r in result.by_scaling(Scaling.DYNAMIC).items()
    }
  return dataclasses.replace(
    result,
    window=window,
    best_static=min(static, key=lambda s: static[s].eval_loss),
    landing=lands,
  )


def run_sweep(
  plan: SweepPlan | None = None,
  config: Config | None = None,
  progress: train.Progress | None = None,
) -> SweepResult:
  """Trains the plan's parts (default: the whole study) on ``config``
  (default: the main job's), with ``plan.steps`` steps and one flush
  checkpoint, at the end."""
  plan = plan or SweepPlan()
  config = dataclasses.replace(
    config or Config(), steps=plan.steps, n_checkpoints=1
  )
  setup = train.prepare(config)
  result = SweepResult(
    config=setup.config,
    plan=plan,
    runs=train.train_all(setup, grid_specs(plan), progress),
  )
  if plan.sawtooth_steps:
    longer = train.prepare(
      dataclasses.replace(config, steps=plan.sawtooth_steps)
    )
    saw = train.train_all(longer, sawtooth_specs(plan), progress, "saw {}")
    result = dataclasses.replace(result, sawtooth=saw)
  if plan.replicas:
    specs = replica_specs(plan, setup.config)
    label = f"R={plan.replicas} {{}}"
    replicas = train.train_all(setup, specs, progress, label)
    result = dataclasses.replace(result, replicas=replicas)
  return finish(result)


def _grid_order(r: RunResult) -> tuple[bool, float]:
  """Unscaled runs first, then the static ones by scale, then dynamic."""
  static = r.spec.scaling is Scaling.STATIC
  return (r.spec.scaling is Scaling.DYNAMIC, r.initial_scale if static else -1)


def _plan_of_parts(
  plan: SweepPlan,
  sawtooth_from: SweepResult | None,
  replicas_from: SweepResult | None,
) -> SweepPlan:
  """The plan with the sawtooth's and the replicas' settings of the
  sweeps those parts come from, so that the report describes them."""
  if sawtooth_from is not None:
    plan = dataclasses.replace(
      plan,
      sawtooth_steps=sawtooth_from.plan.sawtooth_steps,
      sawtooth=sawtooth_from.plan.sawtooth,
    )
  if replicas_from is not None:
    plan = dataclasses.replace(
      plan,
      replicas=replicas_from.plan.replicas,
      divergence=replicas_from.plan.divergence,
    )
  return plan


def merge(results: list[SweepResult]) -> SweepResult:
  """One sweep from several of the same config (e.g. the grid and its
  edges run separately): the first result of each run's name, in grid
  order; the first sawtooth and replicas parts found, with their
  settings."""
  grid: dict[str, RunResult] = {}
  for result in results:
    for name, r in result.runs.items():
      grid.setdefault(name, r)
  ordered = sorted(grid.items(), key=lambda item: _grid_order(item[1]))
  saw = next((r for r in results if r.sawtooth is not None), None)
  rep = next((r for r in results if r.replicas is not None), None)
  return finish(
    SweepResult(
      config=results[0].config,
      plan=_plan_of_parts(results[0].plan, saw, rep),
      runs=dict(ordered),
      sawtooth=None if saw is None else saw.sawtooth,
      replicas=None if rep is None else rep.replicas,
    )
  )
