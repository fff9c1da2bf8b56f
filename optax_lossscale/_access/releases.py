"""The loss-scale states of earlier releases, told apart and brought to
today's.

- 0.1.0's state had five fields, two under other names (`notfinite_count`,
  `total_notfinite`); its types are kept in `optax_lossscale._state`, where
  its pickles name them.
- 0.2.0's state had eleven: today's first eleven. Its pickles name today's
  types (`optax_lossscale.LossScaleState`, and `SkipEvents` and
  `LeafCounts` at `optax_lossscale._core.state`, where they are still
  defined); the fields added since default to None, so that they load.

Restored without a target (flax msgpack, orbax), each is plain dicts. What
an earlier release did not record, today's state says it does not know:
`CountedSince` marks where the counts 0.1.0 lacked began, a skip 0.2.0
recorded has `recorded` False, and the configuration is unknown until the
next update.
"""

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

import optax_lossscale._state as _v010
from optax_lossscale._access import locate as _locate
from optax_lossscale._core.state import (
  COUNTER_DTYPE,
  RECENT_SKIPS,
  SCALE_DTYPE,
  CountedSince,
  LeafCounts,
  LossScaleState,
  SkipEvents,
  empty_ring,
  init_loss_scale_state,
  is_of_an_earlier_release,
)

V010_FIELDS = frozenset(_v010.LossScaleState._fields)
# 0.1.0's counters, by today's names.
_RENAMED = {
  "skipped_in_a_row": "notfinite_count",
  "total_skipped": "total_notfinite",
}
INT32_MAX = 2**31 - 1


def release_of(x: Any) -> str | None:
  """`"0.1.0"`, `"0.2.0"` or `"today"` where `x` is a loss-scale state of
  that release (typed, or as the plain dicts of a restore without a
  target), else None."""
  if isinstance(x, _v010.LossScaleState):
    return "0.1.0"
  if isinstance(x, Mapping) and _keys(x) == V010_FIELDS:
    return "0.1.0"
  if not _locate.is_node(x):
    return None
  return "0.2.0" if is_of_an_earlier_release(_locate.typed(x)) else "today"


def _keys(x: Mapping[Any, Any]) -> frozenset[Any]:
  try:
    return frozenset(x.keys())
  except TypeError:
    return frozenset()


def field(node: Any, name: str) -> Any:
  if isinstance(node, Mapping):
    return node[name]
  return getattr(node, name)


def skipped_of_v010(old: Any) -> int:
  return int(np.asarray(field(old, _RENAMED["total_skipped"])))


def from_v010(
  old: Any, leaf_notfinite: LeafCounts | None, steps: int
) -> LossScaleState:
  """Today's state from 0.1.0's `old` (typed or a dict), having seen
  `steps`; per-leaf counts, where `leaf_notfinite` is given, from zero."""
  counter = field(old, "counter")
  if leaf_notfinite is not None:
    leaf_notfinite = leaf_notfinite._replace(
      counts=jnp.zeros_like(leaf_notfinite.counts)
    )
  fresh = init_loss_scale_state(
    1.0, dynamic=counter is not None, leaf_notfinite=leaf_notfinite
  )
  in_a_row = jnp.asarray(
    field(old, _RENAMED["skipped_in_a_row"]), COUNTER_DTYPE
  )
  total = jnp.asarray(field(old, _RENAMED["total_skipped"]), COUNTER_DTYPE)
  steps_seen = jnp.asarray(steps, COUNTER_DTYPE)
  return fresh._replace(
    loss_scale=jnp.asarray(field(old, "loss_scale"), SCALE_DTYPE),
    counter=None if counter is None else jnp.asarray(counter, COUNTER_DTYPE),
    skipped_in_a_row=in_a_row,
    total_skipped=total,
    last_finite=jnp.asarray(field(old, "last_finite"), jnp.bool_),
    # 0.1.0's hysteresis counted every skip in a row, and each was an
    # overflow of the gradients (it checked nothing else).
    overflows_in_a_row=in_a_row,
    steps=steps_seen,
    # NaN steps, non-finite losses, per-leaf counts and recent skips count
    # from here: 0.1.0 did not count them.
    counted_since=CountedSince(steps=steps_seen, total_skipped=total),
  )


def from_v020(node: Any) -> LossScaleState:
  """Today's state from 0.2.0's (typed, or a dict): its fields as they
  were; its skips re-laid in the order they came, each marked as recorded
  by 0.2.0; the configuration unknown until the next update."""
  old = _locate.typed(node)
  fresh = init_loss_scale_state(
    1.0, dynamic=old.counter is not None, leaf_notfinite=old.leaf_notfinite
  )
  total, nan = (
    int(np.asarray(old.total_skipped)),
    int(np.asarray(old.nan_steps)),
  )
  return old._replace(
    recent_skips=_relaid(old.recent_skips),
    config=fresh.config,  # unknown
    counted_since=fresh.counted_since,  # 0.2.0 counted from the start
    # 0.2.0 did not record where its checks ran: on a mesh with `Auto`
    # axes a NaN counted as an inf. Exact only where no skip could have
    # hidden one: every skip counted a NaN.
    nan_steps_exact=jnp.asarray(total == nan, jnp.bool_),
  )


def _relaid(ring: SkipEvents) -> SkipEvents:
  """0.2.0's ring in today's layout: the skips by step (0.2.0's own
  order, written slots only) in the first slots, the next write after
  them."""
  steps = np.asarray(ring.step)
  order = [i for i in np.argsort(steps, kind="stable") if steps[i] >= 0]
  order = order[-RECENT_SKIPS:]
  fresh = empty_ring()

  def laid(old: Any, new: Any) -> Any:
    values = np.array(new)
    values[: len(order)] = np.asarray(old)[order]
    return jnp.asarray(values, new.dtype)

  return fresh._replace(
    step=laid(ring.step, fresh.step),
    cause=laid(ring.cause, fresh.cause),
    scale_before=laid(ring.scale_before, fresh.scale_before),
    scale_after=laid(ring.scale_after, fresh.scale_after),
    next_slot=jnp.asarray(len(order) % RECENT_SKIPS, COUNTER_DTYPE),
  )


def today(node: Any) -> LossScaleState:
  """Today's state, typed (from a dict of a restore without a target)."""
  if isinstance(node, LossScaleState):
    return node
  return _locate.typed(node)
