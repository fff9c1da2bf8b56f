"""The parts of `find_overflow` (`_diagnostics/overflow.py`), one job each.

- `program`: what is differentiated, and the gradient program traced;
- `primitives`: the classes of jax primitives the finder tells apart;
- `graph`: the visitor that measures every value and records where it came
  from;
- `statistics`: the few numbers each value is reduced to, on the device;
- `reference`: an operation recomputed in float32, for the flushed count;
- `compile`: compile options for a program that runs once;
- `analysis`: on the host, which value is the first harmful overflow, in
  which pass, and which are masks;
- `source`: where an operation is, in the user's code.
"""
