"""The package's step against alternative forms of two of its parts.

Two choices in the compiled step are measured here, each against what it
replaced, side by side with the plain adam step, by `overhead.py`'s
`run_config` (jit, donated params and state, interleaved rounds, warm-up
excluded, medians):

- the unscale: `unscale_and_check` divides each gradient by the scale as a
  product, `(g * quarter) * (1 / (scale * quarter))`, with `quarter` 1/4
  above 2**126 (where `1 / scale` is subnormal and flushes to zero) and 1
  otherwise. `quotient` is `g / scale`, the exact division; `one_multiply`
  is `g * (1 / scale)`, wrong above 2**126, shown only for what the second
  multiply costs;
- the `last_finite` flag: on accelerators it is computed from its old value
  so that its donated buffer stays an input of the program (see `_donation`);
  on CPU it is not. `flag_read` reads it on CPU too.

`package` is the package as it is (`overhead.py`'s `ours`). `temp MB` is
`compiled.memory_analysis().temp_size_in_bytes`: a quotient that XLA does
not fuse into its consumers shows up there.

  python benchmarks/alternatives.py
  python benchmarks/alternatives.py --tiny
"""

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax import lax

from optax_lossscale._core import donation as _donation
from optax_lossscale._core import step as _unscale

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead

FORMS = ("plain", "package", "quotient", "one_multiply", "flag_read")


def _scale_itself(loss_scale, out_dtype):
  compute_dtype = jnp.promote_types(out_dtype, loss_scale.dtype)
  return compute_dtype, None, loss_scale.astype(compute_dtype)


def _reciprocal_only(loss_scale, out_dtype):
  compute_dtype = jnp.promote_types(out_dtype, loss_scale.dtype)
  return compute_dtype, None, 1 / loss_scale.astype(compute_dtype)


def _leaf_with(op: Callable) -> Callable:
  def unscale_leaf(g, out_dtype, scale_for):
    if g is None or not jnp.issubdtype(g.dtype, jnp.inexact):
      return g
    compute_dtype, _, factor = scale_for(out_dtype)
    g = lax.convert_element_type(g, compute_dtype)
    return lax.convert_element_type(op(g, factor), out_dtype)

  return unscale_leaf


_REPLACEMENTS = {
  "quotient": (_scale_itself, _leaf_with(lax.div)),
  "one_multiply": (_reciprocal_only, _leaf_with(lax.mul)),
}


@contextlib.contextmanager
def _traced_as(form: str) -> Iterator[None]:
  """Traces the package with another form of one part while inside
  (tracing only: a compiled step keeps what it was traced with)."""
  if form in _REPLACEMENTS:
    module, names, replacements = (
      _unscale,
      ("_scale_for", "_unscale_leaf"),
      _REPLACEMENTS[form],
    )
  elif form == "flag_read":
    module, names, replacements = (
      _donation,
      ("last_finite_flag",),
      (_donation._finite_reading_old,),
    )
  else:
    yield
    return
  saved = [getattr(module, name) for name in names]
  for name, replacement in zip(names, replacements, strict=True):
    setattr(module, name, replacement)
  try:
    yield
  finally:
    for name, original in zip(names, saved, strict=True):
      setattr(module, name, original)


def _make_variant(form: str, inner):
  """`(init, step)` for `overhead.run_config`: the plain optax step, or the
  package's step traced with `form` in place of its own parts."""
  if form == "plain":
    return overhead._make_variant("plain", inner)
  init, step = overhead._make_variant("ours", inner)

  def traced_as_form(params, state, grads):
    with _traced_as(form):
      return step(params, state, grads)

  return init, traced_as_form


def run_config(n_params, n_leaves, grad_dtype, rounds, out=print):
  """Times every form on one configuration; returns {form: result}."""
  results = overhead.run_config(
    n_params,
    n_leaves,
    "adam",
    grad_dtype,
    list(FORMS),
    rounds,
    compile_repeats=1,
    make_variant=_make_variant,
  )
  for form in FORMS:
    r = results[form]
    out(
      f"{n_params:>10} {n_leaves:>6} {jnp.dtype(grad_dtype).name:>7}"
      f" {form:<13} {r['median_s'] * 1e3:8.2f} {r['ratio']:6.2f}"
      f" {r['temp_bytes'] / 1e6:8.1f}"
    )
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="seconds, smoke")
  parser.add_argument("--rounds", type=int, default=40)
  args = parser.parse_args(argv)
  if args.tiny:
    configs, rounds = [(4096, 4, jnp.float16)], 3
  else:
    configs = [
      (10**7, 50, jnp.float32),
      (10**7, 50, jnp.float16),
      (10**6, 10, jnp.float32),
    ]
    rounds = args.rounds
  print(
    f"device: {jax.devices()[0].device_kind}, jax {jax.__version__};"
    f" adam, median of {rounds} interleaved rounds, ratio to plain adam"
  )
  print(
    f"{'params':>10} {'leaves':>6} {'grads':>7} {'form':<13} {'ms':>8}"
    f" {'ratio':>6} {'temp MB':>8}"
  )
  return {
    (n, leaves, jnp.dtype(dtype).name): run_config(n, leaves, dtype, rounds)
    for n, leaves, dtype in configs
  }


if __name__ == "__main__":
  main()
