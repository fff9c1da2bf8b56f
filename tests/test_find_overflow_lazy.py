"""The finder on demand (issue 35, points 1 and 2): importing the package
loads none of it, a jax that lacks a primitive the finder knows still
imports the package and trains, `ols.find_overflow` and the types it
returns resolve on first use, and a finder run writes none of jax's state.
"""

import math
import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import optax_lossscale as ols

F16 = jnp.float16


def _run(code: str) -> str:
  """`code` in a fresh Python process; its standard output."""
  done = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)],
    capture_output=True,
    text=True,
    check=True,
  )
  return done.stdout


def test_importing_the_package_loads_no_finder_module():
  out = _run(
    """
    import sys, optax_lossscale
    print([m for m in sys.modules if "finder" in m or "overflow" in m])
    """
  )
  assert out.strip() == "[]"


def test_training_loads_no_finder_module():
  out = _run(
    """
    import sys, jax, jax.numpy as jnp, optax, optax_lossscale as ols
    tx = ols.loss_scale_optimizer(optax.sgd(0.1))
    params = jnp.ones(3)
    state = tx.init(params)
    loss, grads = ols.value_and_grad(lambda p: jnp.sum(p * p))(state, params)
    tx.update(grads, state, params, value=loss)
    print(ols.skip_report(state, tx) is not None)
    print([m for m in sys.modules if "finder" in m or "overflow" in m])
    """
  )
  assert out.split() == ["True", "[]"]


@pytest.mark.slow
def test_a_jax_without_a_primitive_the_finder_knows_trains():
  # exp_p taken away before the package is imported: the package imports
  # and trains; the finder, on first use, names what this jax lacks.
  out = _run(
    """
    import jax.extend.core.primitives as primitives
    del primitives.exp_p
    import jax.numpy as jnp, optax, optax_lossscale as ols
    tx = ols.loss_scale_optimizer(optax.sgd(0.1))
    params = jnp.ones(3)
    state = tx.init(params)
    grads = jax.grad(lambda p: jnp.sum(p * p))(params)
    updates, state = tx.update(grads, state, params)
    print(float(updates[0]))
    try:
      ols.find_overflow(lambda p: jnp.sum(p * p), params)
    except RuntimeError as e:
      print(e)
    """.replace("import jax.numpy", "import jax, jax.numpy")
  )
  first, message = out.strip().split("\n", 1)
  # sgd(0.1) on the gradient 2, passed unscaled, divided by 2**15.
  assert math.isclose(float(first), -0.2 / 2**15, rel_tol=1e-6)
  assert "find_overflow does not run on jax" in message
  assert "exp_p" in message and "Training is not affected" in message


def test_the_finder_resolves_lazily_as_a_public_name():
  assert "find_overflow" in dir(ols) and "find_overflow" in ols.__all__
  for name in ("Overflow", "OverflowReport", "ScopeStats"):
    assert name in dir(ols) and name in ols.__all__
    assert getattr(ols, name).__module__ == "optax_lossscale"
  assert ols.find_overflow.__doc__.startswith("Finds the first harmful")


def test_a_report_pickles_by_its_public_path():
  def loss(w):
    return jnp.sum(jnp.exp(w.astype(F16)).astype(jnp.float32))

  report = ols.find_overflow(loss, jnp.full(2, 16.0))
  data = pickle.dumps(report)
  assert b"optax_lossscale._diagnostics" not in data
  out = _run(
    f"""
    import pickle
    report = pickle.loads({data!r})
    print(type(report).__module__, report.first.primitive)
    """
  )
  assert out.split() == ["optax_lossscale", "exp"]


def test_a_finder_run_writes_none_of_jaxs_state():
  # The transposition rules jax looks up are as they were while the finder
  # traces a custom_vjp's backward rule (the rule looks, as it is traced),
  # and jax's source-information context is the same object after the run
  # (the finder enters jax's own scoped context managers only).
  from jax._src import source_info_util
  from jax._src.interpreters import ad

  tables = [
    t
    for t in (
      getattr(ad, "primitive_transposes", None),
      getattr(ad, "fancy_transposes", None),
    )
    if t is not None
  ]
  before = [dict(t) for t in tables]
  context = source_info_util._source_info_context
  seen = []

  @jax.custom_vjp
  def clip(h):
    return h

  def backward(_, g):
    seen.append([dict(t) == b for t, b in zip(tables, before, strict=True)])
    return (g,)

  clip.defvjp(lambda h: (h, None), backward)
  outer = context.context
  ols.find_overflow(
    lambda w: jnp.sum(clip(w.astype(F16)).astype(jnp.float32)), jnp.ones(2)
  )
  assert seen and all(all(marks) for marks in seen)
  assert [dict(t) for t in tables] == before
  assert context.context is outer
