"""`skip_report`: what the loss scaler did, and why steps skipped, in words;
`raise_if_stuck`: the same report as an error, when a run cannot recover.

Everything here runs on the host, at logging time: the state is read once
(one transfer of a few scalars), never per step. Every sentence is the
consequence of a predicate over the state and the configuration that made
it (`_Facts`): what the state cannot prove, the report does not say.
"""

import dataclasses
import functools
import numbers
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from optax_lossscale._access import locate as _locate
from optax_lossscale._access import nnx as _nnx
from optax_lossscale._core import placement as _placement
from optax_lossscale._core.config import LossScaleConfig
from optax_lossscale._core.state import (
  CAUSE_INF,
  CAUSE_LOSS,
  CAUSE_NAN,
  RECENT_SKIPS,
  LossScaleState,
  leaf_counts_tree,
)
from optax_lossscale._core.transformation import LossScaledTransformation
from optax_lossscale._diagnostics import format as _format

# At or above this share of skipped steps, a non-finite loss is the cause.
_MOSTLY = 0.5
# Parameters named in one row of the report, and in the finite list.
_NAMES_SHOWN = 6
# How deep `tx` is searched for its configuration (chains in wrappers).
_SEARCH_DEPTH = 32

# A skip as the report keeps it: (step, causes, scale before, scale after).
Event = tuple[int, tuple[str, ...], float, float]


@dataclasses.dataclass(frozen=True)
class SkipReport:
  """What :func:`skip_report` returns: the numbers the state holds, and
  ``str()`` of them in words (a few lines that read the same in a terminal
  and a notebook).

  Attributes:
    loss_scale: the scale now.
    dynamic: whether the scale is dynamic (it has a counter) or static.
    min_scale: the dynamic scale's floor, when ``tx`` was given; None for a
      static scale or without ``tx``.
    at_floor: whether the scale now sits at that floor (False where the
      floor is unknown or there is none).
    steps: steps seen, applied and skipped.
    total_skipped: steps skipped in total.
    skipped_in_a_row: steps skipped in a row, up to now.
    nan_steps: skipped steps whose gradients held a NaN (not only infs).
    nonfinite_loss_steps: skipped steps whose loss was not finite (counted
      only where ``update`` was given ``value=loss``).
    nan_told_apart: whether the check could tell a NaN in the gradients
      from an inf: True on one device, on ``Explicit`` meshes and under
      ``shard_map``; False on a mesh with ``Auto`` axes, where a NaN counts
      as an inf; None where the state's placement is unknown (host arrays).
    recent: the last skipped steps (up to 8), oldest first: ``(step,
      causes, scale_before, scale_after)``, causes a tuple of ``"inf"``,
      ``"NaN"``, ``"loss"``; ``scale_before`` is the scale the step ran at.
    leaves: with ``leaf_stats``, ``(path, steps not finite)`` for every
      gradient leaf, most first and in tree order among equals; None
      without.
    diagnosis: the conclusions in plain words, one sentence each.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=8.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.array([1.0, jnp.inf]), state)
    >>> report = ols.skip_report(state, tx)
    >>> report.total_skipped, report.loss_scale, report.recent
    (1, 4.0, ((0, ('inf',), 8.0, 4.0),))
    >>> print(report.diagnosis[0])  # doctest: +NORMALIZE_WHITESPACE
    1 step skipped (100%), each an overflow (inf) that lowered the scale:
    the dynamic scale finding its level, as designed.
  """

  loss_scale: float
  dynamic: bool
  min_scale: float | None
  at_floor: bool
  steps: int
  total_skipped: int
  skipped_in_a_row: int
  nan_steps: int
  nonfinite_loss_steps: int
  nan_told_apart: bool | None
  recent: tuple[Event, ...]
  leaves: tuple[tuple[str, int], ...] | None
  diagnosis: tuple[str, ...]

  def __str__(self) -> str:
    return "\n".join(_lines(self))

  def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
    # IPython and Jupyter show the text itself, not the dataclass repr.
    printer.text(str(self))


def skip_report(opt_state: Any, tx: Any = None) -> SkipReport:
  """A report of what the loss scale did and why steps were skipped.

  Call it at logging time (it reads the state once, on the host) and print
  it. It gives the scale (dynamic or static, and the floor); the steps
  skipped in total and in a row, with NaN in the gradients, and with a
  non-finite loss (counted where ``update`` is given ``value=loss``); the
  last few skips with the scale each ran at and left; with
  ``leaf_stats=True``, which parameters' gradients were not finite and which
  stayed finite; and a diagnosis in plain words. Each sentence follows from
  the state and ``tx``'s configuration: a static scale is never said to come
  down, a skip at the floor is one that ran there, and where the check could
  not tell a NaN from an inf (a mesh with ``Auto`` axes) the report says so.

  Args:
    opt_state: anything holding one scalar loss-scale state (see
      :func:`loss_scale`).
    tx: the transformation that made the state, optional: one that
      :func:`loss_scale_optimizer` or :func:`unscale_and_check` made, or a
      chain or wrapper around one (``optax.chain``, ``optax.MultiSteps``).
      Its floor, hysteresis and ``backoff_on_nonfinite_loss`` sharpen the
      diagnosis.

  Returns:
    A :class:`SkipReport`: ``print`` it, or read its fields.

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state, several, or
      a stacked one (read one member of an ensemble at a time); when
      ``tx``'s configuration contradicts the state (it did not make it).
    TypeError: when ``tx`` holds no loss-scale configuration, or several.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=4.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.array([1.0, jnp.nan]), state,
    ...                      value=jnp.float32(jnp.nan))
    >>> _, state = tx.update(jnp.ones(2), state, value=jnp.float32(1.0))
    >>> print(ols.skip_report(state, tx))
    loss scale 2: dynamic, floor 1
    steps: 2 seen; skipped: 1 in total (50%), 0 in a row now
      of the skipped: 1 with NaN in the gradients, 1 with a non-finite loss
    recent skips:
      step 0: NaN, loss; scale 4 -> 2
    diagnosis:
      - the loss itself was not finite in 1 of 1 skipped steps: a forward
        overflow or bad data, which no loss scale fixes. Find where with
        `ols.find_overflow` on a skipped step's batch;
        `backoff_on_nonfinite_loss=False` keeps such steps from lowering the
        scale.
  """
  config = _config_of(tx)
  facts = _read(opt_state, config)
  return _report(facts)


def raise_if_stuck(
  opt_state: Any,
  tx: Any,
  *,
  max_skips_at_floor: int | None = RECENT_SKIPS,
  max_nonfinite_losses: int | None = RECENT_SKIPS,
) -> None:
  """Raises a ``RuntimeError`` whose message is the :func:`skip_report`,
  when the run cannot recover; returns None otherwise.

  Call it from the training loop, after a (jitted) step or at logging
  time: it reads the state on the host (a few scalars), and is not part
  of the step. A run cannot recover when:

  - the last ``max_skips_at_floor`` steps were all skipped, and each ran at
    the floor of a dynamic scale (``min_scale``), which cannot go lower, or
    at a static scale, which never moves;
  - the loss (``value=loss``) was not finite on each of the last
    ``max_nonfinite_losses`` steps, which no loss scale fixes.

  Args:
    opt_state: anything holding one scalar loss-scale state (see
      :func:`loss_scale`).
    tx: the transformation that made the state (as for
      :func:`skip_report`), which gives the floor.
    max_skips_at_floor: how many skipped steps in a row at the floor (or
      at a static scale) stop the run: an int from 1 to 8 (the skips the
      state keeps), or None not to check.
    max_nonfinite_losses: how many steps in a row with a non-finite loss
      stop the run: an int from 1 to 8, or None not to check.

  Raises:
    RuntimeError: when the run cannot recover; its message says which case
      holds and then gives the report.
    TypeError, ValueError: on bad arguments, naming them; as
      :func:`skip_report` on a state or ``tx`` it cannot read.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0)
    >>> state = tx.init(jnp.zeros(2))
    >>> step = jax.jit(tx.update)
    >>> try:
    ...   for _ in range(4):  # at 2, then at the floor three times
    ...     _, state = step(jnp.array([1.0, jnp.inf]), state)
    ...     ols.raise_if_stuck(state, tx, max_skips_at_floor=3)
    ... except RuntimeError as stuck:
    ...   print(stuck)
    The run cannot recover: the last 3 steps were skipped, and each ran at the
    floor of the loss scale (1), which cannot go lower.
    <BLANKLINE>
    loss scale 1: dynamic, now at its floor (1)
    steps: 4 seen; skipped: 4 in total (100%), 4 in a row now
      of the skipped: 0 with NaN in the gradients, 0 with a non-finite loss
    recent skips:
      step 0: inf; scale 2 -> 1
      step 1: inf; scale 1 -> 1
      step 2: inf; scale 1 -> 1
      step 3: inf; scale 1 -> 1
    diagnosis:
      - the gradients overflowed to inf on 3 steps that ran at the floor (1): a
        value or a derivative beyond float16's range (65504) even at that scale;
        compute that part in float32, and find it with `ols.find_overflow`.
  """
  _check_limit("max_skips_at_floor", max_skips_at_floor)
  _check_limit("max_nonfinite_losses", max_nonfinite_losses)
  if max_skips_at_floor is None and max_nonfinite_losses is None:
    raise ValueError(
      "`max_skips_at_floor` and `max_nonfinite_losses` must not both be"
      " None: with neither, nothing is checked."
    )
  if tx is None:
    raise TypeError(
      "`tx` must be the transformation that made the state (it gives the"
      " floor of the scale), got None."
    )
  facts = _read(opt_state, _config_of(tx))
  reason = _nonfinite_losses(facts, max_nonfinite_losses) or _skips_at_floor(
    facts, max_skips_at_floor
  )
  if reason is not None:
    text = "\n".join(_format.wrap(f"The run cannot recover: {reason}"))
    raise RuntimeError(f"{text}\n\n{_report(facts)}")


def _check_limit(name: str, value: Any) -> None:
  accepted = f"an int from 1 to {RECENT_SKIPS} (the skips the state keeps)"
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
      f"`{name}` must be {accepted}, or None, got {value!r} of type"
      f" {type(value).__name__}."
    )
  if not 1 <= int(value) <= RECENT_SKIPS:
    raise ValueError(f"`{name}` must be {accepted}, or None, got {value!r}.")


def _nonfinite_losses(facts: "_Facts", limit: int | None) -> str | None:
  """Predicate: the last `limit` steps were skipped, each with a
  non-finite loss."""
  if limit is None or facts.in_a_row < limit:
    return None
  last = facts.recent[-limit:]
  if len(last) < limit or not all(_has(e, "loss") for e in last):
    return None
  return (
    f"the loss was not finite on each of the last {limit} steps (each"
    " skipped), which no loss scale fixes."
  )


def _skips_at_floor(facts: "_Facts", limit: int | None) -> str | None:
  """Predicate: the last `limit` steps were skipped, each at the floor of a
  dynamic scale, or at a static one."""
  if limit is None or facts.in_a_row < limit:
    return None
  last = facts.recent[-limit:]
  if len(last) < limit:
    return None
  if not facts.dynamic:
    scale = _format.scale(float(facts.state.loss_scale))
    return (
      f"the last {limit} steps were skipped, each at the static loss scale"
      f" ({scale}), which never changes."
    )
  if facts.floor is None or not all(facts.ran_at_floor(e) for e in last):
    return None
  return (
    f"the last {limit} steps were skipped, and each ran at the floor of the"
    f" loss scale ({_format.scale(facts.floor)}), which cannot go lower."
  )


# --- the configuration that made the state ---


def _config_of(tx: Any) -> LossScaleConfig | None:
  """The one loss-scale configuration `tx` holds (None for None)."""
  if tx is None:
    return None
  found = _configs_in(tx)
  if not found:
    raise TypeError(
      "`tx` must be the transformation that made the state: one built by"
      " `loss_scale_optimizer` or `unscale_and_check` (or"
      " `from_keras_config`), or a chain or wrapper around one, or None;"
      f" got {type(tx).__name__}, which holds no loss-scale configuration."
    )
  if len(found) > 1:
    raise TypeError(
      f"`tx` must hold one loss-scale configuration, got {type(tx).__name__}"
      f" holding {len(found)} different ones: pass the transformation that"
      " made the state."
    )
  return found[0]


def _configs_in(root: Any) -> list[LossScaleConfig]:
  """The distinct configurations in `root`: on a `LossScaledTransformation`,
  or closed over by the functions of a chain or wrapper around one."""
  found: list[LossScaleConfig] = []
  seen: set[int] = set()
  stack = [(root, 0)]
  while stack:
    x, depth = stack.pop()
    if id(x) in seen or depth > _SEARCH_DEPTH:
      continue
    seen.add(id(x))
    config = _config_on(x)
    if config is not None:
      if config not in found:
        found.append(config)
      continue
    stack += [(child, depth + 1) for child in _parts(x)]
  return found


def _config_on(x: Any) -> LossScaleConfig | None:
  if isinstance(x, LossScaleConfig):
    return x
  if isinstance(x, LossScaledTransformation):
    try:
      return x.loss_scale_config
    except AttributeError:  # its `update` was replaced
      return None
  return None


_OPAQUE = (str, bytes, numbers.Number, type, types.ModuleType, np.ndarray)


def _parts(x: Any) -> list[Any]:
  """What `x` holds that may hold a configuration: a function's closure, a
  partial's arguments, a container's items, an object's attributes."""
  if x is None or isinstance(x, _OPAQUE) or isinstance(x, jax.Array):
    return []
  if isinstance(x, LossScaledTransformation):
    # Its `update` was replaced: the configuration no longer describes it,
    # but a replacement that wraps a loss scaler holds that one's.
    return [x.update]
  if isinstance(x, functools.partial):
    return [x.func, *x.args, *x.keywords.values()]
  if isinstance(x, types.MethodType):
    return [x.__self__, x.__func__]
  if isinstance(x, types.FunctionType):
    return [
      *_cell_contents(x.__closure__ or ()),
      *(x.__defaults__ or ()),
      *(x.__kwdefaults__ or {}).values(),
      *([x.__wrapped__] if hasattr(x, "__wrapped__") else []),
    ]
  if isinstance(x, Mapping):
    return list(x.values())
  if isinstance(x, tuple | list | set | frozenset):
    return list(x)
  return list(getattr(x, "__dict__", {}).values())


def _cell_contents(cells: tuple[Any, ...]) -> list[Any]:
  contents = []
  for cell in cells:
    try:
      contents.append(cell.cell_contents)
    except ValueError:  # a cell not filled yet
      pass
  return contents


# --- the facts: the state and its configuration, read once ---


@dataclasses.dataclass(frozen=True)
class _Facts:
  state: LossScaleState  # host arrays
  config: LossScaleConfig | None
  nan_told_apart: bool | None
  recent: tuple[Event, ...]

  @property
  def dynamic(self) -> bool:
    return self.state.counter is not None

  @property
  def floor(self) -> float | None:
    """The dynamic scale's floor, where known."""
    if self.config is None or not self.dynamic:
      return None
    return self.config.min_scale

  @property
  def total_skipped(self) -> int:
    return int(self.state.total_skipped)

  @property
  def in_a_row(self) -> int:
    return int(self.state.skipped_in_a_row)

  @property
  def steps(self) -> int:
    return int(self.state.steps)

  @property
  def every_skip_shown(self) -> bool:
    return _every_skip_kept(self.total_skipped, self.recent)

  @property
  def streak(self) -> tuple[Event, ...]:
    """The skips of the current run of skipped steps that the state keeps
    (the last steps, all skipped), oldest first."""
    first = self.steps - self.in_a_row
    return tuple(e for e in self.recent if e[0] >= first)

  def ran_at_floor(self, event: Event) -> bool:
    return self.floor is not None and event[2] <= self.floor


def _read(opt_state: Any, config: LossScaleConfig | None) -> _Facts:
  told = _nan_told_apart(opt_state, config)
  state = jax.device_get(_locate.find_loss_scale_state(opt_state))
  if config is not None:
    _check_agrees(state, config)
  return _Facts(state, config, told, _recent(state))


def _nan_told_apart(
  opt_state: Any, config: LossScaleConfig | None
) -> bool | None:
  """Whether the check could tell a NaN from an inf, as the state's
  placement says: the scale lives where the gradients were checked. On a
  mesh with `Auto` axes the check counts a NaN as an inf
  (`_core.finite._reduced_where_it_lives`); under `shard_map` (an
  `axis_name`) every leaf is checked whole, where a NaN is seen."""
  if config is not None and config.axis_name is not None:
    return True
  scale = _nnx.unwrap(_locate.field(_locate.find_node(opt_state), "loss_scale"))
  sharding = getattr(scale, "sharding", None)
  if not isinstance(scale, jax.Array) or sharding is None:
    return None  # host arrays: where they were checked is unknown
  mesh = getattr(sharding, "mesh", None)
  if mesh is None:
    return True if len(sharding.device_set) == 1 else None
  return _placement.on_one_device(mesh) or _placement.all_axes_are(
    mesh, "Explicit"
  )


def _check_agrees(state: LossScaleState, config: LossScaleConfig) -> None:
  """Refuses a configuration the state contradicts: its settings would be
  reported as facts about a run they did not make."""
  dynamic = state.counter is not None
  if config.dynamic != dynamic:
    _contradiction(
      f"its scale is {'dynamic' if config.dynamic else 'static'}"
      f" (`dynamic={config.dynamic}`), the state's is"
      f" {'dynamic (it has a counter)' if dynamic else 'static (no counter)'}"
    )
  counted = state.leaf_notfinite is not None
  if config.leaf_stats != counted:
    _contradiction(
      f"it has `leaf_stats={config.leaf_stats}`, and the state"
      f" {'holds' if counted else 'holds no'} per-leaf counts"
    )
  # The scale itself is not checked against the configuration: `set_loss_scale`
  # may put it anywhere, legitimately.


def _contradiction(why: str) -> None:
  raise ValueError(
    f"`tx` did not make this state: {why}. Pass the transformation that"
    " made it, or `tx=None` to report the state alone."
  )


def _recent(state: LossScaleState) -> tuple[Event, ...]:
  events = state.recent_skips
  order = np.argsort(np.asarray(events.step), kind="stable")
  recent = [
    (
      int(events.step[i]),
      _causes(int(events.cause[i])),
      float(events.scale_before[i]),
      float(events.scale_after[i]),
    )
    for i in order
    if int(events.step[i]) >= 0  # -1: a slot not written yet
  ]
  return tuple(recent[-RECENT_SKIPS:])


def _causes(bits: int) -> tuple[str, ...]:
  names = ((CAUSE_INF, "inf"), (CAUSE_NAN, "NaN"), (CAUSE_LOSS, "loss"))
  return tuple(name for bit, name in names if bits & bit)


def _report(facts: _Facts) -> SkipReport:
  state, floor = facts.state, facts.floor
  scale = float(state.loss_scale)
  return SkipReport(
    loss_scale=scale,
    dynamic=facts.dynamic,
    min_scale=floor,
    at_floor=floor is not None and scale <= floor,
    steps=facts.steps,
    total_skipped=facts.total_skipped,
    skipped_in_a_row=facts.in_a_row,
    nan_steps=int(state.nan_steps),
    nonfinite_loss_steps=int(state.nonfinite_loss_steps),
    nan_told_apart=facts.nan_told_apart,
    recent=facts.recent,
    leaves=_leaves(state),
    diagnosis=_diagnosis(facts),
  )


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


# --- the diagnosis: each sentence with the predicate that allows it ---


def _diagnosis(facts: _Facts) -> tuple[str, ...]:
  if facts.total_skipped == 0:
    return (
      "no step was skipped: the gradients of every step were finite at the"
      " scale it ran at.",
    )
  found = [
    sentence(facts)
    for sentence in (
      _every_batch,
      _bad_losses,
      _at_floor,
      _coming_down,
      _held_by_hysteresis,
      _finding_its_level,
      _static,
      _mesh_cannot_tell,
      _parameters,
    )
  ]
  said = tuple(sentence for sentence in found if sentence is not None)
  return said or (
    f"{_format.count(facts.total_skipped, 'step')} skipped"
    f" ({_format.share(facts.total_skipped, facts.steps)}), for the causes"
    " counted above; the state points to none of the cases this report knows.",
  )


def _has(event: Event, cause: str) -> bool:
  return cause in event[1]


def _gradients_not_finite(event: Event) -> bool:
  return _has(event, "inf") or _has(event, "NaN")


def _gradients_only(event: Event) -> bool:
  """Skipped for its gradients, with no non-finite loss recorded."""
  return not _has(event, "loss") and _gradients_not_finite(event)


def _every_skip_kept(total_skipped: int, recent: tuple[Event, ...]) -> bool:
  """The state keeps every skip of the run (at most `RECENT_SKIPS`)."""
  return total_skipped == len(recent)


def _gradients_finite_on_every_skip(
  total_skipped: int, recent: tuple[Event, ...]
) -> bool:
  """Every skip is kept in the state, and none recorded non-finite
  gradients (each was for the loss alone)."""
  return _every_skip_kept(total_skipped, recent) and not any(
    _gradients_not_finite(e) for e in recent
  )


def _lowered(event: Event) -> bool:
  return event[3] < event[2]


def _every_batch(facts: _Facts) -> str | None:
  """Predicate: the loss was not finite on every step seen (two or more)."""
  losses = int(facts.state.nonfinite_loss_steps)
  if facts.steps < 2 or losses != facts.steps:
    return None
  return (
    f"the loss was not finite on every one of the {facts.steps} steps,"
    " every batch: the model's forward pass, not the data (unless every"
    " batch is bad), which no loss scale fixes. Find where with"
    " `ols.find_overflow` on any batch."
  )


def _bad_losses(facts: _Facts) -> str | None:
  """Predicate: at least half of the skipped steps had a non-finite loss,
  and not every step did (`_every_batch` says that)."""
  losses = int(facts.state.nonfinite_loss_steps)
  if not losses or losses < _MOSTLY * facts.total_skipped:
    return None
  if _every_batch(facts) is not None:
    return None
  text = (
    f"the loss itself was not finite in {losses} of {facts.total_skipped}"
    " skipped steps: a forward overflow or bad data, which no loss scale fixes."
    " Find where with `ols.find_overflow` on a skipped step's batch"
  )
  return text + _loss_and_scale(facts) + "."


def _loss_and_scale(facts: _Facts) -> str:
  """What such steps did to the scale, as far as the state says."""
  if not facts.dynamic:
    return ""
  if facts.config is not None and not facts.config.backoff_on_nonfinite_loss:
    # The rule leaves the scale on such a step (`_core.rule.next_state`).
    return "; the scale was left as it was on those steps"
  return (
    "; `backoff_on_nonfinite_loss=False` keeps such steps from lowering the"
    " scale"
  )


def _overflow_words(facts: _Facts) -> str:
  """How an inf-only skip is named: the check's own word, or, where it
  could not tell a NaN from an inf, both."""
  if facts.nan_told_apart:
    return "overflowed to inf"
  return (
    "overflowed (inf, or a NaN on an Auto mesh, which this check cannot"
    " tell apart)"
  )


def _at_floor(facts: _Facts) -> str | None:
  """Predicate: skips of the current run of skipped steps ran at the floor
  (their scale before was the floor), for their gradients."""
  at_floor = [
    e for e in facts.streak if facts.ran_at_floor(e) and _gradients_only(e)
  ]
  if not at_floor:
    return None
  floor = _format.scale(facts.floor or 0.0)
  # The state keeps the last skips only. Within a run of skips the scale
  # never grows, so earlier ones may have run at the floor only if the
  # oldest one kept did.
  some = (
    "at least "
    if len(facts.streak) < facts.in_a_row
    and facts.ran_at_floor(facts.streak[0])
    else ""
  )
  howmany = f"{some}{_format.count(len(at_floor), 'step')}"
  nan = [e for e in at_floor if _has(e, "NaN")]
  if len(nan) == len(at_floor):
    return (
      f"NaN in the gradients {_down_to_the_floor(facts)}on {howmany} that"
      f" ran at the floor ({floor}), with no non-finite loss recorded:"
      " float16's range exceeded in a value or a derivative (a norm of tiny"
      " values, rsqrt's derivative, a cube), or a bug (a log or square root"
      " of 0, a division by zero). `ols.find_overflow` on a skipped step's"
      " batch names the operation."
    )
  if not nan and facts.nan_told_apart:
    return (
      f"the gradients {_overflow_words(facts)} on {howmany} that ran at the"
      f" floor ({floor}): a value or a derivative beyond float16's range"
      f" ({_format.number(_format.FLOAT16_MAX)}) even at that scale"
      f"{_lower_floor(facts)}; compute that part in float32, and find it"
      " with `ols.find_overflow`."
    )
  what = (
    f"{len(nan)} with NaN, {len(at_floor) - len(nan)} with inf"
    if facts.nan_told_apart
    else f"{len(nan)} with NaN, {len(at_floor) - len(nan)} with inf (or a"
    " NaN on an Auto mesh, which this check cannot tell apart)"
  )
  return (
    f"the gradients were not finite on {howmany} that ran at the floor"
    f" ({floor}) ({what}): float16's range"
    f" ({_format.number(_format.FLOAT16_MAX)}) exceeded in a value or a"
    " derivative even at that scale, or a bug (a log or square root of 0, a"
    " division by zero). `ols.find_overflow` on a skipped step's batch"
    " names the operation."
  )


def _down_to_the_floor(facts: _Facts) -> str:
  """`at every scale down to the floor `, where the state shows the whole
  run of skipped steps, each with NaN, from above the floor down to it."""
  streak = facts.streak
  if (
    len(streak) == facts.in_a_row
    and streak
    and not facts.ran_at_floor(streak[0])
    and all(_has(e, "NaN") and _gradients_only(e) for e in streak)
  ):
    return (
      "at every scale down to the floor"
      f" ({_format.count(facts.in_a_row, 'step')} skipped in a row), "
    )
  return ""


def _lower_floor(facts: _Facts) -> str:
  if facts.floor is not None and facts.floor > 1:
    return f" (a `min_scale` below {_format.scale(facts.floor)} may avoid it)"
  return ""


def _coming_down(facts: _Facts) -> str | None:
  """Predicate: a dynamic scale, two or more steps skipped in a row, the
  last of which was for its gradients and lowered the scale."""
  if not facts.dynamic or facts.in_a_row < 2 or not facts.streak:
    return None
  last = facts.streak[-1]
  if not (_lowered(last) and _gradients_only(last)):
    return None
  text = (
    f"{facts.in_a_row} steps skipped in a row, the last lowering the scale"
    f" from {_format.scale(last[2])} to {_format.scale(last[3])}: the"
    " scale is still coming down to a level the gradients fit in"
  )
  if facts.floor is not None and last[3] <= facts.floor:
    text += "; it has now reached its floor, and cannot go lower"
  return text + "."


def _held_by_hysteresis(facts: _Facts) -> str | None:
  """Predicate: skips for the gradients that left a dynamic scale where it
  was, above the floor: hysteresis tolerated them (with the floor unknown,
  the floor may have)."""
  if not facts.dynamic:
    return None
  held = [
    e
    for e in facts.recent
    if _gradients_only(e) and not _lowered(e) and not facts.ran_at_floor(e)
  ]
  if not held:
    return None
  shown = len(facts.recent)
  of = (
    f"{len(held)} of the {shown} skipped steps"
    if facts.every_skip_shown
    else f"{len(held)} of the last {shown} skipped steps"
  )
  if facts.config is None:
    why = "hysteresis tolerated them, or the scale sat at its floor"
  else:
    hysteresis = facts.config.hysteresis
    why = (
      f"`hysteresis={hysteresis}` lowers it only when {hysteresis} such"
      " skips come in a row"
    )
  return (
    f"{of} had non-finite gradients and left the scale where it was: {why}."
  )


def _finding_its_level(facts: _Facts) -> str | None:
  """Predicate: a dynamic scale, fewer than two steps skipped in a row
  (`_coming_down` speaks of a run), and every skip the state keeps was for
  the gradients and lowered the scale."""
  if not facts.dynamic or facts.in_a_row >= 2 or not facts.recent:
    return None
  if not all(_gradients_only(e) and _lowered(e) for e in facts.recent):
    return None
  if all(not _has(e, "NaN") for e in facts.recent) and facts.nan_told_apart:
    what = "an overflow (inf)"
  else:
    what = "a skip for non-finite gradients"
  skipped = (
    f"{_format.count(facts.total_skipped, 'step')} skipped"
    f" ({_format.share(facts.total_skipped, facts.steps)})"
  )
  if facts.every_skip_shown:
    return (
      f"{skipped}, each {what} that lowered the scale: the dynamic scale"
      " finding its level, as designed."
    )
  return (
    f"{skipped}; the last {len(facts.recent)}, each {what} that lowered the"
    " scale: the dynamic scale finding its level."
  )


def _static(facts: _Facts) -> str | None:
  """Predicate: a static scale, and skips for the gradients among those
  the state keeps."""
  if facts.dynamic:
    return None
  gradients = [e for e in facts.recent if _gradients_only(e)]
  if not gradients:
    return None
  of = "" if facts.every_skip_shown else "the last "
  return (
    f"{len(gradients)} of {of}{len(facts.recent)} skipped steps had"
    " non-finite gradients at the static scale"
    f" {_format.scale(float(facts.state.loss_scale))}, which never moves:"
    " where the scale makes them, a lower static scale or `dynamic=True`"
    " avoids them; `ols.find_overflow` names the operation."
  )


def _mesh_cannot_tell(facts: _Facts) -> str | None:
  """Predicate: the state lives on a mesh with `Auto` axes, and some skip
  may have had non-finite gradients (else there was no NaN to tell)."""
  if facts.nan_told_apart is not False:
    return None
  if _gradients_finite_on_every_skip(facts.total_skipped, facts.recent):
    return None
  return (
    "these gradients live on a mesh with Auto axes, where the check counts a"
    " NaN as an inf: a skip written `inf or NaN` may have been either, and"
    " the NaN count is a lower bound."
  )


def _parameters(facts: _Facts) -> str | None:
  """Predicate: per-leaf counts; which stayed finite, which did not."""
  leaves = _leaves(facts.state)
  if leaves is None:
    return None
  hit = [name for name, count in leaves if count]
  clean = [name for name, count in leaves if not count]
  if not hit:
    return (
      "every parameter's gradient stayed finite on every step: the skips"
      " came from the loss (or a scale below 1), not the gradients."
    )
  text = (
    f"the gradients of {len(hit)} of {len(leaves)} parameters were not"
    " finite on some step"
  )
  if clean:
    text += (
      f"; {len(clean)} stayed finite on every step"
      f" ({_format.names(clean, _NAMES_SHOWN)}): whatever made the others"
      " non-finite did not reach these, which locates it"
    )
  return text + "."


# --- the text ---


def _lines(report: SkipReport) -> list[str]:
  lines = [_scale_line(report)]
  lines.append(
    f"steps: {report.steps} seen; skipped: {report.total_skipped} in total"
    f" ({_format.share(report.total_skipped, report.steps)}),"
    f" {report.skipped_in_a_row} in a row now"
  )
  if report.total_skipped:
    nan = f"{report.nan_steps} with NaN in the gradients"
    if report.nan_told_apart is False and not (
      _gradients_finite_on_every_skip(report.total_skipped, report.recent)
    ):
      nan += " (at least: this mesh counts a NaN as an inf)"
    lines += _format.wrap(
      f"of the skipped: {nan}, {report.nonfinite_loss_steps} with a"
      " non-finite loss",
      indent="  ",
      hanging="    ",
    )
  if report.recent:
    lines.append("recent skips:")
    lines += [
      f"  step {step}: {_cause_words(causes, report)}; scale"
      f" {_format.scale(before)} -> {_format.scale(after)}"
      for step, causes, before, after in report.recent
    ]
  if report.leaves:
    lines += _leaf_lines(report.leaves)
  lines.append("diagnosis:")
  for item in report.diagnosis:
    lines += _format.wrap(f"- {item}", indent="  ", hanging="    ")
  return lines


def _scale_line(report: SkipReport) -> str:
  scale = f"loss scale {_format.scale(report.loss_scale)}"
  if not report.dynamic:
    return f"{scale}: static (it never changes)"
  if report.min_scale is None:
    return f"{scale}: dynamic, floor unknown (pass `tx`)"
  floor = _format.scale(report.min_scale)
  if report.at_floor:
    return f"{scale}: dynamic, now at its floor ({floor})"
  return f"{scale}: dynamic, floor {floor}"


def _cause_words(causes: tuple[str, ...], report: SkipReport) -> str:
  words = {"inf": "inf", "NaN": "NaN", "loss": "loss"}
  if report.nan_told_apart is False:
    words["inf"] = "inf or NaN"
  return ", ".join(words[c] for c in causes) or "a scale below 1"


def _leaf_lines(leaves: tuple[tuple[str, int], ...]) -> list[str]:
  """The parameters not finite, one row per count (equal counts share a
  row: nothing in the state ranks them), then those that stayed finite."""
  by_count: dict[int, list[str]] = {}
  for name, count in leaves:
    by_count.setdefault(count, []).append(name)
  hit = [(count, names) for count, names in by_count.items() if count]
  lines = []
  if hit:
    lines.append(
      "parameters whose gradients were not finite, most often first:"
    )
    width = max(len(_format.count(count, "step")) for count, _ in hit)
    for count, names in hit[:_NAMES_SHOWN]:
      steps = _format.count(count, "step").ljust(width)
      lines += _format.wrap(
        f"{steps}  {', '.join(names)}",
        indent="  ",
        hanging=" " * (width + 4),
      )
    if len(hit) > _NAMES_SHOWN:
      more = sum(len(names) for _, names in hit[_NAMES_SHOWN:])
      lines.append(f"  ... and {_format.count(more, 'parameter')} more")
  clean = by_count.get(0, [])
  if clean and hit:
    lines += _format.wrap(
      "parameters whose gradients stayed finite:"
      f" {', '.join(clean[: 4 * _NAMES_SHOWN])}"
      + (
        f" and {len(clean) - 4 * _NAMES_SHOWN} more"
        if len(clean) > 4 * _NAMES_SHOWN
        else ""
      )
    )
  return lines
