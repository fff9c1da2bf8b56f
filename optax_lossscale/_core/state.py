"""The loss-scale state: fixed-dtype NamedTuples, so that jitted steps never
retrace and checkpoints carry named fields."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

SCALE_DTYPE = jnp.float32
COUNTER_DTYPE = jnp.int32


# Skip events kept in the state, the most recent last (a ring buffer).
RECENT_SKIPS = 8

# Why a step was skipped, as bits of `SkipEvents.cause`.
CAUSE_INF = 1  # a gradient overflowed to inf
CAUSE_NAN = 2  # a gradient held a NaN
CAUSE_LOSS = 4  # the loss (`value`) itself was not finite


class SkipEvents(NamedTuple):
  """The last :data:`RECENT_SKIPS` skipped steps, oldest first once full.

  Attributes:
    step: the step's number (0-based, saturating), ``int32[k]``; -1 where no
      skip has been recorded yet.
    cause: bits of why: 1 inf, 2 NaN in the gradients, 4 a non-finite loss,
      ``int32[k]``.
    scale_before: the scale the step ran at, ``float32[k]``.
    scale_after: the scale after it, ``float32[k]``.
  """

  step: jax.Array
  cause: jax.Array
  scale_before: jax.Array
  scale_after: jax.Array


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
      " changed by hand."
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
) -> LossScaleState:
  """The state before the first step; `leaf_notfinite` (zero counts, for
  `leaf_stats`) as given."""
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
    recent_skips=SkipEvents(
      step=jnp.full([RECENT_SKIPS], -1, COUNTER_DTYPE),
      cause=jnp.zeros([RECENT_SKIPS], COUNTER_DTYPE),
      scale_before=jnp.zeros([RECENT_SKIPS], SCALE_DTYPE),
      scale_after=jnp.zeros([RECENT_SKIPS], SCALE_DTYPE),
    ),
    leaf_notfinite=leaf_notfinite,
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
