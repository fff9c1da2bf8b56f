"""The policy's interpreter: a jaxpr evaluated equation by equation on the
values of the trace around it, each operation in the dtypes the policy
gives it.

Values carry the dtypes the policy gave them, which may differ from the
dtypes the jaxpr was traced with; each equation casts its floating-point
operands by its rule (`table.Rule`) and is re-bound with its own
parameters, in its own context and under its own source information (its
traceback and name stack: the casts too), so that errors, profiles and the
overflow finder name the user's code. Differentiation happens around the
evaluated program: a float16 product's transpose is a float16 product, and
the cast of a float32 parameter transposes to a float32 gradient.

Calls (`jit`) are evaluated in place; loops, branches, rematerialization
and `shard_map` are issued again through public jax around bodies that
this interpreter evaluates (`control`).
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

from optax_lossscale._autocast import control as _control
from optax_lossscale._autocast import scopes as _scopes
from optax_lossscale._autocast import table as _table
from optax_lossscale._autocast import values as _values
from optax_lossscale._autocast.policy import Policy
from optax_lossscale._autocast.values import Constant
from optax_lossscale._jaxpr import compat as _compat

Rule = _table.Rule


@dataclasses.dataclass(frozen=True)
class Where:
  """Where an equation is evaluated: inside the calls and bodies `context`
  (their equations, outermost first), in a `keep_float32` scope or not."""

  context: tuple[Any, ...] = ()
  kept: bool = False

  def inside(self, eqn: Any, kept: bool) -> "Where":
    return Where((*self.context, eqn), kept)


class Evaluator:
  """Evaluates jaxprs under one policy; `outside` collects the primitives
  that ran on floating-point values in their traced dtypes because the
  table does not list them, each with the first place it was made at (the
  user's `file:line`, or None)."""

  def __init__(self, policy: Policy):
    self.policy = policy
    self.scopes = _scopes.Scopes(policy.keep_float32)
    self.ranges = _values.Ranges()
    self.outside: dict[str, str | None] = {}
    # One cast per value and dtype in each body (as a hand conversion
    # writes it once): `(id(value), dtype) -> (value, cast)`, the value
    # kept so that its id stays its own. A body is traced on its own (a
    # loop's), so its casts are not reused outside it.
    self._casts: list[dict[tuple[int, Any], tuple[Any, Any]]] = []

  def run(
    self,
    body: Any,
    args: Sequence[Any],
    where: Where,
    constants: Sequence[Constant | None] | None = None,
    out_dtypes: Sequence[Any] | None = None,
  ) -> tuple[list[Any], list[Constant | None]]:
    """Evaluates `body` (a `ClosedJaxpr`) on `args`, whose `constants` say
    which hold constants; returns its outputs and theirs. With
    `out_dtypes`, each output is cast to its dtype, under the source
    information of the equation that made it."""
    self._casts.append({})
    try:
      return self._run(body, args, where, constants, out_dtypes)
    finally:
      self._casts.pop()

  def _run(
    self,
    body: Any,
    args: Sequence[Any],
    where: Where,
    constants: Sequence[Constant | None] | None,
    out_dtypes: Sequence[Any] | None,
  ) -> tuple[list[Any], list[Constant | None]]:
    jaxpr = body.jaxpr
    env: dict[Any, Any] = {}
    known: dict[Any, Constant] = {}
    made: dict[Any, Any] = {}

    def read(vs: Sequence[Any]) -> tuple[list[Any], list[Constant | None]]:
      found, found_constants = [], []
      for v in vs:
        if isinstance(v, _compat.Literal):
          value = _compat.literal_value(v)
          found.append(value)
          found_constants.append(Constant.of(value))
        else:
          found.append(env[v])
          found_constants.append(known.get(v))
      return found, found_constants

    def write(v: Any, value: Any, constant: Constant | None) -> None:
      if not isinstance(v, _compat.DropVar):
        env[v] = value
        if constant is not None:
          known[v] = constant

    for v, value in zip(jaxpr.constvars, body.consts, strict=True):
      write(v, value, Constant.of(value))
    if constants is None:
      constants = [None] * len(args)
    for v, value, constant in zip(jaxpr.invars, args, constants, strict=True):
      write(v, value, constant)
    for eqn in jaxpr.eqns:
      invals, incons = read(eqn.invars)
      outvals, outcons = self.equation(eqn, invals, incons, where)
      for v, value, constant in zip(eqn.outvars, outvals, outcons, strict=True):
        write(v, value, constant)
        made[v] = eqn
    outs, outcons = read(jaxpr.outvars)
    if out_dtypes is not None:  # a literal output was made by no equation
      outs = [
        self.cast_at(
          x, dtype, made.get(v) if isinstance(v, _compat.Var) else None
        )
        for x, v, dtype in zip(outs, jaxpr.outvars, out_dtypes, strict=True)
      ]
    return outs, outcons

  def cast_at(self, x: Any, dtype: Any, eqn: Any) -> Any:
    """`x` cast to `dtype` (if it is a float of another dtype; None: as it
    is), under the source information of `eqn` (the equation that made
    it), if any."""
    if dtype is None or not _values.is_float(x) or _values.dtype_of(x) == dtype:
      return x
    if eqn is None:
      return self.cast(x, dtype)
    with _compat.source_of(eqn):
      return self.cast(x, dtype)

  def cast(self, x: Any, dtype: Any) -> Any:
    """`x` in `dtype`, cast once per body."""
    if _values.dtype_of(x) == dtype:
      return x
    cache = self._casts[-1] if self._casts else {}
    key = (id(x), dtype)
    if key not in cache:
      cache[key] = (x, _values.cast(x, dtype))
    return cache[key][1]

  def equation(
    self,
    eqn: Any,
    invals: list[Any],
    incons: list[Constant | None],
    where: Where,
  ) -> tuple[list[Any], list[Constant | None]]:
    """`eqn`'s outputs, evaluated under the policy, and the constants among
    them."""
    kept = where.kept or self.scopes.kept(eqn, where.context)
    structured = _control.evaluate(self, eqn, invals, incons, where, kept)
    if structured is not None:
      return structured
    rule = _table.rule(eqn)
    if rule is Rule.CAST:
      if _not_a_cast(eqn):
        return [invals[0]], [incons[0]]
      return self.bind(eqn, invals), [None] * len(eqn.outvars)
    if rule is Rule.TRACED:
      return self.traced(eqn, invals), [None] * len(eqn.outvars)
    if kept:
      targets, params = self._float32(eqn, invals, rule)
    elif rule is Rule.PRODUCT:
      targets, params = self._product(eqn, invals, incons)
    elif rule is Rule.FLOAT32 or _reciprocal(eqn, incons):
      targets, params = self._float32(eqn, invals, rule)
    elif rule is Rule.FOLLOW:
      targets, params = self._follow(invals, incons), None
    else:  # Rule.EACH
      targets, params = [None] * len(invals), None
    outvals = self.bind(eqn, invals, targets, params)
    return outvals, _moved(eqn, invals, incons, len(outvals))

  def bind(
    self,
    eqn: Any,
    invals: list[Any],
    targets: Sequence[Any] | None = None,
    params: dict[str, Any] | None = None,
  ) -> list[Any]:
    """Binds `eqn` on `invals`, each cast to its dtype in `targets` (None:
    as it is) under `eqn`'s source information, with `params` in place of
    its own where given."""
    if targets is not None and any(t is not None for t in targets):
      with _compat.source_of(eqn):
        invals = [
          x if t is None else self.cast(x, t)
          for x, t in zip(invals, targets, strict=True)
        ]
    update = None if not params else (lambda p: {**p, **params})
    return _compat.bind(eqn, invals, update)

  def traced(self, eqn: Any, invals: list[Any]) -> list[Any]:
    """Binds `eqn` as it was traced, its floating-point inputs cast back to
    their traced dtypes."""
    floats = [_values.is_float(x) for x in invals]
    name = eqn.primitive.name
    if any(floats) and eqn.primitive not in _compat.RULED_CALLS:
      if name not in self.outside:
        self.outside[name] = _scopes.user_line(eqn)
    targets = [
      v.aval.dtype if f else None
      for v, f in zip(eqn.invars, floats, strict=True)
    ]
    return self.bind(eqn, invals, targets)

  def _product(
    self, eqn: Any, invals: list[Any], incons: list[Constant | None]
  ) -> tuple[list[Any], dict[str, Any] | None]:
    """A product's operands in the compute dtype, and its result type; as
    traced where an operand is not a float16, bfloat16 or float32 array,
    or is a constant that the compute dtype cannot hold."""
    dtype = self.policy.dtype
    floats = [_values.is_float(x) for x in invals]
    castable = any(floats) and all(
      _values.dtype_of(x) in _values.ELIGIBLE
      and (c is None or self.ranges.fits(c, dtype))
      for x, c, f in zip(invals, incons, floats, strict=True)
      if f
    )
    if not castable:
      traced = [v.aval.dtype for v in eqn.invars]
      return [
        t if f else None for t, f in zip(traced, floats, strict=True)
      ], None
    return [dtype if f else None for f in floats], _result_type(eqn, dtype)

  def _float32(
    self, eqn: Any, invals: list[Any], rule: Rule
  ) -> tuple[list[Any], dict[str, Any] | None]:
    """float32 at least: float16 and bfloat16 operands cast up; then, but
    for an operation that takes each operand in its own dtype, the float
    operands in the widest of their dtypes."""
    dtypes = [
      (_values.FLOAT32 if d in _values.HALF else d)
      if _values.is_float(x)
      else None
      for x, d in ((x, _values.dtype_of(x)) for x in invals)
    ]
    floats = {d for d in dtypes if d is not None}
    if rule is not Rule.EACH and len(floats) > 1:
      target = _values.widest(floats)
      dtypes = [None if d is None else target for d in dtypes]
    params = None
    if rule is Rule.PRODUCT:
      preferred = eqn.params.get("preferred_element_type")
      if preferred is not None and preferred in _values.HALF:
        params = _result_type(eqn, _values.FLOAT32)
    return dtypes, params

  def _follow(
    self, invals: list[Any], incons: list[Constant | None]
  ) -> list[Any]:
    """Operands as they come; floats of several dtypes in one: the widest
    (`mixed="promote"`), or the compute dtype where one is in it
    (`mixed="cast"`). A constant made from scalars adapts to the others'
    dtype where that dtype holds it, as a Python scalar does."""
    floats = [i for i, x in enumerate(invals) if _values.is_float(x)]
    none: list[Any] = [None] * len(invals)
    if len(floats) < 2:
      return none
    adapting = [i for i in floats if _scalar(incons[i])]
    strong = [i for i in floats if i not in adapting]
    if not strong:
      return none  # constants among themselves: as traced
    dtypes = {_values.dtype_of(invals[i]) for i in strong}
    target = _values.widest(dtypes)
    if self._casts_mixed(dtypes, [incons[i] for i in strong]):
      target = self.policy.dtype
    for i in adapting:
      constant = incons[i]
      if constant is not None and not self.ranges.fits(constant, target):
        target = _values.widest({target, _values.dtype_of(invals[i])})
    return [target if i in floats else None for i in range(len(invals))]

  def _casts_mixed(
    self, dtypes: set[Any], constants: list[Constant | None]
  ) -> bool:
    """Whether `mixed="cast"` runs an operation on `dtypes` in the compute
    dtype: one operand is in it, the others are float32 and none is a
    constant it cannot hold."""
    dtype = self.policy.dtype
    return (
      self.policy.mixed == "cast"
      and dtype in dtypes
      and dtypes <= _values.ELIGIBLE
      and all(c is None or self.ranges.fits(c, dtype) for c in constants)
    )


def _scalar(constant: Constant | None) -> bool:
  return constant is not None and constant.scalar


def _not_a_cast(eqn: Any) -> bool:
  """A `convert_element_type` to the dtype it was traced from (a weak type
  made strong): not a cast, so a value keeps the dtype the policy gave."""
  return eqn.invars[0].aval.dtype == eqn.params["new_dtype"]


def _reciprocal(eqn: Any, incons: list[Constant | None]) -> bool:
  """A division of a constant scalar by a value: torch's reciprocal and
  `__rdiv__`, on its float32 list."""
  dividend = incons[0] if incons else None
  return (
    eqn.primitive is _table.DIV and dividend is not None and dividend.scalar
  )


def _result_type(eqn: Any, dtype: Any) -> dict[str, Any] | None:
  if "preferred_element_type" not in eqn.params:
    return None
  return {"preferred_element_type": dtype}


def _moved(
  eqn: Any, invals: list[Any], incons: list[Constant | None], n: int
) -> list[Constant | None]:
  """The constants among `eqn`'s outputs: those of an operation that moves
  values (`table.MOVES`) whose floating-point operands are all constants."""
  if n != 1 or eqn.primitive not in _table.MOVES:
    return [None] * n
  found = [
    c for x, c in zip(invals, incons, strict=True) if _values.is_float(x)
  ]
  return [Constant.union(found)]
