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


def in_context(
  eqn: Any, context: tuple[Any, ...], *, callers_of_own_body: bool
) -> list[Frame]:
  """`eqn`'s frames, innermost first, inside the calls `context`
  (outermost first); where it has none (the body of `jnp.where`, written in
  jax), its call's.

  A call's body may be traced once and reused at other calls of the same
  function (jax 0.7.1 does so with `jnp.where`'s): its frames then end in
  the frames of the call it was first traced at, and are replaced by this
  call's, so that a line is named where this call is. jax 0.10.2 and later
  keep only the frames inside the body: `callers_of_own_body` adds the
  calls' frames after those (`keep_float32` matches a method anywhere on
  the path), or leaves them as they are (the finder names the body's own).
  """
  frames = _compat.user_frames(eqn)
  if not context:
    return frames
  call = context[-1]
  outer = in_context(
    call, context[:-1], callers_of_own_body=callers_of_own_body
  )
  if not frames:
    return outer
  at_call = _compat.user_frames(call)
  if not at_call or _root(frames) != _root(at_call):
    return frames + outer if callers_of_own_body else frames
  if frames[-len(at_call) :] == at_call:  # traced at this call
    return frames[: -len(at_call)] + outer
  # Traced at another call.
  return inside_body(frames, call) + outer


def _root(frames: list[Frame]) -> tuple[str, str]:
  """The outermost frame's file and function (not its line, which differs
  from one call of the same program to the next)."""
  file, _, function = frames[-1]
  return file, function
