"""Flax NNX, Flax Linen and Equinox as their users write them, and the
gradient helper with each framework's own differentiation."""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_trees_equal
from flax import nnx
from flax.training import train_state

import optax_lossscale as ols

X = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(8, 4)
Y = jnp.arange(8, dtype=jnp.float32).reshape(8, 1) / 8


# --- Flax NNX ---


class _NNXModel(nnx.Module):
  """Dropout and BatchNorm: the two that need NNX's own transformations."""

  def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32):
    self.dense = nnx.Linear(4, 16, dtype=dtype, rngs=rngs)
    self.norm = nnx.BatchNorm(16, dtype=jnp.float32, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.out = nnx.Linear(16, 1, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.norm(self.dense(x)))
    return self.out(self.dropout(h))


# `nnx.as_pure` in newer flax, `nnx.pure` in flax 0.12.0.
_as_pure = getattr(nnx, "as_pure", None) or nnx.pure


def _nnx_loss(model, x, y):
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def _nnx_setup(dtype=jnp.float32, **kwargs):
  model = _NNXModel(nnx.Rngs(0, dropout=1), dtype=dtype)
  tx = ols.loss_scale_optimizer(optax.adam(1e-2), **kwargs)
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def _nnx_step(model, optimizer, x, y):
  loss, grads = ols.value_and_grad(_nnx_loss, grad_fn=nnx.value_and_grad)(
    optimizer, model, x, y
  )
  optimizer.update(model, grads)
  return loss


def test_nnx_optimizer_trains_under_nnx_jit_in_float16():
  model, optimizer = _nnx_setup(jnp.float16, dynamic_growth_steps=5)
  losses = [float(_nnx_step(model, optimizer, X, Y)) for _ in range(30)]
  assert np.mean(losses[-10:]) < np.mean(losses[:5]) / 2  # dropout: noisy
  assert model.out.kernel[...].dtype == jnp.float32  # float32 master weights
  # float16 gradients overflow at 2**15 and more: skipped, backed off, grown.
  stats = ols.skip_stats(optimizer)
  assert int(stats.total_skipped) >= 1 and bool(stats.last_finite)
  scale = float(ols.loss_scale(optimizer))
  assert scale == 2.0 ** round(np.log2(scale))


def test_nnx_readouts_accept_every_form_and_return_arrays():
  model, optimizer = _nnx_setup(initial_scale=256.0)
  _nnx_step(model, optimizer, X, Y)
  graphdef, state = nnx.split(optimizer)
  forms = [
    optimizer,
    optimizer.opt_state,
    nnx.state(optimizer),
    state,
    _as_pure(state),
  ]
  for form in forms:
    scale = ols.loss_scale(form)
    assert type(scale) is type(jnp.zeros(())) and scale == 256.0
    assert f"{scale:.0f}" == "256"
    counter = ols.dynamic_counter(form)
    assert isinstance(counter, jax.Array) and int(counter) == 1
    stats = ols.skip_stats(form)
    assert all(isinstance(x, jax.Array) for x in stats)
    assert bool(stats.last_finite) and int(stats.total_skipped) == 0
    assert ols.scale_loss(jnp.float32(0.5), form) == 128.0
  del graphdef


def test_nnx_static_state_has_no_counter():
  _, optimizer = _nnx_setup(dynamic=False, initial_scale=8.0)
  assert ols.dynamic_counter(nnx.state(optimizer)) is None
  assert ols.dynamic_counter(optimizer) is None


@pytest.mark.slow
@pytest.mark.parametrize("form", ["optimizer", "opt_state", "assign"])
def test_nnx_set_loss_scale_reaches_the_next_update(form):
  model, optimizer = _nnx_setup(initial_scale=256.0)
  if form == "optimizer":
    assert ols.set_loss_scale(optimizer, 1024.0) is optimizer
  elif form == "opt_state":
    ols.set_loss_scale(optimizer.opt_state, 1024.0)
  else:  # the form issue 12 reported broken
    optimizer.opt_state = ols.set_loss_scale(optimizer.opt_state, 1024.0)
  assert ols.loss_scale(optimizer) == 1024.0
  scale_seen = []

  def loss_fn(model, x, y):
    return _nnx_loss(model, x, y)

  @nnx.jit
  def step(model, optimizer):
    scale_seen.append(None)  # traced once
    _, grads = ols.value_and_grad(loss_fn, grad_fn=nnx.value_and_grad)(
      optimizer, model, X, Y
    )
    optimizer.update(model, grads)
    return ols.scale_loss(jnp.float32(1.0), optimizer)

  assert step(model, optimizer) == 1024.0  # the scale the update used
  assert bool(ols.skip_stats(optimizer).last_finite)
  assert int(ols.dynamic_counter(optimizer)) == 1


def test_nnx_scale_loss_on_the_optimizer_inside_nnx_grad():
  """The hand-written pattern: scale_loss reads the optimizer's Variables
  from inside NNX's own transformation."""
  model, optimizer = _nnx_setup(initial_scale=8.0)

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      return ols.scale_loss(_nnx_loss(model, X, Y), optimizer)

    optimizer.update(model, nnx.grad(loss_fn)(model))

  step(model, optimizer)
  assert bool(ols.skip_stats(optimizer).last_finite)
  assert int(ols.dynamic_counter(optimizer)) == 1


def test_nnx_split_state_is_set_functionally_for_pure_state():
  model, optimizer = _nnx_setup(initial_scale=256.0)
  graphdef, state = nnx.split(optimizer)
  pure = _as_pure(state)
  new = ols.set_loss_scale(pure, 64.0)
  assert ols.loss_scale(new) == 64.0 and ols.loss_scale(pure) == 256.0
  merged = nnx.merge(graphdef, ols.set_loss_scale(state, 32.0))
  assert ols.loss_scale(merged) == 32.0
  del model


def test_nnx_overflow_is_skipped_and_backs_off():
  model, optimizer = _nnx_setup(initial_scale=256.0)
  before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  grads = jax.tree.map(
    lambda p: jnp.full_like(p, jnp.inf), nnx.state(model, nnx.Param)
  )
  optimizer.update(model, grads)
  assert_trees_equal(nnx.state(model, nnx.Param), before, bitwise=False)
  assert ols.loss_scale(optimizer) == 128.0
  assert not bool(ols.skip_stats(optimizer).last_finite)


def test_errors_name_nnx_among_the_accepted():
  with pytest.raises(ValueError, match=r"an `nnx.Optimizer`, its `opt_state`"):
    ols.loss_scale({"w": jnp.zeros(2)})


# --- the gradient helper with each framework ---


def test_value_and_grad_signature_describes_the_wrapper():
  def loss_fn(params, batch, *, weight=1.0):
    return jnp.sum(params * batch) * weight

  vg = ols.value_and_grad(loss_fn)
  assert str(inspect.signature(vg)) == (
    "(opt_state, /, params, batch, *, weight=1.0) -> tuple[typing.Any,"
    " typing.Any]"
  )
  assert "loss_fn" in vg.__name__ and vg.__doc__.startswith(
    "`ols.value_and_grad` of `loss_fn`"
  )
  builtin = ols.value_and_grad(jnp.sum)
  assert next(iter(inspect.signature(builtin).parameters)) == "opt_state"


def test_value_and_grad_refuses_bad_arguments():
  with pytest.raises(TypeError, match="`grad_fn` must be a value_and_grad"):
    ols.value_and_grad(jnp.sum, grad_fn="jax")
  with pytest.raises(TypeError, match="`has_aux` must be a bool"):
    ols.value_and_grad(jnp.sum, has_aux=1)


def test_value_and_grad_jax_gradients_are_exactly_scaled():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**10)
  params = {"w": jnp.ones((4, 1)), "b": jnp.zeros(1)}
  opt_state = tx.init(params)

  def loss_fn(p, x, y):
    err = x @ p["w"] + p["b"] - y
    return jnp.mean(err**2), {"err": err}

  (loss, aux), grads = ols.value_and_grad(loss_fn, has_aux=True)(
    opt_state, params, X, Y
  )
  (plain_loss, plain_aux), plain = jax.value_and_grad(loss_fn, has_aux=True)(
    params, X, Y
  )
  assert loss == plain_loss
  np.testing.assert_array_equal(aux["err"], plain_aux["err"])
  jax.tree.map(
    lambda g, p: np.testing.assert_array_equal(g, p * 2.0**10), grads, plain
  )


@pytest.mark.slow
def test_value_and_grad_nnx_with_dropout_and_batchnorm_exactly_scaled():
  model, optimizer = _nnx_setup(initial_scale=2.0**10)
  twin = nnx.clone(model)

  def loss_aux(model, x, y):
    pred = model(x)
    return _nnx_loss(model, x, y), pred

  (loss, pred), grads = ols.value_and_grad(
    loss_aux, has_aux=True, grad_fn=nnx.value_and_grad
  )(optimizer, model, X, Y)
  (plain_loss, plain_pred), plain = nnx.value_and_grad(loss_aux, has_aux=True)(
    twin, X, Y
  )
  assert loss == plain_loss  # the same dropout mask: RNG streams advanced
  np.testing.assert_array_equal(pred, plain_pred)
  jax.tree.map(
    lambda g, p: np.testing.assert_array_equal(g, p * 2.0**10),
    nnx.state(grads, nnx.Param),
    nnx.state(plain, nnx.Param),
  )
  # BatchNorm's statistics moved as in the plain call.
  np.testing.assert_array_equal(model.norm.mean[...], twin.norm.mean[...])


class _EqxModel(eqx.Module):
  """Non-array fields: an activation function and an int."""

  hidden: eqx.nn.Linear
  out: eqx.nn.Linear
  activation: object = eqx.field(static=True)
  width: int = eqx.field(static=True)

  def __init__(self, key, width=16):
    k1, k2 = jax.random.split(key)
    self.hidden = eqx.nn.Linear(4, width, key=k1)
    self.out = eqx.nn.Linear(width, 1, key=k2)
    self.activation = jax.nn.gelu
    self.width = width

  def __call__(self, x):
    return self.out(self.activation(self.hidden(x)))


class _EqxModelPlainFields(eqx.Module):
  """Non-array fields as most Equinox code has them: not marked static."""

  layers: list
  activation: object

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.layers = [eqx.nn.Linear(4, 16, key=k1), eqx.nn.Linear(16, 1, key=k2)]
    self.activation = jax.nn.relu

  def __call__(self, x):
    return self.layers[1](self.activation(self.layers[0](x)))


def _eqx_loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x).astype(jnp.float32) - y) ** 2)


def test_value_and_grad_equinox_exactly_scaled():
  model = _EqxModelPlainFields(jax.random.key(0))
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**10)
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  vg = ols.value_and_grad(_eqx_loss, grad_fn=eqx.filter_value_and_grad)
  loss, grads = vg(opt_state, model, X, Y)
  plain_loss, plain = eqx.filter_value_and_grad(_eqx_loss)(model, X, Y)
  assert loss == plain_loss
  jax.tree.map(
    lambda g, p: np.testing.assert_array_equal(g, p * 2.0**10), grads, plain
  )


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [_EqxModel, _EqxModelPlainFields])
def test_equinox_standard_loop(model_type):
  model = model_type(jax.random.key(0))
  optim = ols.loss_scale_optimizer(optax.adam(1e-2), dynamic_growth_steps=10)
  opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def make_step(model, opt_state, x, y):
    loss, grads = ols.value_and_grad(
      _eqx_loss, grad_fn=eqx.filter_value_and_grad
    )(opt_state, model, x, y)
    updates, opt_state = optim.update(
      grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
    )
    return eqx.apply_updates(model, updates), opt_state, loss

  losses = []
  for _ in range(30):
    model, opt_state, loss = make_step(model, opt_state, X, Y)
    losses.append(float(loss))
  assert losses[-1] < losses[0] / 2
  assert ols.loss_scale(opt_state) == 2.0**15 * 2**3
  # An overflow is skipped: the model does not move.
  bad = jax.tree.map(
    lambda p: jnp.full_like(p, jnp.nan), eqx.filter(model, eqx.is_inexact_array)
  )
  updates, opt_state = optim.update(
    bad, opt_state, eqx.filter(model, eqx.is_inexact_array)
  )
  assert all(not np.any(u) for u in jax.tree.leaves(updates))
  assert ols.loss_scale(opt_state) == 2.0**15 * 2**2


# --- Flax Linen TrainState ---


def test_linen_trainstate_value_and_grad():
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(16, dtype=jnp.float16)(x))
      return nn.Dense(1, dtype=jnp.float16)(x)

  model = MLP()
  params = model.init(jax.random.key(0), X)["params"]
  state = train_state.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=ols.loss_scale_optimizer(optax.adam(1e-2), dynamic_growth_steps=10),
  )

  def loss_fn(params, x, y):
    pred = state.apply_fn({"params": params}, x)
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  @jax.jit
  def step(state, x, y):
    loss, grads = ols.value_and_grad(loss_fn)(state, state.params, x, y)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(30):
    state, loss = step(state, X, Y)
    losses.append(float(loss))
  assert losses[-1] < losses[0] / 2
  assert ols.loss_scale(state) == 2.0**15 * 2**3
  assert jax.tree.leaves(state.params)[0].dtype == jnp.float32
