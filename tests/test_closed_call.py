"""A `closed_call` is entered by the skip's rewrite and by the finder.

From jax 0.12 on, `closed_call_p` is an alias of `eval_jaxpr_p`, named
"eval_jaxpr": a match by name no longer entered it, silently. The package
matches it by object (`compat.CALLS`). CI runs this on the oldest and the
newest jax.
"""

import _hlo
import chex
import jax
import jax.numpy as jnp
import optax
from _helpers import (
  GRADS,
  PARAMS,
  assert_trees_equal,
  closed_call,
  forbid_fallback,
)

import optax_lossscale as ols
from optax_lossscale._jaxpr import compat as _compat


def in_closed_call(inner):
  """`inner`, whose whole update runs inside one `closed_call`."""
  return optax.GradientTransformation(
    inner.init,
    lambda grads, state, params=None: closed_call(
      inner.update, grads, state, params
    ),
  )


def _primitives(jaxpr):
  """Every equation's primitive in `jaxpr`, nested bodies included."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive
    for value in eqn.params.values():
      for body in value if isinstance(value, tuple | list) else [value]:
        if isinstance(body, _compat.ClosedJaxpr):
          yield from _primitives(body.jaxpr)
        elif isinstance(body, _compat.Jaxpr):
          yield from _primitives(body)


def test_the_skip_enters_a_closed_call(monkeypatch):
  forbid_fallback(monkeypatch)
  inner = in_closed_call(optax.adam(1e-2))
  state = inner.init(PARAMS)
  assert _compat.closed_call_p in set(
    _primitives(jax.make_jaxpr(inner.update)(GRADS, state, PARAMS).jaxpr)
  )
  tx = ols.loss_scale_optimizer(inner)
  # The rewrite evaluates the call's body in its place, selecting the new
  # state where the body makes it: no call is left.
  step = jax.make_jaxpr(tx.update)(GRADS, tx.init(PARAMS), PARAMS)
  assert _compat.closed_call_p not in set(_primitives(step.jaxpr))


def test_the_skip_inside_a_closed_call_is_exact():
  plain = ols.loss_scale_optimizer(optax.adam(1e-2))
  called = ols.loss_scale_optimizer(in_closed_call(optax.adam(1e-2)))
  nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), GRADS)
  state_p, state_c = plain.init(PARAMS), called.init(PARAMS)
  update_p, update_c = jax.jit(plain.update), jax.jit(called.update)
  for grads in (GRADS, nan, GRADS, nan):
    updates_p, new_p = update_p(grads, state_p, PARAMS)
    updates_c, new_c = update_c(grads, state_c, PARAMS)
    if grads is nan:  # the old inner state, bit for bit, and zero updates
      assert_trees_equal(new_c.inner_state, state_c.inner_state)
      assert_trees_equal(updates_c, jax.tree.map(jnp.zeros_like, updates_c))
    # The same computation, compiled in another program: equal to float32
    # rounding (XLA may fuse the two differently).
    chex.assert_trees_all_close(
      (updates_c, new_c), (updates_p, new_p), rtol=1e-6, atol=1e-7
    )
    state_p, state_c = new_p, new_c
  assert int(ols.skip_stats(state_c).total_skipped) == 2


def test_the_skip_inside_a_closed_call_copies_no_state():
  size, n_leaves = 4096, 4
  params = [jnp.full((size,), 0.01) for _ in range(n_leaves)]
  grads = [jnp.full((size,), 0.5) for _ in range(n_leaves)]
  tx = ols.loss_scale_optimizer(in_closed_call(optax.adam(1e-3)))

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, tx.init(params), grads)
    .compile()
  )
  copies = [
    i
    for i in _hlo.hlo_instructions(compiled)
    if i.opcode in ("copy", "copy-start") and size in i.sizes
  ]
  assert not copies


def test_the_finder_enters_a_closed_call():
  def loss(w, x):
    h = x.astype(jnp.float16) * w.astype(jnp.float16)  # 2**10
    h = closed_call(lambda h: h * h, h)  # 2**20 in float16: inf
    return jnp.sum(h.astype(jnp.float32))

  w, x = jnp.full((4,), 2.0**4), jnp.full((4,), 2.0**6)
  first = ols.find_overflow(loss, w, x).first
  # Found inside the call, not at the call as a boundary.
  assert (first.primitive, first.boundary, first.pass_name) == (
    "mul",
    None,
    "forward",
  )
