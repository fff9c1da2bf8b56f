"""`find_overflow` measures rather than guesses: issue 34's cases 12 to 22,
each a program on which the finder once said something false.

The finder runs every operation in float16 and in a float32 shadow (the
same operation, float16 widened to float32, on the shadow's inputs) and
says only what the two measure: "float16's range" where the float32 value
is finite, data, a mask or the program's own arithmetic where it is not,
the pass from the program's structure, harm from what reaches the loss or
the gradients. Values are powers of two where the arithmetic must be
exact.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _finder_truth import cotangent_largest

import optax_lossscale as ols

F16 = jnp.float16
F32 = jnp.float32
W4 = jnp.full((4,), 2.0**4)
X6 = jnp.full((4,), 2.0**6)


def flat(report):
  return " ".join(str(report).split())


# 12. A loss wrapped in a `jit` that donates or places its arguments.


@pytest.mark.parametrize("placement", ["donate_argnums", "out_shardings"])
def test_an_overflow_inside_a_placed_jit_is_named_where_it_is(placement):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  options = {
    "donate_argnums": {"donate_argnums": (1,)},
    "out_shardings": {"out_shardings": device},
  }[placement]

  @functools.partial(jax.jit, **options)
  def inner(w, x):
    return jnp.sum(jnp.exp(x * w.astype(F16)).astype(F32))  # exp(16)

  def loss(w, x):
    return inner(w, x)

  report = ols.find_overflow(loss, jnp.full((4,), 16.0), jnp.ones(4, F16))
  first = report.first
  assert (first.pass_name, first.primitive, first.cause) == (
    "forward",
    "exp",
    "range",
  )
  assert first.code.startswith("return jnp.sum(jnp.exp(")
  assert "loss scaling" not in flat(report)
  assert "the loss is float16" not in flat(report)


# 13. An overflow beside a -inf padding mask.


def test_a_matmul_overflow_beside_a_padded_row_is_named_forward():
  valid = jnp.array([True, False])

  def loss(w, x):
    x = jnp.where(valid[:, None], x.astype(F16), -jnp.inf)  # row 1: padding
    logits = x @ w.astype(F16)  # row 0: 4 * 2**8 * 2**6 = 2**16
    kept = jnp.where(valid[:, None], logits, F16(0))
    return jnp.sum(kept.astype(F32))

  report = ols.find_overflow(
    loss, jnp.full((4, 3), 2.0**6), jnp.full((2, 4), 2.0**8)
  )
  assert report.loss == np.inf
  first = report.first
  assert (first.pass_name, first.primitive, first.cause) == (
    "forward",
    "dot_general",
    "range",
  )
  assert first.inf == 6  # row 0's 3 overflow; row 1's -inf are the mask's
  assert flat(report).startswith("Overflow in the forward pass")


def test_an_rnn_overflow_beside_padded_steps_is_named_forward():
  def loss(w, xs):
    steps = jnp.where(jnp.arange(4)[:, None] > 0, xs.astype(F16), -jnp.inf)

    def cell(h, x):
      h = jnp.maximum(h * w.astype(F16) + x, F16(0))  # a padded step: 0
      return h, h

    h, _ = jax.lax.scan(cell, jnp.ones(2, F16), steps)
    return jnp.sum(h.astype(F32))

  # h: 0 (padding), 1, 257, then 257 * 2**8 + 1 = 65793: inf.
  report = ols.find_overflow(loss, jnp.full(2, 2.0**8), jnp.ones((4, 2)))
  assert report.loss == np.inf
  first = report.first
  assert (first.pass_name, first.primitive, first.boundary) == (
    "forward",
    "scan",
    "scan",
  )
  assert first.cause == "range"


# 14. Bad data beyond float16's range, or not finite.


@pytest.mark.parametrize("reading", [1e5, 1e6, np.inf])
def test_bad_data_is_named_as_data_not_as_a_mask(reading):
  def loss(params, x, y):  # the README's quick start
    pred = x.astype(F16) @ params["w"].astype(F16)
    return jnp.mean((pred.astype(F32) - y) ** 2)

  x = jnp.ones((4, 8)).at[0, 0].set(reading)
  params = {"w": jnp.full((8, 1), 2.0**-4)}
  report = ols.find_overflow(loss, params, x, jnp.zeros((4, 1)))
  assert report and report.masks == ()
  first = report.first
  assert first.cause == "data"
  text = flat(report)
  assert "no operation overflowed" not in text
  assert "`x`" in text
  if np.isinf(reading):  # not finite in float32 either: the input itself
    assert (first.pass_name, first.primitive, first.inf) == ("input", "x", 1)
  else:  # finite in float32, beyond float16's 65504 once cast
    assert (first.pass_name, first.primitive) == (
      "forward",
      "convert_element_type",
    )
    assert "beyond float16's range" in text


def test_an_input_marked_as_a_mask_is_a_mask():
  def biased(w, bias):
    return jnp.sum(jnp.exp(w.astype(F16) + bias).astype(F32))

  bias = jnp.array([0.0, -jnp.inf], F16)
  unmarked = ols.find_overflow(biased, jnp.array([1.0, 1.0]), bias)
  assert not unmarked and unmarked.masks == ()
  (listed,) = unmarked.discarded  # exp(-inf) is 0: it reaches nothing
  assert (listed.pass_name, listed.primitive, listed.cause) == (
    "input",
    "bias",
    "data",
  )
  marked = ols.find_overflow(
    biased, jnp.array([1.0, 1.0]), bias, masks=("bias",)
  )
  assert not marked and marked.masks == ("the input `bias`",)
  assert marked.discarded == ()


@pytest.mark.parametrize(
  "masks, error",
  [
    ("bias", TypeError),
    (("w",), ValueError),
    (("nothing",), ValueError),
    ((3,), TypeError),
  ],
)
def test_a_bad_masks_argument_is_refused_naming_masks(masks, error):
  def biased(w, bias):
    return jnp.sum(jnp.exp(w.astype(F16) + bias).astype(F32))

  with pytest.raises(error, match="`masks`"):
    ols.find_overflow(biased, W4, X6, masks=masks)


# 15. An overflowing constant expression; a -inf inside jax's own code.


def test_an_overflowing_constant_expression_is_an_overflow():
  tau = jnp.array(1e-5, F16)  # 1 / tau = 99,900: beyond 65504

  def loss(w, x):
    logits = x.astype(F16) * w.astype(F16) * (F16(1.0) / tau)
    return jax.nn.logsumexp(logits.astype(F32))

  report = ols.find_overflow(loss, jnp.full(4, 2.0**-4), jnp.ones(4))
  first = report.first
  assert (first.pass_name, first.primitive, first.cause) == (
    "forward",
    "div",
    "range",
  )
  assert report.masks == ()  # the user wrote no -inf, nor does logsumexp's
  assert "written in the code" not in flat(report)


# 16. rsqrt's derivative under `jax.checkpoint`.


def test_a_derivative_recomputed_under_checkpoint_is_named_as_it():
  def normed(w, x):
    @jax.checkpoint
    def norm(h):
      variance = jnp.mean(h * h)
      return h * jax.lax.rsqrt(variance + F16(2**-20))

    h = x.astype(F16) * w.astype(F16)  # 2**-10: the variance is 2**-20
    return jnp.sum(norm(h).astype(F32))

  report = ols.find_overflow(normed, jnp.full((4,), 2.0**-10), jnp.ones(4))
  first = report.first
  assert (first.pass_name, first.derivative_of) == ("backward", "rsqrt")
  assert first.primitive == "rsqrt's derivative"
  assert first.recomputed and not first.depends_on_scale
  text = flat(report)
  assert "jax.checkpoint" in text
  assert "the scale can double" not in text
  assert "proportional to the scale" not in text


# 17. A custom_vjp backward rule's value computed from residuals alone.


def test_a_custom_backward_rules_residual_value_does_not_depend_on_the_scale():
  @jax.custom_vjp
  def amplified(h):
    return h

  def forward(h):
    return h, h

  def backward(h, g):
    gain = h * F16(2**12)  # 2**4 * 2**12 = 2**16: from the residual alone
    return (g * gain,)

  amplified.defvjp(forward, backward)

  def loss(w, x):
    return jnp.sum(amplified(x.astype(F16) * w.astype(F16)).astype(F32))

  report = ols.find_overflow(loss, jnp.full(4, 2.0**-2), X6)
  first = report.first
  assert (first.pass_name, first.primitive) == ("backward", "mul")
  assert first.custom_rule == "amplified"
  assert not first.depends_on_scale
  assert first.code.startswith("return jnp.sum(amplified(")  # the call
  text = flat(report)
  assert "proportional to the scale" not in text
  assert "the scale can double" not in text


# 18. Host callbacks run once, as written.


def test_a_host_callback_runs_once_as_written():
  calls = []

  def double(a):
    calls.append(a.dtype)
    return np.asarray(a) * 2

  def loss(w, x):
    shape = jax.ShapeDtypeStruct(x.shape, F16)
    y = jax.pure_callback(double, shape, x.astype(F16))
    return jnp.sum((y * w.astype(F16)).astype(F32))

  report = ols.find_overflow(loss, W4, X6)
  assert not report
  assert calls == [np.dtype(np.float16)]  # once, with its own dtype
  calls.clear()
  report = ols.find_overflow(loss, W4 * 2**5, X6)  # 2**7 * 2**9 = 2**16
  assert calls == [np.dtype(np.float16)]
  assert (report.first.primitive, report.first.cause) == ("mul", "range")


def test_an_io_callback_runs_once():
  seen = []

  def loss(w, x):
    jax.experimental.io_callback(lambda a: seen.append(1), None, x)
    return jnp.sum((x.astype(F16) * w.astype(F16)).astype(F32))

  assert not ols.find_overflow(loss, W4, X6)
  assert seen == [1]


# 19. Complex values.


def test_a_complex_overflow_is_named_at_the_complex_operation():
  def loss(w, x):
    z = jax.lax.complex(x * w, jnp.zeros_like(x))  # 2**10 + 0j
    return jnp.sum(jnp.abs(jnp.exp(z)))  # exp(1024) is beyond float32

  first = ols.find_overflow(loss, W4, X6).first
  assert (first.primitive, first.dtype) == ("exp", "complex64")
  assert first.cause == "arithmetic"


# 20. A finite loss changed by an overflow.


def rms_norm_loss(w, x, target):
  h = x.astype(F16) * w.astype(F16)
  variance = jnp.mean(jnp.square(h), axis=-1, keepdims=True)
  y = h * jax.lax.rsqrt(variance + F16(2**-10))  # rsqrt(inf) = 0
  return jnp.mean((y.astype(F32) - target) ** 2)


def test_an_overflow_that_changes_a_finite_loss_is_harmful():
  x = jnp.ones((4, 8)).at[0].set(2.0**9)  # token 0: 2**18 once squared
  report = ols.find_overflow(rms_norm_loss, jnp.ones(8), x, jnp.ones((4, 8)))
  assert np.isfinite(report.loss)
  assert report.loss != report.reference_loss  # the float32 shadow's
  assert report
  first = report.first
  assert (first.pass_name, first.cause) == ("forward", "range")
  assert first.primitive in ("square", "integer_pow")
  assert first.inf == 8
  assert not flat(report).startswith("No overflow")


def test_a_harmless_overflow_is_listed_not_named():
  def loss(w, x):
    h = x.astype(F16) * w.astype(F16)  # 2**16: inf
    return jnp.sum(jnp.tanh(h).astype(F32))  # 1, as float32's tanh says

  report = ols.find_overflow(loss, W4 * 2**6, X6)
  assert not report
  (listed,) = report.discarded
  assert (listed.primitive, listed.cause) == ("mul", "range")


# 21. Every number printed is one the program computed.


@pytest.mark.parametrize("scale", [1.0, 2.0**6])
def test_the_headroom_figure_is_the_programs_largest_cotangent(scale):
  def loss(w, x):
    h = x.astype(F16) * w.astype(F16)  # 2**-3
    variance = jnp.mean(h * h)  # rsqrt's derivative, -254: not scaled
    y = h * jax.lax.rsqrt(variance + F16(2**-14))
    return jnp.sum(y.astype(F32)) * 2.0**-3

  w, x = jnp.full(4, 2.0**-3), jnp.ones(4)
  report = ols.find_overflow(loss, w, x, scale=scale)
  largest = cotangent_largest(loss, (w, x), scale)
  backward = [s for s in report.scopes if s.pass_name == "backward"]
  assert max(s.largest for s in backward) == largest
  said = "largest float16 cotangent (a backward value computed from the scale)"
  assert f"{said} is {largest:.4g}" in flat(report)


# 22. A gather's index out of range.


def test_an_index_out_of_range_is_named_as_such():
  def taken(w, index):
    picked = jnp.take(w.astype(F16), index, mode="fill")  # NaN out of range
    return jnp.sum(picked.astype(F32))

  report = ols.find_overflow(taken, W4, jnp.array([0, 7]))
  first = report.first
  assert (first.pass_name, first.primitive, first.cause) == (
    "forward",
    "gather",
    "index",
  )
  text = flat(report)
  assert not text.startswith("Overflow")
  assert "out of range" in text and "`index`" in text
