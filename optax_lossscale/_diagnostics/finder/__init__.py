"""The parts of `find_overflow` (`_diagnostics/overflow.py`), one job each.

- `program`: what is differentiated, what is held fixed (and marked as a
  mask), and `fun` as a function of its arrays;
- `primitives`: the classes of jax primitives the finder tells apart,
  built when the finder loads;
- `rules`: each equation's derivative as jax computes it, as a forward and
  a backward rule;
- `widen`: an equation computed in float32 (the shadow);
- `plan`: the program as a flat list of steps, calls entered;
- `split`: the steps cut into chunks, and each chunk's kind;
- `shadow`: a chunk run in its dtypes and in its float32 shadow, operation
  by operation, forward or backward, traced once per kind;
- `chunks`: the chunks run one after the other, each kind compiled once;
- `sources`: the arguments and constants, measured on the host;
- `graph`: the nodes (every value, and what is known of it);
- `statistics`: the few numbers each value is reduced to, on the device;
- `compile`: compile options for a program that runs once;
- `analysis`: on the host, what made each value not finite, and what
  changes the loss or the gradients;
- `verdict`: the report, from those facts;
- `source`: where an operation is, in the user's code.
"""
