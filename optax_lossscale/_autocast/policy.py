"""The policy a call of `autocast` applies, and the checks of its arguments.

Bad arguments fail when `autocast(...)` is called, before anything is
traced, with a message that names the argument, the value received and
what is accepted.
"""

import collections.abc
import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

# What `dtype` may be: the two 16-bit floating-point types.
COMPUTE_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# What `mixed` may be (see `Policy`).
MIXED_RULES = ("promote", "cast")


@dataclasses.dataclass(frozen=True)
class Policy:
  """What one `autocast` applies.

  Attributes:
    dtype: the compute dtype of products (float16 or bfloat16).
    keep_float32: name scopes and call-path names whose operations run in
      float32, each as a tuple of its `/`-separated components.
    mixed: what an operation that is neither a product nor on the float32
      list does with floating-point operands of two dtypes: ``"promote"``
      runs it in the widest (float32 where one is float32), as torch
      does; ``"cast"`` runs it in `dtype` where one operand is in `dtype`,
      as Keras's layers read their float32 variables in the compute dtype.
  """

  dtype: np.dtype
  keep_float32: tuple[tuple[str, ...], ...] = ()
  mixed: str = "promote"


def make_policy(
  fun: Any, dtype: Any, keep_float32: Any, mixed: Any
) -> tuple[Callable[..., Any], Policy]:
  """`fun` and the `Policy` of `autocast(fun, dtype, keep_float32=...,
  mixed=...)`; raises `TypeError` or `ValueError` on a bad argument."""
  if not callable(fun):
    raise TypeError(
      "`fun` must be callable (the function to run under the"
      f" policy, such as the loss), got {_describe(fun)}."
    )
  return fun, Policy(
    _compute_dtype(dtype), _scope_entries(keep_float32), _mixed_rule(mixed)
  )


def _describe(value: Any) -> str:
  text = repr(value)
  if len(text) > 60:
    text = text[:57] + "..."
  return f"{text} of type {type(value).__name__}"


def _compute_dtype(dtype: Any) -> np.dtype:
  accepted = (
    "jnp.float16 or jnp.bfloat16 (or their NumPy types, dtype objects or"
    " names, such as 'float16')"
  )
  if isinstance(dtype, bool) or dtype is None:
    raise TypeError(f"`dtype` must be {accepted}, got {_describe(dtype)}.")
  try:
    found = np.dtype(dtype)
  except TypeError:
    raise TypeError(
      f"`dtype` must be {accepted}, got {_describe(dtype)}."
    ) from None
  if found not in COMPUTE_DTYPES:
    raise ValueError(
      f"`dtype` must be float16 or bfloat16, got {found.name}:"
      " products run in `dtype`, and the policy keeps float32 for the"
      " operations that need it."
    )
  return found


def _scope_entries(keep_float32: Any) -> tuple[tuple[str, ...], ...]:
  if isinstance(keep_float32, (str, bytes)):
    raise TypeError(
      "`keep_float32` must be a sequence of name scopes or"
      f" call-path names, got the string {keep_float32!r}; pass a tuple:"
      f" keep_float32=({keep_float32!r},)."
    )
  if isinstance(keep_float32, collections.abc.Mapping) or not isinstance(
    keep_float32, (collections.abc.Sequence, collections.abc.Set)
  ):
    raise TypeError(
      "`keep_float32` must be a sequence of strings (name"
      " scopes such as 'attention' or 'decoder/attention', call-path"
      f" names such as 'RMSNorm'), got {_describe(keep_float32)}."
    )
  entries = []
  for entry in keep_float32:
    if not isinstance(entry, str):
      raise TypeError(
        "every entry of `keep_float32` must be a string, got"
        f" {_describe(entry)} in {keep_float32!r}."
      )
    entries.append(_components(entry))
  return tuple(entries)


def _components(entry: str) -> tuple[str, ...]:
  """An entry's `/`-separated components. The finder writes a function that
  made values outside any scope in parentheses (`(MLP.__call__)`): taken as
  the function's name."""
  text = entry.strip()
  if text.startswith("(") and text.endswith(")"):
    text = text[1:-1]
  components = tuple(text.split("/"))
  if not text or not all(components):
    raise ValueError(
      f"the `keep_float32` entry {entry!r} is not a name scope:"
      " it must be one or more non-empty names joined by '/', such as"
      " 'attention' or 'decoder/attention'."
    )
  return components


def _mixed_rule(mixed: Any) -> str:
  if not isinstance(mixed, str) or mixed not in MIXED_RULES:
    raise ValueError(
      "`mixed` must be 'promote' (an operation with float16 and"
      " float32 operands runs in float32) or 'cast' (it runs in `dtype`),"
      f" got {_describe(mixed)}."
    )
  return mixed
