"""Test set-up: 8 CPU devices, so that pmap, shard_map and sharded jit run
here without accelerators. Must happen before JAX initialises its backend."""

import os

import jax
import pytest

# Both spellings: the config option (newer jax) and the XLA flag (older).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
jax.config.update("jax_num_cpu_devices", 8)

# Worker scripts run in subprocesses; `--doctest-modules` must not import them.
collect_ignore_glob = ["_*_worker.py"]


def pytest_configure(config):
  # equinox 0.13.0, the newest that installs with the oldest supported jax
  # (.ci/oldest.txt), reads a name that jax 0.7.1 deprecates, at import.
  config.addinivalue_line(
    "filterwarnings",
    "ignore:jax.interpreters.batching.NotMapped is deprecated"
    ":DeprecationWarning:equinox",
  )


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
