"""Every page's code runs, and the printed output on the pages is what the
code prints now (tests/test_doc_snippets.py says how blocks are fenced
and run; a page runs once, here, for both checks).

Every page (README.md and docs/*.md, and the files docs/ includes) is read
block by block. An output block is a ```text fence, or a fence without a
language, right after the code that prints it:

- after ```python blocks: the page's python blocks run in order in one
  namespace (as test_page_runs runs them), their stdout is
  captured, and each output block must equal what the python blocks since
  the previous output block printed, line for line;
- the float16 study's main job (`python notebooks/fp16_study.py`, minutes
  long): its report is printed again from the numbers of the committed run
  (notebooks/figures/fp16_study.json), and each quoted block must be an
  excerpt of it: its lines, in order, each equal to a printed line.

Tolerance, for digits that vary by platform: words, punctuation and
integers (counts, step numbers, powers of two) must be equal; a number with
a fraction may differ by 2 units of its last printed digit, or by 0.5% of
its value, whichever is larger. Runs of spaces compare equal to one.

Every other output block is listed in NOT_RUN with the reason (the output
of a job too long for the suite, or of another program). A page's python
block that prints something must be followed by its output block, so that
no page shows code whose output the reader cannot see.
"""

import contextlib
import io
import math
import re

import pytest
from _doc_pages import (
  PAGES,
  ROOT,
  SKIPS,
  blocks,
  page_id,
  page_params,
  run_page,
)

# The files the site includes from outside docs/ (docs/results.md), read
# for their output blocks too.
INCLUDED = [ROOT / "notebooks" / "RESULTS.md"]

OUTPUT_LANGUAGES = {"text", ""}
ABS_DIGITS = 2  # units of the last printed digit
REL = 0.005

# (page, first line of the block) -> why it is not compared.
NOT_RUN = {
  ("docs/study.md", "run                 eval loss  vs fp32"): (
    "the bad-batch job's table (--corrupt, minutes long; no saved numbers)"
  ),
  ("notebooks/RESULTS.md", "loss scale 4: dynamic, floor 1"): (
    "the bad-batch job's skip_report (--corrupt, minutes long)"
  ),
  ("notebooks/RESULTS.md", "loss scale 2**15: dynamic, floor 1"): (
    "the bad-batch job's skip_report (--corrupt, minutes long)"
  ),
}


_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _tokens(line: str) -> list[str]:
  """Words and numbers, in order; runs of spaces dropped."""
  out = []
  pos = 0
  for m in _NUMBER.finditer(line):
    out += line[pos : m.start()].split()
    out.append(m[0])
    pos = m.end()
  out += line[pos:].split()
  return out


def _is_number(token: str) -> bool:
  return _NUMBER.fullmatch(token) is not None


def _numbers_match(shown: str, printed: str) -> bool:
  exact = not re.search(r"[.eE]", shown)
  if exact or not re.search(r"[.eE]", printed):
    return shown == printed
  a, b = float(shown), float(printed)
  if math.isnan(a) or math.isnan(b):
    return math.isnan(a) and math.isnan(b)
  fraction = re.search(r"\.(\d*)", shown)
  exponent = re.search(r"[eE]([-+]?\d+)", shown)
  unit = 10.0 ** -(len(fraction[1]) if fraction else 0)
  if exponent:
    unit *= 10.0 ** int(exponent[1])
  return abs(a - b) <= max(ABS_DIGITS * unit, REL * abs(b))


def lines_match(shown: str, printed: str) -> bool:
  """One shown line against one printed line, within the tolerance."""
  a, b = _tokens(shown), _tokens(printed)
  if len(a) != len(b):
    return False
  for x, y in zip(a, b, strict=True):
    if _is_number(x) and _is_number(y):
      if not _numbers_match(x, y):
        return False
    elif x != y:
      return False
  return True


def _nonblank(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.strip()]


def assert_same(shown: str, printed: str, where: str) -> None:
  a, b = _nonblank(shown), _nonblank(printed)
  bad = [
    (i, x, y)
    for i, (x, y) in enumerate(zip(a, b, strict=False))
    if not lines_match(x, y)
  ]
  assert len(a) == len(b) and not bad, (
    f"{where}: the page shows\n{shown}\nbut the code prints\n{printed}"
  )


def assert_excerpt(shown: str, printed: str, where: str) -> None:
  """Each shown line matches a printed one, in order."""
  rest = _nonblank(printed)
  for line in _nonblank(shown):
    for j, candidate in enumerate(rest):
      if lines_match(line, candidate):
        rest = rest[j + 1 :]
        break
    else:
      pytest.fail(
        f"{where}: this line is not printed (in this order):\n{line}\n"
        f"printed:\n{printed}",
        pytrace=False,
      )


# ---------------------------------------------- the float16 study


def _is_main_job_output(text: str) -> bool:
  # The main job's table header, in its current form or an old one (the
  # bad-batch job's has "skipped" after "acc %").
  return bool(
    re.search(r"^run +eval loss +vs fp32 +acc % +(act )?flushed", text, re.M)
  )


@pytest.fixture(scope="module")
def main_job_printed() -> str:
  from notebooks.study import cli, results

  result = results.load(ROOT / "notebooks" / "figures" / "fp16_study.json")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    cli.print_report(result)
  return out.getvalue()


# ---------------------------------------------- comparing a page


def check_page(path, main_job_printed_fn) -> int:
  """Compares the page's output blocks; returns how many it compared."""
  page = page_id(path)
  found = blocks(path)
  run = run_page(path) if path in PAGES else None
  if run is not None and run.failure is not None:
    pytest.skip("the page does not run (test_page_runs)")
  printed = ""  # by the python blocks since the last output block
  compared = 0
  previous = None
  for index, block in enumerate(found):
    at = f"{page}, block {index} (line {block.line})"
    own = run.printed[index] if run is not None else None
    if block.language in {"python", "pycon"} and own is not None:
      printed += own
    if block.language == "python" and own and own.strip():
      nxt = found[index + 1] if index + 1 < len(found) else None
      if nxt is None or nxt.language not in OUTPUT_LANGUAGES:
        pytest.fail(
          f"{at}: this block prints\n{own}\nwith no ```text block after it"
          " to show it",
          pytrace=False,
        )
    if block.language in OUTPUT_LANGUAGES:
      first = block.text.splitlines()[0] if block.text.strip() else ""
      listed = any(k[0] == page and first.startswith(k[1]) for k in NOT_RUN)
      if previous is not None and previous.language == "python" and run:
        assert_same(block.text, printed, at)
        compared += 1
      elif _is_main_job_output(block.text):
        assert_excerpt(block.text, main_job_printed_fn(), at)
        compared += 1
      elif not listed and _looks_like_output(block, previous):
        pytest.fail(
          f"{at}: an output block that no test compares; put the code"
          " that prints it right before it, or list it in NOT_RUN:\n"
          f"{block.text}",
          pytrace=False,
        )
      printed = ""
    previous = block
  return compared


def _looks_like_output(block, previous) -> bool:
  """An output block, not a command or a diagram: it follows code (a
  python block, or a shell command it shows the output of)."""
  if block.language == "text" and previous is not None:
    return previous.language in {"python", "bash", "text", ""}
  return False


@pytest.mark.parametrize("path", page_params(PAGES))
def test_page_runs(path):
  skip, reason = SKIPS.get(page_id(path), (False, ""))
  if skip:
    pytest.skip(reason)
  run = run_page(path)
  if run.failure is not None:
    pytest.fail(run.failure, pytrace=False)


@pytest.mark.parametrize("path", page_params([*PAGES, *INCLUDED]))
def test_printed_output_matches(path, request):
  skip, reason = SKIPS.get(page_id(path), (False, ""))
  if skip:
    pytest.skip(reason)

  def main_job():
    return request.getfixturevalue("main_job_printed")

  check_page(path, main_job)


def test_pages_with_printed_output_are_compared():
  # The pages that show printed output, and so must compare some of it.
  expected = {"README.md", "docs/install.md", "docs/study.md"}
  with_output = {
    page_id(p)
    for p in [*PAGES, *INCLUDED]
    if any(b.language == "text" for b in blocks(p))
  }
  assert expected <= with_output


@pytest.mark.parametrize(
  ("shown", "printed", "same"),
  [
    ("loss 0.00094, scale 16384.0", "loss 0.00095, scale 16384.0", True),
    ("loss 0.00094, scale 16384.0", "loss 0.00099, scale 16384.0", False),
    ("skipped: 2", "skipped: 3", False),  # counts are exact
    ("step 30: inf; scale 2**21", "step 30: inf; scale 2**20", False),
    ("fp16   2.9745  +0.0131", "fp16 2.9746 +0.0130", True),  # spaces, digits
    ("eval 2.4925", "eval 2.5925", False),
  ],
)
def test_tolerance(shown, printed, same):
  assert lines_match(shown, printed) is same
