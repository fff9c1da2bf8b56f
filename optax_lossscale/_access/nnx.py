"""Flax NNX Variables, recognized without importing flax.

An `nnx.Optimizer` keeps its state in NNX Variables; the read-outs look
through them and `set_loss_scale` sets them in place, as NNX objects are
set. A Variable can only exist once `flax.nnx` is loaded, so nothing here
imports it.
"""

import sys
from typing import Any


def is_variable(x: Any) -> bool:
  """Whether `x` is an NNX Variable."""
  nnx = sys.modules.get("flax.nnx")
  variable = getattr(nnx, "Variable", None)
  return variable is not None and isinstance(x, variable)


def unwrap(x: Any) -> Any:
  """An NNX Variable's value; anything else as it is."""
  if is_variable(x):
    # `get_value` in newer flax; `.value` in flax 0.12.0, the newest that
    # installs with the oldest jax supported.
    get_value = getattr(x, "get_value", None)
    return get_value() if get_value is not None else x.value
  return x


def set_value(variable: Any, value: Any) -> None:
  """Sets an NNX Variable's value in place."""
  if hasattr(variable, "set_value"):
    variable.set_value(value)
  else:  # flax 0.12.0
    variable.value = value
