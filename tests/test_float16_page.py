"""docs/float16_goes_wrong.md: what it starts with, and that every output
it shows is checked.

tests/test_doc_outputs.py runs the page's blocks as one script and its
```pycon blocks as doctests; these checks keep the page's printed output
in those doctests, where a change in what the code prints fails the suite,
rather than in text blocks that nothing compares.
"""

import pathlib
import re

from _doc_pages import blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "float16_goes_wrong.md"


def _sections(text):
  """The page's `## ` headings, in order."""
  return re.findall(r"^## (.+)$", text, re.M)


def test_the_page_starts_with_what_to_call():
  text = PAGE.read_text()
  assert _sections(text)[0] == "What to call"
  start = text.index("## What to call")
  end = text.index("\n## ", start + 1)
  calls = text[start:end]
  for call in (
    "value=loss",
    "print(ols.skip_report(opt_state, tx))",
    "ols.find_overflow(",
  ):
    assert call in calls, call


def test_the_cases_come_before_the_recipe():
  sections = _sections(PAGE.read_text())
  assert sections.index("The cases") == 1
  recipe = [s for s in sections if "Gemma" in s]
  assert recipe and sections.index(recipe[0]) > 1


def test_every_printed_output_is_a_doctest():
  # A python block that prints shows its output nowhere a test reads it;
  # a text block would hold output that nothing compares with the code's.
  for block in blocks(PAGE):
    assert block.language in {"python", "pycon"}, (block.line, block.text)
    if block.language == "python":
      assert "print(" not in block.text, (block.line, block.text)


def test_the_pycon_outputs_are_there():
  # The reports the page shows, as doctests (test_doc_outputs runs them).
  pycon = "".join(b.text for b in blocks(PAGE) if b.language == "pycon")
  assert pycon.count(">>> print(ols.skip_report(") >= 4
  assert "report.first.pass_name, report.first.scope" in pycon


def test_no_evidence_cited_from_the_repository():
  # Commits and loads: tests/test_doc_pages.py, for every page.
  text = PAGE.read_text()
  assert "tests/test_" not in text  # test files cited as evidence
  assert not re.search(r"\.py:\d+", text)
  assert "SkipStats(" not in text  # the old read-out, in full
