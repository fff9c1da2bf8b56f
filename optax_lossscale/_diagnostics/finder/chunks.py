"""The program's chunks run one after the other, each kind compiled once.

Each kind of chunk (`split`) is traced (`shadow.Tracer`) and compiled once,
forward and backward, and run for every chunk of that kind: a model of a
hundred identical layers is compiled as a few chunks. Compiling the whole
program at once, measured beside its float32 shadow, took the compiler
about ten times a plain `value_and_grad`'s work. Kinds are traced first,
each compiled on a worker thread while the next is traced; then the chunks
run, their values on the device, each dropped after its last use.
"""

import concurrent.futures
import copy
import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from optax_lossscale._diagnostics.finder import graph as _graph
from optax_lossscale._diagnostics.finder import source as _source
from optax_lossscale._diagnostics.finder.compile import compile_for_one_run
from optax_lossscale._diagnostics.finder.plan import Plan, Step
from optax_lossscale._diagnostics.finder.primitives import is_float
from optax_lossscale._diagnostics.finder.shadow import Template, Tracer, Val
from optax_lossscale._diagnostics.finder.split import Chunk, last_reads
from optax_lossscale._jaxpr import compat

# ----------------------------------------------------------------- runner


@dataclasses.dataclass
class _Compiled:
  """A kind of chunk, lowered: its program compiles on a worker thread
  while the next kinds are traced."""

  compiling: concurrent.futures.Future[Any]
  out_info: Any  # its outputs' shapes and dtypes
  template: Template
  order: np.ndarray

  def run(self, *args: Any) -> Any:
    executable = self.compiling.result()
    # Placed as compiled: a kind is lowered from shapes, which on an `Auto`
    # mesh say nothing of how the arrays that reach it are sharded.
    placed = jax.device_put(args, executable.input_shardings[0])
    return executable(*placed)


class Runner:
  """Runs the chunks forward, then backward, building the nodes."""

  def __init__(self, plan: Plan, chunks: list[Chunk], nodes: list[Any]):
    self.plan = plan
    self.chunks = chunks
    self.nodes = nodes  # the program's nodes, the sources' first
    self.arrays: dict[int, tuple[Any, Any]] = {}  # value: (value, shadow)
    self.node_of: dict[int, int] = {}  # value: node
    self.statistics: list[tuple[int, list[Any], np.ndarray]] = []
    self.rows = 0
    self._compiled: dict[Any, _Compiled] = {}
    self._residuals: list[tuple[list[Any], list[Any], list[int]]] = []
    self._where: dict[int, _source.Where] = {}
    self._preparing = False
    # How many chunks there are of each kind: a kind that runs many times
    # is worth compiling to faster code.
    self._runs: dict[Any, int] = {}
    for chunk in chunks:
      self._runs[chunk.key] = self._runs.get(chunk.key, 0) + 1
    self._workers = concurrent.futures.ThreadPoolExecutor(
      max_workers=max(1, min(4, os.cpu_count() or 1))
    )

  def prepare(self, kept: set[int], seeds: dict[int, Any]) -> None:
    """Traces and lowers every kind of chunk, forward and backward, with
    shapes for values, handing each to a worker thread to compile: XLA
    compiles while Python traces the next kinds. The run that follows
    then only waits for them."""
    arrays, node_of = dict(self.arrays), dict(self.node_of)
    self._preparing = True
    try:
      self.forward(kept)
      self.backward(seeds)
    except Exception:  # the run lowers, with its arrays, what is left
      pass
    finally:
      self._preparing = False
      self.arrays, self.node_of, self._residuals = arrays, node_of, []

  def close(self) -> None:
    """Lets the compiling threads go."""
    self._workers.shutdown(wait=False)

  # ---------------------------------------------------------------- forward

  def forward(self, kept: set[int]) -> None:
    last = last_reads(self.plan, self.chunks)
    for c, chunk in enumerate(self.chunks):
      compiled = self._forward_kind(chunk)
      values = [self.arrays[v][0] for v in chunk.inputs]
      shadows = [self.arrays[v][1] for v in chunk.inputs]
      outs16, outs32, res16, res32, *stats = self._call(
        compiled, values, shadows
      )
      template_outputs = compiled.template.outputs
      if self._preparing:
        mapping = {t: -1 for t in template_outputs}
      else:
        externals = [self.node_of[v] for v in chunk.inputs]
        mapping = self._instantiate(compiled, chunk, externals, stats)
      for v, a, b, t in zip(
        chunk.outputs, outs16, outs32, template_outputs, strict=False
      ):
        self.arrays[v] = (a, b)
        self.node_of[v] = mapping[t]
      residual_nodes = [
        mapping[t] for t in template_outputs[len(chunk.outputs) :]
      ]
      self._residuals.append((res16, res32, residual_nodes))
      for v in chunk.inputs:
        if last.get(v) == c and v not in kept:
          self.arrays.pop(v, None)

  def _forward_kind(self, chunk: Chunk) -> _Compiled:
    found = self._compiled.get(("forward", chunk.key))
    if found is not None:
      return found
    made: dict[str, Any] = {"key": chunk.key}
    plan = self.plan

    def run(values: list[Any], shadows: list[Any]) -> Any:
      recorder = _graph.Recorder()
      tracer = Tracer(recorder)
      env = {
        v: tracer.external(a, b, k)
        for k, (v, a, b) in enumerate(
          zip(chunk.inputs, values, shadows, strict=True)
        )
      }
      residuals: list[Val] = []
      for position, i in enumerate(chunk.steps):
        step = plan.steps[i]
        ins = [tracer.read(env, x) for x in step.ins]
        outs, res = tracer.forward(position, step, ins)
        env.update(zip(step.outs, outs, strict=True))
        residuals += res
        made.setdefault("residuals", []).append(len(res))
      outs = [env[v] for v in chunk.outputs]
      reduced, order = recorder.groups.results()
      made["template"] = Template(
        recorder.nodes, [o.node for o in outs] + [r.node for r in residuals]
      )
      made["order"] = order
      return (
        [o.value for o in outs],
        [o.shadow for o in outs],
        [r.value for r in residuals],
        [r.shadow for r in residuals],
        reduced,
      )

    values = [self.arrays[v][0] for v in chunk.inputs]
    shadows = [self.arrays[v][1] for v in chunk.inputs]
    found = self._compile(run, made, values, shadows)
    found.template.extra = made["residuals"]
    self._compiled[("forward", chunk.key)] = found
    return found

  # --------------------------------------------------------------- backward

  def backward(self, seeds: dict[int, tuple[Any, Any, int]]) -> dict:
    """Runs the chunks' backward rules in reverse order from the cotangents
    `seeds` (value: (cotangent, its shadow, its node)); returns every
    value's cotangent so found."""
    cts = dict(seeds)
    for c in reversed(range(len(self.chunks))):
      chunk = self.chunks[c]
      given = [v in cts for v in chunk.outputs]
      if not any(given) or all(
        self.plan.steps[i].rule is None for i in chunk.steps
      ):
        continue
      partial = [v in cts for v in chunk.inputs]
      res16, res32, residual_nodes = self._residuals[c]
      outs_ct = [cts.pop(v) for v in chunk.outputs if v in cts]
      ins_ct = [cts.pop(v) for v in chunk.inputs if v in cts]
      values = [list(res16), [o[0] for o in outs_ct], [p[0] for p in ins_ct]]
      shadows = [list(res32), [o[1] for o in outs_ct], [p[1] for p in ins_ct]]
      compiled = self._backward_kind(chunk, given, partial, values, shadows)
      new16, new32, *stats = self._call(compiled, values, shadows)
      if self._preparing:
        mapping = {t: -1 for t in compiled.template.outputs}
      else:
        externals = (
          residual_nodes + [o[2] for o in outs_ct] + [p[2] for p in ins_ct]
        )
        mapping = self._instantiate(compiled, chunk, externals, stats)
      for k, a, b, t in zip(
        compiled.template.extra, new16, new32, compiled.template.outputs,
        strict=True,
      ):  # fmt: skip
        cts[chunk.inputs[k]] = (a, b, mapping[t])
    return cts

  def _backward_kind(
    self,
    chunk: Chunk,
    given: list[bool],
    partial: list[bool],
    values: list[list[Any]],
    shadows: list[list[Any]],
  ) -> _Compiled:
    key = ("backward", chunk.key, tuple(given), tuple(partial))
    found = self._compiled.get(key)
    if found is not None:
      return found
    made: dict[str, Any] = {"key": chunk.key}
    plan = self.plan
    counts = self._compiled[("forward", chunk.key)].template.extra
    starts = np.cumsum([0, *counts])

    def run(values: list[list[Any]], shadows: list[list[Any]]) -> Any:
      recorder = _graph.Recorder()
      tracer = Tracer(recorder)
      n_residuals = len(values[0])
      externals = iter(
        tracer.external(a, b, k, cotangent=k >= n_residuals)
        for k, (a, b) in enumerate(
          zip(
            itertools.chain.from_iterable(values),
            itertools.chain.from_iterable(shadows),
            strict=True,
          )
        )
      )
      residuals = [next(externals) for _ in values[0]]
      env: dict[int, Val] = {}
      for v, g in zip(chunk.outputs, given, strict=True):
        if g:
          env[v] = next(externals)
      for v, p in zip(chunk.inputs, partial, strict=True):
        if p:
          env[v] = next(externals)
      for position in reversed(range(len(chunk.steps))):
        step = plan.steps[chunk.steps[position]]
        if step.rule is not None:
          res = residuals[starts[position] : starts[position + 1]]
          self._step_backward(tracer, env, step, position, res)
      returned = [k for k, v in enumerate(chunk.inputs) if v in env]
      outs = [env[chunk.inputs[k]] for k in returned]
      reduced, order = recorder.groups.results()
      made["template"] = Template(recorder.nodes, [o.node for o in outs])
      made["order"] = order
      made["returned"] = returned
      return (
        [o.value for o in outs],
        [o.shadow for o in outs],
        reduced,
      )

    found = self._compile(run, made, values, shadows)
    found.template.extra = made["returned"]
    self._compiled[key] = found
    return found

  def _step_backward(
    self,
    tracer: Tracer,
    env: dict[int, Val],
    step: Step,
    position: int,
    residuals: list[Val],
  ) -> None:
    """One step's backward rule, its inputs' cotangents added to `env`."""
    assert step.rule is not None
    outs = [env.pop(v, None) for v in step.outs]
    avals = [self.plan.values[v].aval for v in step.outs]
    if all(
      o is None for o, aval in zip(outs, avals, strict=True) if is_float(aval)
    ):
      return
    in_cts = tracer.backward(position, step, residuals, outs, avals)
    for i, ct in zip(step.rule.differentiated, in_cts, strict=True):
      x = step.ins[i]
      before = env.get(x)
      env[x] = ct if before is None else tracer.add(before, ct, step, position)

  # ------------------------------------------------------------------ both

  def _call(self, compiled: _Compiled, *args: Any) -> Any:
    """The chunk's outputs; while preparing, their shapes and dtypes."""
    if self._preparing:
      return compiled.out_info
    return compiled.run(*args)

  def _compile(
    self, run: Callable[..., Any], made: dict[str, Any], *args: Any
  ) -> _Compiled:
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
      lowered = jax.jit(run).lower(*args)
    runs = self._runs.get(made["key"], 1)
    sizes = [n.size for n in made["template"].nodes if n.row is not None]
    reads = runs * sum(sizes) // max(1, len(sizes))
    compiling = self._workers.submit(compile_for_one_run, lowered, reads)
    return _Compiled(
      compiling, lowered.out_info, made["template"], made["order"]
    )

  def _instantiate(
    self,
    compiled: _Compiled,
    chunk: Chunk,
    externals: list[int],
    stats: list[Any],
  ) -> dict[int, int]:
    """The template's nodes, as this chunk's: inputs mapped, rows offset,
    each named by its step."""
    base = self.rows
    mapping: dict[int, int] = {}
    rows = 0
    for template_node in compiled.template.nodes:
      if template_node.kind == _graph.EXTERNAL:
        assert template_node.external is not None
        mapping[template_node.index] = externals[template_node.external]
        continue
      node = copy.copy(template_node)
      node.index = len(self.nodes)
      node.inputs = tuple(mapping[k] for k in template_node.inputs)
      if node.row is not None:
        node.row += base
        rows += 1
      if node.step is not None:
        node.where = self._where_of(chunk, node)
      self.nodes.append(node)
      mapping[template_node.index] = node.index
    (reduced,) = stats
    self.statistics.append((base, reduced, compiled.order))
    self.rows += rows
    return mapping

  def _where_of(self, chunk: Chunk, node: Any) -> _source.Where:
    i = chunk.steps[node.step]
    where = self._where.get(i)
    if where is None:
      step = self.plan.steps[i]
      where = _source.where(
        step.eqn, step.context.calls, boundary=bool(compat.bodies(step.eqn))
      )
      if step.context.scaling:
        where = dataclasses.replace(where, scaling=True)
      self._where[i] = where
    return dataclasses.replace(
      where,
      primitive=node.label,
      boundary=node.label if node.boundary else None,
    )
