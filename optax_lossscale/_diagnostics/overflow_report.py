"""What `find_overflow` returns: the first harmful value that is not finite
and what made it, and how close each scope's float16 values run to
float16's two edges. This module imports none of the finder: the types are
public (`optax_lossscale.OverflowReport`) and cost nothing to import."""

import dataclasses
import html
import math
from typing import Any

from optax_lossscale._diagnostics import format as _format
from optax_lossscale._diagnostics import overflow_text as _text


@dataclasses.dataclass(frozen=True)
class Overflow:
  """A value that is not finite, and the operation that made it.

  Attributes:
    pass_name: ``"forward"`` (an operation of ``fun``), ``"backward"`` (its
      derivative: the operations of the backward pass, and the values of a
      derivative that jax computes in the forward pass for the backward
      one, see ``derivative_of``), ``"loss scaling"`` (``loss * scale``
      and its cotangent), or ``"input"`` for an argument of ``fun`` that
      holds one already (``"constant"`` for an array or a number ``fun``
      holds).
    primitive: the jax primitive (``"exp"``, ``"dot_general"``); for a
      derivative computed in the forward pass, that derivative
      (``"rsqrt's derivative"``); for an input, its name by ``fun``'s
      parameters (``"batch['x']"``).
    scope: the name scopes (``jax.named_scope``, Flax Linen module paths),
      joined by ``/``; empty when there are none.
    source: ``"file:line (function)"`` of the user's code that made it
      (for an operation of a custom derivative's rule, the line that calls
      the function, see ``custom_rule``).
    code: the text of that line.
    call_path: the functions on the way there, outermost first (module
      methods included: ``MLP.__call__``, ``Linear.__call__``).
    boundary: ``"scan"``, ``"while"``, ``"cond"`` (or another primitive)
      when the value comes out of a body the finder does not enter: it was
      made in it. None otherwise.
    dtype, shape: of the value.
    nan, inf, size: how many of its elements are NaN, infinite, in all.
    largest: its largest finite magnitude.
    derivative_of: for a value that jax computes in the forward pass for
      the backward one (a residual of the derivative, not an output of
      ``fun``'s operation), the primitive whose derivative it is
      (``"rsqrt"``); None otherwise.
    from_mask: True when no operation made an inf or a NaN of its own, and
      the loss or a gradient is not finite because a mask's inf reached
      it: this is the first operation on its way there that carries it
      beyond the positions it masks (a gather that picks a masked logit,
      a sum over one).
    cause: what made it not finite, as measured against the same program
      computed in float32 (its *shadow*): ``"range"`` (finite in float32:
      beyond its own dtype's range, float16's 65504), ``"data"`` (an input
      that is not finite, or beyond float16's range where the program
      casts it to float16), ``"mask"`` (see ``from_mask``),
      ``"arithmetic"`` (not finite in float32 either: a log of 0, a
      division by 0, an inf minus an inf), ``"index"`` (a gather's NaN,
      where its index is out of range), ``"constant"`` (a NaN the program
      writes or closes over), ``"callback"`` (the output of a host
      callback or an FFI call, which the finder runs once, as written)
      or ``"unknown"`` (an operation it cannot compute in float32).
    depends_on_scale: True for a value computed from the loss scale (a
      cotangent of the backward pass): a smaller scale makes it smaller.
      A derivative computed in the forward pass, or a backward value
      computed from forward values alone (in a ``custom_vjp``'s backward
      rule, say), does not depend on it.
    recomputed: True for a derivative's value that jax computes again in
      the backward pass, under ``jax.checkpoint``.
    custom_rule: the name of the function whose custom derivative
      (``jax.custom_vjp``, ``jax.custom_jvp``) computed it, or None. The
      finder names such a value by the line that calls the function.
    from_input: for ``"data"``, the input whose values it is; for
      ``"index"``, the input its indices come from; None otherwise.
    host_call: the host callback or FFI target that made it, or None.
    from_parameter: True where ``from_input`` is a parameter (part of
      ``args[0]``, the differentiated argument) rather than an input held
      fixed (the batch).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> def loss(w, x):
    ...   return jnp.sum(jnp.exp(x * w.astype(jnp.float16)).astype(float))
    >>> first = ols.find_overflow(loss, jnp.full(2, 16.0),
    ...                           jnp.ones(2, jnp.float16)).first
    >>> (first.pass_name, first.primitive, first.inf, first.size)
    ('forward', 'exp', 2, 2)
    >>> first.cause  # exp(16) is finite in float32
    'range'
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
  cause: str | None = None
  depends_on_scale: bool = False
  recomputed: bool = False
  custom_rule: str | None = None
  from_input: str | None = None
  host_call: str | None = None
  from_parameter: bool = False

  def __str__(self) -> str:
    return "\n".join(_text.overflow_lines(self))


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
    flush_checked: values for which that float32 reference is computed:
      the outputs of casts to float16 and of float16 products, quotients
      and powers.

  A value counts once, in its own pass. The backward table holds the
  cotangents: the values computed from the loss scale. The forward table
  holds every other float16 value: ``fun``'s own, the derivatives jax
  computes in the forward pass for the backward one (which do not depend
  on the scale), whether or not ``jax.checkpoint`` has them computed again
  in the backward pass. A mask's infs are not counted as ``nonfinite``.

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
  """What :func:`find_overflow` found: true when a value that is not
  finite, or an overflow, changes the loss or a gradient.

  Attributes:
    first: the first harmful value, in program order: one an operation
      made not finite (or a bad input) whose change reaches the loss or a
      gradient, as infs and NaNs or as values far from the float32
      shadow's (an RMSNorm whose square overflows zeroes a token's
      activations: the loss stays finite, and changes). Where only a
      mask's inf reaches them, the first operation that carries it beyond
      the positions it masks (``first.from_mask``). None when nothing
      harmful was found.
    nonfinite_operations: how many operations hold values that are not
      finite in all: made there, passed on, or a mask's.
    loss: the loss ``fun`` returned (unscaled).
    scale: the loss scale the backward pass ran at.
    scopes: the float16 values of each scope, in program order.
    masks: where the masks are, in words: ±infs the program writes (a
      literal, an array it closes over), numbers beyond float16's range
      that it casts to float16, and the inputs passed as ``masks``. They
      and what they pass on are not overflows.
    discarded: values that are not finite but change neither the loss nor
      the gradients (a ``where`` drops them; ``tanh`` of an inf is 1, as
      float32's is), the first few in program order.
    reference_loss: the loss of the float32 shadow: the same program with
      float16 (and bfloat16 and float8) computed in float32.
    autocast: the compute dtypes of the :func:`autocast` policies ``fun``
      applied as the finder traced it (``("float16",)`` for
      ``find_overflow(ols.autocast(loss_fn), ...)``); empty where it
      applied none. The advice follows it: a scope to keep in float32
      under the policy, or the policy itself.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> def loss(w, bias):  # bias: -inf where masked
    ...   logits = w.astype(jnp.float16) + bias
    ...   return jnp.sum(jnp.exp(logits).astype(jnp.float32))
    >>> bias = jnp.array([0.0, -jnp.inf], jnp.float16)
    >>> report = ols.find_overflow(loss, jnp.array([1.0, 1.0]), bias,
    ...                            masks=("bias",))
    >>> bool(report), report.masks
    (False, ('the input `bias`',))
    >>> report = ols.find_overflow(loss, jnp.array([12.0, 1.0]), bias,
    ...                            masks=("bias",))
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
  reference_loss: float | None = None
  autocast: tuple[str, ...] = ()

  def __bool__(self) -> bool:
    return self.first is not None

  def __str__(self) -> str:
    return _text.report_text(self)

  def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
    """IPython's display: the same text as `str`."""
    printer.text(str(self))

  def _repr_html_(self) -> str:
    """Jupyter's display: the text, in a monospace block."""
    return f"<pre>{html.escape(str(self))}</pre>"


# The public types say where users import them from (in `help()`, reprs,
# pickles and the API page), not this private module; the package resolves
# them on first use.
for _public_type in (Overflow, ScopeStats, OverflowReport):
  _public_type.__module__ = "optax_lossscale"
del _public_type

# Their examples run as this module's doctests (a type whose `__module__`
# is another module's is left out of it otherwise).
__test__ = {
  "Overflow": Overflow,
  "ScopeStats": ScopeStats,
  "OverflowReport": OverflowReport,
}
