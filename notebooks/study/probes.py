"""What float16 does to the gradients: each run's float16 gradients against
float32 gradients of the same weights and batch, at the run's scale. This
is the measurement behind the "flushed %" columns; the paper (Micikevicius
et al., 2018) locates the underflow in the activation gradients, so those
are measured per token, through zero "taps" added to every pre-activation
and to the logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import model, runs
from .runs import RunSpec

F16_TINY = 2.0**-24  # smallest positive (subnormal) float16
F16_NORMAL_MIN = 2.0**-14  # smallest positive normal float16
F16_MAX = 65504.0


def _flat(tree: Any) -> jax.Array:
  return jnp.concatenate([g.ravel() for g in jax.tree.leaves(tree)])


def _magnitudes(tree: Any) -> np.ndarray:
  return np.abs(np.asarray(_flat(tree), np.float32))


def _float32_loss(spec: RunSpec, depth: int) -> Callable[..., jax.Array]:
  """The loss of the run's float32 reference (same model, float32 compute)."""
  return runs.loss(runs.float32_reference(spec), depth)


def _activation_gradients(
  loss: Callable[..., jax.Array],
  params: model.Params,
  x: jax.Array,
  y: jax.Array,
  taps: Any,
  scale: Any = None,
) -> Any:
  """The gradients of `loss` (times `scale`, when given, as the run's
  backward pass holds them) with respect to the activation taps."""
  scaled = loss if scale is None else (lambda *a: loss(*a) * scale)
  return jax.grad(scaled, argnums=3)(params, x, y, taps)


def flush_stats(
  spec: RunSpec,
  params: model.Params,
  opt_state: Any,
  x: jax.Array,
  y: jax.Array,
  depth: int,
) -> dict[str, jax.Array]:
  """Parameter gradients (``flushed``, ``nonfinite``) and activation
  gradients (``act_*``): of the elements nonzero in float32, the share
  that are zero in float16 (flushed); of all elements, the share that are
  inf or NaN (overflowed); and the share of float32 magnitudes (times the
  scale) below 2**-24 and 2**-14. The float16 shares are NaN for a float32
  run."""
  s = runs.scale(spec, opt_state)
  f32 = _float32_loss(spec, depth)
  g32 = _flat(jax.grad(f32)(params, x, y))
  nz = g32 != 0
  out = {
    "below_tiny": jnp.sum(nz & (jnp.abs(g32) * s < F16_TINY)) / nz.sum(),
    "below_normal": (
      jnp.sum(nz & (jnp.abs(g32) * s < F16_NORMAL_MIN)) / nz.sum()
    ),
  }
  taps = model.zero_taps(params, x, depth)
  a32 = _flat(_activation_gradients(f32, params, x, y, taps))
  anz = a32 != 0
  out["act_below_normal"] = (
    jnp.sum(anz & (jnp.abs(a32) * s < F16_NORMAL_MIN)) / anz.sum()
  )
  if spec.dtype == "float32":
    for k in ("flushed", "nonfinite", "act_flushed", "act_nonfinite"):
      out[k] = jnp.float32(jnp.nan)
    return out
  _, g16 = runs.value_and_grad(spec, params, opt_state, x, y, depth)
  g16 = _flat(g16)
  out["flushed"] = jnp.sum(nz & (g16 == 0)) / nz.sum()
  out["nonfinite"] = jnp.mean(~jnp.isfinite(g16))
  f16 = runs.loss(spec, depth)
  a16 = _flat(_activation_gradients(f16, params, x, y, taps, s))
  out["act_flushed"] = jnp.sum(anz & (a16 == 0)) / anz.sum()
  out["act_nonfinite"] = jnp.mean(~jnp.isfinite(a16))
  return out


def gradient_magnitudes(
  spec: RunSpec,
  params: model.Params,
  opt_state: Any,
  x: jax.Array,
  y: jax.Array,
  depth: int,
) -> tuple[np.ndarray, np.ndarray]:
  """All parameter-gradient magnitudes (flattened, float32) the run's
  update would receive, and the float32 reference times the run's scale:
  the two histograms that show where float16's range cuts."""
  s = runs.scale(spec, opt_state)
  g32 = jax.grad(_float32_loss(spec, depth))(params, x, y)
  _, g = runs.value_and_grad(spec, params, opt_state, x, y, depth)
  return _magnitudes(g), _magnitudes(g32) * float(s)


def activation_gradient_magnitudes(
  spec: RunSpec,
  params: model.Params,
  opt_state: Any,
  x: jax.Array,
  y: jax.Array,
  depth: int,
) -> tuple[np.ndarray, np.ndarray]:
  """Magnitudes of the activation gradients (every pre-activation and the
  logits, per token) as the run's backward pass holds them (times its
  scale), and the float32 reference times the same scale."""
  s = float(runs.scale(spec, opt_state))
  taps = model.zero_taps(params, x, depth)
  g32 = _activation_gradients(_float32_loss(spec, depth), params, x, y, taps)
  g = _activation_gradients(runs.loss(spec, depth), params, x, y, taps, s)
  return _magnitudes(g), _magnitudes(g32) * s
