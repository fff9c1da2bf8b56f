"""Writes docs/errors.md by running its examples: python docs/_errors.py

Each case is a short title and the code that triggers an error (or, in the
last section, pins a behaviour). The code runs statement by statement in one
namespace, in page order, as `doctest` runs the page; what each statement
prints, and the exception it raises, is written into the page as a `pycon`
block. `tests/test_errors_page.py` renders the page again and compares it
with the committed one, and `tests/test_doc_outputs.py` runs its blocks as
doctests, so a changed message or error type fails a test.

In the error sections every expression statement must raise and every other
statement (assignments, imports) must not; in the pinned section nothing may
raise. Exception messages are wrapped to the page's width; doctest compares
them with NORMALIZE_WHITESPACE, and memory addresses are written `0x...`
(ELLIPSIS).
"""

import ast
import contextlib
import io
import pathlib
import re
import sys
import textwrap
import traceback
from typing import NamedTuple

PAGE = pathlib.Path(__file__).resolve().parent / "errors.md"
WIDTH = 79


class Case(NamedTuple):
  title: str
  code: str
  prose: str = ""


class Section(NamedTuple):
  title: str
  prose: str
  cases: list[Case]
  raises: bool = True


SETUP = """\
import jax, jax.numpy as jnp, numpy as np, optax
import optax_lossscale as ols
params = {"a": jnp.ones(3), "b": jnp.ones(2)}
sgd = optax.sgd(0.1)
"""

INTRO = """\
# Errors raised by optax_lossscale

Every error that a bad argument or a misuse raises, with its message as the
library raises it. Configuration errors are raised when the transformation is
built (`loss_scale_optimizer(...)`, `unscale_and_check(...)`), before
anything is traced, so an invalid configuration never reaches `jit`.
Non-finite gradients are not errors: such steps are skipped and counted (see
`skip_stats`).

This page is generated: `python docs/_errors.py` runs every example below
and writes the page with what it printed and raised.
`tests/test_errors_page.py` runs them again and fails when a message or an
error type differs from the page, and `tests/test_doc_outputs.py` runs the
page's blocks as doctests, in order, after this set-up:
"""


def _lso(arguments: str) -> str:
  return f"ols.loss_scale_optimizer(sgd, {arguments})"


def _calls(*arguments: str) -> str:
  """One call per argument string; a `  # comment` goes after the call."""
  lines = []
  for a in arguments:
    a, _, comment = a.partition("  # ")
    lines.append(_lso(a) + (f"  # {comment}" if comment else "") + "\n")
  return "".join(lines)


CONSTRUCTOR = Section(
  "Constructor arguments",
  "`loss_scale_optimizer` and `unscale_and_check` take the same arguments"
  " (except `inner`) and check them the same way: a `TypeError` for a value"
  " of the wrong type, a `ValueError` for one out of range. Numbers may be"
  " Python or NumPy scalars (0-d arrays included), but not bools.",
  [
    Case(
      "`inner`: an optax transformation, not yet loss-scaled",
      "ols.loss_scale_optimizer(None)\n"
      'ols.loss_scale_optimizer("adam")\n'
      "ols.loss_scale_optimizer(optax.adam)  # the factory, not a"
      " transformation\n"
      "ols.loss_scale_optimizer(ols.loss_scale_optimizer(sgd))\n"
      "ols.loss_scale_optimizer(\n"
      "  optax.chain(ols.unscale_and_check(), sgd)\n"
      ").init(params)  # found at init\n",
    ),
    Case(
      "`dynamic`: a bool",
      _calls(
        'dynamic="yes"',
        "dynamic=1",
        "dynamic=None",
        "dynamic=np.bool_(True)",
        "dynamic=False  # a static scale needs `initial_scale`",
        "dynamic=False, initial_scale=8.0, dynamic_growth_steps=10",
      ),
    ),
    Case(
      "`initial_scale`: a normal float32 (2**-126 to float32 max), between"
      " `min_scale` and `max_scale`",
      _calls(
        'initial_scale="1024"',
        "initial_scale=True",
        "initial_scale=1 + 0j",
        "initial_scale=np.ones(2)",
        "initial_scale=0",
        "initial_scale=-1",
        'initial_scale=float("nan")',
        'initial_scale=float("inf")',
        "initial_scale=1e39  # overflows float32",
        "initial_scale=1e-46  # underflows float32 to 0",
        "initial_scale=1e-40, min_scale=1e-40  # a float32 subnormal",
        "initial_scale=0.5  # below min_scale=1",
        "initial_scale=2.0**20, max_scale=2.0**16",
      ),
    ),
    Case(
      "`dynamic_growth_steps`: an int from 1 to 2**31 - 1",
      _calls(
        "dynamic_growth_steps=0",
        "dynamic_growth_steps=-5",
        "dynamic_growth_steps=2**31",
        "dynamic_growth_steps=10.0",
        'dynamic_growth_steps=float("nan")',
        'dynamic_growth_steps=float("inf")',
        "dynamic_growth_steps=True",
        'dynamic_growth_steps="10"',
      ),
    ),
    Case(
      "`growth_factor`: > 1 and finite in float32",
      _calls(
        "growth_factor=1.0",
        "growth_factor=1.00000001  # 1.0 in float32",
        "growth_factor=1e39  # inf in float32",
        "growth_factor=0.5",
        'growth_factor=float("nan")',
        'growth_factor=float("inf")',
        'growth_factor="2"',
        "growth_factor=None",
      ),
    ),
    Case(
      "`backoff_factor`: in the open interval (0, 1) in float32",
      _calls(
        "backoff_factor=1.0",
        "backoff_factor=0.99999999  # 1.0 in float32",
        "backoff_factor=0",
        "backoff_factor=-0.5",
        "backoff_factor=2.0",
        'backoff_factor=float("nan")',
        'backoff_factor=float("inf")',
        "backoff_factor=None",
      ),
    ),
    Case(
      "`min_scale`: a normal float32 (2**-126 to float32 max), at most"
      " `initial_scale`",
      _calls(
        "min_scale=0",
        "min_scale=-1",
        'min_scale=float("nan")',
        'min_scale=float("inf")',
        "min_scale=None",
        "min_scale=1e-40  # a float32 subnormal: 0 on CPU",
        "min_scale=2.0**16  # above initial_scale=2**15",
      ),
    ),
    Case(
      "`max_scale`: a normal float32 (2**-126 to float32 max), at least"
      " `initial_scale`",
      _calls(
        "max_scale=0",
        'max_scale=float("nan")',
        'max_scale=float("inf")',
        "max_scale=1e39  # overflows float32",
        'max_scale="big"',
        "max_scale=1024  # below initial_scale=2**15",
      ),
    ),
    Case(
      "`hysteresis`: an int from 1 to 2**31 - 1",
      _calls(
        "hysteresis=0",
        "hysteresis=-1",
        "hysteresis=2**31",
        "hysteresis=1.5",
        'hysteresis=float("nan")',
        "hysteresis=True",
      ),
    ),
    Case(
      "`axis_name`: None, a name, or a tuple of names",
      _calls(
        "axis_name=3.5",
        "axis_name=()",
        'axis_name=("batch", None)',
        "axis_name=True",
        'axis_name=["batch"]  # a list',
      ),
    ),
    Case(
      "`unscale_and_check` checks the same way",
      "ols.unscale_and_check(hysteresis=0)\n"
      'ols.unscale_and_check(initial_scale=float("nan"))\n',
    ),
  ],
)

AUTOCAST = Section(
  "autocast's arguments",
  "`autocast` checks its arguments when it is called, before `fun` is"
  " traced: a `TypeError` for a value of the wrong type, a `ValueError` for"
  " one it does not accept.",
  [
    Case(
      "`fun`: the function to run under the policy",
      'ols.autocast(None)\nols.autocast("loss")\n',
    ),
    Case(
      "`dtype`: float16 or bfloat16",
      "ols.autocast(jnp.sum, jnp.float32)\n"
      'ols.autocast(jnp.sum, "float64")\n'
      "ols.autocast(jnp.sum, None)\n",
      "Any spelling of the two is accepted: `jnp.float16`, `np.float16`,"
      ' `"float16"`, `np.dtype("float16")`, and the same for bfloat16.',
    ),
    Case(
      "`keep_float32`: a sequence of name scopes or call-path names",
      'ols.autocast(jnp.sum, keep_float32="attention")\n'
      "ols.autocast(jnp.sum, keep_float32=3)\n"
      'ols.autocast(jnp.sum, keep_float32=("attention", 3))\n'
      'ols.autocast(jnp.sum, keep_float32=("decoder//attention",))\n',
    ),
    Case(
      "`mixed`: 'promote' or 'cast'",
      'ols.autocast(jnp.sum, mixed="widest")\n',
    ),
  ],
)

MISUSE = Section(
  "Misuse",
  "Errors of `update`, `scale_loss`, the read-outs and the helpers. Those of"
  " `update` and `scale_loss` are raised while tracing: under `jax.jit`"
  " they are raised by the first call, before anything is computed.",
  [
    Case(
      "Gradients that do not match the parameters",
      "tx = ols.loss_scale_optimizer(optax.adam(1e-3))\n"
      'tx.update({"a": jnp.ones(3)}, tx.init(params), params)\n'
      "tx = ols.loss_scale_optimizer(sgd)\n"
      'tx.update({"a": jnp.ones(3)}, tx.init(params), params)\n',
      "When `params` are given, `update` checks the gradient tree against"
      " them, whether or not the inner transformation reads them (`sgd`"
      " does not).",
    ),
    Case(
      "Another optimizer's state passed to `update`",
      "tx = ols.loss_scale_optimizer(optax.adam(1e-3))\n"
      "tx.update(params, optax.adam(1e-3).init(params), params)\n",
    ),
    Case(
      "No loss-scale state where one is looked for",
      "ols.scale_loss(jnp.float32(1.0), optax.adam(1e-3).init(params))\n"
      "ols.scale_loss(jnp.float32(1.0), params)\n"
      "ols.loss_scale(sgd.init(params))\n",
    ),
    Case(
      "Two loss scalers in one state",
      "state = optax.chain(\n"
      "  ols.unscale_and_check(), ols.unscale_and_check()\n"
      ").init(params)\n"
      "ols.scale_loss(jnp.float32(1.0), state)\n",
    ),
    Case(
      "A state made under `jax.vmap`, used outside it",
      "tx = ols.loss_scale_optimizer(sgd)\n"
      "states = jax.vmap(tx.init)(jnp.ones((4, 3)))\n"
      "ols.scale_loss(jnp.float32(1.0), states)\n",
    ),
    Case(
      "An integer loss",
      "opt_state = ols.loss_scale_optimizer(sgd).init(params)\n"
      "ols.scale_loss(jnp.int32(3), opt_state)\n",
    ),
    Case(
      "`set_loss_scale` with a value that is no scale",
      'ols.set_loss_scale(opt_state, float("nan"))\n'
      "ols.set_loss_scale(opt_state, 0.0)\n"
      "ols.set_loss_scale(opt_state, 1e39)\n"
      "ols.set_loss_scale(opt_state, 1e-40)  # a float32 subnormal\n"
      "ols.set_loss_scale(opt_state, jnp.ones(2))\n"
      'ols.set_loss_scale(opt_state, "8")\n'
      "ols.set_loss_scale(opt_state, True)\n"
      "ols.set_loss_scale(opt_state, 0.5)  # below the floor, min_scale=1\n"
      "static = ols.loss_scale_optimizer(\n"
      "  sgd, dynamic=False, initial_scale=8.0\n"
      ").init(params)\n"
      "ols.set_loss_scale(static, 0.5)\n",
    ),
    Case(
      "A state of the other mode, or of another `leaf_stats`",
      "dynamic = ols.loss_scale_optimizer(sgd)\n"
      "static = ols.loss_scale_optimizer(\n"
      "  sgd, dynamic=False, initial_scale=8.0\n"
      ")\n"
      "dynamic.update(params, static.init(params), params)\n"
      "counted = ols.loss_scale_optimizer(sgd, leaf_stats=True)\n"
      "counted.update(params, dynamic.init(params), params)\n",
      "The state must come from a transformation of the same mode and the"
      " same `leaf_stats`: carry a scale over with `set_loss_scale`.",
    ),
    Case(
      "A `value` that is not a real scalar",
      "tx = ols.loss_scale_optimizer(sgd)\n"
      "tx.update(params, tx.init(params), params, value=jnp.ones(2))\n"
      'tx.update(params, tx.init(params), params, value="nan")\n',
    ),
    Case(
      "A report of a state by a transformation that did not make it",
      "state = ols.loss_scale_optimizer(sgd).init(params)\n"
      'ols.skip_report(state, "sgd")\n'
      "counted = ols.loss_scale_optimizer(sgd, leaf_stats=True)\n"
      "ols.skip_report(state, counted)\n"
      "higher = ols.loss_scale_optimizer(sgd, min_scale=2.0, hysteresis=2)\n"
      "ols.raise_if_stuck(state, higher)\n"
      "ols.raise_if_stuck(state, max_skips_at_floor=0)\n",
      "The report reads the configuration the state recorded; a `tx` is"
      " checked against it, and need not be given. Called inside `jit`,"
      " both raise a `TypeError` that says to call them outside the jitted"
      " step, on the state it returns.",
    ),
    Case(
      "A checkpoint of an earlier release that cannot be read as given",
      "tx = ols.loss_scale_optimizer(sgd)\n"
      "old = {  # a 0.1.0 state, as msgpack_restore returns it\n"
      '  "loss_scale_state": {\n'
      '    "loss_scale": 8.0, "counter": 0, "notfinite_count": 1,\n'
      '    "total_notfinite": 3, "last_finite": False},\n'
      '  "inner_state": {"0": {}, "1": {}}}\n'
      "ols.upgrade_state(old)\n"
      "ols.upgrade_state(old, like=tx.init(params))  # sgd keeps no count\n"
      "ols.upgrade_state(old, like=tx.init(params), steps=2)\n"
      "ols.upgrade_state(old, like=tx.init(params), steps=True)\n"
      'old["inner_state"]["0"] = {"count": 40, "mu": params, "nu": params}\n'
      "ols.upgrade_state(old, like=tx.init(params))  # an adam state\n",
    ),
    Case(
      "`value_and_grad` options",
      'loss_fn = lambda p: jnp.sum(p["a"])\n'
      "ols.value_and_grad(loss_fn, has_aux=1)\n"
      'ols.value_and_grad(loss_fn, grad_fn="jax")\n',
    ),
    Case(
      "`find_overflow`'s arguments",
      "def biased(w, bias):\n"
      "  return jnp.sum(jnp.exp(w.astype(jnp.float16) + bias))\n"
      "w, bias = jnp.ones(2), jnp.zeros(2, jnp.float16)\n"
      "ols.find_overflow(biased, w, bias, scale=0.0)\n"
      "ols.find_overflow(biased, w, bias, scale=sgd.init(w))\n"
      'ols.find_overflow(biased, w, bias, masks="bias")  # a tuple of names\n'
      'ols.find_overflow(biased, w, bias, masks=("w",))  # differentiated\n'
      'ols.find_overflow(biased, w, bias, masks=("mask",))\n',
      "`masks` names the inputs held fixed whose infs are masks on purpose:"
      " `fun`'s parameters (every array in them), or inputs in them"
      " (`\"batch['mask']\"`).",
    ),
    Case(
      "Keras configs",
      'typo = {"dynamic": True, "initial_scal": 1024.0}\n'
      "ols.from_keras_config(typo, sgd)\n"
      'ols.from_keras_config({"loss_scale": "big"}, sgd)\n'
      'dynamic = {"class_name": "DynamicLossScale", "config": {}}\n'
      'dynamic["config"]["multiplier"] = 1e308  # inf in float32\n'
      'ols.from_keras_config({"loss_scale": dynamic}, sgd)\n'
      "ols.to_keras_config(optax.adam(1e-3))\n"
      "ols.to_keras_config(" + _lso("hysteresis=2") + ")\n",
    ),
  ],
)

PINNED = Section(
  "Behaviour pinned without an error",
  "Inputs that could be mistaken for errors, and what they do instead.",
  [
    Case(
      "Integer gradient leaves",
      "tx = ols.loss_scale_optimizer(optax.sgd(0.5), initial_scale=4.0)\n"
      'mixed = {"w": jnp.ones(2), "n": jnp.array([3, 5], jnp.int32)}\n'
      'grads = {"w": jnp.full(2, 4.0), "n": jnp.array([8, 8], jnp.int32)}\n'
      "updates, state = tx.update(grads, tx.init(mixed), mixed)\n"
      'updates["w"].tolist(), updates["n"].tolist()  # only w divided by 4\n'
      "bool(ols.skip_stats(state).last_finite)\n"
      'grads["w"] = jnp.array([jnp.nan, 1.0])\n'
      "updates, state = tx.update(grads, tx.init(mixed), mixed)\n"
      'updates["n"].tolist(), bool(ols.skip_stats(state).last_finite)\n'
      "bool(ols.all_finite(jnp.array([1, 2], jnp.int32)))\n",
      "They carry no scaled gradient: they are passed to the inner"
      " transformation unscaled and never make a step non-finite; on a"
      " skipped step their updates are zeros like every other leaf's."
      " `all_finite` counts them finite.",
    ),
    Case(
      "Complex gradients",
      "tx = ols.loss_scale_optimizer(optax.sgd(1.0), initial_scale=4.0)\n"
      "z = jnp.array([1 + 1j, 2 - 2j], jnp.complex64)\n"
      "grads = jnp.array([4 + 8j, 4 - 4j], jnp.complex64)\n"
      "updates, state = tx.update(grads, tx.init(z), z)\n"
      "updates.dtype, updates.tolist()\n"
      'grads = jnp.array([complex(0, float("inf")), 4], jnp.complex64)\n'
      "updates, state = tx.update(grads, tx.init(z), z)\n"
      "updates.tolist(), bool(ols.skip_stats(state).last_finite)\n",
      "They are divided by the scale, their dtype kept; a NaN or an inf in"
      " either the real or the imaginary part makes the step non-finite.",
    ),
  ],
  raises=False,
)

SECTIONS = [CONSTRUCTOR, AUTOCAST, MISUSE, PINNED]


def _statements(code: str) -> list[str]:
  """The code's top-level statements, each with its whole lines (so that a
  trailing comment stays with its statement)."""
  lines = code.splitlines()
  body = ast.parse(code).body
  covered = {n for s in body for n in range(s.lineno, s.end_lineno + 1)}
  stray = [line for i, line in enumerate(lines, 1) if i not in covered and line]
  assert not stray, f"lines outside any statement: {stray}"
  return ["\n".join(lines[s.lineno - 1 : s.end_lineno]) for s in body]


def _prompted(source: str) -> str:
  first, *rest = source.splitlines()
  return "\n".join([f">>> {first}", *(f"... {line}" for line in rest)])


def _exception_text(e: BaseException) -> str:
  """What doctest compares: the last line `format_exception_only` gives."""
  formatted = traceback.format_exception_only(type(e), e)
  assert len(formatted) == 1, (
    f"{formatted}: an exception with notes (jax adds them to errors raised"
    " under jit) reads differently in doctest; trigger it outside jit"
  )
  text = re.sub(r" at 0x[0-9a-f]+", " at 0x...", formatted[0].strip())
  wrapped = textwrap.fill(
    " ".join(text.split()),
    WIDTH,
    break_long_words=False,
    break_on_hyphens=False,
  )
  assert not any(
    line.startswith(("...", ">>>")) for line in wrapped.splitlines()
  ), wrapped
  return "\n".join(["Traceback (most recent call last):", "...", wrapped])


def run_case(case: Case, namespace: dict, raises: bool) -> str:
  """Runs `case` in `namespace` and returns its `pycon` transcript."""
  out = []
  for source in _statements(case.code):
    is_expression = isinstance(ast.parse(source).body[0], ast.Expr)
    printed = io.StringIO()
    error = None
    with contextlib.redirect_stdout(printed):
      try:
        # Mode "single", as doctest: an expression's value is displayed.
        exec(compile(source + "\n", "<errors.md>", "single"), namespace)
      except Exception as e:
        error = e
    where = f"{case.title!r}: {source!r}"
    if raises and is_expression:
      assert error is not None, f"{where} raised nothing"
    else:
      assert error is None, f"{where} raised {error!r}"
    out.append(_prompted(source))
    if printed.getvalue():
      out.append(printed.getvalue().rstrip("\n"))
    if error is not None:
      out.append(_exception_text(error))
  return "\n".join(out)


def _pycon(text: str) -> list[str]:
  return ["```pycon", text, "```", ""]


def render() -> str:
  """Runs every case, in page order, and returns the page."""
  namespace: dict = {"__name__": "errors_md"}
  lines = [INTRO]
  lines += _pycon(run_case(Case("set-up", SETUP), namespace, raises=False))
  for section in SECTIONS:
    lines += [f"## {section.title}", "", textwrap.fill(section.prose), ""]
    for case in section.cases:
      lines += [f"### {case.title}", ""]
      if case.prose:
        lines += [textwrap.fill(case.prose), ""]
      lines += _pycon(run_case(case, namespace, section.raises))
  return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
  PAGE.write_text(render())
  print(f"wrote {PAGE}", file=sys.stderr)
