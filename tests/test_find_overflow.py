"""`find_overflow`: the first inf or NaN of a forward and backward pass,
named by pass, scope, primitive and source line, and each scope's float16
values against float16's edges.

The functions here use powers of two, so that every float16 value, the
headroom and the underflow counts are exact.
"""

import importlib.util
import inspect
import os
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_lossscale as ols
from optax_lossscale._diagnostics.finder import chunks as _chunks
from optax_lossscale._diagnostics.finder import compile as _compile

ROOT = pathlib.Path(__file__).resolve().parents[1]
F16 = jnp.float16


def attention_logits(w, x):
  with jax.named_scope("attention"):
    q = x @ w.astype(F16)
    logits = q @ q.T  # beyond 65504 when w is large
  return jnp.mean(logits.astype(jnp.float32))


def head_loss(w, x):
  with jax.named_scope("head"):
    y = (x @ w.astype(F16)).astype(jnp.float32)
  return jnp.sum(y) * 2.0**17  # the cotangent of y is 2**17: no float16


def layered(w, x):
  with jax.named_scope("layer"):
    h = x.astype(F16) * w.astype(F16)  # 2**6 * 2**4 = 2**10
  return jnp.sum(h.astype(jnp.float32))


W4 = jnp.full((4,), 2.0**4)
X6 = jnp.full((4,), 2.0**6)


def test_a_forward_overflow_is_named_by_scope_primitive_and_line():
  x = jnp.ones((4, 8), F16)
  report = ols.find_overflow(attention_logits, jnp.full((8, 8), 16.0), x)
  assert report
  first = report.first
  assert first.pass_name == "forward"
  assert first.scope == "attention"
  assert first.primitive == "dot_general"
  assert (first.dtype, first.shape) == ("float16", (4, 4))
  assert (first.inf, first.nan, first.size) == (16, 0, 16)  # 8 * 128**2
  assert first.code == "logits = q @ q.T  # beyond 65504 when w is large"
  assert first.source.startswith("tests/test_find_overflow.py:")
  assert first.source.endswith("(attention_logits)")
  assert first.call_path == ("attention_logits",)
  assert first.boundary is None
  assert first.cause == "range"  # finite in float32
  text = str(report)
  assert text.startswith(
    "Overflow in the forward pass (loss scale 1): beyond float16's range."
  )
  assert "scope      attention" in text
  assert "dot_general -> float16[4,4]: 16 inf of 16 values" in text


def test_a_cotangent_beyond_float16_is_found_in_the_backward_pass():
  x = jnp.ones((2, 4), F16)
  report = ols.find_overflow(head_loss, jnp.full((4, 3), 0.25), x)
  first = report.first
  assert first.pass_name == "backward"
  assert first.scope == "head"
  assert first.primitive == "convert_element_type"  # float32 -> float16
  assert (first.dtype, first.inf, first.size) == ("float16", 6, 6)
  assert first.code.startswith("y = (x @ w.astype(F16)).astype(jnp.float32)")
  assert str(report).startswith("Overflow in the backward pass")


def test_a_healthy_function_reports_nothing():
  report = ols.find_overflow(layered, W4, X6)
  assert not report
  assert report.first is None and report.nonfinite_operations == 0
  assert report.loss == 4 * 2.0**10
  text = str(report)
  assert text.startswith("No overflow: the loss and every gradient are finite")
  assert "Float16 values of the forward pass, per scope:" in text
  assert all(len(line) <= 79 for line in text.splitlines())


def test_headroom_per_scope_is_exact():
  report = ols.find_overflow(layered, W4, X6)
  by_scope = {(s.pass_name, s.scope): s for s in report.scopes}
  assert list(by_scope) == [
    ("forward", "layer"),
    ("backward", "(layered)"),
    ("backward", "layer"),
  ]
  forward = by_scope["forward", "layer"]  # x, w and their product
  assert (forward.values, forward.largest, forward.smallest) == (12, 2**10, 16)
  assert forward.doublings == 5  # 2**15 < 65504 < 2**16
  assert forward.halvings == 28  # 2**4 / 2**28 = 2**-24
  assert (forward.flushed, forward.flush_checked, forward.nonfinite) == (
    0,
    12,
    0,
  )
  seed = by_scope["backward", "(layered)"]  # the cotangent 1, in float16
  assert (seed.values, seed.largest, seed.doublings) == (4, 1, 15)
  grad = by_scope["backward", "layer"]  # d(loss)/dw = x = 2**6
  assert (grad.values, grad.largest, grad.doublings) == (4, 64, 9)
  assert "cotangent (a backward value computed from the scale) is 64: 9" in (
    " ".join(str(report).split())
  )


def test_flushed_counts_values_that_float16_rounds_to_zero():
  w = jnp.full((4,), 2.0**-13)
  x = jnp.full((4,), 2.0**-13)  # the product 2**-26 rounds to 0
  stats = ols.find_overflow(layered, w, x).scopes[0]
  assert (stats.pass_name, stats.scope) == ("forward", "layer")
  assert (stats.flushed, stats.flush_checked) == (4, 12)
  assert stats.flushed_share == 1 / 3
  assert stats.smallest == 2.0**-13 and stats.halvings == 11


def test_an_overflow_at_the_scale_only_is_found_at_that_scale():
  # At scale 1, d(loss)/dw = 2**6 may double 9 times: 2**15 fits, 2**16 not.
  assert not ols.find_overflow(layered, W4, X6, scale=2.0**9)
  report = ols.find_overflow(layered, W4, X6, scale=2.0**10)
  assert report.scale == 2.0**10
  first = report.first
  assert (first.pass_name, first.scope, first.primitive) == (
    "backward",
    "layer",
    "mul",
  )
  assert "(loss scale 2**10 (1024))" in str(report)


def test_scale_takes_an_optimizer_state():
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**10)
  report = ols.find_overflow(layered, W4, X6, scale=tx.init(W4))
  assert report.scale == 2.0**10 and report.first.pass_name == "backward"


def test_an_input_that_is_not_finite_is_named():
  x = X6.at[1].set(jnp.nan)
  report = ols.find_overflow(layered, W4, x)
  first = report.first
  assert (first.pass_name, first.primitive, first.nan) == (
    "input",
    "x",
    1,
  )
  assert str(report).startswith("Not finite from the start: the input `x`")


def test_bfloat16_and_float32_are_checked_for_nan_and_inf_only():
  def in_bfloat16(w, x):
    return jnp.sum(jnp.log(x.astype(jnp.bfloat16) * w.astype(jnp.bfloat16)))

  report = ols.find_overflow(in_bfloat16, -W4, X6)
  assert (report.first.dtype, report.first.primitive) == ("bfloat16", "log")
  assert report.first.nan == 4
  assert report.scopes == ()  # the table is float16's
  assert "No float16 values" in str(report)

  def in_float32(w, x):
    return jnp.sum(jnp.exp(w * x))  # e**1024: beyond float32

  first = ols.find_overflow(in_float32, W4, X6).first
  assert (first.dtype, first.primitive, first.inf) == ("float32", "exp", 4)


def test_an_inf_written_in_the_code_is_not_an_overflow():
  def masked(w, x, amplify):
    logits = x.astype(F16) * w.astype(F16)  # 2**10
    logits = jnp.where(jnp.arange(4) < 2, logits, -jnp.inf)  # a mask
    weights = jax.nn.softmax(logits)  # 1/2, 1/2, 0, 0
    weights = weights * F16(2**9) * F16(amplify)
    return jnp.sum(weights.astype(jnp.float32))

  report = ols.find_overflow(masked, W4, X6, 1)
  assert not report and report.nonfinite_operations > 0
  assert "Masks (infs the program writes" in str(report)
  # `jnp.where` is a `jit` whose body is handed the `-inf`: the mask is
  # the number written on the `where`'s line all the same.
  assert report.masks == (
    f"-inf written in the code at {_at(masked, 'jnp.where(')}",
  )
  # An overflow after the mask is still found: 2**8 * 2**8 = 2**16.
  first = ols.find_overflow(masked, W4, X6, 2**8).first
  assert (first.primitive, first.inf) == ("mul", 2)
  assert first.code == "weights = weights * F16(2**9) * F16(amplify)"


MINUS_INF = jnp.array(-jnp.inf, F16)
CAUSAL = jnp.array([0.0, 0.0, -jnp.inf, -jnp.inf], F16)


@pytest.mark.parametrize("how", ["where", "add"])
def test_a_minus_inf_array_a_jit_closes_over_is_a_mask(how):
  @jax.jit
  def mask(logits):  # the array is a constant of this jit's body
    if how == "where":  # passed on into `jnp.where`'s own `jit`
      return jnp.where(jnp.arange(4) < 2, logits, MINUS_INF)
    return logits + CAUSAL

  def masked(w, x, amplify):
    logits = mask(x.astype(F16) * w.astype(F16))  # 2**10, 2**10, -inf, -inf
    weights = jax.nn.softmax(logits)  # 1/2, 1/2, 0, 0
    weights = weights * F16(2**9) * F16(amplify)
    return jnp.sum(weights.astype(jnp.float32))

  report = ols.find_overflow(masked, W4, X6, 1)
  assert not report and report.nonfinite_operations > 0
  used = "jnp.where(" if how == "where" else "logits + CAUSAL"
  assert report.masks == (
    f"an array the code closes over, used at {_at(mask, used)}",
  )
  # An overflow after the mask is still found: 2**8 * 2**8 = 2**16.
  first = ols.find_overflow(masked, W4, X6, 2**8).first
  assert (first.primitive, first.inf) == ("mul", 2)
  assert first.code == "weights = weights * F16(2**9) * F16(amplify)"


def test_each_where_is_named_at_its_own_line():
  # Both `jnp.where`s are calls of one `jit` with the same argument types:
  # a jax that traces its body once (jax 0.7.1) hands the second call the
  # body traced at the first. Each mask is named where its call is.
  def first(w, x):
    logits = jnp.where(jnp.arange(4) < 2, x.astype(F16) * w.astype(F16), -1e9)
    return jnp.sum(jax.nn.softmax(logits).astype(jnp.float32))

  def second(w, x):
    logits = x.astype(F16) * w.astype(F16)
    logits = jnp.where(jnp.arange(4) < 2, logits, -jnp.inf)  # a mask
    return jnp.sum(jax.nn.softmax(logits).astype(jnp.float32))

  (cast,) = ols.find_overflow(first, W4, X6).masks  # -1e9: -inf in float16
  assert cast == (
    f"a cast to float16 of a value beyond its range at {_at(first, 'where')}"
  )
  assert ols.find_overflow(second, W4, X6).masks == (
    f"-inf written in the code at {_at(second, 'jnp.where(')}",
  )


def test_a_jit_called_from_two_functions_is_named_in_the_one_that_overflows():
  @jax.jit
  def amplify(h):
    return h * F16(2**7)

  def once(w, x):
    return jnp.sum(amplify(x.astype(F16) * w.astype(F16)).astype(jnp.float32))

  def thrice(w, x):
    h = amplify(x.astype(F16) * w.astype(F16) * F16(2**-10))  # 2**7
    return jnp.sum(amplify(amplify(h)).astype(jnp.float32))  # 2**21

  assert not ols.find_overflow(once, W4 * 2**-10, X6)  # amplify traced here
  first = ols.find_overflow(thrice, W4, X6).first
  assert (first.primitive, first.code) == ("mul", "return h * F16(2**7)")
  assert first.source == _at(amplify, "return h")
  # The call path is in `thrice` (jax 0.10.2 on: it starts in the body).
  names = {fn.__qualname__ for fn in (thrice, inspect.unwrap(amplify))}
  assert first.call_path[-1] == inspect.unwrap(amplify).__qualname__
  assert set(first.call_path) <= names, first.call_path


def _at(fun, text):
  """`file:line (function)` of the line of `fun` that holds `text`, as the
  report writes it."""
  fun = inspect.unwrap(fun)  # a `jax.jit`'s function
  lines, start = inspect.getsourcelines(fun)
  (offset,) = [i for i, line in enumerate(lines) if text in line]
  file = os.path.relpath(inspect.getsourcefile(fun))
  return f"{file}:{start + offset} ({fun.__qualname__})"


# ------------------------------------------------------------ control flow


def test_remat_and_custom_vjp_are_entered():
  def rematted(w, x):
    h = x.astype(F16) * w.astype(F16) * F16(2**-3)  # 2**7
    h = jax.checkpoint(lambda h: h * h)(h)  # 2**14
    return jnp.sum(h.astype(jnp.float32))

  assert not ols.find_overflow(rematted, W4, X6)
  # In the backward pass, the rematerialized body computes the cotangent
  # 2**9 * 2**7: inf.
  first = ols.find_overflow(rematted, W4, X6, scale=2.0**9).first
  assert (first.primitive, first.boundary, first.pass_name) == (
    "mul",
    None,
    "backward",
  )
  assert first.code == "h = jax.checkpoint(lambda h: h * h)(h)  # 2**14"

  @jax.custom_vjp
  def amplify_grad(h):
    return h

  amplify_grad.defvjp(
    lambda h: (h, None),
    lambda _, g: (g * F16(2**12),),  # 2**4 * 2**12 = 2**16: inf
  )

  def custom_backward(w, x):
    h = amplify_grad(x.astype(F16) * w.astype(F16)) * F16(2**4)
    return jnp.sum(h.astype(jnp.float32))

  # The backward rule runs in the backward pass, named by the line that
  # calls the function (jax names its operations so).
  first = ols.find_overflow(custom_backward, W4, X6).first
  assert (first.primitive, first.boundary, first.pass_name) == (
    "mul",
    None,
    "backward",
  )
  assert first.custom_rule == "amplify_grad" and first.depends_on_scale
  assert first.code.startswith("h = amplify_grad(x.astype(F16)")

  @jax.custom_vjp
  def square(h):
    return h * h  # 2**20 in float16: inf

  square.defvjp(lambda h: (h * h, h), lambda h, g: (2 * h * g,))

  def custom_forward(w, x):  # x is not differentiated: the call stays whole
    return jnp.sum(w * square(x.astype(F16) * F16(2**4)).astype(jnp.float32))

  first = ols.find_overflow(custom_forward, W4, X6).first
  assert (first.primitive, first.boundary, first.pass_name) == (
    "mul",
    None,
    "forward",
  )
  assert first.code == "return h * h  # 2**20 in float16: inf"


def test_scan_cond_and_while_are_boundaries():
  def scanned(w, x):
    h = x.astype(F16) * w.astype(F16)
    h, _ = jax.lax.scan(lambda c, _: (c * c, None), h, None, length=2)
    return jnp.sum(h.astype(jnp.float32))  # (2**10)**4 in float16: inf

  def branched(w, x):
    h = x.astype(F16) * w.astype(F16)
    h = jax.lax.cond(h[0] > 0, lambda h: h * h, lambda h: h, h)
    return jnp.sum(h.astype(jnp.float32))

  def looped(w, x):  # 2**6 * 4**5 = 2**16 in float16: inf
    x = jax.lax.while_loop(lambda x: x[0] < 2**15, lambda x: x * 4, x)
    return jnp.sum(w * x.astype(jnp.float32))

  for fun, primitive in [
    (scanned, "scan"),
    (branched, "cond"),
    (looped, "while"),
  ]:
    x = X6.astype(F16) if fun is looped else X6
    report = ols.find_overflow(fun, W4, x)
    assert (report.first.primitive, report.first.boundary) == (
      primitive,
      primitive,
    )
    text = " ".join(str(report).split())
    assert f"a `{primitive}`, whose body the finder does not enter" in text


# -------------------------------------------------------------- frameworks


def _example(name):
  spec = importlib.util.spec_from_file_location(
    name, ROOT / "examples" / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_nnx_example_is_located_to_its_module():
  example = _example("nnx_mlp_fp16")
  model = example.MLP(8, 16, rngs=nnx.Rngs(0, dropout=1))
  # Activations of about 2**8 into a last layer scaled by 2**10.
  model.norm.scale[...] = model.norm.scale[...] * 2.0**8
  model.out.kernel[...] = model.out.kernel[...] * 2.0**10
  before = _snapshot(nnx.state(model))
  x, y = example.make_data(16, 8)
  # The example's float32 model computes in float16 under autocast.
  first = ols.find_overflow(ols.autocast(example.loss_fn), model, x, y).first
  assert (first.pass_name, first.primitive) == ("forward", "dot_general")
  assert first.code == "return self.out(h)"
  assert first.call_path[-2:] == ("MLP.__call__", "Linear.__call__")
  # The model is not changed (its Dropout's RNG count included).
  jax.tree.map(
    np.testing.assert_array_equal, before, _snapshot(nnx.state(model))
  )


def _snapshot(tree):
  def copy(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    return np.array(leaf)

  return [copy(leaf) for leaf in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_linen_example_is_located_to_its_module_path():
  example = _example("linen_trainstate_fp16")
  model = example.Classifier()
  x, labels = example.make_data(16, 8, 4)
  variables = model.init(jax.random.key(0), x[:2], train=False)

  def loss_fn(params, batch_stats, x, labels):
    logits, _ = model.apply(
      {"params": params, "batch_stats": batch_stats},
      x,
      train=True,
      mutable=["batch_stats"],
    )
    return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels
    ).mean()

  params = jax.tree_util.tree_map_with_path(
    lambda path, p: p * 2.0**20 if "Dense_1" in str(path) else p,
    variables["params"],
  )
  report = ols.find_overflow(
    ols.autocast(loss_fn), params, variables["batch_stats"], x, labels
  )
  first = report.first
  assert (first.pass_name, first.scope) == ("forward", "Classifier/Dense_1")
  assert first.call_path[-2:] == ("Classifier.__call__", "Dense.__call__")
  scopes = {s.scope for s in report.scopes}
  assert {"Classifier/Dense_0", "Classifier/Dense_1"} <= scopes


@pytest.mark.slow
def test_equinox_example_is_located_to_its_module():
  example = _example("equinox_mlp_fp16")
  model = example.MLP(8, 16, jax.random.key(0))
  model = eqx.tree_at(
    lambda m: m.layers[2].weight, model, model.layers[2].weight * 2.0**14
  )
  x = jax.random.normal(jax.random.key(1), (16, 8))
  report = ols.find_overflow(
    ols.autocast(example.loss_fn), model, x, jnp.zeros((16, 1))
  )
  first = report.first  # the cotangent of the last layer's input
  assert (first.pass_name, first.primitive) == ("backward", "dot_general")
  assert first.scope == "eqx.nn.Linear"  # Equinox's own name scope
  assert first.code == "return self.layers[-1](x)"
  assert first.call_path[-2:] == ("MLP.__call__", "Linear.__call__")


# ------------------------------------------------------------------ errors


def test_a_loss_that_is_not_a_scalar_is_refused():
  with pytest.raises(ValueError, match=r"scalar loss .* shape \(4,\)"):
    ols.find_overflow(lambda w: w * 2, W4)
  with pytest.raises(TypeError, match="the loss alone"):
    ols.find_overflow(lambda w: (jnp.sum(w), w), W4)
  with pytest.raises(TypeError, match="floating-point loss"):
    ols.find_overflow(lambda w, n: jnp.sum(n), W4, jnp.arange(3))


def test_a_first_argument_without_floating_point_arrays_is_refused():
  with pytest.raises(TypeError, match="an array of dtype int32"):
    ols.find_overflow(lambda n: jnp.sum(n) * 1.0, jnp.arange(3))
  with pytest.raises(TypeError, match="floating-point arrays"):
    ols.find_overflow(lambda p: 1.0, {"n": 3})


def test_bad_fun_and_scale_are_refused():
  with pytest.raises(TypeError, match="callable"):
    ols.find_overflow("loss", W4)
  with pytest.raises(TypeError, match="arguments"):
    ols.find_overflow(layered)
  for scale in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="positive"):
      ols.find_overflow(layered, W4, X6, scale=scale)
  with pytest.raises(TypeError, match="`scale`"):
    ols.find_overflow(layered, W4, X6, scale=optax.sgd(0.1).init(W4))


# ------------------------------------------------------- report and device


def test_no_host_callback(monkeypatch):
  programs = []
  compile_for_one_run = _compile.compile_for_one_run

  def spy(lowered, elements):
    programs.append(lowered.as_text())
    return compile_for_one_run(lowered, elements)

  monkeypatch.setattr(_chunks, "compile_for_one_run", spy)
  assert ols.find_overflow(layered, W4, X6, scale=2.0**10)
  assert programs  # the chunks' programs, forward and backward
  assert not any("callback" in program.lower() for program in programs)


def test_the_report_displays_in_a_notebook():
  report = ols.find_overflow(layered, W4, X6, scale=2.0**10)

  assert report._repr_html_().startswith("<pre>Overflow in the backward")
  assert "&gt;" in report._repr_html_()  # mul -> float16: escaped
  printed = []

  class Printer:  # IPython's pretty printer, as much as the report uses
    def text(self, s):
      printed.append(s)

  report._repr_pretty_(Printer(), cycle=False)
  assert printed == [str(report)]


def test_static_arguments_pass_as_they_are():
  def loss(w, x, double):
    return jnp.sum(w * x) * (2.0 if double else 1.0)

  assert ols.find_overflow(loss, W4, X6, True).loss == 2 * 4 * 2.0**10


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU options")
def test_compile_options_a_jaxlib_lacks_are_left_out():
  options = []

  class Lowered:
    def compile(self, compiler_options=None):
      options.append(dict(compiler_options or {}))
      if "xla_cpu_use_fusion_emitters" in options[-1]:  # as jax 0.12 does
        raise ValueError(
          "No such compile option: 'xla_cpu_use_fusion_emitters'"
        )
      return "compiled"

  one_module = {"xla_cpu_parallel_codegen_split_count": 1}
  assert _compile.compile_for_one_run(Lowered(), 1000) == "compiled"
  assert options == [
    {
      "xla_cpu_use_fusion_emitters": False,
      "xla_backend_optimization_level": 0,
      **one_module,
    },
    {"xla_backend_optimization_level": 0, **one_module},
  ]
  options.clear()  # chunks that read much: faster code, a longer compile
  assert _compile.compile_for_one_run(Lowered(), 2**28) == "compiled"
  assert options[-1] == one_module  # the emitters' option left out
