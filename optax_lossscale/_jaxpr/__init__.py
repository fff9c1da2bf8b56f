"""The lowest floor: the one place that knows jax's internals.

`compat` holds every jax internal the package uses (primitives matched by
object, equation parameters, re-binding, source information) and every
spelling that differs between the oldest and the newest jax supported;
`interpret` is the jaxpr interpreter built on it; `frames` reads the
user's frames of an equation (`autocast`'s `keep_float32` and the overflow
finder name code alike from it). Every floor above
(`_autocast`, `_core`, `_access`, `_diagnostics`) uses public jax and this
floor only.
"""
