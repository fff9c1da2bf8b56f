"""The finder's advice names the `ols.autocast` call that fixes a float16
range overflow, and each call it names does: run as advised, the same
batch gives a finite loss and the finder finds nothing.

Where `fun` ran under no policy and the policy's float32 list holds the
operation, the advice is the policy itself; otherwise the name the finder
gives the operation (a scope, or a module method on the call path), which
`keep_float32` accepts. `OverflowReport.autocast` records which policies
`fun` applied, as the finder traced it.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import optax_lossscale as ols

F16 = jnp.float16
F32 = jnp.float32
KEEP_BLOCK = 'ols.autocast(loss_fn, keep_float32=("block",))'


def flat(report):
  return " ".join(str(report).split())


def advised_call(report):
  """The `ols.autocast(...)` call the report's text advises, as code."""
  found = re.findall(r"`(ols\.autocast\(loss_fn[^`]*\))`", flat(report))
  assert len(found) == 1, flat(report)
  return found[0]


def run_advice(report, loss):
  """`loss` under the call the report advises: `loss_fn` is `loss`."""
  return eval(advised_call(report), {"ols": ols, "loss_fn": loss})


def assert_the_advice_fixes_it(report, loss, *args):
  fixed = run_advice(report, loss)
  assert bool(jnp.isfinite(fixed(*args)))
  after = ols.find_overflow(fixed, *args)
  assert not after, str(after)
  assert after.autocast == ("float16",)


def test_exp_outside_a_policy_is_fixed_by_the_policy_itself():
  # exp(16) overflows float16; the product's cotangent, exp(16) * 2**-10,
  # does not.
  def hand_cast(w, x):
    z = x.astype(F16) @ w.astype(F16)
    return jnp.sum(jnp.exp(z).astype(F32)) * 2.0**-10

  def float32_model(w, x):
    return jnp.sum(jnp.exp(x @ w)) * 2.0**-10

  args = (jnp.full((4,), 16.0), jnp.full((3, 4), 0.25))
  report = ols.find_overflow(hand_cast, *args)
  assert (report.first.primitive, report.first.cause) == ("exp", "range")
  assert report.autocast == ()
  assert advised_call(report) == "ols.autocast(loss_fn)"
  assert (
    "No loss scale fixes it; in float32 it is finite: `ols.autocast(loss_fn)`,"
    " on the model written in float32, computes `exp` and its derivative in"
    " float32." in flat(report)
  )
  assert_the_advice_fixes_it(report, float32_model, *args)


def test_rsqrts_derivative_outside_a_policy_is_fixed_by_the_policy():
  def hand_cast(w, x):  # rsqrt's derivative of a tiny variance: 2**28
    h = x.astype(F16) * w.astype(F16)
    variance = jnp.mean(h * h)
    return jnp.sum((h * jax.lax.rsqrt(variance + F16(2**-20))).astype(F32))

  def float32_model(w, x):
    h = x * w
    return jnp.sum(h * jax.lax.rsqrt(jnp.mean(h * h) + 2**-20))

  args = (jnp.full((4,), 2.0**-10), jnp.ones(4))
  report = ols.find_overflow(hand_cast, *args)
  assert report.first.derivative_of == "rsqrt"
  assert "computes `rsqrt` and its derivative in float32" in flat(report)
  assert_the_advice_fixes_it(report, float32_model, *args)


def test_the_policy_keeps_the_casts_a_hand_conversion_wrote():
  # Why the advice says "on the model written in float32": the policy
  # computes rsqrt in float32, but the hand cast's float16 `h` receives
  # the derivative, and 2**28 is beyond float16's range there.
  def hand_cast(w, x):
    h = x.astype(F16) * w.astype(F16)
    variance = jnp.mean(h * h)
    return jnp.sum((h * jax.lax.rsqrt(variance + F16(2**-20))).astype(F32))

  args = (jnp.full((4,), 2.0**-10), jnp.ones(4))
  first = ols.find_overflow(ols.autocast(hand_cast), *args).first
  assert (first.pass_name, first.dtype, first.cause) == (
    "backward",
    "float16",
    "range",
  )


def test_a_product_outside_a_policy_is_kept_in_float32_by_its_scope():
  # A product is not on the float32 list: the policy alone would compute it
  # in float16 again; its scope kept in float32 does not.
  def loss(w, x):
    with jax.named_scope("block"):
      h = x.astype(F16) @ (w * 1000.0).astype(F16)
    return jnp.sum(h.astype(F32) * 0.0 + 1.0)

  args = (jnp.ones((4, 2)), jnp.full((3, 4), 300.0))
  report = ols.find_overflow(loss, *args)
  first = report.first
  assert (first.primitive, first.scope) == ("dot_general", "block")
  assert advised_call(report) == KEEP_BLOCK
  assert "computes scope `block` in float32." in flat(report)
  assert not bool(jnp.isfinite(ols.autocast(loss)(*args)))
  assert_the_advice_fixes_it(report, loss, *args)


def test_a_product_under_the_policy_is_kept_in_float32_by_its_scope():
  def loss(w, x):
    with jax.named_scope("block"):
      h = x @ (w * 1000.0)
    return jnp.sum(h * 0.0 + 1.0)

  args = (jnp.ones((4, 2)), jnp.full((3, 4), 300.0))
  report = ols.find_overflow(ols.autocast(loss), *args)
  assert report.autocast == ("float16",)
  assert report.first.scope == "block"
  assert advised_call(report) == KEEP_BLOCK
  assert_the_advice_fixes_it(report, loss, *args)


class _Model(nnx.Module):  # no name scopes: the finder names the method
  def __init__(self):
    self.big = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    self.big.kernel[...] = self.big.kernel[...] * 1000

  def __call__(self, x):
    return self.big(x)


def test_a_module_without_scopes_is_kept_in_float32_by_its_method():
  def loss(model, x):
    return jnp.mean(model(x) ** 2 * 0.0)

  model, x = _Model(), jnp.linspace(50.0, 100.0, 16).reshape(4, 4)
  report = ols.find_overflow(ols.autocast(loss), model, x)
  first = report.first
  assert (first.primitive, first.scope) == ("dot_general", "")
  assert first.call_path[-1] == "Linear.__call__"
  assert advised_call(report) == (
    'ols.autocast(loss_fn, keep_float32=("Linear.__call__",))'
  )
  assert "computes `Linear.__call__` in float32." in flat(report)
  assert_the_advice_fixes_it(report, loss, model, x)


@pytest.mark.parametrize("under_policy", [False, True])
def test_without_a_name_or_a_listed_operation_the_advice_says_less(
  under_policy,
):
  # A product in the loss function itself: no scope, no method below it,
  # and not on the float32 list. No `ols.autocast` call is named.
  def loss(w, x):
    return jnp.sum((x.astype(F16) @ (w * 1000.0).astype(F16)).astype(F32))

  fun = ols.autocast(loss) if under_policy else loss
  report = ols.find_overflow(fun, jnp.ones((4, 2)), jnp.full((3, 4), 300.0))
  assert report.first.primitive == "dot_general"
  assert "ols.autocast" not in flat(report)
  assert "No loss scale fixes it: compute this operation in float32." in (
    flat(report)
  )


def test_a_listed_operation_under_the_policy_is_not_advised_the_policy():
  # Under the policy, exp overflowing float16 ran outside its float32 list
  # (here a `custom_jvp` the policy runs as traced): the policy is in
  # place, so naming it again would fix nothing.
  @jax.custom_jvp
  def exp16(x):
    return jnp.exp(x.astype(F16))

  exp16.defjvp(lambda p, t: (exp16(p[0]), exp16(p[0]) * t[0].astype(F16)))

  def loss(w):
    with jax.named_scope("head"):
      return jnp.sum(exp16(w).astype(F32))

  report = ols.find_overflow(ols.autocast(loss), jnp.full((4,), 16.0))
  assert report.autocast == ("float16",)
  assert report.first.cause == "range"
  assert "`ols.autocast(loss_fn)`" not in flat(report)


def test_the_skip_reports_pointer_leads_to_the_autocast_call():
  # rsqrt's derivative overflows at every scale: the run sinks to the
  # floor and skips there; the report sends the user to the finder, and
  # the finder, on the same batch and state, names the `ols.autocast` call.
  def hand_cast(w, x):
    h = x.astype(F16) * w.astype(F16)
    variance = jnp.mean(h * h)
    return jnp.sum((h * jax.lax.rsqrt(variance + F16(2**-20))).astype(F32))

  tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=4.0)
  params, x = jnp.full((4,), 2.0**-10), jnp.ones(4)
  opt_state = tx.init(params)

  @jax.jit
  def step(opt_state):
    loss, grads = ols.value_and_grad(hand_cast)(opt_state, params, x)
    return tx.update(grads, opt_state, params, value=loss)[1]

  for _ in range(5):
    opt_state = step(opt_state)
  text = " ".join(str(ols.skip_report(opt_state, tx)).split())
  assert "ran at the floor (1)" in text
  assert (
    "`ols.find_overflow` on a skipped step's batch names the operation and,"
    " for float16's range, how to compute it in float32 (an `ols.autocast`"
    " call where it can)." in text
  ) or (
    "`ols.find_overflow` on a skipped step's batch names the operation and"
    " how to compute it in float32 (an `ols.autocast` call where it can)."
    in text
  )
  report = ols.find_overflow(hand_cast, params, x, scale=opt_state)
  assert report.first.cause == "range"
  assert advised_call(report) == "ols.autocast(loss_fn)"


class _Big(nnx.Module):  # a float32 weight beyond float16's range
  def __init__(self):
    self.big = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    self.big.kernel[...] = jnp.full((4, 8), 2.0**17)

  def __call__(self, x):
    return self.big(x)


def _mean_square(model, x):
  return jnp.mean(model(x) ** 2) * 2.0**-40


def test_a_parameter_beyond_float16s_range_is_not_called_the_batch():
  # Found trying the advice on Flax's NNX Gemma: a weight grown beyond
  # 65504, cast to float16 for its product, was "data", with "check the
  # batch". It is the parameter; under the policy, keeping its use in
  # float32 fixes it.
  model, x = _Big(), jnp.full((2, 4), 2.0**-8)
  report = ols.find_overflow(ols.autocast(_mean_square), model, x)
  first = report.first
  assert (first.cause, first.from_parameter) == ("data", True)
  assert first.from_input == "model.big.kernel.value"
  text = flat(report)
  assert text.startswith(
    "Data beyond float16's range: the parameter `model.big.kernel.value`"
  )
  assert "Check the batch" not in text
  assert (
    "No loss scale fixes it: the parameter is beyond float16's range." in text
  )
  assert advised_call(report) == (
    'ols.autocast(loss_fn, keep_float32=("Linear.__call__",))'
  )
  assert_the_advice_fixes_it(report, _mean_square, model, x)


def test_a_batch_beyond_float16s_range_is_the_batch():
  def loss(w, x):
    return jnp.sum((w.astype(F16) * x.astype(F16)).astype(F32))

  report = ols.find_overflow(loss, jnp.ones(4), jnp.full(4, 2.0**17))
  first = report.first
  assert (first.cause, first.from_parameter, first.from_input) == (
    "data",
    False,
    "x",
  )
  assert "Check the batch" in flat(report)
