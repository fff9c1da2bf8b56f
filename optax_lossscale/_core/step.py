"""`unscale_and_check`: divide by the scale, decide finiteness, adjust."""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_lossscale._core import config as _config
from optax_lossscale._core import donation as _donation
from optax_lossscale._core import finite as _finite
from optax_lossscale._core import master_weights as _master_weights
from optax_lossscale._core import rule as _rule
from optax_lossscale._core import skip as _skip
from optax_lossscale._core.config import AxisName, LossScaleConfig
from optax_lossscale._core.state import (
  LossScaleState,
  check_scalar_state,
  init_loss_scale_state,
  is_of_an_earlier_release,
  zero_leaf_counts,
)
from optax_lossscale._core.transformation import LossScaledTransformation


def unscale_and_check(
  dynamic: bool = True,
  initial_scale: float | None = None,
  dynamic_growth_steps: int | None = None,
  *,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  min_scale: float = 1.0,
  max_scale: float | None = None,
  hysteresis: int = 1,
  axis_name: AxisName = None,
  leaf_stats: bool = False,
  backoff_on_nonfinite_loss: bool = True,
) -> LossScaledTransformation:
  r"""Unscales gradients, checks that they are finite, and adjusts the scale.

  Each ``update`` divides the incoming (scaled) gradients by the scale in
  force *before* this step (in the wider of each gradient's and its
  parameter's dtype when ``params`` are given), decides whether every element
  of every leaf is finite, and so is the loss when ``update`` is given
  ``value=loss`` (reduced over ``axis_name`` when given), and moves the
  scale by the rule of :func:`loss_scale_optimizer`. Its state is a
  :class:`LossScaleState`.

  What it guarantees: nothing non-finite leaves it. On a non-finite step
  (non-finite gradients, or a non-finite loss whatever the gradients) the
  returned updates are zeros (each in its own dtype), and the state records
  the step (``last_finite=False``, the skip counters advance).

  What it does not do: it does not freeze the transformations that follow it.
  In ``optax.chain(unscale_and_check(), optax.adam(1e-3))`` a non-finite step
  still feeds zeros to adam, whose moments decay and whose count advances. To
  skip the inner update entirely, use :func:`loss_scale_optimizer`, which is
  this transformation plus that skip.

  Args:
    dynamic: whether the scale adapts (``True``) or stays fixed.
    initial_scale: the starting scale, a normal float32 (at least
      ``2**-126``); ``2**15`` when dynamic, required when static.
    dynamic_growth_steps: consecutive finite steps before the scale grows
      (default 2000); must be ``None`` when static.
    growth_factor: multiplier on growth, ``> 1``.
    backoff_factor: multiplier on backoff, in ``(0, 1)``.
    min_scale: the floor the dynamic scale never goes below (default 1);
      not used when static.
    max_scale: the ceiling growth never exceeds (default: float32 max);
      not used when static.
    hysteresis: skips counted against the scale, with no step applied
      between, before it backs off (an applied step refills the tolerance,
      as DeepSpeed's ``consecutive_hysteresis=True``; a non-finite loss
      that ``backoff_on_nonfinite_loss=False`` leaves uncounted neither
      counts nor refills it); every non-finite step is skipped regardless.
    axis_name: a ``pmap``/``shard_map`` axis name (or tuple of names) over
      which one boolean is reduced, so that every replica skips together.
      Not needed under ``jit`` with shardings.
    leaf_stats: whether to count, per gradient leaf, the steps on which it
      was not finite (read with :func:`nonfinite_leaves`). A state keeps the
      choice it was made with: ``update`` refuses a state whose ``leaf_stats``
      differs from the transformation's.
    backoff_on_nonfinite_loss: whether a step whose loss (``value``) is not
      finite backs the scale off, as an overflow does (the default, as
      Keras). Such a step is skipped and counted either way; with ``False``
      the scale, its counter and hysteresis stay as they were: a bad batch
      or a forward overflow is not the scale's fault, and lowering the scale
      cannot help it.

  Returns:
    A :class:`LossScaledTransformation` (an optax
    ``GradientTransformationExtraArgs`` that also carries its configuration),
    whose state is a :class:`LossScaleState`.

  Raises:
    TypeError, ValueError: on bad configuration, naming the argument, the
      value and what is accepted.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> tx = ols.unscale_and_check(initial_scale=8.0)
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> updates, state = tx.update({'w': jnp.array([8.0, 16.0])}, state)
    >>> updates['w']
    Array([1., 2.], dtype=float32)
    >>> updates, state = tx.update({'w': jnp.array([8.0, jnp.nan])}, state)
    >>> updates['w'], ols.loss_scale(state)
    (Array([0., 0.], dtype=float32), Array(4., dtype=float32))
  """
  config = _config.make_config(
    dynamic,
    initial_scale,
    dynamic_growth_steps,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    min_scale=min_scale,
    max_scale=max_scale,
    hysteresis=hysteresis,
    axis_name=axis_name,
    leaf_stats=leaf_stats,
    backoff_on_nonfinite_loss=backoff_on_nonfinite_loss,
  )
  return _unscale_and_check_from_config(config)


def _unscale_and_check_from_config(
  config: LossScaleConfig,
) -> LossScaledTransformation:
  def init_fn(params: optax.Params) -> LossScaleState:
    return init_state(config, params)

  def update_fn(
    updates: optax.Updates,
    state: LossScaleState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, LossScaleState]:
    unscaled, applied, new_state = unscale_check_adjust(
      updates, state, config, params, extra_args.get("value")
    )
    return _skip.zero_unless(applied, unscaled), new_state

  return LossScaledTransformation.of(
    init_fn, update_fn, config, skips_inner=False
  )


def init_state(
  config: LossScaleConfig,
  params: optax.Params,
  updated: Callable[[], list[bool] | None] | None = None,
) -> LossScaleState:
  """The loss-scale state before the first step (with a count per leaf of
  the gradients, shaped like `params`, when `config.leaf_stats`).
  `updated` tells, per leaf of `params`, whether the optimizer may update
  it (None: every leaf), for the float16 master-weights warning."""
  _master_weights.warn_of_float16_params(params, updated)
  leaf_notfinite = None
  if config.leaf_stats:
    if isinstance(params, optax.LookaheadParams):
      params = params.fast  # the gradients are the fast params'
    leaf_notfinite = zero_leaf_counts(params)
  return init_loss_scale_state(
    config.initial_scale, config.dynamic, leaf_notfinite, config
  )


def unscale_check_adjust(
  updates: Any,
  state: LossScaleState,
  config: LossScaleConfig,
  params: Any = None,
  value: Any = None,
) -> tuple[Any, jax.Array, LossScaleState]:
  """Returns (unscaled updates, whether the step applies, next loss-scale
  state). `value` is the step's unscaled loss, or None."""
  check_scalar_state(state)
  _check_state_matches(state, config)
  if value is not None:
    _check_value(value)
  scale = state.loss_scale
  unscaled = unscale(updates, scale, params)
  scale_usable: jax.Array | bool = True
  if _config.scale_can_fall_below_one(config):
    # Dividing by a scale below 1 can overflow a finite gradient: check the
    # very values that are passed on.
    verdict = _finite.check(unscaled, per_leaf=config.leaf_stats)
  else:
    # Dividing by a scale >= 1 cannot overflow a finite gradient, so the
    # incoming gradient decides, as it arrives: XLA then need not
    # materialize the quotient for the check. The check cannot vouch for a
    # scale below 1, which only a state changed by hand (not through
    # `set_loss_scale`, which refuses it) or by another configuration can
    # hold: such a step is skipped, and recorded as that.
    verdict = _finite.check(updates, per_leaf=config.leaf_stats)
    scale_usable = scale >= 1
  outcome = _agreed_outcome(verdict, value, config)._replace(
    scale_usable=scale_usable
  )
  new_state = _rule.next_state(state, outcome, config)
  applied = new_state.last_finite
  last_finite = _donation.last_finite_flag(state.last_finite, applied)
  return unscaled, applied, new_state._replace(last_finite=last_finite)


def _check_state_matches(
  state: LossScaleState, config: LossScaleConfig
) -> None:
  """Refuses, while tracing, a state made by a transformation configured
  otherwise in what the state's structure holds: a static or dynamic scale
  (the counter), and per-leaf counts (`leaf_stats`)."""
  if is_of_an_earlier_release(state):
    raise ValueError(
      "The loss-scale state is of an earlier release of optax_lossscale"
      " (a pickle of 0.2.0, say): it lacks the fields today's `update`"
      " records. Pass the restored state through"
      " `optax_lossscale.upgrade_state` first (docs/migration.md)."
    )
  state_dynamic = state.counter is not None
  if state_dynamic != config.dynamic:
    made, given = _mode(state_dynamic), _mode(config.dynamic)
    raise ValueError(
      f"The loss-scale state holds a {made} scale (it was made by a"
      f" transformation with `dynamic={state_dynamic}`), and this"
      f" transformation's scale is {given} (`dynamic={config.dynamic}`)."
      " Update a state with the transformation whose `init` made it; to"
      f" switch a run in progress to a {given} scale, `init` a new state"
      " with this transformation and carry the scale over with"
      " `ols.set_loss_scale(new_state, ols.loss_scale(old_state))`."
    )
  state_counts = state.leaf_notfinite is not None
  if state_counts != config.leaf_stats:
    raise ValueError(
      "The loss-scale state was made with"
      f" `leaf_stats={state_counts}`, and this transformation has"
      f" `leaf_stats={config.leaf_stats}`: switching per-leaf statistics"
      " on or off during a run is refused, since the counts would not"
      " cover the run. Update the state with the transformation whose"
      " `init` made it, or `init` a new state with this one (carry the"
      " scale over with `ols.set_loss_scale(new_state,"
      " ols.loss_scale(old_state))`)."
    )


def _mode(dynamic: bool) -> str:
  return "dynamic" if dynamic else "static"


def _check_value(value: Any) -> None:
  """Refuses, while tracing, a `value` that is not a real float scalar
  (its shape and dtype are static: no traced value is read)."""
  shape, dtype = None, None
  if isinstance(value, bool | int | float | complex):
    shape, dtype = (), jnp.result_type(value)
  elif hasattr(value, "shape") and hasattr(value, "dtype"):
    shape, dtype = tuple(value.shape), value.dtype
  if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    described = (
      f"shape {shape} and dtype {dtype}"
      if shape is not None
      else f"{value!r} of type {type(value).__name__}"
    )
    raise TypeError(
      "`value` must be the step's loss, a real floating-point scalar (a"
      " float, or an array of shape () and a float dtype), got"
      f" {described}. Pass the unscaled loss, as `ols.value_and_grad`"
      " returns it (reduce a per-example loss to its mean first)."
    )


def _agreed_outcome(
  verdict: _finite.Verdict, value: Any, config: LossScaleConfig
) -> _rule.Outcome:
  """The step's outcome, the same on every replica of `axis_name`: the
  codes of the gradients, of the loss and of each leaf travel together, as
  one int32 vector."""
  grads_finite, grads_nan = verdict.finite, verdict.nan
  loss_finite = (
    jnp.ones([], jnp.bool_) if value is None else _finite.check(value).finite
  )
  leaf_notfinite = verdict.leaf_notfinite
  if config.axis_name is not None:
    # One vector crosses the replicas; without an axis, nothing to pack.
    codes = [
      verdict.code[None],
      _finite.code_of(loss_finite, jnp.zeros([], jnp.bool_))[None],
    ]
    if leaf_notfinite is not None:
      codes.append(leaf_notfinite.astype(_finite.CODE_DTYPE))
    agreed = _finite.reduce_across(jnp.concatenate(codes), config.axis_name)
    grads_finite = agreed[0] == _finite.FINITE
    grads_nan = agreed[0] == _finite.NAN
    loss_finite = agreed[1] == _finite.FINITE
    if leaf_notfinite is not None:
      leaf_notfinite = agreed[2:] != _finite.FINITE
  return _rule.Outcome(
    grads_finite=grads_finite,
    grads_nan=grads_nan,
    loss_finite=loss_finite,
    leaf_notfinite=leaf_notfinite,
    nan_told_apart=verdict.nan_told_apart,
  )


def unscale(updates: Any, loss_scale: jax.Array, params: Any = None) -> Any:
  """Each leaf over the scale, in the wider of its own and its param's dtype.

  Unscaling a float16 gradient back into float16 would flush to zero exactly
  the small values the scale protected, so with float32 master params the
  unscaled gradient is float32. Without params, each leaf keeps its dtype.
  """
  loss_scale = jnp.asarray(loss_scale)
  # Once per dtype, not per leaf: a step has hundreds of leaves to trace.
  scale_for = functools.cache(functools.partial(_scale_for, loss_scale))
  return jax.tree.map(
    lambda g, dtype: _unscale_leaf(g, dtype, scale_for),
    updates,
    _unscaled_dtypes(updates, params),
    is_leaf=_is_none,
  )


def _scale_for(
  loss_scale: jax.Array, out_dtype: Any
) -> tuple[Any, jax.Array, jax.Array]:
  """`(compute_dtype, quarter, reciprocal)` for a leaf unscaled into
  `out_dtype`: `g / scale` is computed as `(g * quarter) * reciprocal` in
  `compute_dtype` (the wider of `out_dtype` and the scale's), with
  `reciprocal = 1 / (scale * quarter)`."""
  compute_dtype = wider_dtype(out_dtype, loss_scale.dtype)
  scale = loss_scale.astype(compute_dtype)
  # A product, not a quotient: XLA fuses a product into each of its
  # consumers, where on a mesh it materialized the quotient (one gradient
  # shard per leaf) for adam's two moments. For a power-of-two scale the
  # product is exact, as the quotient is; otherwise within an ulp of it.
  # Above 2**126 the reciprocal of the scale is subnormal and XLA flushes
  # it to zero, so such a scale is quartered on both sides first; `g / 4`
  # only rounds where g is subnormal, and then the quotient underflows.
  # The quarter is a quotient too (1/4 or 1/1, both exact): XLA copies a
  # cheap scalar computation (the compare and select of a `where`) into
  # every fusion that reads it, one per gradient consumer, and each copy
  # is compiled; a quotient it computes once (benchmarks/README.md).
  one = jnp.ones([], compute_dtype)
  quarter = lax.div(
    one, jnp.where(scale > 2.0**126, 4.0, 1.0).astype(compute_dtype)
  )
  reciprocal = lax.div(one, lax.mul(scale, quarter))
  return compute_dtype, quarter, reciprocal


def _is_none(x: Any) -> bool:
  return x is None


def _unscaled_dtypes(updates: Any, params: Any) -> Any:
  """The dtype each unscaled leaf gets (a tree of dtypes, None for None)."""
  if params is None:
    params = updates  # each leaf keeps its own dtype
  else:
    params = check_same_structure(updates, params)

  def dtype(g: Any, p: Any) -> Any:
    if g is None:
      return None
    if not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
      return jnp.result_type(g)  # integers and float0 pass through as they are
    return wider_dtype(jnp.result_type(g), jnp.result_type(p))

  return jax.tree.map(dtype, updates, params, is_leaf=_is_none)


def wider_dtype(a: Any, b: Any) -> Any:
  """`jnp.promote_types(a, b)` for a float `a`; jax promotes no float of 8
  bits or fewer implicitly, so there the wider float of the two (`a` on a
  tie): float8 gradients unscale in float32, as float16 ones do."""
  if not (_narrow_float(a) or _narrow_float(b)):
    return jnp.promote_types(a, b)
  if jnp.issubdtype(b, jnp.floating) and (
    jnp.dtype(b).itemsize > jnp.dtype(a).itemsize
  ):
    return jnp.dtype(b)
  return jnp.dtype(a)


def _narrow_float(dtype: Any) -> bool:
  return bool(jnp.issubdtype(dtype, jnp.floating)) and (
    jnp.dtype(dtype).itemsize == 1
  )


def check_same_structure(updates: Any, params: Any) -> Any:
  """The params whose dtypes the unscaled gradients take: `params` itself,
  or `params.fast` of an `optax.LookaheadParams` (`optax.lookahead` takes
  gradients of the fast parameters alongside both). A gradient tree that
  matches neither fails at trace time, whatever the inner transformation
  does with `params`."""

  def structure(tree: Any) -> jax.tree_util.PyTreeDef:
    return jax.tree.structure(tree, is_leaf=lambda x: x is None)

  if structure(updates) == structure(params):
    return params
  if isinstance(params, optax.LookaheadParams) and structure(
    updates
  ) == structure(params.fast):
    return params.fast
  raise ValueError(
    "The gradient tree must have the structure of `params` (or of"
    " `params.fast` for `optax.lookahead`), got gradients"
    f" {structure(updates)} and params {structure(params)}."
  )


def _unscale_leaf(
  g: Any, out_dtype: Any, scale_for: Callable[[Any], Any]
) -> Any:
  # `result_type`, not `g.dtype`: a leaf can be a Python float.
  if g is None or not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
    return g  # integer (or float0) leaves carry no scaled gradient
  if jnp.issubdtype(out_dtype, jnp.complexfloating):
    # Part by part: a complex division by a real scale promoted to complex
    # can overflow in its intermediate products.
    real_dtype = jnp.finfo(out_dtype).dtype
    return jax.lax.complex(
      _unscale_leaf(jnp.real(g), real_dtype, scale_for),
      _unscale_leaf(jnp.imag(g), real_dtype, scale_for),
    ).astype(out_dtype)
  compute_dtype, quarter, reciprocal = scale_for(out_dtype)
  # `lax` directly, not `jnp` operators: each of those traces a call of its
  # own, and a step unscales every leaf.
  g = lax.convert_element_type(g, compute_dtype)
  quotient = lax.mul(lax.mul(g, quarter), reciprocal)
  return lax.convert_element_type(quotient, out_dtype)
