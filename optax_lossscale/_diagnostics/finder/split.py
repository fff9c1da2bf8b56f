"""The plan cut into chunks, and each chunk's kind.

The plan is cut wherever it enters or leaves one of several alike
outermost name scopes (`layer_0`, `layer_1`: the layers of a model start
chunks of their own); a run of steps that repeats (a loop of layers with
no scopes) is cut at its period; the rest is cut every `STEPS` steps. A
chunk's *kind* is what it computes: its steps' primitives, parameters,
input types and wiring, not where they are in the code.
"""

import dataclasses
import re
from typing import Any

import numpy as np

from optax_lossscale._diagnostics.finder.plan import Plan, Step
from optax_lossscale._jaxpr import compat

STEPS = 12  # steps in a chunk, at most


@dataclasses.dataclass
class Chunk:
  steps: list[int]  # the plan's steps
  inputs: list[int]  # values it reads, made before it, by first use
  outputs: list[int]  # values it makes that are read after it
  key: Any = None


def split(plan: Plan, kept: set[int]) -> list[Chunk]:
  """The plan's steps in chunks; `kept` are values read after the last
  step (the loss)."""
  groups: list[list[int]] = []
  for segment in _segments(plan):
    groups += _periodic(plan, segment)
  made_in = {}
  for c, group in enumerate(groups):
    for i in group:
      for v in plan.steps[i].outs:
        made_in[v] = c
  read_after: dict[int, int] = {v: len(groups) for v in kept}
  for c, group in enumerate(groups):
    for i in group:
      for v in plan.steps[i].ins:
        if isinstance(v, int):
          read_after[v] = max(read_after.get(v, -1), c)
  chunks = []
  for c, group in enumerate(groups):
    inputs: list[int] = []
    for i in group:
      for v in plan.steps[i].ins:
        if isinstance(v, int) and made_in.get(v, -1) != c and v not in inputs:
          inputs.append(v)
    outputs = [
      v for i in group for v in plan.steps[i].outs if read_after.get(v, -1) > c
    ]
    chunk = Chunk(group, inputs, outputs)
    chunk.key = _key(plan, chunk)
    chunks.append(chunk)
  return chunks


def _segments(plan: Plan) -> list[list[int]]:
  """The steps, cut where they enter or leave one of several alike
  scopes."""
  repeated = _repeated_scopes(plan)
  segments: list[list[int]] = []
  for i, step in enumerate(plan.steps):
    before = plan.steps[i - 1].scope if i else None
    if not segments or (
      step.scope != before and {step.scope, before} & repeated
    ):
      segments.append([])
    segments[-1].append(i)
  return segments


def _periodic(plan: Plan, segment: list[int]) -> list[list[int]]:
  """A segment in chunks: a run of steps that repeats with a period of at
  most `STEPS` (a loop of layers written in Python, with no scopes), over
  at least two chunks' length, is cut at its period, so that its chunks
  are alike; the rest in chunks of `STEPS` steps."""
  signatures = [_signature(plan.steps[i]) for i in segment]
  groups: list[list[int]] = []
  pending: list[int] = []
  i = 0
  while i < len(segment):
    period, repeats = _repetition(signatures, i)
    if period * repeats >= 2 * STEPS:
      if pending:
        groups.append(pending)
        pending = []
      for k in range(repeats):
        start = i + k * period
        groups.append(segment[start : start + period])
      i += period * repeats
      continue
    pending.append(segment[i])
    if len(pending) == STEPS:
      groups.append(pending)
      pending = []
    i += 1
  if pending:
    groups.append(pending)
  return groups


def _repetition(signatures: list[Any], start: int) -> tuple[int, int]:
  """`(period, repeats)` of the longest run of `signatures` from `start`
  that repeats a block of at most `STEPS`; (1, 0) where none does."""
  best = (1, 0)
  for period in range(1, STEPS + 1):
    block = signatures[start : start + period]
    if len(block) < period:
      break
    repeats = 1
    while (
      signatures[start + repeats * period : start + (repeats + 1) * period]
      == block
    ):
      repeats += 1
    if repeats > 1 and period * repeats > best[0] * best[1]:
      best = (period, repeats)
  return best


def _repeated_scopes(plan: Plan) -> set[str]:
  """The outermost scopes that are one of several alike (`layer_0`,
  `layer_1`: the same name but for its numbers): a chunk starts where one
  starts or ends, so that alike layers are chunked alike."""
  names = {step.scope for step in plan.steps}
  alike: dict[str, set[str]] = {}
  for name in names:
    alike.setdefault(re.sub(r"\d+", "#", name), set()).add(name)
  return {name for group in alike.values() if len(group) > 1 for name in group}


def last_reads(plan: Plan, chunks: list[Chunk]) -> dict[int, int]:
  """For each value, the last chunk that reads it."""
  last: dict[int, int] = {}
  for c, chunk in enumerate(chunks):
    for v in chunk.inputs:
      last[v] = c
  return last


# ------------------------------------------------------------------- keys


def _key(plan: Plan, chunk: Chunk) -> Any:
  outside = {v: k for k, v in enumerate(chunk.inputs)}
  inside: dict[int, tuple[int, int]] = {}
  parts = []
  for position, i in enumerate(chunk.steps):
    step = plan.steps[i]
    refs: list[tuple[Any, ...]] = []
    for x in step.ins:
      if isinstance(x, compat.Literal):
        value = np.asarray(compat.literal_value(x))
        refs.append(("literal", x.aval, value.dtype.str, value.tobytes()))
      elif x in inside:
        refs.append(("inside", *inside[x]))
      else:
        refs.append(("outside", outside[x]))
    parts.append((_signature(step), tuple(refs)))
    for k, v in enumerate(step.outs):
      inside[v] = (position, k)
  avals = tuple(
    (plan.values[v].aval, plan.values[v].tangent) for v in chunk.inputs
  )
  return (tuple(parts), tuple(inside[v] for v in chunk.outputs), avals)


def _signature(step: Step) -> Any:
  rule = step.rule
  return (
    step.eqn.primitive,
    _hashable(step.eqn.params),
    tuple(v.aval for v in step.eqn.invars),
    None if rule is None else rule.differentiated,
    step.context.remat,
    step.context.scaling,
  )


def _hashable(value: Any) -> Any:
  """`value` as a key: a body by its text, containers by their items."""
  if isinstance(value, compat.ClosedJaxpr | compat.Jaxpr):
    return ("body", str(value))
  if isinstance(value, dict):
    return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
  if isinstance(value, tuple | list):
    return tuple(_hashable(v) for v in value)
  if isinstance(value, np.ndarray):
    return ("array", value.dtype.str, value.shape, value.tobytes())
  try:
    hash(value)
  except TypeError:
    return ("object", id(value))
  return value
