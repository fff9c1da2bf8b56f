"""`find_overflow`: the first harmful value of a step that is not finite,
what made it and in which pass, and how close every scope runs to
float16's edges.

`fun` is traced once (`jax.make_jaxpr`); the finder's interpreter
(`finder.shadow`) then runs it operation by operation under one `jax.jit`,
in its own dtypes and in its float32 shadow side by side, forward, then
backward from each operation's derivative as jax computes it, and reduces
every value to a few numbers (`finder.statistics`). The numbers come back
as a few small arrays; what they mean is decided on the host
(`finder.analysis`, `finder.verdict`). Nothing runs on the host during the
run but the host callbacks `fun` itself makes, once each.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._access.scale import scaled
from optax_lossscale._diagnostics.finder import graph as _graph
from optax_lossscale._diagnostics.finder import primitives as _prims
from optax_lossscale._diagnostics.finder import verdict as _verdict
from optax_lossscale._diagnostics.finder.analysis import Facts
from optax_lossscale._diagnostics.finder.compile import compile_for_one_run
from optax_lossscale._diagnostics.finder.program import Program, scale_value
from optax_lossscale._diagnostics.finder.shadow import (
  Context,
  Interpreter,
  Val,
)
from optax_lossscale._diagnostics.finder.widen import widen
from optax_lossscale._diagnostics.overflow_report import OverflowReport


def find_overflow(
  fun: Callable[..., Any],
  *args: Any,
  scale: Any = 1.0,
  masks: tuple[str, ...] = (),
) -> OverflowReport:
  """Finds the first harmful inf or NaN of a step, forward or back, and
  what made it, measured against float32.

  Runs ``fun(*args)`` (a scalar loss) and its gradient with respect to
  ``args[0]`` once, at loss scale ``scale``, operation by operation, in
  its own dtypes and in a float32 *shadow* side by side: the same
  operations with float16 (and bfloat16, float8) computed in float32, on
  the shadow's own values. Every value is compared with its shadow. The
  first value, in program order, that an operation makes not finite (or a
  bad input) and that changes the loss or the gradients is named by its
  pass, its primitive, its name scopes (``jax.named_scope``, Flax Linen
  module paths, Equinox layer names), the line of user code that made it
  and the call path there (module methods included, such as
  ``MLP.__call__ > Linear.__call__``). Use it on the batch of a skipped
  step: it is a diagnosis, not part of training.

  - **What made it** (``Overflow.cause``). Where the float32 value is
    finite, it is float16's range (``"range"``). Where it is not finite
    in float32 either, it is data (an input argument, named by its
    parameter), a mask (see ``masks``), or the program's own arithmetic
    (a log of 0, a division by 0: ``"arithmetic"``). A number beyond
    float16's range that the program casts to float16 is data where it
    comes from an input, and a mask where the program writes it (Gemma's
    ``-2.38e38``); an out-of-range gather's NaN is an index.
  - **Masks.** An inf the program writes (a literal ``-inf``, an array it
    closes over), a number it writes beyond float16's range and casts to
    it, and the inputs named in ``masks`` are masks: what they pass on is
    not an overflow, and they are listed on a line of their own. An input
    not named there that holds an inf is data.
  - **Harmful.** A value is harmful when its change reaches the loss or a
    gradient: as infs and NaNs, or through an operation that turns them
    into finite values far from float32's (an RMSNorm whose square
    overflows: ``rsqrt(inf)`` is 0, the token's activations are zeroed,
    and a finite loss changes). One that an operation turns back into
    float32's own value (``tanh(inf)`` is 1, as in float32) or that a
    ``where`` drops is listed, not named.
  - **The pass**, from the program's structure. The finder builds the
    gradient equation by equation from jax's own derivative rules: an
    operation of ``fun`` is the forward pass; a value jax computes in the
    forward pass for the backward one (rsqrt's ``-0.5 * x**-1.5``) is
    that derivative's (``derivative_of``, and ``recomputed`` when
    ``jax.checkpoint`` computes it again in the backward pass); an
    operation of a backward rule is the backward pass, and computed from
    the loss scale (``depends_on_scale``) where it is a cotangent.
    ``loss * scale`` and the loss's cotangent are the loss scaling.

  For every scope and pass, the report also measures the float16 values
  against float16's two edges: the largest magnitude against 65504, the
  smallest nonzero one against ``2**-24``, and the share *flushed* to zero
  (a cast's or an arithmetic operation's float16 output zero where the
  same operation in float32, from the same inputs, is not). The backward
  table holds the cotangents; its largest is how close the loss scale
  runs to 65504.

  Calls (``jit``, donating or placing its arguments or not) and
  ``jax.checkpoint`` are entered; a custom derivative runs as its rules,
  whose operations are named by the line that calls the function
  (``custom_rule``); ``scan``, ``while_loop`` and ``cond`` run whole, and a
  value that comes out of one not finite is reported as made inside it.
  Host callbacks and FFI calls run once, as written (never again in
  float32), and what they return has no float32 shadow.

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
    masks: names of ``fun``'s parameters (every array in them), or of
      inputs in them (``"batch['mask']"``), whose infs are masks on
      purpose (a ``-inf`` attention bias passed with the batch).

  Returns:
    An ``OverflowReport``: false when nothing harmful was found.
    ``str(report)`` says what and where (and prints a table of the
    scopes); ``report.first`` is the first harmful value.

  Raises:
    TypeError: when ``fun`` is not callable or returns no floating-point
      scalar array, when ``args[0]`` holds no floating-point array, when
      ``scale`` is neither a real number nor a state with a loss scale, or
      when ``masks`` is not a tuple of names.
    ValueError: when the loss is not a scalar, ``scale`` is not a positive
      finite number (float32's largest at most), or ``masks`` names no
      input held fixed.
    RuntimeError: on a jax that lacks a primitive the finder tells apart.

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
    >>> first.cause  # exp(16) is finite in float32
    'range'
    >>> print(str(report).splitlines()[0])
    Overflow in the forward pass (loss scale 1): beyond float16's range.
    >>> scaled = ols.find_overflow(loss, jnp.full((4, 3), 0.5), x,
    ...                            scale=2.0**20)  # or an optimizer state
    >>> scaled.first.pass_name  # the cotangent 2**20 / 6 exceeds 65504
    'backward'
    >>> scaled.first.depends_on_scale
    True
  """
  _prims.require()
  value = scale_value(scale)
  run = _Run(fun, args, value, masks)
  loss, reference, bits, counts, magnitudes = run.compiled(
    run.consts, run.differentiated, run.inputs, np.float32(value)
  )
  found = run.found
  order = found["order"]
  facts = Facts(
    found["nodes"],
    _by_row(jax.device_get(bits), order),
    _by_row(jax.device_get(counts), order),
    _by_row(jax.device_get(magnitudes), order),
  )
  outputs = _verdict.Outputs(
    loss=found["loss"],
    grads=found["grads"],
    loss_value=float(loss),
    reference_loss=float(reference),
    labels=found["labels"],
  )
  return _verdict.report(facts, outputs, value)


def _by_row(values: np.ndarray, order: np.ndarray) -> np.ndarray:
  """`values` in reduction order, put in row order."""
  rows = np.empty_like(values)
  rows[order] = values
  return rows


class _Run:
  """The finder's program for `fun(*args)`: traced, instrumented and
  compiled, with what running it needs."""

  def __init__(
    self,
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    value: float,
    masks: Any,
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
    self._program = program = Program(fun, args, masks)
    # Tracing and re-binding fold casts of numbers in the code with numpy (a
    # mask constant beyond float16's range, say): what numpy would warn of
    # is what the finder measures.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
      self._closed = jax.make_jaxpr(program)(
        program.differentiated, program.inputs
      )
      loss = jax.ShapeDtypeStruct((), self._closed.out_avals[0].dtype)
      self._scaling = jax.make_jaxpr(scaled)(loss, jnp.float32(value))
      self.consts = list(self._closed.consts)
      self.differentiated = program.differentiated
      self.inputs = program.inputs
      self.found: dict[str, Any] = {}
      lowered = jax.jit(self._instrumented).lower(
        self.consts, self.differentiated, self.inputs, np.float32(value)
      )
    self.compiled = compile_for_one_run(lowered, self.found["elements"])

  def _instrumented(
    self,
    consts: list[Any],
    differentiated: list[Any],
    inputs: list[Any],
    scale: Any,
  ) -> tuple[Any, ...]:
    """The program, forward and backward, each value measured: `(loss,
    its float32 reference, bits, counts, magnitudes)`."""
    recorder = _graph.Recorder()
    run = Interpreter(recorder)
    labels = iter(self._program.labels)
    params = [
      self._argument(recorder, _graph.PARAMETER, next(labels), x)
      for x in differentiated
    ]
    kinds = [
      _graph.MASK_INPUT if marked else _graph.INPUT
      for marked in self._program.masks
    ]
    held = [
      self._argument(recorder, kind, next(labels), x)
      for kind, x in zip(kinds, inputs, strict=True)
    ]
    closed = run.constants(consts, "an array `fun` closes over")
    (loss,) = run.forward(self._closed.jaxpr, closed, params + held, Context())
    scale_node = recorder.source(_graph.SCALE, "the loss scale", scale, scale)
    (scaled_loss,) = run.forward(
      self._scaling.jaxpr,
      run.constants(self._scaling.consts, "a constant of the loss scaling"),
      [loss, Val(scale, scale, scale_node.index)],
      Context(scaling=True),
    )
    ones = jnp.ones((), scaled_loss.value.dtype)
    seed = recorder.source(_graph.SEED, "1", ones, widen(ones))
    cotangents = run.backward(
      {scaled_loss.node: Val(ones, widen(ones), seed.index)}
    )
    bits, counts, magnitudes, order = recorder.groups.results()
    self.found.update(
      nodes=recorder.nodes,
      loss=loss.node,
      grads=[cotangents[p.node].node for p in params if p.node in cotangents],
      labels={
        v.node: name
        for v, name in zip(params + held, self._program.labels, strict=True)
      },
      order=order,
      elements=recorder.elements(),
    )
    loss_value = jnp.asarray(loss.value, jnp.float32)
    loss_shadow = jnp.asarray(loss.shadow, jnp.float32)
    return loss_value, loss_shadow, bits, counts, magnitudes

  @staticmethod
  def _argument(
    recorder: _graph.Recorder, kind: str, label: str, x: Any
  ) -> Val:
    shadow = widen(x)
    node = recorder.source(kind, label, x, shadow)
    return Val(x, shadow, node.index, kind == _graph.PARAMETER)
