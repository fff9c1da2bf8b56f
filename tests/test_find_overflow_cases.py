"""`find_overflow` names the first harmful overflow, in the pass it belongs
to: masks, discarded values, derivatives computed in the forward trace,
gathers, non-finite losses, frameworks, `jax.checkpoint`, the loss scaling,
bad arguments, the text, and the program's memory.

Values are powers of two where the arithmetic must be exact.
"""

import functools
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import load_file
from flax import nnx

import optax_lossscale as ols

F16 = jnp.float16
F32 = jnp.float32
K_MASK = -2.3819763e38  # finite in float32, -inf in float16
W4 = jnp.full((4,), 2.0**4)
X6 = jnp.full((4,), 2.0**6)


def flat(report):
  return " ".join(str(report).split())


# ------------------------------------------------------------------- masks


def test_a_finite_mask_constant_inside_jit_is_a_mask():
  @jax.jit
  def mask(logits):  # the constant becomes -inf once in float16
    return jnp.where(jnp.arange(4) < 2, logits, K_MASK)

  def attention(w, x, amplify):
    logits = mask(x.astype(F16) * w.astype(F16) * F16(2**-6))  # 16
    weights = jax.nn.softmax(logits) * F16(2**9) * F16(amplify)  # 1/2, 0
    return jnp.sum(weights.astype(F32))

  report = ols.find_overflow(attention, W4, X6, 1.0)
  assert not report, str(report)
  assert report.masks
  assert "Masks (infs the program writes" in str(report)
  # A real overflow after the mask is still named: 2**-1 * 2**9 * 2**8.
  first = ols.find_overflow(attention, W4, X6, 2.0**8).first
  assert (first.pass_name, first.primitive) == ("forward", "mul")
  assert first.code.startswith("weights = jax.nn.softmax(logits)")


def test_a_mask_cast_from_float32_and_a_constant_closed_over_in_jit():
  bias = jnp.array([0.0, -jnp.inf, 0.0, -jnp.inf])  # closed over in a jit

  @jax.jit
  def biased(logits):
    return logits + bias

  def attention(w, x):
    logits = (x * w).astype(F32) * 2.0**-6
    logits = jnp.where(jnp.arange(4) < 3, logits, K_MASK).astype(F16)
    weights = jax.nn.softmax(biased(logits.astype(F32)).astype(F16))
    return jnp.sum(weights.astype(F32))

  report = ols.find_overflow(attention, W4, X6)
  assert not report, str(report)
  assert len(report.masks) >= 2


def test_a_minus_inf_bias_in_the_batch_does_not_hide_an_exp_overflow():
  def biased(w, bias):
    logits = w.astype(F16) + bias
    return jnp.sum(jnp.exp(logits).astype(F32))

  bias = jnp.array([0.0, -jnp.inf], F16)
  masks = ("bias",)  # an input is a mask where the caller says so
  assert not ols.find_overflow(biased, jnp.array([1.0, 1.0]), bias, masks=masks)
  report = ols.find_overflow(biased, jnp.array([12.0, 1.0]), bias, masks=masks)
  first = report.first  # exp(12) > 65504
  assert (first.pass_name, first.primitive, first.inf) == ("forward", "exp", 1)
  assert report.masks == ("the input `bias`",)


# -------------------------------------------------------------- harmful


def guarded(w, x):
  safe = jnp.where(w > 0, jnp.log(w), 0.0)  # log(-1) = nan, dropped
  h = x.astype(F16) * w.astype(F16)  # d(loss)/dw = x = 2**6
  return jnp.sum(h.astype(F32)) + jnp.sum(safe)


def test_a_value_a_where_discards_is_listed_not_named():
  w = W4.at[0].set(-1.0)
  report = ols.find_overflow(guarded, w, X6)
  assert not report and report.first is None
  (discarded,) = report.discarded
  assert (discarded.primitive, discarded.pass_name) == ("log", "forward")
  assert discarded.cause == "arithmetic"  # log(-1): NaN in float32 too
  assert "Not finite, but changing neither the loss nor the" in flat(report)


def test_a_discarded_value_does_not_hide_a_backward_overflow():
  w = W4.at[0].set(-1.0)
  report = ols.find_overflow(guarded, w, X6, scale=2.0**15)
  first = report.first  # 2**6 * 2**15 = 2**21
  assert (first.pass_name, first.primitive) == ("backward", "mul")
  assert "(loss scale 2**15 (32768))" in str(report)


# ---------------------------------------------------------------- passes


def test_rsqrts_derivative_is_named_as_the_derivative():
  def normed(w, x):
    h = x.astype(F16) * w.astype(F16)
    variance = jnp.mean(h * h)
    return jnp.sum((h * jax.lax.rsqrt(variance + F16(2**-20))).astype(F32))

  report = ols.find_overflow(normed, jnp.full((4,), 2.0**-10), X6 * 2**-6)
  assert np.isfinite(report.loss)
  first = report.first
  assert (first.pass_name, first.derivative_of) == ("backward", "rsqrt")
  assert first.primitive == "rsqrt's derivative"
  assert first.code.startswith("return jnp.sum((h * jax.lax.rsqrt(")
  assert not first.depends_on_scale and not first.recomputed
  assert flat(report).startswith(
    "Overflow in rsqrt's derivative (loss scale 1): beyond float16's range."
    " It is finite in float32. jax computes it in the forward pass for the"
    " backward one; it does not depend on the loss scale"
  )


@pytest.mark.parametrize(
  "loss, w",
  [
    (lambda w: jnp.sum(jnp.sqrt(w)), jnp.zeros(4).at[1].set(1.0)),
    (lambda w: jnp.linalg.norm(w), jnp.zeros(4)),
  ],
  ids=["sqrt", "norm"],
)
def test_sqrts_derivative_at_zero_is_a_derivative(loss, w):
  report = ols.find_overflow(loss, w)
  assert report and np.isfinite(report.loss)
  assert (report.first.pass_name, report.first.derivative_of) == (
    "backward",
    "sqrt",
  )


def test_an_overflow_at_2_24_is_named_backward():
  def layered(w, x):
    with jax.named_scope("layer"):
      h = x.astype(F16) * w.astype(F16)
    return jnp.sum(h.astype(F32))

  report = ols.find_overflow(layered, W4, X6, scale=2.0**24)
  assert report.first.pass_name == "backward"
  assert report.first.derivative_of is None
  assert "(loss scale 2**24 (16777216))" in str(report)


# ---------------------------------------------------------------- gathers


def test_an_out_of_range_take_is_named_as_the_gather():
  def taken(w, index):
    picked = jnp.take(w, index, mode="fill")  # NaN out of range
    return jnp.sum(picked.astype(F16).astype(F32))

  report = ols.find_overflow(taken, W4, jnp.array([0, 7]))
  first = report.first
  assert (first.pass_name, first.primitive, first.nan) == (
    "forward",
    "gather",
    1,
  )


# ------------------------------------------------------- non-finite losses


def test_a_fully_masked_softmax_row_is_never_no_overflow():
  def fully_masked(w, x):
    logits = x.astype(F16) * w.astype(F16) * F16(2**-10)
    logits = jnp.where(jnp.arange(4) < 0, logits, -jnp.inf)
    return jnp.sum(jax.nn.softmax(logits).astype(F32))

  report = ols.find_overflow(fully_masked, W4, X6)
  assert report and np.isnan(report.loss)
  assert report.first.pass_name == "forward"
  assert not str(report).startswith("No overflow")


def test_a_closed_over_statistic_holding_nan_is_named():
  statistic = jnp.array([jnp.nan, 1.0, 1.0, 1.0])

  def normalized(w, x):
    return jnp.sum(w * x / statistic)

  report = ols.find_overflow(normalized, W4, X6)
  assert report and np.isnan(report.loss)
  assert (report.first.pass_name, report.first.nan) == ("constant", 1)
  assert str(report).startswith(
    "Not finite from the start: an array `fun` closes over holds 1 NaN"
  )


def test_a_mask_reaching_the_loss_is_named_where_it_reaches_it():
  def padded(w, targets):  # a target whose logit is masked
    logits = jnp.where(jnp.arange(4) < 3, w, -jnp.inf).astype(F16)
    picked = logits[targets]
    return -jnp.mean(picked.astype(F32))

  report = ols.find_overflow(padded, W4, jnp.array([0, 3]))
  assert report and report.loss == np.inf
  assert report.first.from_mask
  assert report.first.primitive == "gather"  # picks the masked logit
  assert "a mask's inf reaches it" in flat(report)


# -------------------------------------------------------------- frameworks


class Normalized(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.ones(4))
    self.variance = nnx.BatchStat(jnp.full(4, 2.0**-12))  # rsqrt' = 2**17

  def __call__(self, x):
    scale = jax.lax.rsqrt(self.variance[...].astype(F16))
    return x * self.w[...].astype(F16) * scale


def test_nnx_running_statistics_are_not_differentiated():
  def loss(model, x):
    return jnp.sum(model(x).astype(F32))

  report = ols.find_overflow(loss, Normalized(), X6.astype(F16) * 2**-6)
  assert not report, str(report)


def test_equinox_differentiates_its_inexact_arrays():
  class Layer(eqx.Module):
    weight: jax.Array
    count: jax.Array

    def __call__(self, x):
      return x * self.weight.astype(F16) * self.count

  def loss(layer, x):
    return jnp.sum(layer(x).astype(F32))

  layer = Layer(W4, jnp.array(2, jnp.int32))
  report = ols.find_overflow(loss, layer, X6.astype(F16), scale=2.0**9)
  assert report.first.pass_name == "backward"  # 2**6 * 2 * 2**9 = 2**16


# --------------------------------------------------------------- checkpoint


def test_checkpoint_counts_each_value_once_in_its_own_pass():
  def rematted(w, x):
    h = x.astype(F16) * w.astype(F16) * F16(2**-6)  # 2**4
    h = jax.checkpoint(lambda h: h**3)(h)  # its derivative 3 h**2 = 768
    return jnp.sum(h.astype(F32))

  # In the backward pass, the rematerialized body recomputes 3 h**2 = 768
  # (a forward value); the cotangents are that times the scale, 2**-10.
  report = ols.find_overflow(rematted, W4, X6, scale=2.0**-10)
  backward = [s for s in report.scopes if s.pass_name == "backward"]
  largest = max(s.largest for s in backward)
  assert largest < 768
  room = int(np.floor(np.log2(65504 / largest)))
  assert f"is {largest:.4g}: {room} doublings below" in flat(report)


# ------------------------------------------------------------ loss scaling


def test_the_loss_scalings_overflow_is_named_as_such():
  def half_loss(w, x):  # a float16 loss of 4 * 2**10
    return jnp.sum(x.astype(F16) * w.astype(F16))

  # `loss * scale` beyond 65504 changes no gradient: the backward pass
  # starts from the scale itself, 2**5 in float16. It is listed.
  report = ols.find_overflow(half_loss, W4, X6, scale=2.0**5)
  assert not report
  (scaled,) = report.discarded
  assert (scaled.pass_name, scaled.cause, scaled.inf) == (
    "loss scaling",
    "range",
    1,
  )
  # A scale beyond 65504 is an inf in float16: every gradient is.
  report = ols.find_overflow(half_loss, W4, X6, scale=2.0**16)
  assert report.first.pass_name == "loss scaling"
  assert flat(report).startswith(
    "Overflow in the loss scaling (loss scale 2**16 (65536)): beyond"
    " float16's range. The loss's cotangent, the scale in the loss's dtype,"
  )
  assert "Compute the loss in float32, or lower the scale." in flat(report)


# ------------------------------------------------------------ source lines


def test_a_custom_vjp_backward_rule_is_named_by_the_call():
  @jax.custom_vjp
  def clip_gradient(h):
    return h

  def forward(h):
    return h, None

  def backward(_, g):
    g = g * F16(2**2)
    return (g * F16(2**10),)  # 2**4 * 2**12 = 2**16: inf

  clip_gradient.defvjp(forward, backward)

  def loss(w, x):
    h = clip_gradient(x.astype(F16) * w.astype(F16)) * F16(2**4)
    return jnp.sum(h.astype(F32))

  # jax runs a backward rule under the traceback of the line that calls
  # the function; naming the rule's own lines would take writing jax's
  # state, which the finder does not do.
  report = ols.find_overflow(loss, W4, X6)
  first = report.first
  assert (first.pass_name, first.primitive) == ("backward", "mul")
  assert first.custom_rule == "clip_gradient"
  assert first.code == (
    "h = clip_gradient(x.astype(F16) * w.astype(F16)) * F16(2**4)"
  )
  assert "of `clip_gradient`, a custom derivative" in flat(report)


# ------------------------------------------------------------------ errors


def test_float8_is_measured():
  def in_float8(w, x):
    h = x.astype(jnp.float8_e4m3fn) * w.astype(jnp.float8_e4m3fn)
    return jnp.sum(h.astype(F32))

  assert not ols.find_overflow(in_float8, W4 * 2**-4, X6 * 2**-6)
  report = ols.find_overflow(in_float8, W4 * 2**4, X6)  # 2**14 > 448: NaN
  assert report.first.dtype == "float8_e4m3fn"


@pytest.mark.parametrize(
  "scale", ["abc", [1.0], 1j, 1e39, 0, -2.0, float("nan"), None]
)
def test_a_bad_scale_is_refused_naming_scale(scale):
  with pytest.raises((TypeError, ValueError), match="`scale`"):
    ols.find_overflow(guarded, W4, X6, scale=scale)


@pytest.mark.parametrize(
  "returned, error",
  [(None, TypeError), ("loss", TypeError), (jnp.ones(3), ValueError)],
)
def test_a_fun_that_returns_no_scalar_is_refused_naming_fun(returned, error):
  with pytest.raises(error, match="`fun`"):
    ols.find_overflow(lambda w: returned, W4)


# -------------------------------------------------------------------- text


def test_arguments_are_named_by_their_parameters():
  def loss(weights, batch):
    return jnp.sum(weights["w"] * batch["x"])

  report = ols.find_overflow(loss, {"w": W4.at[1].set(jnp.nan)}, {"x": X6})
  assert report.first.primitive == "weights['w']"
  assert "the input `weights['w']` holds 1 NaN" in flat(report)


def test_scope_names_are_never_broken_mid_word():
  scope = "a_very_long_scope_name_" * 5

  def loss(w, x):
    with jax.named_scope(scope):
      h = x.astype(F16) * w.astype(F16) * F16(2**6)
    return jnp.sum(h.astype(F32))

  text = str(ols.find_overflow(loss, W4, X6))
  (line,) = [
    line
    for line in text.splitlines()
    if line.startswith("  scope ") and "values" not in line
  ]
  assert line.split()[-1] == scope, line


def test_call_paths_leave_out_decorator_wrappers():
  def traced(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
      return f(*args, **kwargs)

    return wrapper

  @traced
  def layer(w, x):
    return x.astype(F16) * w.astype(F16) * F16(2**6)

  def loss(w, x):
    return jnp.sum(layer(w, x).astype(F32))

  first = ols.find_overflow(loss, W4, X6).first
  names = [name.rsplit(".", 1)[-1] for name in first.call_path]
  assert names[-2:] == ["loss", "layer"], first.call_path


# ---------------------------------------------------------- jax internals


def test_the_finder_matches_primitives_by_object():
  from jax.extend import core as jex_core

  from optax_lossscale._diagnostics.finder import primitives

  classes = (
    primitives.LAYOUT,
    primitives.PICKERS,
    primitives.ELEMENTWISE,
    primitives.NO_REFERENCE,
    {primitives.CONVERT, primitives.GATHER, primitives.ADD},
  )
  for members in classes:
    assert all(isinstance(p, jex_core.Primitive) for p in members)


# ------------------------------------------------------------------ memory


def _memory_benchmark():
  root = pathlib.Path(__file__).resolve().parents[1]
  return load_file(root / "benchmarks" / "finder_memory.py")


@pytest.mark.slow
def test_the_memory_benchmark_runs_tiny(capsys):
  plain, finder = _memory_benchmark().main(["--tiny"])
  assert "finder / plain, rss_growth_bytes" in capsys.readouterr().out
  assert plain["variant"] == "plain" and finder["variant"] == "finder"


@pytest.mark.slow
def test_peak_memory_is_a_few_times_value_and_grads():
  # The float32 shadow holds a float32 copy of every float16 value the
  # backward pass keeps, beside the float16 ones: the finder's peak is a
  # few times a plain value_and_grad's (3.4-3.6x at this size, measured in
  # benchmarks/README.md), never an order of magnitude.
  plain, finder = _memory_benchmark().main([])
  assert finder["rss_growth_bytes"] <= 5 * plain["rss_growth_bytes"]


# -------------------------------------------------------------------- cost


def _layers(params, x):
  for i, w in enumerate(params):
    with jax.named_scope(f"layer_{i}"):
      x = x @ w.astype(F16)  # the identity: x stays 2**7
  return jnp.sum(x.astype(F32))


def test_alike_layers_compile_once_and_are_named_each(monkeypatch):
  from optax_lossscale._diagnostics.finder import chunks

  compiled = []
  compile_for_one_run = chunks.compile_for_one_run

  def spy(lowered, elements):
    compiled.append(elements)
    return compile_for_one_run(lowered, elements)

  monkeypatch.setattr(chunks, "compile_for_one_run", spy)
  x = jnp.full((2, 8), 2.0**7, F16)
  counts = []
  for depth in (4, 12):
    params = [jnp.eye(8) for _ in range(depth)]
    compiled.clear()
    assert not ols.find_overflow(_layers, params, x)
    counts.append(len(compiled))
  assert counts[0] == counts[1]  # the layers' chunks are one kind
  # The kind is shared; each chunk is named where it is: layer_9's product
  # overflows (2**7 * 2**10 = 2**17).
  params = [jnp.eye(8) for _ in range(12)]
  params[9] = params[9] * 2.0**10
  first = ols.find_overflow(_layers, params, x).first
  assert (first.scope, first.primitive, first.pass_name) == (
    "layer_9",
    "dot_general",
    "forward",
  )
