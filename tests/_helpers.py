"""What several test modules share: trees, inner optimizers, the training
steps, a tree-equality assertion, a `closed_call` equation, the loading
of a script by its path, and the patches of private names.

The private names that tests patch are named here and nowhere else, so that
a change to the package's private modules is met in one place.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols
from optax_lossscale._core import skip as _skip
from optax_lossscale._jaxpr import compat as _compat
from optax_lossscale._jaxpr import interpret as _interpret

# Parameters and gradients of two leaves of different shapes.
PARAMS = {
  "w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4),
  "b": jnp.linspace(0.5, 1.0, 4),
}
GRADS = {"w": jnp.linspace(0.3, -0.2, 12).reshape(3, 4), "b": jnp.full(4, 0.25)}

# Inner optimizers by name, each built afresh: plain ones, and wrappers that
# keep hyperparameters or counters in their state.
INNERS = {
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
  "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
  "lion": lambda: optax.lion(1e-3),
  "lamb": lambda: optax.lamb(1e-3),
  "rmsprop": lambda: optax.rmsprop(1e-3, momentum=0.5),
  "adafactor": lambda: optax.adafactor(1e-2),
  "clip_then_adam": lambda: optax.chain(
    optax.clip_by_global_norm(0.1), optax.adam(1e-2)
  ),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax.linear_schedule(1e-2, 1e-3, 10)
  ),
  "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
  "apply_if_finite": lambda: optax.apply_if_finite(optax.sgd(1e-2), 2),
}


def train_step(tx):
  """`step(params, state, grads) -> (params, state)`: `tx`'s update,
  applied."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def loss_step(tx, loss):
  """`step(params, state, x) -> (params, state)`: the gradients of
  `loss(params, x)` through `ols.value_and_grad`, `tx`'s update applied."""

  def step(params, state, x):
    _, grads = ols.value_and_grad(loss)(state, params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def jit_step(tx, donate=True):
  """`train_step(tx)` under `jit`, its params and state donated as training
  donates them (unless `donate` is false: where a test reads them after)."""
  return jax.jit(train_step(tx), donate_argnums=(0, 1) if donate else ())


def _is_extended(x):
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.extended
  )


def assert_trees_equal(a, b, *, bitwise=True, skip_extended=False):
  """Asserts that `a` and `b` have one tree structure and equal leaves.

  With `bitwise`, each pair of leaves has one dtype, one shape and the same
  bytes: "kept bit for bit" (a NaN equals only a NaN of the same bits, and
  -0.0 is not 0.0). Without, each pair is equal as
  `np.testing.assert_array_equal` compares: by value, NaN equal to NaN in
  the same places, -0.0 equal to 0.0, any dtypes. With `skip_extended`,
  leaves of an extended dtype (typed PRNG keys), which numpy cannot hold,
  are left out.

  >>> zero, minus_zero = {"x": np.float32(0.0)}, {"x": np.float32(-0.0)}
  >>> assert_trees_equal(zero, minus_zero, bitwise=False)
  >>> assert_trees_equal(zero, minus_zero)  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  AssertionError: ("['x']", array(0., dtype=float32), array(-0., ...
  """
  structure_a, structure_b = jax.tree.structure(a), jax.tree.structure(b)
  assert structure_a == structure_b, (structure_a, structure_b)
  leaves_a = jax.tree_util.tree_flatten_with_path(a)[0]
  for (path, x), y in zip(leaves_a, jax.tree.leaves(b), strict=True):
    where = jax.tree_util.keystr(path)
    if skip_extended and _is_extended(x) and _is_extended(y):
      continue
    if not bitwise:
      np.testing.assert_array_equal(x, y, err_msg=where)
      continue
    x, y = np.asarray(x), np.asarray(y)
    assert (x.dtype, x.shape) == (y.dtype, y.shape), (where, x, y)
    assert x.tobytes() == y.tobytes(), (where, x, y)


def closed_call(f, *args):
  """`f(*args)`, bound as one `closed_call_p` equation around `f`'s jaxpr
  (an `eval_jaxpr` equation from jax 0.12 on)."""
  flat, tree = jax.tree.flatten(args)
  closed, out_shape = jax.make_jaxpr(
    lambda *xs: f(*jax.tree.unflatten(tree, list(xs))), return_shape=True
  )(*flat)
  subfuns, params = _compat.bind_params(
    _compat.closed_call_p, {"call_jaxpr": closed}
  )
  outs = _compat.closed_call_p.bind(*subfuns, *flat, **params)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def load_file(path: pathlib.Path, name: str | None = None):
  """The module in the Python file at `path` (a script or a docs/ helper,
  not importable by name), run afresh."""
  spec = importlib.util.spec_from_file_location(name or f"_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# --- patches of private names ---


def forbid_fallback(monkeypatch):
  """Makes the skip's fallback (the plain select after the inner update)
  raise, so that a test fails where the jaxpr rewrite does not run."""

  def fell_back(*args, **kwargs):
    raise AssertionError(
      f"update_unless fell back to the plain select on jax {jax.__version__}"
    )

  monkeypatch.setattr(_skip, "_select_after", fell_back)


def break_the_rewrite(monkeypatch, error):
  """Makes the jaxpr rewrite raise `error` where it re-binds an equation,
  so that the skip falls back, and forgets the reasons already warned of,
  so that the fallback warns again."""

  def broken_eval(*args, **kwargs):
    raise error

  monkeypatch.setattr(_interpret, "evaluate", broken_eval)
  monkeypatch.setattr(_skip, "_FALLBACK_REASONS_SAID", set())


def rewrite_off(monkeypatch):
  """Makes the skip trace as a plain select after the inner update (its
  `rewrite=False`), as where the rewrite falls back."""
  update_unless = _skip.update_unless

  def select_after(*args, **kwargs):
    return update_unless(*args, **{**kwargs, "rewrite": False})

  monkeypatch.setattr(_skip, "update_unless", select_after)
