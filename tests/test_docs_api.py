"""docs/api.md documents exactly the public API, and every type a public
name hands out; docs/index.md's "At a glance" table lists every public name
with its current signature, linked to its API entry.

Both lists come from `optax_lossscale.__all__` and the signatures and type
annotations, so a new public name, a new keyword or a new returned type
fails here until the pages say so.
"""

import dataclasses
import inspect
import pathlib
import re
import types
import typing

import optax_lossscale as ols

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
API_PAGE = DOCS / "api.md"
INDEX_PAGE = DOCS / "index.md"

# `.. autofunction:: name` (in an eval-rst block) or ```{autofunction} name,
# the name with its module path if it has one.
_ENTRY = re.compile(
  r"^(?:\.\.\s+|```\{)auto(?:function|class|data|exception)(?:::|\})\s+"
  r"([\w.]+)\s*$",
  flags=re.M,
)


def documented_paths() -> list[str]:
  return _ENTRY.findall(API_PAGE.read_text())


def documented_names() -> list[str]:
  """The public names documented (`name` or `optax_lossscale.name`)."""
  return [
    p.removeprefix("optax_lossscale.")
    for p in documented_paths()
    if "." not in p.removeprefix("optax_lossscale.")
  ]


def test_every_public_name_is_documented():
  missing = sorted(set(ols.__all__) - set(documented_names()))
  assert not missing, f"add to docs/api.md: {missing}"


def test_only_public_names_are_documented_once():
  names = documented_names()
  assert len(names) == len(set(names)), names
  extra = sorted(set(names) - set(ols.__all__))
  assert not extra, f"not in optax_lossscale.__all__: {extra}"


# ---------------------------------------------- the types handed out


def _package_classes(annotation) -> set[type]:
  """The optax_lossscale classes an annotation names (in unions and
  generics too)."""
  if isinstance(annotation, type) and annotation.__module__.startswith(
    "optax_lossscale"
  ):
    return {annotation}
  found: set[type] = set()
  for arg in typing.get_args(annotation):
    found |= _package_classes(arg)
  return found


def _hints(obj) -> dict:
  try:
    return typing.get_type_hints(obj)
  except NameError:  # a private attribute's annotation, unevaluated
    return {}


def _handed_out(cls: type) -> set[type]:
  """The package's classes that a class's fields and properties hold."""
  found: set[type] = set()
  if dataclasses.is_dataclass(cls) or hasattr(cls, "_fields"):
    for annotation in _hints(cls).values():
      found |= _package_classes(annotation)
  for _, prop in inspect.getmembers(cls, lambda m: isinstance(m, property)):
    found |= _package_classes(_hints(prop.fget).get("return"))
  return found


def returned_types() -> set[type]:
  """Every class of the package that a public function returns, or that a
  returned object holds, transitively."""
  todo: set[type] = set()
  for name in ols.__all__:
    obj = getattr(ols, name)
    if inspect.isclass(obj):
      todo.add(obj)
    else:
      todo |= _package_classes(_hints(obj).get("return"))
  seen: set[type] = set()
  while todo:
    cls = todo.pop()
    seen.add(cls)
    todo |= _handed_out(cls) - seen
  return seen


def test_every_returned_type_is_documented():
  # A type that is not exported is documented by its defining module's
  # path (docs/conf.py keeps that path out of the rendered page).
  documented = set(documented_paths())
  missing = []
  for cls in returned_types():
    public = f"optax_lossscale.{cls.__name__}"
    if getattr(ols, cls.__name__, None) is cls:
      continue  # a public name: test_every_public_name_is_documented
    defining = f"{inspect.getmodule(cls).__name__}.{cls.__qualname__}"
    if defining not in documented and public not in documented:
      missing.append(defining)
  assert not missing, f"add an autoclass to docs/api.md: {sorted(missing)}"
  assert {"SkipReport", "OverflowReport", "Overflow", "ScopeStats"} <= {
    c.__name__ for c in returned_types()
  }


# ---------------------------------------------- the index's table


def _glance_table() -> str:
  text = INDEX_PAGE.read_text()
  start = text.index("## At a glance")
  end = text.find("\n## ", start + 1)
  return text[start : end if end > 0 else len(text)]


# {func}`title <optax_lossscale.name>` or {class}`...`
_ROLE = re.compile(
  r"\{(func|class)\}`(?P<title>[^`<]*?)\s*<optax_lossscale\.(?P<name>\w+)>`"
)


class _Spelled:
  """A default value written as the source writes it (`jnp.float16`)."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


def _default(value):
  """jnp's scalar types (`autocast`'s `dtype=jnp.float16`) as written."""
  if isinstance(value, type) and value.__module__ == "jax.numpy":
    return _Spelled(f"jnp.{value.__name__}")
  return value


def _bare_signature(obj) -> str:
  """The signature as the table writes it: defaults, no annotations."""
  sig = inspect.signature(obj)
  params = [
    p.replace(annotation=inspect.Parameter.empty, default=_default(p.default))
    for p in sig.parameters.values()
  ]
  return str(
    sig.replace(parameters=params, return_annotation=inspect.Signature.empty)
  )


def expected_title(name: str) -> str:
  obj = getattr(ols, name)
  if inspect.isclass(obj):
    return name
  return name + _bare_signature(obj)


def glance_rows() -> dict[str, tuple[str, str]]:
  """name -> (role, title) of each linked name in the table's first column."""
  rows = {}
  for line in _glance_table().splitlines():
    if not line.startswith("| {"):
      continue
    first_cell = line.split(" | ")[0]
    for m in _ROLE.finditer(first_cell):
      assert m["name"] not in rows, f"listed twice: {m['name']}"
      rows[m["name"]] = (m[1], m["title"])
  return rows


def test_at_a_glance_lists_every_public_name_linked():
  rows = glance_rows()
  missing = [n for n in ols.__all__ if n not in rows]
  assert not missing, "add to docs/index.md's At a glance:\n" + "\n".join(
    f"| {{{'class' if inspect.isclass(getattr(ols, n)) else 'func'}}}"
    f"`{expected_title(n)} <optax_lossscale.{n}>` | ... |"
    for n in missing
  )
  extra = sorted(set(rows) - set(ols.__all__))
  assert not extra, f"not public: {extra}"


def test_at_a_glance_signatures_are_current():
  for name, (role, title) in glance_rows().items():
    obj = getattr(ols, name)
    assert role == ("class" if inspect.isclass(obj) else "func"), name
    assert title == expected_title(name), (
      f"docs/index.md's At a glance writes {title!r}; the signature is"
      f" {expected_title(name)!r}"
    )


def test_signature_helper_sees_keywords():
  # The check above compares whole signatures; a keyword added to
  # loss_scale_optimizer shows in its title.
  title = expected_title("loss_scale_optimizer")
  assert "backoff_on_nonfinite_loss=True" in title and ", *," in title
  assert isinstance(ols.loss_scale_optimizer, types.FunctionType)
