"""The user's frames of an equation: what `autocast`'s `keep_float32` and
the overflow finder both read, so that whatever the finder names,
`keep_float32` matches.

A frame is `(file, line, qualified function name)`, innermost first, as
`compat.user_frames` gives them.
"""

import os
from typing import Any

from optax_lossscale._jaxpr import compat as _compat

Frame = tuple[str, int, str]  # file, line, qualified function name

# optax_lossscale/, whose frames end the frames of the user's function.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours(file: str) -> bool:
  """Whether `file` is a module of this package."""
  return os.path.abspath(file).startswith(_PACKAGE_DIR + os.sep)


def frames_of_fun(frames: list[Frame]) -> list[Frame]:
  """The frames inside the user's function: those inside the first frame
  of this package (`autocast`'s trace of `fun`, the finder's call of it or
  its loss scaling)."""
  for i, frame in enumerate(frames):
    if ours(frame[0]):
      return frames[:i]
  return frames


def inside_body(frames: list[Frame], call: Any) -> list[Frame]:
  """The innermost of `frames` up to the outermost frame of the function
  that `call`'s body was traced from; none when it is not among them (a
  body written in jax, whose frames `compat.user_frames` leaves out)."""
  body = _compat.call_body(call)
  if body is None:
    body = _compat.ruled_call_body(call)
  traced = None if body is None else _compat.traced_function(body)
  if traced is None:
    return []
  name, file = traced
  inside = [
    i
    for i, (f, _, function) in enumerate(frames)
    if f == file and function.rsplit(".", 1)[-1] == name
  ]
  return frames[: inside[-1] + 1] if inside else []
