"""`value_and_grad`: scaled gradients and the unscaled loss, in one call."""

import functools

import jax

from optax_lossscale._lookup import scale_loss


def value_and_grad(fun, argnums=0, has_aux: bool = False):
  """Like :func:`jax.value_and_grad`, with the loss scaled inside.

  The returned function takes the optimizer state first, then ``fun``'s own
  arguments. It differentiates ``scale_loss(fun(...), opt_state)`` and
  returns the *unscaled* value that ``fun`` computed (exactly, not divided
  back) together with the *scaled* gradients that the loss-scaled
  optimizer's ``update`` expects. It removes the two usual mistakes:
  forgetting to scale, and reporting the scaled loss.

  Args:
    fun: the loss function; with ``has_aux``, it returns ``(loss, aux)`` and
      only ``loss`` is scaled.
    argnums: which positional argument(s) of ``fun`` to differentiate.
    has_aux: whether ``fun`` returns auxiliary data.

  Returns:
    A function ``(opt_state, *args, **kwargs) -> (value, grads)``, where
    ``value`` is ``loss`` or ``(loss, aux)``.

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
  """

  @functools.wraps(fun)
  def scaled_value_and_grad(opt_state, *args, **kwargs):
    def scaled_fun(*args, **kwargs):
      out = fun(*args, **kwargs)
      loss = out[0] if has_aux else out
      return scale_loss(loss, opt_state), out

    grads, out = jax.grad(scaled_fun, argnums=argnums, has_aux=True)(
        *args, **kwargs
    )
    return out, grads

  return scaled_value_and_grad
