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


@dataclasses.dataclass
class ModelState:
  scale: float
  counter: int = 0
  in_a_row: int = 0
  total: int = 0
  last_finite: bool = True


def f32(x: float) -> float:
  with np.errstate(over="ignore"):
    return float(np.float32(x))


def initial(config: ModelConfig) -> ModelState:
  return ModelState(scale=f32(config.initial_scale))


def step(state: ModelState, finite: bool, config: ModelConfig) -> ModelState:
  """One update call; float32 arithmetic for the scale, as the library."""
  s = ModelState(**dataclasses.asdict(state))
  s.last_finite = finite
  if finite:
    s.in_a_row = 0
  else:
    s.in_a_row = min(s.in_a_row + 1, INT32_MAX)
    s.total = min(s.total + 1, INT32_MAX)
  if not config.dynamic:
    return s
  if finite:
    if s.counter + 1 >= config.growth_steps:
      grown = f32(s.scale * f32(config.growth_factor))
      if math.isfinite(grown) and grown <= config.max_scale:
        s.scale = grown
      s.counter = 0
    else:
      s.counter += 1
  else:
    s.counter = 0
    if s.in_a_row >= config.hysteresis:
      s.scale = max(
        f32(s.scale * f32(config.backoff_factor)), f32(config.min_scale)
      )
  return s
