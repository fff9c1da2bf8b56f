"""The program the finder measures: `fun`'s arguments split into what is
differentiated (what the framework's own grad differentiates), the other
arrays (inputs, some of them marked as masks) and the rest (held as they
are), and `scale` read."""

import inspect
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_lossscale._access import locate as _locate
from optax_lossscale._diagnostics.finder.primitives import is_float

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def scale_value(scale: Any) -> float:
  """`scale` as a float: a positive finite real number (at most float32's
  largest, the dtype the scale is applied in), or an optimizer state that
  holds one loss scale."""
  if isinstance(scale, bool) or isinstance(scale, str | bytes | complex):
    raise TypeError(_scale_message(scale))
  if isinstance(scale, numbers.Real):
    value = float(scale)
  elif isinstance(scale, jax.Array | np.ndarray | np.generic):
    if np.shape(scale) != () or not np.issubdtype(
      np.asarray(scale).dtype, np.number
    ):
      raise TypeError(_scale_message(scale))
    if np.iscomplexobj(scale):
      raise TypeError(_scale_message(scale))
    value = float(scale)
  elif isinstance(scale, list | tuple | dict | set) and not _has_state(scale):
    raise TypeError(_scale_message(scale))
  else:
    try:
      value = float(_locate.find_loss_scale_state(scale).loss_scale)
    except (TypeError, ValueError) as e:
      raise TypeError(f"{_scale_message(scale)} ({e})") from None
  if not (math.isfinite(value) and 0 < value <= _FLOAT32_MAX):
    raise ValueError(
      f"`scale` must be a positive finite number (at most float32's largest,"
      f" {_FLOAT32_MAX:.4g}), got {scale!r}."
    )
  return value


def _has_state(tree: Any) -> bool:
  try:
    _locate.find_loss_scale_state(tree)
  except (TypeError, ValueError):
    return False
  return True


def _scale_message(scale: Any) -> str:
  return (
    "`scale` must be a positive real number (the loss scale) or an optimizer"
    f" state that holds one loss scale, got {scale!r} of type"
    f" {type(scale).__name__}."
  )


def checked_loss(loss: Any) -> jax.Array:
  """`fun`'s result, refused unless it is a floating-point scalar."""
  if loss is None:
    raise TypeError(
      "`fun` must return the loss, a floating-point scalar; it returned None"
      " (a missing `return`?)."
    )
  if isinstance(loss, tuple | list | dict):
    raise TypeError(
      "`fun` must return the loss alone, a scalar; it returned a"
      f" {type(loss).__name__}. For a function with aux outputs, pass"
      " `lambda *a: fun(*a)[0]`."
    )
  if not isinstance(loss, jax.Array | np.ndarray | np.generic | float | int):
    raise TypeError(
      "`fun` must return the loss, a floating-point scalar; it returned"
      f" {type(loss).__name__}."
    )
  loss = jnp.asarray(loss)
  if not is_float(loss):
    raise TypeError(
      f"`fun` must return a floating-point loss, got dtype {loss.dtype}."
    )
  if loss.shape != ():
    raise ValueError(
      "`fun` must return a scalar loss (the mean over the batch, say), got"
      f" shape {loss.shape}."
    )
  return loss


def is_array(x: Any) -> bool:
  return isinstance(x, jax.Array | np.ndarray)


def _is_float_array(x: Any) -> bool:
  return is_array(x) and is_float(x)


class Program:
  """`fun` as a function of its arrays, `(differentiated, inputs) -> loss`.

  Attributes:
    differentiated: the arrays the gradient is taken with respect to: the
      first argument's float arrays, or, for a Flax NNX module its
      `nnx.Param`s, for an Equinox module its inexact arrays (what
      `nnx.grad` and `eqx.filter_grad` differentiate).
    inputs: every other array, held fixed.
    labels: each differentiated array's and input's name, by `fun`'s
      parameter names (`weights['w']`).
    masks: for each input, whether the user marks it as a mask.
  """

  def __init__(
    self, fun: Callable[..., Any], args: Sequence[Any], masks: Any = ()
  ):
    self._fun = fun
    flat, self._treedef = jax.tree_util.tree_flatten_with_path(tuple(args))
    self._leaves = [leaf for _, leaf in flat]
    wanted = iter(_differentiated_leaves(args[0]))
    self._diff: list[int] = []
    self._input: list[int] = []
    for i, (path, leaf) in enumerate(flat):
      first = path[0] == jax.tree_util.SequenceKey(0)
      if first and next(wanted) and _is_float_array(leaf):
        self._diff.append(i)
      elif is_array(leaf):
        self._input.append(i)
    names = _parameter_names(fun, len(args))
    self.labels = [_label(flat[i][0], names) for i in self._diff + self._input]
    if not self._diff:
      raise TypeError(
        "find_overflow differentiates the loss with respect to `fun`'s first"
        " argument, so that argument must hold floating-point arrays (the"
        f" parameters); got {_describe(args[0])}."
      )
    self.differentiated = [self._leaves[i] for i in self._diff]
    self.inputs = [self._leaves[i] for i in self._input]
    self.masks = _marked(
      masks, self.labels[len(self._diff) :], self.labels[: len(self._diff)]
    )

  def __call__(self, differentiated: list[Any], inputs: list[Any]) -> Any:
    leaves = list(self._leaves)
    for i, value in zip(self._diff, differentiated, strict=True):
      leaves[i] = value
    for i, value in zip(self._input, inputs, strict=True):
      leaves[i] = value
    return checked_loss(
      self._fun(*jax.tree_util.tree_unflatten(self._treedef, leaves))
    )


def _marked(masks: Any, inputs: list[str], params: list[str]) -> list[bool]:
  """For each input label, whether `masks` names it: a parameter of `fun`
  (every array in it) or an input's own label (`batch['mask']`)."""
  if isinstance(masks, str) or not isinstance(masks, tuple | list):
    raise TypeError(
      "`masks` must be a tuple of names of `fun`'s parameters (or of"
      f" inputs in them, as `\"batch['mask']\"`), got {masks!r}."
    )
  marks = [False] * len(inputs)
  for name in masks:
    if not isinstance(name, str):
      raise TypeError(
        f"`masks` must hold names (str), got {name!r} in {masks!r}."
      )
    hits = [i for i, label in enumerate(inputs) if _names(name, label)]
    if not hits:
      what = (
        "a differentiated parameter (never a mask)"
        if any(_names(name, label) for label in params)
        else "no input of `fun`"
      )
      accepted = sorted({_root(label) for label in inputs})
      raise ValueError(
        f"`masks` names {name!r}, {what}; it takes the names of the inputs"
        f" held fixed: {', '.join(accepted) or 'none'} (or of inputs in"
        " them)."
      )
    for i in hits:
      marks[i] = True
  return marks


def _names(name: str, label: str) -> bool:
  return label == name or (label.startswith(name) and label[len(name)] in "[.")


def _root(label: str) -> str:
  for i, char in enumerate(label):
    if char in "[.":
      return label[:i]
  return label


def _differentiated_leaves(first: Any) -> list[bool]:
  """For each leaf of `first`, whether the framework's own grad would
  differentiate it (a float array, checked by the caller)."""
  nnx = _loaded("flax.nnx")
  if nnx is not None:
    variables = jax.tree_util.tree_leaves(
      first, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    if any(isinstance(v, nnx.Variable) for v in variables):
      marks: list[bool] = []
      for v in variables:
        param = isinstance(v, nnx.Param)
        marks += [param] * len(jax.tree_util.tree_leaves(v))
      return marks
  eqx = _loaded("equinox")
  if eqx is not None and isinstance(first, eqx.Module):
    return [bool(eqx.is_inexact_array(leaf)) for leaf in jax.tree.leaves(first)]
  return [True] * len(jax.tree_util.tree_leaves(first))


def _loaded(module: str) -> Any:
  """`module` if the user has imported it (the finder imports no framework
  of its own)."""
  return sys.modules.get(module)


def _parameter_names(fun: Callable[..., Any], count: int) -> list[str]:
  """The name of each of `count` positional arguments of `fun`, by its
  signature (`args[i]` where it says none)."""
  try:
    parameters = list(inspect.signature(fun).parameters.values())
  except (TypeError, ValueError):  # a builtin, say
    parameters = []
  kinds = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
  )
  positional = [p.name for p in parameters if p.kind in kinds]
  rest = [
    p.name for p in parameters if p.kind is inspect.Parameter.VAR_POSITIONAL
  ]
  names = []
  for i in range(count):
    if i < len(positional):
      names.append(positional[i])
    elif rest:
      names.append(f"{rest[0]}[{i - len(positional)}]")
    else:
      names.append(f"args[{i}]")
  return names


def _label(path: Any, names: list[str]) -> str:
  index = path[0].idx
  return names[index] + jax.tree_util.keystr(tuple(path[1:]))


def _describe(x: Any) -> str:
  if is_array(x):
    return f"an array of dtype {x.dtype}"
  leaves = jax.tree.leaves(x)
  if not leaves:
    return f"{type(x).__name__} with no array in it"
  kinds = sorted(
    {str(getattr(leaf, "dtype", type(leaf).__name__)) for leaf in leaves}
  )
  return f"{type(x).__name__} whose leaves are {', '.join(kinds)}"
