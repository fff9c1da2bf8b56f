"""`LossScaledTransformation`: an optax transformation that carries the
loss-scale configuration its `update` was made with."""

# Annotations stay unevaluated: `help()` and the API page then show the
# public names rather than private module paths.
from __future__ import annotations

from typing import Any

import optax

from optax_lossscale._core.config import LossScaleConfig


class LossScaledTransformation(optax.GradientTransformationExtraArgs):
  """What :func:`loss_scale_optimizer` and :func:`unscale_and_check` return:
  an optax transformation (a pair of ``init`` and ``update``, as optax's
  own) that also carries its validated configuration,
  ``loss_scale_config``.

  The configuration belongs to the pair: it survives copies, pickling and
  ``tx._replace(init=...)``, and is gone when ``update`` is replaced, since
  it describes that ``update``.
  """

  _validated: LossScaleConfig | None
  _skips_inner: bool

  @classmethod
  def of(
    cls,
    init: optax.TransformInitFn,
    update: optax.TransformUpdateExtraArgsFn,
    config: LossScaleConfig,
    *,
    skips_inner: bool,
  ) -> LossScaledTransformation:
    """The pair `(init, update)`, carrying `config`; `skips_inner` says
    whether it wraps an inner transformation (`loss_scale_optimizer`) or
    only unscales and checks (`unscale_and_check`)."""
    tx = cls(init, update)
    tx._validated = config
    tx._skips_inner = skips_inner
    return tx

  @property
  def loss_scale_config(self) -> LossScaleConfig:
    """The validated configuration: ``dynamic``, ``initial_scale``,
    ``growth_steps``, the factors and bounds, ``hysteresis``, ...."""
    config = self.__dict__.get("_validated")
    if config is None:
      raise AttributeError(
        "This transformation's `update` is not the one"
        " `loss_scale_optimizer` or `unscale_and_check` made (it was"
        " replaced), so it has no `loss_scale_config`."
      )
    return config

  def _replace(self, **fields: Any) -> LossScaledTransformation:
    replaced = super()._replace(**fields)
    if "update" not in fields:
      replaced._validated = self.__dict__.get("_validated")
      replaced._skips_inner = self.__dict__.get("_skips_inner", False)
    return replaced
