"""The code on docs/frameworks.md runs, block after block, as one script;
the README snippets that issue 12 touched run against a small setup."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python_blocks(path: pathlib.Path) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", path.read_text(),
                    flags=re.S | re.M)


def test_frameworks_page_runs(capsys):
  blocks = python_blocks(ROOT / "docs" / "frameworks.md")
  assert len(blocks) == 8
  namespace: dict = {"__name__": "frameworks_md"}
  for i, block in enumerate(blocks):
    try:
      exec(compile(block, f"docs/frameworks.md block {i}", "exec"), namespace)
    except Exception as e:  # noqa: BLE001 - name the block that failed
      pytest.fail(f"block {i} failed: {e!r}\n{block}")
  out = capsys.readouterr().out
  assert re.search(r"loss \d\.\d{3}  scale \d+", out), out
