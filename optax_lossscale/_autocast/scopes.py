"""`keep_float32`: which equations run in float32 by where they are.

An entry is matched against an equation's name stack (`jax.named_scope`,
Flax Linen's module paths), the names of the calls it sits in included, as
a whole sequence of components: `"attention"` matches
`decoder/attention/softmax`, `"3/0"` matches `3/0/1/0` but not `13/0`. An
entry of one name also matches the functions on the equation's call path,
from the frames that made it: a qualified name's dotted parts, in the same
way (`"RMSNorm"` and `"RMSNorm.__call__"` match a method of class
`RMSNorm`; `"attention"` a function `attention`). The overflow finder
names scopes and call paths from the same two sources
(`_diagnostics/finder/source.py`), so whatever it names is matched here.
"""

import os
from collections.abc import Sequence
from typing import Any

from optax_lossscale._jaxpr import compat as _compat
from optax_lossscale._jaxpr import frames as _user_frames

Frame = _user_frames.Frame


class Scopes:
  """The `keep_float32` entries of a policy, each a tuple of components."""

  def __init__(self, entries: Sequence[tuple[str, ...]]):
    self._entries = tuple(entries)
    self._names = tuple(e[0] for e in self._entries if len(e) == 1)

  def __bool__(self) -> bool:
    return bool(self._entries)

  def kept(self, eqn: Any, context: tuple[Any, ...]) -> bool:
    """Whether `eqn`, inside the calls and bodies `context` (outermost
    first), is in a scope or a function that `keep_float32` names."""
    if not self._entries:
      return False
    scopes: list[str] = []
    for e in (*context, eqn):
      scopes += _compat.name_scopes(e)[0]
    if any(_contains(scopes, entry) for entry in self._entries):
      return True
    if not self._names:
      return False
    for _, _, function in _user_frames.frames_of_fun(
      _user_frames.in_context(eqn, context, callers_of_own_body=True)
    ):
      parts = function.split(".")
      if any(_contains(parts, name.split(".")) for name in self._names):
        return True
    return False


def _contains(sequence: Sequence[str], part: Sequence[str]) -> bool:
  """Whether `part` is a run of whole, consecutive items of `sequence`."""
  n = len(part)
  return any(
    tuple(sequence[i : i + n]) == tuple(part)
    for i in range(len(sequence) - n + 1)
  )


def user_line(eqn: Any) -> str | None:
  """`file:line` of the innermost frame of `fun` that made `eqn`, or None."""
  frames = _user_frames.frames_of_fun(_compat.user_frames(eqn))
  if not frames:
    return None
  file, line, _ = frames[0]
  return f"{os.path.basename(file)}:{line}"
