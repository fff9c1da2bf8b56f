"""Keras `LossScaleOptimizer.get_config()` import and export."""

import math
from typing import Any

from optax_lossscale._core.config import (
  FLOAT32_MAX,
  as_real_scalar,
  backoff_factor_ok,
  growth_factor_ok,
)
from optax_lossscale._core.optimizer import (
  Inner,
  LossScaledTransformation,
  loss_scale_optimizer,
)

# Keys of a Keras config that describe the inner optimizer, which the caller
# gives as an optax transformation instead (Keras 2 and Keras 3 spellings).
_INNER_OPTIMIZER_KEYS = frozenset(
  {
    "inner_optimizer",
    "optimizer",
    "name",
    "learning_rate",
    "weight_decay",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
    "is_legacy_optimizer",
    "jit_compile",
    "decay",
  }
)
_CURRENT_KEYS = frozenset({"dynamic", "initial_scale", "dynamic_growth_steps"})


def from_keras_config(
  config: dict[str, Any], inner: Inner
) -> LossScaledTransformation:
  """Builds the loss-scaled optimizer that a Keras config describes.

  Accepts the ``get_config()`` dict of ``tf.keras.mixed_precision.
  LossScaleOptimizer`` in its current form (``dynamic``, ``initial_scale``,
  ``dynamic_growth_steps``; Keras 3's, without ``dynamic``, too) and in the
  TF <= 2.3 form with a ``loss_scale`` entry (``FixedLossScale``, or
  ``DynamicLossScale`` with ``initial_loss_scale``, ``increment_period`` and
  ``multiplier``; a bare number or ``"dynamic"`` as well). A multiplier ``m``
  becomes ``growth_factor=m`` and ``backoff_factor=1/m`` (Keras divides by
  ``m``; for an ``m`` that is not a power of two, multiplying by the float32
  ``1/m`` can differ from that in the last bit). The inner optimizer
  comes from the caller; the config's inner-optimizer entries are ignored.

  Args:
    config: the dict.
    inner: the optax transformation to wrap.

  Returns:
    The transformation :func:`loss_scale_optimizer` builds.

  Raises:
    ValueError: for an unknown key or loss-scale class, or bad values.

  Examples:
    >>> import optax, optax_lossscale as ols
    >>> tx = ols.from_keras_config(
    ...     {'dynamic': True, 'initial_scale': 1024.0,
    ...      'dynamic_growth_steps': 100}, optax.sgd(0.1))
    >>> ols.to_keras_config(tx)
    {'dynamic': True, 'initial_scale': 1024.0, 'dynamic_growth_steps': 100}
    >>> old = {'loss_scale': {'class_name': 'DynamicLossScale',
    ...        'config': {'initial_loss_scale': 256.0, 'increment_period': 10,
    ...                   'multiplier': 4.0}}}
    >>> tx = ols.from_keras_config(old, optax.sgd(0.1))
    >>> tx.loss_scale_config.backoff_factor
    0.25
  """
  if not isinstance(config, dict):
    raise TypeError(
      f"`config` must be a dict (a Keras `get_config()`), got {config!r}."
    )
  unknown = set(config) - _INNER_OPTIMIZER_KEYS - _CURRENT_KEYS - {"loss_scale"}
  if unknown:
    raise ValueError(
      f"`config` has keys a Keras LossScaleOptimizer config does not have:"
      f" {sorted(unknown)}. Accepted: {sorted(_CURRENT_KEYS)}, or"
      " 'loss_scale' (TF <= 2.3), plus inner-optimizer entries."
    )
  if "loss_scale" in config:
    if _CURRENT_KEYS & set(config):
      raise ValueError(
        "`config` mixes the TF <= 2.3 'loss_scale' entry with the current"
        f" keys {sorted(_CURRENT_KEYS & set(config))}; give one form."
      )
    return loss_scale_optimizer(
      inner, **_legacy_arguments(config["loss_scale"])
    )
  return loss_scale_optimizer(
    inner,
    dynamic=config.get("dynamic", True),
    initial_scale=config.get("initial_scale"),
    dynamic_growth_steps=config.get("dynamic_growth_steps"),
  )


def _legacy_arguments(loss_scale: Any) -> dict[str, Any]:
  if isinstance(loss_scale, str) and loss_scale == "dynamic":
    return {"dynamic": True}
  if as_real_scalar(loss_scale) is not None:  # NumPy scalars included
    return {"dynamic": False, "initial_scale": loss_scale}
  if not isinstance(loss_scale, dict) or "class_name" not in loss_scale:
    raise ValueError(
      "`config['loss_scale']` must be 'dynamic', a number, or a dict with"
      f" 'class_name' and 'config', got {loss_scale!r}."
    )
  name, inner_config = loss_scale["class_name"], loss_scale.get("config", {})
  if name == "FixedLossScale":
    _check_legacy_keys(
      name, inner_config, {"loss_scale_value"}, required={"loss_scale_value"}
    )
    return {"dynamic": False, "initial_scale": inner_config["loss_scale_value"]}
  if name == "DynamicLossScale":
    _check_legacy_keys(
      name,
      inner_config,
      {"initial_loss_scale", "increment_period", "multiplier"},
      required=set(),
    )
    multiplier = inner_config.get("multiplier", 2.0)
    m = as_real_scalar(multiplier)  # NumPy scalars included
    if (
      m is None
      or not (math.isfinite(m) and m > 1)
      # As the rule uses it: growth by m and backoff by 1/m, in float32.
      or not growth_factor_ok(m)
      or not backoff_factor_ok(1.0 / m)
    ):
      raise ValueError(
        "`multiplier` of a DynamicLossScale must be a number > 1 whose"
        " float32 value m and 1/m are usable growth and backoff factors"
        f" (from 1 + 2**-23 to 2**126), got {multiplier!r}."
      )
    return {
      "dynamic": True,
      "initial_scale": inner_config.get("initial_loss_scale", 2.0**15),
      "dynamic_growth_steps": inner_config.get("increment_period", 2000),
      "growth_factor": m,
      "backoff_factor": 1.0 / m,
    }
  raise ValueError(
    "`config['loss_scale']['class_name']` must be 'FixedLossScale' or"
    f" 'DynamicLossScale', got {name!r}."
  )


def _check_legacy_keys(
  name: str,
  inner_config: Any,
  accepted: frozenset[str] | set[str],
  *,
  required: frozenset[str] | set[str],
) -> None:
  """A misspelt key must not fall back to a default silently."""
  if not isinstance(inner_config, dict):
    raise ValueError(
      f"The 'config' of a {name} must be a dict, got {inner_config!r}."
    )
  unknown = set(inner_config) - accepted
  missing = required - set(inner_config)
  if unknown or missing:
    raise ValueError(
      f"The 'config' of a {name} accepts the keys {sorted(accepted)}"
      f" ({sorted(required)} required), got unknown {sorted(unknown)} and"
      f" missing {sorted(missing)}."
    )


def to_keras_config(tx: LossScaledTransformation) -> dict[str, Any]:
  """The Keras ``LossScaleOptimizer`` config of a loss-scaled transformation.

  Only what Keras can express is exported; an extension set away from its
  default (factors other than 2 and 1/2, ``min_scale``, ``max_scale``,
  ``hysteresis``) raises instead of being dropped silently.

  Args:
    tx: a transformation made by :func:`loss_scale_optimizer`.

  Returns:
    ``{'dynamic', 'initial_scale', 'dynamic_growth_steps'}``, as Keras's
    ``get_config()`` has them (without the inner optimizer).

  Raises:
    TypeError: if ``tx`` was not made by :func:`loss_scale_optimizer`.
    ValueError: if ``tx`` uses an extension Keras cannot express.

  Examples:
    >>> import optax, optax_lossscale as ols
    >>> ols.to_keras_config(ols.loss_scale_optimizer(optax.adam(1e-3)))
    {'dynamic': True, 'initial_scale': 32768.0, 'dynamic_growth_steps': 2000}
  """
  c = None
  if isinstance(tx, LossScaledTransformation):
    try:
      c = tx.loss_scale_config if tx.skips_inner else None
    except AttributeError:  # its `update` was replaced
      c = None
  if c is None:
    raise TypeError(
      "`tx` must be made by `loss_scale_optimizer` (with its `update`"
      f" unchanged), got {type(tx).__name__}."
    )
  extensions = {
    "growth_factor": (c.growth_factor, 2.0),
    "backoff_factor": (c.backoff_factor, 0.5),
    "min_scale": (c.min_scale, 1.0),
    "hysteresis": (c.hysteresis, 1),
    # `leaf_stats` only counts, and changes no step: it is not refused.
    "backoff_on_nonfinite_loss": (c.backoff_on_nonfinite_loss, True),
  }
  not_keras = {k: v for k, (v, default) in extensions.items() if v != default}
  if c.max_scale != FLOAT32_MAX:
    not_keras["max_scale"] = c.max_scale
  if not_keras:
    raise ValueError(
      f"Keras's LossScaleOptimizer cannot express {not_keras}; only"
      " `dynamic`, `initial_scale` and `dynamic_growth_steps` export."
    )
  return {
    "dynamic": c.dynamic,
    "initial_scale": c.initial_scale,
    "dynamic_growth_steps": c.growth_steps if c.dynamic else None,
  }
