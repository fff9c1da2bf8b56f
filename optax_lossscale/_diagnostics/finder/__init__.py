"""The parts of `find_overflow` (`_diagnostics/overflow.py`), one job each.

- `program`: what is differentiated, what is held fixed (and marked as a
  mask), and `fun` as a function of its arrays;
- `primitives`: the classes of jax primitives the finder tells apart,
  built when the finder loads;
- `rules`: each equation's derivative as jax computes it, as a forward and
  a backward rule;
- `widen`: an equation computed in float32 (the shadow);
- `shadow`: the interpreter that runs the program and its float32 shadow
  operation by operation, forward and backward;
- `graph`: the nodes (every value, and what is known of it);
- `statistics`: the few numbers each value is reduced to, on the device;
- `compile`: compile options for a program that runs once;
- `analysis`: on the host, what made each value not finite, and what
  changes the loss or the gradients;
- `verdict`: the report, from those facts;
- `source`: where an operation is, in the user's code.
"""
