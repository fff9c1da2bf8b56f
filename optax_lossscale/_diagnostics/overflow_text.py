"""The text of `find_overflow`'s report: the verdict (what made the first
harmful value, where, and what fixes it), the masks and the discarded
values, the loss scale's room in the backward pass, and a table of each
scope's float16 values. Every number printed is one the program computed
or counted; `advice` words what to do from the facts alone."""

import math
from typing import TYPE_CHECKING

from optax_lossscale._autocast import table as _policy_table
from optax_lossscale._diagnostics import format as _format

if TYPE_CHECKING:
  from optax_lossscale._diagnostics.overflow_report import (
    Overflow,
    OverflowReport,
    ScopeStats,
  )


def report_text(report: "OverflowReport") -> str:
  lines = _verdict(report)
  lines += ["", *_window(report)]
  lines += ["", *_table(report.scopes)]
  return "\n".join(lines)


def _verdict(report: "OverflowReport") -> list[str]:
  first = report.first
  if first is None:
    lines = _format.wrap(
      "No overflow: the loss and every gradient are finite at loss scale"
      f" {_format.scale_with_value(report.scale)} (loss {report.loss:.6g}),"
      " and no value that is not finite changes them."
    )
  else:
    lines = [*_head(report, first), *overflow_lines(first)]
    carried = report.nonfinite_operations
    if carried > 1:
      lines += _format.wrap(
        f"{carried} operations hold values that are not finite in all:"
        " passed on from this one, or a mask's.",
        indent="  ",
      )
    lines += _format.wrap(" ".join(advice(report)))
  if report.masks:
    lines += _format.wrap(
      "Masks (infs the program writes, numbers beyond float16's range that"
      " it casts to float16, and inputs passed as `masks`; what they pass"
      " on is not an overflow): " + "; ".join(report.masks) + "."
    )
  if report.discarded:
    lines += _format.wrap(
      "Not finite, but changing neither the loss nor the gradients (a"
      " `where` drops them, or the next operation gives float32's value"
      " all the same): "
      + "; ".join(_briefly(o) for o in report.discarded)
      + "."
    )
  return lines


def _head(report: "OverflowReport", first: "Overflow") -> list[str]:
  scale = _format.scale_with_value(report.scale)
  dtype = first.dtype or "its dtype"
  if first.pass_name in ("input", "constant"):
    what = (
      f"the input `{first.primitive}`"
      if first.pass_name == "input"
      else "an array `fun` closes over"
    )
    kind = " (bad data)" if first.cause == "data" else ""
    return _format.wrap(
      f"Not finite from the start: {what} holds {_counts(first)} before any"
      f" operation runs{kind}."
    )
  if first.from_mask:
    return _format.wrap(
      f"The loss ({report.loss:.6g}) or a gradient is not finite at loss"
      f" scale {scale}, though no operation overflowed: a mask's inf"
      " reaches it. The first operation that carries it beyond the"
      " positions it masks:"
    )
  if first.cause == "data":
    what = "parameter" if first.from_parameter else "input"
    return _format.wrap(
      f"Data beyond float16's range: the {what} `{first.from_input}` holds"
      f" values beyond {_format.number(_limit(dtype))}, which the cast to"
      f" {dtype} makes inf (loss scale {scale}). It is made by:"
    )
  if first.cause == "index":
    source = f" from the input `{first.from_input}`" if first.from_input else ""
    return _format.wrap(
      f"An index out of range in the {first.pass_name} pass: the gather"
      f" fills NaN where its index{source} is out of range. It is made by:"
    )
  if first.cause == "arithmetic":
    return _format.wrap(
      f"Not finite in float32 either, in {_where(first)} (loss scale"
      f" {scale}): the program's own arithmetic (a log or a division by 0,"
      " an inf minus an inf), not float16's range. It is made by:"
    )
  if first.cause in ("callback", "unknown"):
    what = (
      f"a host call (`{first.host_call}`), which the finder runs once, as"
      " written"
      if first.cause == "callback"
      else "an operation the finder cannot compute in float32"
    )
    return _format.wrap(
      f"Not finite in {_where(first)} (loss scale {scale}), made by"
      f" {what}: no float32 value to compare it with. It is made by:"
    )
  return [
    *_format.wrap(
      f"Overflow in {_where(first)} (loss scale {scale}): beyond {dtype}'s"
      " range."
    ),
    *_format.wrap(_range_words(first, report)),
  ]


def _where(o: "Overflow") -> str:
  """`rsqrt's derivative`, `the forward pass`, `the loss scaling`."""
  if o.derivative_of is not None:
    return f"{o.derivative_of}'s derivative"
  if o.pass_name == "loss scaling":
    return "the loss scaling"
  return f"the {o.pass_name} pass"


def _range_words(first: "Overflow", report: "OverflowReport") -> str:
  if first.derivative_of is not None:
    again = (
      ", and again in the backward pass under `jax.checkpoint`"
      if first.recomputed
      else ""
    )
    return (
      "It is finite in float32. jax computes it in the forward pass for the"
      f" backward one{again}; it does not depend on the loss scale (the loss"
      f" is {report.loss:.6g}). It is made by:"
    )
  if first.pass_name == "loss scaling":
    return (
      "The loss's cotangent, the scale in the loss's dtype, is finite in"
      " float32. It is made by:"
    )
  if first.pass_name == "backward" and first.depends_on_scale:
    return (
      "It is finite in float32, and computed from the loss scale (a"
      " cotangent). The first value that is not finite and changes the"
      " gradients is made by:"
    )
  if first.pass_name == "backward":
    return (
      "It is finite in float32, and computed from the forward pass's values"
      " alone, not from the loss scale. It is made by:"
    )
  changed = ""
  if math.isfinite(report.loss) and report.reference_loss is not None:
    changed = (
      f" The loss is {report.loss:.6g}, the float32 shadow's"
      f" {report.reference_loss:.6g}."
    )
  return (
    "It is finite in float32 (the same operations computed in float32)."
    f"{changed} The first value that is not finite and changes the loss or"
    " the gradients is made by:"
  )


def advice(report: "OverflowReport") -> list[str]:
  """What to do, from the facts of `report.first`: one place that words
  it, so that a fix known elsewhere (a compute policy that was applied)
  can be named here."""
  first = report.first
  if first is None:
    return []
  if first.from_mask:
    return ["Mask so that every row keeps a finite value it can pick."]
  if first.cause == "data" and first.from_parameter:
    return [_parameter_advice(report, first)]
  if first.cause == "data":
    hint = (
      f" If `{first.from_input}` is a mask, pass"
      f' `masks=("{first.from_input}",)`.'
      if first.pass_name == "input" and first.from_input and not first.nan
      else ""
    )
    return [
      "Check the batch: no loss scale fixes bad data, and"
      " `backoff_on_nonfinite_loss=False` keeps such steps from lowering"
      f" the scale.{hint}"
    ]
  if first.cause == "index":
    return ["Keep the indices in range, or index with a mode that clips."]
  if first.cause == "arithmetic":
    return [
      "float32 would not fix it, nor would a loss scale: guard the"
      " operation (a `where` before it, an epsilon)."
    ]
  if first.cause != "range":
    return []
  if first.pass_name == "loss scaling":
    return ["Compute the loss in float32, or lower the scale."]
  if first.depends_on_scale and first.custom_rule is None:
    return [
      "A smaller loss scale keeps it in range; the dynamic scale backs off"
      " until it does."
    ]
  if first.custom_rule is None:
    fix = _autocast_fix(report, first)
    if fix:
      return [f"No loss scale fixes it; in float32 it is finite: {fix}."]
  scope = f" (scope `{first.scope}`)" if first.scope else ""
  return [f"No loss scale fixes it: compute this operation{scope} in float32."]


def _autocast_fix(report: "OverflowReport", first: "Overflow") -> str | None:
  """The `ols.autocast` call that computes `first`'s operation in float32:
  the policy itself where `fun` ran under none and the policy's float32
  list holds the operation (its derivative's, for a derivative); else
  the name the finder gives it (a scope, or a module method on the call
  path), which `keep_float32` accepts. None where there is neither."""
  operation = first.derivative_of or first.primitive
  if not report.autocast and _policy_table.runs_in_float32(operation):
    return (
      "`ols.autocast(loss_fn)`, on the model written in float32, computes"
      f" `{operation}` and its derivative in float32"
    )
  return _keep_float32(first)


def _keep_float32(first: "Overflow") -> str | None:
  """`ols.autocast(loss_fn, keep_float32=(name,))` for the name of
  `first` that `keep_float32` accepts, and what it computes in float32;
  None where `first` has no such name."""
  name = _keepable_name(first)
  if name is None:
    return None
  what = f"scope `{name}`" if name == first.scope else f"`{name}`"
  return (
    f'`ols.autocast(loss_fn, keep_float32=("{name}",))` computes {what}'
    " in float32"
  )


def _parameter_advice(report: "OverflowReport", first: "Overflow") -> str:
  """For a parameter beyond float16's range where the program casts it to
  float16: no loss scale fixes it; where it is cast under `autocast`, the
  name that keeps its use in float32."""
  keep = _keep_float32(first) if report.autocast else None
  fix = f" {keep}, where the parameter stays float32." if keep else ""
  return (
    f"No loss scale fixes it: the parameter is beyond float16's range.{fix}"
  )


def _keepable_name(first: "Overflow") -> str | None:
  """The innermost name of `first` that `keep_float32` accepts and that is
  narrower than the whole function: its name scopes, else the innermost
  call on its path below the outermost (the loss function itself)."""
  if first.scope:
    return first.scope
  if len(first.call_path) > 1:
    return first.call_path[-1]
  return None


def _limit(dtype: str) -> float:
  return _format.FLOAT16_MAX if dtype == "float16" else math.inf


def _briefly(o: "Overflow") -> str:
  at = f" at {o.source}" if o.source else ""
  cause = f", {o.cause}" if o.cause else ""
  return f"{o.primitive} ({o.pass_name}{cause}){at}"


def _counts(o: "Overflow") -> str:
  parts = [f"{n} {name}" for n, name in ((o.inf, "inf"), (o.nan, "NaN")) if n]
  return f"{' and '.join(parts)} of {o.size} values"


def overflow_lines(o: "Overflow") -> list[str]:
  shape = ",".join(str(d) for d in o.shape)
  if o.pass_name == "input":
    return [f"  value      {o.dtype}[{shape}]: {_counts(o)}"]
  largest = f"; largest finite |x| {o.largest:.4g}" if o.largest > 0 else ""
  if o.dtype == "float16" and o.inf:
    largest += " (float16's largest is 65504)"
  field = "  {:<11}".format
  hanging = field("")
  lines = _format.wrap(
    f"{field('operation')}{o.primitive} -> {o.dtype}[{shape}]:"
    f" {_counts(o)}{largest}",
    hanging=hanging,
  )
  lines += _wrap_path(field("scope"), o.scope or "(no name scope)", "/")
  if o.custom_rule is not None:
    lines += _format.wrap(
      f"{field('rule')}of `{o.custom_rule}`, a custom derivative: named by"
      " the line that calls it",
      hanging=hanging,
    )
  if o.boundary is not None:
    lines += _format.wrap(
      f"{field('inside')}a `{o.boundary}`, whose body the finder does not"
      " enter: the value was made in it",
      hanging=hanging,
    )
  if o.source is not None:
    lines += _format.wrap(f"{field('source')}{o.source}", hanging=hanging)
    if o.code:
      lines.append(f"{hanging}  {o.code}")
  if o.call_path:
    lines += _wrap_path(field("call path"), " > ".join(o.call_path), " > ")
  return lines


def _wrap_path(label: str, path: str, separator: str) -> list[str]:
  """`label` and `path`, wrapped only after a `separator`: a name is never
  broken, and one longer than a line stays whole on its own line."""
  parts = path.split(separator)
  pieces = [part + separator for part in parts[:-1]] + [parts[-1]]
  lines = [label]
  for piece in pieces:
    if (
      len(lines[-1]) + len(piece.rstrip()) > _format.WIDTH and lines[-1].strip()
    ):
      if lines[-1] != label:
        lines[-1] = lines[-1].rstrip()
        lines.append(" " * len(label))
    lines[-1] += piece.lstrip() if lines[-1].isspace() else piece
  return [line.rstrip() for line in lines]


def _window(report: "OverflowReport") -> list[str]:
  """What the loss scale leaves of float16's range in the backward pass:
  its largest cotangent, as measured."""
  backward = [s for s in report.scopes if s.pass_name == "backward"]
  first = report.first
  if not backward:
    return _format.wrap(
      "No float16 cotangent in the backward pass: the loss scale has no"
      " float16 range to fit."
    )
  scale = _format.scale_with_value(report.scale)
  largest = max(s.largest for s in backward)
  flushed = sum(s.flushed for s in backward)
  checked = sum(s.flush_checked for s in backward)
  if first is not None and not first.depends_on_scale:
    text = "The value named above is not computed from the loss scale"
    text += ": no scale keeps it in range." if first.cause == "range" else "."
  elif any(s.nonfinite for s in backward):
    text = (
      f"At loss scale {scale}, the backward pass's float16 cotangents are"
      " not all finite."
    )
  elif largest > 0:
    room = math.floor(math.log2(_format.FLOAT16_MAX / largest))
    text = (
      f"At loss scale {scale}, the largest float16 cotangent (a backward"
      f" value computed from the scale) is {largest:.4g}:"
      f" {_format.count(room, 'doubling')} below float16's 65504."
    )
  else:
    text = f"At loss scale {scale}, the backward pass's float16 values are 0."
  if first is not None:
    text += (
      " Infs and NaNs passed on from the value named above are not counted"
      " here."
    )
  if checked:
    text += (
      f" Flushed to zero in the backward pass: {flushed} of {checked}"
      f" float16 values ({_format.percent(flushed / checked)})."
    )
  return _format.wrap(text)


_HEADER = (
  "scope",
  "values",
  "max |x|",
  "doublings",
  "min |x|>0",
  "halvings",
  "flushed",
)


def _table(scopes: "tuple[ScopeStats, ...]") -> list[str]:
  """The scopes' float16 numbers, a table per pass."""
  if not scopes:
    return ["No float16 values: nothing to measure against float16's range."]
  rows = [_HEADER] + [_row(s) for s in scopes]
  widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADER))]

  def line(row: tuple[str, ...]) -> str:
    cells = [
      cell.ljust(width) if i == 0 else cell.rjust(width)
      for i, (cell, width) in enumerate(zip(row, widths, strict=True))
    ]
    return "  " + "  ".join(cells).rstrip()

  lines = []
  for pass_name in ("forward", "backward"):
    rows = [_row(s) for s in scopes if s.pass_name == pass_name]
    if rows:
      lines += [f"Float16 values of the {pass_name} pass, per scope:"]
      lines += [line(_HEADER), *map(line, rows), ""]
  return lines + _format.wrap(
    "doublings: how often the largest value can double before it exceeds"
    " 65504, float16's largest number; halvings: how often the smallest"
    " nonzero one can halve before it falls below 2**-24, float16's"
    " smallest; flushed: the share of values that float16 rounded to zero"
    " where the same operation in float32, from the same inputs, is not"
    " zero."
  )


def _row(s: "ScopeStats") -> tuple[str, ...]:
  def count(n: int | None) -> str:
    return "-" if n is None else str(n)

  largest = "not finite" if s.nonfinite else f"{s.largest:.4g}"
  smallest = f"{s.smallest:.4g}" if s.smallest < math.inf else "-"
  share = s.flushed_share
  return (
    s.scope,
    str(s.values),
    largest,
    count(s.doublings),
    smallest,
    count(s.halvings),
    "-" if share is None else _format.percent(share),
  )
