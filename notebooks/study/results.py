"""What the study produces: one ``RunResult`` per run, gathered into a
``StudyResult`` (the main job) or a ``SweepResult`` (``--sweep``), and
their JSON form (``--json``, and ``--merge`` reading it back)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from .config import BadBatchPlan, Config, SweepPlan
from .runs import RunSpec, Scaling


@dataclasses.dataclass(frozen=True, eq=False)
class RunResult:
  """One run's curves (``loss``, ``scale`` after each step, ``skipped``),
  its held-out ``eval_loss`` and ``eval_acc``, and the flush statistics at
  the checkpoints (``probes.flush_stats``, with the ``step``). The counts
  are derived from the curves, so a result read back from JSON agrees with
  the one that was saved. For the scaled runs, ``skip_stats`` holds the
  library's own counts at the end (``ols.skip_stats``: ``total_skipped``,
  ``skipped_in_a_row``, ``nan_steps``, ``nonfinite_loss_steps``) and
  ``skip_report`` the text of ``ols.skip_report``. ``params`` and
  ``opt_state`` are the final ones when training was asked to keep them
  (the notebook's histograms). Compared by identity: its fields are
  arrays."""

  spec: RunSpec
  loss: np.ndarray
  scale: np.ndarray
  skipped: np.ndarray
  eval_loss: float
  eval_acc: float
  flush: list[dict[str, float]]
  initial_scale: float
  seconds: float = math.nan
  skip_stats: dict[str, int] | None = None
  skip_report: str | None = None
  params: Any = None
  opt_state: Any = None

  @property
  def skipped_total(self) -> int:
    return int(self.skipped.sum())

  @property
  def final_scale(self) -> float:
    return float(self.scale[-1])

  def _previous_scale(self) -> np.ndarray:
    """The scale before each step: the initial one, then each step's."""
    return np.concatenate([[self.initial_scale], self.scale[:-1]])

  @property
  def backoffs(self) -> int:
    return int(np.sum(self.scale < self._previous_scale()))

  @property
  def growths(self) -> int:
    return int(np.sum(self.scale > self._previous_scale()))

  def flush_mean(self, key: str) -> float:
    """A flush statistic's mean over the checkpoints."""
    return float(np.mean([f[key] for f in self.flush]))

  @property
  def flushed_mean(self) -> float:
    return self.flush_mean("flushed")

  @property
  def act_flushed_mean(self) -> float:
    return self.flush_mean("act_flushed")

  @property
  def act_nonfinite_mean(self) -> float:
    return self.flush_mean("act_nonfinite")

  @property
  def skipped_percent(self) -> float:
    return 100 * self.skipped_total / len(self.skipped)

  @property
  def nonfinite_loss_skips(self) -> int:
    """Skipped steps whose loss was not finite (a corrupted batch)."""
    return int(np.sum(self.skipped & ~np.isfinite(self.loss)))


@dataclasses.dataclass(frozen=True, eq=False)
class StudyResult:
  """The main job: its config and its runs by name. ``probe_batch`` is the
  training batch the flush statistics use (not saved to JSON)."""

  config: Config
  runs: dict[str, RunResult]
  probe_batch: Any = None


@dataclasses.dataclass(frozen=True)
class Landing:
  """When a dynamic scale first lies in the window: after ``steps`` steps,
  ``skips`` of them skipped; ``stays``: the share of the steps from then on
  that it is still there."""

  steps: int
  skips: int
  stays: float


@dataclasses.dataclass(frozen=True, eq=False)
class SweepResult:
  """``--sweep``: the runs on the static grid and the dynamic ones, the
  longer ``sawtooth`` runs and the ``replicas`` runs when the plan has
  them, and what ``sweep.finish`` derives: the usable ``window`` (None if
  no static scale is usable), the ``best_static`` scale, and each dynamic
  run's ``landing`` in the window."""

  config: Config
  plan: SweepPlan
  runs: dict[str, RunResult]
  sawtooth: dict[str, RunResult] | None = None
  replicas: dict[str, RunResult] | None = None
  window: tuple[float, float] | None = None
  best_static: float | None = None
  landing: dict[str, Landing | None] | None = None

  def by_scaling(self, scaling: Scaling) -> dict[str, RunResult]:
    """The grid's runs with this scaling mode, in order."""
    return {k: r for k, r in self.runs.items() if r.spec.scaling is scaling}


@dataclasses.dataclass(frozen=True, eq=False)
class BadBatchResult:
  """``--corrupt``: the config (its steps and replicas the plan's), the
  plan, which steps had a corrupted batch (``corrupted``, a bool per
  step), and the runs by name."""

  config: Config
  plan: BadBatchPlan
  corrupted: np.ndarray
  runs: dict[str, RunResult]

  @property
  def corrupted_steps(self) -> list[int]:
    """The corrupted steps, counted from 1."""
    return (np.nonzero(self.corrupted)[0] + 1).tolist()


Result = StudyResult | SweepResult | BadBatchResult


# ---------------------------------------------------------------- to JSON


def _plain(value: Any) -> Any:
  """Numbers and arrays as JSON values, NaN as null."""
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_plain(v) for v in value]
  if isinstance(value, np.ndarray):
    return _plain(value.tolist())
  if isinstance(value, np.generic):
    return _plain(value.item())
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def run_to_json(r: RunResult) -> dict[str, Any]:
  """A run's curves and numbers (the derived counts too, for readers of
  the file), without its parameters."""
  return _plain(
    {
      "spec": r.spec.to_json(),
      "loss": r.loss,
      "scale": r.scale,
      "skipped": r.skipped,
      "eval_loss": r.eval_loss,
      "eval_acc": r.eval_acc,
      "flush": r.flush,
      "flushed_mean": r.flushed_mean,
      "act_flushed_mean": r.act_flushed_mean,
      "act_nonfinite_mean": r.act_nonfinite_mean,
      "initial_scale": r.initial_scale,
      "backoffs": r.backoffs,
      "growths": r.growths,
      "final_scale": r.final_scale,
      "skipped_total": r.skipped_total,
      "seconds": r.seconds,
      "skip_stats": r.skip_stats,
      "skip_report": r.skip_report,
    }
  )


def _runs_to_json(runs: dict[str, RunResult]) -> dict[str, Any]:
  return {name: run_to_json(r) for name, r in runs.items()}


def to_json(result: Result) -> dict[str, Any]:
  """A result as plain JSON values (``load`` reads it back)."""
  out: dict[str, Any] = {"config": dataclasses.asdict(result.config)}
  if isinstance(result, StudyResult):
    out["runs"] = _runs_to_json(result.runs)
    return _plain(out)
  if isinstance(result, BadBatchResult):
    out["bad_batches"] = {
      "plan": dataclasses.asdict(result.plan),
      "corrupted": result.corrupted,
    }
    out["runs"] = _runs_to_json(result.runs)
    return _plain(out)
  out["sweep"] = dataclasses.asdict(result.plan)
  out["runs"] = _runs_to_json(result.runs)
  for part in ("sawtooth", "replicas"):
    if getattr(result, part) is not None:
      out[part] = _runs_to_json(getattr(result, part))
  out["window"] = result.window
  out["best_static"] = result.best_static
  if result.landing is not None:
    out["landing"] = {
      k: None if v is None else dataclasses.asdict(v)
      for k, v in result.landing.items()
    }
  return _plain(out)


def save(result: Result, path: str | os.PathLike, **extra: Any) -> None:
  """Writes ``to_json(result)`` and ``extra`` (the time, the versions)."""
  with open(path, "w") as f:
    json.dump({**to_json(result), **_plain(extra)}, f)


# ---------------------------------------------------------------- from JSON


def _nan(value: Any) -> Any:
  return math.nan if value is None else value


def run_from_json(value: dict[str, Any], name: str) -> RunResult:
  """A run saved by ``run_to_json`` (or by the study before specs had a
  type), its curves back as numpy arrays (a NaN loss, saved as null, back
  as NaN)."""
  return RunResult(
    spec=RunSpec.from_json(value["spec"], name),
    loss=np.asarray(value["loss"], dtype=float),
    scale=np.asarray(value["scale"], dtype=float),
    skipped=np.asarray(value["skipped"], dtype=bool),
    eval_loss=_nan(value["eval_loss"]),
    eval_acc=_nan(value["eval_acc"]),
    flush=[{k: _nan(v) for k, v in f.items()} for f in value["flush"]],
    initial_scale=value["initial_scale"],
    seconds=_nan(value.get("seconds")),
    skip_stats=value.get("skip_stats"),
    skip_report=value.get("skip_report"),
  )


def _runs_from_json(value: dict[str, Any]) -> dict[str, RunResult]:
  return {name: run_from_json(v, name) for name, v in value.items()}


def _pairs(pairs: list[list[Any]]) -> tuple[tuple[float, int | None], ...]:
  return tuple((float(s), g) for s, g in pairs)


def plan_from_json(value: dict[str, Any]) -> SweepPlan:
  """A sweep plan; fields an older file lacks keep their defaults."""
  fields = dict(value)
  for key in ("dynamic", "sawtooth"):
    if key in fields:
      fields[key] = _pairs(fields[key])
  for key in ("static_log2", "divergence"):
    if key in fields:
      fields[key] = tuple(fields[key])
  return SweepPlan(**fields)


def from_json(value: dict[str, Any]) -> Result:
  """The inverse of ``to_json``: a ``SweepResult`` where the file has a
  sweep plan, a ``BadBatchResult`` where it has a bad-batch plan, else a
  ``StudyResult``."""
  config = Config(**value["config"])
  runs = _runs_from_json(value["runs"])
  if "bad_batches" in value:
    bad = value["bad_batches"]
    return BadBatchResult(
      config=config,
      plan=BadBatchPlan(**bad["plan"]),
      corrupted=np.asarray(bad["corrupted"], dtype=bool),
      runs=runs,
    )
  if "sweep" not in value:
    return StudyResult(config=config, runs=runs)
  parts = {
    part: _runs_from_json(value[part])
    for part in ("sawtooth", "replicas")
    if part in value
  }
  landing = value.get("landing")
  return SweepResult(
    config=config,
    plan=plan_from_json(value["sweep"]),
    runs=runs,
    window=None if value["window"] is None else tuple(value["window"]),
    best_static=value["best_static"],
    landing=None
    if landing is None
    else {k: None if v is None else Landing(**v) for k, v in landing.items()},
    **parts,
  )


def load(path: str | os.PathLike) -> Result:
  """A result saved with ``--json``."""
  with open(path) as f:
    return from_json(json.load(f))


def load_sweep(path: str | os.PathLike) -> SweepResult:
  """A sweep saved with ``--sweep --json``; anything else is an error."""
  result = load(path)
  if not isinstance(result, SweepResult):
    raise ValueError(f"{path}: not a sweep (saved without --sweep)")
  return result
