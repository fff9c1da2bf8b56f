"""The wheel and the sdist, built as a package index would receive them:
their metadata (licence, classifiers, version, dependencies) and their
contents (the package and its subpackages, no tests in the wheel).

They are built with flit_core's build backend called in-process, in a
temporary folder: no network and no isolated build environment, so the
check runs wherever the `test` extra is installed (it has flit_core).
"""

import email.parser
import email.policy
import os
import pathlib
import re
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The release these files describe; optax_lossscale.__version__ holds it
# and flit reads it from there (the version is dynamic in pyproject.toml).
VERSION = "0.2.0"
SUBPACKAGES = ("_core", "_access", "_diagnostics")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  buildapi = pytest.importorskip(
    "flit_core.buildapi", reason="the `test` extra installs flit_core"
  )
  out = tmp_path_factory.mktemp("dist")
  cwd = os.getcwd()
  os.chdir(ROOT)  # the backend builds the project in the working directory
  try:
    wheel = out / buildapi.build_wheel(str(out))
    sdist = out / buildapi.build_sdist(str(out))
  finally:
    os.chdir(cwd)
  return wheel, sdist


def _metadata(text: str):
  return email.parser.Parser(policy=email.policy.compat32).parsestr(text)


@pytest.fixture(scope="module")
def wheel_names(built):
  with zipfile.ZipFile(built[0]) as z:
    return z.namelist()


@pytest.fixture(scope="module")
def metadata(built, wheel_names):
  (path,) = [n for n in wheel_names if n.endswith(".dist-info/METADATA")]
  with zipfile.ZipFile(built[0]) as z:
    return _metadata(z.read(path).decode())


def test_version(metadata, built):
  assert metadata["Version"] == VERSION
  assert built[0].name == f"optax_lossscale-{VERSION}-py3-none-any.whl"
  assert built[1].name == f"optax_lossscale-{VERSION}.tar.gz"


def test_licence_is_an_spdx_expression_with_its_file(metadata, wheel_names):
  assert metadata["License-Expression"] == "Apache-2.0"
  assert metadata.get_all("License-File") == ["LICENSE"]
  assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel_names)


def test_classifiers_keywords_and_authors(metadata):
  classifiers = metadata.get_all("Classifier")
  for minor in (11, 12, 13):
    assert f"Programming Language :: Python :: 3.{minor}" in classifiers
  assert "Typing :: Typed" in classifiers
  assert any(c.startswith("Topic :: ") for c in classifiers)
  assert metadata["Requires-Python"] == ">=3.11"
  assert "loss scaling" in metadata["Keywords"].split(",")
  assert metadata["Author"] == "optax_lossscale maintainers"


def _requirement_name(requirement: str) -> str:
  return re.match(r"[A-Za-z0-9_.-]+", requirement)[0].lower()


def test_only_jax_and_optax_are_required(metadata):
  # Everything else (tqdm, pytest, sphinx, ...) sits behind an extra.
  plain = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
  assert sorted(map(_requirement_name, plain)) == ["jax", "optax"]
  extras = set(metadata.get_all("Provides-Extra"))
  assert {"demo", "test", "docs", "lint", "dev"} <= extras


def test_long_description_has_no_relative_links(metadata):
  # A package index shows the README alone: a link into the repository
  # (`docs/x.md`, `LICENSE`) would lead nowhere there.
  assert metadata["Description-Content-Type"] == "text/markdown"
  body = metadata.get_payload()
  assert "Dynamic loss scaling" in body
  targets = re.findall(r"\]\(([^)\s]+)\)", body)
  relative = [t for t in targets if not re.match(r"https?://", t)]
  assert not relative, relative


def test_wheel_holds_the_package_and_no_tests(wheel_names):
  for sub in SUBPACKAGES:
    assert f"optax_lossscale/{sub}/__init__.py" in wheel_names, sub
  assert "optax_lossscale/py.typed" in wheel_names
  top = {n.split("/")[0] for n in wheel_names}
  assert top == {"optax_lossscale", f"optax_lossscale-{VERSION}.dist-info"}


def test_sdist_holds_the_package_readme_and_licence(built):
  with tarfile.open(built[1]) as t:
    names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    info = t.extractfile(f"optax_lossscale-{VERSION}/PKG-INFO")
    assert info is not None
    pkg_info = _metadata(info.read().decode())
  for sub in SUBPACKAGES:
    assert f"optax_lossscale/{sub}/__init__.py" in names, sub
  assert {"pyproject.toml", "README.md", "LICENSE"} <= names
  assert pkg_info["Version"] == VERSION
  assert pkg_info["License-Expression"] == "Apache-2.0"
