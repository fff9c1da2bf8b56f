"""docs/api.md documents exactly the public API: every name in
`optax_lossscale.__all__` has an autodoc entry there, and nothing else does.
"""

import pathlib
import re

import optax_lossscale as ols

API_PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"

# `.. autofunction:: name` (in an eval-rst block) or ```{autofunction} name.
_ENTRY = re.compile(
  r"^(?:\.\.\s+|```\{)auto(?:function|class|data|exception)(?:::|\})\s+"
  r"(?:optax_lossscale\.)?(\w+)\s*$",
  flags=re.M,
)


def documented_names() -> list[str]:
  return _ENTRY.findall(API_PAGE.read_text())


def test_every_public_name_is_documented():
  missing = sorted(set(ols.__all__) - set(documented_names()))
  assert not missing, f"add to docs/api.md: {missing}"


def test_only_public_names_are_documented_once():
  names = documented_names()
  assert len(names) == len(set(names)), names
  extra = sorted(set(names) - set(ols.__all__))
  assert not extra, f"not in optax_lossscale.__all__: {extra}"
