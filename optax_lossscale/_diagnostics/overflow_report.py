"""What `find_overflow` returns: the first non-finite value, and how close
each scope's float16 values run to float16's two edges, in words."""

import dataclasses
import html
import math
from typing import Any

from optax_lossscale._diagnostics import format as _format


@dataclasses.dataclass(frozen=True)
class Overflow:
  """A value that is not finite, and the operation that made it.

  Attributes:
    pass_name: ``"forward"`` (what the loss is computed from),
      ``"backward"`` (what the gradients are computed from: the cotangents,
      and derivatives computed in the forward trace, see
      ``derivative_of``), ``"loss scaling"`` (``loss * scale`` itself), or
      ``"input"`` for an argument of ``fun`` that holds one already
      (``"constant"`` for an array ``fun`` closes over).
    primitive: the jax primitive (``"exp"``, ``"dot_general"``); for a
      derivative computed in the forward trace, that derivative
      (``"rsqrt's derivative"``); for an input, its name by ``fun``'s
      parameters (``"batch['x']"``).
    scope: the name scopes (``jax.named_scope``, Flax Linen module paths),
      joined by ``/``; empty when there are none.
    source: ``"file:line (function)"`` of the user's code that made it.
    code: the text of that line.
    call_path: the functions on the way there, outermost first (module
      methods included: ``MLP.__call__``, ``Linear.__call__``).
    boundary: ``"scan"``, ``"while"``, ``"cond"`` (or another primitive)
      when the value comes out of a body the finder does not enter: the
      overflow happened inside it. None otherwise.
    dtype, shape: of the value.
    nan, inf, size: how many of its elements are NaN, infinite, in all.
    largest: its largest finite magnitude.
    derivative_of: for a value that jax computes while tracing the forward
      pass but that only the gradients use, the primitive whose derivative
      it is (``"rsqrt"``); None otherwise. Such a value does not depend on
      the loss scale.
    from_mask: True when no operation made an inf or a NaN of its own, and
      the loss or a gradient is not finite because a mask's inf reached
      it: this is the first operation on its way there that carries it
      beyond the positions it masks (a gather that picks a masked logit,
      a sum over one).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> def loss(w, x):
    ...   return jnp.sum(jnp.exp(x * w.astype(jnp.float16)).astype(float))
    >>> first = ols.find_overflow(loss, jnp.full(2, 16.0),
    ...                           jnp.ones(2, jnp.float16)).first
    >>> (first.pass_name, first.primitive, first.inf, first.size)
    ('forward', 'exp', 2, 2)
    >>> first.code
    'return jnp.sum(jnp.exp(x * w.astype(jnp.float16)).astype(float))'
  """

  pass_name: str
  primitive: str
  scope: str
  source: str | None
  code: str | None
  call_path: tuple[str, ...]
  boundary: str | None
  dtype: str
  shape: tuple[int, ...]
  nan: int
  inf: int
  size: int
  largest: float
  derivative_of: str | None = None
  from_mask: bool = False

  def __str__(self) -> str:
    return "\n".join(_overflow_lines(self))


@dataclasses.dataclass(frozen=True)
class ScopeStats:
  """The float16 values one scope made in one pass.

  Attributes:
    pass_name: ``"forward"`` or ``"backward"``.
    scope: the name scopes joined by ``/``, or, where there are none, the
      function that made the values in parentheses (``"(MLP.__call__)"``).
    values: float16 values measured (elements of operation outputs).
    largest: the largest finite magnitude (0 when there is none).
    smallest: the smallest nonzero finite magnitude (inf when none).
    nonfinite: values that are NaN or infinite.
    flushed: values that float16 rounded to zero although the same
      operation, computed in float32 from the same inputs, gives a nonzero
      value; counted where the operation made them (a zero passed on is
      not counted again).
    flush_checked: values for which that float32 reference exists (not for
      the outputs of control flow, for instance).

  A value counts once, in its own pass: a value recomputed under
  ``jax.checkpoint`` is not counted again, a mask's infs are not counted as
  ``nonfinite``, and the forward table holds the derivatives computed in
  the forward trace (they do not scale with the loss scale).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> def loss(w, x):
    ...   with jax.named_scope("layer"):
    ...     h = x * w.astype(jnp.float16)  # 2**6 * 2**4
    ...   return jnp.sum(h.astype(jnp.float32))
    >>> report = ols.find_overflow(loss, jnp.full(4, 16.0),
    ...                            jnp.full(4, 64.0, jnp.float16))
    >>> layer = report.scopes[0]
    >>> layer.pass_name, layer.scope, layer.largest, layer.doublings
    ('forward', 'layer', 1024.0, 5)
  """

  pass_name: str
  scope: str
  values: int
  largest: float
  smallest: float
  nonfinite: int
  flushed: int
  flush_checked: int

  @property
  def doublings(self) -> int | None:
    """How many times every value can double before one exceeds float16's
    largest number (65504); None when nothing finite and nonzero was made
    or a value is already not finite."""
    if self.nonfinite or not 0 < self.largest <= _format.FLOAT16_MAX:
      return None
    return math.floor(math.log2(_format.FLOAT16_MAX / self.largest))

  @property
  def halvings(self) -> int | None:
    """How many times the smallest nonzero value can halve before it falls
    below float16's smallest subnormal (2**-24); None without one."""
    if not 0 < self.smallest < math.inf:
      return None
    return math.floor(math.log2(self.smallest / _format.FLOAT16_SMALLEST))

  @property
  def flushed_share(self) -> float | None:
    """`flushed` over `flush_checked`, or None when nothing was checked."""
    if not self.flush_checked:
      return None
    return self.flushed / self.flush_checked


@dataclasses.dataclass(frozen=True)
class OverflowReport:
  """What :func:`find_overflow` found: true when the loss or a gradient is
  not finite.

  Attributes:
    first: the first harmful value that is not finite, in program order:
      made not finite by an operation from finite inputs (or a bad input),
      and carried to the loss, the scaled loss or a gradient. Where only a
      mask's inf reaches them, the first operation that carries it beyond
      the positions it masks (``first.from_mask``). None when the loss and
      the gradients are finite.
    nonfinite_operations: how many operations hold values that are not
      finite in all: made there, passed on, or a mask's.
    loss: the loss ``fun`` returned (unscaled).
    scale: the loss scale the backward pass ran at.
    scopes: the float16 values of each scope, in program order.
    masks: where the masks are, in words: infs written in the code or
      passed in, and values that become infs only once cast to float16.
      They and what they pass on are not overflows.
    discarded: overflows that reach neither the loss nor the gradients (a
      ``where`` drops them), the first few in program order.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> def loss(w, bias):  # bias: -inf where masked
    ...   logits = w.astype(jnp.float16) + bias
    ...   return jnp.sum(jnp.exp(logits).astype(jnp.float32))
    >>> bias = jnp.array([0.0, -jnp.inf], jnp.float16)
    >>> report = ols.find_overflow(loss, jnp.array([1.0, 1.0]), bias)
    >>> bool(report), report.masks
    (False, ('the input `bias`',))
    >>> report = ols.find_overflow(loss, jnp.array([12.0, 1.0]), bias)
    >>> bool(report), report.first.primitive  # exp(12) > 65504
    (True, 'exp')
  """

  first: Overflow | None
  nonfinite_operations: int
  loss: float
  scale: float
  scopes: tuple[ScopeStats, ...]
  masks: tuple[str, ...] = ()
  discarded: tuple[Overflow, ...] = ()

  def __bool__(self) -> bool:
    return self.first is not None

  def __str__(self) -> str:
    lines = _verdict(self)
    lines += ["", *_window(self)]
    lines += ["", *_table(self.scopes)]
    return "\n".join(lines)

  def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
    """IPython's display: the same text as `str`."""
    printer.text(str(self))

  def _repr_html_(self) -> str:
    """Jupyter's display: the text, in a monospace block."""
    return f"<pre>{html.escape(str(self))}</pre>"


def _verdict(report: OverflowReport) -> list[str]:
  first = report.first
  if first is None:
    lines = _format.wrap(
      "No overflow: the loss and every gradient are finite at loss scale"
      f" {_format.scale_with_value(report.scale)} (loss {report.loss:.6g})."
    )
  else:
    lines = [*_head(report, first), *_overflow_lines(first)]
    carried = report.nonfinite_operations
    if carried > 1:
      lines += _format.wrap(
        f"{carried} operations hold values that are not finite in all:"
        " passed on from this one, or a mask's.",
        indent="  ",
      )
  if report.masks:
    lines += _format.wrap(
      "Masks (infs written in the code or passed in, and values that become"
      " infs once cast to float16; what they pass on is not an overflow): "
      + "; ".join(report.masks)
      + "."
    )
  if report.discarded:
    lines += _format.wrap(
      "Discarded (not finite, but reaching neither the loss nor the"
      " gradients, as where a `where` drops them): "
      + "; ".join(_briefly(o) for o in report.discarded)
      + "."
    )
  return lines


def _head(report: OverflowReport, first: Overflow) -> list[str]:
  scale = _format.scale_with_value(report.scale)
  if first.pass_name in ("input", "constant"):
    what = (
      f"the input `{first.primitive}`"
      if first.pass_name == "input"
      else "an array `fun` closes over"
    )
    return _format.wrap(
      f"Not finite from the start: {what} holds {_counts(first)} before any"
      " operation runs."
    )
  if first.from_mask:
    return [
      *_format.wrap(
        f"The loss ({report.loss:.6g}) or a gradient is not finite at loss"
        f" scale {scale}, though no operation overflowed: a mask's inf"
        " reaches it. The first operation that carries it beyond the"
        " positions it masks:"
      )
    ]
  if first.derivative_of is not None:
    return _format.wrap(
      f"Overflow in {first.derivative_of}'s derivative (loss scale"
      f" {scale}): jax computes it while tracing the forward pass, for the"
      " backward pass, so it does not depend on the loss scale (the loss"
      f" is {report.loss:.6g}). It is made by:"
    )
  if first.pass_name == "loss scaling":
    return _format.wrap(
      f"Overflow in the loss scaling: the loss times the scale {scale} is"
      " beyond float16's 65504. The loss is float16: compute it in"
      " float32, or lower the scale. It is made by:"
    )
  return [
    f"Overflow in the {first.pass_name} pass (loss scale {scale}).",
    *_format.wrap(
      "The first value that is not finite and reaches the loss or the"
      " gradients is made by:"
    ),
  ]


def _briefly(o: Overflow) -> str:
  at = f" at {o.source}" if o.source else ""
  return f"{o.primitive} ({o.pass_name}){at}"


def _counts(o: Overflow) -> str:
  parts = [f"{n} {name}" for n, name in ((o.inf, "inf"), (o.nan, "NaN")) if n]
  return f"{' and '.join(parts)} of {o.size} values"


def _overflow_lines(o: Overflow) -> list[str]:
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


def _window(report: OverflowReport) -> list[str]:
  """The loss-scale window the backward pass's float16 values leave."""
  backward = [s for s in report.scopes if s.pass_name == "backward"]
  if not backward:
    return _format.wrap(
      "No float16 value in the backward pass: the loss scale has no float16"
      " range to fit."
    )
  scale = _format.scale_with_value(report.scale)
  largest = max(s.largest for s in backward)
  flushed = sum(s.flushed for s in backward)
  checked = sum(s.flush_checked for s in backward)
  if any(s.nonfinite for s in backward):
    text = (
      f"At loss scale {scale}, the backward pass's float16 values are not"
      " all finite."
    )
  elif largest > 0:
    room = math.floor(math.log2(_format.FLOAT16_MAX / largest))
    text = (
      f"At loss scale {scale}, the backward pass's largest float16"
      f" magnitude is {largest:.4g}: the scale can double {room} more"
      f" time{'s' if room != 1 else ''} before a backward value overflows."
    )
  else:
    text = f"At loss scale {scale}, the backward pass's float16 values are 0."
  text += (
    " (Backward values are proportional to the scale; forward values do not"
    " depend on it.)"
  )
  if report.first is not None:
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


def _table(scopes: tuple[ScopeStats, ...]) -> list[str]:
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


def _row(s: ScopeStats) -> tuple[str, ...]:
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
