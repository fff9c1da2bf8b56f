"""Bad input and primitives outside the policy (issue 33, point 9): bad
arguments fail when `autocast(...)` is called, naming the argument, the
value and what is accepted; host callbacks, FFI calls and Pallas kernels
run in the dtypes they were traced with, their inputs cast back, never an
error."""

import _autocast as helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.experimental import pallas as pl

import optax_lossscale as ols
from optax_lossscale._autocast import interpreter
from optax_lossscale._autocast.policy import Policy

F32 = np.dtype(jnp.float32)


def loss(x):
  return jnp.sum(x)


@pytest.mark.parametrize(
  "fun, match",
  [
    (None, r"`fun` must be callable .* got None of type NoneType"),
    ("loss", r"`fun` must be callable .* got 'loss' of type str"),
    (jnp.ones(3), r"`fun` must be callable"),
  ],
)
def test_fun_must_be_callable(fun, match):
  with pytest.raises(TypeError, match=match):
    ols.autocast(fun)


@pytest.mark.parametrize("dtype", [jnp.float32, "float64", np.int8, jnp.bool_])
def test_dtype_must_be_float16_or_bfloat16(dtype):
  name = np.dtype(dtype).name
  with pytest.raises(ValueError, match=f"float16 or bfloat16, got {name}"):
    ols.autocast(loss, dtype)


@pytest.mark.parametrize("dtype", [None, True, 3, "half-ish", object()])
def test_dtype_must_be_a_dtype(dtype):
  with pytest.raises(TypeError, match=r"`dtype` must be jnp.float16 or"):
    ols.autocast(loss, dtype)


def test_a_bare_string_for_keep_float32_is_refused_with_the_tuple_to_pass():
  with pytest.raises(TypeError) as raised:
    ols.autocast(loss, keep_float32="attention")
  message = str(raised.value)
  assert "got the string 'attention'" in message
  assert "keep_float32=('attention',)" in message


@pytest.mark.parametrize(
  "entries, error, match",
  [
    (3, TypeError, r"a sequence of strings .* got 3 of type int"),
    ({"attention": 1}, TypeError, r"a sequence of strings .* of type dict"),
    (("attention", 3), TypeError, r"every entry .* got 3 of type int"),
    (("",), ValueError, r"entry '' is not a name scope"),
    (("a//b",), ValueError, r"entry 'a//b' is not a name scope"),
    (("/a",), ValueError, r"entry '/a' is not a name scope"),
  ],
)
def test_keep_float32_must_be_a_sequence_of_scope_names(entries, error, match):
  with pytest.raises(error, match=match):
    ols.autocast(loss, keep_float32=entries)


@pytest.mark.parametrize("entries", [(), [], ("a", "b/c"), {"a"}, ["(F.g)"]])
def test_keep_float32_takes_any_sequence_or_set_of_names(entries):
  ols.autocast(loss, keep_float32=entries)


@pytest.mark.parametrize("mixed", ["widest", None, True])
def test_mixed_is_promote_or_cast(mixed):
  with pytest.raises(
    ValueError, match=r"`mixed` must be 'promote' .* or 'cast'"
  ):
    ols.autocast(loss, mixed=mixed)


def test_a_bad_argument_fails_before_anything_is_traced():
  traced = []

  def fun(x):
    traced.append(x)
    return x

  with pytest.raises(ValueError):
    ols.autocast(fun, jnp.float32)
  assert traced == []


# Primitives the policy does not list: as traced, their inputs cast back.


def _outside(fun, *args):
  """The primitives `fun` ran outside the policy, from its evaluator."""
  closed = jax.make_jaxpr(fun)(*args)
  evaluator = interpreter.Evaluator(Policy(np.dtype(jnp.float16)))
  evaluator.run(closed, list(args), interpreter.Where())
  return evaluator.outside


def _operand_dtypes(fun, *args, name):
  program = jax.make_jaxpr(ols.autocast(fun))(*args)
  return helpers.operand_dtypes(program, name)


X = jnp.linspace(0.5, 1.5, 16).reshape(4, 4)


def test_a_host_callback_gets_its_traced_dtypes():
  seen = []

  def host(h):
    seen.append(h.dtype)
    return np.asarray(h * 2)

  def fun(x):
    h = x @ x
    out = jax.pure_callback(host, jax.ShapeDtypeStruct(h.shape, h.dtype), h)
    return out @ x

  assert _operand_dtypes(fun, X, name="pure_callback") == [("float32",)]
  got = jax.jit(ols.autocast(fun))(X)
  assert seen[-1] == F32
  np.testing.assert_allclose(got, fun(X), rtol=5e-3)
  assert set(_outside(fun, X)) == {"pure_callback"}


def test_io_callback_and_debug_print_run():
  printed = []

  def fun(x):
    h = x @ x
    io_callback(lambda v: printed.append(v.dtype), None, h, ordered=True)
    jax.debug.print("{}", jnp.sum(h))
    return h

  out = ols.autocast(fun)(X)
  assert out.dtype == F32 and printed == [F32]


def test_an_ffi_call_is_bound_as_traced():
  def fun(x):
    h = x @ x
    call = jax.ffi.ffi_call("a_target", jax.ShapeDtypeStruct(h.shape, h.dtype))
    return call(h)

  # Traced only: no such target exists to run.
  assert _operand_dtypes(fun, X, name="ffi_call") == [("float32",)]


def test_a_pallas_kernel_runs_in_its_traced_dtypes():
  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  def fun(x):
    h = x @ x
    kernel = pl.pallas_call(
      double, out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype), interpret=True
    )
    return kernel(h)

  assert _operand_dtypes(fun, X, name="pallas_call") == [("float32",)]
  got = ols.autocast(fun)(X)
  assert got.dtype == F32
  np.testing.assert_allclose(got, fun(X), rtol=5e-3)


def test_the_primitives_outside_the_policy_are_logged_with_their_line(caplog):
  def fun(x):
    h = x @ x
    shape = jax.ShapeDtypeStruct(h.shape, h.dtype)
    return jax.pure_callback(lambda v: np.asarray(v), shape, h)

  line = fun.__code__.co_firstlineno + 3
  with caplog.at_level("INFO", logger="optax_lossscale.autocast"):
    ols.autocast(fun)(X)
  assert caplog.messages == [
    "autocast(fun): outside the policy, in their traced dtypes:"
    f" pure_callback (test_autocast_errors.py:{line})"
  ]
  caplog.clear()
  ols.autocast(lambda x: jnp.tanh(x @ x))(X)  # all within the policy
  assert caplog.messages == []


# fun is traced at each call, as under jit.


def test_python_control_flow_on_an_array_value_fails_as_under_jit():
  def branchy(x):
    return x if float(jnp.sum(x)) > 0 else -x

  assert branchy(X) is X  # eagerly, without autocast
  with pytest.raises(jax.errors.ConcretizationTypeError):
    ols.autocast(branchy)(X)
  with pytest.raises(jax.errors.ConcretizationTypeError):
    jax.jit(branchy)(X)


def test_non_array_arguments_pass_as_they_are_and_keywords_too():
  def fun(x, train, *, scale, name):
    assert isinstance(train, bool) and isinstance(name, str)
    h = x @ x
    return (h * scale if train else h), name

  out, name = ols.autocast(fun)(X, True, scale=jnp.float32(2.0), name="n")
  np.testing.assert_allclose(out, 2 * (X @ X), rtol=2e-3)
  assert name == "n" and out.dtype == F32
  out, _ = ols.autocast(fun)(X, False, scale=2.0, name="n")
  np.testing.assert_allclose(out, X @ X, rtol=2e-3)
