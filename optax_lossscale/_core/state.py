"""The loss-scale state: fixed-dtype NamedTuples, so that jitted steps never
retrace and checkpoints carry named fields."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_lossscale._core.config import LossScaleConfig

SCALE_DTYPE = jnp.float32
COUNTER_DTYPE = jnp.int32


# Skip events kept in the state, the most recent last (a ring buffer).
RECENT_SKIPS = 8

# Why a step was skipped, as bits of `SkipEvents.cause`.
CAUSE_INF = 1  # a gradient overflowed to inf
CAUSE_NAN = 2  # a gradient held a NaN
CAUSE_LOSS = 4  # the loss (`value`) itself was not finite
# The scale was below 1 where the check reads the gradients before the
# division, which it can vouch for only at a scale of at least 1.
CAUSE_SCALE = 8


class SkipEvents(NamedTuple):
  """The last :data:`RECENT_SKIPS` skipped steps, a ring: each skip is
  written at ``next_slot``, so that once all are written the oldest sits
  there (the report reads them in the order they came).

  Each field holds one value per skip, ``[k]``; unwritten slots have
  ``step`` -1. The fields after ``scale_after`` are ``None`` in a state an
  earlier release saved (pass it through :func:`upgrade_state`); a skip
  that release recorded has ``recorded`` False.

  Attributes:
    step: the step's number (0-based, saturating at ``2**31 - 1``),
      ``int32[k]``; -1 where no skip has been recorded yet.
    cause: bits of why: 1 inf, 2 NaN in the gradients, 4 a non-finite loss,
      8 a scale below 1 that the check could not vouch for, ``int32[k]``.
    scale_before: the scale the step ran at, ``float32[k]``.
    scale_after: the scale after it, ``float32[k]``.
    floor: the floor (``min_scale``) of the dynamic scale in force at that
      step, ``float32[k]``; 0 for a static scale.
    nan_told_apart: whether that step's check could tell a NaN in the
      gradients from an inf, ``bool[k]``: False where some leaf was
      checked on a mesh with ``Auto`` axes, where a NaN counts as an inf.
    hysteresis_held: whether hysteresis held the dynamic scale: the skip
      counted against the scale, but fewer than ``hysteresis`` such skips
      had come since the last applied step, ``bool[k]``.
    loss_not_blamed: whether the skip, for a non-finite loss, left the
      dynamic scale, its counter and hysteresis as they were
      (``backoff_on_nonfinite_loss=False``), ``bool[k]``.
    recorded: whether the skip was recorded with the fields above (from
      ``floor`` on), ``bool[k]``: False for a skip an earlier release
      recorded, before an upgrade, whose ``floor`` and flags claim nothing.
    next_slot: the slot the next skip is written to, ``int32[]``.
  """

  step: jax.Array
  cause: jax.Array
  scale_before: jax.Array
  scale_after: jax.Array
  floor: jax.Array | None = None
  nan_told_apart: jax.Array | None = None
  hysteresis_held: jax.Array | None = None
  loss_not_blamed: jax.Array | None = None
  recorded: jax.Array | None = None
  next_slot: jax.Array | None = None


class RecordedConfig(NamedTuple):
  """The configuration a loss-scale state was last updated with (its
  `init`, then each `update`): what the report says about the run's
  scale, read from the state itself rather than from a transformation
  that may be configured otherwise. Scalars; ``known`` is False in a state
  upgraded from an earlier release, until its first update.

  Attributes:
    known: whether the fields below were recorded, ``bool[]``.
    min_scale: the dynamic scale's floor, ``float32[]``.
    max_scale: the dynamic scale's ceiling, ``float32[]``.
    growth_steps: finite steps in a row before the scale grows,
      ``int32[]``.
    growth_factor: the multiplier on growth, ``float32[]``.
    backoff_factor: the multiplier on backoff, ``float32[]``.
    hysteresis: skips counted against the scale before it backs off,
      ``int32[]``.
    backoff_on_nonfinite_loss: whether a non-finite loss counts against
      the scale, ``bool[]``.
  """

  known: jax.Array
  min_scale: jax.Array
  max_scale: jax.Array
  growth_steps: jax.Array
  growth_factor: jax.Array
  backoff_factor: jax.Array
  hysteresis: jax.Array
  backoff_on_nonfinite_loss: jax.Array


class CountedSince(NamedTuple):
  """Where the counts that a state's first release lacked began: ``steps``
  and ``total_skipped`` as they were then. Zeros for a state made by
  `init`; for a state upgraded from 0.1.0 (which counted neither NaN
  steps, nor non-finite losses, nor per leaf, nor kept recent skips), their
  values at the upgrade.

  Attributes:
    steps: the steps seen when those counts began, ``int32[]``.
    total_skipped: the steps skipped by then, ``int32[]``.
  """

  steps: jax.Array
  total_skipped: jax.Array


class LeafCounts(NamedTuple):
  """Per gradient leaf, the steps on which it was not finite.

  The counts are one vector, so that a step updates them in one operation
  (a scalar per leaf made XLA compile a step of many leaves slowly:
  benchmarks/README.md), beside the tree they count the leaves of.

  Attributes:
    counts: ``int32[n]``, one count per leaf of the gradients, in
      ``jax.tree.leaves`` order (saturating at ``2**31 - 1``).
    structure: the parameters' tree with ``()`` in place of each leaf: it
      holds no arrays, only the tree's shape and names, by which
      :func:`nonfinite_leaves` and :func:`skip_report` read the counts.
  """

  counts: jax.Array
  structure: Any


class LossScaleState(NamedTuple):
  """State of :func:`unscale_and_check`: the scale and its bookkeeping.

  Every counter is ``int32[]`` and saturates at ``2**31 - 1`` rather than
  wrapping.

  Attributes:
    loss_scale: the scale that multiplies the loss, ``float32[]``.
    counter: consecutive finite steps since the scale last grew or backed
      off (Keras's ``dynamic_counter``); ``None`` when the scale is static.
    skipped_in_a_row: skipped steps in a row.
    total_skipped: skipped steps in total.
    last_finite: whether the last step was applied (its gradients, and its
      loss when ``value`` was given, were finite), ``bool[]``.
    overflows_in_a_row: skipped steps in a row that the scale is blamed
      for, which hysteresis counts before the scale backs off. A step
      skipped for a non-finite loss under
      ``backoff_on_nonfinite_loss=False`` leaves it.
    nan_steps: skipped steps whose gradients held a NaN (not only infs).
    nonfinite_loss_steps: skipped steps whose loss (``value``) was not
      finite (every such step is skipped).
    steps: the steps seen, applied and skipped.
    recent_skips: the last skipped steps, a :class:`SkipEvents`.
    leaf_notfinite: with ``leaf_stats=True``, a :class:`LeafCounts`: for
      each leaf of the gradients, the steps on which it was not finite (read
      them as a tree with :func:`nonfinite_leaves`); ``None`` otherwise.
    config: the configuration the state was last updated with, a
      :class:`RecordedConfig`.
    counted_since: where ``nan_steps``, ``nonfinite_loss_steps``,
      ``recent_skips`` and ``leaf_notfinite`` began counting, a
      :class:`CountedSince` (zeros but in a state upgraded from 0.1.0).
    nan_steps_exact: whether ``nan_steps`` counts every NaN, ``bool[]``:
      False once a skip's gradients were checked where a NaN counts as an
      inf (a mesh with ``Auto`` axes), or where an upgraded state cannot
      say.

  The last three are ``None`` in a state an earlier release saved (a
  pickle of 0.2.0): :func:`upgrade_state` fills them.
  """

  loss_scale: jax.Array
  counter: jax.Array | None
  skipped_in_a_row: jax.Array
  total_skipped: jax.Array
  last_finite: jax.Array
  overflows_in_a_row: jax.Array
  nan_steps: jax.Array
  nonfinite_loss_steps: jax.Array
  steps: jax.Array
  recent_skips: SkipEvents
  leaf_notfinite: LeafCounts | None
  config: RecordedConfig | None = None
  counted_since: CountedSince | None = None
  nan_steps_exact: jax.Array | None = None


class LossScaleOptimizerState(NamedTuple):
  """State of :func:`loss_scale_optimizer`.

  Attributes:
    loss_scale_state: the :class:`LossScaleState`.
    inner_state: the state of the wrapped transformation, left exactly as it
      was on skipped steps.
  """

  loss_scale_state: LossScaleState
  inner_state: Any


class SkipStats(NamedTuple):
  """Step statistics read by :func:`skip_stats`. Counters saturate at
  ``2**31 - 1``.

  Attributes:
    total_skipped: skipped steps in total.
    skipped_in_a_row: skipped steps in a row.
    last_finite: whether the last step was finite (and so applied).
    nan_steps: skipped steps whose gradients held a NaN, not only infs
      (on a mesh with `Auto` axes, whose leaves' placement XLA picks after
      tracing, a NaN there counts as an overflow: telling them apart would
      copy the leaf).
    nonfinite_loss_steps: skipped steps whose loss (the ``value`` passed to
      ``update``) was not finite, whatever ``backoff_on_nonfinite_loss``
      says.
  """

  total_skipped: jax.Array
  skipped_in_a_row: jax.Array
  last_finite: jax.Array
  nan_steps: jax.Array
  nonfinite_loss_steps: jax.Array


def _zero_count() -> jax.Array:
  return jnp.zeros([], COUNTER_DTYPE)


def zero_leaf_counts(params: Any) -> LeafCounts:
  """A zero count for each leaf of `params` (of the gradients)."""
  leaves = len(jax.tree.leaves(params))
  structure = jax.tree.map(lambda _: (), params)
  if len(jax.tree.leaves(structure, is_leaf=is_placeholder)) != leaves:
    raise ValueError(
      "`leaf_stats=True` keeps the params' tree with `()` in place of each"
      " leaf, to name the counts by; these params hold an empty tuple `()`"
      " of their own, which would be taken for a leaf. Replace it with"
      " None (an empty subtree too), or build the optimizer without"
      " `leaf_stats`."
    )
  return LeafCounts(
    counts=jnp.zeros([leaves], COUNTER_DTYPE), structure=structure
  )


def leaf_counts_tree(leaf_counts: LeafCounts) -> Any:
  """The counts as a tree shaped like the gradients, a count per leaf (an
  array of the leading shape of a stacked state's counts)."""
  placeholders, structure = jax.tree.flatten(
    leaf_counts.structure, is_leaf=is_placeholder
  )
  counts = jnp.asarray(leaf_counts.counts)
  if counts.shape[-1:] != (len(placeholders),):
    raise ValueError(
      f"The per-leaf counts hold {counts.shape[-1:]} values for a tree of"
      f" {len(placeholders)} leaves: the state's `leaf_notfinite` was"
      " changed by hand, or restored without a target from a format that"
      " turns the `()` naming each leaf into `{}` (flax msgpack) while the"
      " params hold empty subtrees too. Restore it with a target, or pass"
      " it through `ols.upgrade_state(restored, like=tx.init(params))`."
    )
  return jax.tree.unflatten(
    structure, [counts[..., i] for i in range(len(placeholders))]
  )


def is_placeholder(x: Any) -> bool:
  """Whether `x` stands for a leaf in `LeafCounts.structure`: an empty
  tuple itself (not an empty NamedTuple, such as `optax.EmptyState`)."""
  return type(x) is tuple and not x


def init_loss_scale_state(
  initial_scale: float,
  dynamic: bool,
  leaf_notfinite: LeafCounts | None = None,
  config: LossScaleConfig | None = None,
) -> LossScaleState:
  """The state before the first step; `leaf_notfinite` (zero counts, for
  `leaf_stats`) as given; `config` recorded (None: not known)."""
  return LossScaleState(
    loss_scale=jnp.asarray(initial_scale, SCALE_DTYPE),
    counter=_zero_count() if dynamic else None,
    skipped_in_a_row=_zero_count(),
    total_skipped=_zero_count(),
    last_finite=jnp.ones([], jnp.bool_),
    overflows_in_a_row=_zero_count(),
    nan_steps=_zero_count(),
    nonfinite_loss_steps=_zero_count(),
    steps=_zero_count(),
    recent_skips=empty_ring(),
    leaf_notfinite=leaf_notfinite,
    config=unknown_config() if config is None else recorded_config(config),
    counted_since=CountedSince(_zero_count(), _zero_count()),
    nan_steps_exact=jnp.ones([], jnp.bool_),
  )


def empty_ring() -> SkipEvents:
  """The ring of recent skips with none written."""

  def full(value: Any, dtype: Any) -> jax.Array:
    return jnp.full([RECENT_SKIPS], value, dtype)

  return SkipEvents(
    step=full(-1, COUNTER_DTYPE),
    cause=full(0, COUNTER_DTYPE),
    scale_before=full(0, SCALE_DTYPE),
    scale_after=full(0, SCALE_DTYPE),
    floor=full(0, SCALE_DTYPE),
    nan_told_apart=full(False, jnp.bool_),
    hysteresis_held=full(False, jnp.bool_),
    loss_not_blamed=full(False, jnp.bool_),
    recorded=full(False, jnp.bool_),
    next_slot=_zero_count(),
  )


def recorded_config(config: LossScaleConfig) -> RecordedConfig:
  """`config` as the state records it (constants in the step)."""
  return RecordedConfig(
    known=jnp.ones([], jnp.bool_),
    min_scale=jnp.asarray(config.min_scale, SCALE_DTYPE),
    max_scale=jnp.asarray(config.max_scale, SCALE_DTYPE),
    growth_steps=jnp.asarray(config.growth_steps, COUNTER_DTYPE),
    growth_factor=jnp.asarray(config.growth_factor, SCALE_DTYPE),
    backoff_factor=jnp.asarray(config.backoff_factor, SCALE_DTYPE),
    hysteresis=jnp.asarray(config.hysteresis, COUNTER_DTYPE),
    backoff_on_nonfinite_loss=jnp.asarray(
      config.backoff_on_nonfinite_loss, jnp.bool_
    ),
  )


def unknown_config() -> RecordedConfig:
  """No configuration recorded (an upgraded state, until its first
  update): every field zero, `known` False."""
  return RecordedConfig(
    known=jnp.zeros([], jnp.bool_),
    min_scale=jnp.zeros([], SCALE_DTYPE),
    max_scale=jnp.zeros([], SCALE_DTYPE),
    growth_steps=_zero_count(),
    growth_factor=jnp.zeros([], SCALE_DTYPE),
    backoff_factor=jnp.zeros([], SCALE_DTYPE),
    hysteresis=_zero_count(),
    backoff_on_nonfinite_loss=jnp.zeros([], jnp.bool_),
  )


def is_of_an_earlier_release(state: LossScaleState) -> bool:
  """Whether `state` lacks today's fields (a pickle of 0.2.0, whose
  types load as today's with those fields None)."""
  return (
    state.config is None
    or state.counted_since is None
    or state.nan_steps_exact is None
    or state.recent_skips.next_slot is None
  )


def check_scalar_state(state: LossScaleState) -> None:
  """`update` and `scale_loss` need one scale; the read-outs take any."""
  shape = jnp.shape(state.loss_scale)
  if shape != ():
    raise ValueError(
      "The loss-scale state must hold a scalar scale, got shape"
      f" {shape}. This happens when a state made under `jax.vmap` (an"
      " ensemble of optimizer states) is used outside of it: call"
      " `update`/`scale_loss` inside the same `jax.vmap`, or index one"
      " member of the ensemble. A state replicated for `jax.pmap` is the"
      " same: use it inside `pmap`, or index one replica. The read-outs"
      " (`loss_scale`, `dynamic_counter`, `skip_stats`) accept such a"
      " state and give one value per member."
    )
