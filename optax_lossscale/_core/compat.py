"""Every use of jax internals, and every spelling that differs between the
oldest and the newest jax supported, in one place.

Everything else in the package uses public jax only. Where a name here goes
away in a new jax, the skip's rewrite falls back to a plain select with a
warning (`_skip`), and the overflow finder says it cannot name sources.
"""

import contextlib
import types
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core

Var = jex_core.Var
Literal = jex_core.Literal
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn

source_info: types.ModuleType | None
try:  # name stacks and tracebacks of re-bound equations, for profiles
  from jax._src import source_info_util as source_info
except ImportError:  # pragma: no cover - everything runs without them
  source_info = None


def _drop_var_type() -> type:
  # Public in `jax.extend.core` only in newer jax.
  for module in (jex_core, jax.core):
    if hasattr(module, "DropVar"):
      return module.DropVar
  from jax._src import core as src_core  # older jax

  return src_core.DropVar


DropVar = _drop_var_type()


def bind_args(eqn: Any) -> tuple[list[Any], dict[str, Any]]:
  """`(subfuns, params)` with which `eqn.primitive.bind` re-binds `eqn`."""
  bind_params = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bind_params, tuple):  # older jax: (subfuns, params)
    subfuns, params = bind_params
    return list(subfuns), params
  return [], bind_params


def source_of(
  eqn: Any, inlined: bool = False
) -> contextlib.AbstractContextManager[Any]:
  """Binds under `eqn`'s traceback and name stack (and, for an inlined call,
  its name), so that profiles and HLO metadata keep them."""
  if source_info is None:
    return contextlib.nullcontext()
  stack = contextlib.ExitStack()
  info = eqn.source_info
  stack.enter_context(
    source_info.user_context(
      info.traceback,
      name_stack=source_info.current_name_stack() + info.name_stack,
    )
  )
  if inlined and eqn.params.get("name"):
    stack.enter_context(source_info.extend_name_stack(eqn.params["name"]))
  return stack


def user_frame(eqn: Any) -> str | None:
  """`file:line (function)` of the user's code that made `eqn`, or None."""
  if source_info is None:
    return None
  try:
    frame = source_info.user_frame(eqn.source_info.traceback)
  except Exception:
    return None
  if frame is None:
    return None
  return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def user_frames(eqn: Any) -> list[tuple[str, int, str]]:
  """`(file, line, function)` of each frame of the code that made `eqn`,
  innermost first, jax's own frames left out (an empty list when unknown).
  `function` is the qualified name (`MLP.__call__`)."""
  if source_info is None:
    return []
  try:
    return [
      (frame.file_name, frame.start_line, frame.function_name)
      for frame in source_info.user_frames(eqn.source_info.traceback)
    ]
  except Exception:
    return []


def name_scopes(eqn: Any) -> tuple[tuple[str, ...], bool]:
  """The names in `eqn`'s name stack (`jax.named_scope`, Flax Linen module
  paths), outermost first, and whether a `transpose` is among its
  transformations: the equation then belongs to a backward pass."""
  stack = getattr(eqn.source_info.name_stack, "stack", None)
  if stack is None:  # pragma: no cover - a name stack of another shape
    return (), "transpose(" in str(eqn.source_info.name_stack)
  names, transposed = [], False
  for element in stack:
    if type(element).__name__ == "Transform":
      transposed = transposed or element.name == "transpose"
    else:
      names.append(element.name)
  return tuple(names), transposed


# XLA:CPU compiles a program kernel by kernel; a program that reads every
# intermediate value (the overflow finder's) has a kernel for nearly every
# operation. The older elemental emitters compile those several times
# faster, and LLVM's optimization level trades compile time against the
# speed of the code: level 0 wins for small programs, level 1 from about
# 2**27 values read (the float16 study's model at 97k parameters crosses
# it between 8192 and 32768 tokens). Debug options of XLA, not an API: a
# jaxlib that lacks one compiles without it.
_QUICK_CPU_COMPILE = {
  "xla_cpu_use_fusion_emitters": False,
  "xla_backend_optimization_level": 0,
}
_LARGE_CPU_COMPILE = {
  "xla_cpu_use_fusion_emitters": False,
  "xla_backend_optimization_level": 1,
}
LARGE = 2**27  # elements a program reads, above which its code must be fast


def compile_for_one_run(lowered: Any, elements: int) -> Any:
  """`lowered.compile()` for a program that runs once and reads about
  `elements` values: on XLA:CPU, compiled quickly (see
  `_QUICK_CPU_COMPILE`). An option this jaxlib does not know (it says
  which) is left out."""
  options: dict[str, Any] = {}
  if jax.default_backend() == "cpu":
    options = dict(
      _LARGE_CPU_COMPILE if elements > LARGE else _QUICK_CPU_COMPILE
    )
  while options:
    try:
      return lowered.compile(compiler_options=options)
    except Exception as e:  # refused before compiling: cheap to retry
      unknown = [name for name in options if name in str(e)]
      if not unknown:
        break
      del options[unknown[0]]
  return lowered.compile()


def shard_map(
  f: Callable[..., Any], mesh: Any, in_specs: Any, out_specs: Any
) -> Callable[..., Any]:
  """`jax.shard_map`, or its older home."""
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  from jax.experimental.shard_map import shard_map as old  # older jax

  return old(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def varying_like(x: Any, like: Any) -> Any:
  """`x`, typed as varying over every manual axis (inside `shard_map`) that
  `like` varies over, so that the two can be the outputs of one `switch`;
  `x` itself elsewhere. A cast of the type only: nothing runs."""
  missing = _varying_axes(like) - _varying_axes(x)
  if not missing:
    return x
  axes = tuple(sorted(missing, key=str))
  # `pcast` in newer jax, `pvary` in older; neither in both's type stubs.
  cast = getattr(jax.lax, "pcast", None)
  if cast is not None:
    return cast(x, axes, to="varying")
  vary = getattr(jax.lax, "pvary", None)
  assert vary is not None, "a jax with manual axes has pcast or pvary"
  return vary(x, axes)


def _varying_axes(x: Any) -> frozenset[Any]:
  """The manual axes over which `x` varies (`vma` in older jax)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))
