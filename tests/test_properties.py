"""Property-based tests: random step sequences against the pure-Python model
of the rule in `_model.py`."""

import functools

import _model
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_equal, jit_step
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_lossscale as ols

# A handful of configurations, each compiled once and reused across examples.
CONFIGS = {
  "keras_small_window": dict(initial_scale=2.0**4, dynamic_growth_steps=3),
  "hysteresis": dict(
    initial_scale=2.0**6, dynamic_growth_steps=2, hysteresis=3
  ),
  "factors_and_bounds": dict(
    initial_scale=2.0**3,
    dynamic_growth_steps=2,
    growth_factor=4.0,
    backoff_factor=0.25,
    min_scale=0.5,
    max_scale=2.0**9,
  ),
  "odd_factors": dict(
    initial_scale=3.0,
    dynamic_growth_steps=1,
    growth_factor=1.5,
    backoff_factor=0.75,
    min_scale=0.3,
    max_scale=1e6,
  ),
  "near_inf": dict(initial_scale=2.0**125, dynamic_growth_steps=1),
  "static": dict(dynamic=False, initial_scale=2.0**5),
}
POISONS = (np.nan, np.inf, -np.inf)
# Parameters of every float dtype, float16 included, which `init` warns of.
pytestmark = pytest.mark.filterwarnings("ignore:float16 master weights")
PARAMS = {
  "dense": {
    "w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3),
    "b": jnp.zeros(3, jnp.float16),
  },
  "embed": jnp.ones(4, jnp.bfloat16),
  "none": None,
}


def model_config(kwargs) -> _model.ModelConfig:
  names = {"dynamic_growth_steps": "growth_steps"}
  config = _model.ModelConfig(**{names.get(k, k): v for k, v in kwargs.items()})
  if not config.dynamic:
    config.growth_steps = 1
  return config


@functools.cache
def compiled(name):
  # eps=1e-3: adam's default 1e-8 is zero in float16, and 0/0 from the
  # inner optimizer itself is not what these tests are about.
  tx = ols.loss_scale_optimizer(optax.adam(0.1, eps=1e-3), **CONFIGS[name])
  # Not donated: a skipped step's params and state are compared with these.
  return tx, jit_step(tx, donate=False)


def gradients(scale, poison_leaf, poison, rng):
  """Scaled gradients, finite unless `poison_leaf` is not None."""
  leaves, treedef = jax.tree.flatten(PARAMS)
  grads = []
  for i, p in enumerate(leaves):
    g = rng.uniform(-1, 1, p.shape).astype(np.float32) * np.float32(
      min(scale, 1e4)
    )
    if i == poison_leaf:
      g.flat[rng.integers(g.size)] = poison
    grads.append(jnp.asarray(g, p.dtype))
  return jax.tree.unflatten(treedef, grads)


step_strategy = st.one_of(
  st.just(None),  # a finite step
  st.tuples(st.integers(0, 2), st.sampled_from(POISONS)),
)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True)
@given(
  name=st.sampled_from(sorted(CONFIGS)),
  steps=st.lists(step_strategy, min_size=1, max_size=24),
  seed=st.integers(0, 2**16),
)
def test_random_sequences_follow_the_rule(name, steps, seed):
  tx, step = compiled(name)
  config = model_config(CONFIGS[name])
  rng = np.random.default_rng(seed)
  params, state = PARAMS, tx.init(PARAMS)
  expected = _model.initial(config)
  for poison in steps:
    leaf, value = (None, None) if poison is None else poison
    grads = gradients(expected.scale, leaf, value, rng)
    new_params, new_state = step(params, state, grads)
    expected = _model.step(expected, poison is None, config)

    got = new_state.loss_scale_state
    assert float(got.loss_scale) == expected.scale
    if config.dynamic:
      assert int(got.counter) == expected.counter
    else:
      assert got.counter is None
    stats = ols.skip_stats(new_state)
    assert int(stats.total_skipped) == expected.total
    assert int(stats.skipped_in_a_row) == expected.in_a_row
    assert bool(stats.last_finite) == expected.last_finite
    assert config.min_scale <= expected.scale <= config.max_scale

    if poison is not None:
      assert_trees_equal(new_params, params)
      assert_trees_equal(new_state.inner_state, state.inner_state)
    for leaf in jax.tree.leaves((new_params, new_state.inner_state)):
      assert np.isfinite(np.asarray(leaf, np.float32)).all()
    params, state = new_params, new_state


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
  st.lists(st.booleans(), max_size=60),
  st.sampled_from([1, 2, 3, 7]),
  st.sampled_from([1, 2, 4]),
)
def test_model_invariants(finite_flags, growth_steps, hysteresis):
  """The rule itself: bounds hold and the scale is a power of two."""
  config = _model.ModelConfig(
    initial_scale=2.0**15, growth_steps=growth_steps, hysteresis=hysteresis
  )
  state = _model.initial(config)
  for finite in finite_flags:
    state = _model.step(state, finite, config)
    assert config.min_scale <= state.scale <= config.max_scale
    assert np.log2(state.scale).is_integer()
    assert 0 <= state.counter < growth_steps
