"""Test set-up: 8 CPU devices, so that pmap, shard_map and sharded jit run
here without accelerators. Must happen before JAX initialises its backend."""

import os
import pathlib

import jax
import pytest

# Both spellings: the config option (newer jax) and the XLA flag (older).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax.config.update("jax_num_cpu_devices", 8)

# Worker scripts run in subprocesses; `--doctest-modules` must not import them.
collect_ignore_glob = ["_*_worker.py"]

# The check users run is the check the suite runs. On CPU the package lowers
# the finiteness check of a tree to a CPU form of its own (kept for its
# speed there: benchmarks/README.md, "The check's forms"); on GPU and TPU to
# another. Every test runs with the latter, but those marked
# `cpu_check_form`, which test the CPU form.
from optax_lossscale._core import reductions as _reductions  # noqa: E402


def pytest_runtest_setup(item):
  # Before the item's fixtures, so that a module's fixtures are made with
  # the form of the first test that needs them.
  marked = item.get_closest_marker("cpu_check_form") is not None
  _reductions.lower_cpu_as_accelerators(not marked)


def pytest_sessionfinish(session):
  _reductions.lower_cpu_as_accelerators(False)


def pytest_configure(config):
  # equinox 0.13.0, the newest that installs with the oldest supported jax
  # (.ci/oldest.txt), reads a name that jax 0.7.1 deprecates, at import.
  config.addinivalue_line(
    "filterwarnings",
    "ignore:jax.interpreters.batching.NotMapped is deprecated"
    ":DeprecationWarning:equinox",
  )


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect, and xdist
def pytest_collection_modifyitems(config, items):
  # XLA on CPU in jaxlib < 0.8 has no fast float16 dot: it computes one
  # about 30x slower than 0.8 (a [131072, 128] x [128, 32] float16 product:
  # 8-16 s on jaxlib 0.7.1-0.7.2, 0.2-0.6 s on 0.8.0-0.10.2, on this 2-core
  # machine), so the float16 study's 2**17-token training runs for hours
  # there, past CI's time limit. The oldest supported jax runs the rest.
  slow_float16_dot = pytest.mark.skipif(
    jax.default_backend() == "cpu"
    and tuple(int(p) for p in jax.lib.__version__.split(".")[:2]) < (0, 8),
    reason="jaxlib < 0.8 on CPU has no fast float16 dot (about 30x "
    "slower): the float16 study would run for hours",
  )
  for item in items:
    if item.path.name == "test_study.py":
      item.add_marker(slow_float16_dot)
  _mark_slow(config, items)
  _longest_first(items)


# The tests that `-m "not slow"` leaves out: by file, the test's name (all
# its parametrizations) or one parametrization's, each with why it is slow
# (most take 5 to 20 CPU seconds each, on this 2-core machine). Files whose
# owners mark their own slow tests (`@pytest.mark.slow`) are not listed.
# A prefix that matches nothing in a file collected whole is an error, so
# the list follows renames.
SLOW = {
  "tests/test_study.py": {
    # The `trained` fixture: float16 training runs (about 90 CPU seconds).
    "test_scales_in_the_window_match_float32": "the `trained` fixture",
    "test_below_the_window_plain_float16_flushes_and_falls_behind": "same",
    "test_above_the_window_every_step_overflows": "same",
    "test_dynamic_lands_in_the_window_from_below": "same",
    "test_dynamic_lands_in_the_window_from_above": "same",
    "test_main_job_dynamic_grows_and_backs_off": "same",
    # The `bad_batches` fixture: 64-replica runs (about 13 CPU seconds).
    "test_corrupted_batches_are_the_same_in_every_run": "`bad_batches`",
    "test_keras_rule_halves_the_scale_on_each_corrupted_batch": "same",
    "test_held_scale_ignores_corrupted_batches": "same",
    "test_bad_batch_job_prints_reads_back_and_draws": "same",
    "test_notebook_executes_and_draws": "runs the notebook in a kernel",
    "test_main_table_columns_line_up": "`trained`, through `printed`",
    "test_main_job_writes_scales_as_powers_of_two": "same",
    "test_main_job_says_activation_before_parameter": "same",
    "test_main_job_numbers_steps_as_the_skip_report_does": "same",
    "test_main_job_ends_with_the_result": "same",
  },
  "tests/test_gemma.py": {
    # Each runs the finder on the Gemma-style model (about 10 s); the
    # healthy step's and the mask's case stays in the fast subset.
    "test_attention_logits_beyond_65504_finder": "the finder on the model",
    "test_gelu_cube_overflow_finder": "same",
    "test_nan_batches_finder": "same",
    "test_inf_loss_with_finite_gradients_finder": "same",
    "test_backward_overflow_at_2_24_finder": "same",
    "test_rsqrt_derivative_at_a_tiny_variance_finder": "same",
    "test_the_finder_lets_no_numpy_warning_out": "same",
    "test_a_healthy_step_has_no_overflow_and_the_mask_is_none": "same",
  },
  "tests/test_benchmarks.py": {
    "test_compile_time_tiny": "compiles many programs",
    "test_train_step_tiny": "times several train steps",
    "test_device_time_tiny": "profiles several train steps",
    "test_sharded_tiny_report": "the `sharded_tiny` fixture: every mesh, "
    "layout and recipe",
    "test_sharded_tiny_structural_claims": "same",
    "test_sharded_tiny_no_gradient_sized_temporary": "same",
  },
  "tests/test_examples.py": {
    "test_example_trains_in_float16[nnx_gpt_fp16]": "a sharded GPT",
    "test_gpt_example_trains_sharded_and_tracks_float32": "its run",
    "test_example_trains_in_float16[nnx_mnist_tutorial_fp16]": "the digits "
    "tutorial",
    "test_converted_tutorial_learns_the_digits": "its run",
    # nnx_mlp_fp16 stays: the fast subset runs one example end to end.
    "test_example_trains_in_float16[linen_trainstate_fp16]": "a training run",
    "test_example_trains_in_float16[equinox_mlp_fp16]": "a training run",
  },
  "tests/test_doc_outputs.py": {
    "test_printed_output_matches[docs/recipes.md]": "runs the page, as"
    " test_doc_snippets.py's slow case of it does",
    "test_printed_output_matches[docs/frameworks.md]": "same",
    "test_printed_output_matches[docs/float16_goes_wrong.md]": "same",
  },
  "tests/test_doc_snippets.py": {
    "test_page_runs[docs/recipes.md]": "trains several models",
    "test_page_runs[docs/frameworks.md]": "trains in every framework",
    "test_page_runs[docs/composition.md]": "many optimizers",
    "test_page_runs[docs/float16_goes_wrong.md]": "trains several models",
  },
  "tests/test_finite.py": {
    "test_unscaled_check_matches_the_elementwise_definition": "hypothesis "
    "compiles a check per tree",
    "test_nan_in_a_large_leaf_is_found_wherever_it_is": "large leaves",
  },
  "tests/test_sharding.py": {
    "test_all_finite_on_a_mesh[AxisType.Explicit]": "compiles per layout",
    "test_the_accelerator_form_of_the_check_adds_no_gathering": "same",
  },
  "tests/test_resume_kill.py": {
    "test_sigkill_then_resume_equals_uninterrupted"
    "[kill-during-overflow-streak]": "three subprocesses; the clean-run "
    "case stays in the fast subset",
  },
  "tests/test_faults.py": {
    "test_random_fault_schedules[hysteresis3-odd-factors]": "50 schedules"
    " each; the keras-like configuration stays in the fast subset",
    "test_random_fault_schedules[below-one]": "same",
    "test_random_fault_schedules[hysteresis2-pinned-max]": "same",
    "test_random_fault_schedules[static]": "same",
    "test_random_fault_schedules[inject-hyperparams]": "same",
  },
  "tests/test_optax_sweep.py": {
    "test_wrapped_like_plain[optax.adabelief]": "the sweep's slowest"
    " compilations; the rest of the sweep stays in the fast subset",
    "test_wrapped_like_plain[optax.scale_by_lbfgs]": "same",
    "test_wrapped_like_plain[optax.noisy_sgd]": "same",
  },
  "tests/test_training.py": {
    "test_flax_train_state_trains_in_float16": "a training run (the"
    " TrainState step stays in the fast subset, in test_frameworks.py)",
  },
  "tests/test_distributed.py": {
    "test_two_processes_skip_together": "starts two processes",
  },
  "tests/test_step_on_meshes.py": {
    "test_gemma_inf_loss_with_its_batch_sharded_is_skipped": "trains the"
    " model on a mesh and on one device",
    "test_gemma_inf_loss_with_its_batch_sharded_diagnosis": "same",
  },
  "tests/test_find_overflow_cases.py": {
    "test_the_memory_benchmark_runs_tiny": "a process per variant",
  },
  "tests/test_checkpoint.py": {
    "test_migrate_plain_optax_checkpoint": "orbax saves and restores",
  },
}
_SLOW_PREFIXES = [f"{f}::{t}" for f, tests in SLOW.items() for t in tests]


def _matches(nodeid, prefix):
  return nodeid == prefix or nodeid.startswith((prefix + "[", prefix + "::"))


def _mark_slow(config, items):
  unmatched = set(_SLOW_PREFIXES)
  for item in items:
    for prefix in _SLOW_PREFIXES:
      if _matches(item.nodeid, prefix):
        item.add_marker(pytest.mark.slow)
        unmatched.discard(prefix)
  stale = [p for p in sorted(unmatched) if _collected_whole(config, p)]
  if stale:  # a failing test, not an error: xdist's workers lose the latter
    items.append(_StaleSlowEntries.from_parent(items[0].session, stale=stale))


class _StaleSlowEntries(pytest.Item):
  def __init__(self, *, stale, **kwargs):
    super().__init__(name="tests/conftest.py::SLOW", **kwargs)
    self.stale = stale

  def runtest(self):
    raise AssertionError(
      "tests/conftest.py: SLOW lists tests that were not collected "
      f"(renamed or removed?): {self.stale}"
    )

  def reportinfo(self):
    return self.path, None, self.name


def _collected_whole(config, prefix):
  """Whether this run collects the whole file that `prefix` is in (so a
  prefix that matched nothing is stale, not left out by the command)."""
  path = config.rootpath / prefix.split("::")[0]
  for arg in config.args:
    if "::" in arg:
      continue
    where = pathlib.Path(config.invocation_params.dir, arg).resolve()
    if path == where or where in path.parents:
      return True
  return False


# Under `--dist loadfile --no-loadscope-reorder` xdist hands out files in
# collection order; the longest start first, so that no core waits at the
# end for one of them.
FIRST = (
  "test_study.py",
  "test_benchmarks.py",
  "test_gemma.py",
  "test_optax_sweep.py",
  "test_examples.py",
  "test_sharding.py",
  "test_doc_snippets.py",
)


def _longest_first(items):
  def rank(item):
    name = item.path.name
    return FIRST.index(name) if name in FIRST else len(FIRST)

  items.sort(key=rank)  # stable: the order within each file is kept


@pytest.hookimpl(optionalhook=True)  # xdist's hook; absent with -p no:xdist
def pytest_xdist_auto_num_workers(config):
  """`-n auto` (pyproject.toml): one worker a core, but none (the tests run
  in this process, with no workers to start) when the command names one
  test file or tests in one file."""
  files = {arg.split("::")[0] for arg in config.args}
  if len(files) == 1 and pathlib.Path(files.pop()).suffix == ".py":
    return 0
  return None  # xdist's own count


def pytest_terminal_summary(terminalreporter):
  # The fault-injection totals that each configuration's test in
  # tests/test_faults.py records (and asserts on) for itself.
  lines = [
    f"{report.nodeid}: " + ", ".join(f"{k}={v}" for k, v in value.items())
    for reports in terminalreporter.stats.values()
    for report in reports
    if getattr(report, "when", None) == "call"
    for name, value in getattr(report, "user_properties", ())
    if name == "fault_totals"
  ]
  if lines:
    terminalreporter.write_sep("-", "fault injection totals")
    for line in lines:
      terminalreporter.write_line(line)
