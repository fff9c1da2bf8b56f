"""The command line of ``python notebooks/fp16_study.py``: the main job by
default, ``--sweep`` for the whole study, ``--corrupt`` for the bad-batch
job, ``--merge`` to join sweeps saved with ``--json``. The entry point
chooses the platform; this module does not, so that tests and the notebook
import it on any."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from . import figures, report, results, runs, sweep, train
from .config import BadBatchPlan, Config, SweepPlan
from .results import BadBatchResult, Result, SweepResult

DESCRIPTION = (
  "Float16 with and without loss scaling, on a small character-level LM."
)
PARTS = ("static", "dynamic", "sawtooth", "replicas")


def parser() -> argparse.ArgumentParser:
  """The flags (README.md, docs/study.md and notebooks/RESULTS.md use
  them)."""
  p = argparse.ArgumentParser(description=DESCRIPTION)
  p.add_argument("--steps", type=int, default=None)
  p.add_argument(
    "--short",
    action="store_true",
    help="a smoke run: 10 steps (too few to read much)",
  )
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--static-scale", type=float, default=None)
  p.add_argument("--dynamic-scale", type=float, default=None)
  p.add_argument("--growth-steps", type=int, default=None)
  p.add_argument(
    "--replicas",
    type=int,
    default=None,
    help="divide each replica's loss by the global count",
  )
  p.add_argument("--seed", type=int, default=Config.seed)
  p.add_argument(
    "--sweep", action="store_true", help="the whole study (see RESULTS.md)"
  )
  p.add_argument(
    "--scales",
    default=None,
    help="with --sweep: the static scales' log2, e.g. 1,3",
  )
  p.add_argument(
    "--parts",
    default=None,
    help="with --sweep: some of static,dynamic,sawtooth,"
    "replicas (default: all)",
  )
  p.add_argument(
    "--corrupt",
    type=float,
    default=None,
    metavar="SHARE",
    help="the bad-batch job: this share of the batches corrupted (one NaN),"
    " float32 and dynamic scaling with and without a backoff on a NaN"
    f" loss, {BadBatchPlan.steps} steps (--steps), a global mean over"
    f" {BadBatchPlan.replicas} replicas (--replicas)",
  )
  p.add_argument(
    "--merge",
    nargs="+",
    default=None,
    help="print (and save) sweeps saved with --json as one",
  )
  p.add_argument("--figure", default=None, help="save a PNG here")
  p.add_argument(
    "--json", default=None, help="write every number (curves too) to this path"
  )
  return p


def _main_job(args: argparse.Namespace) -> bool:
  return not (args.sweep or args.corrupt is not None)


def config_from(args: argparse.Namespace) -> Config:
  """The shared settings the flags change. ``--static-scale`` is the main
  job's only (the sweep has its grid); ``--replicas`` is the main job's
  global mean, and the sweep's and the bad-batch job's replica count
  (``plan_from``, ``bad_batch_plan_from``), as are their steps."""
  fields: dict[str, Any] = {"seed": args.seed}
  names = ["batch", "dynamic_scale", "growth_steps"]
  main = _main_job(args)
  if main:
    names += ["static_scale", "replicas"]
  for name in names:
    if getattr(args, name) is not None:
      fields[name] = getattr(args, name)
  if main:
    fields["steps"] = 10 if args.short else (args.steps or Config.steps)
  return Config(**fields)


def bad_batch_plan_from(args: argparse.Namespace) -> BadBatchPlan:
  """The bad-batch job the flags ask for: ``--corrupt SHARE``, with
  ``--steps`` (``--short``: 10) and ``--replicas``."""
  plan = BadBatchPlan(share=args.corrupt)
  steps = 10 if args.short else args.steps
  if steps is not None:
    plan = dataclasses.replace(plan, steps=steps)
  if args.replicas is not None:
    plan = dataclasses.replace(plan, replicas=args.replicas)
  return plan


def plan_from(args: argparse.Namespace) -> SweepPlan:
  """The sweep the flags ask for: ``--steps`` (the sawtooth three times as
  long), ``--replicas``, ``--scales`` and ``--parts``."""
  plan = SweepPlan()
  if args.steps is not None:
    plan = dataclasses.replace(
      plan, steps=args.steps, sawtooth_steps=3 * args.steps
    )
  if args.replicas is not None:
    plan = dataclasses.replace(plan, replicas=args.replicas)
  if args.scales is not None:
    log2 = tuple(int(e) for e in args.scales.split(","))
    plan = dataclasses.replace(plan, static_log2=log2)
  parts = (args.parts or ",".join(PARTS)).split(",")
  dropped = {
    "static": {"static_log2": ()},
    "dynamic": {"dynamic": ()},
    "sawtooth": {"sawtooth_steps": 0},
    "replicas": {"replicas": 0},
  }
  for part, empty in dropped.items():
    if part not in parts:
      plan = dataclasses.replace(plan, **empty)
  return plan


def run(args: argparse.Namespace, progress: train.Progress) -> Result:
  """Trains what the flags ask for (or merges saved sweeps)."""
  if args.merge:
    return sweep.merge([results.load_sweep(p) for p in args.merge])
  if args.sweep:
    return sweep.run_sweep(plan_from(args), config_from(args), progress)
  if args.corrupt is not None:
    return train.run_bad_batches(
      bad_batch_plan_from(args), config_from(args), progress
    )
  return train.run_study(config_from(args), progress)


def total_steps(args: argparse.Namespace) -> int:
  """The progress bar's length: the training steps to come."""
  if args.merge:
    return 0
  if args.sweep:
    return sweep.total_steps(plan_from(args))
  if args.corrupt is not None:
    plan = bad_batch_plan_from(args)
    return plan.steps * len(runs.bad_batch_specs(plan.share, plan.replicas))
  return config_from(args).steps * len(runs.MAIN_RUNS)


def print_report(result: Result) -> None:
  """The header line, then the sweep's table, the bad-batch job's, or the
  main job's tables."""
  config = result.config
  print(report.format_header(config))
  if isinstance(result, SweepResult):
    print(report.format_sweep(result))
    return
  if isinstance(result, BadBatchResult):
    print(report.format_bad_batches(result))
    return
  note = report.format_replicas_note(config)
  if note is not None:
    print(note)
  print()
  print(report.format_runs(result))
  print(report.STEP_NUMBERING)
  print()
  print(report.format_table(result))
  print(report.TABLE_LEGEND)
  print()
  print(report.format_scales(result))
  # One report: the run whose scale moves within the main job.
  text = report.format_main_skip_report(result, "fp16_dynamic_g5")
  if text is not None:
    print()
    print(text)
  conclusion = report.format_conclusion(result)
  if conclusion is not None:
    print()
    print(conclusion)


def save(result: Result, args: argparse.Namespace, seconds: float) -> None:
  """The figure and the numbers, where the flags ask for them."""
  if args.figure:
    if isinstance(result, SweepResult):
      figures.save_sweep_figure(result, args.figure)
    elif isinstance(result, BadBatchResult):
      figures.save_bad_batch_figure(result, args.figure)
    else:
      figures.save_figure(result, args.figure)
    print(f"figure saved to {args.figure}")
  if args.json:
    device = jax.devices()[0].device_kind
    results.save(
      result, args.json, seconds=seconds, jax=jax.__version__, device=device
    )
    print(f"numbers saved to {args.json}")


def main(argv: Sequence[str] | None = None) -> Result:
  """Runs the study as the flags say, printing a progress bar (stderr),
  the tables and the time."""
  from tqdm import tqdm

  args = parser().parse_args(argv)
  if args.merge:
    args.sweep = True
  t0 = time.perf_counter()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  bar = None
  if not args.merge:
    bar = tqdm(total=total_steps(args), unit="step", file=sys.stderr)

  def progress(label: str, n: int) -> None:
    assert bar is not None
    bar.set_description(label)
    bar.update(n)

  result = run(args, progress)
  if bar is not None:
    bar.close()
  print_report(result)
  seconds = time.perf_counter() - t0
  print(f"{seconds:.0f} s in all")
  save(result, args, seconds)
  return result
