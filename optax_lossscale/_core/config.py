"""Construction-time validation: bad configuration fails here, never in jit."""

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np
from jax import errors as jax_errors

# Keras-TF2 defaults (tf.keras.mixed_precision.LossScaleOptimizer).
DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000
_INT32_MAX = int(np.iinfo(np.int32).max)
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The smallest normal float32, 2**-126: XLA on CPU flushes the subnormals
# below it to zero, so a scale or bound there could become 0 (1/0 is inf).
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
# What a scale and its bounds accept, in messages.
NORMAL_FLOAT32 = (
  "a normal float32, from 2**-126 (np.finfo(np.float32).tiny) to float32 max"
)

# What `axis_name` accepts: one axis name, or a tuple of them.
AxisName: TypeAlias = str | int | tuple[str | int, ...] | None


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  """The validated, static configuration of a loss scaler, as
  :func:`loss_scale_optimizer` and :func:`unscale_and_check` hold it
  (``tx.loss_scale_config``): their arguments after validation, with the
  defaults filled in and every float as the float32 the rule computes with.
  Frozen and hashable.

  Attributes:
    dynamic: whether the scale adapts.
    initial_scale: the scale before the first step (``2**15`` by default).
    growth_steps: consecutive finite steps before the scale grows (the
      ``dynamic_growth_steps`` argument; 2000 by default; not used when
      static).
    growth_factor: the multiplier on growth.
    backoff_factor: the multiplier on backoff.
    min_scale: the dynamic scale's floor.
    max_scale: the dynamic scale's ceiling (float32 max by default).
    hysteresis: non-finite steps in a row before the scale backs off.
    axis_name: the ``pmap``/``shard_map`` axis (or axes) over which the
      verdict is reduced, or ``None``.
    leaf_stats: whether the state counts non-finite steps per gradient leaf.
    backoff_on_nonfinite_loss: whether a non-finite loss backs the scale
      off.

  Examples:
    >>> import optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), max_scale=2**20)
    >>> config = tx.loss_scale_config
    >>> config.dynamic, config.initial_scale, config.growth_steps
    (True, 32768.0, 2000)
    >>> config.max_scale, config.hysteresis, config.leaf_stats
    (1048576.0, 1, False)
    >>> static = ols.unscale_and_check(dynamic=False, initial_scale=0.1)
    >>> static.loss_scale_config.initial_scale  # 0.1 as a float32
    0.10000000149011612
  """

  dynamic: bool
  initial_scale: float
  growth_steps: int
  growth_factor: float
  backoff_factor: float
  min_scale: float
  max_scale: float
  hysteresis: int
  axis_name: AxisName
  leaf_stats: bool = False
  backoff_on_nonfinite_loss: bool = True


def as_real_scalar(value: Any) -> float | None:
  """A Python, NumPy or concrete JAX real scalar as a float, else None."""
  if isinstance(value, bool | np.bool_):
    return None
  if isinstance(value, numbers.Real):
    try:
      return float(value)
    except OverflowError:  # an int beyond float's range: out of range
      return -math.inf if value < 0 else math.inf
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if (
    shape == ()
    and dtype is not None
    and (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer))
  ):
    try:
      return float(value)
    except (TypeError, jax_errors.ConcretizationTypeError):
      return None  # a traced value: configuration must be concrete
  return None


def _check_float(
  name: str, value: Any, *, accepted: str, ok: Callable[[float], bool]
) -> float:
  """Returns `value` as a float if it is a real number and `ok(value)`."""
  as_float = as_real_scalar(value)
  if as_float is None:
    raise TypeError(
      f"`{name}` must be a real number ({accepted}), got {value!r} of type"
      f" {type(value).__name__}."
    )
  if not math.isfinite(as_float) or not ok(as_float):
    raise ValueError(f"`{name}` must be {accepted}, got {value!r}.")
  return as_float


def _check_int(name: str, value: Any, *, minimum: int) -> int:
  accepted = f"an int >= {minimum} and <= 2**31 - 1"
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
      f"`{name}` must be {accepted}, got {value!r} of type"
      f" {type(value).__name__}."
    )
  value = int(value)
  if not minimum <= value <= _INT32_MAX:
    raise ValueError(f"`{name}` must be {accepted}, got {value!r}.")
  return value


def _as_float32(value: float) -> float:
  with np.errstate(over="ignore"):  # too large becomes inf, refused after
    return float(np.float32(value))


def _representable_in_float32(value: float) -> bool:
  """Whether `value`, as the float32 that will be used, is normal."""
  return FLOAT32_TINY <= _as_float32(value) <= FLOAT32_MAX


# The factors as the rule uses them, in float32: 1.00000001 is 1.0 there
# (the scale would never grow), 1e39 is inf, 0.99999999 is 1.0 (it would
# never back off), and a subnormal is 0 on CPU only.
GROWTH_FACTOR = "> 1 and finite in float32, from 1 + 2**-23 to float32 max"
BACKOFF_FACTOR = (
  "in the open interval (0, 1) in float32, from 2**-126 to 1 - 2**-24"
)


def growth_factor_ok(value: float) -> bool:
  return 1.0 < _as_float32(value) <= FLOAT32_MAX


def backoff_factor_ok(value: float) -> bool:
  return FLOAT32_TINY <= _as_float32(value) < 1.0


def make_config(
  dynamic: bool,
  initial_scale: float | None,
  dynamic_growth_steps: int | None,
  *,
  growth_factor: float,
  backoff_factor: float,
  min_scale: float,
  max_scale: float | None,
  hysteresis: int,
  axis_name: AxisName,
  leaf_stats: bool = False,
  backoff_on_nonfinite_loss: bool = True,
) -> LossScaleConfig:
  """Validates the public arguments; every error names argument and value."""
  # Keras-TF2's own checks come first, with the same exception types.
  _check_bool("dynamic", dynamic)
  if not dynamic and initial_scale is None:
    raise ValueError(
      "`initial_scale` must be given when `dynamic=False` (a static scale"
      " needs a value), got None."
    )
  if not dynamic and dynamic_growth_steps is not None:
    raise ValueError(
      "`dynamic_growth_steps` must be None when `dynamic=False` (a static"
      f" scale never grows), got {dynamic_growth_steps!r}."
    )

  positive = NORMAL_FLOAT32
  if initial_scale is None:
    initial_scale = DEFAULT_INITIAL_SCALE
  initial_scale = _check_float(
    "initial_scale",
    initial_scale,
    accepted=positive,
    ok=_representable_in_float32,
  )
  growth_steps = _check_int(
    "dynamic_growth_steps",
    DEFAULT_GROWTH_STEPS
    if dynamic_growth_steps is None
    else dynamic_growth_steps,
    minimum=1,
  )
  growth_factor = _check_float(
    "growth_factor",
    growth_factor,
    accepted=GROWTH_FACTOR,
    ok=growth_factor_ok,
  )
  backoff_factor = _check_float(
    "backoff_factor",
    backoff_factor,
    accepted=BACKOFF_FACTOR,
    ok=backoff_factor_ok,
  )
  min_scale = _check_float(
    "min_scale", min_scale, accepted=positive, ok=_representable_in_float32
  )
  if max_scale is None:
    max_scale = FLOAT32_MAX
  max_scale = _check_float(
    "max_scale", max_scale, accepted=positive, ok=_representable_in_float32
  )
  # The bounds are the dynamic scale's: a static scale (Keras-TF2 accepts
  # one below 1) is not compared with them.
  if dynamic and not min_scale <= initial_scale <= max_scale:
    raise ValueError(
      "`min_scale <= initial_scale <= max_scale` must hold for a dynamic"
      " scale, got"
      f" min_scale={min_scale!r}, initial_scale={initial_scale!r},"
      f" max_scale={max_scale!r}."
    )
  hysteresis = _check_int("hysteresis", hysteresis, minimum=1)
  _check_axis_name(axis_name)
  _check_bool("leaf_stats", leaf_stats)
  _check_bool("backoff_on_nonfinite_loss", backoff_on_nonfinite_loss)
  # The rule computes in float32: keep the float32 values, so that bounds
  # compare as they will be applied (0.1 is not a float32).
  return LossScaleConfig(
    dynamic=dynamic,
    initial_scale=_float32(initial_scale),
    growth_steps=growth_steps,
    growth_factor=_float32(growth_factor),
    backoff_factor=_float32(backoff_factor),
    min_scale=_float32(min_scale),
    max_scale=_float32(max_scale),
    hysteresis=hysteresis,
    axis_name=axis_name,
    leaf_stats=leaf_stats,
    backoff_on_nonfinite_loss=backoff_on_nonfinite_loss,
  )


def _check_bool(name: str, value: object) -> None:
  if not isinstance(value, bool):
    raise TypeError(
      f"`{name}` must be a bool (True or False), got {value!r} of type"
      f" {type(value).__name__}."
    )


def _float32(value: float) -> float:
  return float(np.float32(value))


def _check_axis_name(axis_name: object) -> None:
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if axis_name is None:
    return
  if not names or any(
    not isinstance(n, str | int) or isinstance(n, bool) for n in names
  ):
    raise TypeError(
      "`axis_name` must be None, an axis name (a str), or a tuple of axis"
      f" names, got {axis_name!r}."
    )


def scale_can_fall_below_one(config: LossScaleConfig) -> bool:
  """Whether the rule can take the scale below 1 (where unscaling can
  overflow a finite gradient)."""
  if config.dynamic:
    return config.min_scale < 1.0
  return config.initial_scale < 1.0
