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
    # The study, and the finder's memory measured at the benchmark's size
    # (16 float16 products of [4096, 512] x [512, 512]: 85 s there).
    if item.path.name == "test_study.py" or item.name == (
      "test_peak_memory_is_a_few_times_value_and_grads"
    ):
      item.add_marker(slow_float16_dot)
  _longest_first(items)


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
  "test_doc_outputs.py",
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
