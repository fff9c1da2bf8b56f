"""A pickle of any loss-scaled state names only public paths, and loads in a
fresh process that imports nothing but `pickle` (issue 35, point 3); the
pickles of 0.2.0, which name `optax_lossscale._core.state`, still load."""

import io
import pathlib
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_equal

import optax_lossscale as ols

PARAMS = {"w": jnp.ones(3), "b": jnp.zeros(2)}
V020 = pathlib.Path(__file__).resolve().parent / "fixtures" / "v020"

MADE = {
  "dynamic": lambda: ols.loss_scale_optimizer(optax.adam(1e-3)),
  "leaf_stats": lambda: ols.loss_scale_optimizer(
    optax.adam(1e-3), leaf_stats=True, hysteresis=2
  ),
  "static": lambda: ols.loss_scale_optimizer(
    optax.sgd(0.1), dynamic=False, initial_scale=8.0
  ),
  "unscale_and_check": lambda: optax.chain(
    ols.unscale_and_check(leaf_stats=True), optax.sgd(0.1)
  ),
}


def state_of(name):
  """The state after a finite step, an overflow and a bad batch."""
  tx = MADE[name]()
  state = tx.init(PARAMS)
  for poison, loss in ((None, 1.0), (np.inf, 1.0), (np.nan, np.nan)):
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    if poison is not None:
      grads["w"] = grads["w"].at[0].set(poison)
    _, state = tx.update(grads, state, PARAMS, value=jnp.float32(loss))
  return jax.device_get(state)


def globals_named(data):
  """The (module, name) of every class or function the pickle names, as
  unpickling looks them up."""
  found = []

  class Recording(pickle.Unpickler):
    def find_class(self, module, name):
      found.append((module, name))
      return super().find_class(module, name)

  Recording(io.BytesIO(data)).load()
  return found


def load_in_a_fresh_process(data):
  """Unpickles `data` in a new Python that imports only `pickle` itself,
  and returns it pickled again."""
  code = (
    "import pickle, sys;"
    " state = pickle.loads(sys.stdin.buffer.read());"
    " sys.stdout.buffer.write(pickle.dumps(state))"
  )
  done = subprocess.run(
    [sys.executable, "-c", code],
    input=data,
    capture_output=True,
    check=True,
    env={"JAX_PLATFORMS": "cpu", "PATH": "", **_python_env()},
  )
  return done.stdout


def _python_env():
  import os

  return {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}


@pytest.mark.parametrize("name", sorted(MADE))
def test_a_pickled_state_names_public_paths_and_loads_afresh(name):
  state = state_of(name)
  data = pickle.dumps(state)
  ours = [m for m, _ in globals_named(data) if m.startswith("optax_lossscale")]
  assert ours and set(ours) == {"optax_lossscale"}, ours
  again = pickle.loads(load_in_a_fresh_process(data))
  assert_trees_equal(again, state)
  assert str(ols.skip_report(again)) == str(ols.skip_report(state))


def test_a_v020_pickle_loads_afresh():
  data = (V020 / "checkpoint.pkl").read_bytes()
  private = {
    (m, n) for m, n in globals_named(data) if m.startswith("optax_lossscale.")
  }
  assert private == {
    ("optax_lossscale._core.state", "SkipEvents"),
    ("optax_lossscale._core.state", "LeafCounts"),
  }
  loaded = pickle.loads(load_in_a_fresh_process(data))
  state = ols.upgrade_state(loaded)["opt_state"]
  assert type(state.loss_scale_state.recent_skips) is ols.SkipEvents
  assert int(ols.skip_stats(state).total_skipped) == 4
