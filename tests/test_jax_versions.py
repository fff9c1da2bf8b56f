"""The declared jax range, and the skip's jaxpr rewrite on the running jax.

`.ci/run` runs the suite twice: on the newest jax and on the oldest one that
`pyproject.toml` declares (pinned by `.ci/oldest.txt`). On both, the rewrite
in `_skip.update_unless` must run: its fallback (the plain select after the
update) is exact but copies every donated state buffer, and until it warns it
does so silently (jax 0.7's `jax.extend.core` has no `DropVar`, for one).
"""

import importlib
import pathlib
import re
import tomllib

import jax
import jax.numpy as jnp
import pytest
from _helpers import GRADS, INNERS, PARAMS, forbid_fallback
from packaging.requirements import Requirement
from packaging.version import Version

import optax_lossscale as ols

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _jax_requirement() -> Requirement:
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  (jax_req,) = [
    r for r in map(Requirement, project["dependencies"]) if r.name == "jax"
  ]
  return jax_req


def test_the_running_jax_is_in_the_declared_range():
  assert Version(jax.__version__) in _jax_requirement().specifier, (
    f"jax {jax.__version__} is outside pyproject.toml's {_jax_requirement()}"
  )


def test_the_oldest_ci_pin_is_the_declared_floor():
  pins = dict(
    re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", line).groups()
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
  )
  floors = [
    s.version for s in _jax_requirement().specifier if s.operator == ">="
  ]
  assert floors == [pins["jax"]]
  assert pins["jaxlib"] == pins["jax"]


@pytest.mark.parametrize(
  "module",
  [
    "chex",
    "equinox",
    "flax.linen",
    "flax.nnx",
    "flax.training.train_state",
    "jmp",
    "orbax.checkpoint",
  ],
)
def test_the_test_extras_import_on_this_jax(module):
  # Under the suite's filterwarnings = error: a deprecation raised at import
  # by an extra pinned for the oldest jax fails here, not in a later test.
  importlib.import_module(module)


@pytest.mark.parametrize("name", sorted(INNERS))
def test_the_rewrite_runs_on_this_jax(name, monkeypatch):
  """Under jit the skip never takes the plain select after the update."""
  forbid_fallback(monkeypatch)
  tx = ols.loss_scale_optimizer(INNERS[name]())
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), GRADS)
  for grads in (GRADS, nan, GRADS):
    _, state = update(grads, state, PARAMS)
  assert int(ols.skip_stats(state).total_skipped) == 1
