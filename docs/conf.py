"""Sphinx configuration for the optax_lossscale documentation site.

Build (warnings are errors; `.ci/run` runs the same into a temporary folder):
  python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import pathlib
import re
import sys

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
# signature's annotations written out in the description, not the signature.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
# Cross-references the docstrings make to optax, jax and numpy names cannot
# resolve without intersphinx (no network in CI), so they are not checked.
nitpicky = False

html_theme = "furo"
html_title = f"optax_lossscale {release}"
html_static_path: list[str] = []
