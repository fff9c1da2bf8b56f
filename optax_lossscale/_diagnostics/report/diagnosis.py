"""The diagnosis: each sentence with the predicate over the recorded facts
that allows it. A sentence says what happened; advice comes after it, as a
condition ("if the scale reaches its floor and steps still skip, ..."),
never as a prediction. Where the state cannot know a fact, the sentence is
not said, or says less ("at least", "since step N")."""

from collections.abc import Callable

from optax_lossscale._diagnostics import format as _format
from optax_lossscale._diagnostics.report.facts import Event, Facts

# Parameters named in one row of the report, and in the finite list.
NAMES_SHOWN = 6

FIND_OVERFLOW = (
  "`ols.find_overflow` on a skipped step's batch names the operation"
)
# For float16's range the finder's advice names the fix: an `ols.autocast`
# call where the operation has a name that `keep_float32` accepts or is on
# the policy's float32 list.
IN_FLOAT32 = (
  "how to compute it in float32 (an `ols.autocast` call where it can)"
)
FIND_AND_FIX = f"{FIND_OVERFLOW} and, for float16's range, {IN_FLOAT32}"
NOT_THE_SCALE = (
  "the overflow does not depend on the scale: run `ols.find_overflow` on a"
  " skipped step's batch"
)


def diagnosis(facts: Facts) -> tuple[str, ...]:
  """The sentences that the facts allow, in order."""
  if facts.total_skipped == 0:
    return (
      "no step was skipped: the gradients of every step were finite at the"
      " scale it ran at.",
    )
  if facts.skipped_counted == 0:  # all before an upgrade
    return (
      f"no step was skipped since step {facts.since_steps}, where this"
      " state's counts of why began (an upgrade from a release that did not"
      f" count them); {_format.count(facts.total_skipped, 'step')} skipped"
      " before it, for causes the state does not know.",
    )
  sentences: tuple[Callable[[Facts], str | None], ...] = (
    _causes,
    _every_batch,
    _bad_losses,
    _at_the_floor_now,
    _in_a_row,
    _at_the_floor_before,
    _held_by_hysteresis,
    _finding_its_level,
    _static,
    _below_one,
    _mesh_cannot_tell,
    _parameters,
  )
  said = tuple(s for s in (sentence(facts) for sentence in sentences) if s)
  # Where no other sentence applies (no skip kept, say), the counts.
  return said or (_causes(facts, named_alone=True) or _skipped(facts) + ".",)


# --- what the facts say of each skip and count ---


def since(facts: Facts) -> str:
  """` since step N`, where the counts began after the first step."""
  return f" since step {facts.since_steps}" if facts.upgraded else ""


def _skipped(facts: Facts) -> str:
  """`N steps skipped (P%)`, since the counts began."""
  counted = facts.skipped_counted
  return (
    f"{_format.count(counted, 'step')} skipped{since(facts)}"
    f" ({_format.share(counted, facts.steps_counted)})"
  )


def _kept(facts: Facts, events: list[Event]) -> str:
  """`N of the M skipped steps` (or `of the last M kept`)."""
  every = facts.every_skip_kept
  return (
    f"{len(events)} of the {'' if every else 'last '}"
    f"{len(facts.events)} skipped steps{'' if every else ' kept'}"
  )


def _overflow_words(events: list[Event]) -> str:
  """How an inf-only skip is named: the check's own word, or, where it
  could not tell a NaN from an inf, both."""
  if all(e.nan_told_apart for e in events):
    return "overflowed to inf"
  return (
    "overflowed (inf, or a NaN on an Auto mesh, which this check cannot"
    " tell apart)"
  )


# --- the causes, each with its count ---


def _causes(facts: Facts, named_alone: bool = False) -> str | None:
  """Predicate: more than one cause among the skips counted (or one, with
  `named_alone`); each named with its count (from the kept skips where the
  ring keeps every one, else the loss from its counter and the rest
  together)."""
  losses = facts.nonfinite_loss_steps
  if facts.every_skip_kept:
    # A skip is named by its first cause: the loss, the gradients, then a
    # scale below 1 (with the gradients finite as they came).
    below = sum(
      e.has("scale below 1") and not e.has("loss") and not e.gradients_only
      for e in facts.events
    )
    parts = [
      (losses, "for a non-finite loss"),
      (facts.skipped_counted - losses - below, "for non-finite gradients"),
      (below, "for a scale below 1"),
    ]
  else:
    parts = [
      (losses, "for a non-finite loss"),
      (facts.skipped_counted - losses, "without a non-finite loss"),
    ]
  named = [f"{n} {why}" for n, why in parts if n]
  if not named or (len(named) < 2 and not named_alone):
    return None
  return f"{_skipped(facts)}: {', '.join(named)}."


def _every_batch(facts: Facts) -> str | None:
  """Predicate: the loss was not finite on every step counted (two or
  more)."""
  counted = facts.steps_counted
  if counted < 2 or facts.nonfinite_loss_steps != counted:
    return None
  return (
    f"the loss was not finite on every one of the {counted} steps"
    f"{since(facts)}, every batch: the model's forward pass, not the data"
    " (unless every batch is bad), which no loss scale fixes. Find where"
    " with `ols.find_overflow` on any batch."
  )


def _bad_losses(facts: Facts) -> str | None:
  """Predicate: some skips had a non-finite loss, and not every step did
  (`_every_batch` says that)."""
  losses = facts.nonfinite_loss_steps
  if not losses or _every_batch(facts) is not None:
    return None
  text = (
    f"the loss itself was not finite in {losses} of"
    f" {facts.skipped_counted} skipped steps{since(facts)}: a forward"
    " overflow or bad data, which no loss scale fixes. Find where with"
    " `ols.find_overflow` on a skipped step's batch"
  )
  return text + _loss_and_scale(facts, losses) + "."


def _loss_and_scale(facts: Facts, losses: int) -> str:
  """What such steps did to the scale, as the kept ones recorded it."""
  if not facts.dynamic:
    return ""
  kept = [e for e in facts.events if e.has("loss") and e.recorded]
  if kept and all(e.loss_not_blamed for e in kept):
    which = "those steps" if len(kept) == losses else f"the last {len(kept)}"
    return f"; each of {which} left the scale as it was"
  if any(not e.loss_not_blamed for e in kept):
    return (
      "; `backoff_on_nonfinite_loss=False` keeps such steps from lowering"
      " the scale"
    )
  return ""


# --- the gradients: at the floor, in a row, held, finding a level ---


def _at_the_floor_now(facts: Facts) -> str | None:
  """Predicate: skips of the current run of skipped steps ran at the floor
  recorded with them, for their gradients."""
  streak = facts.streak
  at_floor = [e for e in streak if e.ran_at_floor and e.gradients_only]
  if not at_floor:
    return None
  floor = _format.scale(at_floor[-1].before)
  # The ring keeps the last skips only. Within a run of skips the scale
  # never grows, so earlier ones may have run at the floor only if the
  # oldest one kept did.
  some = (
    "at least "
    if len(streak) < facts.in_a_row and streak[0].ran_at_floor
    else ""
  )
  howmany = f"{some}{_format.count(len(at_floor), 'step')}"
  nan = [e for e in at_floor if e.has("NaN")]
  if len(nan) == len(at_floor):
    return (
      f"NaN in the gradients {_down_to_the_floor(facts)}on {howmany} that"
      f" ran at the floor ({floor}), with no non-finite loss recorded:"
      " float16's range exceeded in a value or a derivative (a norm of tiny"
      " values, rsqrt's derivative, a cube), or a bug (a log or square root"
      f" of 0, a division by zero). {FIND_AND_FIX}."
    )
  if not nan and all(e.nan_told_apart for e in at_floor):
    return (
      f"the gradients {_overflow_words(at_floor)} on {howmany} that ran at"
      f" the floor ({floor}): a value or a derivative beyond float16's"
      f" range ({_format.number(_format.FLOAT16_MAX)}) even at that scale"
      f"{_lower_floor(at_floor[-1])}: {FIND_OVERFLOW} and {IN_FLOAT32}."
    )
  untold = not all(e.nan_told_apart for e in at_floor)
  what = f"{len(nan)} with NaN, {len(at_floor) - len(nan)} with inf" + (
    " (or a NaN on an Auto mesh, which this check cannot tell apart)"
    if untold
    else ""
  )
  return (
    f"the gradients were not finite on {howmany} that ran at the floor"
    f" ({floor}) ({what}): float16's range"
    f" ({_format.number(_format.FLOAT16_MAX)}) exceeded in a value or a"
    " derivative even at that scale, or a bug (a log or square root of 0, a"
    f" division by zero). {FIND_AND_FIX}."
  )


def _down_to_the_floor(facts: Facts) -> str:
  """`at every scale down to the floor `, where the ring shows the whole
  run of skipped steps, each with NaN, from above the floor down to it."""
  streak = facts.streak
  if (
    streak
    and len(streak) == facts.in_a_row
    and not streak[0].ran_at_floor
    and all(e.has("NaN") and e.gradients_only for e in streak)
  ):
    return (
      "at every scale down to the floor"
      f" ({_format.count(facts.in_a_row, 'step')} skipped in a row), "
    )
  return ""


def _lower_floor(event: Event) -> str:
  if event.floor is not None and event.floor > 1:
    return f" (a `min_scale` below {_format.scale(event.floor)} may avoid it)"
  return ""


def _in_a_row(facts: Facts) -> str | None:
  """Predicate: a dynamic scale, two or more steps skipped in a row, the
  last of which was for its gradients and lowered the scale. What
  happened, then what to do if it goes on: no prediction."""
  streak = facts.streak
  if not facts.dynamic or facts.in_a_row < 2 or not streak:
    return None
  last = streak[-1]
  if not (last.lowered and last.gradients_only):
    return None
  text = (
    f"{facts.in_a_row} steps skipped in a row, the last for non-finite"
    f" gradients, lowering the scale from {_format.scale(last.before)} to"
    f" {_format.scale(last.after)}"
  )
  if last.floor is None:
    return text + (
      f": if the scale reaches its floor and steps still skip, {NOT_THE_SCALE}."
    )
  floor = _format.scale(last.floor)
  if last.after == last.floor:
    return text + (
      f", its floor: it cannot go lower. If steps still skip there,"
      f" {NOT_THE_SCALE}."
    )
  return text + (
    f": if the scale reaches its floor ({floor}) and steps still skip,"
    f" {NOT_THE_SCALE}."
  )


def _at_the_floor_before(facts: Facts) -> str | None:
  """Predicate: kept skips, before the current run of skipped steps, ran
  at the floor for their gradients, and a step was applied after them."""
  earlier = facts.events[: len(facts.events) - len(facts.streak)]
  at_floor = [e for e in earlier if e.ran_at_floor and e.gradients_only]
  if not at_floor:
    return None
  return (
    f"{_kept(facts, at_floor)} ran at the floor"
    f" ({_format.scale(at_floor[-1].before)}) and were skipped for"
    " non-finite gradients there, and a step was applied after them: if"
    f" such skips come back, {NOT_THE_SCALE}."
  )


def _held_by_hysteresis(facts: Facts) -> str | None:
  """Predicate: kept skips that counted against a dynamic scale and left
  it where it was, as hysteresis decided (recorded with each)."""
  held = [e for e in facts.events if e.hysteresis_held]
  if not facts.dynamic or not held:
    return None
  spared = any(e.loss_not_blamed for e in facts.events)
  return (
    f"{_kept(facts, held)} left the scale where it was, held by"
    " hysteresis: the scale backs off once `hysteresis` skips have counted"
    " against it since the last applied step"
    + (
      " (a non-finite loss does not count, with"
      " `backoff_on_nonfinite_loss=False`)"
      if spared
      else ""
    )
    + "."
  )


def _finding_its_level(facts: Facts) -> str | None:
  """Predicate: a dynamic scale, fewer than two steps skipped in a row
  (`_in_a_row` speaks of a run), and every kept skip for the gradients
  lowered the scale."""
  if not facts.dynamic or facts.in_a_row >= 2:
    return None
  gradients = [e for e in facts.events if e.gradients_only]
  if not gradients or not all(e.lowered for e in gradients):
    return None
  if all(not e.has("NaN") and e.nan_told_apart for e in gradients):
    what = "an overflow (inf)"
  else:
    what = "a skip for non-finite gradients"
  if len(gradients) == len(facts.events) and facts.every_skip_kept:
    return (
      f"{_skipped(facts)}, each {what} that lowered the scale: the dynamic"
      " scale finding its level, as designed."
    )
  verb = "was" if len(gradients) == 1 else "were each"
  return (
    f"{_kept(facts, gradients)} {verb} {what} that lowered the scale: the"
    " dynamic scale finding its level."
  )


def _static(facts: Facts) -> str | None:
  """Predicate: a static scale, and kept skips for the gradients, at the
  scales they ran at."""
  if facts.dynamic:
    return None
  gradients = [e for e in facts.events if e.gradients_only]
  if not gradients:
    return None
  scales = sorted({e.before for e in gradients}, reverse=True)
  at = (
    f"the static scale {_format.scale(scales[0])}"
    if len(scales) == 1
    else "static scales "
    + ", ".join(_format.scale(s) for s in scales)
    + " (changed by hand)"
  )
  of = "" if facts.every_skip_kept else "the last "
  return (
    f"{len(gradients)} of {of}{len(facts.events)} skipped steps had"
    f" non-finite gradients at {at}: a static scale never moves by itself,"
    " so where the scale makes them, a lower static scale or"
    " `dynamic=True` avoids them; `ols.find_overflow` names the operation."
  )


def _below_one(facts: Facts) -> str | None:
  """Predicate: kept skips ran at a scale below 1 that the check could not
  vouch for (a state changed by hand, or updated by a configuration whose
  check needs a scale of at least 1)."""
  below = [e for e in facts.events if e.has("scale below 1")]
  if not below:
    return None
  return (
    f"{_kept(facts, below)} ran at a scale below 1"
    f" ({_format.scale(below[-1].before)}), where this configuration's"
    " check, which reads the gradients before they are divided by the"
    " scale, cannot vouch for them: each was skipped. Set the scale with"
    " `ols.set_loss_scale`, which refuses "
    + ("a value below the floor." if facts.dynamic else "a static one below 1.")
  )


def _mesh_cannot_tell(facts: Facts) -> str | None:
  """Predicate: a kept skip with non-finite gradients was checked where a
  NaN counts as an inf, or the NaN count is not exact."""
  untold = [
    e
    for e in facts.events
    if e.recorded and not e.nan_told_apart and e.has("inf")
  ]
  if untold:
    return (
      "some of these gradients were checked on a mesh with Auto axes,"
      " where the check counts a NaN as an inf: a skip written `inf or NaN`"
      " may have been either, and the NaN count is a lower bound."
    )
  if not facts.nan_steps_exact:
    return (
      "the NaN count is a lower bound: a skip with non-finite gradients was"
      " checked where a NaN counts as an inf (a mesh with Auto axes), and is"
      " no longer kept here, or was recorded by an earlier release that did"
      " not say where its check ran."
    )
  return None


def _parameters(facts: Facts) -> str | None:
  """Predicate: per-leaf counts over skips counted; which stayed finite,
  which did not."""
  leaves = facts.leaves
  if leaves is None or facts.skipped_counted == 0:
    return None
  hit = [name for name, count in leaves if count]
  clean = [name for name, count in leaves if not count]
  if not hit:
    return (
      f"every parameter's gradient stayed finite on every step{since(facts)}:"
      " the skips came from the loss (or a scale below 1), not the"
      " gradients."
    )
  text = (
    f"the gradients of {len(hit)} of {len(leaves)} parameters were not"
    f" finite on some step{since(facts)}"
  )
  if clean:
    text += (
      f"; {len(clean)} stayed finite on every step"
      f" ({_format.names(clean, NAMES_SHOWN)}): whatever made the others"
      " non-finite did not reach these, which locates it"
    )
  return text + "."
