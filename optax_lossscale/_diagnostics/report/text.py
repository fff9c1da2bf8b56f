"""The report's text: the scale, the counts, the recent skips with what
each recorded, the parameters, and the diagnosis, in a few lines that read
the same in a terminal and a notebook."""

from optax_lossscale._diagnostics import format as _format
from optax_lossscale._diagnostics.report.diagnosis import NAMES_SHOWN, since
from optax_lossscale._diagnostics.report.facts import SATURATED, Event, Facts


def lines(facts: Facts, diagnosis: tuple[str, ...]) -> list[str]:
  """The report's lines."""
  out = [_scale_line(facts)]
  out.append(
    f"steps: {facts.steps} seen; skipped: {facts.total_skipped} in total"
    f" ({_format.share(facts.total_skipped, facts.steps)}),"
    f" {facts.in_a_row} in a row now"
  )
  out += _counts_lines(facts)
  if facts.events:
    out.append("recent skips:")
    out += [f"  {_event_line(e)}" for e in facts.events]
  if facts.leaves and facts.skipped_counted:
    out += _leaf_lines(facts.leaves)
  out.append("diagnosis:")
  for item in diagnosis:
    out += _format.wrap(f"- {item}", indent="  ", hanging="    ")
  return out


def _scale_line(facts: Facts) -> str:
  scale = f"loss scale {_format.scale(facts.scale)}"
  if not facts.dynamic:
    return f"{scale}: static (it never changes by itself)"
  config = facts.config
  if config is None:
    return f"{scale}: dynamic, floor not recorded (until the next update)"
  floor = _format.scale(config.min_scale)
  text = f"{scale}: dynamic, floor {floor}"
  if facts.scale == config.min_scale:
    text = f"{scale}: dynamic, now at its floor ({floor})"
  elif facts.scale < config.min_scale:
    text = f"{scale}: dynamic, below its floor ({floor})"
  if config.hysteresis > 1:
    text += f", hysteresis {config.hysteresis}"
  return text


def _counts_lines(facts: Facts) -> list[str]:
  """The NaN and loss counts, over the skips they counted."""
  if not facts.total_skipped:
    return []
  counted = facts.skipped_counted
  if facts.upgraded and not counted:
    return [
      f"  no skip since step {facts.since_steps}, where the NaN and loss"
      " counts began (an upgrade)"
    ]
  nan = f"{facts.nan_steps} with NaN in the gradients"
  if not facts.nan_steps_exact:
    nan += " (a lower bound: see the diagnosis)"
  of = (
    f"of the {counted} skipped{since(facts)}"
    if facts.upgraded
    else "of the skipped"
  )
  return _format.wrap(
    f"{of}: {nan}, {facts.nonfinite_loss_steps} with a non-finite loss",
    indent="  ",
    hanging="    ",
  )


def _event_line(event: Event) -> str:
  words = {"inf": "inf", "NaN": "NaN", "loss": "loss"}
  if not event.nan_told_apart:  # on an Auto mesh, or not recorded
    words["inf"] = "inf or NaN"
  causes = ", ".join(words.get(c, c) for c in event.causes)
  line = (
    f"{step_name(event.step)}: {causes}; scale"
    f" {_format.scale(event.before)} -> {_format.scale(event.after)}"
  )
  if event.hysteresis_held:
    line += ", held by hysteresis"
  if event.loss_not_blamed:
    line += ", not counted against the scale"
  return line


def _leaf_lines(leaves: tuple[tuple[str, int], ...]) -> list[str]:
  """The parameters not finite, one row per count (equal counts share a
  row: nothing in the state ranks them), then those that stayed finite."""
  by_count: dict[int, list[str]] = {}
  for name, count in leaves:
    by_count.setdefault(count, []).append(name)
  hit = [(count, names) for count, names in by_count.items() if count]
  out = []
  if hit:
    out.append("parameters whose gradients were not finite, most often first:")
    width = max(len(_format.count(count, "step")) for count, _ in hit)
    for count, names in hit[:NAMES_SHOWN]:
      steps = _format.count(count, "step").ljust(width)
      out += _format.wrap(
        f"{steps}  {', '.join(names)}",
        indent="  ",
        hanging=" " * (width + 4),
      )
    if len(hit) > NAMES_SHOWN:
      more = sum(len(names) for _, names in hit[NAMES_SHOWN:])
      out.append(f"  ... and {_format.count(more, 'parameter')} more")
  clean = by_count.get(0, [])
  if clean and hit:
    shown = 4 * NAMES_SHOWN
    out += _format.wrap(
      "parameters whose gradients stayed finite:"
      f" {', '.join(clean[:shown])}"
      + (f" and {len(clean) - shown} more" if len(clean) > shown else "")
    )
  return out


def step_name(step: int) -> str:
  """`step 12`; a saturated step counter says where it stopped."""
  if step >= SATURATED:
    return f"step {SATURATED} or later"
  return f"step {step}"
