"""Dynamic loss scaling for float16 training, as an Optax transformation.

The public API is what this module exports; everything under a leading
underscore is private and may change.

`find_overflow` and the types it returns load on first use (module
`__getattr__`): importing the package, and training with it, loads none of
the finder.
"""

import importlib as _importlib
import typing as _typing

from optax_lossscale._access.grad import value_and_grad as value_and_grad
from optax_lossscale._access.readouts import dynamic_counter as dynamic_counter
from optax_lossscale._access.readouts import loss_scale as loss_scale
from optax_lossscale._access.readouts import (
  nonfinite_leaves as nonfinite_leaves,
)
from optax_lossscale._access.readouts import skip_stats as skip_stats
from optax_lossscale._access.scale import scale_loss as scale_loss
from optax_lossscale._access.setter import set_loss_scale as set_loss_scale
from optax_lossscale._access.upgrade import upgrade_state as upgrade_state
from optax_lossscale._autocast import autocast as autocast
from optax_lossscale._core.config import LossScaleConfig as LossScaleConfig
from optax_lossscale._core.finite import all_finite as all_finite
from optax_lossscale._core.keras import from_keras_config as from_keras_config
from optax_lossscale._core.keras import to_keras_config as to_keras_config
from optax_lossscale._core.master_weights import (
  Float16ParamsWarning as Float16ParamsWarning,
)
from optax_lossscale._core.optimizer import (
  LossScaledTransformation as LossScaledTransformation,
)
from optax_lossscale._core.optimizer import (
  loss_scale_optimizer as loss_scale_optimizer,
)
from optax_lossscale._core.state import CountedSince as CountedSince
from optax_lossscale._core.state import LeafCounts as LeafCounts
from optax_lossscale._core.state import (
  LossScaleOptimizerState as LossScaleOptimizerState,
)
from optax_lossscale._core.state import LossScaleState as LossScaleState
from optax_lossscale._core.state import RecordedConfig as RecordedConfig
from optax_lossscale._core.state import SkipEvents as SkipEvents
from optax_lossscale._core.state import SkipStats as SkipStats
from optax_lossscale._core.step import unscale_and_check as unscale_and_check
from optax_lossscale._diagnostics.report import SkipReport as SkipReport
from optax_lossscale._diagnostics.report import (
  raise_if_stuck as raise_if_stuck,
)
from optax_lossscale._diagnostics.report import skip_report as skip_report

# The public types say where users import them from (in `help()`, reprs and
# the API page), not the private module that defines them; and so do
# pickles of a state, which then load wherever the private modules move.
# (0.2.0's pickles name `optax_lossscale._core.state` for `SkipEvents` and
# `LeafCounts`: the types are still defined there, and load.)
for _public_type in (
  CountedSince,
  Float16ParamsWarning,
  LeafCounts,
  LossScaleConfig,
  LossScaleOptimizerState,
  LossScaleState,
  LossScaledTransformation,
  RecordedConfig,
  SkipEvents,
  SkipReport,
  SkipStats,
):
  _public_type.__module__ = __name__
del _public_type

__version__ = "0.2.0"

# Loaded on first use: the module each name is defined in.
_LAZY = {
  "find_overflow": "optax_lossscale._diagnostics.overflow",
  "Overflow": "optax_lossscale._diagnostics.overflow_report",
  "OverflowReport": "optax_lossscale._diagnostics.overflow_report",
  "ScopeStats": "optax_lossscale._diagnostics.overflow_report",
}

if _typing.TYPE_CHECKING:  # what the names are, for type checkers
  from optax_lossscale._diagnostics.overflow import (
    find_overflow as find_overflow,
  )
  from optax_lossscale._diagnostics.overflow_report import (
    Overflow as Overflow,
  )
  from optax_lossscale._diagnostics.overflow_report import (
    OverflowReport as OverflowReport,
  )
  from optax_lossscale._diagnostics.overflow_report import (
    ScopeStats as ScopeStats,
  )


def __getattr__(name: str) -> _typing.Any:
  """A name of `_LAZY`, loaded on first use, then kept here."""
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(_importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY})


__all__ = (
  "CountedSince",
  "Float16ParamsWarning",
  "LeafCounts",
  "LossScaleConfig",
  "LossScaleOptimizerState",
  "LossScaleState",
  "LossScaledTransformation",
  "Overflow",
  "OverflowReport",
  "RecordedConfig",
  "ScopeStats",
  "SkipEvents",
  "SkipReport",
  "SkipStats",
  "all_finite",
  "autocast",
  "dynamic_counter",
  "find_overflow",
  "from_keras_config",
  "loss_scale",
  "loss_scale_optimizer",
  "nonfinite_leaves",
  "raise_if_stuck",
  "scale_loss",
  "set_loss_scale",
  "skip_report",
  "skip_stats",
  "to_keras_config",
  "unscale_and_check",
  "upgrade_state",
  "value_and_grad",
)
