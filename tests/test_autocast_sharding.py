"""autocast on meshes (8 CPU devices, `Explicit` and `Auto` axes): a
`shard_map` inside the function runs its body under the policy, its
collectives in the dtype they are given; a sharded `jit` around the
function keeps the shardings and the collectives of the float32 step."""

import _autocast as helpers
import _hlo
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_lossscale as ols
from optax_lossscale._jaxpr import compat

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8,
  reason="needs 8 devices (on CPU, the test set-up makes them)",
)
AXIS_TYPES = [AxisType.Explicit, AxisType.Auto]
F16 = np.dtype(jnp.float16)


def _mesh(axis_type):
  return jax.make_mesh((8,), ("x",), axis_types=(axis_type,))


def _ring(h):
  return lax.ppermute(h, "x", [(i, (i + 1) % 8) for i in range(8)])


# Collectives inside a shard_map body, each on a float16 value `h` that
# varies over "x"; each returns a value varying over "x".
COLLECTIVES = {
  "psum_invariant_p": lambda h: lax.psum(h, "x") + h,
  "pmax_p": lambda h: lax.pmax(h, "x") + h,
  "pmin_p": lambda h: lax.pmin(h, "x") + h,
  "ppermute_p": _ring,
  "pbroadcast_p": lambda h: lax.pbroadcast(h, "x", 0) + h,  # not on CPU
  "all_gather_p": lambda h: lax.all_gather(h, "x", tiled=True)[:2] + h,
  "all_to_all_p": lambda h: lax.all_to_all(h, "x", 1, 1, tiled=True),
  "reduce_scatter_p": lambda h: jnp.tile(
    lax.psum_scatter(h, "x", scatter_dimension=1, tiled=True), (1, 8)
  ),
}
if hasattr(lax, "all_gather_invariant"):  # public on jax 0.7 only
  COLLECTIVES["all_gather_invariant_p"] = lambda h: (
    lax.all_gather_invariant(h, "x", tiled=True)[:2] + h
  )


def _in_shard_map(mesh, inner):
  def fun(x, w):
    body = lambda xs, w: inner(xs @ w)  # noqa: E731
    return jax.shard_map(
      body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")
    )(x, w)

  return fun


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_each_collective_communicates_in_the_dtype_it_is_given(name):
  mesh = _mesh(AxisType.Explicit)
  fun = _in_shard_map(mesh, COLLECTIVES[name])
  x = jnp.linspace(0.1, 1.0, 16 * 8).reshape(16, 8)
  w = jnp.eye(8) * 0.5
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    program = jax.make_jaxpr(ols.autocast(fun))(x, w)
    primitive = compat.policy_primitive(name)
    (eqn,) = [e for e in helpers.equations(program) if e.primitive is primitive]
    assert [np.dtype(v.aval.dtype) for v in eqn.invars] == [F16]
    if name == "pbroadcast_p":
      return  # XLA on CPU has no lowering for it
    got = jax.jit(ols.autocast(fun))(x, w)
    np.testing.assert_allclose(got, jax.jit(fun)(x, w), rtol=2e-3)


def test_an_invariant_value_made_varying_keeps_its_dtype():
  """jax inserts `pvary` where an invariant value meets a varying one."""
  mesh = _mesh(AxisType.Explicit)
  fun = _in_shard_map(mesh, lambda h: h + jnp.tanh(h[:1] * 0 + 1.0))

  def with_invariant(x, w):
    def body(xs, w):
      return xs @ w + (w @ w)[:1]  # w @ w: invariant, float16

    return jax.shard_map(
      body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")
    )(x, w)

  x = jnp.ones((16, 8))
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    program = jax.make_jaxpr(ols.autocast(with_invariant))(x, jnp.eye(8))
    pvary = compat.policy_primitive("pvary_p")
    found = {
      e.invars[0].aval.shape: np.dtype(e.invars[0].aval.dtype)
      for e in helpers.equations(program)
      if e.primitive is pvary
    }
    # The product's float16 result, and the float32 input `w`, which the
    # product inside casts after.
    assert found == {(1, 8): F16, (8, 8): np.dtype(jnp.float32)}
    assert jax.jit(ols.autocast(fun))(x, jnp.eye(8)).dtype == jnp.float32


def test_a_reshard_moves_the_float16_value():
  mesh = _mesh(AxisType.Explicit)

  def fun(x, w):
    return jax.sharding.reshard(x @ w, P()) * 2

  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("x")))
    program = jax.make_jaxpr(ols.autocast(fun))(x, jnp.eye(8))
    reshard = compat.policy_primitive("reshard_p")
    (eqn,) = [e for e in helpers.equations(program) if e.primitive is reshard]
    assert np.dtype(eqn.invars[0].aval.dtype) == F16
    got = jax.jit(ols.autocast(fun))(x, jnp.eye(8))
    assert got.sharding.spec == P(None, None) or got.sharding.spec == P()
    np.testing.assert_array_equal(got, 2 * np.ones((16, 8)))


@pytest.mark.parametrize("mesh_given", [True, False], ids=["mesh", "context"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_a_shard_map_body_runs_under_the_policy(axis_type, mesh_given):
  """With its mesh given, or taken from `jax.set_mesh` (its equation then
  holds an abstract mesh)."""
  mesh = _mesh(axis_type)
  given = {"mesh": mesh} if mesh_given else {}

  def loss(w, x):
    def body(xs, w):
      return lax.psum(jnp.sum(jnp.tanh(xs @ w) ** 2), "x")

    return jax.shard_map(body, in_specs=(P("x"), P()), out_specs=P(), **given)(
      x, w
    )

  w = jnp.linspace(-0.5, 0.5, 64).reshape(8, 8)
  x = jnp.linspace(-1.0, 1.0, 16 * 8).reshape(16, 8)
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    grad = jax.value_and_grad(ols.autocast(loss))
    program = jax.make_jaxpr(grad)(w, x)
    assert helpers.products_by_dtype(program) == {"float16": 2}
    (value16, grads16) = jax.jit(grad)(w, x)
    (value32, grads32) = jax.jit(jax.value_and_grad(loss))(w, x)
  np.testing.assert_allclose(value16, value32, rtol=2e-3)
  np.testing.assert_allclose(grads16, grads32, atol=2e-2)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_a_sharded_step_communicates_as_the_hand_conversion_does(axis_type):
  """Data-parallel MLP: the gradients are placed as float32's are; the
  compiled step gathers nothing, and all-reduces what the same policy
  written by hand all-reduces: the weights' partial gradients in float16
  (half float32's bytes), the biases' in float32."""
  mesh = _mesh(axis_type)
  params = helpers.mlp_init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (16, 8))
  y = jnp.arange(16) % 4
  losses = {
    "float32": helpers.mlp_loss,
    "autocast": ols.autocast(helpers.mlp_loss),
    "by hand": helpers.mlp_loss_by_hand,
  }
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    y = jax.device_put(y, NamedSharding(mesh, P("x")))
    try:
      steps = {
        name: jax.jit(jax.value_and_grad(loss)).lower(params, x, y).compile()
        for name, loss in losses.items()
      }
    except Exception as e:  # jax's ShardingTypeError is not public
      if "ambiguous" not in str(e):
        raise
      _float32_step_refused(mesh, params, x, y)
      pytest.skip(f"jax {jax.__version__} refuses the float32 step: {e}")
    results = {name: step(params, x, y) for name, step in steps.items()}
  gathering = ("all-gather", "all-to-all", "collective-permute")
  for compiled in steps.values():
    assert not any(_hlo.hlo_opcodes(compiled)[k] for k in gathering)
  reduced = {name: _all_reduced(c) for name, c in steps.items()}
  assert reduced["autocast"] == reduced["by hand"]
  assert sorted(reduced["autocast"]) == sorted(
    ("float16" if len(shape) == 2 else "float32", shape)
    for _, shape in reduced["float32"]
  )
  (v32, g32), (v16, g16) = results["float32"], results["autocast"]
  for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32), strict=True):
    assert a.dtype == b.dtype
    assert _unpadded(a.sharding.spec) == _unpadded(b.sharding.spec)
    np.testing.assert_allclose(a, b, atol=5e-3)
  np.testing.assert_allclose(v16, v32, rtol=2e-3)


def _float32_step_refused(mesh, params, x, y):
  """Checks that jax refuses the float32 step itself (jax 0.7 on an
  `Explicit` mesh: the weights' gradient contracts the sharded batch)."""
  with pytest.raises(Exception, match="ambiguous"):
    jax.jit(jax.value_and_grad(helpers.mlp_loss)).lower(params, x, y)


def _unpadded(spec):
  """`spec` without trailing `None`s: `P()` and `P(None, None)` both say
  replicated."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def _all_reduced(compiled):
  """The arrays all-reduced by the compiled program, as (dtype, shape)."""
  names = {"f16": "float16", "f32": "float32"}
  return sorted(
    (names[dtype], shape)
    for i in _hlo.hlo_instructions(compiled)
    if i.opcode in ("all-reduce", "all-reduce-start")
    for dtype, shape in i.arrays
  )


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_autocast_inside_a_shard_map_body(axis_type):
  mesh = _mesh(axis_type)

  @ols.autocast
  def body(xs, w):
    return jax.lax.psum(jnp.sum(jnp.tanh(xs @ w) ** 2), "x")

  def loss(w, x):
    return jax.shard_map(
      body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P()
    )(x, w)

  w = jnp.linspace(-0.5, 0.5, 64).reshape(8, 8)
  x = jnp.linspace(-1.0, 1.0, 16 * 8).reshape(16, 8)
  with jax.set_mesh(mesh):
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    program = jax.make_jaxpr(jax.value_and_grad(loss))(w, x)
    assert helpers.products_by_dtype(program) == {"float16": 2}
    value16, grads16 = jax.jit(jax.value_and_grad(loss))(w, x)
  plain = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)  # noqa: E731
  value32, grads32 = jax.value_and_grad(plain)(w, np.asarray(x))
  np.testing.assert_allclose(value16, value32, rtol=2e-3)
  np.testing.assert_allclose(grads16, grads32, atol=2e-2)
