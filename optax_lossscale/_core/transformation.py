"""`LossScaledTransformation`: an optax transformation that carries the
loss-scale configuration its `update` was made with, in that `update`."""

# Annotations stay unevaluated: `help()` and the API page then show the
# public names rather than private module paths.
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optax

from optax_lossscale._core.config import LossScaleConfig


@dataclasses.dataclass(frozen=True, slots=True, weakref_slot=True)
class ConfiguredUpdate:
  """An `update` function and the configuration it was made with: the
  transformation's `update` itself, so that the configuration goes wherever
  the function goes (`jax.tree.map` over the transformation, `copy`,
  `_replace(init=...)`), and is gone with it when `update` is replaced."""

  function: Callable[..., Any]
  config: LossScaleConfig
  skips_inner: bool  # wraps an inner transformation (`loss_scale_optimizer`)

  def __call__(
    self,
    updates: optax.Updates,
    state: Any,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, Any]:
    return self.function(updates, state, params, **extra_args)

  def __repr__(self) -> str:
    made_by = (
      "loss_scale_optimizer" if self.skips_inner else "unscale_and_check"
    )
    return f"<update of {made_by}>"


class LossScaledTransformation(optax.GradientTransformationExtraArgs):
  """What :func:`loss_scale_optimizer` and :func:`unscale_and_check` return:
  an optax transformation (a pair of ``init`` and ``update``, as optax's
  own) that also carries its validated configuration,
  ``loss_scale_config``.

  The configuration belongs to ``update``, which holds it: it survives
  ``copy.copy``, ``jax.tree.map`` over the transformation and
  ``tx._replace(init=...)``, and is gone when ``update`` is replaced, since
  it describes that ``update``. A chain or wrapper around the
  transformation (``optax.chain``, ``optax.MultiSteps``) is a
  transformation of optax's own, which carries none.

  It does not pickle, as optax's own transformations do not: its ``init``
  and ``update`` are closures. Pickle the state (it names only public
  types, and records the configuration it was updated with), or
  ``tx.loss_scale_config`` (a frozen dataclass that pickles), and build the
  transformation again.
  """

  @classmethod
  def of(
    cls,
    init: optax.TransformInitFn,
    update: optax.TransformUpdateExtraArgsFn,
    config: LossScaleConfig,
    *,
    skips_inner: bool,
  ) -> LossScaledTransformation:
    """The pair `(init, update)`, `update` carrying `config`;
    `skips_inner` says whether it wraps an inner transformation
    (`loss_scale_optimizer`) or only unscales and checks
    (`unscale_and_check`)."""
    return cls(init, ConfiguredUpdate(update, config, skips_inner))

  @property
  def loss_scale_config(self) -> LossScaleConfig:
    """The validated configuration: ``dynamic``, ``initial_scale``,
    ``growth_steps``, the factors and bounds, ``hysteresis``, ...."""
    return self._configured().config

  @property
  def skips_inner(self) -> bool:
    """Whether it wraps an inner transformation and skips its update on a
    non-finite step (:func:`loss_scale_optimizer`), or only unscales and
    checks (:func:`unscale_and_check`)."""
    return self._configured().skips_inner

  def _configured(self) -> ConfiguredUpdate:
    if not isinstance(self.update, ConfiguredUpdate):
      raise AttributeError(
        "This transformation's `update` is not the one"
        " `loss_scale_optimizer` or `unscale_and_check` made (it was"
        " replaced), so it has no `loss_scale_config`."
      )
    return self.update

  def __copy__(self) -> LossScaledTransformation:
    return type(self)(*self)

  def __deepcopy__(self, memo: dict[int, Any]) -> LossScaledTransformation:
    # Its parts are functions, which copy as themselves.
    return type(self)(*self)

  def __reduce__(self) -> Any:
    raise TypeError(
      "A LossScaledTransformation does not pickle: its `init` and `update`"
      " are closures, as optax's own transformations are. Pickle the"
      " optimizer state (it pickles, and records the configuration it was"
      " updated with) or `tx.loss_scale_config`, and build the"
      " transformation again where it is loaded."
    )
