"""Smoke tests: each benchmark runs with `--tiny` and reports numbers.

Timings are never asserted (shared, noisy machines); only that the scripts
run end to end and return finite measurements, and, for the sharded
benchmark, the structural claims of docs/scaling.md (no gradient moves between
devices: op kinds counted in the compiled HLO, shardings, temporaries).
"""

import contextlib
import io
import itertools
import math
import pathlib

import _hlo
import jax
import jax.numpy as jnp
import pytest
from _helpers import load_file, rewrite_off

import optax_lossscale as ols

# The benchmarks time the package as it runs here, with its CPU check.
pytestmark = pytest.mark.cpu_check_form

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name):
  return load_file(BENCH / f"{name}.py", f"_bench_{name}")


@pytest.mark.slow
def test_overhead_tiny(capsys):
  results = _load("overhead").main(["--tiny", "--chained", "2"])
  out = capsys.readouterr().out
  assert "device:" in out and "jax" in out
  variants = {r["variant"] for r in results}
  assert {
    "plain",
    "ours",
    "ours_select_after",
    "usual_where",
    "apply_if_finite",
    "jmp",
    "flax",
  } <= variants
  for r in results:
    assert r["median_s"] > 0 and math.isfinite(r["ratio"])
    assert math.isfinite(r["compile_ratio"])
    assert math.isfinite(r["chained_ratio"])
    assert r["copies"] >= 0 and r["temp_bytes"] >= 0
  plain = next(r for r in results if r["variant"] == "plain")
  assert plain["ratio"] == pytest.approx(1.0)


@pytest.mark.parametrize("opt", ["adam", "sgdm"])
def test_select_after_is_the_step_with_the_rewrite_off(opt, monkeypatch):
  """`ours_select_after`, made of public pieces, compiles to the program of
  `loss_scale_optimizer`'s step with the skip's rewrite switched off: the
  same operations of each kind."""
  overhead = _load("overhead")
  inner = overhead.inner_of(opt)
  sizes = overhead.leaf_sizes(10_000, 5)
  params = overhead.make_params(sizes)
  grads = [jnp.full((s,), 0.5, jnp.float16) for s in sizes]

  def compiled(init, step):
    args = (params, init(params), grads)
    return jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()

  public = compiled(*overhead.select_after(inner))
  rewrite_off(monkeypatch)
  switched_off = compiled(*overhead.optax_step(ols.loss_scale_optimizer(inner)))
  assert _hlo.hlo_opcodes(public) == _hlo.hlo_opcodes(switched_off)


@pytest.mark.slow
def test_compile_time_tiny(capsys):
  module = _load("compile_time")
  found = module.main(["--tiny"])
  out = capsys.readouterr().out
  assert "device:" in out and "ours - apply_if_finite" in out
  ((blocks, run),) = found.items()
  assert run["leaves"] == 12 * blocks + 4
  results = run["results"]
  assert set(results) == set(module.VARIANTS)
  assert results["plain"]["ratio"] == pytest.approx(1.0)
  for r in results.values():
    assert r["cpu"] > 0 and r["wall"] > 0 and r["spread"] >= 0
    assert math.isfinite(r["ratio"])
  assert isinstance(module.target_met(results), bool)


@pytest.mark.slow
def test_leaf_stats_tiny(capsys):
  results = _load("leaf_stats").main(["--tiny"])
  out = capsys.readouterr().out
  assert "device:" in out and "leaf_stats" in out
  for seconds in (*results["run_s"].values(), *results["compile_s"].values()):
    assert seconds > 0 and math.isfinite(seconds)
  fusions = results["fusions"]
  assert 0 < fusions["default"] <= fusions["leaf_stats"]


def test_compile_time_gpt_has_148_leaves_at_12_blocks():
  """The model the compile-time target is stated for."""
  module = _load("compile_time")
  params = jax.eval_shape(
    lambda: module.gpt_params(
      jax.random.PRNGKey(0), blocks=12, width=8, vocab=16, context=4
    )
  )
  assert len(jax.tree.leaves(params)) == 148


@pytest.mark.slow
def test_train_step_tiny(capsys):
  results = _load("train_step").main(["--tiny", "--chained", "2"])
  out = capsys.readouterr().out
  assert "overhead" in out
  assert set(results) == {"mlp", "transformer", "transformer12"}
  assert results["transformer12"]["leaves"] > results["transformer"]["leaves"]
  for r in results.values():
    assert r["plain_s"] > 0 and r["scaled_s"] > 0
    assert math.isfinite(r["overhead"]) and r["params"] > 0
    assert math.isfinite(r["chained_overhead"])
    assert r["compile_ratio"] > 0


@pytest.mark.slow
@pytest.mark.skipif(
  jax.default_backend() == "cpu"
  and tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 8),
  reason="jaxlib < 0.8 records no per-kernel events in CPU profiles",
)
def test_device_time_tiny(capsys):
  results = _load("device_time").main(["--tiny"])
  out = capsys.readouterr().out
  assert "device us" in out
  assert {"train step mlp", "train step transformer"} <= set(results)
  for res in results.values():
    assert set(res) >= {"plain"} and len(res) >= 2
    for seconds, kernels in res.values():
      assert seconds > 0 and kernels > 0


@pytest.fixture(scope="module")
def sharded_tiny():
  """One tiny run of benchmarks/sharded.py (8 devices, from conftest):
  `(results, printed report)`."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    results = _load("sharded").main(["--tiny"])
  return results, out.getvalue()


def _by_case(results):
  cases = {}
  for r in results:
    cases.setdefault((r["mesh"], r["layout"], r["opt"]), {})[r["recipe"]] = r
  return cases


@pytest.mark.slow
def test_sharded_tiny_report(sharded_tiny):
  results, out = sharded_tiny
  assert "device: 8 x" in out and "jax" in out
  cases = _by_case(results)
  assert set(cases) == set(
    itertools.product(("auto", "explicit"), ("fsdp", "tp"), ("adam", "sgdm"))
  )
  kinds = {
    "all-gather",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
  }
  for case, rows in cases.items():
    assert set(rows) == {"plain", "ours", "jmp", "flax"}, case
    assert rows["plain"]["error"] is None, case
    assert rows["plain"]["ratio"] == pytest.approx(1.0)
    assert rows["plain"]["shardings_kept"]
    for recipe, r in rows.items():
      if r["error"] is not None:  # reported in its row, not raised
        assert f"{recipe:<6} error: " in out
        continue
      assert r["median_s"] > 0 and math.isfinite(r["ratio"]), (case, recipe)
      assert math.isfinite(r["compile_ratio"])
      assert set(r["collectives"]) == kinds
      assert all(n >= 0 for n in r["collectives"].values())
      assert r["temp_bytes"] >= 0 and r["wide_all_reduces"] >= 0
      assert isinstance(r["shardings_kept"], bool)
      assert r["sharded_leaves"] > 0


@pytest.mark.slow
def test_sharded_tiny_structural_claims(sharded_tiny):
  """On Auto and Explicit meshes, FSDP and tensor-parallel, adam and sgd
  with momentum, the loss-scaled step runs; its outputs keep plain optax's
  shardings; it adds no collective that moves gradients (all-gather,
  all-to-all, collective-permute, reduce-scatter), and at most a few
  all-reduces, each of a scalar."""
  results, _ = sharded_tiny
  for case, rows in _by_case(results).items():
    plain, ours = rows["plain"], rows["ours"]
    assert ours["error"] is None, (case, ours["error"])
    assert ours["shardings_kept"], (case, ours["differing"])
    extra = ours["extra_collectives"]
    for kind in (
      "all-gather",
      "all-to-all",
      "collective-permute",
      "reduce-scatter",
    ):
      assert extra[kind] <= 0, (
        case,
        kind,
        ours["collectives"],
        plain["collectives"],
      )
    # One pmin on an Explicit mesh; on an Auto mesh one scalar per leaf and
    # mesh axis at most, which XLA from jax 0.8 on combines.
    most = (
      1
      if case[0] == "explicit"
      else ours["leaves"] * (1 if case[1] == "fsdp" else 2)
    )
    assert extra["all-reduce"] <= most, (case, ours["collectives"])
    assert ours["wide_all_reduces"] <= plain["wide_all_reduces"], case


_OLD_XLA = tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 8)


def _assert_no_gradient_sized_temporary(results):
  too_large = []
  for case, rows in _by_case(results).items():
    plain, ours = rows["plain"], rows["ours"]
    # The smallest per-device shard of one float32 gradient leaf (fsdp: 8
    # devices): a temporary this large would be a gradient-sized one.
    shard_bytes = ours["size"] ** 2 * 4 // 8
    if ours["temp_bytes"] - plain["temp_bytes"] >= shard_bytes:
      too_large.append((case, ours["temp_bytes"], plain["temp_bytes"]))
  if _OLD_XLA and too_large and all(c[0][0] == "auto" for c in too_large):
    pytest.xfail(
      "open with jax < 0.8 on CPU: XLA materializes the input of"
      f" the per-leaf sum on Auto meshes: {too_large}"
    )
  assert not too_large


@pytest.mark.slow
def test_sharded_tiny_no_gradient_sized_temporary(sharded_tiny):
  """The loss-scaled step adds no gradient-sized temporary per device."""
  _assert_no_gradient_sized_temporary(sharded_tiny[0])


@pytest.mark.slow
@pytest.mark.xfail(
  strict=True,
  reason="issue 11: with shards of 2,048 elements per device (128x128"
  " leaves over 8 devices), the Auto FSDP step materializes each gradient"
  " shard; from 192x192 leaves up it does not",
)
def test_sharded_small_shards_no_gradient_sized_temporary():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    results = _load("sharded").main(
      [
        "--tiny",
        "--size",
        "128",
        "--mesh",
        "auto",
        "--layout",
        "fsdp",
        "--recipes",
        "ours",
        "--rounds",
        "1",
      ]
    )
  _assert_no_gradient_sized_temporary(results)


@pytest.mark.slow  # compiles five variants of two models
def test_autocast_tiny(capsys):
  results = _load("autocast").main(["--tiny"])
  out = capsys.readouterr().out
  assert "device:" in out and "by_hand" in out
  assert "autocast compiles to the same operations" in out
  for model, variants in results.items():
    ours, theirs = variants["autocast"], variants["by_hand"]
    # The same float16 products as the policy written by hand, and no
    # float32 one; float32 has no float16 product.
    assert ours["products"] == theirs["products"], model
    assert ours["operations"] == theirs["operations"], model
    assert ours["temp_bytes"] == theirs["temp_bytes"], model
    assert set(ours["products"]) == {"float16"}, model
    assert set(variants["float32"]["products"]) == {"float32"}, model
    assert set(variants["cast"]["products"]) == {"float16"}, model
    for r in variants.values():
      assert r["run_s"] > 0 and r["compile_s"] > 0
      assert r["temp_bytes"] >= 0
    # Casting everything keeps fewer residual bytes than float32 does.
    saved = {name: r["saved_bytes"] for name, r in variants.items()}
    assert 0 < saved["float16"] < saved["float32"], (model, saved)
  assert set(results) == {"mlp", "transformer", "gpt2"}


def test_autocast_saved_tiny(capsys):
  # Traced only: the bytes each variant's backward pass keeps.
  found = _load("autocast").main(["--tiny", "--saved"])
  assert "saved:" in capsys.readouterr().out
  assert set(found) == {"mlp", "transformer", "gpt2"}
  for model, saved in found.items():
    assert 0 < saved["float16"] < saved["float32"], (model, saved)
    assert saved["cast"] < saved["float32"], (model, saved)


@pytest.mark.slow
def test_finder_cost_tiny(capsys):
  # One find_overflow call against a plain value_and_grad's first call,
  # each in a fresh process; no timing is asserted.
  runs = _load("finder_cost").main(["--tiny"])
  out = capsys.readouterr().out
  assert "finder / plain, wall" in out and "finder / plain, cpu" in out
  (plain,), (finder,) = runs["plain"], runs["finder"]
  assert plain["parameters"] == finder["parameters"] == 3 * 32 * 32
  assert finder["found"] is False  # the tiny MLP is healthy
  runs = _load("finder_cost").main(["--tiny", "--scale", "1e30"])
  assert "found an overflow" in capsys.readouterr().out
  assert runs["finder"][0]["found"] is True  # its backward pass at 1e30
