"""Every transformation that optax and optax.contrib build with default-ish
arguments, wrapped by `loss_scale_optimizer` under `jit`.

For each: the jaxpr rewrite of the skip is taken (its fallback would raise
here), finite steps match the plain transformation, and a non-finite step
keeps the parameters and the inner state bit for bit. Those that cannot
take part are listed with the reason.
"""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from _helpers import PARAMS, assert_trees_equal, forbid_fallback
from jax.extend import core as jex_core

import optax_lossscale as ols

SCALE = 16.0  # a power of two: the unscaled gradients are exact

# Values for required arguments, by name.
ARGUMENTS = {
  "learning_rate": 1e-2,
  "clipping": 1.0,
  "eta": 0.01,
  "gamma": 0.55,
  "max_delta": 1.0,
  "threshold": 1.0,
  "max_norm": 1.0,
  "decay": 0.9,
  "step_size": 0.1,
  "max_backtracking_steps": 5,
  "max_linesearch_steps": 5,
  "step_size_fn": lambda count: 0.1,
  "inner": optax.sgd(0.1),
  "max_consecutive_errors": 2,
  "should_transform_fn": lambda count: count % 2 == 0,
  "mask": {"w": True, "b": False},
  "inner_factory": optax.adam,
  "measure": lambda updates: optax.tree.norm(updates),
  "measure_name": "norm",
  "f": lambda updates, params=None: updates,
  "tx": optax.sgd(0.1),
  "optimizer": optax.sgd(0.1),
  "adv_optimizer": optax.sgd(0.1),
  "base_optimizer": optax.sgd(0.1),
  "freeze_mask": {"w": False, "b": True},
  "transforms": {"a": optax.adam(0.1), "s": optax.sgd(0.1)},
  "param_labels": {"w": "a", "b": "s"},
  "l2_norm_clip": 1.0,
  "noise_multiplier": 0.1,
  "seed": 0,
  "fast_optimizer": optax.sgd(0.1),
  "sync_period": 2,
  "slow_step_size": 0.5,
  "args": (optax.sgd(0.1),),
}
# Built by hand: the generic fill does not fit their signatures.
SPECIAL = {
  "optax.inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
    learning_rate=0.1
  ),
  "optax.inject_stateful_hyperparams": lambda: (
    optax.inject_stateful_hyperparams(optax.adam)(learning_rate=0.1)
  ),
  "optax.chain": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adam(0.1)
  ),
  "optax.named_chain": lambda: optax.named_chain(
    ("clip", optax.clip_by_global_norm(1.0)), ("adam", optax.adam(0.1))
  ),
  "optax.scale_by_schedule": lambda: optax.scale_by_schedule(
    optax.linear_schedule(1.0, 0.1, 10)
  ),
  "optax.apply_every": lambda: optax.apply_every(2),
  "optax.add_noise": lambda: optax.add_noise(0.01, 0.55, key=0),
  "optax.noisy_sgd": lambda: optax.noisy_sgd(0.01, key=0),
}
# Not run here, with the reason.
EXCLUDED = {
  "optax.lookahead": "its gradients are for params.fast, not for the"
  " LookaheadParams it is given (covered by the framework tests)",
  "optax.snapshot": "changes its state's structure between init and"
  " update, as optax.monitor does (whose error test_skip.py tests)",
  "optax.measure_with_ema": "its updates are a measurement (a scalar), not"
  " a tree like the params: a part of optax.monitor only",
  "optax.contrib.scale_by_muon": "with default arguments the plain"
  " transformation fails on these params too",
  "optax.inject_stateful_hyperparams": "deprecated in optax",
  "optax.optimistic_adam": "deprecated in optax",
  "optax.contrib.dpsgd": "takes per-example gradients, with a batch axis"
  " the parameters do not have",
  "optax.contrib.differentially_private_aggregate": "as dpsgd",
  "optax.contrib.sam": "its update takes the adversarial step's own"
  " gradient function, outside this harness",
  "optax.with_extra_args_support": "a wrapper of a wrapper, covered by"
  " every other case",
  "optax.contrib.split_real_and_imaginary": "for complex parameters",
  "optax.flatten": "covered; needs no special case",
}
# Extra arguments that some updates need (`value`, `grad`, `value_fn`,
# `obj_fn`).
NEEDS_VALUE = (
  "optax.polyak_sgd",
  "optax.scale_by_polyak",
  "optax.contrib.reduce_on_plateau",
  "optax.contrib.momo",
  "optax.contrib.momo_adam",
  "optax.lbfgs",
  "optax.scale_by_backtracking_linesearch",
  "optax.scale_by_zoom_linesearch",
  "optax.contrib.sophia",
)


def _factories():
  found = {}
  for module in (optax, optax.contrib):
    for name in sorted(dir(module)):
      fn = getattr(module, name)
      if name.startswith("_") or inspect.isclass(fn) or not callable(fn):
        continue
      try:
        signature = inspect.signature(fn)
      except (TypeError, ValueError):
        continue
      if "GradientTransformation" not in str(signature.return_annotation):
        continue
      found[f"{module.__name__}.{name}"] = (fn, signature)
  return found


FACTORIES = _factories()


def build(qualname):
  if qualname in SPECIAL:
    return SPECIAL[qualname]()
  fn, signature = FACTORIES[qualname]
  kwargs = {
    p.name: ARGUMENTS[p.name]
    for p in signature.parameters.values()
    if p.default is inspect.Parameter.empty and p.kind is not p.VAR_POSITIONAL
  }
  if "args" in kwargs:
    return fn(*kwargs.pop("args"), **kwargs)
  return fn(**kwargs)


def loss(params):
  return jnp.sum((params["w"] @ params["b"] - 0.3) ** 2) + jnp.sum(
    params["b"] ** 2
  )


def extra_args(qualname, params):
  if qualname not in NEEDS_VALUE:
    return {}
  if qualname == "optax.contrib.sophia":
    return dict(obj_fn=loss)
  return dict(value=loss(params), grad=jax.grad(loss)(params), value_fn=loss)


# The slowest to evaluate op by op (line searches, matrix methods): 5 to 20
# CPU seconds each; the whole suite runs them.
SLOW = (
  "optax.lbfgs",
  "optax.scale_by_zoom_linesearch",
  "optax.contrib.sophia",
  "optax.contrib.muon",
  "optax.contrib.galore",
  "optax.contrib.scale_by_galore",
  "optax.contrib.mechanize",
  "optax.add_noise",
  "optax.adabelief",
  "optax.scale_by_lbfgs",
  "optax.noisy_sgd",
)


def _cases():
  # The fast subset takes every other transformation of optax's core
  # (alphabetically) among the quick ones; the whole suite takes them all.
  names = sorted(set(FACTORIES) - set(EXCLUDED))
  core = [q for q in names if not q.startswith("optax.contrib.")]
  fast = {q for q in core if q not in SLOW}
  fast = set(sorted(fast)[::2])
  return [
    q if q in fast else pytest.param(q, marks=pytest.mark.slow) for q in names
  ]


@pytest.mark.parametrize("qualname", _cases())
def test_wrapped_like_plain(qualname, monkeypatch):
  forbid_fallback(monkeypatch)
  inner = build(qualname)
  tx = ols.loss_scale_optimizer(build(qualname), initial_scale=SCALE)

  def run():
    """Three finite steps of each, and after each of ours a skipped one."""
    params, state = PARAMS, tx.init(PARAMS)
    plain_params, plain_state = PARAMS, inner.init(PARAMS)
    trace = []
    for step in range(3):
      updates, plain_state = inner.update(
        jax.grad(loss)(plain_params),
        plain_state,
        plain_params,
        **extra_args(qualname, plain_params),
      )
      plain_params = optax.apply_updates(plain_params, updates)
      scaled = jax.tree.map(lambda g: g * SCALE, jax.grad(loss)(params))
      updates, state = tx.update(
        scaled, state, params, **extra_args(qualname, params)
      )
      params = optax.apply_updates(params, updates)
      poisoned = dict(scaled, b=scaled["b"].at[step].set(jnp.nan))
      updates, skipped_state = tx.update(
        poisoned, state, params, **extra_args(qualname, params)
      )
      trace.append((plain_params, params, state, updates, skipped_state))
      state = ols.set_loss_scale(skipped_state, SCALE)  # undo the backoff
    return trace

  # Traced, so that the skip's rewrite runs; then evaluated op by op, whose
  # compilations every case shares (one `jit` per case took minutes).
  closed, shapes = jax.make_jaxpr(run, return_shape=True)()
  trace = jax.tree.unflatten(
    jax.tree.structure(shapes), jex_core.jaxpr_as_fun(closed)()
  )
  for plain_params, params, state, updates, skipped in trace:
    chex.assert_trees_all_close(params, plain_params, rtol=1e-5, atol=1e-6)
    # A non-finite step changes nothing but the loss-scale state.
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    assert_trees_equal(
      skipped.inner_state, state.inner_state, skip_extended=True
    )
    assert not bool(ols.skip_stats(skipped).last_finite)


def test_the_exclusions_are_real_names():
  assert set(EXCLUDED) <= set(FACTORIES)
  assert set(SPECIAL) <= set(FACTORIES)
  assert set(SLOW) <= set(FACTORIES) - set(EXCLUDED)
