"""Every code block of README.md and docs/*.md runs, page by page.

The pages are found by glob, so a new page is covered without a change here.
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

import doctest
import importlib
import pathlib
import re
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

OTHER_LIBRARIES = re.compile(r"\btf\.|keras|tensorflow|torch", re.I)
DOCTEST_FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _flax_nnx_has(name: str) -> bool:
  return hasattr(importlib.import_module("flax.nnx"), name)


# page (relative to the repository) -> (skip?, reason)
SKIPS = {
  "docs/frameworks.md": (
    not _flax_nnx_has("as_pure"),
    "the page's jmp comparison uses nnx.as_pure, which flax 0.12.0 (the"
    " newest that installs with jax 0.7) lacks",
  ),
}


class Block:
  def __init__(self, language: str, text: str, line: int):
    self.language = language
    self.text = text
    self.line = line  # of the opening fence, 1-based


_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def blocks(path: pathlib.Path) -> list[Block]:
  """The fenced blocks of a Markdown page, dedented to their fence."""
  found = []
  lines = path.read_text().splitlines()
  i = 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    indent, fence = len(m["indent"]), m["fence"]
    language = m["info"].strip().split(" ")[0]
    start, i = i, i + 1
    body = []
    while i < len(lines):
      close = _FENCE.match(lines[i])
      if (
        close
        and close["fence"][0] == fence[0]
        and len(close["fence"]) >= len(fence)
        and not close["info"].strip()
      ):
        break
      body.append(
        lines[i][indent:] if lines[i][:indent].isspace() else lines[i]
      )
      i += 1
    found.append(Block(language, "\n".join(body) + "\n", start + 1))
    i += 1
  return found


def _page_id(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


def _where(page: str, index: int, block: Block) -> str:
  return (
    f"{page}, block {index} ({block.language}, line {block.line}):\n"
    f"{block.text}"
  )


def run_page(path: pathlib.Path) -> dict:
  """Runs the page's python and pycon blocks; returns the namespace."""
  page = _page_id(path)
  namespace: dict = {"__name__": re.sub(r"\W", "_", page)}
  for index, block in enumerate(blocks(path)):
    if block.language == "python":
      try:
        code = compile(block.text, f"{page}:{block.line}", "exec")
        exec(code, namespace)
      except Exception:
        pytest.fail(
          f"{_where(page, index, block)}\n{traceback.format_exc()}",
          pytrace=False,
        )
    elif block.language == "pycon":
      test = doctest.DocTestParser().get_doctest(
        block.text, namespace, f"{page} block {index}", str(path), block.line
      )
      report: list[str] = []
      runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
      result = runner.run(test, out=report.append, clear_globs=False)
      namespace.update(test.globs)  # the DocTest ran in a copy
      if result.failed:
        pytest.fail(
          f"{_where(page, index, block)}\n{''.join(report)}", pytrace=False
        )
  return namespace


@pytest.mark.parametrize("path", PAGES, ids=_page_id)
def test_page_runs(path):
  skip, reason = SKIPS.get(_page_id(path), (False, ""))
  if skip:
    pytest.skip(reason)
  run_page(path)


@pytest.mark.parametrize("path", PAGES, ids=_page_id)
def test_py_blocks_are_other_libraries(path):
  for index, block in enumerate(blocks(path)):
    if block.language == "py":
      assert OTHER_LIBRARIES.search(block.text), (
        "```py is for code of other libraries (not run); fence our code"
        f" ```python: {_where(_page_id(path), index, block)}"
      )
    # Prompts fenced as anything but pycon would not be run.
    if block.text.lstrip().startswith(">>>"):
      assert block.language == "pycon", _where(_page_id(path), index, block)
    assert block.language.lower() not in {"python3", "py3", "ipython"}, _where(
      _page_id(path), index, block
    )
