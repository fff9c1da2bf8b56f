"""`loss_scale_optimizer`: unscale, check, skip the inner update, adjust."""

# Annotations stay unevaluated: `help()` and the API page then show the
# public aliases (`Inner`, ...) rather than their private module paths.
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import optax

from optax_lossscale._core import config as _config
from optax_lossscale._core import skip as _skip
from optax_lossscale._core import step as _step
from optax_lossscale._core.config import AxisName
from optax_lossscale._core.state import (
  LossScaleOptimizerState,
  LossScaleState,
)
from optax_lossscale._core.transformation import LossScaledTransformation
from optax_lossscale._jaxpr import zeros as _zeros

# What `inner` accepts: an optax transformation, or an `optax.MultiSteps`.
Inner: TypeAlias = optax.GradientTransformation | optax.MultiSteps


def _forwards_extra_args(update: Callable[..., Any]) -> bool:
  """Whether `update` takes keyword arguments beyond optax's three."""
  try:
    parameters = inspect.signature(update).parameters.values()
  except (TypeError, ValueError):
    return False
  return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _as_transformation(inner: Inner) -> optax.GradientTransformationExtraArgs:
  """Accepts what optax accepts: transformations, `MultiSteps` objects and
  duck-typed objects with `init` and `update`. Extra args (``value=`` for
  ``reduce_on_plateau``, ...) reach every `update` that takes ``**kwargs``;
  a plain `GradientTransformation` whose `update` does not is given none,
  as ``optax.with_extra_args_support`` does."""
  if isinstance(inner, LossScaledTransformation):
    raise ValueError(
      "`inner` is already loss-scaled (made by `loss_scale_optimizer` or"
      " `unscale_and_check`);"
      " wrapping it again would scale and skip twice. Pass the plain optax"
      " transformation instead."
    )
  if not (
    callable(getattr(inner, "init", None))
    and callable(getattr(inner, "update", None))
  ):
    raise TypeError(
      "`inner` must be an optax transformation (an object with `init` and"
      f" `update`, e.g. `optax.adam(1e-3)` or an `optax.MultiSteps`), got"
      f" {inner!r} of type {type(inner).__name__}."
    )
  if isinstance(inner, optax.GradientTransformationExtraArgs):
    return inner
  if _forwards_extra_args(inner.update):
    # `MultiSteps.update(..., **extra_args)` and duck-typed objects: not
    # through `.gradient_transformation()` + `with_extra_args_support`,
    # which drops the extra args.
    return optax.GradientTransformationExtraArgs(inner.init, inner.update)
  return optax.with_extra_args_support(
    optax.GradientTransformation(inner.init, inner.update)
  )


def _refuse_nested_loss_scaling(inner_state: Any) -> None:
  nested = [
    leaf
    for leaf in jax.tree.leaves(
      inner_state, is_leaf=lambda x: isinstance(x, LossScaleState)
    )
    if isinstance(leaf, LossScaleState)
  ]
  if nested:
    raise ValueError(
      "`inner` already contains a loss scaler (`unscale_and_check` or"
      " `loss_scale_optimizer`, perhaps inside `optax.chain`); a"
      " loss-scaled optimizer must not wrap another. Keep one loss scaler,"
      " outermost."
    )


def loss_scale_optimizer(
  inner: Inner,
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
  r"""Wraps an optax transformation with dynamic loss scaling.

  ``update`` receives the gradients of the *scaled* loss (see
  :func:`scale_loss`). Per call, with ``s`` the scale and ``c`` the counter:

  1. The gradients are divided by ``s`` as it was before this step, in the
     wider of each gradient's and its parameter's dtype (float32 master
     params get float32 unscaled gradients even from float16 ones).
  2. ``finite``: every element of every unscaled leaf is finite, and so is
     the loss when it is given (``update(..., value=loss)``), whatever the
     gradients (reduced across ``axis_name`` when given, so that replicas
     decide together).
  3. Finite: the inner update is applied. If
     ``c + 1 >= dynamic_growth_steps``, ``s`` becomes ``s * growth_factor``
     when that is finite and ``<= max_scale`` (else it stays) and ``c = 0``;
     otherwise ``c += 1``.
  4. Not finite: the inner update is skipped (the updates are zeros in their
     own dtypes and the inner state is kept bit for bit), ``c = 0``, and if
     this is the ``hysteresis``-th non-finite step in a row (or later),
     ``s = max(s * backoff_factor, min_scale)``.
  5. Static (``dynamic=False``): ``s`` never changes, non-finite steps are
     still skipped; ``min_scale`` and ``max_scale`` are not used (nor
     compared with ``initial_scale``).
  6. A step whose loss is not finite is skipped and counted (step 4); with
     ``backoff_on_nonfinite_loss=False`` it leaves ``s``, ``c`` and the
     hysteresis count as they were.

  Every step is counted in the state: skipped steps in total and in a row,
  those with a NaN (not only inf) in the gradients, those with a non-finite
  loss, and, with ``leaf_stats=True``, per gradient leaf. Read them with
  :func:`skip_stats`, :func:`nonfinite_leaves` and :func:`skip_report`.

  ``update`` takes optax's extra arguments: ``value=loss`` (the unscaled
  loss, as :func:`value_and_grad` returns it) is read by the check and
  still passed on to ``inner``.

  With the defaults this is Keras-TF2's ``LossScaleOptimizer`` step for step,
  except that a skipped step does not advance the inner optimizer's count,
  and static mode skips non-finite steps too.

  Args:
    inner: the optax transformation to wrap (``optax.MultiSteps`` objects
      included). Put gradient clipping inside it, so that it sees unscaled,
      finite gradients.
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
    A :class:`LossScaledTransformation`: an optax
    ``GradientTransformationExtraArgs`` that also carries its configuration,
    whose state is a :class:`LossScaleOptimizerState`.

  Raises:
    TypeError, ValueError: on bad configuration, naming the argument, the
      value and what is accepted.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> params = {'w': jnp.array([1.0, 2.0])}
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.5))
    >>> opt_state = tx.init(params)
    >>> def loss_fn(params, opt_state):
    ...   return ols.scale_loss(jnp.sum(params['w'] ** 2), opt_state)
    >>> grads = jax.grad(loss_fn)(params, opt_state)  # scaled by 2**15
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> optax.apply_updates(params, updates)['w']
    Array([0., 0.], dtype=float32)
    >>> grads = {'w': jnp.array([jnp.inf, 1.0])}      # an overflow: skipped
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> updates['w'], ols.loss_scale(opt_state)
    (Array([0., 0.], dtype=float32), Array(16384., dtype=float32))

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, 2018.
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
  return _loss_scale_optimizer_from_config(_as_transformation(inner), config)


def _loss_scale_optimizer_from_config(
  inner: optax.GradientTransformationExtraArgs, config: _config.LossScaleConfig
) -> LossScaledTransformation:
  def init_fn(params: optax.Params) -> LossScaleOptimizerState:
    inner_state = inner.init(params)
    _refuse_nested_loss_scaling(inner_state)
    return LossScaleOptimizerState(
      loss_scale_state=_step.init_state(
        config, params, lambda: _updated_leaves(inner, inner_state, params)
      ),
      inner_state=inner_state,
    )

  def update_fn(
    updates: optax.Updates,
    state: LossScaleOptimizerState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, LossScaleOptimizerState]:
    _check_state_type(state)
    # `value` (the unscaled loss) is read here and still reaches `inner`,
    # as optax's extra args do (`reduce_on_plateau` needs it).
    unscaled, finite, loss_scale_state = _step.unscale_check_adjust(
      updates, state.loss_scale_state, config, params, extra_args.get("value")
    )
    # The inner update only ever sees finite values: on a skipped step it
    # computes on zeros, and its results are discarded (zero updates, the old
    # inner state bit for bit; see `_skip.update_unless`).
    safe = _skip.zero_unless(finite, unscaled)
    inner_updates, inner_state = _skip.update_unless(
      finite,
      lambda inner_state: inner.update(safe, inner_state, params, **extra_args),
      state.inner_state,
    )
    return inner_updates, LossScaleOptimizerState(
      loss_scale_state=loss_scale_state, inner_state=inner_state
    )

  return LossScaledTransformation.of(
    init_fn, update_fn, config, skips_inner=True
  )


def _updated_leaves(
  inner: optax.GradientTransformationExtraArgs,
  inner_state: Any,
  params: Any,
) -> list[bool] | None:
  """Per leaf of `params`, whether `inner` may update it: not where its
  update is zero whatever the gradients (a frozen parameter), as the
  traced update says (nothing is computed). None where the update cannot
  be traced without the step's arguments (extra args it needs, say)."""
  grads = params.fast if isinstance(params, optax.LookaheadParams) else params
  try:
    zero = _zeros.zero_outputs(
      lambda g, s, p: inner.update(g, s, p)[0], grads, inner_state, params
    )
  except Exception:  # any failure to trace it: each leaf may be updated
    return None
  return [not z for z in zero]


def _check_state_type(state: Any) -> None:
  if not isinstance(state, LossScaleOptimizerState):
    raise TypeError(
      "`state` must be the LossScaleOptimizerState that this optimizer's"
      f" `init` returned, got {type(state).__name__}. A state of another"
      " optimizer (a plain optax state, say) cannot be updated here; to"
      " restore a plain optax checkpoint, see docs/composition.md, section"
      " Checkpoints."
    )
