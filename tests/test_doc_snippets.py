"""The code on docs/frameworks.md runs, block after block, as one script;
the README snippets that issue 12 touched run against a small setup."""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python_blocks(path: pathlib.Path) -> list[str]:
  return re.findall(
    r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M
  )


@pytest.mark.skipif(
  not hasattr(importlib.import_module("flax.nnx"), "as_pure"),
  reason="the page's jmp comparison uses nnx.as_pure, which flax 0.12.0"
  " (the newest that installs with jax 0.7) lacks",
)
def test_frameworks_page_runs(capsys):
  blocks = python_blocks(ROOT / "docs" / "frameworks.md")
  assert len(blocks) == 8
  namespace: dict = {"__name__": "frameworks_md"}
  for i, block in enumerate(blocks):
    try:
      exec(compile(block, f"docs/frameworks.md block {i}", "exec"), namespace)
    except Exception as e:
      pytest.fail(f"block {i} failed: {e!r}\n{block}")
  out = capsys.readouterr().out
  assert re.search(r"loss \d\.\d{3}  scale \d+", out), out


README_SETUP = """
import functools
import jax, jax.numpy as jnp, optax
import flax.linen as nn
from flax.training import train_state
import optax_lossscale as ols

model = nn.Dense(1, dtype=jnp.float16)
params = model.init(jax.random.key(0), jnp.ones((1, 3)))
def loss_fn(params, batch):
  pred = model.apply(params, batch["x"]).astype(jnp.float32)
  return jnp.mean((pred - batch["y"]) ** 2)
def loss_and_aux_fn(params, batch):
  return loss_fn(params, batch), {"n": batch["x"].shape[0]}
batch = {"x": jnp.linspace(-1, 1, 24).reshape(8, 3), "y": jnp.ones((8, 1))}
batches = jax.tree.map(lambda x: jnp.stack([x] * 4), batch)
stacked_params = jax.tree.map(lambda x: jnp.stack([x] * 3), params)
stacked_batches = jax.tree.map(lambda x: jnp.stack([x] * 3), batch)
"""


def _readme_block(after: str, containing: str) -> str:
  readme = (ROOT / "README.md").read_text()
  section = readme.split(after, 1)[1]
  blocks = python_blocks_of(section)
  return next(b for b in blocks if containing in b)


def python_blocks_of(text: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_training_snippets_run():
  ns: dict = {}
  exec(README_SETUP, ns)
  for after, containing in [
    ("## Quick start", "def train_step"),
    ("## Quick start", "ols.skip_stats(opt_state)"),
    ("### Training loops", "def scan_body"),
    ("### Scaling out", "jax.pmap"),
  ]:
    exec(_readme_block(after, containing), ns)
  fsdp_ns: dict = {}
  exec(README_SETUP, fsdp_ns)
  exec(_readme_block("### Scaling out", "fsdp_step"), fsdp_ns)
  spec = fsdp_ns["params"]["w"].sharding.spec
  assert tuple(spec)[:1] == ("data",), spec
  assert fsdp_ns["ols"].loss_scale(fsdp_ns["opt_state"]) == 2.0**15
  n = ns["jax"].local_device_count()
  assert ns["losses"].shape == (3,)  # the ensemble's losses, one per member
  assert ns["ols"].loss_scale(ns["states"]).shape == (3,)
  assert ns["ols"].loss_scale(ns["replicated_state"]).shape == (n,)
  assert ns["state"].step == 1  # the TrainState took its step
