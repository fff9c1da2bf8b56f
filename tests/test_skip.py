"""The skip under `jit`: exact for any optax optimizer, and free of copies.

`_skip.update_unless` selects each new inner-state value where the inner
update makes it (see its module docstring). These tests hold it to the plain
select's results and check, in the compiled HLO, that the optimizer state is
updated in place rather than copied.
"""

import re

import _hlo
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import GRADS, INNERS, PARAMS, assert_trees_equal, jit_step
from jax import export

import optax_lossscale as ols
from optax_lossscale._core import skip as _skip


def run_both(inner, grads_seq):
  """Runs the rewritten skip and the plain select side by side under jit."""

  def make_step(rewrite):
    @jax.jit
    def step(state, grads):
      finite = ols.all_finite(grads)
      safe = _skip.zero_unless(finite, grads)
      return _skip.update_unless(
        finite, lambda s: inner.update(safe, s, PARAMS), state, rewrite=rewrite
      )

    return step

  rewritten, plain = make_step(True), make_step(False)
  state_r = state_p = inner.init(PARAMS)
  for grads in grads_seq:
    updates_r, new_r = rewritten(state_r, grads)
    updates_p, new_p = plain(state_p, grads)
    yield grads, (updates_r, state_r, new_r), (updates_p, new_p)
    state_r, state_p = new_r, new_p


@pytest.mark.parametrize("name", sorted(INNERS))
def test_rewritten_skip_matches_the_plain_select(name):
  nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), GRADS)
  sequence = [GRADS, nan, GRADS, GRADS, nan, nan, GRADS]
  for grads, (u_r, old_r, new_r), (u_p, new_p) in run_both(
    INNERS[name](), sequence
  ):
    chex.assert_trees_all_equal_shapes_and_dtypes(new_r, new_p)
    if grads is nan:
      assert_trees_equal(new_r, old_r)  # the old state, bit for bit
      chex.assert_trees_all_equal(u_r, jax.tree.map(jnp.zeros_like, u_r))
    # On finite steps XLA may fuse the two programs differently (an FMA
    # here or there), so the values agree to float32 rounding.
    chex.assert_trees_all_close(new_r, new_p, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(u_r, u_p, rtol=1e-6, atol=1e-7)


def test_eager_calls_take_the_plain_select():
  inner = optax.adam(1e-2)
  state = inner.init(PARAMS)
  finite = jnp.asarray(True)
  updates, new_state = _skip.update_unless(
    finite, lambda s: inner.update(GRADS, s, PARAMS), state
  )
  plain_updates, plain_state = inner.update(GRADS, state, PARAMS)
  chex.assert_trees_all_equal(updates, plain_updates)
  chex.assert_trees_all_equal(new_state, plain_state)


def compiled_costs(tx, grad_dtype=jnp.float32, n_leaves=8, size=4096):
  """(state-sized copies, temporary bytes) of the compiled step."""
  params = [jnp.full((size,), 0.01) for _ in range(n_leaves)]
  grads = [jnp.full((size,), 0.5, grad_dtype) for _ in range(n_leaves)]

  compiled = jit_step(tx).lower(params, tx.init(params), grads).compile()
  instructions = _hlo.hlo_instructions(compiled)
  # The module was read: its parameters include the state-sized buffers.
  assert any(i.opcode == "parameter" and size in i.sizes for i in instructions)
  state_sized_copies = [
    i
    for i in instructions
    if i.opcode in ("copy", "copy-start") and size in i.sizes
  ]
  temp = compiled.memory_analysis().temp_size_in_bytes
  return len(state_sized_copies), temp


# Older jax warns that the plain reference step (float16 gradients, float32
# state) cannot use some donated buffers; ours uses them all.
@pytest.mark.cpu_check_form  # the CPU compiled program, as CPU users run it
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize(
  "inner",
  [optax.adam(1e-3), optax.sgd(1e-3, momentum=0.9)],
  ids=["adam", "sgd_momentum"],
)
def test_no_copy_of_the_optimizer_state_and_no_temporary(inner, grad_dtype):
  # The usual `where` skip copies every donated state buffer first (the
  # reason it runs at 4-6x a plain step on CPU); ours copies none, and
  # materializes nothing gradient-sized (a divisor made once and shared by
  # every leaf once made XLA materialize each unscaled gradient).
  _, plain_temp = compiled_costs(optax.chain(inner), grad_dtype)
  copies, temp = compiled_costs(ols.loss_scale_optimizer(inner), grad_dtype)
  assert copies == 0
  assert temp <= plain_temp + 4096  # not one leaf's 16 KB


def _flush_subnormals(x):
  tiny = np.finfo(np.float32).tiny
  return np.where(np.abs(x) < tiny, np.copysign(0.0, x), x).astype(np.float32)


def _backend_flushes_subnormals() -> bool:
  # XLA on CPU flushes float32 subnormals to zero; on GPU it keeps them.
  halve = jax.jit(lambda x: x * 0.5)
  return float(halve(jnp.float32(np.finfo(np.float32).tiny))) == 0.0


def test_unscale_is_the_correctly_rounded_quotient():
  """Exact for powers of two up to the largest float32 one, where XLA's own
  division on CPU flushes (1e30 / 2**127 would be 0); within one ulp for
  other scales (XLA divides through a reciprocal on CPU). Where the backend
  flushes subnormal inputs and results to zero (XLA on CPU), the reference
  does too; where it keeps them (XLA on GPU), so does the reference."""
  from optax_lossscale._core import step as _unscale

  flush = (
    _flush_subnormals
    if _backend_flushes_subnormals()
    else lambda x: np.asarray(x, np.float32)
  )
  rng = np.random.default_rng(0)
  values = np.concatenate(
    [
      rng.standard_normal(1000) * 10.0 ** rng.integers(-40, 38, 1000),
      [0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.17e-38, 1e30, 3.0],
    ]
  ).astype(np.float32)
  unscale = jax.jit(_unscale.unscale)
  for exponent in (-10, 0, 1, 15, 24, 100, 126, 127, 1.5, 20.3, 126.7):
    scale = np.float32(2.0**exponent)
    with np.errstate(over="ignore"):  # 3.4e38 / 2**-10 is inf, as it should
      expected = flush(flush(values).astype(np.float64) / np.float64(scale))
    got = np.asarray(unscale(jnp.asarray(values), jnp.float32(scale)))
    ulps = np.abs(
      got.view(np.int32).astype(np.int64)
      - expected.view(np.int32).astype(np.int64)
    )
    allowed = 0 if float(exponent).is_integer() else 1
    assert ulps.max() <= allowed, (exponent, ulps.max())


def test_the_unscale_factors_are_made_once_not_per_consumer():
  """Each unscaled gradient is read by two fusions (adam's two moments);
  XLA copies a cheap scalar computation into every fusion that reads it,
  and compiles each copy, so the factors are quotients, which it makes
  once: the compiled step's selects grow only by the skip's own per leaf,
  and its compares not at all."""
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))

  def compare_and_select(leaves):
    params = [jnp.ones((64, 64), jnp.float32) for _ in range(leaves)]
    grads = [jnp.ones((64, 64), jnp.float16) for _ in range(leaves)]
    compiled = jit_step(tx).lower(params, tx.init(params), grads).compile()
    opcodes = _hlo.hlo_opcodes(compiled)
    return opcodes["compare"], opcodes["select"]

  (compares_4, selects_4), (compares_12, selects_12) = map(
    compare_and_select, (4, 12)
  )
  # Per leaf: the skip's selects of adam's two moments and of the update,
  # where each is made, and the zeroed gradient in each of its two
  # readers. Nothing of the scale (a `where` for the quarter had added a
  # compare and a select per reader), and the check compares once per group
  # of leaves, not per leaf.
  assert selects_12 - selects_4 <= 8 * 5
  assert compares_12 == compares_4


def test_typed_prng_keys_in_the_inner_state():
  """optax.noisy_sgd keeps a typed key in its state; eager and jitted
  updates both keep it (no `astype` on an extended dtype)."""
  tx = ols.loss_scale_optimizer(optax.noisy_sgd(0.1, key=jax.random.key(0)))
  params = jnp.ones(3)
  state = tx.init(params)
  for update in (tx.update, jax.jit(tx.update)):
    _, new_state = update(jnp.array([1.0, jnp.nan, 1.0]), state, params)
    assert (
      jax.random.key_data(new_state.inner_state[0].rng_key).tolist()
      == jax.random.key_data(state.inner_state[0].rng_key).tolist()
    )
    _, new_state = update(jnp.ones(3), state, params)
    assert (
      new_state.inner_state[0].rng_key.dtype
      == state.inner_state[0].rng_key.dtype
    )


@pytest.mark.parametrize(
  "make_tx",
  [
    lambda: optax.adam(1e-3),
    lambda: ols.loss_scale_optimizer(optax.adam(1e-3)),
    lambda: ols.loss_scale_optimizer(optax.sgd(1e-3, momentum=0.9)),
    lambda: ols.loss_scale_optimizer(
      optax.sgd(1e-3), dynamic=False, initial_scale=8.0
    ),
  ],
  ids=["plain_adam", "adam", "sgd_momentum", "static_sgd"],
)
def test_every_output_is_written_into_a_donated_buffer(make_tx):
  # An output with no donated input to reuse gets a fresh buffer every
  # step; on GPU a fresh address makes XLA update its command buffer on
  # every call (twice the plain step's wall-clock at 10M params in 50
  # leaves on an H100). Every state leaf must therefore be read by the step.
  tx = make_tx()
  params = [jnp.full((256,), 0.01) for _ in range(3)]
  grads = [jnp.full((256,), 0.5) for _ in range(3)]

  step = jit_step(tx)
  state = tx.init(params)
  params, state = step(params, state, grads)  # outputs of a jitted step
  donated = {
    x.unsafe_buffer_pointer() for x in jax.tree.leaves((params, state))
  }
  outputs = jax.tree.leaves(step(params, state, grads))
  fresh = [x.shape for x in outputs if x.unsafe_buffer_pointer() not in donated]
  assert fresh == []


@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
def test_accelerators_read_the_old_last_finite_flag(platform):
  # On an accelerator the flag is computed from its old value, so that the
  # donated buffer is an input of the program there too (on CPU the read is
  # left out: it slowed the step, and the buffer is reused without it).
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  params = [jnp.ones(256), jnp.ones(256)]

  args = (params, tx.init(params), params)
  paths = [
    jax.tree_util.keystr(path)
    for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]
  ]
  (flag,) = [i for i, p in enumerate(paths) if p.endswith("last_finite")]
  step = jit_step(tx)
  reads = {}
  for target in (platform, "cpu"):
    module = export.export(step, platforms=[target])(*args).mlir_module()
    body = module[module.index("func.func public @main") :]
    body = body[body.index("{\n") :]  # after the signature
    reads[target] = len(re.findall(rf"%arg{flag}\b", body))
  assert reads[platform] >= 1
  assert reads["cpu"] == 0


def test_a_weakly_typed_inner_state_leaf_stays_weak():
  # A state leaf made from a Python scalar is weakly typed; plain optax
  # keeps it so, and the step must trace once, not once per weak type.
  def init(params):
    del params
    return {"decay": jnp.asarray(0.5)}  # weakly typed

  def update(updates, state, params=None):
    del params
    return updates, {"decay": state["decay"] * 1.0}

  inner = optax.GradientTransformation(init, update)
  tx = ols.loss_scale_optimizer(inner)
  state = tx.init(jnp.ones(2))
  assert jax.typeof(state.inner_state["decay"]).weak_type
  traces = []

  @jax.jit
  def step(state, grads):
    traces.append(None)
    return tx.update(grads, state)[1]

  for grads in (jnp.ones(2), jnp.array([1.0, jnp.nan]), jnp.ones(2)):
    state = step(state, grads)
    assert jax.typeof(state.inner_state["decay"]).weak_type
  assert len(traces) == 1


def test_a_state_that_changes_structure_is_named():
  measure = optax.monitor({"norm": optax.tree.norm})
  tx = ols.loss_scale_optimizer(optax.chain(measure, optax.sgd(0.1)))
  params = jnp.ones(3)
  state = tx.init(params)
  for update in (tx.update, jax.jit(tx.update)):
    with pytest.raises(ValueError, match=r"structure.*optax.monitor"):
      update(params, state, params)
