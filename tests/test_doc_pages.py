"""The pages users read (README.md, docs/*.md and what they include) hold
no lab notes: no
commit hashes, machine loads or shared cores, and no open questions; those
are contributors' notes, in benchmarks/README.md and CONTRIBUTING.md."""

import re

import pytest
from _doc_pages import PAGES, page_id

# A hexadecimal word of 7 to 40 digits with a letter and a digit in it.
COMMIT = re.compile(
  r"(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
)
LAB_NOTES = re.compile(
  r"load average|this machine|shared cores|cores, shared|lent for"
  r"|is not known|first suspect",
  re.I,
)


INCLUDE = re.compile(r"^```\{include\} (\S+)", re.M)


def _text_shown(path):
  """The page's text, with that of the files it includes."""
  text = path.read_text()
  included = [path.parent / name for name in INCLUDE.findall(text)]
  return "\n".join([text, *(p.read_text() for p in included)])


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_no_lab_notes(path):
  text = _text_shown(path)
  assert not COMMIT.findall(text), COMMIT.findall(text)
  assert not LAB_NOTES.findall(text), LAB_NOTES.findall(text)
