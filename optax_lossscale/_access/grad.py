"""`value_and_grad`: scaled gradients and the unscaled loss, in one call,
through the gradient transformation of whichever framework the model is in."""

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from optax_lossscale._access.locate import find_loss_scale_state
from optax_lossscale._access.scale import checked_loss, scaled


def value_and_grad(
  fun: Callable[..., Any],
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
  *,
  grad_fn: Callable[..., Callable[..., Any]] | None = None,
) -> Callable[..., tuple[Any, Any]]:
  """Like :func:`jax.value_and_grad`, with the loss scaled inside.

  The returned function takes the optimizer state first, then ``fun``'s own
  arguments. It differentiates ``scale_loss(fun(...), opt_state)`` and
  returns the *unscaled* value that ``fun`` computed (exactly, not divided
  back) together with the *scaled* gradients that the loss-scaled
  optimizer's ``update`` expects. It removes the two usual mistakes:
  forgetting to scale, and reporting the scaled loss.

  The differentiation itself is ``grad_fn``'s, so that models of any
  framework work as that framework differentiates them:
  ``grad_fn=nnx.value_and_grad`` for a Flax NNX model (Dropout RNGs and
  BatchNorm statistics included), ``grad_fn=eqx.filter_value_and_grad``
  for an Equinox model (non-array fields included). ``grad_fn`` is called
  as ``grad_fn(scaled_fun, has_aux=True)`` (plus ``argnums=argnums`` when
  ``argnums`` is not 0; Equinox takes no ``argnums`` and differentiates
  the first argument), where ``scaled_fun`` returns
  ``(scaled_loss, fun's output)``.

  Args:
    fun: the loss function; with ``has_aux``, it returns ``(loss, aux)`` and
      only ``loss`` is scaled.
    argnums: which positional argument(s) of ``fun`` to differentiate.
    has_aux: whether ``fun`` returns auxiliary data.
    grad_fn: a ``value_and_grad``-style transformation; default
      :func:`jax.value_and_grad`.

  Returns:
    A function ``(opt_state, *args, **kwargs) -> (value, grads)``, where
    ``value`` is ``loss`` or ``(loss, aux)``, and ``opt_state`` is anything
    :func:`scale_loss` accepts (an ``nnx.Optimizer`` too).

  Raises:
    TypeError: when ``grad_fn`` is not callable or ``has_aux`` not a bool.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_lossscale as ols
    >>> tx = ols.loss_scale_optimizer(optax.sgd(0.1), initial_scale=4.0)
    >>> params = jnp.array([1.0, 2.0])
    >>> opt_state = tx.init(params)
    >>> loss_fn = lambda p, x: jnp.sum(p * x)
    >>> loss, grads = ols.value_and_grad(loss_fn)(opt_state, params, 3.0)
    >>> loss, grads        # the loss unscaled, the gradients scaled by 4
    (Array(9., dtype=float32), Array([12., 12.], dtype=float32))
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> updates
    Array([-0.3, -0.3], dtype=float32)

    With aux, and another framework's transformation (here jax's own, with
    ``argnums``):

    >>> import jax
    >>> def loss_aux(x, p):
    ...   return jnp.sum(p * x), {'mean': jnp.mean(p)}
    >>> vg = ols.value_and_grad(loss_aux, has_aux=True,
    ...                         grad_fn=jax.value_and_grad, argnums=1)
    >>> (loss, aux), grads = vg(opt_state, 3.0, params)
    >>> loss, aux['mean'], grads
    (Array(9., dtype=float32), Array(1.5, dtype=float32),
     Array([12., 12.], dtype=float32))
  """
  if not isinstance(has_aux, bool):
    raise TypeError(
      f"`has_aux` must be a bool (True or False), got {has_aux!r}."
    )
  if grad_fn is None:
    grad_fn = jax.value_and_grad
  elif not callable(grad_fn):
    raise TypeError(
      "`grad_fn` must be a value_and_grad-style transformation (e.g."
      " `jax.value_and_grad`, `nnx.value_and_grad`,"
      f" `eqx.filter_value_and_grad`), got {grad_fn!r}."
    )
  options: dict[str, Any] = {"has_aux": True}
  if not (isinstance(argnums, int) and argnums == 0):
    options["argnums"] = argnums

  def scaled_value_and_grad(
    opt_state: Any, /, *args: Any, **kwargs: Any
  ) -> tuple[Any, Any]:
    # Read outside the differentiated function: inside a framework's
    # transformation only the array is closed over, never its state objects.
    scale = find_loss_scale_state(opt_state).loss_scale

    def scaled_fun(*args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
      out = fun(*args, **kwargs)
      loss = out[0] if has_aux else out
      return scaled(checked_loss(loss), scale), out

    (_, out), grads = grad_fn(scaled_fun, **options)(*args, **kwargs)
    return out, grads

  name = getattr(fun, "__name__", type(fun).__name__)
  scaled_value_and_grad.__name__ = f"value_and_grad_{name}"
  scaled_value_and_grad.__qualname__ = f"value_and_grad_{name}"
  scaled_value_and_grad.__doc__ = (
    f"`ols.value_and_grad` of `{name}`: (opt_state, *args, **kwargs) ->"
    " (value, scaled grads)."
  )
  # Read by `inspect.signature`; mypy knows no `__signature__` on functions.
  scaled_value_and_grad.__signature__ = _signature(fun)  # type: ignore[attr-defined]
  return scaled_value_and_grad


def _signature(fun: Callable[..., Any]) -> inspect.Signature:
  """`(opt_state, /, <fun's parameters>) -> tuple`, or with `*args,
  **kwargs` where `fun`'s own cannot be read."""
  opt_state = inspect.Parameter("opt_state", inspect.Parameter.POSITIONAL_ONLY)
  try:
    rest = list(inspect.signature(fun).parameters.values())
    return inspect.Signature(
      [opt_state, *rest], return_annotation=tuple[Any, Any]
    )
  except (TypeError, ValueError):
    return inspect.Signature(
      [
        opt_state,
        inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
      ],
      return_annotation=tuple[Any, Any],
    )
