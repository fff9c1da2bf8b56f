"""The skip: keep the inner state and zero the updates on non-finite steps.

A select with `jnp.where` on a device boolean: no host round trip, no Python
branch on a traced value, correct under jit, pmap, shard_map, scan and vmap.

Why not simply `where(finite, new_state, old_state)` after the inner update
(`keep_unless`)? Written that way, the inner update's updates are computed
from the *unselected* new state, which is then no output of the step. XLA
fuses that cheap new-state arithmetic into both the updates and the selected
state, so two fusions read every old (donated) state buffer while one of them
overwrites it in place, and XLA's default copy insertion copies every donated
state buffer first, which makes the step several times slower than a plain
adam step on CPU (benchmarks/README.md).

`update_unless` instead selects each new-state value *where it is made*, and
lets everything after it in the inner update (its updates, in particular)
read the selected value. On a finite step the selected value is the new value,
so the updates are the plain inner update's computation (bitwise up to XLA's
fusion choices, which already differ between two jits of the same update); on
a skipped step the updates are discarded (zeros are returned), and the state is
the old one, bit for bit. The step then has the dataflow of the plain optax
step (each old state buffer is read by one fusion, which writes the new state
in place; the updates read the new state), and XLA inserts no copies.

It works on the inner update's jaxpr, so it is general: any optax
transformation, no knowledge of adam. Where a state value cannot be selected
where it is made (a state leaf whose dtype or shape differs from the old
one, a value that fills two state slots, a literal), that leaf falls back to
the select at the end, which is always exact.
"""

import functools
import warnings
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax

from optax_lossscale._core import placement as _placement
from optax_lossscale._jaxpr import compat as _compat
from optax_lossscale._jaxpr import interpret as _interpret


def keep_unless(finite: jax.Array, new: Any, old: Any) -> Any:
  """`new` where `finite`, else `old`, leaf by leaf in `old`'s dtype.

  The cast back matters: `jnp.where` promotes, and a state whose dtypes drift
  retraces the step and breaks checkpoints.
  """
  return jax.tree.map(
    lambda n, o: _select(finite, n, o),
    new,
    old,
  )


def zero_unless(finite: jax.Array, updates: Any) -> Any:
  """`updates` where `finite`, else zeros of the same types."""
  shared = functools.cache(_zeros)  # one per type, not per leaf

  def zeros(u: Any) -> jax.Array:
    # On a mesh with `Auto` axes the type does not say where a leaf lives
    # (it names the `Explicit` axes only): two leaves of one type can be
    # sharded differently, and XLA gave a zeros array shared by both one
    # sharding, which both leaves' outputs then took.
    if _placement.any_axis_is(_placement.mesh_of(u), "Auto"):
      return _zeros(jax.typeof(u))
    return shared(jax.typeof(u))

  return jax.tree.map(lambda u: _select(finite, u, zeros(u)), updates)


def _zeros(aval: Any) -> jax.Array:
  """Zeros of `aval`'s shape and dtype, sharded as it is on an `Explicit`
  mesh (a select needs both cases sharded alike); elsewhere XLA places
  them."""
  return jnp.zeros(
    aval.shape, aval.dtype, out_sharding=_explicit_sharding(aval)
  )


def _explicit_sharding(aval: Any) -> Any:
  """The sharding in `aval` where it is an `Explicit` mesh's, else None:
  elsewhere XLA places the value."""
  sharding = getattr(aval, "sharding", None)
  if _placement.any_axis_is(getattr(sharding, "mesh", None), "Explicit"):
    return sharding
  return None


def _select(finite: jax.Array, n: Any, o: Any) -> Any:
  if _same_array_type(n, o):
    # What `jnp.where` computes, bound directly: a step selects every leaf
    # of its state and updates, and `jnp.where` traces a call of its own for
    # each. The flag is broadcast as `jnp.where` broadcasts it (XLA on CPU
    # ran a select with a scalar flag slower), sharded as the leaf on an
    # `Explicit` mesh.
    flag = lax.broadcast_in_dim(
      finite, jnp.shape(o), (), out_sharding=_explicit_sharding(jax.typeof(o))
    )
    return lax.select(flag, n, o)
  selected = jnp.where(finite, n, o)
  if jax.dtypes.issubdtype(jnp.result_type(o), jax.dtypes.extended):
    # Typed PRNG keys (optax.noisy_sgd's state): no `astype`, and `where`
    # keeps their dtype.
    return selected
  if jax.typeof(selected) == jax.typeof(o):
    return selected  # a weakly typed leaf stays weak: no retrace
  return selected.astype(jnp.result_type(o))


def _same_array_type(n: Any, o: Any) -> bool:
  """Whether `n` and `o` are arrays of one type (shape, dtype, weak type and
  sharding): `lax.select_n` then needs no promotion or broadcast."""
  if not (isinstance(n, jax.Array) and isinstance(o, jax.Array)):
    return False
  n_type, o_type = jax.typeof(n), jax.typeof(o)
  return n_type == o_type and not jax.dtypes.issubdtype(
    o_type.dtype, jax.dtypes.extended
  )


def update_unless(
  finite: jax.Array,
  update: Callable[[Any], tuple[Any, Any]],
  old_state: Any,
  *,
  rewrite: bool = True,
) -> tuple[Any, Any]:
  """Runs `update(old_state) -> (updates, new_state)`, skipped unless `finite`.

  Returns `(updates, state)`: on a finite step what `update` computes;
  otherwise zero updates (each in its own dtype) and `old_state`, bit for bit.

  With `rewrite=True` (the default) the selection of each new-state value is
  moved to where the value is made (see the module docstring); with
  `rewrite=False` it is the plain `where` after the update.
  """
  if not rewrite or not _traced(finite, old_state):
    # Eagerly, every op runs on its own: nothing to gain, and re-binding the
    # update's inlined calls one op at a time could round differently from
    # the inner update's own eager run.
    return _select_after(finite, update, old_state)

  old_leaves, state_def = jax.tree.flatten(old_state)
  closed, out_shape = jax.make_jaxpr(
    lambda *leaves: update(jax.tree.unflatten(state_def, list(leaves))),
    return_shape=True,
  )(*old_leaves)
  out_leaves_shape, out_def = jax.tree.flatten(out_shape)
  updates_shape, new_state_shape = jax.tree.unflatten(
    out_def, list(range(len(out_leaves_shape)))
  )
  update_slots = jax.tree.leaves(updates_shape)
  state_slots = jax.tree.leaves(new_state_shape)
  # Annotated: jax's own annotation of the structure's type does not resolve.
  new_state_def: jax.tree_util.PyTreeDef = jax.tree.structure(new_state_shape)
  if new_state_def != state_def:
    raise _structure_changed(old_state, new_state_shape)

  jaxpr = closed.jaxpr
  # Which jaxpr outputs are state leaves, and which old value each keeps.
  select_at = {}  # Var -> old leaf value, for vars selected where made
  count: dict[_compat.Var, int] = {}
  for slot in state_slots:
    v = jaxpr.outvars[slot]
    if isinstance(v, _compat.Var):
      count[v] = count.get(v, 0) + 1
  passed_through = set(jaxpr.invars) | set(jaxpr.constvars)
  for slot, old in zip(state_slots, old_leaves, strict=True):
    v = jaxpr.outvars[slot]
    if (
      isinstance(v, _compat.Var)
      and count[v] == 1
      and v not in passed_through
      # A state leaf's var is an array's: its `aval` (typed as the
      # `AbstractValue` base) is a `ShapedArray`.
      and cast("jax.core.ShapedArray", v.aval).shape == jnp.shape(old)
      and cast("jax.core.ShapedArray", v.aval).dtype == jnp.result_type(old)
    ):
      select_at[v] = old

  try:
    outs = _interpret.evaluate(
      jaxpr, closed.consts, old_leaves, _SelectWhereMade(finite, select_at)
    )
  except Exception as e:  # any failure to re-bind: the plain select
    # A primitive that cannot be re-bound from its jaxpr equation (none in
    # optax is known): the plain select is always exact, but slower, so it
    # is said once. Errors of the inner update itself were raised by
    # `make_jaxpr` above, not hidden here.
    _warn_fallback(e)
    return _select_after(finite, update, old_state)
  updates = [outs[i] for i in update_slots]
  new_leaves = []
  for slot, old in zip(state_slots, old_leaves, strict=True):
    v = jaxpr.outvars[slot]
    if isinstance(v, _compat.Var) and v in select_at:
      new_leaves.append(outs[slot])  # already selected where made
    else:
      new_leaves.append(_select(finite, outs[slot], old))
  updates = jax.tree.unflatten(jax.tree.structure(updates_shape), updates)
  return (
    zero_unless(finite, updates),
    jax.tree.unflatten(state_def, new_leaves),
  )


def _select_after(
  finite: jax.Array,
  update: Callable[[Any], tuple[Any, Any]],
  old_state: Any,
) -> tuple[Any, Any]:
  """The plain skip: run `update`, then select; always exact."""
  updates, new_state = update(old_state)
  new_state_def: jax.tree_util.PyTreeDef = jax.tree.structure(new_state)
  if new_state_def != jax.tree.structure(old_state):
    raise _structure_changed(old_state, new_state)
  return zero_unless(finite, updates), keep_unless(finite, new_state, old_state)


def _structure_changed(old_state: Any, new_state: Any) -> ValueError:
  """The error for an inner update whose state changes structure."""
  old_paths = {
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(old_state)[0]
  }
  new_paths = {
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(new_state)[0]
  }
  differing = sorted(old_paths ^ new_paths)[:3] or ["(the node types)"]
  return ValueError(
    "The inner transformation's `update` returned a state whose structure"
    " differs from the state it was given, at inner_state"
    f" {', inner_state'.join(differing)}. A skipped step keeps the old"
    " state, so the state must keep one structure from `init` on (for"
    " example, `optax.monitor` does not). Wrap only transformations whose"
    " `update` returns a state shaped like their `init`'s."
  )


_FALLBACK_REASONS_SAID: set[str] = set()


def _warn_fallback(error: Exception) -> None:
  reason = f"{type(error).__name__}: {error}".splitlines()[0][:300]
  if reason in _FALLBACK_REASONS_SAID:
    return
  _FALLBACK_REASONS_SAID.add(reason)
  warnings.warn(
    "optax_lossscale could not select the inner state where the inner"
    f" update makes it ({reason}); this step takes the plain select after"
    " the update instead, which is exact but copies the optimizer state."
    " Please report this with your jax and optax versions.",
    RuntimeWarning,
    stacklevel=4,
  )


def _traced(*trees: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


class _SelectWhereMade:
  """The rewrite's visitor: each var in `select_at` is replaced by the select
  of its value (on a finite step) and its old state value (otherwise), where
  it is made. Selections wanted on a call's outputs are pushed into the
  call's body, so that the rest of the body reads the selected value too."""

  def __init__(self, finite: jax.Array, select_at: dict[Any, Any]):
    self._finite = finite
    self._select_at = select_at
    self._pushed: dict[Any, set[Any]] = {}  # call eqn -> its outvars pushed

  def enter(self, eqn: Any, body: Any) -> "_SelectWhereMade":
    inner_select = {}
    pushed = set()
    for outer_v, inner_v, ok in zip(
      eqn.outvars,
      body.jaxpr.outvars,
      _interpret.produced_inside(body),
      strict=True,
    ):
      if ok and _wanted(outer_v, self._select_at):
        inner_select[inner_v] = self._select_at[outer_v]
        pushed.add(outer_v)
    self._pushed[id(eqn)] = pushed
    return _SelectWhereMade(self._finite, inner_select)

  def produced(self, eqn: Any, values: list[Any]) -> list[Any]:
    pushed = self._pushed.pop(id(eqn), set())
    return [
      _select(self._finite, val, self._select_at[v])
      if _wanted(v, self._select_at) and v not in pushed
      else val
      for v, val in zip(eqn.outvars, values, strict=True)
    ]


def _wanted(v: Any, select_at: dict[Any, Any]) -> bool:
  return isinstance(v, _compat.Var) and v in select_at
