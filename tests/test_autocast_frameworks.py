"""autocast with the frameworks (issue 33, point 8): Flax NNX modules as
arguments (BatchNorm statistics, Dropout's RNG counts updated as without
autocast), Equinox modules with non-array leaves, Flax Linen's `apply`,
and a penzai-style model of named axes."""

import dataclasses

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_lossscale as ols

X = jnp.linspace(-2.0, 2.0, 32).reshape(8, 4)
Y = jnp.linspace(-1.0, 1.0, 16).reshape(8, 2)


def _close(got, want, atol=5e-3):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype
    np.testing.assert_allclose(g, w, atol=atol)


# Flax NNX.


class _NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.BatchNorm(4, rngs=rngs)
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.gelu(self.hidden(self.norm(x)))
    return self.out(self.dropout(h))


def _nnx_loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _nnx_pair():
  return _NnxModel(nnx.Rngs(0, dropout=1)), _NnxModel(nnx.Rngs(0, dropout=1))


def _state(model, kind):
  return jax.tree.leaves(nnx.state(model, kind))


@pytest.mark.parametrize(
  "jit",
  [pytest.param(False, marks=pytest.mark.slow), True],
  ids=["eager", "nnx.jit"],
)
def test_nnx_statistics_and_rng_counts_update_as_without_autocast(jit):
  """BatchNorm reads the float32 batch first, so its statistics are the
  same arithmetic in both runs: equal. Dropout draws from the same count,
  and both counts advance once."""
  ours, theirs = _nnx_pair()

  def step(model, loss):
    return nnx.value_and_grad(loss)(model, X, Y)

  if jit:
    step = nnx.jit(step, static_argnums=1)
  (loss16, grads16) = step(ours, ols.autocast(_nnx_loss))
  (loss32, grads32) = step(theirs, _nnx_loss)
  for a, b in zip(
    _state(ours, nnx.BatchStat), _state(theirs, nnx.BatchStat), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  counts = _state(ours, nnx.RngCount)
  assert counts == _state(theirs, nnx.RngCount)
  assert [int(c) for c in counts] == [1]
  np.testing.assert_allclose(loss16, loss32, rtol=5e-3)
  _close(nnx.state(grads16), nnx.state(grads32), atol=1e-2)
  # The statistics moved from their initial values.
  fresh = _NnxModel(nnx.Rngs(0, dropout=1))
  assert any(
    not np.array_equal(a, b)
    for a, b in zip(
      _state(ours, nnx.BatchStat), _state(fresh, nnx.BatchStat), strict=True
    )
  )


def test_nnx_a_training_step_with_the_loss_scaler():
  model = _NnxModel(nnx.Rngs(0, dropout=1))
  tx = ols.loss_scale_optimizer(optax.adam(1e-2))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    grad = ols.value_and_grad(
      ols.autocast(_nnx_loss), grad_fn=nnx.value_and_grad
    )
    loss, grads = grad(optimizer, model, X, Y)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(5)]
  assert losses[-1] < losses[0]
  params = nnx.state(model, nnx.Param)
  assert {p.dtype for p in jax.tree.leaves(params)} == {np.dtype(jnp.float32)}
  assert [int(c) for c in _state(model, nnx.RngCount)] == [5]


def test_nnx_a_method_decorated_with_autocast():
  class Head(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(4, 2, rngs=rngs)
      self.calls = nnx.Variable(jnp.int32(0))

    @ols.autocast
    def __call__(self, x):
      self.calls[...] = self.calls[...] + 1
      return self.linear(x)

  head = Head(nnx.Rngs(0))
  out = head(X)
  assert out.dtype == jnp.float32
  assert int(head.calls[...]) == 1
  _close(out, head.linear(X), atol=1e-2)


# Equinox.


class _Tagged(eqx.Module):
  mlp: eqx.nn.MLP
  tag: str  # a non-array leaf
  scale: float  # a Python number, passed as it is


def _eqx_model():
  mlp = eqx.nn.MLP(
    4, 2, 8, depth=2, activation=jax.nn.gelu, key=jax.random.key(0)
  )
  return _Tagged(mlp, "head", 0.5)


def _eqx_loss(model, x, y):
  assert model.tag == "head"  # arrives as it is
  return jnp.mean((model.scale * jax.vmap(model.mlp)(x) - y) ** 2)


@pytest.mark.parametrize(
  "jit",
  [pytest.param(False, marks=pytest.mark.slow), True],
  ids=["eager", "filter_jit"],
)
def test_equinox_modules_with_non_array_leaves(jit):
  model = _eqx_model()
  grad16 = eqx.filter_value_and_grad(ols.autocast(_eqx_loss))
  grad32 = eqx.filter_value_and_grad(_eqx_loss)
  if jit:
    grad16, grad32 = eqx.filter_jit(grad16), eqx.filter_jit(grad32)
  (loss16, g16), (loss32, g32) = grad16(model, X, Y), grad32(model, X, Y)
  np.testing.assert_allclose(loss16, loss32, rtol=5e-3)
  _close(eqx.filter(g16, eqx.is_array), eqx.filter(g32, eqx.is_array))


# Flax Linen.


class _LinenModel(linen.Module):
  @linen.compact
  def __call__(self, x, train):
    x = linen.Dense(8)(x)
    x = linen.BatchNorm(use_running_average=not train)(x)
    x = linen.LayerNorm()(x)
    return linen.Dense(2)(linen.gelu(x))


@pytest.mark.slow
def test_linen_apply_with_mutable_statistics():
  model = _LinenModel()
  variables = model.init(jax.random.key(0), X, train=False)

  def loss(params, stats, x, y):
    out, updates = model.apply(
      {"params": params, "batch_stats": stats},
      x,
      train=True,
      mutable=["batch_stats"],
    )
    return jnp.mean((out - y) ** 2), updates["batch_stats"]

  args = (variables["params"], variables["batch_stats"], X, Y)
  (l16, s16), g16 = jax.value_and_grad(ols.autocast(loss), has_aux=True)(*args)
  (l32, s32), g32 = jax.value_and_grad(loss, has_aux=True)(*args)
  np.testing.assert_allclose(l16, l32, rtol=5e-3)
  _close(g16, g32, atol=1e-2)
  _close(s16, s32, atol=1e-2)  # after a float16 product: close, float32


# A penzai-style model: layers are dataclass pytrees, arrays carry named
# axes, and each layer's call is a named scope.


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Named:
  data: jax.Array
  names: tuple[str, ...] = dataclasses.field(metadata={"static": True})

  def contract(self, other, over):
    keep = [n for n in self.names if n != over]
    keep += [n for n in other.names if n != over and n not in keep]
    letters = {
      n: chr(ord("a") + i) for i, n in enumerate({*self.names, *other.names})
    }
    spec = (
      "".join(letters[n] for n in self.names)
      + ","
      + "".join(letters[n] for n in other.names)
      + "->"
      + "".join(letters[n] for n in keep)
    )
    return _Named(jnp.einsum(spec, self.data, other.data), tuple(keep))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _NamedLinear:
  weights: _Named
  into: str = dataclasses.field(metadata={"static": True})

  def __call__(self, x):
    with jax.named_scope(type(self).__name__):
      return self.weights.contract(x, over=self.into)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _NamedSoftmax:
  over: str = dataclasses.field(metadata={"static": True})

  def __call__(self, x):
    with jax.named_scope(type(self).__name__):
      axis = x.names.index(self.over)
      return _Named(jax.nn.softmax(x.data, axis=axis), x.names)


def test_a_penzai_style_named_axis_model():
  layers = [
    _NamedLinear(
      _Named(jnp.linspace(-1, 1, 32).reshape(4, 8), ("in", "hidden")), "in"
    ),
    _NamedLinear(
      _Named(jnp.linspace(-1, 1, 16).reshape(8, 2), ("hidden", "out")), "hidden"
    ),
    _NamedSoftmax("out"),
  ]

  def loss(layers, x):
    h = _Named(x, ("batch", "in"))
    for layer in layers:
      h = layer(h)
    return -jnp.mean(jnp.log(h.data))

  program = jax.make_jaxpr(jax.grad(ols.autocast(loss)))(layers, X)
  products = [
    e.outvars[0].aval.dtype
    for e in program.jaxpr.eqns
    if e.primitive.name == "dot_general"
  ]
  assert products and set(products) == {np.dtype(jnp.float16)}
  _close(jax.grad(ols.autocast(loss))(layers, X), jax.grad(loss)(layers, X))
