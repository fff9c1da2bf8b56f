"""What jax's own gradient program computes, value by value, for the
finder's tests to check its numbers against: the program of
`jax.grad(lambda p: fun(p, ...) * scale)` evaluated one equation at a time
(calls entered), independently of the finder's own interpreter."""

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._jaxpr import compat


def cotangent_largest(fun, args, scale):
  """The largest finite magnitude of the float16 values of `fun`'s
  gradient program (the loss scaled by `scale` in float32, as
  `ols.scale_loss` does) that are computed from the loss scale: the
  cotangents."""

  def gradient(params, scale):
    def scaled(p):
      loss = fun(p, *args[1:])
      return (loss.astype(jnp.float32) * scale).astype(loss.dtype)

    return jax.grad(scaled)(params)

  closed = jax.make_jaxpr(gradient)(args[0], jnp.float32(scale))
  params = jax.tree.leaves(args[0])
  largest = [0.0]

  def visit(value, scaled):
    if scaled and getattr(value, "dtype", None) == jnp.float16:
      magnitudes = np.abs(np.asarray(value, np.float32))
      finite = magnitudes[np.isfinite(magnitudes)]
      if finite.size:
        largest[0] = max(largest[0], float(finite.max()))

  _evaluate(
    closed.jaxpr,
    closed.consts,
    [*params, jnp.float32(scale)],
    [False] * len(params) + [True],
    visit,
  )
  return largest[0]


def _evaluate(jaxpr, consts, args, scaled, visit):
  env, from_scale = {}, {}
  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v], from_scale[v] = x, False
  for v, x, s in zip(jaxpr.invars, args, scaled, strict=True):
    env[v], from_scale[v] = x, s

  def read(v):
    if isinstance(v, compat.Literal):
      return compat.literal_value(v), False
    return env[v], from_scale[v]

  for eqn in jaxpr.eqns:
    read_in = [read(v) for v in eqn.invars]
    values = [value for value, _ in read_in]
    marks = [mark for _, mark in read_in]
    body = compat.call_body(eqn) or compat.ruled_call_body(eqn)
    if body is not None:
      outs, out_marks = _evaluate(body.jaxpr, body.consts, values, marks, visit)
    else:
      outs = compat.bind(eqn, values)
      out_marks = [any(marks)] * len(outs)
    for v, out, mark in zip(eqn.outvars, outs, out_marks, strict=True):
      if not isinstance(v, compat.DropVar):
        env[v], from_scale[v] = out, mark
      visit(out, mark)
  results = [read(v) for v in jaxpr.outvars]
  return [r[0] for r in results], [r[1] for r in results]
