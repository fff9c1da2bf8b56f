"""The state types of optax_lossscale 0.1.0, at the module path where 0.1.0
defined them, so that a pickle of a 0.1.0 state loads.

Loaded, such a state is passed through `optax_lossscale.upgrade_state`,
which returns today's state. Asked for a field it lacks (as today's code
asks), it raises an error that names that function. Nothing else in the
package uses these types.
"""

from typing import Any, NamedTuple

_UPGRADE = (
  "it is the state of optax_lossscale 0.1.0 (from a pickle, say): pass it"
  " through `optax_lossscale.upgrade_state` first, which returns today's"
  " state with the new fields filled (docs/migration.md)"
)


def _no_such_field(self: Any, name: str) -> Any:
  """A field today's code asks for and 0.1.0's state lacks: the error says
  how to upgrade the state."""
  if name.startswith("__"):
    raise AttributeError(name)
  raise AttributeError(
    f"This {type(self).__name__} has no field {name!r}: {_UPGRADE}."
  )


class LossScaleState(NamedTuple):
  """0.1.0's loss-scale state: five fields, the counters under their old
  names."""

  loss_scale: Any
  counter: Any
  notfinite_count: Any
  total_notfinite: Any
  last_finite: Any

  def __getattr__(self, name: str) -> Any:
    return _no_such_field(self, name)


class LossScaleOptimizerState(NamedTuple):
  """0.1.0's state of `loss_scale_optimizer` (today's field names)."""

  loss_scale_state: LossScaleState
  inner_state: Any

  def __getattr__(self, name: str) -> Any:
    return _no_such_field(self, name)
