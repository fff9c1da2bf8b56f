"""Values under the policy: the dtypes it casts, the casts, and what it
knows of a value that the program's own constants make."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT16 = np.dtype(jnp.float16)
BFLOAT16 = np.dtype(jnp.bfloat16)
FLOAT32 = np.dtype(jnp.float32)
# The dtypes the policy casts (as torch.autocast: float64 operands, and the
# 8-bit and 4-bit floats a user chose, make an operation run as written).
ELIGIBLE = frozenset({FLOAT16, BFLOAT16, FLOAT32})
HALF = frozenset({FLOAT16, BFLOAT16})


def dtype_of(x: Any) -> np.dtype:
  dtype = getattr(x, "dtype", None)
  return np.dtype(dtype) if dtype is not None else np.result_type(x)


def is_float(x: Any) -> bool:
  """Whether `x` holds real floating-point numbers (not complex, not an
  integer, a boolean or a PRNG key)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  return not jnp.issubdtype(dtype, jax.dtypes.extended) and jnp.issubdtype(
    dtype, jnp.floating
  )


def cast(x: Any, dtype: Any) -> Any:
  """`x` in `dtype`: as it is when it has that dtype already; a NumPy
  constant stays a NumPy constant (a literal of the program)."""
  dtype = np.dtype(dtype)
  if dtype_of(x) == dtype:
    return x
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x, dtype)
  return jax.lax.convert_element_type(x, dtype)


def widest(dtypes: Any) -> np.dtype:
  """The widest of floating-point `dtypes` (float16 and bfloat16 promote
  to float32, as jnp does)."""
  return np.dtype(jnp.result_type(*dtypes))


@dataclasses.dataclass(frozen=True)
class Constant:
  """A value made from the program's constants alone (literals, arrays
  `fun` closes over), by operations that move or pick their values
  (`table.MOVES`): it holds only values of `sources`.

  `scalar`: every source is a scalar (a `0.5`, a `-1e9` mask value, a
  `jnp.where(m, x, 0.0)` filler). Such a value adapts to the dtype of
  what it meets, as a Python scalar does in jnp (and a 0-d tensor in
  torch), where that dtype can hold it."""

  sources: tuple[Any, ...]
  scalar: bool

  @staticmethod
  def of(value: Any) -> "Constant | None":
    """The constant `value` is, if it is a concrete floating-point array (a
    tracer of an outer trace is not)."""
    if isinstance(value, jax.core.Tracer) or not is_float(value):
      return None
    return Constant((value,), np.ndim(value) == 0)

  @staticmethod
  def union(found: list["Constant | None"]) -> "Constant | None":
    """The constant holding the values of each of `found`, or None when one
    is not a constant."""
    if not found or any(c is None for c in found):
      return None
    known = [c for c in found if c is not None]
    sources = tuple(s for c in known for s in c.sources)
    return Constant(sources, all(c.scalar for c in known))


class Ranges:
  """Whether a dtype holds a constant's values: none of its finite values
  becomes an inf there, and none of its nonzero values a zero. Each
  source's range is computed once, on the device, when first asked."""

  def __init__(self) -> None:
    self._ranges: dict[int, tuple[Any, float, float]] = {}

  def fits(self, constant: Constant, dtype: Any) -> bool:
    return all(self._fits(source, dtype) for source in constant.sources)

  def _fits(self, source: Any, dtype: Any) -> bool:
    largest, smallest = self._range(source)
    source_dtype = dtype_of(source)
    with np.errstate(over="ignore", under="ignore"):
      as_dtype = np.asarray([largest, smallest], source_dtype).astype(dtype)
    finite = largest == 0 or bool(np.isfinite(as_dtype[0]))
    nonzero = smallest == np.inf or bool(as_dtype[1] != 0)
    return finite and nonzero

  def _range(self, source: Any) -> tuple[float, float]:
    """The largest finite magnitude of `source` and its smallest nonzero
    one (0 and inf where there is none)."""
    key = id(source)
    if key not in self._ranges:
      self._ranges[key] = (source, *_magnitudes(source))
    _, largest, smallest = self._ranges[key]
    return largest, smallest


def _magnitudes(source: Any) -> tuple[float, float]:
  if np.size(source) == 0:
    return 0.0, float("inf")
  if isinstance(source, (np.ndarray, np.generic, float)):
    values = np.abs(np.asarray(source, np.float64))
    finite = values[np.isfinite(values)]
    nonzero = finite[finite > 0]
    largest = float(finite.max()) if finite.size else 0.0
    smallest = float(nonzero.min()) if nonzero.size else float("inf")
    return largest, smallest
  # A jax array: reduced where it lives, so that a large closed-over array
  # is not copied to the host.
  with jax.ensure_compile_time_eval():
    magnitude = jnp.abs(jnp.asarray(source))
    kept = jnp.isfinite(magnitude)
    return (
      float(jnp.max(jnp.where(kept, magnitude, 0))),
      float(jnp.min(jnp.where(kept & (magnitude > 0), magnitude, jnp.inf))),
    )
