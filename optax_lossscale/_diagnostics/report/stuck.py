"""`raise_if_stuck`'s cases: the predicates over the recorded facts that
say a run cannot recover."""

from optax_lossscale._diagnostics import format as _format
from optax_lossscale._diagnostics.report.facts import Event, Facts


def nonfinite_losses(facts: Facts, limit: int | None) -> str | None:
  """Predicate: the last `limit` steps were skipped, each with a
  non-finite loss."""
  last = _last_skips(facts, limit)
  if last is None or not all(e.has("loss") for e in last):
    return None
  return (
    f"the loss was not finite on each of the last {limit} steps (each"
    " skipped), which no loss scale fixes."
  )


def skips_at_floor(facts: Facts, limit: int | None) -> str | None:
  """Predicate: the last `limit` steps were skipped, each at the floor of a
  dynamic scale (recorded with it) or at a static scale, and the scale is
  still that one: the next step runs where they did."""
  last = _last_skips(facts, limit)
  if last is None or any(e.has("scale below 1") for e in last):
    return None
  if not facts.dynamic:
    if not all(e.before == facts.scale for e in last):
      return None
    return (
      f"the last {limit} steps were skipped, each at the static loss scale"
      f" ({_format.scale(facts.scale)}), which never changes by itself."
    )
  if not all(e.ran_at_floor and e.before == facts.scale for e in last):
    return None
  return (
    f"the last {limit} steps were skipped, and each ran at the floor of the"
    f" loss scale ({_format.scale(facts.scale)}), which cannot go lower."
  )


def _last_skips(facts: Facts, limit: int | None) -> tuple[Event, ...] | None:
  """The last `limit` steps, where each was skipped and is kept."""
  if limit is None or facts.in_a_row < limit:
    return None
  streak = facts.streak
  if len(streak) < limit:
    return None
  return streak[len(streak) - limit :]
