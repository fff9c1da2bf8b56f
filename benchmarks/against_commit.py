"""The loss-scaled step of this checkout against that of an earlier commit,
side by side in one process, with the plain optax step and `leaf_stats`.

A change on the step path is measured against the commit before it: both
packages are imported at once (the earlier one from `git archive`, renamed),
and `overhead.run_config` times them interleaved, so that the machine's load
falls on both alike.

  python benchmarks/against_commit.py REV [--rounds 30] [--tiny]
"""

import argparse
import importlib
import pathlib
import subprocess
import sys
import tarfile
import tempfile

import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import overhead

import optax_lossscale as ols

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_RENAMED = "optax_lossscale_at_commit"


def import_at(rev: str, into: pathlib.Path):
  """The package as it was at `rev`, imported as `optax_lossscale_at_commit`."""
  archive = into / "package.tar"
  subprocess.run(
    [
      "git",
      "-C",
      str(_ROOT),
      "archive",
      "-o",
      str(archive),
      rev,
      "optax_lossscale",
    ],
    check=True,
  )
  with tarfile.open(archive) as tar:
    tar.extractall(into, filter="data")
  package = into / _RENAMED
  (into / "optax_lossscale").rename(package)
  for path in package.glob("*.py"):
    text = path.read_text().replace("optax_lossscale", _RENAMED)
    path.write_text(text)
  sys.path.insert(0, str(into))
  return importlib.import_module(_RENAMED)


def variants(earlier):
  optax_step = overhead.optax_step

  def make(name, inner):
    if name == "plain":
      return optax_step(inner)
    if name == "at_commit":
      return optax_step(earlier.loss_scale_optimizer(inner))
    if name == "ours":
      return optax_step(ols.loss_scale_optimizer(inner))
    if name == "ours_leaf_stats":
      return optax_step(ols.loss_scale_optimizer(inner, leaf_stats=True))
    raise ValueError(name)

  return make


CONFIGS = (
  ("adam", jnp.float32),
  ("adam", jnp.float16),
  ("sgdm", jnp.float32),
)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("rev", help="the earlier commit")
  p.add_argument("--rounds", type=int, default=30)
  p.add_argument("--tiny", action="store_true", help="one tiny configuration")
  args = p.parse_args(argv)
  params, leaves = (20_000, 5) if args.tiny else (10_000_000, 50)
  configs = CONFIGS[:1] if args.tiny else CONFIGS
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    make = variants(import_at(args.rev, pathlib.Path(tmp)))
    for opt, dtype in configs:
      print(
        f"== {params:,} params, {leaves} leaves, {opt}, grads"
        f" {jnp.dtype(dtype).name}",
        flush=True,
      )
      names = ["plain", "at_commit", "ours", "ours_leaf_stats"]
      results = overhead.run_config(
        params, leaves, opt, dtype, names, args.rounds, make_variant=make
      )
      for name, r in results.items():
        print(
          f"  {name:16s} {r['median_s'] * 1e3:8.2f} ms  {r['ratio']:.3f}x"
          f"  compile {r['compile_s']:.2f} s ({r['compile_ratio']:.2f}x)",
          flush=True,
        )
        rows.append(
          dict(opt=opt, grads=jnp.dtype(dtype).name, variant=name, **r)
        )
  return rows


if __name__ == "__main__":
  main()
