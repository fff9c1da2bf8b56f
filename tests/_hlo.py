"""Structural reading of compiled and lowered programs, for tests.

Tests count operations by kind (and read their result shapes); they never
compare program text, whose names, layouts and spelling change with XLA.
Two small, tolerant parsers: one for the optimized HLO module of a compiled
program, one for the StableHLO of a lowered or exported one.
"""

import collections
import re
from typing import NamedTuple

# `[ROOT] [%]name = TYPE opcode(...)`: TYPE may be a tuple with spaces; the
# opcode is the first lowercase word followed by `(` (layout tags such as
# `T(8,128)` and `S(1)` are uppercase).
_HLO_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s*"
  r"(?<![\w.\-])(?P<opcode>[a-z][a-z0-9\-]*)\("
)
_HLO_ARRAY = re.compile(
  r"\b(?P<dtype>[a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[(?P<dims>[0-9,]*)\]"
)

# `%r = stablehlo.op ...`, `%r:2 = "stablehlo.op"(...)`, `stablehlo.return`.
_MLIR_OP = re.compile(
  r"^\s*(?P<assigned>%[\w#.$\-]+(?::(?P<results>\d+))?"
  r"(?:\s*,\s*%[\w#.$\-]+)*\s*=\s*)?\"?(?P<name>(?:stablehlo|chlo|mhlo)\.\w+)"
)
_MLIR_TENSOR = re.compile(r"tensor<(?P<dims>(?:[0-9?]+x)*)(?P<dtype>\w+)>")


class Instruction(NamedTuple):
  """One instruction: its opcode and the arrays of its result."""

  opcode: str
  arrays: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) each

  @property
  def sizes(self) -> tuple[int, ...]:
    """The element count of each array of the result."""
    out = []
    for _, dims in self.arrays:
      size = 1
      for d in dims:
        size *= d
      out.append(size)
    return tuple(out)


def hlo_instructions(compiled) -> list[Instruction]:
  """The instructions of a compiled program's optimized HLO module, in
  every computation (fused computations included)."""
  found = []
  for line in compiled.as_text().splitlines():
    match = _HLO_INSTRUCTION.match(line)
    if match is None:
      continue
    arrays = tuple(
      (a["dtype"], tuple(int(d) for d in a["dims"].split(",") if d))
      for a in _HLO_ARRAY.finditer(match["type"])
    )
    found.append(Instruction(match["opcode"], arrays))
  return found


def hlo_opcodes(compiled) -> collections.Counter:
  """How many instructions of each opcode the compiled program has; the
  asynchronous pairs of a collective count once, by their `-start`."""
  counts = collections.Counter()
  for instruction in hlo_instructions(compiled):
    opcode = instruction.opcode
    if opcode.endswith("-done"):
      continue
    counts[opcode.removesuffix("-start")] += 1
  return counts


class MlirOp(NamedTuple):
  """One StableHLO operation: its name (without dialect), the number of its
  results, and the tensor types on its line (operands, then results)."""

  name: str
  results: int
  tensors: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) each


def mlir_ops(text: str) -> list[MlirOp]:
  """The StableHLO operations of a lowered module's text, one per line."""
  found = []
  for line in text.splitlines():
    match = _MLIR_OP.match(line)
    if match is None:
      continue
    tensors = tuple(
      (t["dtype"], tuple(int(d) for d in t["dims"].split("x") if d))
      for t in _MLIR_TENSOR.finditer(line.split(" loc(")[0])
    )
    found.append(
      MlirOp(
        match["name"].split(".", 1)[1],
        int(match["results"] or 1) if match["assigned"] else 0,
        tensors,
      )
    )
  return found
