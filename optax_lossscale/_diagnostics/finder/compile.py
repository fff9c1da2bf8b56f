"""Compile options for the finder's chunks, each compiled once and run a
few times, reading nearly every value they make.

XLA:CPU compiles a program kernel by kernel; a program that reduces every
intermediate value has a kernel for nearly every operation. The older
elemental emitters compile those several times faster, and LLVM's
optimization level trades compile time against the speed of the code:
about twice the compile time for code about twice as fast. The time saved
grows with the elements each value has, times the runs; the time spent,
with the number of values: level 0 wins for a chunk whose values are read
little, the default level for one whose values are large and read many
times (`benchmarks/README.md`, the finder's cost). These are debug
options of XLA, not an API: a jaxlib that lacks one compiles without it.
"""

from typing import Any

import jax

# XLA:CPU splits a program's LLVM module to compile the parts on threads
# of its own; the finder already compiles several kinds at once on worker
# threads, so a split only adds work (each part compiled on its own).
_ONE_MODULE = {"xla_cpu_parallel_codegen_split_count": 1}
_QUICK_CPU_COMPILE = {
  "xla_cpu_use_fusion_emitters": False,
  "xla_backend_optimization_level": 0,
  **_ONE_MODULE,
}
_LARGE_CPU_COMPILE = {"xla_cpu_use_fusion_emitters": False, **_ONE_MODULE}
LARGE = 2**21  # elements a chunk reads per value it measures, in all its
# runs, above which its code must be fast


def compile_for_one_run(lowered: Any, reads: int) -> Any:
  """`lowered.compile()` for a program whose runs read about `reads`
  elements per value they measure: on XLA:CPU, compiled quickly where that
  is few (see `_QUICK_CPU_COMPILE`). An option this jaxlib does not know
  (it says which) is left out."""
  options: dict[str, Any] = {}
  if jax.default_backend() == "cpu":
    options = dict(_LARGE_CPU_COMPILE if reads > LARGE else _QUICK_CPU_COMPILE)
  while options:
    try:
      return lowered.compile(compiler_options=options)
    except Exception as e:  # refused before compiling: cheap to retry
      unknown = [name for name in options if name in str(e)]
      if not unknown:
        break
      del options[unknown[0]]
  return lowered.compile()
