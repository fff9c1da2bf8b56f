"""The optax contract every transformation must keep, and the public API."""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import train_step

import optax_lossscale as ols

# The contract holds for every float dtype of parameters, float16 ones
# included, which `init` warns of (tests/test_hostile.py checks the warning).
pytestmark = pytest.mark.filterwarnings("ignore:float16 master weights")

PARAMS = {
  "w": jnp.ones((3, 2)),
  "h": jnp.ones(4, jnp.float16),
  "b": jnp.ones(2, jnp.bfloat16),
}


def test_all_matches_the_exports():
  public = {n for n in dir(ols) if not n.startswith("_")}
  assert set(ols.__all__) == public
  # "About a dozen": the transformations, the loss helpers, the read-outs
  # and setter, the diagnostics (report, per-leaf counts, finder) and the
  # Keras pair; beside them, the types they return and store.
  functions = [n for n in ols.__all__ if not inspect.isclass(getattr(ols, n))]
  assert len(functions) <= 20


@pytest.mark.parametrize("name", ols.__all__)
def test_every_public_name_has_a_runnable_example(name):
  doc = inspect.getdoc(getattr(ols, name))
  assert doc and doc.splitlines()[0].strip(), name
  if inspect.isfunction(getattr(ols, name)):
    assert "Examples:" in doc and ">>>" in doc, name


def test_returns_an_extra_args_transformation():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  assert isinstance(
    ols.unscale_and_check(), optax.GradientTransformationExtraArgs
  )


def test_state_dtypes_are_fixed():
  state = ols.loss_scale_optimizer(optax.sgd(0.1)).init(PARAMS)
  s = state.loss_scale_state
  assert s.loss_scale.dtype == jnp.float32 and s.loss_scale.shape == ()
  for counter in (s.counter, s.skipped_in_a_row, s.total_skipped):
    assert counter.dtype == jnp.int32 and counter.shape == ()
  assert s.last_finite.dtype == jnp.bool_


def test_jitted_step_does_not_retrace():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))

  step = jax.jit(chex.assert_max_traces(train_step(tx), n=1))

  params, state = PARAMS, tx.init(PARAMS)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 3.0), PARAMS)
  for i in range(4):  # finite, then skipped, then finite: one trace
    g = grads if i != 2 else jax.tree.map(lambda x: x * jnp.inf, grads)
    params, state = step(params, state, g)
  assert int(ols.skip_stats(state).total_skipped) == 1


def test_unknown_extra_args_are_ignored():
  """Accepted by both transformations and without effect: the step equals
  the step without them, bit for bit, on a finite and a skipped step."""
  inf_grads = jax.tree.map(lambda p: p.at[0].set(jnp.inf), PARAMS)
  for tx in (
    ols.loss_scale_optimizer(optax.adam(1e-3)),
    optax.chain(ols.unscale_and_check(), optax.adam(1e-3)),
  ):
    state = tx.init(PARAMS)
    for grads in (PARAMS, inf_grads):
      with_extra = tx.update(grads, state, PARAMS, some_unknown_arg=1.0)
      without = tx.update(grads, state, PARAMS)
      chex.assert_trees_all_equal(with_extra, without, strict=True)
      jitted = jax.jit(tx.update)(grads, state, PARAMS, some_unknown_arg=1.0)
      chex.assert_trees_all_equal(jitted, without, strict=True)


F32_PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}


def test_extra_args_reach_the_inner_transformation():
  tx = ols.loss_scale_optimizer(
    optax.contrib.reduce_on_plateau(), initial_scale=2.0
  )
  state = tx.init(F32_PARAMS)
  _, state = tx.update(F32_PARAMS, state, F32_PARAMS, value=jnp.float32(1.0))
  assert float(state.inner_state.best_value) == 1.0


def test_init_accepts_shape_dtype_structs():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  shapes = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), PARAMS
  )
  abstract = jax.eval_shape(tx.init, shapes)
  concrete = tx.init(PARAMS)
  chex.assert_trees_all_equal_shapes_and_dtypes(abstract, concrete)


def test_state_is_stable_under_lax_cond():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  state = tx.init(PARAMS)

  def f(pred, state):
    return jax.lax.cond(
      pred, lambda s: tx.update(PARAMS, s, PARAMS)[1], lambda s: s, state
    )

  out = jax.jit(f)(True, state)
  chex.assert_trees_all_equal_shapes_and_dtypes(out, state)


def test_updates_keep_their_dtype():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  updates, _ = tx.update(PARAMS, tx.init(PARAMS), PARAMS)
  chex.assert_trees_all_equal_dtypes(updates, PARAMS)


def _update_sum(updates):
  return float(
    sum(jnp.sum(u.astype(jnp.float32)) for u in jax.tree.leaves(updates))
  )


def test_inside_inject_hyperparams_and_multisteps():
  """Wrapped around either, the loss scaling works as around any optimizer:
  the scale is found and moves, a non-finite step is skipped with the inner
  state kept bit for bit, and the wrapped optimizer still does its job."""
  size = sum(p.size for p in jax.tree.leaves(F32_PARAMS))
  ones = jax.tree.map(jnp.ones_like, F32_PARAMS)
  infs = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), F32_PARAMS)

  # inject_hyperparams (which cannot mix float16 and bfloat16 params).
  tx = ols.loss_scale_optimizer(
    optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), initial_scale=4.0
  )
  update = jax.jit(tx.update)
  state = tx.init(F32_PARAMS)
  assert float(ols.loss_scale(state)) == 4.0
  scaled = jax.tree.map(lambda g: 4.0 * g, ones)
  updates, state = update(scaled, state, F32_PARAMS)
  assert _update_sum(updates) == -0.5 * size  # unscaled, then sgd at 0.5
  assert int(state.inner_state.count) == 1
  skipped_updates, skipped = update(infs, state, F32_PARAMS)
  assert _update_sum(skipped_updates) == 0.0
  chex.assert_trees_all_equal(skipped.inner_state, state.inner_state)
  assert float(ols.loss_scale(skipped)) == 2.0  # halved exactly
  assert int(ols.skip_stats(skipped).total_skipped) == 1
  # The learning rate is still set through the wrapped state, and used.
  state = optax.tree.set(skipped, learning_rate=jnp.float32(0.125))
  scaled = jax.tree.map(lambda g: 2.0 * g, ones)
  updates, state = update(scaled, state, F32_PARAMS)
  assert _update_sum(updates) == -0.125 * size
  assert int(state.inner_state.count) == 2  # the skip did not count

  # MultiSteps: k = 2 micro-batches accumulated, one update emitted.
  tx = ols.loss_scale_optimizer(
    optax.MultiSteps(optax.sgd(1.0), 2), initial_scale=8.0
  )
  update = jax.jit(tx.update)
  state = tx.init(PARAMS)

  def micro(value, scale):
    return jax.tree.map(lambda p: jnp.full_like(p, value * scale), PARAMS)

  updates, state = update(micro(1.0, 8.0), state, PARAMS)
  assert _update_sum(updates) == 0.0 and int(state.inner_state.mini_step) == 1
  # A non-finite micro-batch is skipped: nothing accumulated, scale halved.
  nan = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), PARAMS)
  updates, skipped = update(nan, state, PARAMS)
  assert _update_sum(updates) == 0.0
  chex.assert_trees_all_equal(skipped.inner_state, state.inner_state)
  assert float(ols.loss_scale(skipped)) == 4.0
  # The second finite micro-batch emits the mean of the two, once.
  updates, state = update(micro(3.0, 4.0), skipped, PARAMS)
  expected = jax.tree.map(lambda p: jnp.full_like(p, -2.0), PARAMS)
  chex.assert_trees_all_equal(updates, expected, strict=True)
  assert int(state.inner_state.gradient_step) == 1
  assert int(state.inner_state.mini_step) == 0


def test_empty_subtrees_masked_nodes_and_none():
  params = {"a": jnp.ones(2), "empty": {}, "none": None}
  tx = ols.loss_scale_optimizer(
    optax.masked(optax.adam(1e-3), {"a": True, "empty": {}, "none": None})
  )
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(params, state, params)
  assert updates["none"] is None and updates["empty"] == {}


def test_inner_state_with_ints_and_bools():
  # apply_if_finite's state holds int32 counters and a bool.
  tx = ols.loss_scale_optimizer(optax.apply_if_finite(optax.sgd(0.1), 3))
  state = tx.init(PARAMS)
  _, new = jax.jit(tx.update)(PARAMS, state, PARAMS)
  chex.assert_trees_all_equal_shapes_and_dtypes(new, state)


def test_double_wrapping_is_refused():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1))
  with pytest.raises(ValueError, match="already loss-scaled"):
    ols.loss_scale_optimizer(tx)
  nested = ols.loss_scale_optimizer(
    optax.chain(ols.unscale_and_check(), optax.sgd(0.1))
  )
  with pytest.raises(ValueError, match="must not wrap another"):
    nested.init(PARAMS)


def test_keras_own_errors():
  with pytest.raises(TypeError, match="`dynamic` must be a bool"):
    ols.loss_scale_optimizer(optax.sgd(0.1), dynamic="yes")
  with pytest.raises(ValueError, match="`initial_scale` must be given"):
    ols.loss_scale_optimizer(optax.sgd(0.1), dynamic=False)
  with pytest.raises(ValueError, match="`dynamic_growth_steps` must be None"):
    ols.loss_scale_optimizer(
      optax.sgd(0.1), dynamic=False, initial_scale=2, dynamic_growth_steps=10
    )
  with pytest.raises(TypeError, match="`inner` must be an optax"):
    ols.loss_scale_optimizer("adam")


def test_scale_loss_errors():
  with pytest.raises(ValueError, match="No loss-scale state"):
    ols.scale_loss(1.0, optax.adam(1e-3).init(PARAMS))
  tx = ols.loss_scale_optimizer(optax.sgd(0.1))
  two = (tx.init(PARAMS), tx.init(PARAMS))
  with pytest.raises(ValueError, match="Found 2 loss-scale states"):
    ols.scale_loss(1.0, two)


def test_set_loss_scale():
  state = ols.loss_scale_optimizer(optax.adam(1e-3)).init(PARAMS)
  new = ols.set_loss_scale(state, 8)
  assert ols.loss_scale(new) == 8.0 and ols.loss_scale(new).dtype == jnp.float32
  chex.assert_trees_all_equal(new.inner_state, state.inner_state)
  for bad in (0.0, -1.0, np.inf, np.nan, 1e39):
    with pytest.raises(ValueError, match="`value` must be"):
      ols.set_loss_scale(state, bad)
  traced = jax.jit(ols.set_loss_scale)(state, 16.0)
  assert ols.loss_scale(traced) == 16.0


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
  root = __import__("pathlib").Path(__file__).resolve().parents[1]
  readme = (root / "README.md").read_text()
  first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
  commands = first_block.strip().splitlines()
  assert len(commands) == 2
  assert "notebooks/fp16_study.py" in commands[0]
  assert commands[1] in (root / ".ci" / "run").read_text().splitlines()


def test_the_two_constructors_share_one_signature_and_one_args_text():
  """`unscale_and_check` and `loss_scale_optimizer` take the same eleven
  configuration parameters (names, kinds, defaults, annotations), and
  their docstrings document them with one text."""
  shared = inspect.signature(ols.unscale_and_check, eval_str=True).parameters
  wrapped = inspect.signature(
    ols.loss_scale_optimizer, eval_str=True
  ).parameters
  assert list(wrapped) == ["inner", *shared]
  for name, parameter in shared.items():
    other = wrapped[name]
    assert (parameter.kind, parameter.default) == (other.kind, other.default)
    assert parameter.annotation == other.annotation, name
  assert list(shared) == [
    "dynamic",
    "initial_scale",
    "dynamic_growth_steps",
    "growth_factor",
    "backoff_factor",
    "min_scale",
    "max_scale",
    "hysteresis",
    "axis_name",
    "leaf_stats",
    "backoff_on_nonfinite_loss",
  ]

  def args_text(fn):
    doc = inspect.getdoc(fn)
    section = doc.split("Args:\n", 1)[1].split("\n\n", 1)[0]
    start = section.index("  dynamic:")
    return section[start:]

  assert args_text(ols.unscale_and_check) == args_text(ols.loss_scale_optimizer)
  for name in shared:
    assert f"  {name}: " in args_text(ols.unscale_and_check), name
  assert "{shared_args}" not in inspect.getdoc(ols.unscale_and_check)
