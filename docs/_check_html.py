"""Checks the built site for powers of two that Markdown turned into bold.

Markdown reads `2**17 positions ... below 2**-17` as "2", then a bold
"17 positions ... below 2", then "-17": the two `**` pair up as emphasis.
The sources write powers as code (`` `2**17` ``) instead; this finds the
ones that slipped through, in the HTML that Sphinx built, so that it also
sees the pages that docs/ includes from elsewhere (benchmarks/README.md,
notebooks/RESULTS.md).

A mangled power shows as a digit right before a `<strong>` whose text starts
with a digit or a minus, or a `</strong>` right after a digit and right
before one. Usage, after the build (`.ci/run` does this):

  python docs/_check_html.py BUILD_DIR

prints `file:line: ...` for each and exits 1 when there is any.
"""

import html.parser
import pathlib
import sys


class _MangledPowers(html.parser.HTMLParser):
  """Collects (line, context) for each `<strong>` edge that splits a power."""

  def __init__(self) -> None:
    super().__init__(convert_charrefs=True)
    self.found: list[tuple[int, str]] = []
    self._text = ""  # the text right before the current tag, if adjacent
    self._edge: tuple[int, str] | None = None  # a digit, then <strong>

  def _tag(self, tag: str, closing: bool) -> None:
    if tag == "strong" and self._text[-1:].isdigit():
      kind = "</strong>" if closing else "<strong>"
      self._edge = (self.getpos()[0], f"{self._text[-20:]}{kind}")
    else:
      self._edge = None
    self._text = ""

  def handle_starttag(self, tag, attrs):
    self._tag(tag, closing=False)

  def handle_endtag(self, tag):
    self._tag(tag, closing=True)

  def handle_data(self, data):
    if self._edge is not None and data[:1] in {"-", *"0123456789"}:
      line, before = self._edge
      self.found.append((line, f"{before}{data[:20]}"))
    self._edge = None
    self._text = data


def mangled_powers(text: str) -> list[tuple[int, str]]:
  """(line, context) of each mangled power in one HTML document."""
  parser = _MangledPowers()
  parser.feed(text)
  parser.close()
  return parser.found


def check(build_dir: pathlib.Path) -> list[str]:
  """`file:line: ...` for each mangled power under build_dir."""
  problems = []
  for page in sorted(build_dir.rglob("*.html")):
    for line, context in mangled_powers(page.read_text(encoding="utf-8")):
      problems.append(
        f"{page}:{line}: a power of two read as bold: {context!r}; write"
        " it as code in the Markdown source (`2**17`)"
      )
  return problems


def main(argv: list[str]) -> int:
  if len(argv) != 1 or not pathlib.Path(argv[0]).is_dir():
    print(f"usage: python {sys.argv[0]} BUILD_DIR", file=sys.stderr)
    return 2
  problems = check(pathlib.Path(argv[0]))
  for problem in problems:
    print(problem)
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
