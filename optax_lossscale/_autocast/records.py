"""Which policies were applied while a program was traced, for the
overflow finder's advice (it says `ols.autocast(loss_fn)` where `fun` ran
under none, and names a `keep_float32` scope where it did).

Kept in a `contextvars.ContextVar` of the package's own, never in jax's
state: nothing is recorded unless a caller asks, and what one thread or
task records is its own.
"""

import contextlib
import contextvars
from collections.abc import Iterator

from optax_lossscale._autocast.policy import Policy

_RECORDS: contextvars.ContextVar[list[Policy] | None] = contextvars.ContextVar(
  "optax_lossscale_autocast_records", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list[Policy]]:
  """While inside, each call of a function made by `autocast` appends the
  `Policy` it applied to the list this yields (one entry per call traced
  or run, in order; a call inside another's `fun` appends its own).

  Example:
    >>> import jax.numpy as jnp
    >>> import optax_lossscale as ols
    >>> from optax_lossscale import _autocast
    >>> loss = ols.autocast(lambda w: jnp.sum(w * w), keep_float32=("head",))
    >>> with _autocast.recording() as policies:
    ...   _ = loss(jnp.ones(3))
    >>> [(p.dtype.name, p.keep_float32) for p in policies]
    [('float16', (('head',),))]
  """
  records: list[Policy] = []
  token = _RECORDS.set(records)
  try:
    yield records
  finally:
    _RECORDS.reset(token)


def record(policy: Policy) -> None:
  """Appends `policy` to the innermost `recording()`, if any."""
  records = _RECORDS.get()
  if records is not None:
    records.append(policy)
