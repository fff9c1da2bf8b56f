"""The nodes: every value the gradient program makes, with the nodes it was
made from and what is known of it while tracing (its pass, where it is in
the code); each floating-point value an operation makes is measured
against its float32 shadow (`statistics`) where it is made."""

import dataclasses
from typing import Any

import numpy as np

from optax_lossscale._diagnostics.finder import source as _source
from optax_lossscale._diagnostics.finder import statistics as _statistics

# What a node is.
PARAMETER = "parameter"  # differentiated
INPUT = "input"  # an array argument held fixed
MASK_INPUT = "mask input"  # one the user marks as a mask (`masks=`)
CONSTANT = "constant"  # an array the program closes over
LITERAL = "literal"  # a number written in the program
SCALE = "scale"  # the loss scale
SEED = "seed"  # the cotangent the backward pass starts from
OPERATION = "operation"
EXTERNAL = "external"  # in a chunk's template: a value made outside it

# What an operation is part of.
FORWARD = "forward"  # the equation itself, computing what the loss needs
DERIVATIVE = "derivative"  # its forward rule's own values (jax's residuals)
BACKWARD = "backward"  # its backward rule: its inputs' cotangents
SCALING = "loss scaling"  # the finder's `loss * scale`, and its cotangent


@dataclasses.dataclass
class Node:
  """A value of the program (an operation's output, an argument, a
  constant) and what is known of it while tracing."""

  index: int  # in program order
  kind: str
  label: str  # an argument's name; an operation's primitive's
  inputs: tuple[int, ...] = ()  # the nodes it was made from
  where: _source.Where | None = None  # the equation it belongs to
  role: str = FORWARD
  owner: str | None = None  # the primitive of the equation it belongs to
  dtype: str | None = None  # a floating-point value's, else None
  shape: tuple[int, ...] = ()
  row: int | None = None  # its row of statistics, when measured
  layout: bool = False  # only rearranges its inputs' elements
  picker: bool = False  # picks some of its inputs' elements
  flush_checked: bool = False  # its code has FLUSHED
  reference: bool = True  # its shadow is a float32 reference
  static: bool = False  # computed from constants and literals alone
  from_cotangent: bool = False  # computed from the backward's seed
  recomputed: bool = False  # a derivative jax computes under `remat`
  custom_rule: str | None = None  # the function whose custom rule made it
  host_call: str | None = None  # the callback or FFI target that made it
  value: np.ndarray | None = None  # a literal's
  primitive: Any = None  # an operation's, the object (names change)
  boundary: bool = False  # an operation holding a body it runs whole
  step: int | None = None  # in a chunk's template: the step it belongs to
  external: int | None = None  # an EXTERNAL node's place among the inputs

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))


class Recorder:
  """The nodes, in program order, and their measurements."""

  def __init__(self) -> None:
    self.nodes: list[Node] = []
    self.groups = _statistics.Groups()

  def add(self, kind: str, **fields: Any) -> Node:
    node = Node(len(self.nodes), kind, **fields)
    self.nodes.append(node)
    return node

  def measure(
    self,
    node: Node,
    value: Any,
    shadow: Any,
    inputs: list[Any] | None = None,
    reference: Any = None,
  ) -> None:
    """Records `value`'s comparison with `shadow` as `node`'s."""
    node.dtype = str(value.dtype)
    node.shape = tuple(value.shape)
    node.flush_checked = reference is not None
    node.row = self.groups.add(
      _statistics.Value(
        value, shadow, tuple(inputs) if inputs else None, reference
      )
    )
