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

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale import _autocast
from optax_lossscale._access.scale import scaled
from optax_lossscale._diagnostics.finder import chunks as _chunks
from optax_lossscale._diagnostics.finder import graph as _graph
from optax_lossscale._diagnostics.finder import primitives as _prims
from optax_lossscale._diagnostics.finder import sources as _sources
from optax_lossscale._diagnostics.finder import split as _split
from optax_lossscale._diagnostics.finder import statistics as _statistics
from optax_lossscale._diagnostics.finder import verdict as _verdict
from optax_lossscale._diagnostics.finder.analysis import Facts
from optax_lossscale._diagnostics.finder.plan import Context, Plan
from optax_lossscale._diagnostics.finder.primitives import is_float
from optax_lossscale._diagnostics.finder.program import Program, scale_value
from optax_lossscale._diagnostics.finder.widen import widen_dtype
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
  with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
    return run.report()


class _Run:
  """The finder's run of `fun(*args)`: planned, then run in chunks, each
  value measured; then the report."""

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
    self.program = program = Program(fun, args, masks)
    self.scale = value
    # Tracing folds casts of numbers in the code with numpy (a mask
    # constant beyond float16's range, say): what numpy would warn of is
    # what the finder measures.
    # Which `ols.autocast` policies `fun` applies, recorded as it is traced:
    # the advice names the fix that fits (a scope kept in float32, or the
    # policy itself where `fun` runs under none).
    with (
      np.errstate(over="ignore", invalid="ignore", divide="ignore"),
      _autocast.recording() as policies,
    ):
      self.closed = jax.make_jaxpr(program)(
        program.differentiated, program.inputs
      )
      loss = jax.ShapeDtypeStruct((), self.closed.out_avals[0].dtype)
      self.scaling = jax.make_jaxpr(scaled)(loss, jnp.float32(value))
    self.autocast = tuple(dict.fromkeys(p.dtype.name for p in policies))

  def report(self) -> OverflowReport:
    plan = Plan()
    program = self.program
    arrays = [*program.differentiated, *program.inputs]
    kinds = [_graph.PARAMETER] * len(program.differentiated) + [
      _graph.MASK_INPUT if marked else _graph.INPUT for marked in program.masks
    ]
    arguments = [
      plan.value(jax.typeof(x), kind == _graph.PARAMETER and is_float(x))
      for x, kind in zip(arrays, kinds, strict=True)
    ]
    consts = plan.constants(self.closed.consts)
    (loss,) = plan.add(self.closed.jaxpr, consts, arguments, Context())
    scale = plan.value(jax.typeof(jnp.float32(0)), False)
    (scaled_loss,) = plan.add(
      self.scaling.jaxpr,
      plan.constants(self.scaling.consts),
      [loss, scale],
      Context(scaling=True),
    )
    sources = [
      (v, kind, label, x)
      for v, kind, label, x in zip(
        arguments, kinds, program.labels, arrays, strict=True
      )
    ]
    sources += [
      (v, _graph.CONSTANT, "an array the code closes over", item.array)
      for v, item in enumerate(plan.values)
      if item.array is not None
    ]
    sources.append(
      (scale, _graph.SCALE, "the loss scale", np.float32(self.scale))
    )
    nodes, measured, shadows = _sources.measure(sources)
    chunks = _split.split(plan, {loss, scaled_loss})
    runner = _chunks.Runner(plan, chunks, nodes)
    runner.statistics.append(measured)
    runner.rows = len(measured[2])
    for (v, _, _, x), shadow, node in zip(sources, shadows, nodes, strict=True):
      runner.arrays[v] = (x, shadow)
      runner.node_of[v] = node.index
    ones = np.ones((), plan.values[scaled_loss].aval.dtype)
    seed = (ones, ones.astype(widen_dtype(ones.dtype)))
    try:
      runner.prepare({loss, scaled_loss}, {scaled_loss: (*seed, -1)})
      runner.forward({loss, scaled_loss})
      loss16, loss32 = runner.arrays[loss]
      node = _graph.Node(
        len(runner.nodes), _graph.SEED, "1", from_cotangent=True
      )
      runner.nodes.append(node)
      cotangents = runner.backward({scaled_loss: (*seed, node.index)})
    finally:
      runner.close()
    facts = Facts(runner.nodes, *_gather(runner.statistics, runner.rows))
    outputs = _verdict.Outputs(
      loss=runner.node_of[loss],
      grads=[cotangents[v][2] for v in arguments if v in cotangents],
      loss_value=float(loss16),
      reference_loss=float(loss32),
      labels={
        runner.node_of[v]: name
        for v, name in zip(arguments, program.labels, strict=True)
      },
    )
    found = _verdict.report(facts, outputs, self.scale)
    return dataclasses.replace(found, autocast=self.autocast)


def _gather(
  statistics: list[tuple[int, list[Any], np.ndarray]], rows: int
) -> tuple[np.ndarray, np.ndarray]:
  """Every chunk's statistics, fetched at once, by global row."""
  fetched = jax.device_get([stats for _, stats, _ in statistics])
  counts = np.zeros((rows, _statistics.COUNTS), np.int64)
  magnitudes = np.zeros((rows, 2), np.float64)
  for (base, _, order), groups in zip(statistics, fetched, strict=True):
    c, m = _statistics.columns(groups)
    index = base + np.asarray(order, np.int64)
    counts[index], magnitudes[index] = c, m
  return counts, magnitudes
