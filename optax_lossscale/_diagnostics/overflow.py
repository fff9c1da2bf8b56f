"""`find_overflow`: where the first inf or NaN of a step is made, and how
close every scope runs to float16's edges.

The function and its gradient are traced once (`jax.make_jaxpr` of the
scaled loss's `value_and_grad`), and the trace is evaluated by
`_interpret.evaluate` under one `jax.jit`, with a visitor that reduces
every floating-point output to a few device statistics. The statistics come
back as two arrays; the first offender is picked on the host, in program
order. Nothing runs on the host during the evaluation (no callback).
"""

import dataclasses
import linecache
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._access import locate as _locate
from optax_lossscale._access.scale import scaled
from optax_lossscale._core import compat as _compat
from optax_lossscale._core import interpret as _interpret
from optax_lossscale._diagnostics.overflow_report import (
  Overflow,
  OverflowReport,
  ScopeStats,
)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_LIBRARY_DIRS = (
  f"{os.sep}site-packages{os.sep}",
  f"{os.sep}dist-packages{os.sep}",
)
# A float32 recomputation would not mean the same thing for these.
_NO_REFERENCE = frozenset(
  {"bitcast_convert_type", "reduce_precision", "nextafter"}
)
# Operations that only move, select or widen values: they make no value of
# their own (none can turn finite inputs into an inf or a NaN, nor round one
# to zero), so they are not measured; their outputs stand for their inputs.
_MOVES = frozenset(
  {
    "broadcast_in_dim", "clamp", "concatenate", "copy", "copy_p",
    "device_put", "dynamic_slice", "dynamic_update_slice", "expand_dims",
    "gather", "max", "min", "neg", "optimization_barrier", "pad",
    "reduce_max", "reduce_min", "reshape", "rev", "select_n",
    "sharding_constraint", "slice", "squeeze", "stop_gradient", "transpose",
  }
)  # fmt: skip
# A literal that is not finite (a -inf mask's).
_NONFINITE_LITERAL = -1
# Scope names jax makes itself; they name no user scope.
_JAX_SCOPES = frozenset({"rematted_computation"})


def find_overflow(
  fun: Callable[..., Any], *args: Any, scale: Any = 1.0
) -> OverflowReport:
  """Finds the first operation that makes an inf or a NaN, forward or back.

  Runs ``fun(*args)`` (a scalar loss) and its gradient with respect to
  ``args[0]`` once, at loss scale ``scale``, and checks every value every
  operation makes. The first operation whose output is not finite although
  its inputs are (or an argument that holds an inf or a NaN already) is
  named by its pass (forward or backward), its primitive, its name scopes
  (``jax.named_scope``, Flax Linen module paths, Equinox layer names), the
  line of user code that made it and the call path there (module methods
  included, such as ``MLP.__call__ > Linear.__call__``). Use it on the batch
  of a skipped step: it is a diagnosis, not part of training.

  For every scope and pass, the report also measures the float16 values
  against float16's two edges: the largest magnitude against 65504, the
  smallest nonzero one against ``2**-24``, and the share *flushed* to zero:
  values that an operation's float16 output holds as zero although the same
  operation computed in float32 from the same inputs does not (a zero
  passed on by later operations is not counted again). Backward values are
  proportional to the scale, so the largest says how far the scale may grow
  before the backward pass overflows.

  Every floating-point output is checked for infs and NaNs; only float16
  ones are measured against its range. An inf written in the code (a
  ``-inf`` mask) is no overflow, and neither is what it passes on.
  Operations that only move, select or widen values (reshapes, broadcasts,
  ``where``, ``max``) make no value of their own and are not measured.
  bfloat16 has float32's range (up to about ``3.4e38``), so it overflows
  where float32 does and needs no loss scale; its short mantissa (8 bits)
  costs precision, not range, which this finder does not measure. Calls
  (``jit``), ``remat`` and custom derivatives are entered; ``scan``,
  ``while_loop`` and ``cond`` are not: a non-finite value coming out of
  one is reported as made inside it.

  Args:
    fun: the loss function, returning a floating-point scalar. Its first
      argument holds the parameters: a pytree (a dict, a Flax NNX module,
      an Equinox module, Linen variables) whose floating-point arrays are
      differentiated; its other leaves are held fixed.
    *args: ``fun``'s arguments, such as ``(params, batch)``; arrays in
      them are inputs, anything else is passed as it is.
    scale: the loss scale of the backward pass: a positive number, or any
      optimizer state that :func:`loss_scale` accepts (its current scale).

  Returns:
    An ``OverflowReport``: false when no value overflowed. ``str(report)``
    says where (and prints a table of the scopes); ``report.first`` is the
    first non-finite value (``pass_name``, ``primitive``, ``scope``,
    ``source``, ``code``, ``call_path``, ``boundary``, ``dtype``, ``shape``,
    ``nan``, ``inf``, ``size``, ``largest``); ``report.scopes`` holds each
    scope's float16 numbers (``largest``, ``smallest``, ``flushed``, and
    ``doublings``/``halvings`` to the edges).

  Raises:
    TypeError: when ``fun`` is not callable, when ``args[0]`` holds no
      floating-point array, or when the loss is not a floating-point array.
    ValueError: when the loss is not a scalar, or ``scale`` is not a
      positive finite number or an optimizer state with one loss scale.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> def loss(w, x):
    ...   with jax.named_scope("attention"):
    ...     logits = x @ w.astype(jnp.float16)
    ...     weights = jnp.exp(logits)
    ...   return jnp.mean(weights.astype(jnp.float32))
    >>> x = jnp.ones((2, 4), jnp.float16)
    >>> bool(ols.find_overflow(loss, jnp.full((4, 3), 0.5), x))
    False
    >>> report = ols.find_overflow(loss, jnp.full((4, 3), 4.0), x)
    >>> first = report.first  # exp(16) is beyond float16's 65504
    >>> first.pass_name, first.scope, first.primitive, first.inf
    ('forward', 'attention', 'exp', 6)
    >>> print(str(report).splitlines()[0])
    Overflow in the forward pass (loss scale 1).
    >>> scaled = ols.find_overflow(loss, jnp.full((4, 3), 0.5), x,
    ...                            scale=2.0**20)  # or an optimizer state
    >>> scaled.first.pass_name  # the cotangent 2**20 / 6 exceeds 65504
    'backward'
  """
  if not callable(fun):
    raise TypeError(f"`fun` must be the loss function (callable), got {fun!r}.")
  if not args:
    raise TypeError(
      "find_overflow needs `fun`'s arguments: find_overflow(fun, params,"
      " batch, ...); the gradient is taken with respect to the first."
    )
  scale_value = _scale_value(scale)
  program = _Program(fun, args)
  closed = jax.make_jaxpr(program)(
    program.differentiated, program.inputs, jnp.float32(scale_value)
  )
  labels = [*program.labels, "the loss scale"]
  recorder = _Recorder()

  def instrumented(consts: list[Any], inputs: list[Any]) -> Any:
    env = dict(zip(closed.jaxpr.constvars, consts, strict=True))
    env.update(zip(closed.jaxpr.invars, inputs, strict=True))
    origin = {
      v: recorder.input(label, value, "input")
      for v, label, value in zip(
        closed.jaxpr.invars, labels, inputs, strict=True
      )
    }
    for v, value in zip(closed.jaxpr.constvars, consts, strict=True):
      # Part of the code, not of the data: a -inf mask, say.
      origin[v] = recorder.input(
        "an array `fun` closes over", value, "constant"
      )
    outs = _interpret.evaluate(
      closed.jaxpr,
      consts,
      inputs,
      _Measure(recorder, env, origin, ()),
      ruled_calls=True,
    )
    return outs[0], recorder.statistics()

  inputs = [*program.differentiated, *program.inputs, jnp.float32(scale_value)]
  consts = list(closed.consts)
  lowered = jax.jit(instrumented).lower(consts, inputs)
  compiled = _compat.compile_for_one_run(lowered, recorder.elements())
  loss, statistics = compiled(consts, inputs)
  counts, magnitudes = recorder.unpack(statistics)
  return recorder.report(float(loss), scale_value, counts, magnitudes)


def _scale_value(scale: Any) -> float:
  """The scale as a float: a number, or the scale of an optimizer state."""
  if isinstance(scale, bool):
    raise ValueError(f"`scale` must be a positive number, got {scale!r}.")
  try:
    value = float(scale)
  except (TypeError, ValueError):
    value = float(_locate.find_loss_scale_state(scale).loss_scale)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(
      f"`scale` must be a positive finite number, got {value!r}."
    )
  return value


class _Program:
  """`fun`'s gradient program: `(differentiated, inputs, scale) -> (loss,
  grads)`, with `args` split into the first argument's floating-point
  arrays (differentiated), the other arrays (inputs), and the rest (held
  as they are)."""

  def __init__(self, fun: Callable[..., Any], args: Sequence[Any]):
    self._fun = fun
    flat, self._treedef = jax.tree_util.tree_flatten_with_path(tuple(args))
    self._leaves = [leaf for _, leaf in flat]
    self._diff = []
    self._input = []
    self.labels = []
    for i, (path, leaf) in enumerate(flat):
      first = path[0] == jax.tree_util.SequenceKey(0)
      if first and _is_float_array(leaf):
        self._diff.append(i)
      elif _is_array(leaf):
        self._input.append(i)
    for i in self._diff + self._input:
      self.labels.append("args" + jax.tree_util.keystr(flat[i][0]))
    if not self._diff:
      raise TypeError(
        "find_overflow differentiates the loss with respect to `fun`'s first"
        " argument, so that argument must hold floating-point arrays (the"
        f" parameters); got {_describe(args[0])}."
      )
    self.differentiated = [self._leaves[i] for i in self._diff]
    self.inputs = [self._leaves[i] for i in self._input]

  def __call__(
    self, differentiated: list[Any], inputs: list[Any], scale: jax.Array
  ) -> tuple[jax.Array, list[Any]]:
    def scaled_loss(diff: list[Any]) -> tuple[jax.Array, jax.Array]:
      leaves = list(self._leaves)
      for i, value in zip(self._diff, diff, strict=True):
        leaves[i] = value
      for i, value in zip(self._input, inputs, strict=True):
        leaves[i] = value
      args = jax.tree_util.tree_unflatten(self._treedef, leaves)
      loss = _checked_loss(self._fun(*args))
      return scaled(loss, scale), loss

    (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(
      differentiated
    )
    return loss, grads


def _is_array(x: Any) -> bool:
  return isinstance(x, jax.Array | np.ndarray)


def _is_float_array(x: Any) -> bool:
  return _is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


def _describe(x: Any) -> str:
  if _is_array(x):
    return f"an array of dtype {x.dtype}"
  leaves = jax.tree.leaves(x)
  if not leaves:
    return f"{type(x).__name__} with no array in it"
  kinds = sorted(
    {getattr(leaf, "dtype", type(leaf).__name__).__str__() for leaf in leaves}
  )
  return f"{type(x).__name__} whose leaves are {', '.join(kinds)}"


def _checked_loss(loss: Any) -> jax.Array:
  if isinstance(loss, tuple | list | dict):
    raise TypeError(
      "`fun` must return the loss alone, a scalar; it returned a"
      f" {type(loss).__name__}. For a function with aux outputs, pass"
      " `lambda *a: fun(*a)[0]`."
    )
  loss = jnp.asarray(loss)
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(
      f"`fun` must return a floating-point loss, got dtype {loss.dtype}."
    )
  if loss.shape != ():
    raise ValueError(
      "`fun` must return a scalar loss (the mean over the batch, say), got"
      f" shape {loss.shape}."
    )
  return loss


@dataclasses.dataclass(frozen=True)
class _Where:
  """Where an equation is, in words: known while tracing."""

  pass_name: str
  primitive: str
  scope: str
  label: str  # the scope, or the function, for the table
  source: str | None = None
  code: str | None = None
  call_path: tuple[str, ...] = ()
  boundary: str | None = None


@dataclasses.dataclass(frozen=True)
class _Site:
  """A measured value: where it was made, and its type."""

  serial: int  # its equation's position in program order
  where: _Where
  dtype: str
  shape: tuple[int, ...]
  has_reference: bool  # a float32 reference says what was flushed
  # The measured values (indices) whose finiteness decides that of the
  # equation's inputs; `_NONFINITE_LITERAL` for a literal inf or NaN.
  inputs: frozenset[int] = frozenset()

  @property
  def size(self) -> int:
    return math.prod(self.shape)


class _Recorder:
  """Collects, in program order, each floating-point value's statistics
  (traced) and its site (static)."""

  def __init__(self) -> None:
    self._sites: list[_Site] = []
    self._values: list[jax.Array] = []  # flattened, widened
    self._flushed: list[jax.Array | None] = []  # flattened, or None
    self._serial = 0

  def input(self, label: str, value: Any, kind: str) -> frozenset[int]:
    """Records an argument (`kind` "input") or a constant of the program;
    returns the value's origin."""
    if not _is_float_array(value):
      return frozenset()
    self._serial += 1
    where = _Where(kind, label, "", "")
    site = _Site(
      self._serial, where, str(value.dtype), tuple(value.shape), False
    )
    return frozenset({self._add(site, value, None)})

  def operation(
    self,
    eqn: Any,
    outs: list[Any],
    ins: list[Any],
    inputs: frozenset[int],
    context: tuple[Any, ...],
  ) -> list[frozenset[int]]:
    """Records `eqn`'s floating-point outputs, made from values of origins
    `inputs`; returns each output's origin."""
    floats = [k for k, v in enumerate(eqn.outvars) if _is_float(v.aval)]
    if not floats or _moves(eqn):
      return [inputs if k in floats else frozenset() for k in range(len(outs))]
    self._serial += 1
    where = _where(eqn, context)
    halves = [k for k in floats if outs[k].dtype == jnp.float16]
    reference = _float32_reference(eqn, ins) if halves else None
    origins = [frozenset[int]() for _ in outs]
    for k in floats:
      out = outs[k]
      ref = None if reference is None else reference[k]
      has_reference = ref is not None and out.dtype == jnp.float16
      site = _Site(
        self._serial,
        where,
        str(out.dtype),
        tuple(out.shape),
        has_reference,
        inputs,
      )
      index = self._add(site, out, ref if site.has_reference else None)
      origins[k] = frozenset({index})
    return origins

  def _add(self, site: _Site, value: Any, reference: Any) -> int:
    self._sites.append(site)
    value = jnp.ravel(value)
    self._values.append(value)  # in its dtype: the statistics are exact
    if reference is None:
      self._flushed.append(None)
    else:
      self._flushed.append((jnp.ravel(reference) != 0) & (value == 0))
    return len(self._sites) - 1

  def statistics(self) -> list[tuple[jax.Array, jax.Array]]:
    """Per group of values of one size and dtype (in `self._groups()`
    order), `[nan, inf, flushed]` counts and `[largest, smallest nonzero]`
    finite magnitudes, one row per value.

    One stacked reduction per group: a few kernels in all, where one
    reduction per value made XLA compile for most of a minute.
    """
    results = []
    for members in self._groups():
      rows = jnp.stack([self._values[i] for i in members])
      flushed = jnp.stack([self._flushed_or_none(i) for i in members])
      results.append(_statistics(rows, flushed))
    return results

  def elements(self) -> int:
    """How many values are measured in all."""
    return sum(site.size for site in self._sites)

  def _flushed_or_none(self, i: int) -> jax.Array:
    flushed = self._flushed[i]
    if flushed is None:
      return jnp.zeros(self._sites[i].size, bool)
    return flushed

  def _groups(self) -> list[list[int]]:
    groups: dict[tuple[int, Any], list[int]] = {}
    for i, value in enumerate(self._values):
      groups.setdefault((value.size, value.dtype), []).append(i)
    return list(groups.values())

  def unpack(
    self, statistics: list[tuple[Any, Any]]
  ) -> tuple[np.ndarray, np.ndarray]:
    """The groups' statistics back in program order, as numpy arrays."""
    counts = np.zeros((len(self._sites), 3), np.int64)
    magnitudes = np.zeros((len(self._sites), 2), np.float64)
    for members, (c, m) in zip(self._groups(), statistics, strict=True):
      counts[members] = np.asarray(c)
      magnitudes[members] = np.asarray(m)
    for i, site in enumerate(self._sites):
      if not site.has_reference:
        counts[i, 2] = -1
    return counts, magnitudes

  def report(
    self,
    loss: float,
    scale: float,
    counts: np.ndarray,
    magnitudes: np.ndarray,
  ) -> OverflowReport:
    nonfinite = counts[:, 0] + counts[:, 1] > 0

    def made_here(i: int, site: _Site) -> bool:
      """Whether value `i` is the first not finite of its lineage: an
      argument, or an operation's output from finite inputs (a value that
      stems from a constant inf, such as a mask, is not an overflow)."""
      if site.where.pass_name == "constant":
        return False
      return not any(
        j == _NONFINITE_LITERAL or nonfinite[j] for j in site.inputs
      )

    first = None
    for i, site in enumerate(self._sites):
      if nonfinite[i] and made_here(i, site):
        first = _overflow(site, counts[i], magnitudes[i])
        break
    operations = {
      site.serial
      for i, site in enumerate(self._sites)
      if nonfinite[i] and site.where.pass_name in ("forward", "backward")
    }
    return OverflowReport(
      first=first,
      nonfinite_operations=len(operations),
      loss=loss,
      scale=scale,
      scopes=_per_scope(self._sites, counts, magnitudes),
    )


def _overflow(
  site: _Site, counts: np.ndarray, magnitudes: np.ndarray
) -> Overflow:
  w = site.where
  return Overflow(
    pass_name=w.pass_name,
    primitive=w.primitive,
    scope=w.scope,
    source=w.source,
    code=w.code,
    call_path=w.call_path,
    boundary=w.boundary,
    dtype=site.dtype,
    shape=site.shape,
    nan=int(counts[0]),
    inf=int(counts[1]),
    size=site.size,
    largest=float(magnitudes[0]),
  )


def _per_scope(
  sites: list[_Site], counts: np.ndarray, magnitudes: np.ndarray
) -> tuple[ScopeStats, ...]:
  """The float16 outputs' statistics summed per (pass, scope), in the order
  the scopes first appear."""
  groups: dict[tuple[str, str], dict[str, Any]] = {}
  for site, (nan, inf, flushed), (largest, smallest) in zip(
    sites, counts, magnitudes, strict=True
  ):
    if site.dtype != "float16" or site.where.pass_name not in (
      "forward",
      "backward",
    ):
      continue
    g = groups.setdefault(
      (site.where.pass_name, site.where.label),
      dict(values=0, largest=0.0, smallest=math.inf, nonfinite=0,
           flushed=0, flush_checked=0),
    )  # fmt: skip
    g["values"] += site.size
    g["largest"] = max(g["largest"], float(largest))
    g["smallest"] = min(g["smallest"], float(smallest))
    g["nonfinite"] += int(nan) + int(inf)
    if site.has_reference:
      g["flushed"] += int(flushed)
      g["flush_checked"] += site.size
  return tuple(
    ScopeStats(pass_name=pass_name, scope=label, **g)
    for (pass_name, label), g in groups.items()
  )


def _statistics(
  rows: jax.Array, flushed: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Per row of `rows`: `[nan, inf, flushed]` counts (int32) and
  `[largest, smallest nonzero]` finite magnitudes (in `rows`' dtype)."""
  magnitude = jnp.abs(rows)
  finite = jnp.isfinite(rows)
  counts = jnp.stack(
    [
      jnp.sum(jnp.isnan(rows), axis=1, dtype=jnp.int32),
      jnp.sum(jnp.isinf(rows), axis=1, dtype=jnp.int32),
      jnp.sum(flushed, axis=1, dtype=jnp.int32),
    ],
    axis=1,
  )
  largest = jnp.max(magnitude, axis=1, where=finite, initial=0)
  smallest = jnp.min(
    magnitude, axis=1, where=finite & (magnitude > 0), initial=jnp.inf
  )
  return counts, jnp.stack([largest, smallest], axis=1)  # in rows' dtype


def _float32_reference(eqn: Any, ins: list[Any]) -> list[Any] | None:
  """`eqn`'s outputs computed in float32 from the same inputs (float16
  inputs and dtype parameters widened), or None where that would not be
  the same operation: control flow, bit casts, precision casts."""
  if eqn.primitive.name in _NO_REFERENCE or _has_body(eqn):
    return None
  subfuns, params = _compat.bind_args(eqn)
  if subfuns:
    return None
  widened = {key: _widen_dtype(value) for key, value in params.items()}
  wide_ins = [
    x.astype(jnp.float32) if _is_array(x) and x.dtype == jnp.float16 else x
    for x in ins
  ]
  try:
    outs = eqn.primitive.bind(*wide_ins, **widened)
  except Exception:  # a primitive that takes no float32: no reference
    return None
  outs = list(outs) if eqn.primitive.multiple_results else [outs]
  for out, v in zip(outs, eqn.outvars, strict=True):
    if jnp.shape(out) != v.aval.shape:
      return None
  return outs


def _widen_dtype(value: Any) -> Any:
  if isinstance(value, np.dtype | type) and value in (
    np.float16,
    jnp.float16,
  ):
    return np.dtype(np.float32)
  return value


def _has_body(eqn: Any) -> bool:
  """Whether `eqn` holds a jaxpr (control flow, a call not entered)."""

  def is_body(value: Any) -> bool:
    if isinstance(value, _compat.Jaxpr | _compat.ClosedJaxpr):
      return True
    return isinstance(value, tuple | list) and any(map(is_body, value))

  return any(is_body(value) for value in eqn.params.values())


class _Measure:
  """The visitor: records each equation's floating-point outputs. It keeps
  the values it has seen (a float32 reference needs the inputs) and their
  origins (which measured values decide whether they are finite)."""

  def __init__(
    self,
    recorder: _Recorder,
    env: dict[Any, Any],
    origin: dict[Any, frozenset[int]],
    context: tuple[Any, ...],
  ):
    self._recorder = recorder
    self._env = env
    self._origin = origin
    self._context = context  # the calls this body is inside, outermost first
    self._entered: dict[int, tuple[Any, _Measure]] = {}

  def _read(self, v: Any) -> Any:
    return v.val if isinstance(v, _compat.Literal) else self._env[v]

  def _origin_of(self, v: Any) -> frozenset[int]:
    if isinstance(v, _compat.Literal):
      finite = np.all(np.isfinite(v.val)) if _is_float(v.aval) else True
      return frozenset() if finite else frozenset({_NONFINITE_LITERAL})
    return self._origin.get(v, frozenset())

  def enter(self, eqn: Any, body: Any) -> "_Measure":
    jaxpr = body.jaxpr
    env = dict(zip(jaxpr.constvars, body.consts, strict=True))
    env.update(zip(jaxpr.invars, map(self._read, eqn.invars), strict=True))
    origin = {v: frozenset[int]() for v in jaxpr.constvars}
    origin.update(
      zip(jaxpr.invars, map(self._origin_of, eqn.invars), strict=True)
    )
    inner = _Measure(self._recorder, env, origin, (*self._context, eqn))
    self._entered[id(eqn)] = (body, inner)
    return inner

  def produced(self, eqn: Any, values: list[Any]) -> list[Any]:
    entered = self._entered.pop(id(eqn), None)
    if entered is not None:  # measured inside
      body, inner = entered
      origins = [inner._origin_of(v) for v in body.jaxpr.outvars]
    else:
      inputs = frozenset().union(*map(self._origin_of, eqn.invars))
      ins = [self._read(v) for v in eqn.invars]
      origins = self._recorder.operation(
        eqn, values, ins, inputs, self._context
      )
    for v, value, origin in zip(eqn.outvars, values, origins, strict=True):
      if not isinstance(v, _compat.DropVar):
        self._env[v] = value
        self._origin[v] = origin
    return values


def _is_float(aval: Any) -> bool:
  dtype = getattr(aval, "dtype", None)
  return (
    dtype is not None
    and jnp.issubdtype(dtype, jnp.floating)
    and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
  )


def _moves(eqn: Any) -> bool:
  """Whether `eqn` only moves, selects or widens values (`_MOVES`)."""
  name = eqn.primitive.name
  if name == "convert_element_type":
    (source,), (target,) = eqn.invars, eqn.outvars
    return (
      _is_float(source.aval)
      and _is_float(target.aval)
      and jnp.promote_types(source.aval.dtype, target.aval.dtype)
      == target.aval.dtype
    )
  return name in _MOVES


def _where(eqn: Any, context: tuple[Any, ...]) -> _Where:
  """Where `eqn` is, inside the calls `context` (outermost first)."""
  scopes: list[str] = []
  backward = False
  for e in (*context, eqn):
    names, transposed = _compat.name_scopes(e)
    scopes += [name for name in names if name not in _JAX_SCOPES]
    backward = backward or transposed
  frames: list[tuple[str, int, str]] = []
  for e in (eqn, *reversed(context)):  # the innermost that has frames
    frames = _compat.user_frames(e)
    if frames:
      break
  scaling = bool(frames) and _ours(frames[0][0])
  frames = _frames_of_fun(frames)
  source = code = None
  label = "/".join(scopes)
  if frames:
    file, line, function = _source_frame(frames)
    source = f"{_short(file)}:{line} ({function})"
    code = linecache.getline(file, line).strip() or None
    label = label or f"({function})"
  elif scaling:
    label = label or "(loss * scale)"
  boundary = None if not _has_body(eqn) else eqn.primitive.name
  return _Where(
    pass_name="backward" if backward else "forward",
    primitive=eqn.primitive.name,
    scope="/".join(scopes),
    label=label or "(no source)",
    source=source,
    code=code,
    call_path=_call_path(frames),
    boundary=boundary,
  )


def _ours(file: str) -> bool:
  return os.path.abspath(file).startswith(_PACKAGE_DIR + os.sep)


def _library(file: str) -> bool:
  return any(d in file for d in _LIBRARY_DIRS)


def _frames_of_fun(
  frames: list[tuple[str, int, str]],
) -> list[tuple[str, int, str]]:
  """The frames inside `fun`: those inside the first frame of this package
  (the finder's own call of `fun`, or its loss scaling)."""
  for i, frame in enumerate(frames):
    if _ours(frame[0]):
      return frames[:i]
  return frames


def _source_frame(frames: list[tuple[str, int, str]]) -> tuple[str, int, str]:
  """The innermost frame of the user's own code (not an installed library),
  else the innermost frame."""
  for frame in frames:
    if not _library(frame[0]):
      return frame
  return frames[0]


def _call_path(frames: list[tuple[str, int, str]]) -> tuple[str, ...]:
  """Function names outermost first; of a run of frames in an installed
  library, only the first called (`Linear.__call__`, not its helpers)."""
  path: list[str] = []
  previous_library = False
  for file, _, function in reversed(frames):
    library = _library(file)
    if not (library and previous_library):
      path.append(function)
    previous_library = library
  return tuple(path)


def _short(file: str) -> str:
  """`file` relative to the working directory or to site-packages."""
  for d in _LIBRARY_DIRS:
    if d in file:
      return file.split(d, 1)[1]
  try:
    relative = os.path.relpath(file)
  except ValueError:  # another drive
    return file
  return file if relative.startswith("..") else relative
