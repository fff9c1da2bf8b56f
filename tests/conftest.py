"""Test set-up: 8 CPU devices, so that pmap, shard_map and sharded jit run
here without accelerators. Must happen before JAX initialises its backend."""

import os

import jax

# Both spellings: the config option (newer jax) and the XLA flag (older).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8"
)
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
