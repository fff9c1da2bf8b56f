"""`autocast`: a function run with op-level mixed precision."""

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import jax.numpy as jnp

from optax_lossscale._autocast import arguments as _arguments
from optax_lossscale._autocast import records as _records
from optax_lossscale._autocast.interpreter import Evaluator, Where
from optax_lossscale._autocast.policy import Policy, make_policy

# Where autocast says, at INFO, which primitives ran outside its policy.
LOGGER = logging.getLogger("optax_lossscale.autocast")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def autocast(
  fun: Callable[_P, _R],
  dtype: Any = jnp.float16,
  *,
  keep_float32: Sequence[str] = (),
  mixed: str = "promote",
) -> Callable[_P, _R]:
  """Runs ``fun`` with op-level mixed precision: products in ``dtype``,
  the numerically sensitive operations in float32.

  The other half of mixed precision, beside the loss scaler (Keras's
  ``mixed_float16`` policy, ``torch.autocast``): ``fun`` is traced at each
  call and its operations run as follows (``docs/autocast.md`` has the
  table, primitive by primitive):

  - **Products** (``dot_general``, ``conv_general_dilated``,
    ``ragged_dot_general``) take their operands in ``dtype`` and give a
    ``dtype`` result, forward and backward (their transposes are products
    of the same dtypes). A constant operand that ``dtype`` cannot hold (a
    value beyond 65504 in float16) keeps the product as traced.
  - **The float32 list** (exponentials, logarithms, powers and squares,
    ``rsqrt``, sums and cumulative sums, a constant divided by a value,
    torch.autocast's unbounded functions, the special functions) runs on
    float32 operands.
  - **Everything else** runs in its operands' dtypes; operands of two
    floating-point dtypes meet in the widest (``mixed="promote"``, as
    torch does) or in ``dtype`` where one is in it (``mixed="cast"``, as
    Keras's layers read float32 variables in the compute dtype). A
    constant made from a scalar (``x * 0.5``, the ``0.0`` of
    ``jnp.where(m, x, 0.0)``) takes the dtype it meets, where that dtype
    holds it: a ``-1e9`` mask value meets float16 values in float32.
  - **Outputs** come back in the dtypes ``fun`` returns, so float32
    parameters get float32 gradients; integers, booleans and PRNG keys are
    never touched, and a cast written in ``fun`` (``x.astype(...)``) is
    kept.
  - **Kept as traced:** custom derivative rules (``jax.custom_jvp``,
    ``jax.custom_vjp``) and primitives the policy does not list (host
    callbacks, FFI calls, Pallas kernels) run in the dtypes they were
    traced with, their inputs cast back at their boundary.

  ``fun`` is traced at each call, as under ``jax.jit`` (once per
  compilation inside a jitted step): its array arguments are traced, and
  Python control flow on their values fails as it does under ``jit``; any
  other argument (a flag, a number, an Equinox module's functions) passes
  into ``fun`` as it is.

  Loops (``scan``, ``while_loop``, ``cond``, ``fori_loop``) run their bodies
  under the same policy, their carries in their own dtypes; nested
  ``jit``, ``jax.checkpoint``, ``vmap`` and ``shard_map`` work inside
  ``fun`` and around it. Each operation keeps its name scopes and source
  line, so that errors, profiles and :func:`find_overflow` name the user's
  code. Flax NNX modules passed as arguments are updated as ``fun`` leaves
  them (BatchNorm statistics, RNG counts); an Equinox module's non-array
  leaves pass through as they are.

  bfloat16 has float32's range: with ``dtype=jnp.bfloat16`` no loss scale
  is needed. With float16, wrap the optimizer in
  :func:`loss_scale_optimizer` and take gradients with
  :func:`value_and_grad`.

  Args:
    fun: the function to run under the policy, such as the loss.
    dtype: the compute dtype of the products: float16 (``jnp.float16``,
      ``np.float16``, ``"float16"``) or bfloat16.
    keep_float32: name scopes (``jax.named_scope``, Flax Linen module
      paths) whose operations all run in float32, matched as whole
      components (``"attention"`` matches ``decoder/attention/softmax``,
      ``"3/0"`` matches ``3/0/1/0``); an entry of one name also matches the
      functions and classes on an operation's call path (``"RMSNorm"``,
      ``"Attention.__call__"``), as :func:`find_overflow` names them. A
      sequence of strings; a bare string is refused.
    mixed: ``"promote"`` (the default) or ``"cast"``, for operations whose
      floating-point operands are in two dtypes (see above).

  Returns:
    A function with ``fun``'s signature that runs ``fun`` under the
    policy.

  Raises:
    TypeError: ``fun`` is not callable; ``dtype`` is not a dtype;
      ``keep_float32`` is not a sequence of strings (a bare string).
    ValueError: ``dtype`` is neither float16 nor bfloat16; an empty
      ``keep_float32`` entry; ``mixed`` is neither ``"promote"`` nor
      ``"cast"``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> @ols.autocast
    ... def loss(w, x):
    ...   return jnp.mean(jnp.exp(jnp.tanh(x @ w)))
    >>> w, x = jnp.full((4, 2), 0.25), jnp.ones((3, 4))
    >>> program = jax.make_jaxpr(jax.grad(loss))(w, x).jaxpr
    >>> sorted({(e.primitive.name, e.outvars[0].aval.dtype.name)
    ...         for e in program.eqns
    ...         if e.primitive.name in ("dot_general", "exp", "tanh")})
    [('dot_general', 'float16'), ('exp', 'float32'), ('tanh', 'float16')]
    >>> jax.grad(loss)(w, x).dtype  # float32 weights, float32 gradients
    dtype('float32')
  """
  fun, policy = make_policy(fun, dtype, keep_float32, mixed)

  @functools.wraps(fun)
  def under_policy(*args: _P.args, **kwargs: _P.kwargs) -> _R:
    return call(policy, fun, args, kwargs)

  return under_policy


def call(
  policy: Policy,
  fun: Callable[..., Any],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
) -> Any:
  """`fun(*args, **kwargs)` under `policy`: traced, then evaluated on the
  arguments' values (tracers of the trace around it, or arrays)."""
  _records.record(policy)
  arguments = _arguments.Arguments(args, kwargs)
  closed, results, state = _arguments.trace(fun, arguments)
  dtypes = [v.aval.dtype for v in closed.jaxpr.outvars]
  evaluator = Evaluator(policy)
  outs, _ = evaluator.run(closed, arguments.arrays, Where(), out_dtypes=dtypes)
  if evaluator.outside:
    _say_outside(fun, evaluator.outside)
  n = len(results.arrays)
  arguments.write_back(state.rebuild(outs[n:]))
  return results.rebuild(outs[:n])


def _say_outside(
  fun: Callable[..., Any], outside: dict[str, str | None]
) -> None:
  """Logs the primitives that ran outside the policy (one line a trace)."""
  if not LOGGER.isEnabledFor(logging.INFO):
    return
  named = ", ".join(
    name if where is None else f"{name} ({where})"
    for name, where in outside.items()
  )
  LOGGER.info(
    "autocast(%s): outside the policy, in their traced dtypes: %s",
    getattr(fun, "__name__", type(fun).__name__),
    named,
  )
