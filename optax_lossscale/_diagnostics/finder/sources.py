"""The program's sources (its arguments, the arrays it closes over, the
loss scale) measured on the host: they exist before anything runs, and
measuring them there costs no compilation. Their float32 shadows are the
values themselves, widened (exactly)."""

from typing import Any

import jax
import numpy as np

from optax_lossscale._diagnostics.finder import graph as _graph
from optax_lossscale._diagnostics.finder import statistics as _stats
from optax_lossscale._diagnostics.finder.primitives import is_float
from optax_lossscale._diagnostics.finder.widen import widen_dtype


def measure(
  sources: list[tuple[int, str, str, Any]],
) -> tuple[list[_graph.Node], tuple[Any, ...], list[Any]]:
  """`sources` (value, kind, label, array) as nodes, measured: `(nodes,
  (base row 0, [their reductions], order), their float32 shadows)`."""
  nodes: list[_graph.Node] = []
  counts: list[list[int]] = []
  magnitudes: list[list[float]] = []
  shadows: list[Any] = []
  for index, (_, kind, label, x) in enumerate(sources):
    node = _graph.Node(
      index, kind, label, static=kind == _graph.CONSTANT, shape=np.shape(x)
    )
    if is_float(x):
      node.dtype, node.row = str(x.dtype), len(counts)
      count, magnitude = _statistics_of(np.asarray(x))
      counts.append(count)
      magnitudes.append(magnitude)
    nodes.append(node)
    shadows.append(_widened(x))
  rows = len(counts)
  statistics = _stats.as_reduced(
    np.asarray(counts, np.int64).reshape(rows, _stats.COUNTS),
    np.asarray(magnitudes, np.float64).reshape(rows, 2),
  )
  return nodes, (0, [statistics], np.arange(rows)), shadows


def _statistics_of(a: np.ndarray) -> tuple[list[int], list[float]]:
  if np.iscomplexobj(a):
    a = np.maximum(np.abs(a.real), np.abs(a.imag))
  a = np.abs(a.astype(np.float64)).ravel()
  nan = np.isnan(a)
  finite = np.isfinite(a)
  kept = a[finite]
  nonzero = kept[kept > 0]
  count = [0] * _stats.COUNTS
  count[_stats.NAN] = int(nan.sum())
  count[_stats.INF] = int((~finite & ~nan).sum())
  count[_stats.SHADOW_NAN] = int(nan.any())  # the shadow: the value, widened
  count[_stats.BOTH] = int((~finite).any())
  largest = float(kept.max()) if kept.size else 0.0
  smallest = float(nonzero.min()) if nonzero.size else np.inf
  return count, [largest, smallest]


def _widened(x: Any) -> Any:
  """`x` in its wide dtype, where `x` is (on the device it is on)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or widen_dtype(dtype) == dtype:
    return x
  wide = np.asarray(x).astype(widen_dtype(dtype))
  if isinstance(x, jax.Array):
    return jax.device_put(wide, x.sharding)
  return wide
