"""The facts a skip report reads: the loss-scale state, once, on the host.

Every fact comes from what the state recorded (its counters, the ring of
recent skips with what each step's check found, the configuration of its
last update); a transformation passed beside it is only checked against
it, never read for the run.
"""

import dataclasses
from typing import Any

import jax
import numpy as np

from optax_lossscale._access import locate as _locate
from optax_lossscale._core.config import LossScaleConfig
from optax_lossscale._core.state import (
  CAUSE_INF,
  CAUSE_LOSS,
  CAUSE_NAN,
  CAUSE_SCALE,
  RECENT_SKIPS,
  LossScaleState,
  check_scalar_state,
  is_of_an_earlier_release,
  leaf_counts_tree,
)
from optax_lossscale._core.transformation import LossScaledTransformation

# A counter at this value has saturated: it stopped counting there.
SATURATED = 2**31 - 1

# The causes' names, by bit of `SkipEvents.cause`.
_CAUSES = (
  (CAUSE_INF, "inf"),
  (CAUSE_NAN, "NaN"),
  (CAUSE_LOSS, "loss"),
  (CAUSE_SCALE, "scale below 1"),
)


@dataclasses.dataclass(frozen=True)
class Event:
  """A kept skip, with what its step recorded."""

  step: int
  causes: tuple[str, ...]
  before: float  # the scale it ran at
  after: float  # the scale it left
  floor: float | None  # the dynamic scale's floor then; None if static
  nan_told_apart: bool
  hysteresis_held: bool
  loss_not_blamed: bool
  recorded: bool  # False: an earlier release's, whose flags claim nothing

  @property
  def as_tuple(self) -> tuple[int, tuple[str, ...], float, float]:
    """`(step, causes, scale before, scale after)`, as `SkipReport.recent`
    holds it."""
    return self.step, self.causes, self.before, self.after

  def has(self, cause: str) -> bool:
    return cause in self.causes

  @property
  def gradients_only(self) -> bool:
    """Skipped for its gradients (inf or NaN), the loss not recorded as
    non-finite."""
    return not self.has("loss") and (self.has("inf") or self.has("NaN"))

  @property
  def lowered(self) -> bool:
    return self.after < self.before

  @property
  def ran_at_floor(self) -> bool:
    return self.floor is not None and self.before == self.floor


@dataclasses.dataclass(frozen=True)
class Config:
  """The configuration the state recorded at its last update."""

  min_scale: float
  max_scale: float
  growth_steps: int
  growth_factor: float
  backoff_factor: float
  hysteresis: int
  backoff_on_nonfinite_loss: bool


@dataclasses.dataclass(frozen=True)
class Facts:
  """The state, read once, as Python values."""

  scale: float
  dynamic: bool
  config: Config | None  # None where the state has not recorded one
  steps: int
  total_skipped: int
  in_a_row: int
  nan_steps: int
  nonfinite_loss_steps: int
  since_steps: int  # where the NaN, loss and per-leaf counts began
  since_skipped: int
  nan_steps_exact: bool
  events: tuple[Event, ...]  # the kept skips, in the order they came
  leaves: tuple[tuple[str, int], ...] | None

  @property
  def floor(self) -> float | None:
    """The dynamic scale's floor, as the state recorded it."""
    if not self.dynamic or self.config is None:
      return None
    return self.config.min_scale

  @property
  def upgraded(self) -> bool:
    """Whether some counts began after the first step (an upgrade)."""
    return self.since_steps > 0

  @property
  def skipped_counted(self) -> int:
    """The skips since the counts began."""
    return self.total_skipped - self.since_skipped

  @property
  def steps_counted(self) -> int:
    return self.steps - self.since_steps

  @property
  def every_skip_kept(self) -> bool:
    """Whether the ring keeps every skip since the counts began."""
    return self.total_skipped < SATURATED and self.skipped_counted == len(
      self.events
    )

  @property
  def streak(self) -> tuple[Event, ...]:
    """The kept skips of the current run of skipped steps, oldest first:
    the last ones the ring holds (skips in a row are the latest skips)."""
    return self.events[
      len(self.events) - min(self.in_a_row, len(self.events)) :
    ]

  @property
  def nan_told_apart(self) -> bool | None:
    """Whether every check recorded could tell a NaN from an inf: False
    where a kept skip's could not, or the NaN count is not exact; None
    where no skip recorded it."""
    recorded = [e for e in self.events if e.recorded]
    if not self.nan_steps_exact or any(not e.nan_told_apart for e in recorded):
      return False
    return True if recorded else None


def read(opt_state: Any, tx: Any = None) -> Facts:
  """The facts of the one loss-scale state in `opt_state`; `tx`, where
  given, must not contradict them."""
  state = _locate.typed(_locate.find_node(opt_state))
  _refuse_tracers(state)
  state = jax.device_get(state)
  check_scalar_state(state)
  if is_of_an_earlier_release(state):
    raise ValueError(
      "The loss-scale state is of an earlier release of optax_lossscale (a"
      " pickle of 0.2.0, say): it lacks the facts this report reads. Pass"
      " the restored state through `optax_lossscale.upgrade_state` first"
      " (docs/migration.md)."
    )
  _check_tx(tx, state)
  return _facts_of(state)


def _refuse_tracers(state: LossScaleState) -> None:
  """The report reads the state's values on the host: under `jit` (or
  another transformation) they are not there yet."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
    raise TypeError(
      "`skip_report` and `raise_if_stuck` read the loss-scale state's"
      " values on the host, and were given traced values (they were called"
      " inside `jax.jit` or another transformation). Call them outside the"
      " jitted step, on the state it returns: `_, opt_state = step(...)`,"
      " then `ols.skip_report(opt_state)`; it costs one transfer of a few"
      " scalars, at logging time."
    )


def _check_tx(tx: Any, state: LossScaleState) -> None:
  """Refuses a `tx` that carries a configuration the state contradicts: its
  settings are not the run's. A transformation that carries none (a chain
  or wrapper around a loss scaler, `inject_hyperparams` around one) has
  nothing to check."""
  if tx is None:
    return
  if not (
    callable(getattr(tx, "init", None))
    and callable(getattr(tx, "update", None))
  ):
    raise TypeError(
      "`tx` must be an optax transformation (the one that made the state,"
      " or a chain or wrapper around it), or None; got"
      f" {tx!r} of type {type(tx).__name__}."
    )
  config = _carried(tx)
  if config is None:
    return
  differences = _differences(config, state)
  if differences:
    raise ValueError(
      "`tx` did not make this state: "
      + "; ".join(differences)
      + ". Pass the transformation that made it, or no `tx`: the report"
      " reads the configuration from the state itself."
    )


def _carried(tx: Any) -> LossScaleConfig | None:
  if not isinstance(tx, LossScaledTransformation):
    return None
  try:
    return tx.loss_scale_config
  except AttributeError:  # its `update` was replaced
    return None


def _differences(config: LossScaleConfig, state: LossScaleState) -> list[str]:
  """What `config` says otherwise than the state, in words."""
  found = []
  dynamic = state.counter is not None
  if config.dynamic != dynamic:
    found.append(
      f"its scale is {'dynamic' if config.dynamic else 'static'}"
      f" (`dynamic={config.dynamic}`), the state's is"
      f" {'dynamic (it has a counter)' if dynamic else 'static (no counter)'}"
    )
  counted = state.leaf_notfinite is not None
  if config.leaf_stats != counted:
    found.append(
      f"it has `leaf_stats={config.leaf_stats}`, and the state"
      f" {'holds' if counted else 'holds no'} per-leaf counts"
    )
  recorded = state.config
  assert recorded is not None  # today's state (`read`)
  if not bool(recorded.known):
    return found  # an upgraded state, not updated yet: nothing recorded
  for name in (
    "min_scale",
    "max_scale",
    "growth_steps",
    "growth_factor",
    "backoff_factor",
    "hysteresis",
    "backoff_on_nonfinite_loss",
  ):
    ours, theirs = getattr(config, name), getattr(recorded, name).item()
    if ours != theirs:
      found.append(
        f"it has `{name}={ours!r}`, and the state was last updated with"
        f" `{name}={theirs!r}`"
      )
  return found


def _facts_of(state: LossScaleState) -> Facts:
  config, since = state.config, state.counted_since
  # Today's state (`read` refuses an earlier release's).
  assert config is not None and since is not None
  return Facts(
    scale=float(state.loss_scale),
    dynamic=state.counter is not None,
    config=_config_of(config) if bool(config.known) else None,
    steps=int(state.steps),
    total_skipped=int(state.total_skipped),
    in_a_row=int(state.skipped_in_a_row),
    nan_steps=int(state.nan_steps),
    nonfinite_loss_steps=int(state.nonfinite_loss_steps),
    since_steps=int(since.steps),
    since_skipped=int(since.total_skipped),
    nan_steps_exact=bool(state.nan_steps_exact),
    events=_events(state),
    leaves=_leaves(state),
  )


def _config_of(recorded: Any) -> Config:
  return Config(
    min_scale=float(recorded.min_scale),
    max_scale=float(recorded.max_scale),
    growth_steps=int(recorded.growth_steps),
    growth_factor=float(recorded.growth_factor),
    backoff_factor=float(recorded.backoff_factor),
    hysteresis=int(recorded.hysteresis),
    backoff_on_nonfinite_loss=bool(recorded.backoff_on_nonfinite_loss),
  )


def _events(state: LossScaleState) -> tuple[Event, ...]:
  """The kept skips in the order they were written: from the ring's next
  slot (the oldest, once the ring is full) round to the one before it."""
  ring = {
    name: np.asarray(value)
    for name, value in state.recent_skips._asdict().items()
  }
  start = int(ring["next_slot"])
  order = [(start + i) % RECENT_SKIPS for i in range(RECENT_SKIPS)]
  dynamic = state.counter is not None
  events = []
  for i in order:
    step = int(ring["step"][i])
    if step < 0:  # a slot not written yet
      continue
    floor = float(ring["floor"][i])
    events.append(
      Event(
        step=step,
        causes=_causes(int(ring["cause"][i])),
        before=float(ring["scale_before"][i]),
        after=float(ring["scale_after"][i]),
        # 0: no floor recorded (a static scale, or an earlier release).
        floor=floor if dynamic and floor > 0 else None,
        nan_told_apart=bool(ring["nan_told_apart"][i]),
        hysteresis_held=bool(ring["hysteresis_held"][i]),
        loss_not_blamed=bool(ring["loss_not_blamed"][i]),
        recorded=bool(ring["recorded"][i]),
      )
    )
  return tuple(events)


def _causes(bits: int) -> tuple[str, ...]:
  return tuple(name for bit, name in _CAUSES if bits & bit)


def _leaves(state: LossScaleState) -> tuple[tuple[str, int], ...] | None:
  """Each leaf's count, most first; among equal counts in tree order (the
  gradients' own order: no ranking that the counts do not make)."""
  if state.leaf_notfinite is None:
    return None
  counted = [
    (_path_name(path), int(count))
    for path, count in jax.tree_util.tree_flatten_with_path(
      leaf_counts_tree(state.leaf_notfinite)
    )[0]
  ]
  return tuple(sorted(counted, key=lambda item: -item[1]))


def _path_name(path: Any) -> str:
  """`blocks/3/attn/kernel` for a key path."""
  parts = []
  for key in path:
    for attribute in ("key", "name", "idx"):
      if hasattr(key, attribute):
        parts.append(str(getattr(key, attribute)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts) or "(the gradient)"
