"""Sphinx configuration for the optax_lossscale documentation site.

Build (warnings are errors; `.ci/run` runs the same into a temporary folder):
  python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import dataclasses
import importlib
import inspect
import pathlib
import re
import sys

import jax
from docutils import nodes

_ROOT = pathlib.Path(__file__).resolve().parents[1]
# The checkout's package, whichever one is installed: autodoc imports it.
sys.path.insert(0, str(_ROOT))

import optax_lossscale  # noqa: E402 (after the sys.path line)

project = "optax_lossscale"
author = "the optax_lossscale authors"
copyright = "the optax_lossscale authors"
version = release = getattr(optax_lossscale, "__version__", "")

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

# MyST: `{eval-rst}` and `{autofunction}` blocks in api.md; `#` anchors for
# headings, so that `[x](composition.md#some-heading)` resolves.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Links from a page to files outside docs/ (`../README.md`,
# `../benchmarks/README.md`, `../examples/`) are right on GitHub, where the
# pages are read too, but the site has no such page. MyST turns them into
# their plain text and warns; the warning is silenced for exactly the
# Markdown files and top-level folders that exist outside docs/ (a typo still
# fails the build). Other files (`../examples/x.py`, images) need nothing:
# MyST makes them downloads. The silencing goes through `nitpick_ignore_regex`,
# which MyST consults whether or not `nitpicky` is on.
_TOP_DIRS = [
  p.name
  for p in _ROOT.iterdir()
  if p.is_dir() and p.name != "docs" and not p.name.startswith(".")
]
_OUT_OF_TREE_MD = [
  p.with_suffix("")
  for pattern in ["*.md", *(f"{d}/*.md" for d in _TOP_DIRS)]
  for p in _ROOT.glob(pattern)
]
nitpick_ignore_regex = [
  ("myst", re.escape(str(p))) for p in _OUT_OF_TREE_MD
] + [("myst", rf"\.\./{re.escape(d)}/?") for d in _TOP_DIRS]

# API reference: Google-style docstrings, members in source order, the
# signature's annotations written out in the description, not the signature,
# and only for what the docstring documents (a NamedTuple's fields are
# documented once, as attributes, not again as constructor parameters).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_typehints_format = "short"
# `optax_lossscale.LossScaleState` in a type reads `LossScaleState`.
python_use_unqualified_type_names = True
# A heading reads `class SkipReport`, not the private module that defines
# it (the returned types are documented from there: they are not exported).
add_module_names = False

# Cross-references the docstrings make to optax, jax and numpy names cannot
# resolve without intersphinx (no network in CI), so they are not checked.
nitpicky = False

# Fences without a language are program output or shell commands (the
# included benchmarks/README.md and notebooks/RESULTS.md have many), not
# Python: Sphinx's default would colour them as Python.
highlight_language = "text"

html_theme = "furo"
html_title = f"optax_lossscale {release}"
html_static_path: list[str] = []


# Public names for private paths. Annotations are evaluated objects, and
# Sphinx and napoleon write them under the module that defines them:
# `jax.jaxlib._jax.Array`, `optax_lossscale._core.state.LossScaleState`,
# `optax._src.base.GradientTransformation`. A dotted name with a private
# part is written as its package's public name for the same object.
_PRIVATE_PATH = re.compile(
  r"\b(?P<package>[A-Za-z]\w*)"  # jax
  r"(?P<modules>(?:\.\w+)*\._\w+(?:\.\w+)*)"  # .jaxlib._jax
  r"\.(?P<name>\w+)\b"  # .Array
)


def _public_name(match: re.Match) -> str:
  package, name = match["package"], match["name"]
  try:
    public = getattr(importlib.import_module(package), name)
  except (ImportError, AttributeError):
    return match[0]  # not a package's public name: left as written
  try:
    private = getattr(importlib.import_module(package + match["modules"]), name)
  except (ImportError, AttributeError):
    # A path that is not importable as written (jax's `jax.jaxlib._jax` is
    # `jaxlib._jax`): the package's public name stands.
    private = public
  return f"{package}.{name}" if private is public else match[0]


def _public_paths(app, what, name, obj, options, lines) -> None:
  """autodoc-process-docstring, after napoleon has written its fields."""
  lines[:] = [_PRIVATE_PATH.sub(_public_name, line) for line in lines]
  _prose_types_as_sentences(lines)
  _every_field_listed(what, obj, lines)


# Napoleon reads `Returns: A SkipReport: print it, ...` as the type
# "A SkipReport" and the description "print it, ...", and a property's
# "The validated configuration: ..." as the type "The validated
# configuration". A "type" that starts with an article is prose: it goes back
# in front of its description, and the return type comes from the
# annotation (autodoc adds it, linked, where none is written).
_PROSE_TYPE = re.compile(
  r"^:(?P<field>rtype|type):\s+(?P<text>(?:A|An|The)\s.*)$"
)


def _prose_types_as_sentences(lines: list[str]) -> None:
  for i, line in enumerate(lines):
    m = _PROSE_TYPE.match(line)
    if m is None:
      continue
    del lines[i]
    if m["field"] == "rtype":
      targets = [j for j, x in enumerate(lines) if x.startswith(":returns:")]
      if targets:
        j = targets[0]
        rest = lines[j][len(":returns:") :].strip()
        lines[j] = f":returns: {m['text']}: {rest}"
      else:
        lines.insert(i, f":returns: {m['text']}.")
    else:
      # A property: its first paragraph is the description; the prose is
      # its opening words.
      first = next((j for j, x in enumerate(lines) if x.strip()), None)
      if first is None:
        lines.insert(0, f"{m['text']}.")
      else:
        lines[first] = f"{m['text']}: {lines[first].lstrip()}"
    _prose_types_as_sentences(lines)
    return


def _every_field_listed(what: str, obj: object, lines: list[str]) -> None:
  """A returned dataclass's fields are each listed, with their type, even
  where its docstring describes only some: napoleon lists those it
  describes (`.. attribute:: dtype, shape` for several at once)."""
  if what != "class" or not dataclasses.is_dataclass(obj):
    return
  listed = {
    name.strip()
    for line in lines
    if line.startswith(".. attribute:: ")
    for name in line[len(".. attribute:: ") :].split(",")
  }
  for field in dataclasses.fields(obj):
    if field.name not in listed:
      annotation = (
        field.type
        if isinstance(field.type, str)
        else inspect.formatannotation(field.type)
      )
      lines += ["", f".. attribute:: {field.name}"]
      if annotation:
        lines.append(f"   :type: {annotation}")
      lines.append("")


def _public_headings(app, what, name, obj, options, signature, annotation):
  """autodoc-process-signature: a class's heading is its name alone. The
  types documented here are read (returned, or held by a state), not built,
  and their fields are listed below the heading."""
  if what == "class":
    return "", annotation
  if signature and "<class 'jax.numpy." in signature:
    # A jnp scalar type as a default (`autocast`'s `dtype=jnp.float16`) as
    # the source writes it, not as its repr.
    return re.sub(
      r"<class 'jax\.numpy\.(\w+)'>", r"jnp.\1", signature
    ), annotation
  return None


def _array_like_by_name(app, domain, objtype, contentnode) -> None:
  """A parameter annotated `jax.typing.ArrayLike` reads so, not as the
  eight-member union that the alias stands for."""
  if domain != "py" or not contentnode.parent.children:
    return
  signature = contentnode.parent[0]
  obj = getattr(optax_lossscale, signature.get("fullname", ""), None)
  try:
    parameters = inspect.signature(obj).parameters
  except (TypeError, ValueError):
    return
  array_like = {
    f"type {p.name}"
    for p in parameters.values()
    if p.annotation is jax.typing.ArrayLike
  }
  for field in contentnode.findall(nodes.field):
    if field[0].astext() in array_like:
      field[1].clear()
      field[1] += nodes.paragraph("", "jax.typing.ArrayLike")


def setup(app):
  # After napoleon (500) and after autodoc's own typehint fields (500).
  app.connect("autodoc-process-docstring", _public_paths, priority=600)
  app.connect("object-description-transform", _array_like_by_name, 600)
  app.connect("autodoc-process-signature", _public_headings)
