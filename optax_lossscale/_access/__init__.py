"""State access: the loss-scale state found inside a whole optimizer state.

`scale_loss`, `value_and_grad`, the read-outs and the setter accept any
optax state, a `TrainState`, an `nnx.Optimizer` or `nnx.state(...)` output,
and find the one loss-scale state in it. Builds on `_core`.
"""
