"""A pure-Python model of the loss-scaling rule, written from the README's
specification alone, that the tests compare the library against: the
scale, the counters, and what each skip records (the ring of the last
eight, with the scale it ran at and left, the floor, whether the check
told a NaN from an inf, whether hysteresis held the scale, whether a
non-finite loss was left uncounted)."""

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


RECENT_SKIPS = 8


@dataclasses.dataclass(frozen=True)
class ModelEvent:
  """A skip as the state records it."""

  step: int
  causes: tuple[str, ...]  # of "inf", "NaN", "loss", "scale below 1"
  before: float
  after: float
  floor: float | None  # None for a static scale
  nan_told_apart: bool
  hysteresis_held: bool
  loss_not_blamed: bool


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
  steps: int = 0
  nan_steps_exact: bool = True
  # The last `RECENT_SKIPS` skips, oldest first.
  events: tuple[ModelEvent, ...] = ()


def f32(x: float) -> float:
  with np.errstate(over="ignore"):
    return float(np.float32(x))


def initial(config: ModelConfig) -> ModelState:
  return ModelState(scale=f32(config.initial_scale))


def checks_below_one(config: ModelConfig) -> bool:
  """Whether the check reads the unscaled gradients, so that a scale below
  1 is checked (a configuration whose scale can go there); else it reads
  them before the division, and vouches only for a scale of at least 1."""
  if config.dynamic:
    return config.min_scale < 1
  return config.initial_scale < 1


def step(
  state: ModelState,
  finite: bool,
  config: ModelConfig,
  loss_finite: bool = True,
  nan: bool = False,
  told: bool = True,
) -> ModelState:
  """One update call; float32 arithmetic for the scale, as the library.

  `finite`: the gradients' check; `nan`: whether they held a NaN;
  `loss_finite`: the check of `value` (True when none is given); `told`:
  whether the check tells a NaN from an inf (not on an `Auto` mesh, where
  a NaN counts as an inf).
  """
  s = ModelState(**dataclasses.asdict(state))
  s.events = state.events
  nan = nan and not finite and told
  usable = s.scale >= 1 or checks_below_one(config)
  applied = finite and loss_finite and usable
  if config.backoff_on_nonfinite_loss:
    # A non-finite loss skips the step whatever the gradients, and backs
    # the scale off as an overflow does.
    blamed = not applied
  else:
    blamed = not applied and loss_finite
  before = s.scale
  backed_off = False
  s.last_finite = applied
  if applied:
    s.in_a_row = 0
    s.overflows_in_a_row = 0
  else:
    s.in_a_row = _inc(s.in_a_row)
    s.total = _inc(s.total)
    if nan:
      s.nan_steps = _inc(s.nan_steps)
    if not loss_finite:
      s.nonfinite_loss_steps = _inc(s.nonfinite_loss_steps)
    if blamed:
      s.overflows_in_a_row = _inc(s.overflows_in_a_row)
    if not finite and not told:
      s.nan_steps_exact = False
  if config.dynamic:
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
        backed_off = True
        s.scale = max(
          f32(s.scale * f32(config.backoff_factor)), f32(config.min_scale)
        )
  if not applied:
    causes = []
    if not finite:
      causes.append("NaN" if nan else "inf")
    if not loss_finite:
      causes.append("loss")
    if not usable:
      causes.append("scale below 1")
    event = ModelEvent(
      step=state.steps,
      causes=tuple(causes),
      before=before,
      after=s.scale,
      floor=f32(config.min_scale) if config.dynamic else None,
      nan_told_apart=told,
      hysteresis_held=config.dynamic and blamed and not backed_off,
      loss_not_blamed=config.dynamic and not blamed,
    )
    s.events = (*state.events, event)[-RECENT_SKIPS:]
  s.steps = _inc(s.steps)
  return s


def _inc(count: int) -> int:
  return min(count + 1, INT32_MAX)


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
