"""`find_overflow`: where the first harmful inf or NaN of a step is made, in
the pass it belongs to, and how close every scope runs to float16's edges.

The function and its gradient are traced once (`jax.make_jaxpr` of the
scaled loss's `value_and_grad`), and the trace is evaluated by
`_jaxpr.interpret.evaluate` under one `jax.jit`, with a visitor
(`finder.graph`) that reduces every floating-point value to a few numbers
where it is made. The numbers come back as two small arrays; which value is
the first harmful overflow is decided on the host (`finder.analysis`).
Nothing runs on the host during the evaluation (no callback).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._diagnostics.finder import graph as _graph
from optax_lossscale._diagnostics.finder.analysis import Analysis, Outputs
from optax_lossscale._diagnostics.finder.compile import compile_for_one_run
from optax_lossscale._diagnostics.finder.program import Program, scale_value
from optax_lossscale._diagnostics.overflow_report import OverflowReport
from optax_lossscale._jaxpr import compat
from optax_lossscale._jaxpr import interpret as _interpret


def find_overflow(
  fun: Callable[..., Any], *args: Any, scale: Any = 1.0
) -> OverflowReport:
  """Finds the first harmful inf or NaN of a step, forward or back.

  Runs ``fun(*args)`` (a scalar loss) and its gradient with respect to
  ``args[0]`` once, at loss scale ``scale``, and checks every value every
  operation makes. The first value that an operation makes not finite
  (from finite inputs) and that reaches the loss or the gradients is named
  by its pass, its primitive, its name scopes (``jax.named_scope``, Flax
  Linen module paths, Equinox layer names), the line of user code that made
  it and the call path there (module methods included, such as
  ``MLP.__call__ > Linear.__call__``). Use it on the batch of a skipped
  step: it is a diagnosis, not part of training.

  - **Masks.** An inf written in the code or passed in with the batch (a
    ``-inf`` bias), or a constant or batch value that becomes an inf only
    once cast to float16 (``-2.4e38``, finite in float32), is a mask, and
    what it passes on is not an overflow. Masks are listed on a line of
    their own. A NaN in the batch or in a closed-over array, and an inf or a
    NaN in the parameters, are bad inputs, named as such.
  - **Harmful.** A value that a ``where`` discards never reaches the loss
    or the gradients: it is listed as discarded, and the first harmful one
    is named. Whenever the loss or a gradient is not finite, the report
    says where that came from (where a mask's inf reached the loss, if
    nothing else).
  - **The pass.** The forward pass is what the loss is computed from; the
    backward pass is what the loss scale reaches. Values that jax computes
    while tracing the forward pass but that serve the derivative (rsqrt's
    ``-0.5 * x**-1.5``) are named as that derivative (``derivative_of``),
    in the backward pass; they do not depend on the scale. ``loss * scale``
    itself overflowing (a float16 loss) is the ``"loss scaling"`` pass.

  For every scope and pass, the report also measures the float16 values
  against float16's two edges: the largest magnitude against 65504, the
  smallest nonzero one against ``2**-24``, and the share *flushed* to zero:
  values that an operation's float16 output holds as zero although the same
  operation computed in float32 from the same inputs does not. Backward
  values are proportional to the scale, so the largest says how far the
  scale may grow before the backward pass overflows.

  Every floating-point output is checked for infs and NaNs; only float16
  ones are measured against its range. bfloat16 has float32's range (up to
  about ``3.4e38``), so it overflows where float32 does and needs no loss
  scale. Calls (``jit``), ``remat`` and custom derivatives are entered;
  ``scan``, ``while_loop`` and ``cond`` are not: a non-finite value coming
  out of one is reported as made inside it.

  The program reduces each value to a few numbers where it is made, so its
  peak memory is close to a plain ``jax.value_and_grad``'s on the same
  batch (``benchmarks/finder_memory.py`` measures it).

  Args:
    fun: the loss function, returning a floating-point scalar. Its first
      argument holds the parameters: what the framework's own grad
      differentiates is differentiated (the float arrays of a dict or of
      Linen variables, the ``nnx.Param`` of a Flax NNX module, the inexact
      arrays of an Equinox module); its other leaves, running statistics
      included, are held fixed.
    *args: ``fun``'s arguments, such as ``(params, batch)``; arrays in
      them are inputs, anything else is passed as it is. The report names
      them by ``fun``'s parameter names.
    scale: the loss scale of the backward pass: a positive number, or any
      optimizer state that :func:`loss_scale` accepts (its current scale).

  Returns:
    An ``OverflowReport``: false when the loss and the gradients are
    finite. ``str(report)`` says
    where (and prints a table of the scopes); ``report.first`` is the first
    harmful non-finite value.

  Raises:
    TypeError: when ``fun`` is not callable or returns no floating-point
      scalar array, when ``args[0]`` holds no floating-point array, or when
      ``scale`` is neither a real number nor a state with a loss scale.
    ValueError: when the loss is not a scalar, or ``scale`` is not a
      positive finite number (float32's largest at most).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> def loss(w, x):
    ...   with jax.named_scope("attention"):
    ...     logits = x @ w.astype(jnp.float16)
    ...     weights = jnp.exp(logits)
    ...   return jnp.mean(weights.astype(jnp.float32))
    >>> x = jnp.ones((2, 4), jnp.float16)
    >>> bool(ols.find_overflow(loss, jnp.full((4, 3), 0.5), x))
    False
    >>> report = ols.find_overflow(loss, jnp.full((4, 3), 4.0), x)
    >>> first = report.first  # exp(16) is beyond float16's 65504
    >>> first.pass_name, first.scope, first.primitive, first.inf
    ('forward', 'attention', 'exp', 6)
    >>> print(str(report).splitlines()[0])
    Overflow in the forward pass (loss scale 1).
    >>> scaled = ols.find_overflow(loss, jnp.full((4, 3), 0.5), x,
    ...                            scale=2.0**20)  # or an optimizer state
    >>> scaled.first.pass_name  # the cotangent 2**20 / 6 exceeds 65504
    'backward'
  """
  value = scale_value(scale)
  run = _Run(fun, args, value)
  loss, (counts, magnitudes) = run.compiled(run.consts, run.inputs)
  analysis = Analysis(
    run.recorder.nodes,
    jax.device_get(counts),
    jax.device_get(magnitudes),
    run.found["outputs"],
  )
  return analysis.report(run.found["labels"], float(loss), value)


def compiled_program(
  fun: Callable[..., Any], *args: Any, scale: Any = 1.0
) -> Any:
  """The finder's compiled program for `fun(*args)`, for its memory analysis
  (`benchmarks/finder_memory.py`)."""
  return _Run(fun, args, scale_value(scale)).compiled


class _Run:
  """The finder's program for `fun(*args)`: traced, instrumented and
  compiled, with what running it needs."""

  def __init__(
    self, fun: Callable[..., Any], args: tuple[Any, ...], value: float
  ):
    if not callable(fun):
      raise TypeError(
        f"`fun` must be the loss function (callable), got {fun!r}."
      )
    if not args:
      raise TypeError(
        "find_overflow needs `fun`'s arguments: find_overflow(fun, params,"
        " batch, ...); the gradient is taken with respect to the first."
      )
    program = Program(fun, args)
    with compat.custom_vjp_rules_keep_their_lines():
      self._closed = jax.make_jaxpr(program)(
        program.differentiated, program.inputs, jnp.float32(value)
      )
    self._kinds = [_graph.PARAMETER] * len(program.differentiated)
    self._kinds += [_graph.INPUT] * len(program.inputs) + [_graph.SCALE]
    self._names = [*program.labels, "the loss scale"]
    self.recorder = _graph.Recorder()
    self.found: dict[str, Any] = {}
    self.inputs = [
      *program.differentiated,
      *program.inputs,
      jnp.float32(value),
    ]
    self.consts = list(self._closed.consts)
    lowered = jax.jit(self._instrumented).lower(self.consts, self.inputs)
    self.compiled = compile_for_one_run(lowered, self.recorder.elements())

  def _instrumented(self, consts: list[Any], inputs: list[Any]) -> Any:
    """The program, each value measured where it is made: `(loss,
    statistics)`."""
    jaxpr, recorder = self._closed.jaxpr, self.recorder
    arguments = zip(jaxpr.invars, self._kinds, self._names, inputs, strict=True)
    node_of = {
      v: recorder.source(kind, name, x) for v, kind, name, x in arguments
    }
    node_of.update(
      (v, recorder.source(_graph.CONSTANT, "an array `fun` closes over", c))
      for v, c in zip(jaxpr.constvars, consts, strict=True)
    )
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, inputs, strict=True))
    visitor = _graph.Measure(recorder, env, node_of, ())
    # Re-binding folds casts of numbers in the code with numpy (a mask
    # constant beyond float16's range, say): what it would warn of is
    # what the finder measures.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
      outs = _interpret.evaluate(
        jaxpr, consts, inputs, visitor, ruled_calls=True
      )
    nodes = [visitor.node(v) for v in jaxpr.outvars]
    self.found["outputs"] = Outputs(nodes[0], nodes[1], nodes[2:])
    self.found["labels"] = {
      node_of[v]: name
      for v, name in zip(jaxpr.invars, self._names, strict=True)
    }
    return outs[0], recorder.statistics()
