"""The documentation's Markdown pages and their fenced blocks, shared by
tests/test_doc_snippets.py (how blocks are fenced) and
tests/test_doc_outputs.py (every block runs, and printed output matches
what the blocks print)."""

import contextlib
import dataclasses
import doctest
import functools
import importlib
import io
import linecache
import pathlib
import re
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The README and every page of the site; found by glob, so that a new page
# is covered without a change here.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


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


def page_id(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


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

# page -> why running it is slow (more than a few seconds): its tests are
# marked `slow`, and `-m "not slow"` leaves them out.
SLOW_PAGES = {
  "docs/recipes.md": "trains several models",
  "docs/frameworks.md": "trains in every framework",
  "docs/composition.md": "many optimizers",
  "docs/float16_goes_wrong.md": "trains several models",
  "docs/autocast.md": "traces each framework's model",
}


def page_params(paths: list[pathlib.Path]) -> list:
  """`paths` as pytest parameters, named by page, the slow pages marked."""
  return [
    pytest.param(
      p,
      id=page_id(p),
      marks=[pytest.mark.slow] if page_id(p) in SLOW_PAGES else [],
    )
    for p in paths
  ]


DOCTEST_FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def where(page: str, index: int, block: Block) -> str:
  return (
    f"{page}, block {index} ({block.language}, line {block.line}):\n"
    f"{block.text}"
  )


@dataclasses.dataclass
class PageRun:
  """A page's python and pycon blocks, run in order in one namespace.

  printed: per block, what it wrote to stdout (None for a block that was
  not run: another language, or after a failure). failure: the first
  failing block with its traceback or doctest report, else None."""

  namespace: dict
  printed: list[str | None]
  failure: str | None


@functools.cache
def run_page(path: pathlib.Path) -> PageRun:
  """Runs a page once per test session: tests/test_doc_outputs.py checks
  that it runs and what it prints."""
  page = page_id(path)
  namespace: dict = {"__name__": re.sub(r"\W", "_", page)}
  found = blocks(path)
  printed: list[str | None] = [None] * len(found)
  for index, block in enumerate(found):
    if block.language not in {"python", "pycon"}:
      continue
    out = io.StringIO()
    failure = None
    with contextlib.redirect_stdout(out):
      if block.language == "python":
        try:
          filename = f"{page}:{block.line}"
          # Its lines readable as a file's, for tracebacks and for
          # ols.find_overflow, which quotes the line that overflowed.
          linecache.cache[filename] = (
            len(block.text),
            None,
            block.text.splitlines(keepends=True),
            filename,
          )
          code = compile(block.text, filename, "exec")
          exec(code, namespace)
        except Exception:
          failure = traceback.format_exc()
      else:
        test = doctest.DocTestParser().get_doctest(
          block.text, namespace, f"{page} block {index}", str(path), block.line
        )
        report: list[str] = []
        runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
        result = runner.run(test, out=report.append, clear_globs=False)
        namespace.update(test.globs)  # the DocTest ran in a copy
        if result.failed:
          failure = "".join(report)
    printed[index] = out.getvalue()
    if failure is not None:
      return PageRun(
        namespace, printed, f"{where(page, index, block)}\n{failure}"
      )
  return PageRun(namespace, printed, None)
