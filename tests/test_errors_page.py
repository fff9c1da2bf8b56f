"""docs/errors.md is what docs/_errors.py writes today: every example on it
runs again here, and the page must match, message for message. (The page's
blocks also run as doctests in tests/test_doc_outputs.py.)"""

import difflib
import pathlib

import pytest
from _helpers import load_file

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _generator():
  return load_file(ROOT / "docs" / "_errors.py")


def test_errors_page_is_current():
  generator = _generator()
  page = generator.PAGE.read_text()
  rendered = generator.render()
  diff = "".join(
    difflib.unified_diff(
      page.splitlines(keepends=True),
      rendered.splitlines(keepends=True),
      "docs/errors.md (committed)",
      "docs/errors.md (as the library behaves now)",
    )
  )
  if diff:
    pytest.fail(
      "docs/errors.md is stale: run `python docs/_errors.py` and review the"
      f" change.\n{diff}",
      pytrace=False,
    )


def test_case_titles_are_unique():
  generator = _generator()
  titles = [c.title for s in generator.SECTIONS for c in s.cases]
  assert len(titles) == len(set(titles)), titles
