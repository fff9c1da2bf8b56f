"""The finiteness check, equal to the element-wise definition ("every
element of every unscaled leaf is finite") for every dtype, special value and
scale, in each form of leaves that live on one device: the accelerators'
(one reduction over groups of concatenated leaves), run here directly and
lowered for GPU; CPU's (large leaves of one shape read together, small
leaves concatenated), which the suite runs by default; and the per-leaf form
of `leaf_stats`, the same everywhere. What is checked of their programs is
structural: one pass over the gradients, no copy of them, no run-time
branch. The forms for leaves sharded over a mesh are tested in
tests/test_sharding.py."""

import collections
import functools

import _hlo
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import export

import optax_lossscale as ols
from optax_lossscale._core import config as _config
from optax_lossscale._core import finite as _finite
from optax_lossscale._core import reductions as _reductions
from optax_lossscale._core import state as _state
from optax_lossscale._core import step as _unscale

DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
SPECIALS = (np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 3e38, -3e38, 1e-45)


SIZE = 6  # fixed shapes: one compilation serves every example


@st.composite
def trees(draw):
  """One leaf of each dtype, values mixing ordinary numbers and specials."""
  tree = {}
  for dtype in DTYPES:
    values = np.asarray(
      draw(
        st.lists(
          st.one_of(st.floats(-1e4, 1e4), st.sampled_from(SPECIALS)),
          min_size=SIZE,
          max_size=SIZE,
        )
      ),
      np.float64,
    )
    with np.errstate(over="ignore"):
      tree[jnp.dtype(dtype).name] = jnp.asarray(
        values.astype(np.float32), dtype
      )
  return tree


def elementwise_finite(tree):
  return all(
    np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(tree)
  )


def elementwise_code(tree):
  """The check's code by definition: 2 for a NaN anywhere, else 1 for an
  infinity anywhere, else 0."""
  values = [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
  if any(np.isnan(x).any() for x in values):
    return _finite.NAN
  return _finite.FINITE if elementwise_finite(tree) else _finite.INF


@settings(max_examples=300, deadline=None, derandomize=True)
@given(trees())
def test_all_finite_matches_the_elementwise_definition(tree):
  assert bool(jax.jit(ols.all_finite)(tree)) == elementwise_finite(tree)
  verdict = _check_per_leaf(tree)
  assert int(verdict.code) == elementwise_code(tree)
  assert [bool(c) for c in verdict.leaf_notfinite] == [
    not elementwise_finite(x) for x in jax.tree.leaves(tree)
  ]


_check_per_leaf = jax.jit(lambda tree: _finite.check(tree, per_leaf=True))


_concatenated = jax.jit(
  lambda tree: _finite.code_of(
    *_reductions.on_accelerators(*jax.tree.leaves(tree))
  )
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(trees())
def test_the_concatenated_check_matches_the_elementwise_definition(tree):
  """The formulation lowered for GPU and TPU, run here on CPU."""
  assert int(_concatenated(tree)) == elementwise_code(tree)


def test_the_concatenated_check_sees_every_group_of_leaves():
  """Leaves are concatenated in groups (a single concatenation of 1,000
  leaves was materialized on GPU); a non-finite value in any group counts."""
  per = _reductions.LEAVES_PER_CONCATENATION
  n = 3 * per + 5
  for bad in (0, per, 2 * per + 1, n - 1):
    tree = [jnp.ones(3)] * n
    assert int(_concatenated(tree)) == _finite.FINITE
    tree[bad] = jnp.array([1.0, np.inf, 1.0])
    assert int(_concatenated(tree)) == _finite.INF, bad


@st.composite
def same_shape_leaves(draw):
  """Up to five leaves of one shape and dtype, mixing numbers and specials."""
  dtype = draw(st.sampled_from(DTYPES))
  count = draw(st.integers(1, 5))
  values = np.asarray(
    draw(
      st.lists(
        st.one_of(st.floats(-1e4, 1e4), st.sampled_from(SPECIALS)),
        min_size=count * SIZE,
        max_size=count * SIZE,
      )
    ),
    np.float64,
  )
  with np.errstate(over="ignore"):
    values = values.astype(np.float32).reshape(count, 2, SIZE // 2)
    return [jnp.asarray(v, dtype) for v in values]


_one_pass = jax.jit(
  lambda leaves: _finite.code_of(*_reductions._one_pass(leaves))
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True)
@given(same_shape_leaves())
def test_leaves_read_together_match_the_elementwise_definition(leaves):
  """The CPU form: the largest magnitude over a group of leaves of one
  shape, read as integers and compared with inf's, in one reduction; and
  the per-leaf form, which reads such a group in one reduction too."""
  assert int(_one_pass(leaves)) == elementwise_code(leaves)
  verdict = _check_per_leaf(leaves)
  assert int(verdict.code) == elementwise_code(leaves)
  assert [bool(c) for c in verdict.leaf_notfinite] == [
    not elementwise_finite(x) for x in leaves
  ]


@pytest.mark.parametrize(
  "size, per",
  [
    (5, _reductions.LEAVES_PER_CONCATENATION),  # small leaves: stacked
    (_reductions.SMALL_BELOW, _reductions.LEAVES_PER_REDUCTION),  # large
  ],
)
def test_every_leaf_of_every_per_leaf_group_counts(size, per):
  """The per-leaf form reads leaves of one shape together, in groups (small
  ones stacked, large ones in one reduction), and puts their verdicts back
  in leaf order; a non-finite value in any leaf of any group is that
  leaf's alone, wherever leaves of other kinds sit between them."""
  count = 2 * per + 3
  tree = [jnp.ones(size)] * count
  for i in (1, per + 1, count):  # leaves of another kind in between
    tree.insert(i, jnp.ones((2, 3), jnp.float16))
  verdict = _check_per_leaf(tree)
  assert bool(verdict.finite) and not any(map(bool, verdict.leaf_notfinite))
  for bad in sorted({0, 1, per - 1, per, per + 1, count, len(tree) - 1}):
    for special in (np.nan, np.inf, -np.inf):
      broken = list(tree)
      broken[bad] = (
        tree[bad].ravel().at[-1].set(special).reshape(tree[bad].shape)
      )
      verdict = _check_per_leaf(broken)
      notfinite = [bool(c) for c in verdict.leaf_notfinite]
      assert notfinite == [i == bad for i in range(len(tree))], (bad, special)
      assert bool(verdict.nan) == np.isnan(special)


def test_every_group_of_large_leaves_of_one_shape_counts_on_cpu():
  """Leaves of one shape are read together, in groups of up to
  `ELEMENTS_PER_GROUP` elements; a non-finite value in any leaf of any group
  counts."""
  check = jax.jit(ols.all_finite)
  small = _reductions.SMALL_BELOW  # the smallest leaf not concatenated
  per_group = _reductions.ELEMENTS_PER_GROUP // small
  for size, count in (
    (small, 3),
    (small, per_group + 1),
    (_reductions.ELEMENTS_PER_GROUP // 4, 10),
  ):
    tree = [jnp.ones(size)] * count + [jnp.ones((3, 5), jnp.float16)]
    assert bool(check(tree))
    for bad in sorted({0, 1, count // 2, count - 2, count - 1}):
      for special in (np.nan, np.inf, -np.inf):
        broken = list(tree)
        broken[bad] = tree[bad].at[size - 1 - bad].set(special)
        assert not bool(check(broken)), (size, count, bad, special)


def _lowered_ops(platform: str, per_leaf: bool = False):
  # Twenty float32 leaves of one shape and one of another, large enough not
  # to be concatenated on CPU, and a small float16 leaf (but larger than
  # the number of leaves, see `_gradient_elements_read`).
  tree = {
    "a": [jnp.ones(4096)] * 20,
    "b": jnp.ones((64, 64)),
    "c": jnp.ones(100, jnp.float16),
  }
  check = jax.jit(lambda tree: _finite.check(tree, per_leaf).code)
  exported = export.export(check, platforms=[platform])
  return tree, _hlo.mlir_ops(exported(tree).mlir_module())


def _float_elements(tree):
  return sum(
    x.size
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(x.dtype, jnp.floating)
  )


def _gradient_elements_read(ops, leaves):
  """The elements that the reductions over gradients read: the inputs of
  every reduction larger than the combination of the leaves' verdicts (a
  vector of at most one flag per leaf). Boolean inputs come in pairs (is
  every element finite, is any NaN) of one array's elements."""
  read = 0
  for op in ops:
    if op.name != "reduce":
      continue
    inputs = op.tensors[: (len(op.tensors) - op.results) // 2]
    sizes = [int(np.prod(dims, dtype=int)) for _, dims in inputs]
    if all(dtype == "i1" for dtype, _ in inputs):
      sizes = sizes[::2]
    read += sum(size for size in sizes if size > leaves)
  return read


@pytest.mark.cpu_check_form  # the CPU compiled program, as CPU users run it
@pytest.mark.parametrize("per_leaf", [False, True])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_each_lowering_holds_one_form_that_reads_each_element_once(
  platform, per_leaf
):
  """The form is chosen when lowering for a platform. Whatever the form,
  the reductions together read no gradient element
  twice (one pass), and on CPU no float data is concatenated (a copy of
  the gradients there)."""
  tree, ops = _lowered_ops(platform, per_leaf)
  read = _gradient_elements_read(ops, len(jax.tree.leaves(tree)))
  if per_leaf or platform != "cpu":
    assert read == _float_elements(tree)
  else:  # a group's element-wise maximum is reduced, once
    assert read <= _float_elements(tree)
  if platform == "cpu":
    concatenated = [op.tensors[-1] for op in ops if op.name == "concatenate"]
    assert all(dtype in ("i1", "i8", "i32") for dtype, _ in concatenated), (
      concatenated
    )


SCALES = (2.0**-20, 0.3, 0.5, 1.0, 3.0, 2.0**15, 2.0**127)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True)
@given(trees(), st.sampled_from(SCALES), st.booleans())
def test_unscaled_check_matches_the_elementwise_definition(
  grads, scale, float32_params
):
  """Scales below 1 can overflow a finite gradient when unscaling; the
  verdict must see it, in the dtype the unscaled gradient will have."""
  dynamic = _config.make_config(
    True,
    scale,
    None,
    growth_factor=2.0,
    backoff_factor=0.5,
    min_scale=min(scale, 1.0),
    max_scale=None,
    hysteresis=1,
    axis_name=None,
  )
  params = jax.tree.map(
    lambda g: jnp.zeros(g.shape, jnp.float32 if float32_params else g.dtype),
    grads,
  )
  state = _state.init_loss_scale_state(dynamic.initial_scale, True)
  unscaled, finite, _ = _check(grads, state, params, dynamic)
  assert bool(finite) == elementwise_finite(unscaled)


@functools.partial(jax.jit, static_argnums=3)
def _check(grads, state, params, config):
  return _unscale.unscale_check_adjust(grads, state, config, params)


def test_complex_leaves_check_each_part():
  big = jnp.asarray([3e38 + 3e38j], jnp.complex64)  # |z| overflows, parts not
  assert bool(ols.all_finite(big))
  assert not bool(ols.all_finite(jnp.asarray([1 + 1j * np.inf], jnp.complex64)))
  assert not bool(ols.all_finite(jnp.asarray([np.nan + 0j], jnp.complex64)))


def test_integer_and_empty_leaves_are_finite():
  assert bool(
    ols.all_finite(
      {"i": jnp.arange(3), "e": jnp.zeros((0, 4)), "b": jnp.ones(2, jnp.bool_)}
    )
  )


@pytest.mark.slow
def test_nan_in_a_large_leaf_is_found_wherever_it_is():
  # XLA's vectorized float max on CPU drops NaNs in large arrays (a NaN in a
  # 4099-element float32 leaf gave max 1.0); the check must not.
  alone = _reductions.SMALL_BELOW  # smaller leaves are checked together
  for dtype in DTYPES:
    for size in (alone - 1, alone, alone + 3, 1_000_003):
      for position in (0, 7, size // 2, size - 1):
        for special in (np.nan, np.inf, -np.inf):
          leaf = jnp.ones(size, dtype).at[position].set(special)
          assert not bool(jax.jit(ols.all_finite)({"w": leaf})), (
            dtype,
            size,
            position,
            special,
          )
          assert not bool(
            jax.jit(ols.all_finite)(
              {
                "v": jnp.ones(5, dtype),
                "w": leaf,
                "x": jnp.ones(3, jnp.float32),
              }
            )
          ), (dtype, size, position, special)
          assert int(
            _concatenated(
              {
                "v": jnp.ones(5, dtype),
                "w": leaf,
                "x": jnp.ones(3, jnp.float32),
              }
            )
          ) == elementwise_code(leaf), (dtype, size, position, special)


def test_transposed_and_multi_dimensional_leaves_are_checked_whole():
  """A weight gradient is often a transposed matmul output; the check reads
  it in any layout."""
  rng = np.random.default_rng(0)
  check = jax.jit(lambda a, b: ols.all_finite({"t": (a @ b).T, "m": a}))
  a = jnp.asarray(rng.standard_normal((256, 300)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((300, 128)), jnp.float32)
  assert bool(check(a, b))
  for i, j in ((0, 0), (255, 299), (17, 123)):
    for special in (np.nan, np.inf):
      assert not bool(check(a.at[i, j].set(special), b)), (i, j, special)
      assert not bool(check(a, b.at[j, i % 128].set(special))), (i, j, special)


@pytest.mark.cpu_check_form  # the CPU compiled program, as CPU users run it
def test_many_small_leaves_are_checked_together_on_cpu():
  """Small leaves are concatenated by dtype and checked in one pass; a
  non-finite value in any of them counts."""
  n = 300
  tree = {
    f"l{i}": jnp.ones((i % 7 + 1, 3), (jnp.float32, jnp.float16)[i % 2])
    for i in range(n)
  }
  check = jax.jit(ols.all_finite)
  assert bool(check(tree))
  for i in (0, 1, n // 2, n - 1):
    for special in (np.nan, np.inf, -np.inf):
      bad = dict(tree, **{f"l{i}": tree[f"l{i}"].at[-1, -1].set(special)})
      assert not bool(check(bad)), (i, special)
  opcodes = _hlo.hlo_opcodes(check.lower(tree).compile())
  assert opcodes["reduce"] >= 1 and opcodes["reduce-window"] == 0


@pytest.mark.cpu_check_form  # the CPU compiled program, as CPU users run it
@pytest.mark.parametrize("per_leaf", [False, True])
def test_large_leaves_are_checked_in_one_pass_without_a_copy(per_leaf):
  """No tree of reduce-windows and no byte-per-element temporary: the
  compiled check of a large leaf, of a group of leaves of one shape, or of
  transposed matmul gradients, reads them where they are."""
  a = jnp.ones((256, 300))
  b = jnp.ones((300, 128))
  check = jax.jit(
    lambda tree, a, b: (
      _finite.check({**tree, "t": [(a @ b).T, (b.T @ a.T)]}, per_leaf).code
    )
  )
  for tree in (
    {"w": jnp.ones((512, 512), jnp.float32)},
    {"g": [jnp.ones((256, 256), jnp.float16)] * 8},
  ):
    compiled = check.lower(tree, a, b).compile()
    opcodes = _hlo.hlo_opcodes(compiled)
    assert opcodes["reduce"] >= 1 and opcodes["reduce-window"] == 0
    assert opcodes["copy"] == 0 and opcodes["transpose"] == 0
    size = sum(x.size for x in jax.tree.leaves(tree))
    products = 2 * 128 * 256 * 4  # the two matmul outputs, in bytes
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < products + size // 100


def test_large_leaves_without_an_exponent_mask_are_checked_alone():
  """Complex leaves are checked part by part; they are never grouped."""
  size = _reductions.SMALL_BELOW
  tree = [jnp.ones(size, jnp.complex64)] * 3 + [jnp.ones(size)] * 3
  check = jax.jit(ols.all_finite)
  assert bool(check(tree))
  for bad in range(6):
    specials = (np.nan, np.inf) + (
      (1j * np.inf, 1 + 1j * np.nan) if bad < 3 else ()
    )
    for special in specials:
      broken = list(tree)
      broken[bad] = tree[bad].at[bad].set(special)
      assert not bool(check(broken)), (bad, special)


def test_nan_in_a_large_leaf_never_reaches_adam():
  import optax

  params = {"w": jnp.zeros(4099, jnp.float32)}
  tx = ols.loss_scale_optimizer(optax.adam(1e-3))
  state = tx.init(params)
  grads = {"w": jnp.ones(4099, jnp.float32).at[7].set(jnp.nan)}
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  assert not bool(ols.skip_stats(new_state).last_finite)
  assert np.isfinite(np.asarray(updates["w"])).all()
  assert np.isfinite(np.asarray(new_state.inner_state[0].mu["w"])).all()


@pytest.mark.filterwarnings("ignore:float16 master weights")
def test_overflow_when_unscaling_below_one_is_caught():
  """A finite float16 gradient divided by a scale below 1 can overflow in
  float16; the verdict is taken on the values passed on."""
  import optax

  tx = ols.loss_scale_optimizer(
    optax.sgd(1e-3), initial_scale=0.51916975, min_scale=2.0**-10
  )
  params = {"w": jnp.zeros(64, jnp.float16)}
  grads = {"w": jnp.full(64, 34020.0, jnp.float16)}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert not bool(ols.skip_stats(state).last_finite)
  np.testing.assert_array_equal(updates["w"], np.zeros(64, np.float16))


def test_a_scale_set_below_one_under_a_floor_of_one_is_skipped_once():
  import optax

  tx = ols.loss_scale_optimizer(optax.sgd(1.0))
  params = {"w": jnp.zeros(2)}
  # `set_loss_scale` refuses a value below the floor: the state's field
  # replaced by hand, as only such a state (or another configuration's)
  # can hold it.
  state = tx.init(params)
  state = state._replace(
    loss_scale_state=state.loss_scale_state._replace(
      loss_scale=jnp.float32(0.25)
    )
  )
  grads = {"w": jnp.array([1.0, 2.0])}
  update = jax.jit(tx.update)
  _, state = update(grads, state, params)
  assert not bool(ols.skip_stats(state).last_finite)
  assert float(ols.loss_scale(state)) == 1.0  # backed off to min_scale
  _, state = update(grads, state, params)
  assert bool(ols.skip_stats(state).last_finite)


def _enable_x64(on: bool):
  # `jax.enable_x64` in newer jax, `jax.experimental.enable_x64` in older.
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(on)
  from jax.experimental import enable_x64

  return enable_x64(on)


def test_float64_leaves_are_checked_by_their_own_exponent():
  """1e300 is finite in float64 (its exponent is not all ones)."""
  with _enable_x64(True):
    size = _reductions.SMALL_BELOW
    tree = [jnp.ones(size, jnp.float64).at[1].set(1e300)] * 3
    check = jax.jit(ols.all_finite)
    assert bool(check(tree))
    for special in (np.nan, np.inf, -np.inf):
      assert not bool(check([*tree[:2], tree[2].at[size - 1].set(special)]))


def test_the_same_complex_array_twice():
  # Leaves without an exponent mask are grouped by position: one array
  # passed twice is two leaves (grouping by `id` put both in one group).
  c = jnp.ones(4096, jnp.complex64)
  assert bool(ols.all_finite([c, c]))
  assert not bool(ols.all_finite([c, c.at[7].set(jnp.nan)]))


def _lowered_op_kinds(platform):
  """The kinds of the StableHLO operations of the check of a tree of large
  and small leaves, lowered for `platform`, and how many of each (but
  constants: the choice of a form adds one)."""
  tree = {"a": [jnp.ones(4096)] * 3, "b": jnp.ones(7, jnp.float16)}
  exported = export.export(jax.jit(ols.all_finite), platforms=[platform])
  ops = _hlo.mlir_ops(exported(tree).mlir_module())
  return collections.Counter(op.name for op in ops if op.name != "constant")


def test_the_suite_runs_the_check_that_accelerators_run():
  # tests/conftest.py lowers, for CPU, the form that GPU and TPU run, in
  # every test not marked `cpu_check_form`.
  assert _lowered_op_kinds("cpu") == _lowered_op_kinds("cuda")


@pytest.mark.cpu_check_form
def test_a_marked_test_runs_the_cpu_form():
  assert _lowered_op_kinds("cpu") != _lowered_op_kinds("cuda")
