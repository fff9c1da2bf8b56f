"""A pure-Python model of the loss-scaling rule, written from the README's
specification alone, that the tests compare the library against."""

import dataclasses
import math

import numpy as np

INT32_MAX = 2**31 - 1


@dataclasses.dataclass
class ModelConfig:
  dynamic: bool = True
  initial_scale: float = 2.0**15
  growth_steps: int = 2000
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  min_scale: float = 1.0
  max_scale: float = float(np.finfo(np.float32).max)
  hysteresis: int = 1
  backoff_on_nonfinite_loss: bool = True


@dataclasses.dataclass
class ModelState:
  scale: float
  counter: int = 0
  in_a_row: int = 0
  total: int = 0
  last_finite: bool = True
  overflows_in_a_row: int = 0
  nan_steps: int = 0
  nonfinite_loss_steps: int = 0


def f32(x: float) -> float:
  with np.errstate(over="ignore"):
    return float(np.float32(x))


def initial(config: ModelConfig) -> ModelState:
  return ModelState(scale=f32(config.initial_scale))


def step(
  state: ModelState,
  finite: bool,
  config: ModelConfig,
  loss_finite: bool = True,
  nan: bool = False,
) -> ModelState:
  """One update call; float32 arithmetic for the scale, as the library.

  `finite`: the gradients' check; `nan`: whether they held a NaN;
  `loss_finite`: the check of `value` (True when none is given).
  """
  s = ModelState(**dataclasses.asdict(state))
  if config.backoff_on_nonfinite_loss:
    # A non-finite loss skips the step whatever the gradients, and backs
    # the scale off as an overflow does.
    applied = finite and loss_finite
    blamed = not applied
  else:
    applied = finite and loss_finite
    blamed = not finite and loss_finite
  s.last_finite = applied
  if applied:
    s.in_a_row = 0
    s.overflows_in_a_row = 0
  else:
    s.in_a_row = min(s.in_a_row + 1, INT32_MAX)
    s.total = min(s.total + 1, INT32_MAX)
    if nan:
      s.nan_steps = min(s.nan_steps + 1, INT32_MAX)
    if not loss_finite:
      s.nonfinite_loss_steps = min(s.nonfinite_loss_steps + 1, INT32_MAX)
    if blamed:
      s.overflows_in_a_row = min(s.overflows_in_a_row + 1, INT32_MAX)
  if not config.dynamic:
    return s
  if applied:
    if s.counter + 1 >= config.growth_steps:
      grown = f32(s.scale * f32(config.growth_factor))
      if math.isfinite(grown) and grown <= config.max_scale:
        s.scale = grown
      s.counter = 0
    else:
      s.counter += 1
  elif blamed:
    s.counter = 0
    if s.overflows_in_a_row >= config.hysteresis:
      s.scale = max(
        f32(s.scale * f32(config.backoff_factor)), f32(config.min_scale)
      )
  return s


def history(
  config: ModelConfig, outcomes: list[tuple[bool, bool, bool]]
) -> list[tuple[bool, float, float]]:
  """`(skipped, scale before, scale after)` for each step of `outcomes`,
  each `(gradients finite, NaN among them, loss finite)`."""
  state, steps = initial(config), []
  for finite, nan, loss_finite in outcomes:
    before = state.scale
    state = step(
      state, finite, config, loss_finite=loss_finite, nan=nan and not finite
    )
    steps.append((not state.last_finite, before, state.scale))
  return steps
