"""docs/_check_html.py finds powers of two that Markdown turned into bold.

`.ci/run` runs it on the built site. Here it runs on HTML that markdown-it
(the parser MyST uses, installed with the `docs` extra) renders from
Markdown, which is what Sphinx puts in the page, and on the Markdown
sources of the site themselves, so that a mangled power fails the suite
before the site is built.
"""

import pathlib

import pytest
from _helpers import load_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
markdown_it = pytest.importorskip("markdown_it")


check_html = load_file(ROOT / "docs" / "_check_html.py")
render = markdown_it.MarkdownIt("commonmark").enable("table").render

# The site's pages and the files they include.
SOURCES = [
  *sorted((ROOT / "docs").glob("*.md")),
  ROOT / "benchmarks" / "README.md",
  ROOT / "notebooks" / "RESULTS.md",
]


@pytest.mark.parametrize(
  "markdown",
  [
    "a batch of 2**17 positions, each below 2**-17, flushes",
    "from 2**2 to 2**17 here",
    "- **The window.** from 2**2 to 2**17",
    "up to 2**20\nelements, and under 2**12 elements",
  ],
)
def test_finds_a_mangled_power(markdown):
  html = render(markdown)
  assert "<strong>" in html  # Markdown did mangle it
  assert check_html.mangled_powers(html)


@pytest.mark.parametrize(
  "markdown",
  [
    "a batch of `2**17` positions, each below `2**-17`",
    "a batch of 2<sup>17</sup> positions, each below 2<sup>-17</sup>",
    "one power alone, 2**15, stays as it is written",
    "**Bold 2** 17 and **3 items**, then 2 **more**",
    "| 2**0 | 2**17 |\n| --- | --- |\n| 2**2 | 2**-17 |",
    "```\n2**17 positions ... below 2**-17\n```",
  ],
)
def test_leaves_powers_that_are_not_mangled(markdown):
  assert check_html.mangled_powers(render(markdown)) == []


def test_reports_file_and_line(tmp_path):
  page = tmp_path / "sub" / "page.html"
  page.parent.mkdir()
  page.write_text("<html>\n<p>\nbelow 2<strong>17 and 2</strong>-17</p>\n")
  (tmp_path / "clean.html").write_text(render("`2**17` and `2**-17`"))
  problems = check_html.check(tmp_path)
  assert len(problems) == 2
  assert all(p.startswith(f"{page}:3: ") for p in problems)
  assert check_html.main([str(tmp_path)]) == 1
  page.unlink()
  assert check_html.main([str(tmp_path)]) == 0


def _source_id(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", SOURCES, ids=_source_id)
def test_site_sources_have_no_mangled_power(path):
  html = render(path.read_text(encoding="utf-8"))
  found = check_html.mangled_powers(html)
  assert not found, (
    f"{_source_id(path)}: powers of two read as bold (write them as"
    f" code, `2**17`): {found}"
  )
