"""Every use of jax internals in the package, and every spelling that
differs between the oldest and the newest jax supported (0.7.1 .. 0.12.x),
in one place.

Internals here: the primitives the jaxpr interpreter matches (by object,
never by name), the equation parameters it reads, how an equation is
re-bound (its parameters, its context `eqn.ctx`, its source information),
and the frames and name stacks the overflow finder reports. `PRIMITIVES`
and `INTERNALS` list each primitive, parameter key and internal name the
package uses; tests/test_compat_names.py checks each on the running jax.

What the overflow finder takes from here: `CALLS` and `RULED_CALLS`, their
bodies (`call_body`, `ruled_call_body`, `bodies`), `bind` (its
`map_params` widens an equation for the float32 shadow), `user_frames`,
`traced_function` (where a call's body was written), `name_scopes`, the
jaxpr types, `literal_value` (a literal's value as an array of its dtype,
whatever jax holds in it), `remat_p`, and `is_host_call` (host callbacks
and FFI calls, the few primitives jax exports no object for). It reads
jax's state and never writes it: nothing here swaps a table entry or sets
a context of jax's own.

Everything else in the package uses public jax only. Where a name here goes
away in a new jax, it resolves to None and the test above fails in CI; at
run time a call of a primitive that did not resolve is bound whole (the
skip stays exact, and selects that call's state outputs after it), and an
equation that no longer re-binds makes the skip fall back to the plain
select with a warning (`skip`).
"""

import contextlib
import contextvars
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import source_info_util as _src_source_info
from jax.extend import core as jex_core
from jax.extend import source_info_util as source_info
from jax.extend.core import primitives as _primitives

Var = jex_core.Var
Literal = jex_core.Literal
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn
Primitive = jex_core.Primitive

# jax < 0.10: `DropVar` is public in `jax.core` only; jax >= 0.12: in
# `jax.extend.core` only.
DropVar = getattr(jex_core, "DropVar", None) or jax.core.DropVar


def literal_value(literal: Any) -> Any:
  """`literal`'s value, with the literal's dtype. jax 0.7.1 writes a Python
  scalar passed to a `jit` (`jnp.where`'s `-inf`) as a literal holding the
  bare Python number, with no dtype; jax 0.10.2 and later hold a typed
  scalar (a `float` with a `dtype`) or an array."""
  value = literal.val
  if hasattr(value, "dtype"):
    return value
  return np.asarray(value, dtype=literal.aval.dtype)


def _primitive(name: str) -> Any:
  """The primitive object `jax.extend.core.primitives.<name>`, or None on a
  jax that lacks it (the names test fails there)."""
  return getattr(_primitives, name, None)


def _remat_primitive() -> Any:
  # jax < 0.8.2: `remat_p` is in `jax._src.ad_checkpoint` only.
  found = _primitive("remat_p")
  if found is not None:
    return found
  from jax._src import ad_checkpoint  # jax < 0.8.2

  return getattr(ad_checkpoint, "remat_p", None)


# The primitives the package matches, by identity, and the equation
# parameter that holds each one's body.
jit_p = _primitive("jit_p")  # body: a ClosedJaxpr
# jax >= 0.12: an alias of `eval_jaxpr_p`, whose name is "eval_jaxpr"; a
# match by name would no longer enter it.
closed_call_p = _primitive("closed_call_p")  # body: a ClosedJaxpr
remat_p = _remat_primitive()  # named "remat2"; body: an open Jaxpr
custom_jvp_call_p = _primitive("custom_jvp_call_p")  # body: a ClosedJaxpr
custom_vjp_call_p = _primitive("custom_vjp_call_p")  # body: a ClosedJaxpr
_BODY_KEYS = {
  jit_p: "jaxpr",
  closed_call_p: "call_jaxpr",
  remat_p: "jaxpr",
  custom_jvp_call_p: "call_jaxpr",
  custom_vjp_call_p: "call_jaxpr",
}

# Calls whose equation holds a `ClosedJaxpr` that runs exactly once.
CALLS = frozenset(p for p in (jit_p, closed_call_p) if p is not None)
# Calls whose body runs exactly once under a rule of its own:
# rematerialization, a custom derivative.
RULED_CALLS = frozenset(
  p for p in (remat_p, custom_jvp_call_p, custom_vjp_call_p) if p is not None
)

# A `jit` that places or donates its inputs or outputs is not inlined: its
# placement would be lost.
_PLACEMENT_KEYS = ("in_shardings", "out_shardings")
_DONATION_KEY = "donated_invars"
_NAME_KEY = "name"  # a `jit`'s function name, kept in the inlined name stack

# Each primitive the package names, and the parameter keys it reads from its
# equations: tests/test_compat_names.py checks both on the running jax.
PRIMITIVES: dict[str, tuple[Any, tuple[str, ...]]] = {
  name: (p, (_BODY_KEYS[p], *extra))
  for name, p, extra in (
    ("jit_p", jit_p, (*_PLACEMENT_KEYS, _DONATION_KEY, _NAME_KEY)),
    ("closed_call_p", closed_call_p, ()),
    ("remat_p", remat_p, ()),
    ("custom_jvp_call_p", custom_jvp_call_p, ()),
    ("custom_vjp_call_p", custom_vjp_call_p, ()),
  )
}

# Host callbacks and FFI calls, by name: jax exports no primitive object for
# them (`jax.extend.core.primitives` has none of these on any supported jax;
# their objects live in `jax._src.callback` and `jax._src.ffi`). They run
# code outside the program, so the overflow finder runs them once, as
# written, never again in another dtype.
_HOST_CALL_NAMES = frozenset(
  {
    "pure_callback",
    "io_callback",
    "debug_callback",
    "debug_print",
    "ffi_call",
    "custom_call",
  }
)

# Source information that `jax.extend.source_info_util` does not export
# (on any supported jax): the user's frames, and the name stack's elements.
_user_frames = getattr(_src_source_info, "user_frames", None)
_Transform = getattr(_src_source_info, "Transform", None)

# The other internal names the package uses, for the same test.
INTERNALS: dict[str, Any] = {
  "DropVar": DropVar,
  "source_info_util.user_frames": _user_frames,
  "source_info_util.Transform": _Transform,
}


def bind_params(
  primitive: Any, params: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
  """`(subfuns, params)` with which `primitive.bind(*subfuns, *args,
  **params)` binds an equation of `primitive` with `params`."""
  bind_params = primitive.get_bind_params(params)
  # jax < 0.10: `(subfuns, params)`; a call's function is a positional
  # argument. jax >= 0.10: one dict (a call's function under "subfuns").
  if isinstance(bind_params, tuple):
    subfuns, params = bind_params
    return list(subfuns), params
  return [], bind_params


def bind_args(eqn: Any) -> tuple[list[Any], dict[str, Any]]:
  """`(subfuns, params)` with which `eqn.primitive.bind` re-binds `eqn`."""
  return bind_params(eqn.primitive, eqn.params)


def bind(
  eqn: Any,
  invals: Sequence[Any],
  map_params: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> list[Any]:
  """Binds `eqn`'s primitive on `invals` as the equation does: with its
  parameters (passed through `map_params` first, where given), in its
  context (`eqn.ctx`: the mesh, compute types) and under its source
  information. A list of the outputs."""
  subfuns, params = bind_args(eqn)
  if map_params is not None:
    params = map_params(params)
  with source_of(eqn), eqn.ctx.manager:
    outvals = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(outvals) if eqn.primitive.multiple_results else [outvals]


def call_body(eqn: Any, keep_placement: bool = True) -> Any:
  """The body (a `ClosedJaxpr`) of a call in `CALLS` that may be evaluated
  in its caller's place, or None.

  A `jit` that places its inputs or outputs (`in_shardings`,
  `out_shardings`) or donates them is not, unless `keep_placement` is
  false: inlined, those would be lost (the overflow finder, which only
  reads values, loses nothing by it).
  """
  if eqn.primitive not in CALLS:
    return None
  body = eqn.params[_BODY_KEYS[eqn.primitive]]
  if not keep_placement:
    return body
  placed = [
    s
    for key in _PLACEMENT_KEYS
    for s in eqn.params.get(key, ())
    if isinstance(s, jax.sharding.Sharding)
  ]
  if placed or any(eqn.params.get(_DONATION_KEY, ())):
    return None
  return body


def ruled_call_body(eqn: Any) -> Any:
  """The body (a `ClosedJaxpr`) of a call in `RULED_CALLS`, or None;
  evaluated in the call's place it computes the call's outputs."""
  if eqn.primitive not in RULED_CALLS:
    return None
  body = eqn.params[_BODY_KEYS[eqn.primitive]]
  if isinstance(body, Jaxpr):  # remat's body is open, without consts
    return ClosedJaxpr(body, [])
  return body


# The tracebacks of the calls evaluated in their callers' place (`inlined`).
_INLINED: contextvars.ContextVar = contextvars.ContextVar("inlined", default=())


@contextlib.contextmanager
def inlined(eqn: Any) -> Any:
  """While a call's body is evaluated in the call's place: its equations
  bind under the call's source information and its name (a `jit`'s)."""
  with source_of(eqn), contextlib.ExitStack() as stack:
    name = eqn.params.get(_NAME_KEY) if eqn.primitive is jit_p else None
    if name:
      stack.enter_context(source_info.extend_name_stack(name))
    calls = _INLINED.set((*_INLINED.get(), _traceback(eqn)))
    stack.callback(_INLINED.reset, calls)
    yield


def _traceback(eqn: Any) -> Any:
  """`eqn`'s traceback, or its inlined call's where it has no user frame
  (a jitted jax function's body, `jax.nn.log_softmax`'s, say)."""
  own, calls = eqn.source_info.traceback, _INLINED.get()
  if calls and _user_frames is not None and not any(_user_frames(own)):
    return calls[-1]
  return own


def source_of(eqn: Any) -> contextlib.AbstractContextManager[Any]:
  """Binds under `_traceback(eqn)` and `eqn`'s name stack (HLO metadata)."""
  return source_info.user_context(
    _traceback(eqn),
    name_stack=source_info.current_name_stack() + eqn.source_info.name_stack,
  )


def user_frames(eqn: Any) -> list[tuple[str, int, str]]:
  """`(file, line, function)` of each frame of the code that made `eqn`,
  innermost first, jax's own frames left out (an empty list when unknown).
  `function` is the qualified name (`MLP.__call__`)."""
  if _user_frames is None:
    return []
  return [
    (frame.file_name, frame.start_line, frame.function_name)
    for frame in _user_frames(eqn.source_info.traceback)
  ]


def traced_function(body: Any) -> tuple[str, str] | None:
  """`(name, file)` of the function that call body `body` (a `ClosedJaxpr`)
  was traced from, from its debug information; None when unknown (a
  `functools.partial`, say)."""
  info = getattr(body.jaxpr, "debug_info", None)
  src = getattr(info, "func_src_info", None)
  if not isinstance(src, str) or " at " not in src:
    return None
  name, place = src.split(" at ", 1)
  return name, place.rsplit(":", 1)[0]


def name_scopes(eqn: Any) -> tuple[tuple[str, ...], bool]:
  """The names in `eqn`'s name stack (`jax.named_scope`, Flax Linen module
  paths), outermost first, and whether a `transpose` is among its
  transformations: the equation then belongs to a backward pass."""
  names, transposed = [], False
  for element in eqn.source_info.name_stack.stack:
    if _Transform is not None and isinstance(element, _Transform):
      transposed = transposed or element.name == "transpose"
    else:
      names.append(element.name)
  return tuple(names), transposed


def shard_map(
  f: Callable[..., Any], mesh: Any, in_specs: Any, out_specs: Any
) -> Callable[..., Any]:
  """`jax.shard_map` (public from jax 0.7.1 on, the oldest supported)."""
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def varying_like(x: Any, like: Any) -> Any:
  """`x`, typed as varying over every manual axis (inside `shard_map`) that
  `like` varies over, so that the two can be the outputs of one `switch`;
  `x` itself elsewhere. A cast of the type only: nothing runs."""
  missing = _varying_axes(like) - _varying_axes(x)
  if not missing:
    return x
  axes = tuple(sorted(missing, key=str))
  # jax >= 0.8.2: `pcast`; jax < 0.10: `pvary` (neither is in the type
  # stubs of both).
  cast = getattr(jax.lax, "pcast", None)
  if cast is not None:
    return cast(x, axes, to="varying")
  vary = getattr(jax.lax, "pvary", None)
  assert vary is not None, "a jax with manual axes has pcast or pvary"
  return vary(x, axes)


def _varying_axes(x: Any) -> frozenset[Any]:
  """The manual axes over which `x` varies."""
  aval = jax.typeof(x)
  # jax >= 0.10: `manual_axis_type.varying`; jax < 0.10: `vma`.
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def bodies(eqn: Any) -> list[Any]:
  """Every body `eqn` holds in its parameters (control flow's, a call's),
  as `ClosedJaxpr`s."""
  found: list[Any] = []

  def visit(value: Any) -> None:
    if isinstance(value, ClosedJaxpr):
      found.append(value)
    elif isinstance(value, Jaxpr):
      found.append(ClosedJaxpr(value, []))
    elif isinstance(value, tuple | list):
      for v in value:
        visit(v)

  for value in eqn.params.values():
    visit(value)
  return found


def is_host_call(eqn: Any) -> bool:
  """Whether `eqn` is a host callback or an FFI call (by name: see
  `_HOST_CALL_NAMES`)."""
  return eqn.primitive.name in _HOST_CALL_NAMES


def host_call_name(eqn: Any) -> str:
  """The name of the function a host callback calls, or the FFI target's;
  the primitive's name where neither is known."""
  for key in ("callback", "target_name", "call_target_name"):
    value = eqn.params.get(key)
    if isinstance(value, str):
      return value
    name = getattr(getattr(value, "callback_func", value), "__name__", None)
    if isinstance(name, str):
      return name
  return eqn.primitive.name


# The compute policy (`_autocast`): the primitives it names beyond those
# above, and the control-flow parameters it reads to re-issue a loop or a
# branch through public jax. tests/test_autocast_compat.py checks each on
# the running jax.


def policy_primitive(name: str) -> Any:
  """jax's primitive `<name>` (such as `"exp_p"`), by object: from
  `jax.extend.core.primitives`, else from `jax.lax`, else from the private
  module that defines it on every supported jax (`PRIVATE_PRIMITIVES`);
  None on a jax that lacks it (`log2_p` before jax 0.12)."""
  found = _primitive(name)
  if found is None:
    found = getattr(jax.lax, name, None)
  if found is None and name in PRIVATE_PRIMITIVES:
    module, _ = PRIVATE_PRIMITIVES[name]
    found = getattr(importlib.import_module(module), name, None)
  return found


# Primitives that no public module exports on the supported jax versions:
# `name: (module, first jax that has it)`.
PRIVATE_PRIMITIVES: dict[str, tuple[str, tuple[int, ...]]] = {
  "ragged_dot_general_p": ("jax._src.lax.lax", (0, 7, 1)),
  "pvary_p": ("jax._src.core", (0, 7, 1)),
  "psum_invariant_p": ("jax._src.lax.parallel", (0, 7, 1)),
  "all_gather_invariant_p": ("jax._src.lax.parallel", (0, 7, 1)),
  "reduce_scatter_p": ("jax._src.lax.parallel", (0, 7, 1)),
  "pbroadcast_p": ("jax._src.lax.parallel", (0, 7, 1)),
  "reshard_p": ("jax._src.pjit", (0, 7, 1)),
  "shard_map_p": ("jax._src.shard_map", (0, 7, 1)),
}

scan_p = _primitive("scan_p")
while_p = _primitive("while_p")
cond_p = _primitive("cond_p")


def closed_jaxpr(body: Any) -> Any:
  """A control-flow body as a `ClosedJaxpr`: jax 0.12 holds the bodies of
  `scan`, `while`, `cond` and custom derivatives as open `Jaxpr`s (their
  constants hoisted to inputs), earlier jax as `ClosedJaxpr`s."""
  return ClosedJaxpr(body, []) if isinstance(body, Jaxpr) else body


def scan_layout(params: dict[str, Any]) -> tuple[int, int]:
  """`(consts, carries)`: how many of a `scan` equation's inputs are its
  body's constants, then its carries (the rest are the scanned inputs)."""
  if "num_consts" in params:  # jax < 0.12
    return params["num_consts"], params["num_carry"]
  # jax 0.12: `ft_in`, a flat tree of (consts, carries, scanned inputs).
  consts, carries, _ = params["ft_in"].unpack()
  return len(consts), len(carries)


def shard_map_arguments(params: dict[str, Any]) -> dict[str, Any]:
  """The keyword arguments of public `jax.shard_map` that make a
  `shard_map` equation's map again: its mesh, specs, check and manual
  axes."""
  # jax < 0.10: `manual_axes`; jax >= 0.10: `newly_manual_axes`.
  manual = params.get("newly_manual_axes", params.get("manual_axes"))
  return {
    "mesh": params["mesh"],
    "in_specs": tuple(params["in_specs"]),
    "out_specs": tuple(params["out_specs"]),
    "check_vma": params["check_vma"],
    "axis_names": frozenset(manual or ()),
  }


def remat_arguments(params: dict[str, Any]) -> dict[str, Any]:
  """The keyword arguments of public `jax.checkpoint` that make a `remat`
  equation's rematerialization again."""
  return {"prevent_cse": params["prevent_cse"], "policy": params["policy"]}


def placed_call(eqn: Any) -> bool:
  """Whether `eqn` is a `jit` that places or donates its inputs or outputs
  (its body then runs as a whole, not inlined: see `call_body`)."""
  return eqn.primitive in CALLS and call_body(eqn) is None
