"""Every jax internal the package names exists on the running jax.

`compat` holds each primitive the package matches (by object) and the
equation parameters it reads from it, and the other internal names it uses.
Each resolves, and each parameter key is in the parameters of an equation
that jax itself traced: a jax that renames one fails here, not silently in
the skip's rewrite or the finder.
"""

import jax
import jax.numpy as jnp
import pytest
from _helpers import closed_call

from optax_lossscale._jaxpr import compat as _compat


@jax.custom_jvp
def _custom_jvp(x):
  return jnp.sin(x)


_custom_jvp.defjvp(lambda primals, tangents: (_custom_jvp(*primals), *tangents))


@jax.custom_vjp
def _custom_vjp(x):
  return jnp.sin(x)


_custom_vjp.defvjp(lambda x: (_custom_vjp(x), None), lambda _, g: (g,))

# A function whose jaxpr's first equation is one of each primitive.
_MAKERS = {
  "jit_p": lambda x: jax.jit(jnp.sin)(x),
  "closed_call_p": lambda x: closed_call(jnp.sin, x),
  "remat_p": jax.checkpoint(jnp.sin),
  "custom_jvp_call_p": _custom_jvp,
  "custom_vjp_call_p": _custom_vjp,
}


def test_every_named_primitive_has_a_traced_example():
  assert set(_MAKERS) == set(_compat.PRIMITIVES)


@pytest.mark.parametrize("name", sorted(_compat.PRIMITIVES))
def test_each_named_primitive_and_its_keys_exist(name):
  primitive, keys = _compat.PRIMITIVES[name]
  assert isinstance(primitive, _compat.Primitive), (name, jax.__version__)
  (eqn,) = jax.make_jaxpr(_MAKERS[name])(1.0).jaxpr.eqns
  assert eqn.primitive is primitive
  missing = [key for key in keys if key not in eqn.params]
  assert not missing, f"{name} on jax {jax.__version__}: no {missing}"
  # The interpreter finds the body and re-binds the equation.
  assert hasattr(eqn.ctx, "manager")
  if primitive in _compat.CALLS:
    body = _compat.call_body(eqn)
  else:
    assert primitive in _compat.RULED_CALLS
    body = _compat.ruled_call_body(eqn)
  assert isinstance(body, _compat.ClosedJaxpr)
  assert jax.make_jaxpr(lambda x: _compat.bind(eqn, [x]))(1.0).jaxpr.eqns


def test_the_other_internal_names_resolve():
  missing = [name for name, v in _compat.INTERNALS.items() if v is None]
  assert not missing, f"jax {jax.__version__} lacks {missing}"


def test_name_scopes_and_frames_are_read():
  def f(x):
    with jax.named_scope("outer"):
      return jnp.sum(jnp.sin(x) * 3.0)

  eqns = jax.make_jaxpr(jax.grad(f))(jnp.ones(3)).jaxpr.eqns
  scopes = [_compat.name_scopes(eqn) for eqn in eqns]
  assert ("outer",) in [names for names, _ in scopes]
  assert any(transposed for _, transposed in scopes)  # the backward pass
  frames = _compat.user_frames(eqns[0])
  assert frames and frames[0][0] == __file__


def test_bind_passes_the_parameters_through_map_params():
  # The overflow finder's float32 reference: a float16 equation re-bound
  # with its dtype parameters widened.
  (eqn,) = jax.make_jaxpr(lambda x: x.astype(jnp.float16))(1.0).jaxpr.eqns

  def widen(params):
    return {
      k: jnp.dtype(jnp.float32) if v == jnp.float16 else v
      for k, v in params.items()
    }

  (narrow,) = _compat.bind(eqn, [jnp.float32(1 + 2**-20)])
  (wide,) = _compat.bind(eqn, [jnp.float32(1 + 2**-20)], map_params=widen)
  assert (narrow.dtype, float(narrow)) == (jnp.float16, 1.0)
  assert (wide.dtype, float(wide)) == (jnp.float32, 1 + 2**-20)


def test_a_literal_passed_into_a_jit_reads_with_its_dtype():
  # `jnp.where` is a `jit`: its `-inf` is a literal argument of the call,
  # which jax 0.7.1 holds as a bare Python float.
  def masked(x):
    return jnp.where(x > 0, x, -jnp.inf)

  eqns = jax.make_jaxpr(masked)(jnp.ones(2, jnp.float16)).jaxpr.eqns
  (literal,) = [
    v
    for eqn in eqns
    for v in eqn.invars
    if isinstance(v, _compat.Literal) and v.aval.dtype == jnp.float32
  ]
  value = _compat.literal_value(literal)
  assert (value.dtype, float(value)) == (jnp.float32, -float("inf"))


def test_a_call_body_names_the_function_it_was_traced_from():
  def double(x):
    return x * 2.0

  (eqn,) = jax.make_jaxpr(jax.jit(double))(1.0).jaxpr.eqns
  body = _compat.call_body(eqn)
  assert _compat.traced_function(body) == ("double", __file__)


def test_host_calls_are_known_by_their_names():
  # jax exports no primitive object for host callbacks: compat knows them
  # by name, and the finder runs them once, as written. A jax that renames
  # one fails here.
  def calls(x):
    y = jax.pure_callback(
      lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x
    )
    jax.experimental.io_callback(lambda a: None, None, x)
    jax.debug.print("{}", x)
    return y

  eqns = jax.make_jaxpr(calls)(jnp.ones(2)).jaxpr.eqns
  assert len(eqns) == 3
  assert all(_compat.is_host_call(eqn) for eqn in eqns), [
    eqn.primitive.name for eqn in eqns
  ]
  assert not _compat.is_host_call(jax.make_jaxpr(jnp.sin)(1.0).jaxpr.eqns[0])
