"""The float16 study (notebooks/study, run by notebooks/fp16_study.py): its
own claims at a reduced size, its bookkeeping, and the notebook that shows
it. The study runs on the session's default platform: only the script
chooses one."""

import contextlib
import dataclasses
import doctest
import importlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from notebooks.study import cli, report, results, runs, sweep, train
from notebooks.study.config import BadBatchPlan, Config, SweepPlan
from notebooks.study.results import Landing, RunResult, SweepResult
from notebooks.study.runs import RunSpec, Scaling

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

# Reduced size: fewer steps than the default command, the same batch (the
# 2**17-token mean is what makes plain float16 underflow: every per-token
# gradient carries the factor 2**-17).
STEPS = 30
# |static - fp32| on held-out loss, nats/char. Seeds and batches are the
# same, so the only differences are float16 rounding.
MATCH_TOL = 0.003
# Plain float16 must be worse than float32 (and than the static run) by at
# least this much: measured +0.0091 at 30 steps here (pytest -s prints the
# losses), +0.013 at 40 (the main job); the scaled runs: +0.0003.
PLAIN_WORSE_BY = 0.005
# The sweep (RESULTS.md) finds the window's edges at 100 steps: from 2**2
# up the held-out loss is within 0.005 of float32; from 2**18 up every step
# overflows from the first one, so a static scale there never trains.
LOW, HIGH = 2.0**2, 2.0**17


@pytest.fixture(scope="module")
def trained():
  # The main job's fast-growing run grows every 5 finite steps and first
  # overflows at step 31 of 40; here, in 30 steps, it grows every 3.
  setup = train.prepare(Config(steps=STEPS, n_checkpoints=1, growth_steps=3))
  specs = (
    *runs.main_specs(setup.config),
    runs.static(2.0**20, "static_high"),
    # From below: growth every 3 finite steps climbs 10 octaves in 30.
    runs.dynamic(1.0, 3, "dyn_from_low"),
    # From above, at the default growth interval: backoffs only.
    runs.dynamic(2.0**32, name="dyn_from_high"),
  )
  out = train.train_all(setup, specs)
  for name, r in out.items():  # shown with pytest -s
    print(
      f"{name:<15} {r.eval_loss:.4f} skipped {r.skipped_total}"
      f" backoffs {r.backoffs} growths {r.growths}"
      f" final 2**{np.log2(r.final_scale):g}"
    )
  return out


@pytest.mark.slow
def test_scales_in_the_window_match_float32(trained):
  ref = trained["fp32"].eval_loss
  # static 2**10, and dynamic at the defaults (2**15, which never moves in
  # 30 steps: no overflow, and growth only after 2000 finite steps)
  for run, scale in (("fp16_static", 2.0**10), ("fp16_dynamic", 2.0**15)):
    r = trained[run]
    assert abs(r.eval_loss - ref) < MATCH_TOL, run
    assert r.skipped_total == 0, run
    assert np.all(r.scale == scale), run
    assert r.act_flushed_mean < 0.01, run


@pytest.mark.slow
def test_the_float32_model_under_autocast_matches_float32(trained):
  ref = trained["fp32"].eval_loss
  r = trained["fp16_autocast"]
  assert r.spec.autocast and r.spec.scaling is Scaling.DYNAMIC
  # As fp16_dynamic does, with no cast written in the model.
  assert abs(r.eval_loss - ref) < MATCH_TOL
  assert r.skipped_total == 0
  assert np.all(r.scale == 2.0**15)
  assert r.act_flushed_mean < 0.01


def _product_dtypes(spec, params, x, y):
  program = jax.make_jaxpr(jax.grad(runs.loss(spec, Config.depth)))(
    params, x, y
  )
  return [
    np.dtype(e.outvars[0].aval.dtype).name
    for e in program.jaxpr.eqns
    if e.primitive.name == "dot_general"
  ]


@pytest.mark.slow
def test_autocast_runs_the_products_the_study_casts_by_hand():
  setup = train.prepare(Config(steps=1, batch=256, max_chars=20_000))
  x, y = setup.probe_batch
  specs = {s.name: s for s in runs.main_specs(setup.config)}
  by_hand = _product_dtypes(specs["fp16_dynamic"], setup.params0, x, y)
  under_autocast = _product_dtypes(specs["fp16_autocast"], setup.params0, x, y)
  # Every product of the gradient program, forward and backward, in float16,
  # as many as the study's own conversion has; the gradients float32.
  assert under_autocast == by_hand == ["float16"] * len(by_hand)
  # Forward, each layer's; backward, each layer's weights' and inputs'
  # (the first layer's input is the embedding, which is trained too).
  assert len(by_hand) == 3 * (Config.depth + 1)
  grads = jax.grad(runs.loss(specs["fp16_autocast"], Config.depth))(
    setup.params0, x, y
  )
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_below_the_window_plain_float16_flushes_and_falls_behind(trained):
  ref = trained["fp32"].eval_loss
  plain = trained["fp16"]
  assert plain.eval_loss - ref > PLAIN_WORSE_BY
  assert plain.eval_loss > trained["fp16_static"].eval_loss + PLAIN_WORSE_BY
  # the cause: a real share of the activation gradients flush to zero,
  # next to none at 2**10; nothing overflows
  assert plain.act_flushed_mean > 0.05
  assert trained["fp16_static"].act_flushed_mean < 0.01
  assert plain.flush[-1]["nonfinite"] == 0
  assert plain.skipped_total == 0


@pytest.mark.slow
def test_above_the_window_every_step_overflows(trained):
  high = trained["static_high"]
  # every step overflows and is skipped, so the parameters never move: the
  # held-out loss is that of the initial model, far behind float32
  assert high.skipped_total == STEPS
  assert np.all(high.scale == 2.0**20)
  assert high.eval_loss > trained["fp16"].eval_loss + 1.0


@pytest.mark.slow
def test_dynamic_lands_in_the_window_from_below(trained):
  r = trained["dyn_from_low"]
  assert r.growths >= 4
  assert LOW <= r.final_scale <= HIGH
  # in the window, almost nothing flushes any more
  assert r.act_flushed_mean < 0.05
  # every scale change was a doubling or a halving, each halving a skip
  ratio = r.scale[1:] / r.scale[:-1]
  assert set(np.unique(ratio)) <= {0.5, 1.0, 2.0}
  assert r.backoffs == r.skipped_total


@pytest.mark.slow
def test_dynamic_lands_in_the_window_from_above(trained):
  r = trained["dyn_from_high"]
  # it backs off once per overflowing step, straight down to the window,
  # and stays there (no growth at the default interval of 2000)
  assert r.backoffs == r.skipped_total >= 32 - 17
  assert r.growths == 0
  assert LOW <= r.final_scale <= HIGH
  first = int(np.argmax(r.scale <= HIGH))
  assert np.all(r.skipped[: first + 1])
  assert not np.any(r.skipped[first + 1 :])
  assert r.final_scale == 2.0**32 / 2.0**r.skipped_total


@pytest.mark.slow
def test_main_job_dynamic_grows_and_backs_off(trained):
  r = trained["fp16_dynamic_g5"]
  # from the default 2**15, growth every 3 finite steps climbs to the
  # overflow edge and saws: both happen, each backoff is one skipped step
  assert r.growths >= 1
  assert r.backoffs >= 1
  assert r.backoffs == r.skipped_total
  prev = np.concatenate([[2.0**15], r.scale[:-1]])
  np.testing.assert_array_equal(r.scale < prev, r.skipped)
  np.testing.assert_array_equal(
    r.scale[r.scale > prev], 2 * prev[r.scale > prev]
  )
  # and it ends at a usable scale, with next to nothing flushed (the
  # overflow edge rises as the gradients shrink during training: 2**17 at
  # the start, 2**20 to 2**21 by step 30)
  assert LOW <= r.final_scale <= 2.0**22
  assert r.act_flushed_mean < 0.01


# ------------------------------------------------ the main job's output


@pytest.fixture(scope="module")
def printed(trained):
  """The main job's report, printed from the reduced runs."""
  result = results.StudyResult(
    config=Config(steps=STEPS, n_checkpoints=1, growth_steps=3),
    runs={name: trained[name] for name in runs.MAIN_RUNS},
  )
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    cli.print_report(result)
  return out.getvalue()


def _table(text):
  lines = text.splitlines()
  start = next(i for i, x in enumerate(lines) if x.startswith("run "))
  return lines[start : start + 1 + len(runs.MAIN_RUNS)]


@pytest.mark.slow
def test_main_table_columns_line_up(printed):
  header, *rows = _table(printed)
  # Every column right-aligned under its heading: each row is as long as
  # the header, and each heading's last character sits above a value's.
  ends = [m.end() for m in re.finditer(r"\S+(?: \S+)*", header)][1:]
  for row in rows:
    assert len(row) == len(header), row
    for end in ends:
      assert row[end - 1] != " ", (header, row)


@pytest.mark.slow
def test_main_job_writes_scales_as_powers_of_two(printed):
  assert not re.search(r"\d\.\d+e\+\d", printed)  # no 1.04858e+06
  _, *rows = _table(printed)
  finals = {row.split()[0]: row.split()[-1] for row in rows}
  assert finals["fp32"] == finals["fp16"] == "-"  # no scale
  assert finals["fp16_static"] == "2**10"
  assert finals["fp16_dynamic"] == finals["fp16_autocast"] == "2**15"
  assert re.fullmatch(r"2\*\*\d+", finals["fp16_dynamic_g5"])


@pytest.mark.slow
def test_main_job_says_activation_before_parameter(printed):
  assert "param / act" not in printed and "(param)" not in printed
  header = _table(printed)[0]
  assert header.index("act flushed %") < header.index("param flushed %")
  assert "(activation % / parameter %)" in printed


@pytest.mark.slow
def test_main_job_numbers_steps_as_the_skip_report_does(printed, trained):
  assert report.STEP_NUMBERING in printed
  r = trained["fp16_dynamic_g5"]
  # The skipped steps in the scale's changes are the report's steps.
  listed = [int(s) for s in re.findall(r"(\d+): 2\*\*\d+ \(skipped\)", printed)]
  np.testing.assert_array_equal(listed, np.nonzero(r.skipped)[0])
  reported = [int(s) for s in re.findall(r"step (\d+): inf", printed)]
  assert reported == listed[-len(reported) :]
  assert len(reported) >= 1


@pytest.mark.slow
def test_main_job_ends_with_the_result(printed, trained):
  closing = " ".join(printed.strip().split("\n\n")[-1].split())
  ref, dyn, plain = (trained[n] for n in ("fp32", "fp16_dynamic", "fp16"))
  assert closing.startswith(f"Result after {STEPS} steps: float16 with dynamic")
  assert f"({dyn.eval_loss:.4f} against {ref.eval_loss:.4f})" in closing
  assert "no skipped step" in closing  # the defaults never overflow here
  assert f"plain float16 ends {plain.eval_loss - ref.eval_loss:.4f} behind" in (
    closing
  )
  assert f"{100 * plain.act_flushed_mean:.0f}% of its activation" in closing
  auto = trained["fp16_autocast"]
  assert "the float32 model under ols.autocast, with the same scaling" in (
    closing
  )
  assert f"({auto.eval_loss:.4f}), with no skipped step" in closing
  # It prints the scale's actions for the run whose scale moves.
  g5 = trained["fp16_dynamic_g5"]
  assert (
    f"{g5.growths} growths, {g5.backoffs} backoffs,"
    f" {g5.skipped_total} skipped steps" in printed
  )


# ------------------------------------------------ corrupted batches

# The bad-batch job (--corrupt) in small: 20 steps of 4096 tokens on a
# 64-replica mean, each batch corrupted with probability 0.3 (seed 0 draws
# 4 of them). What is checked is the bookkeeping and the rule, not the
# cost, which needs the full job (RESULTS.md, Table 5).
BAD = BadBatchPlan(share=0.3, steps=20, replicas=64)


@pytest.fixture(scope="module")
def bad_batches():
  return train.run_bad_batches(BAD, Config(batch=4096))


def _before(r):
  """The scale before each step."""
  return np.concatenate([[r.initial_scale], r.scale[:-1]])


def _words(text):
  """The report's text with its line wrapping undone."""
  return " ".join(text.split())


@pytest.mark.slow
def test_corrupted_batches_are_the_same_in_every_run(bad_batches):
  corrupted = bad_batches.corrupted
  assert 0 < corrupted.sum() < BAD.steps
  for name, r in bad_batches.runs.items():
    # a corrupted batch's loss is NaN, every other loss finite; the step
    # is skipped (float32 by optax.apply_if_finite), and nothing else is
    # in this range of scales
    np.testing.assert_array_equal(~np.isfinite(r.loss), corrupted, name)
    np.testing.assert_array_equal(r.skipped, corrupted, name)
    assert r.nonfinite_loss_skips == corrupted.sum(), name
    assert np.isfinite(r.eval_loss), name


@pytest.mark.slow
def test_keras_rule_halves_the_scale_on_each_corrupted_batch(bad_batches):
  r = bad_batches.runs["fp16_dynamic"]
  corrupted = bad_batches.corrupted
  n = int(corrupted.sum())
  assert r.spec.backoff_on_nonfinite_loss
  np.testing.assert_array_equal(r.scale < _before(r), corrupted)
  np.testing.assert_array_equal(r.scale[corrupted], _before(r)[corrupted] / 2)
  assert r.final_scale == 2.0**15 / 2**n
  # the library's counts: every skip is a corrupted batch (NaN loss, NaN
  # gradients); ordinary overflows would be skips with a finite loss
  overflows = int(np.sum(r.skipped & np.isfinite(r.loss)))
  assert r.skip_stats["total_skipped"] == n + overflows
  assert r.skip_stats["nonfinite_loss_steps"] == n
  assert r.skip_stats["nan_steps"] == n
  text = _words(r.skip_report)
  assert f"the loss itself was not finite in {n} of {n}" in text
  assert "scale 2**15 -> 2**14" in text


@pytest.mark.slow
def test_held_scale_ignores_corrupted_batches(bad_batches):
  r = bad_batches.runs["fp16_dynamic_hold"]
  n = int(bad_batches.corrupted.sum())
  assert not r.spec.backoff_on_nonfinite_loss
  assert np.all(r.scale == 2.0**15)
  overflows = int(np.sum(r.skipped & np.isfinite(r.loss)))
  assert r.skip_stats["total_skipped"] == n + overflows
  assert r.skip_stats["nonfinite_loss_steps"] == n
  text = _words(r.skip_report)
  assert f"the loss itself was not finite in {n} of {n}" in text
  assert "each of those steps left the scale as it was" in text
  assert "scale 2**15 -> 2**15" in text


@pytest.mark.slow
def test_bad_batch_job_prints_reads_back_and_draws(bad_batches, tmp_path):
  text = report.format_bad_batches(bad_batches)
  steps = bad_batches.corrupted_steps
  assert f"{len(steps)} of {BAD.steps} steps, at steps {steps}" in text
  assert "ols.skip_report for fp16_dynamic:" in text
  assert "ols.skip_report for fp16_dynamic_hold:" in text
  path = tmp_path / "bad.json"
  results.save(bad_batches, path)
  back = results.load(path)
  assert isinstance(back, results.BadBatchResult)
  assert back.plan == BAD and back.corrupted_steps == steps
  for name, r in bad_batches.runs.items():
    b = back.runs[name]
    assert b.spec == r.spec
    np.testing.assert_array_equal(b.loss, r.loss)  # NaN back as NaN
    assert (b.skip_stats, b.skip_report) == (r.skip_stats, r.skip_report)
  assert report.format_bad_batches(back) == text
  pytest.importorskip("matplotlib")
  figures = importlib.import_module("notebooks.study.figures")
  figures.save_bad_batch_figure(back, tmp_path / "bad.png")
  assert (tmp_path / "bad.png").stat().st_size > 0


def test_corrupted_batch_specs_are_checked():
  specs = runs.bad_batch_specs(0.04, 64)
  assert [(s.scaling, s.backoff_on_nonfinite_loss) for s in specs] == [
    (Scaling.NONE, True),
    (Scaling.DYNAMIC, True),
    (Scaling.DYNAMIC, False),
  ]
  assert {(s.nan_batch_share, s.replicas) for s in specs} == {(0.04, 64)}
  for share in (-0.1, 1.0, float("nan")):
    with pytest.raises(ValueError, match="nan_batch_share must be in"):
      RunSpec("x", nan_batch_share=share)
  for scaling, scale in ((Scaling.NONE, None), (Scaling.STATIC, 4.0)):
    with pytest.raises(ValueError, match="needs dynamic scaling"):
      RunSpec(
        "x",
        scaling=scaling,
        initial_scale=scale,
        backoff_on_nonfinite_loss=False,
      )
  args = cli.parser().parse_args(["--corrupt", "0.05", "--steps", "30"])
  plan = cli.bad_batch_plan_from(args)
  assert (plan.share, plan.steps, plan.replicas) == (0.05, 30, 64)
  assert cli.total_steps(args) == 90


# ------------------------------------------------ runs, sweeps and records


def test_run_specs_say_what_they_are():
  specs = {s.name: s for s in runs.main_specs(Config(replicas=4))}
  assert tuple(specs) == runs.MAIN_RUNS
  assert [s.scaling for s in specs.values()] == [
    Scaling.NONE,
    Scaling.NONE,
    Scaling.STATIC,
    Scaling.DYNAMIC,
    Scaling.DYNAMIC,
    Scaling.DYNAMIC,
  ]
  assert [s.name for s in specs.values() if s.autocast] == ["fp16_autocast"]
  assert specs["fp16_autocast"].initial_scale is None  # the defaults
  with pytest.raises(ValueError, match="autocast computes in float16"):
    RunSpec("x", dtype="float32", autocast=True)
  assert {s.replicas for s in specs.values()} == {4}
  assert specs["fp32"].compute_dtype == jnp.float32
  g5 = specs["fp16_dynamic_g5"]
  assert (g5.initial_scale, g5.growth_steps) == (2.0**15, 5)
  # None: loss_scale_optimizer's defaults
  assert specs["fp16_dynamic"].initial_scale is None
  with pytest.raises(ValueError, match="unscaled run"):
    RunSpec("x", initial_scale=2.0)
  with pytest.raises(ValueError, match="replicas"):
    runs.fp16(replicas=0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    g5.growth_steps = 7


@pytest.mark.parametrize(
  "module", ["config", "data", "model", "runs", "train", "sweep", "report"]
)
def test_docstring_examples(module):
  # pytest's --doctest-modules covers optax_lossscale/ and tests/ only
  failed, attempted = doctest.testmod(
    importlib.import_module(f"notebooks.study.{module}"),
    optionflags=doctest.NORMALIZE_WHITESPACE,
  )
  assert attempted and not failed


def _record(name, loss=2.0, scales=(1.0,), skipped=None, spec=None):
  """A trained run's record without training: what the sweep's bookkeeping
  reads."""
  if spec is None:
    spec = {"fp32": runs.fp32(), "fp16": runs.fp16()}.get(name)
  if spec is None and name.startswith("static"):
    spec = runs.static(scales[0], name)
  if spec is None:
    spec = runs.dynamic(scales[0], 20, name)
  scales = np.asarray(scales, np.float32)
  return RunResult(
    spec=spec,
    loss=np.full(len(scales), loss, np.float32),
    scale=scales,
    skipped=np.zeros(len(scales), bool)
    if skipped is None
    else np.asarray(skipped, bool),
    eval_loss=loss,
    eval_acc=0.5,
    flush=[
      {"step": len(scales)}
      | dict.fromkeys(
        ("flushed", "nonfinite", "act_flushed", "act_nonfinite"), float("nan")
      )
    ],
    initial_scale=float(spec.initial_scale or 1.0),
  )


def test_window_and_landing():
  losses = {1.0: 2.5, 4.0: 2.004, 16.0: 1.999, 64.0: 2.5, 256.0: 2.0}
  assert sweep.find_window(losses, 2.0, 0.005) == (4.0, 16.0)
  assert sweep.find_window({1.0: 3.0}, 2.0, 0.005) is None
  scale = np.array([32.0, 16.0, 8.0, 16.0, 8.0])
  skipped = np.array([1, 1, 0, 0, 1], bool)
  assert sweep.landing(scale, skipped, (4.0, 16.0)) == Landing(2, 2, 1.0)
  assert sweep.landing(scale, skipped, (64.0, 128.0)) is None


def test_merged_sweeps_are_in_grid_order_with_their_window():
  plan = SweepPlan(tol=0.005)

  def part(*records, **extra):
    return SweepResult(
      config=Config(steps=3),
      plan=plan,
      runs={r.spec.name: r for r in records},
      **extra,
    )

  grid = part(
    _record("fp32"),
    _record("static 2**4", 2.001, [16.0]),
    _record("dyn 2**5 g20", 2.0, [32.0, 16.0, 16.0], [1, 0, 0]),
    _record("static 2**0", 2.3, [1.0]),
  )
  edges = dataclasses.replace(
    part(
      _record("fp32", loss=9.0),  # a later record of a name is not kept
      _record("static 2**2", 2.002, [4.0]),
      _record("fp16", 2.3),
      replicas={"fp32": _record("fp32")},
    ),
    plan=dataclasses.replace(plan, replicas=8),
  )
  merged = sweep.merge([grid, edges])
  assert list(merged.runs) == [
    "fp32",
    "fp16",
    "static 2**0",
    "static 2**2",
    "static 2**4",
    "dyn 2**5 g20",
  ]
  assert merged.runs["fp32"].eval_loss == 2.0
  assert merged.window == (4.0, 16.0)
  assert merged.best_static == 16.0
  assert merged.landing == {"dyn 2**5 g20": Landing(2, 1, 1.0)}
  # each part keeps its settings: the replica count of the sweep it is from
  assert merged.replicas is edges.replicas
  assert merged.plan.replicas == 8
  assert merged.sawtooth is None


def test_json_round_trip(tmp_path):
  r = dataclasses.replace(
    _record("dyn 2**2 g20", 2.5, [4.0, 2.0], [False, True]),
    params={"w": np.zeros(3)},
  )
  out = sweep.finish(
    SweepResult(
      config=Config(steps=2),
      plan=SweepPlan(),
      runs={"fp32": _record("fp32", 2.5, [1.0, 1.0]), r.spec.name: r},
    )
  )
  path = tmp_path / "r.json"
  results.save(out, path, seconds=1.5)
  saved = json.loads(path.read_text())  # strict JSON: NaN saved as null
  assert saved["runs"][r.spec.name]["flush"][0]["act_flushed"] is None
  assert "params" not in saved["runs"][r.spec.name]
  back = results.load_sweep(path)
  b = back.runs[r.spec.name]
  assert b.spec == r.spec
  np.testing.assert_array_equal(b.loss, r.loss)
  np.testing.assert_array_equal(b.scale, r.scale)
  np.testing.assert_array_equal(b.skipped, r.skipped)
  assert (b.backoffs, b.skipped_total) == (1, 1)
  assert np.isnan(b.act_flushed_mean)
  assert b.params is None
  assert back.config == out.config and back.plan == out.plan
  assert back.window is None and back.landing is None


def test_committed_sweep_reads_back_typed():
  # notebooks/figures/fp16_sweep.json was saved before runs had a type:
  # its specs are dicts, read into RunSpecs without parsing any name.
  out = results.load_sweep(NOTEBOOKS / "figures" / "fp16_sweep.json")
  assert out.window == (2.0**2, 2.0**17)
  assert out.runs["static 2**4"].spec == runs.static(16.0)
  assert out.runs["dyn 2**32 g2000"].spec == runs.dynamic(2.0**32)
  assert out.replicas is not None and out.sawtooth is not None
  assert out.replicas["fp16"].spec == runs.fp16()
  assert sweep.finish(out).window == out.window
  from_above = out.landing["dyn 2**32 g20"]
  assert (from_above.steps, from_above.skips) == (15, 15)


def test_command_line_flags():
  args = cli.parser().parse_args(
    ["--sweep", "--steps", "6", "--parts", "static,sawtooth", "--scales", "1"]
  )
  plan = cli.plan_from(args)
  assert (plan.steps, plan.sawtooth_steps) == (6, 18)
  assert (plan.static_log2, plan.dynamic, plan.replicas) == ((1,), (), 0)
  args = cli.parser().parse_args(["--short", "--replicas", "4"])
  assert (cli.config_from(args).steps, cli.config_from(args).replicas) == (
    10,
    4,
  )


def test_the_script_runs_from_anywhere():
  # The README's command runs the script by its path; it finds the study
  # package beside it whatever the working directory.
  done = subprocess.run(
    [sys.executable, str(NOTEBOOKS / "fp16_study.py"), "--help"],
    capture_output=True,
    text=True,
    cwd=ROOT / "tests",
    check=True,
  )
  assert "--sweep" in done.stdout and "--merge" in done.stdout


@pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="what XLA does on CPU"
)
def test_cpu_float16_dot_accumulates_in_float32():
  # notebooks/RESULTS.md and docs/study.md say this of the CPU runs: XLA
  # converts a float16 product's operands to float32 and rounds the result
  # once. 4096 ones sum to 4096 that way; a float16 accumulator stops at
  # 2048, where float16's spacing becomes 2 and 2048 + 1 rounds to 2048.
  ones = jnp.ones((8, 4096), jnp.float16)
  product = ones @ ones.T
  assert product.dtype == jnp.float16
  assert np.all(np.asarray(product, np.float32) == 4096)
  acc = np.float16(0)
  for _ in range(4096):
    acc = np.float16(acc + np.float16(1))
  assert acc == 2048


@pytest.mark.slow
def test_notebook_executes_and_draws(tmp_path):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(NOTEBOOKS / "fp16_study.ipynb", as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs, "commit the notebook with outputs stripped"
  env_before = {
    k: os.environ.get(k)
    for k in ("FP16_STUDY_STEPS", "FP16_STUDY_BATCH", "JAX_PLATFORMS")
  }
  # Small: this checks that the notebook runs and draws, not the numbers.
  # The sweep's figures are drawn from the committed sweep results. CPU:
  # the kernel is a fresh process, which would otherwise take whatever
  # accelerator the machine has.
  os.environ.update(
    FP16_STUDY_STEPS="10", FP16_STUDY_BATCH="8192", JAX_PLATFORMS="cpu"
  )
  try:
    client = nbclient.NotebookClient(
      nb,
      timeout=300,
      kernel_name="python3",
      resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
  finally:
    for k, v in env_before.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  pngs = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.outputs
    if "image/png" in o.get("data", {})
  ]
  assert len(pngs) >= 6
  errors = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.outputs
    if o.get("output_type") == "error"
  ]
  assert not errors
