"""The core: the transformation itself.

Configuration, state, the scaling rule, the finiteness check, the unscale
and the step, the skip of the inner update, and the optimizer around them.
Nothing here reads a whole optimizer state or explains a skip: state access
(`_access`) and diagnostics (`_diagnostics`) build on this floor, never the
reverse.
"""
