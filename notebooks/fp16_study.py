"""Float16 with and without loss scaling, on a small character-level LM.

The command line of the study (``python notebooks/fp16_study.py --help``);
the study itself is the package ``notebooks/study``. This script is the
one place that chooses the platform: CPU, where the numbers in
notebooks/RESULTS.md come from, unless ``JAX_PLATFORMS`` names another.
"""

import os
import sys

# Before jax is imported: jax reads it when it first starts a backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

try:
  import optax_lossscale  # noqa: F401
except ImportError:  # run from a checkout without installing it
  sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  )

# notebooks/, this script's directory, is first on sys.path.
from study.cli import main

if __name__ == "__main__":
  main()
