"""`keep_float32` and where operations are (issue 33, points 6 and 7):
entries match name scopes as whole components and call paths by class,
method or function; whatever `find_overflow` names through autocast (its
line, scope and call path, in NNX, Equinox and Linen models) is the
user's code, and `keep_float32` accepts it and switches that code to
float32. Each operation keeps its source line and name stack, in the
program and in the compiled module's metadata."""

import inspect

import _autocast as helpers
import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import optax_lossscale as ols

W = jnp.linspace(-0.5, 0.5, 16).reshape(4, 4)
X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def _product_dtypes(fun, *args):
  """The result dtype of each product, in program order."""
  program = jax.make_jaxpr(fun)(*args)
  return [
    np.dtype(e.outvars[0].aval.dtype).name
    for e in helpers.equations(program)
    if e.primitive.name in helpers.PRODUCTS
  ]


def _scoped(*names):
  """A product inside nested name scopes `names`, then one outside."""

  def fun(w, x):
    def inner(depth, h):
      if depth == len(names):
        return h @ w
      with jax.named_scope(names[depth]):
        return inner(depth + 1, h)

    return inner(0, x) @ w

  return fun


@pytest.mark.parametrize(
  "scopes, entry, kept",
  [
    (("decoder", "attention", "softmax"), "attention", True),
    (("decoder", "attention", "softmax"), "decoder/attention", True),
    (("decoder", "attention", "softmax"), "attention/softmax", True),
    (("decoder", "attention", "softmax"), "decoder/softmax", False),
    (("decoder", "attention", "softmax"), "attn", False),
    (("3", "0", "1", "0"), "3/0", True),
    (("13", "0"), "3/0", False),
    (("3", "01"), "3/0", False),
  ],
)
def test_a_scope_entry_matches_whole_components(scopes, entry, kept):
  fun = ols.autocast(_scoped(*scopes), keep_float32=(entry,))
  inside = "float32" if kept else "float16"
  assert _product_dtypes(fun, W, X) == [inside, "float16"]


def test_scopes_inside_calls_and_loop_bodies_match():
  @jax.jit
  def layer(h, w):
    with jax.named_scope("attention"):
      return h @ w

  def fun(w, x):
    with jax.named_scope("decoder"):
      h = layer(x, w)
      h = jax.lax.scan(lambda c, _: (layer(c, w), None), h, length=2)[0]
    return h @ w

  keep = ols.autocast(fun, keep_float32=("decoder/attention",))
  assert _product_dtypes(keep, W, X) == ["float32", "float32", "float16"]


class RMSNorm:
  def __init__(self, scale):
    self.scale = scale

  def __call__(self, x):
    variance = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + 1e-6) * self.scale


def attention(q, k):
  return jax.nn.softmax(q @ k.T)


@pytest.mark.parametrize(
  "entry", ["RMSNorm", "RMSNorm.__call__", "(RMSNorm.__call__)"]
)
def test_a_call_path_entry_matches_a_class_or_its_method(entry):
  def fun(w, x):
    return RMSNorm(2.0)(x @ w) @ w

  program = jax.make_jaxpr(ols.autocast(fun, keep_float32=(entry,)))(W, X)
  muls = {
    np.dtype(e.outvars[0].aval.dtype).name
    for e in helpers.equations(program)
    if e.primitive.name == "mul"
  }
  assert muls == {"float32"}  # x * x: float16 without the entry
  unkept = jax.make_jaxpr(ols.autocast(fun))(W, X)
  assert "float16" in {
    np.dtype(e.outvars[0].aval.dtype).name
    for e in helpers.equations(unkept)
    if e.primitive.name == "mul"
  }


def test_a_call_path_entry_matches_a_function():
  def fun(w, x):
    return attention(x @ w, x) @ x

  keep = ols.autocast(fun, keep_float32=("attention",))
  # x @ w outside; q @ k.T inside `attention`; the last one outside.
  assert _product_dtypes(keep, W, X) == ["float16", "float32", "float16"]
  assert (
    _product_dtypes(ols.autocast(fun, keep_float32=("atten",)), W, X)
    == ["float16"] * 3
  )


# Whatever the finder names through autocast, keep_float32 accepts.


def _inputs():
  x = jnp.linspace(50.0, 100.0, 16).reshape(4, 4)  # with weights near 1000:
  return x, jnp.zeros((4, 2))  # a first product beyond 65504


class _NnxModel(nnx.Module):
  def __init__(self):
    rngs = nnx.Rngs(0)
    self.big = nnx.Linear(4, 8, rngs=rngs)
    self.big.kernel[...] = self.big.kernel[...] * 1000
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(self.norm(self.big(x)))


class _EqxModel(eqx.Module):
  big: eqx.nn.Linear
  norm: eqx.nn.LayerNorm
  out: eqx.nn.Linear

  def __init__(self):
    k1, k2 = jax.random.split(jax.random.key(0))
    big = eqx.nn.Linear(4, 8, key=k1)
    self.big = eqx.tree_at(lambda m: m.weight, big, big.weight * 1000)
    self.norm = eqx.nn.LayerNorm(8)
    self.out = eqx.nn.Linear(8, 2, key=k2)

  def __call__(self, x):
    return jax.vmap(lambda r: self.out(self.norm(self.big(r))))(x)


class _LinenModel(linen.Module):
  @linen.compact
  def __call__(self, x):
    big = linen.Dense(8, kernel_init=linen.initializers.constant(1000.0))
    return linen.Dense(2)(linen.LayerNorm()(big(x)))


def _nnx_case():
  def loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  return loss, _NnxModel()


def _eqx_case():
  def loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  return loss, _EqxModel()


def _linen_case():
  model = _LinenModel()
  params = model.init(jax.random.key(0), _inputs()[0])

  def loss(params, x, y):
    return jnp.mean((model.apply(params, x) - y) ** 2)

  return loss, params


@pytest.mark.slow
@pytest.mark.parametrize(
  "case", [_nnx_case, _eqx_case, _linen_case], ids=["nnx", "equinox", "linen"]
)
def test_what_the_finder_names_keep_float32_accepts(case):
  loss, params = case()
  x, y = _inputs()
  assert bool(jnp.isfinite(loss(params, x, y)))
  assert not bool(jnp.isfinite(ols.autocast(loss)(params, x, y)))
  report = ols.find_overflow(ols.autocast(loss), params, x, y)
  first = report.first
  assert (first.pass_name, first.primitive) == ("forward", "dot_general")
  # The user's code: a line of this file, or (Linen) of the model's call.
  assert first.source is not None
  names = [first.scope] if first.scope else []
  names += list(first.call_path)
  assert names
  for name in names:
    kept = ols.autocast(loss, keep_float32=(name,))
    assert bool(jnp.isfinite(kept(params, x, y))), name
    assert not ols.find_overflow(kept, params, x, y), name


def test_the_finder_names_the_line_and_scope_of_the_user_code():
  def loss(w, x):
    with jax.named_scope("block"):
      h = x @ (w * 1000.0)
    return jnp.sum(h * 0.0 + 1.0)

  report = ols.find_overflow(ols.autocast(loss), W, jnp.full((3, 4), 300.0))
  first = report.first
  assert (first.primitive, first.scope) == ("dot_general", "block")
  assert first.code == "h = x @ (w * 1000.0)"
  assert first.source.startswith("tests/test_autocast_scopes.py:")
  assert first.call_path[-1].endswith("loss")


def test_the_finder_names_the_line_that_called_a_jitted_jax_function():
  # jax.nn.log_softmax is a jit whose body has no frame of the user's;
  # autocast evaluates it in place, and its casts (the float16 logits to
  # float32 for the exponentials) and operations are named by the line
  # that called it, as the call itself is without autocast. Found on
  # Flax's NNX Gemma, whose backward first overflows at that cast.
  def loss(w, x):
    logp = jax.nn.log_softmax(x @ w)
    return -jnp.mean(logp[:, 0])

  report = ols.find_overflow(ols.autocast(loss), W, X, scale=2.0**40)
  first = report.first
  assert (first.pass_name, first.primitive) == (
    "backward",
    "convert_element_type",
  )
  assert first.code == "logp = jax.nn.log_softmax(x @ w)"
  assert first.source.startswith("tests/test_autocast_scopes.py:")
  assert first.call_path[-1].endswith("loss")


# Source lines and name stacks, in the program and in the compiled module.


def _line_of(text, fun):
  lines, start = inspect.getsourcelines(fun)
  return start + next(i for i, line in enumerate(lines) if text in line)


def _scoped_loss(w, x):
  with jax.named_scope("attention"):
    logits = x @ w
  return jnp.sum(jnp.exp(logits))


def test_each_operation_keeps_its_line_and_its_name_stack():
  program = jax.make_jaxpr(ols.autocast(_scoped_loss))(W, X)
  line = _line_of("logits = x @ w", _scoped_loss)
  made_there = [
    e
    for e in program.jaxpr.eqns
    if any(
      frame.file_name == __file__ and frame.start_line == line
      for frame in jax._src.source_info_util.user_frames(
        e.source_info.traceback
      )
    )
  ]
  # The product and the casts of its two operands.
  assert sorted(e.primitive.name for e in made_there) == [
    "convert_element_type",
    "convert_element_type",
    "dot_general",
  ]
  assert all(str(e.source_info.name_stack) == "attention" for e in made_there)


def test_the_compiled_module_names_the_users_line_and_scope():
  lowered = jax.jit(jax.grad(ols.autocast(_scoped_loss))).lower(W, X)
  text = lowered.as_text(debug_info=True)
  line = _line_of("logits = x @ w", _scoped_loss)
  assert f'test_autocast_scopes.py":{line}' in text
  # Forward and backward products are named in the scope.
  named = [
    line
    for line in text.splitlines()
    if "dot_general" in line and "attention" in line and "loc(" in line
  ]
  assert any("jvp(attention)" in line for line in named)
  assert any("transpose(jvp(attention))" in line for line in named)


def test_an_error_in_fun_names_the_users_line():
  def broken(w, x):
    return x @ w.T[:2]  # shapes (3, 4) and (2, 4)

  with pytest.raises(TypeError) as raised:
    ols.autocast(broken)(W, X)
  frames = [f for f in raised.traceback if str(f.path) == __file__]
  assert any("x @ w.T[:2]" in str(f.statement) for f in frames)


def test_an_equinox_layer_is_kept_by_the_scope_it_writes():
  linear = eqx.nn.Linear(4, 4, key=jax.random.key(0))

  def fun(x):
    return jax.vmap(linear)(x @ W)

  kept = ols.autocast(fun, keep_float32=("eqx.nn.Linear",))
  assert _product_dtypes(kept, X) == ["float16", "float32"]
