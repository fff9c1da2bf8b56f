"""Where an operation is, in the user's code: its name scopes, the line that
made it, and the call path there."""

import dataclasses
import linecache
import os
import re
from typing import Any

from optax_lossscale._jaxpr import compat as _compat
from optax_lossscale._jaxpr import frames as _user_frames

_LIBRARY_DIRS = (
  f"{os.sep}site-packages{os.sep}",
  f"{os.sep}dist-packages{os.sep}",
)
# Scope names jax makes itself; they name no user scope.
_JAX_SCOPES = frozenset({"rematted_computation"})
# A call that passes its own arguments on whole: a decorator's wrapper.
_PASS_THROUGH = re.compile(r"\(\s*\*\w+\s*,\s*\*\*\w+\s*\)")

Frame = _user_frames.Frame


@dataclasses.dataclass(frozen=True)
class Where:
  """Where an equation is, in words: known while tracing."""

  primitive: str
  scope: str
  label: str  # the scope, or the function, for the table
  source: str | None = None
  code: str | None = None
  call_path: tuple[str, ...] = ()
  boundary: str | None = None
  transposed: bool = False  # its name stack says: a transpose
  scaling: bool = False  # made by the finder's own loss scaling
  line: tuple[str, int] | None = None  # the user's line, as a key


def where(eqn: Any, context: tuple[Any, ...], boundary: bool) -> Where:
  """Where `eqn` is, inside the calls `context` (outermost first);
  `boundary` when it holds a body that is not entered."""
  scopes: list[str] = []
  transposed = False
  for e in (*context, eqn):
    names, t = _compat.name_scopes(e)
    scopes += [name for name in names if name not in _JAX_SCOPES]
    transposed = transposed or t
  frames = _user_frames.in_context(eqn, context, callers_of_own_body=False)
  scaling = bool(frames) and _user_frames.ours(frames[0][0])
  frames = _user_frames.frames_of_fun(frames)
  source = code = line = None
  label = "/".join(scopes)
  if frames:
    file, number, function = _source_frame(frames)
    source = f"{_short(file)}:{number} ({function})"
    code = linecache.getline(file, number).strip() or None
    line = (file, number)
    label = label or f"({function})"
  elif scaling:
    label = label or "(loss * scale)"
  return Where(
    primitive=eqn.primitive.name,
    scope="/".join(scopes),
    label=label or "(no source)",
    source=source,
    code=code,
    call_path=_call_path(frames),
    boundary=eqn.primitive.name if boundary else None,
    transposed=transposed,
    scaling=scaling,
    line=line,
  )


def _library(file: str) -> bool:
  return any(d in file for d in _LIBRARY_DIRS)


def _source_frame(frames: list[Frame]) -> Frame:
  """The innermost frame of the user's own code (not an installed library),
  else the innermost frame."""
  for frame in frames:
    if not _library(frame[0]):
      return frame
  return frames[0]


def _wrappers(frames: list[Frame]) -> list[bool]:
  """For each frame (outermost first), whether it is a decorator's wrapper:
  its line passes its arguments on whole, or it is in an installed library
  and the user's code is called further in (a framework's `jit` or `grad`
  around a user function)."""
  marks = []
  for i, (file, line, _) in enumerate(frames):
    further = frames[i + 1 :]
    if not further:
      marks.append(False)
    elif _library(file):
      marks.append(any(not _library(f[0]) for f in further))
    else:
      marks.append(bool(_PASS_THROUGH.search(linecache.getline(file, line))))
  return marks


def _call_path(frames: list[Frame]) -> tuple[str, ...]:
  """Function names outermost first, without decorators' wrappers; of a run
  of frames in an installed library, only the first called
  (`Linear.__call__`, not its helpers)."""
  outermost_first = list(reversed(frames))
  path: list[str] = []
  previous_library = False
  for frame, wrapper in zip(
    outermost_first, _wrappers(outermost_first), strict=True
  ):
    if wrapper:
      continue
    library = _library(frame[0])
    if not (library and previous_library):
      path.append(frame[2])
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
