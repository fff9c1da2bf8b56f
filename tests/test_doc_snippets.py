"""How the code blocks of README.md and docs/*.md are fenced, which
decides how tests/test_doc_outputs.py runs them (`test_page_runs`), page
by page.

The pages are found by glob, so a new page is covered without a change
here; tests/_doc_pages.py runs each once per session, and one test module
both runs them and compares what they print with the page, so that a page
runs once however the modules are spread over workers.
For each page, its fenced blocks run in page order, in one fresh namespace
(like one script), with the session's 8 CPU devices (tests/conftest.py).
The fence's language decides what happens to a block:

- ```python  runs. A page must be self-contained: its first block imports
  what it uses, and nothing comes from another page. Facts the prose states
  (a shape, a scale after a step) are best checked by `assert` lines in the
  block itself, where the reader sees them.
- ```pycon   runs as a doctest (`>>>` prompts, expected output below), in
  the same namespace, with NORMALIZE_WHITESPACE and ELLIPSIS: a traceback's
  frames are written `...`, and so may be a memory address (`0x...`).
  docs/errors.md is made of these (docs/_errors.py writes it).
- ```py      is code of another library shown for comparison (Keras or
  TensorFlow, PyTorch): it is not run, and must mention `tf.`, `keras`,
  `tensorflow` or `torch` (test_py_blocks_are_other_libraries).
- anything else (bash, text, diff, no language, MyST directives such as
  {eval-rst}) is not run.

A page whose code needs something that the oldest supported versions lack
is skipped there, with a reason, in SKIPS. A failure names the page, the
block's index and line, and shows the block.
"""

import re

import pytest
from _doc_pages import PAGES, blocks, page_id, where

OTHER_LIBRARIES = re.compile(r"\btf\.|keras|tensorflow|torch", re.I)


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_py_blocks_are_other_libraries(path):
  for index, block in enumerate(blocks(path)):
    if block.language == "py":
      assert OTHER_LIBRARIES.search(block.text), (
        "```py is for code of other libraries (not run); fence our code"
        f" ```python: {where(page_id(path), index, block)}"
      )
    # Prompts fenced as anything but pycon would not be run.
    if block.text.lstrip().startswith(">>>"):
      assert block.language == "pycon", where(page_id(path), index, block)
    assert block.language.lower() not in {"python3", "py3", "ipython"}, where(
      page_id(path), index, block
    )
