"""What a run is, and what its spec means for training.

A run is a frozen ``RunSpec`` with one explicit field per choice (precision,
scaling mode, initial scale, growth interval, replicas), so that code asks
``spec.scaling`` instead of parsing a run's name or probing a dict for keys.
Everything that turns a spec into training (the optimizer, the loss, the
gradients the update receives, the scale) is in this module, so a new
choice is a new field here and a line where it takes effect.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optax_lossscale as ols

from . import model
from .config import Config

# loss_scale_optimizer's (and Keras's) default growth interval, named where
# a run's description says what None means.
DEFAULT_GROWTH_STEPS = 2000

# The main job's runs, in the order they train and print.
MAIN_RUNS = (
  "fp32",
  "fp16",
  "fp16_static",
  "fp16_dynamic",
  "fp16_autocast",
  "fp16_dynamic_g5",
)


class Scaling(enum.Enum):
  """How a run scales its loss."""

  NONE = "none"
  STATIC = "static"
  DYNAMIC = "dynamic"


_DTYPES = {"float32": jnp.float32, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run: its name and every choice that sets it apart from the others
  (they share the data, the initial weights and the batches).

  ``initial_scale`` and ``growth_steps`` are ``loss_scale_optimizer``'s
  arguments, None meaning its default (2**15; 2000 finite steps).
  ``replicas = R`` divides the loss by R times the batch's token count, one
  replica's share of a data-parallel global mean, and multiplies the
  gradients by R before the update (the all-reduce sum of R replicas
  holding the same batch).

  ``autocast``: a float16 run's compute comes from ``ols.autocast`` around
  the float32 model's loss, instead of the study's own casts (every
  parameter to float16 in the loss, the logits back to float32).

  ``nan_batch_share``: the probability that a batch is corrupted (one NaN
  in its embedded activations, so its loss and gradients are NaN; which
  batches is drawn from each batch's key, the same for every run).
  ``backoff_on_nonfinite_loss``: ``loss_scale_optimizer``'s argument, for
  the dynamic runs: whether a step with a NaN loss halves the scale (True,
  Keras's rule) or leaves it (False); both skip the step.

  >>> spec = static(2.0**10)
  >>> spec.name, spec.scaling.value, spec.scaled
  ('static 2**10', 'static', True)
  >>> RunSpec("x", scaling=Scaling.STATIC)
  Traceback (most recent call last):
  ValueError: run 'x': a static scale needs initial_scale
  >>> RunSpec("x", nan_batch_share=1.0)
  Traceback (most recent call last):
  ValueError: run 'x': nan_batch_share must be in [0, 1), not 1.0
  >>> RunSpec("x", dtype="float32", autocast=True)
  Traceback (most recent call last):
  ValueError: run 'x': autocast computes in float16: dtype must be 'float16'
  """

  name: str
  dtype: str = "float16"
  scaling: Scaling = Scaling.NONE
  initial_scale: float | None = None
  growth_steps: int | None = None
  replicas: int = 1
  nan_batch_share: float = 0.0
  backoff_on_nonfinite_loss: bool = True
  autocast: bool = False

  def __post_init__(self) -> None:
    problem = _problem(self)
    if problem:
      raise ValueError(f"run {self.name!r}: {problem}")

  @property
  def scaled(self) -> bool:
    """Whether ``loss_scale_optimizer`` wraps the run's Adam."""
    return self.scaling is not Scaling.NONE

  @property
  def compute_dtype(self) -> Any:
    """The dtype of the forward and backward passes."""
    return _DTYPES[self.dtype]

  def to_json(self) -> dict[str, Any]:
    """The spec as plain JSON values (``from_json`` reads it back)."""
    return {**dataclasses.asdict(self), "scaling": self.scaling.value}

  @classmethod
  def from_json(cls, value: dict[str, Any], name: str) -> RunSpec:
    """A spec from ``to_json``, or from a result saved before specs had a
    type (notebooks/figures/fp16_sweep.json): there a dict with ``dtype``
    and, for the scaled runs, ``dynamic``, ``initial_scale`` and
    ``growth_steps``, under the run's ``name``.

    >>> RunSpec.from_json({"dtype": "float16", "dynamic": False,
    ...                    "initial_scale": 4.0}, "static 2**2")
    ... # doctest: +NORMALIZE_WHITESPACE
    RunSpec(name='static 2**2', dtype='float16', scaling=<Scaling.STATIC:
    'static'>, initial_scale=4.0, growth_steps=None, replicas=1,
    nan_batch_share=0.0, backoff_on_nonfinite_loss=True, autocast=False)
    """
    if "scaling" in value:
      return cls(**{**value, "scaling": Scaling(value["scaling"])})
    scaling = Scaling.NONE
    if "dynamic" in value:
      scaling = Scaling.DYNAMIC if value["dynamic"] else Scaling.STATIC
    return cls(
      name=name,
      dtype=value["dtype"],
      scaling=scaling,
      initial_scale=value.get("initial_scale"),
      growth_steps=value.get("growth_steps"),
    )


def _problem(spec: RunSpec) -> str | None:
  """What is wrong with a spec's fields, if anything."""
  if spec.dtype not in _DTYPES:
    return f"dtype must be one of {sorted(_DTYPES)}, not {spec.dtype!r}"
  if spec.autocast and spec.dtype != "float16":
    return "autocast computes in float16: dtype must be 'float16'"
  if spec.replicas < 1:
    return f"replicas must be at least 1, not {spec.replicas}"
  if spec.scaling is Scaling.NONE and (
    spec.initial_scale is not None or spec.growth_steps is not None
  ):
    return "an unscaled run takes no initial_scale or growth_steps"
  if spec.scaling is Scaling.STATIC:
    if spec.initial_scale is None:
      return "a static scale needs initial_scale"
    if spec.growth_steps is not None:
      return "a static scale does not grow: growth_steps must be None"
  # `not 0 <= share < 1` also refuses NaN
  if not 0.0 <= spec.nan_batch_share < 1.0:
    return f"nan_batch_share must be in [0, 1), not {spec.nan_batch_share}"
  dynamic = spec.scaling is Scaling.DYNAMIC
  if not (dynamic or spec.backoff_on_nonfinite_loss):
    return (
      "backoff_on_nonfinite_loss=False needs dynamic scaling: only a"
      " dynamic scale backs off"
    )
  return None


def _log2(scale: float) -> str:
  return f"2**{int(math.log2(scale))}"


def fp32(name: str = "fp32", replicas: int = 1) -> RunSpec:
  """Everything in float32: the reference."""
  return RunSpec(name, dtype="float32", replicas=replicas)


def fp16(name: str = "fp16", replicas: int = 1) -> RunSpec:
  """float16 compute, no loss scaling."""
  return RunSpec(name, replicas=replicas)


def static(scale: float, name: str | None = None, replicas: int = 1) -> RunSpec:
  """float16 with a fixed loss scale; named ``static 2**k`` by default.

  >>> static(16).name
  'static 2**4'
  """
  return RunSpec(
    name or f"static {_log2(scale)}",
    scaling=Scaling.STATIC,
    initial_scale=float(scale),
    replicas=replicas,
  )


def dynamic(
  scale: float | None = None,
  growth_steps: int | None = None,
  name: str | None = None,
  replicas: int = 1,
) -> RunSpec:
  """float16 with dynamic loss scaling from ``scale``, growing after
  ``growth_steps`` finite steps (None: the library's defaults); named
  ``dyn 2**k gN`` by default.

  >>> dynamic(2.0**32).name
  'dyn 2**32 g2000'
  """
  if name is None:
    start = "default" if scale is None else _log2(scale)
    name = f"dyn {start} g{growth_steps or DEFAULT_GROWTH_STEPS}"
  return RunSpec(
    name,
    scaling=Scaling.DYNAMIC,
    initial_scale=None if scale is None else float(scale),
    growth_steps=growth_steps,
    replicas=replicas,
  )


def autocast(name: str = "fp16_autocast", replicas: int = 1) -> RunSpec:
  """The float32 model under ``ols.autocast``, with dynamic loss scaling at
  the library's defaults: ``fp16_dynamic`` without the study's own casts."""
  return dataclasses.replace(
    dynamic(name=name, replicas=replicas), autocast=True
  )


def main_specs(config: Config) -> tuple[RunSpec, ...]:
  """The main job's six runs (``MAIN_RUNS``), at ``config.replicas``."""
  r = config.replicas
  return (
    fp32(replicas=r),
    fp16(replicas=r),
    static(config.static_scale, "fp16_static", r),
    dynamic(name="fp16_dynamic", replicas=r),
    autocast(replicas=r),
    dynamic(config.dynamic_scale, config.growth_steps, "fp16_dynamic_g5", r),
  )


def bad_batch_specs(share: float, replicas: int) -> tuple[RunSpec, ...]:
  """The runs of the bad-batch job (``--corrupt``), each with ``share`` of
  its batches corrupted (the same ones): float32, which skips them (see
  ``optimizer``); dynamic scaling at the defaults, whose rule (Keras's)
  halves the scale on each; and the same with
  ``backoff_on_nonfinite_loss=False``, which skips them and leaves the
  scale.

  >>> [s.name for s in bad_batch_specs(0.04, 64)]
  ['fp32', 'fp16_dynamic', 'fp16_dynamic_hold']
  """
  return (
    RunSpec("fp32", dtype="float32", replicas=replicas, nan_batch_share=share),
    RunSpec(
      "fp16_dynamic",
      scaling=Scaling.DYNAMIC,
      replicas=replicas,
      nan_batch_share=share,
    ),
    RunSpec(
      "fp16_dynamic_hold",
      scaling=Scaling.DYNAMIC,
      replicas=replicas,
      nan_batch_share=share,
      backoff_on_nonfinite_loss=False,
    ),
  )


def float32_reference(spec: RunSpec) -> RunSpec:
  """The float32 run that a run's gradients are compared with: the same
  loss (replicas included), in float32 and unscaled."""
  return fp32(f"{spec.name} (float32)", spec.replicas)


def optimizer(spec: RunSpec, lr: float) -> optax.GradientTransformation:
  """Adam, wrapped in ``loss_scale_optimizer`` for the scaled runs. An
  unscaled run with corrupted batches wraps it in ``optax.apply_if_finite``
  instead, which skips a step whose gradients are not finite as the
  scaled runs do (a zero update, Adam's state kept), without giving up."""
  inner = optax.adam(lr)
  if spec.scaling is Scaling.NONE:
    if spec.nan_batch_share:
      return optax.apply_if_finite(inner, max_consecutive_errors=2**30)
    return inner
  if spec.scaling is Scaling.DYNAMIC:
    return ols.loss_scale_optimizer(
      inner,
      initial_scale=spec.initial_scale,
      dynamic_growth_steps=spec.growth_steps,
      backoff_on_nonfinite_loss=spec.backoff_on_nonfinite_loss,
    )
  return ols.loss_scale_optimizer(
    inner, dynamic=False, initial_scale=spec.initial_scale
  )


def scale(spec: RunSpec, opt_state: Any) -> jax.Array:
  """The run's current loss scale (1 for the unscaled runs)."""
  if spec.scaled:
    return ols.loss_scale(opt_state)
  return jnp.float32(1.0)


def loss(spec: RunSpec, depth: int) -> Callable[..., jax.Array]:
  """The run's loss, ``(params, x, y, taps=None) -> scalar``: in its dtype,
  one replica's share of the mean. Under ``autocast``, the float32 loss
  wrapped in ``ols.autocast``."""
  if spec.autocast:
    float32_loss = functools.partial(
      model.loss_fn,
      depth=depth,
      compute_dtype=jnp.float32,
      replicas=spec.replicas,
    )
    return ols.autocast(float32_loss)
  return functools.partial(
    model.loss_fn,
    depth=depth,
    compute_dtype=spec.compute_dtype,
    replicas=spec.replicas,
  )


def value_and_grad(
  spec: RunSpec,
  params: model.Params,
  opt_state: Any,
  x: jax.Array,
  y: jax.Array,
  depth: int,
  corrupt: jax.Array | None = None,
) -> tuple[jax.Array, model.Params]:
  """The loss (this replica's share, unscaled) and the gradients the run's
  update receives: scaled for the scaled runs, in the run's dtype. With
  ``corrupt`` (a bool scalar) the batch may be a corrupted one
  (``model.apply``)."""
  f = loss(spec, depth)
  if corrupt is not None:
    f = functools.partial(f, corrupt=corrupt)
  if spec.scaled:
    return ols.value_and_grad(f)(opt_state, params, x, y)
  return jax.value_and_grad(f)(params, x, y)
