"""Float16 with and without loss scaling, on a small character-level LM.

A small-scale check of the claims behind this library (Micikevicius et al.,
2018, "Mixed Precision Training"): in float16, small gradients flush to zero
below 2**-24 and training loses accuracy; scaling the loss keeps them in
range. Too large a scale overflows (65504 is float16's largest number), so
a static scale works only inside a window; dynamic loss scaling finds that
window by itself, backing off on overflow and growing after a run of finite
steps.

Task: a character-level language model over Python's own standard-library
source files (they ship with every Python, nothing is downloaded). The
model is an MLP over the previous ``context`` characters (Bengio et al.
style): embedding -> ``depth`` tanh layers -> softmax over the vocabulary.
The loss is the usual *token-level mean* cross-entropy over a large batch of
positions (2**17 tokens by default, e.g. 64 sequences of 2048). That mean is
where underflow comes from: the gradient reaching each logit is
``(softmax - onehot) / n_tokens``, so with 2**17 tokens every logit gradient
is below 2**-17, deep in float16's subnormal range (normal numbers start at
2**-14; a subnormal near 2**-20 keeps only 4 significant bits), and that of
a character of probability p is ``p * 2**-17``, rounded to zero once it is
below 2**-25 (half the smallest subnormal 2**-24), i.e. once p < 2**-8. The
backward pass through the float16 layers multiplies those already-subnormal
values by weights and tanh derivatives, and more of them vanish.

Float16 here is what practitioners do: float32 master weights, cast to
float16 *inside* the differentiated function (so the backward pass runs in
float16), logits cast back to float32 for the softmax and the float32 mean,
and the float16 gradients cast back to float32 for Adam.

The main job (``python notebooks/fp16_study.py``, about 2 minutes on two
CPU cores) trains five runs, same seeds, same batches, same steps:

  * ``fp32``:             everything float32;
  * ``fp16``:             float16 compute, no loss scaling;
  * ``fp16_static``:      float16, static loss scale (``--static-scale``);
  * ``fp16_dynamic``:     float16, ``loss_scale_optimizer`` at its defaults
                          (2**15, growth after 2000 finite steps);
  * ``fp16_dynamic_g5``:  the same from ``--dynamic-scale`` (2**15) with
                          growth after ``--growth-steps`` (5) finite steps,
                          so that the scale moves within the short run: it
                          grows, overflows, backs off.

``--sweep`` runs the whole study instead (see RESULTS.md for its time): static
scales 2**0 .. 2**30, dynamic runs from 2**0, 2**15 and 2**32, the sawtooth
with a short growth interval against the default one, and a data-parallel
token mean (``--replicas``) where plain float16 breaks down. ``--json PATH``
writes every number (per-step curves included) to PATH.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
  import optax_lossscale as ols
except ImportError:  # run from a checkout without installing it
  sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  )
  import optax_lossscale as ols

RUNS = ("fp32", "fp16", "fp16_static", "fp16_dynamic", "fp16_dynamic_g5")

# Standard-library modules whose source is the corpus (present in every
# CPython 3.11+; the text differs slightly between versions).
CORPUS_FILES = (
  "argparse.py",
  "textwrap.py",
  "difflib.py",
  "typing.py",
  "inspect.py",
  "dataclasses.py",
  "functools.py",
  "pathlib.py",
  "shutil.py",
  "subprocess.py",
  "tarfile.py",
  "zipfile/__init__.py",
  "logging/__init__.py",
  "json/decoder.py",
  "json/encoder.py",
  "collections/__init__.py",
)

F16_TINY = 2.0**-24  # smallest positive (subnormal) float16
F16_NORMAL_MIN = 2.0**-14  # smallest positive normal float16
F16_MAX = 65504.0


# ---------------------------------------------------------------- data


def load_corpus(max_chars: int | None = None):
  """Stdlib source text as int32 tokens; vocabulary: printable ASCII,
  newline, and one 'other' symbol (index 0)."""
  root = os.path.dirname(os.__file__)
  texts = []
  for name in CORPUS_FILES:
    path = os.path.join(root, name)
    if os.path.exists(path):
      with open(path, encoding="utf-8", errors="replace") as f:
        texts.append(f.read())
  text = "\n".join(texts)
  if max_chars is not None:
    text = text[:max_chars]
  chars = ["\0", "\n"] + [chr(c) for c in range(32, 127)]
  index = {c: i for i, c in enumerate(chars)}
  tokens = np.array([index.get(c, 0) for c in text], dtype=np.int32)
  return tokens, len(chars)


# ---------------------------------------------------------------- model


def init_params(key, vocab, context, embed, width, depth):
  keys = jax.random.split(key, depth + 2)
  params = {"embed": 0.5 * jax.random.normal(keys[0], (vocab, embed))}
  fan_in = context * embed
  for i in range(depth):
    params[f"h{i}"] = {
      "w": jax.random.normal(keys[i + 1], (fan_in, width)) / np.sqrt(fan_in),
      "b": jnp.zeros((width,)),
    }
    fan_in = width
  params["out"] = {
    "w": jax.random.normal(keys[-1], (fan_in, vocab)) / np.sqrt(fan_in),
    "b": jnp.zeros((vocab,)),
  }
  return params


def apply(params, x, depth, taps=None):
  """Logits, in the params' dtype; ``x`` is ``[batch, context]`` int32.
  ``taps`` (zeros, one per pre-activation and one for the logits) exist only
  so that the gradients w.r.t. activations can be read off."""
  dtype = params["embed"].dtype
  tap = (lambda i: 0) if taps is None else (lambda i: taps[i].astype(dtype))
  h = params["embed"][x].reshape(x.shape[0], -1)
  for i in range(depth):
    layer = params[f"h{i}"]
    h = jnp.tanh(h @ layer["w"] + layer["b"] + tap(i))
  return h @ params["out"]["w"] + params["out"]["b"] + tap(depth)


def loss_fn(params, x, y, taps=None, *, depth, compute_dtype, replicas=1):
  """Token-level mean cross-entropy. The float32 master params are cast to
  ``compute_dtype`` here, inside the differentiated function, so that the
  backward pass runs (and rounds) in ``compute_dtype``; the logits go back
  to float32 for the softmax and the mean.

  With ``replicas = R > 1`` this is one data-parallel replica's share of a
  global token mean: its tokens' summed loss divided by ``R`` times its own
  token count (the global count when every replica holds as many)."""
  p = jax.tree.map(lambda a: a.astype(compute_dtype), params)
  logits = apply(p, x, depth, taps).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, y[:, None], axis=1)
  return jnp.sum(nll) / (nll.size * replicas)


# ---------------------------------------------------------------- training


def make_batch(key, tokens, batch, context):
  starts = jax.random.randint(key, (batch,), 0, tokens.shape[0] - context - 1)
  idx = starts[:, None] + jnp.arange(context + 1)[None, :]
  window = tokens[idx]
  return window[:, :context], window[:, context]


# A run is described by a spec: ``dtype`` ("float32" or "float16") and, for
# the loss-scaled runs, ``dynamic``, ``initial_scale`` and ``growth_steps``
# (None: the default 2000), the arguments of ``loss_scale_optimizer``.


def fp32_spec():
  return {"dtype": "float32"}


def fp16_spec():
  return {"dtype": "float16"}


def static_spec(scale):
  return {"dtype": "float16", "dynamic": False, "initial_scale": float(scale)}


def dynamic_spec(scale=None, growth_steps=None):
  return {
    "dtype": "float16",
    "dynamic": True,
    "initial_scale": None if scale is None else float(scale),
    "growth_steps": growth_steps,
  }


def _scaled(spec):
  return "dynamic" in spec


def make_optimizer(spec, lr):
  inner = optax.adam(lr)
  if not _scaled(spec):
    return inner
  if spec["dynamic"]:
    return ols.loss_scale_optimizer(
      inner,
      initial_scale=spec["initial_scale"],
      dynamic_growth_steps=spec["growth_steps"],
    )
  return ols.loss_scale_optimizer(
    inner, dynamic=False, initial_scale=spec["initial_scale"]
  )


def _scale_of(spec, opt_state):
  if _scaled(spec):
    return ols.loss_scale(opt_state)
  return jnp.float32(1.0)


def _loss(spec, cfg):
  dtype = jnp.float32 if spec["dtype"] == "float32" else jnp.float16
  return functools.partial(
    loss_fn, depth=cfg["depth"], compute_dtype=dtype, replicas=cfg["replicas"]
  )


def grads_for(spec, params, opt_state, x, y, cfg):
  """The float32 view of the gradients the run's update would receive
  (scaled for the loss-scaled runs), and the loss (this replica's share)."""
  f = _loss(spec, cfg)
  if _scaled(spec):
    return ols.value_and_grad(f)(opt_state, params, x, y)
  return jax.value_and_grad(f)(params, x, y)


def _flat(tree):
  return jnp.concatenate([g.ravel() for g in jax.tree.leaves(tree)])


def _zero_taps(params, x, depth):
  width = params["h0"]["w"].shape[1]
  vocab = params["out"]["w"].shape[1]
  return [jnp.zeros((x.shape[0], width))] * depth + [
    jnp.zeros((x.shape[0], vocab))
  ]


def flush_stats(spec, params, opt_state, x, y, cfg):
  """Compares the run's float16 gradients with float32 gradients of the same
  params and batch, at the run's scale. Parameter gradients (``flushed``,
  ``nonfinite``) and activation gradients (``act_*``: the cotangents of
  every pre-activation and of the logits, per token, where the paper
  locates the underflow): of the elements nonzero in float32, the share
  that are zero in float16 (flushed); of all elements, the share that are
  inf or NaN (overflowed); and the share of float32 magnitudes (times the
  scale) below 2**-24 and 2**-14."""
  scale = _scale_of(spec, opt_state)
  f32 = _loss(fp32_spec(), cfg)
  g32 = _flat(jax.grad(f32)(params, x, y))
  nz = g32 != 0
  out = {
    "below_tiny": jnp.sum(nz & (jnp.abs(g32) * scale < F16_TINY)) / nz.sum(),
    "below_normal": (
      jnp.sum(nz & (jnp.abs(g32) * scale < F16_NORMAL_MIN)) / nz.sum()
    ),
  }
  taps = _zero_taps(params, x, cfg["depth"])
  a32 = _flat(jax.grad(f32, argnums=3)(params, x, y, taps))
  anz = a32 != 0
  out["act_below_normal"] = (
    jnp.sum(anz & (jnp.abs(a32) * scale < F16_NORMAL_MIN)) / anz.sum()
  )
  if spec["dtype"] == "float32":
    for k in ("flushed", "nonfinite", "act_flushed", "act_nonfinite"):
      out[k] = jnp.float32(jnp.nan)
    return out
  _, g16 = grads_for(spec, params, opt_state, x, y, cfg)
  g16 = _flat(g16)
  out["flushed"] = jnp.sum(nz & (g16 == 0)) / nz.sum()
  out["nonfinite"] = jnp.mean(~jnp.isfinite(g16))
  f16 = _loss(spec, cfg)
  a16 = _flat(
    jax.grad(lambda *a: f16(*a) * scale, argnums=3)(params, x, y, taps)
  )
  out["act_flushed"] = jnp.sum(anz & (a16 == 0)) / anz.sum()
  out["act_nonfinite"] = jnp.mean(~jnp.isfinite(a16))
  return out


def gradient_magnitudes(spec, params, opt_state, x, y, cfg):
  """All parameter-gradient magnitudes (flattened numpy, float32) the run's
  update would receive, and the float32 reference times the run's scale."""
  scale = _scale_of(spec, opt_state)
  g32 = jax.grad(_loss(fp32_spec(), cfg))(params, x, y)
  _, g = grads_for(spec, params, opt_state, x, y, cfg)
  flat = lambda t: np.abs(np.asarray(_flat(t), np.float32))  # noqa: E731
  return flat(g), flat(g32) * float(scale)


def activation_gradient_magnitudes(spec, params, opt_state, x, y, cfg):
  """Magnitudes of the activation gradients (every pre-activation and the
  logits, per token) as the run's float16 backward pass holds them (times
  its scale), and the float32 reference times the same scale."""
  scale = float(_scale_of(spec, opt_state))
  taps = _zero_taps(params, x, cfg["depth"])
  flat = lambda t: np.abs(np.asarray(_flat(t), np.float32))  # noqa: E731
  g32 = jax.grad(_loss(fp32_spec(), cfg), argnums=3)(params, x, y, taps)
  f = _loss(spec, cfg)
  g = jax.grad(lambda *a: f(*a) * scale, argnums=3)(params, x, y, taps)
  return flat(g), flat(g32) * scale


def make_chunk(spec, tx, tokens, cfg):
  """A jitted function running ``chunk`` training steps with lax.scan. With
  ``replicas = R``, the gradients (this replica's share of the global mean)
  are multiplied by R in float32 before the update: the all-reduce sum over
  R replicas, here all holding the same batch."""
  batch, context, replicas = cfg["batch"], cfg["context"], cfg["replicas"]

  def step(carry, key):
    params, opt_state = carry
    x, y = make_batch(key, tokens, batch, context)
    loss, grads = grads_for(spec, params, opt_state, x, y, cfg)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * replicas, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if _scaled(spec):
      scale = ols.loss_scale(opt_state)
      skipped = ~ols.skip_stats(opt_state).last_finite
    else:
      scale, skipped = jnp.float32(1.0), ~ols.all_finite(grads)
    return (params, opt_state), (loss * replicas, scale, skipped)

  @jax.jit
  def chunk(params, opt_state, keys):
    return jax.lax.scan(step, (params, opt_state), keys)

  return chunk


def evaluate(params, x, y, depth):
  """Held-out loss in float32 (nats per char) and next-char accuracy."""
  logits = apply(params, x, depth)
  logp = jax.nn.log_softmax(logits)
  loss = -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
  acc = jnp.mean(jnp.argmax(logits, -1) == y)
  return loss, acc


DEFAULTS = dict(
  steps=40,
  batch=131072,
  context=8,
  embed=16,
  width=32,
  depth=4,
  lr=3e-3,
  static_scale=2.0**10,
  dynamic_scale=2.0**15,
  growth_steps=5,
  replicas=1,
  seed=0,
  chunk=10,
  n_checkpoints=2,
  eval_tokens=32768,
  max_chars=None,
)


def prepare(steps=DEFAULTS["steps"], **overrides):
  """Config, data, initial parameters and per-step keys shared by every run
  (so every run sees the same batches)."""
  cfg = dict(DEFAULTS, **overrides, steps=steps)
  chunk_len = min(cfg["chunk"], steps)
  n_chunks = -(-steps // chunk_len)
  cfg["steps"], cfg["chunk"] = n_chunks * chunk_len, chunk_len
  tokens_np, vocab = load_corpus(cfg["max_chars"])
  cfg["vocab"], cfg["corpus_chars"] = vocab, int(tokens_np.size)
  # Hold out the last 10% of the corpus.
  split = int(tokens_np.size * 0.9)
  train, held = jnp.asarray(tokens_np[:split]), jnp.asarray(tokens_np[split:])
  key = jax.random.PRNGKey(cfg["seed"])
  k_init, k_data, k_eval, k_probe = jax.random.split(key, 4)
  params0 = init_params(
    k_init, vocab, cfg["context"], cfg["embed"], cfg["width"], cfg["depth"]
  )
  # Flush statistics after 1/k, 2/k, ..., k/k of the training (k =
  # n_checkpoints), on one fixed training batch.
  checkpoints = sorted(
    set(
      np.linspace(0, n_chunks, cfg["n_checkpoints"] + 1)[1:]
      .round()
      .astype(int)
      .tolist()
    )
  )
  return {
    "cfg": cfg,
    "train": train,
    "params0": params0,
    "eval": make_batch(k_eval, held, cfg["eval_tokens"], cfg["context"]),
    "probe": make_batch(k_probe, train, cfg["batch"], cfg["context"]),
    "keys": jax.random.split(k_data, cfg["steps"]).reshape(
      n_chunks, chunk_len, -1
    ),
    "checkpoints": checkpoints,
    "eval_fn": jax.jit(functools.partial(evaluate, depth=cfg["depth"])),
  }


def train(setup, spec, progress=None, name="", keep_params=False) -> dict:
  """Trains one run; returns its curves (``loss``, ``scale`` and ``skipped``
  per step), held-out ``eval_loss`` and ``eval_acc``, ``flush`` statistics
  at the checkpoints and their means, ``skipped_total``, ``backoffs``,
  ``growths``, ``final_scale`` and ``seconds``."""
  cfg = setup["cfg"]
  t0 = time.perf_counter()
  tx = make_optimizer(spec, cfg["lr"])
  params, opt_state = setup["params0"], tx.init(setup["params0"])
  chunk = make_chunk(spec, tx, setup["train"], cfg)
  flush_fn = jax.jit(functools.partial(flush_stats, spec, cfg=cfg))
  keys = setup["keys"]
  losses, scales, skipped, flush = [], [], [], []
  for c in range(len(keys) + 1):
    if c in setup["checkpoints"]:
      stats = {
        k: float(v)
        for k, v in flush_fn(params, opt_state, *setup["probe"]).items()
      }
      flush.append({"step": c * cfg["chunk"], **stats})
    if c == len(keys):
      break
    (params, opt_state), (loss, s, k) = chunk(params, opt_state, keys[c])
    losses.append(np.asarray(loss))
    scales.append(np.asarray(s))
    skipped.append(np.asarray(k))
    if progress is not None:
      progress(name, cfg["chunk"])
  scales = np.concatenate(scales)
  eval_loss, eval_acc = (
    float(v) for v in setup["eval_fn"](params, *setup["eval"])
  )
  init = float(_scale_of(spec, tx.init(setup["params0"])))
  prev = np.concatenate([[init], scales[:-1]])
  mean = lambda k: float(np.mean([f[k] for f in flush]))  # noqa: E731
  rec = {
    "spec": spec,
    "loss": np.concatenate(losses),
    "scale": scales,
    "skipped": np.concatenate(skipped),
    "eval_loss": eval_loss,
    "eval_acc": eval_acc,
    "flush": flush,
    "flushed_mean": mean("flushed"),
    "act_flushed_mean": mean("act_flushed"),
    "act_nonfinite_mean": mean("act_nonfinite"),
    "initial_scale": init,
    "backoffs": int(np.sum(scales < prev)),
    "growths": int(np.sum(scales > prev)),
    "final_scale": float(scales[-1]),
  }
  rec["skipped_total"] = int(rec["skipped"].sum())
  rec["seconds"] = time.perf_counter() - t0
  if keep_params:
    rec["params"], rec["opt_state"] = params, opt_state
  return rec


def main_specs(cfg):
  return {
    "fp32": fp32_spec(),
    "fp16": fp16_spec(),
    "fp16_static": static_spec(cfg["static_scale"]),
    "fp16_dynamic": dynamic_spec(),
    "fp16_dynamic_g5": dynamic_spec(cfg["dynamic_scale"], cfg["growth_steps"]),
  }


def run_study(
  steps: int = DEFAULTS["steps"],
  runs=RUNS,
  progress=None,
  keep_params: bool = False,
  **overrides,
) -> dict:
  """The main job: trains the five runs. Returns ``config``, ``runs`` (per
  run, what ``train`` returns), ``summary`` rows for the table, and the
  ``probe_batch`` the flush statistics use."""
  setup = prepare(steps, **overrides)
  cfg = setup["cfg"]
  specs = main_specs(cfg)
  out = {"config": cfg, "runs": {}}
  for run in runs:
    out["runs"][run] = train(setup, specs[run], progress, run, keep_params)
  ref = out["runs"].get("fp32")
  out["summary"] = [
    {
      "run": run,
      "eval_loss": r["eval_loss"],
      "eval_acc": r["eval_acc"],
      "vs_fp32": (r["eval_loss"] - ref["eval_loss"]) if ref else float("nan"),
      "flushed_pct": 100 * r["flushed_mean"],
      "act_flushed_pct": 100 * r["act_flushed_mean"],
      "skipped": r["skipped_total"],
      "final_scale": r["final_scale"],
    }
    for run, r in out["runs"].items()
  ]
  out["probe_batch"] = setup["probe"]
  return out


# ---------------------------------------------------------------- sweep

SWEEP = dict(
  steps=100,
  # static scales 2**0, 2**2, ..., 2**30, and every power of two at the
  # window's edges
  static_log2=(
    0,
    1,
    2,
    3,
    4,
    6,
    8,
    10,
    12,
    14,
    16,
    17,
    18,
    19,
    20,
    22,
    24,
    26,
    28,
    30,
  ),
  # dynamic runs: (initial scale, growth interval; None = Keras's 2000)
  dynamic=(
    (1.0, 20),
    (2.0**15, 20),
    (2.0**32, 20),
    (2.0**15, None),
    (2.0**32, None),
  ),
  # the usable window: held-out loss within this of float32 (nats/char)
  tol=0.005,
  # the data-parallel token mean: replicas sharing one global mean
  replicas=64,
  divergence=("fp32", "fp16", "fp16_dynamic"),
  # the sawtooth: longer, growth every 20 finite steps against 2000
  sawtooth_steps=300,
  sawtooth=((2.0**15, 20), (2.0**15, None)),
)


def _dyn_name(scale, growth):
  g = "2000" if growth is None else str(growth)
  return f"dyn 2**{int(math.log2(scale))} g{g}"


def sweep_runs(sweep=SWEEP):
  """The names and specs of the sweep's runs, in order."""
  runs = {"fp32": fp32_spec(), "fp16": fp16_spec()}
  for e in sweep["static_log2"]:
    runs[f"static 2**{e}"] = static_spec(2.0**e)
  for scale, growth in sweep["dynamic"]:
    runs[_dyn_name(scale, growth)] = dynamic_spec(scale, growth)
  return runs


def find_window(static, ref, tol):
  """The usable window: the longest run of consecutive grid scales whose
  held-out loss is within ``tol`` of float32 (``static`` maps scale ->
  record, in increasing order). Returns (low, high) or None."""
  best, cur = None, []
  for s, r in static.items():
    if abs(r["eval_loss"] - ref) <= tol:
      cur.append(s)
      if best is None or len(cur) > len(best):
        best = list(cur)
    else:
      cur = []
  return None if best is None else (best[0], best[-1])


def landing(rec, window):
  """Steps (and skipped steps among them) until the scale first lies in the
  window, and the share of the later steps it stays there; None if never."""
  lo, hi = window
  inside = (rec["scale"] >= lo) & (rec["scale"] <= hi)
  if not inside.any():
    return None
  first = int(np.argmax(inside))
  return {
    "steps": first + 1,
    "skips": int(rec["skipped"][: first + 1].sum()),
    "stays": float(inside[first:].mean()),
  }


def run_sweep(sweep=SWEEP, progress=None, **overrides) -> dict:
  """The whole study: the static window, dynamic runs from both sides, the
  sawtooth, and the data-parallel token mean."""
  setup = prepare(sweep["steps"], n_checkpoints=1, **overrides)
  cfg = setup["cfg"]
  runs = {}
  for name, spec in sweep_runs(sweep).items():
    runs[name] = train(setup, spec, progress, name)
  out = finish_sweep({"config": cfg, "sweep": dict(sweep), "runs": runs})
  if sweep["sawtooth_steps"]:
    setup = prepare(sweep["sawtooth_steps"], n_checkpoints=1, **overrides)
    specs = {
      "fp32": fp32_spec(),
      **{_dyn_name(*sg): dynamic_spec(*sg) for sg in sweep["sawtooth"]},
    }
    out["sawtooth"] = {
      name: train(setup, spec, progress, f"saw {name}")
      for name, spec in specs.items()
    }
  # Data-parallel: each replica's loss is divided by the global count.
  R = sweep["replicas"]
  if R:
    setup = prepare(sweep["steps"], n_checkpoints=1, replicas=R, **overrides)
    specs = main_specs(setup["cfg"])
    out["replicas"] = {
      name: train(setup, specs[name], progress, f"R={R} {name}")
      for name in sweep["divergence"]
    }
  return out


def finish_sweep(out):
  """Adds the window, the best static scale and the dynamic runs' landings
  to a sweep result, from its runs."""
  runs = out["runs"]
  static = {
    r["initial_scale"]: r for k, r in runs.items() if k.startswith("static")
  }
  static = dict(sorted(static.items()))
  out["window"] = out["best_static"] = None
  if static:
    out["window"] = find_window(
      static, runs["fp32"]["eval_loss"], out["sweep"]["tol"]
    )
    out["best_static"] = min(static, key=lambda s: static[s]["eval_loss"])
  if out["window"] is not None:
    out["landing"] = {
      name: landing(r, out["window"])
      for name, r in runs.items()
      if name.startswith("dyn ")
    }
  return out


def merge_sweeps(outs):
  """One sweep result from several (runs of the same config, e.g. the grid
  and its edges run separately): runs in static-scale order, the first
  record of each name kept."""
  runs = {}
  for o in outs:
    for k, r in o["runs"].items():
      runs.setdefault(k, r)

  def key(k):
    return (
      k.startswith("dyn"),
      runs[k]["initial_scale"] if k.startswith("static") else -1,
    )

  merged = {
    "config": outs[0]["config"],
    "sweep": dict(outs[0]["sweep"]),
    "runs": {k: runs[k] for k in sorted(runs, key=key)},
  }
  for o in outs:
    for part in ("sawtooth", "replicas"):
      if part in o:
        merged.setdefault(part, o[part])
  return finish_sweep(merged)


def sweep_steps(sweep=SWEEP):
  n = len(sweep_runs(sweep)) + (
    len(sweep["divergence"]) if sweep["replicas"] else 0
  )
  saw = (1 + len(sweep["sawtooth"])) * sweep["sawtooth_steps"]
  return n * sweep["steps"] + saw


# ---------------------------------------------------------------- report


def format_table(result) -> str:
  lines = [
    f"{'run':<14}{'eval loss':>10}{'vs fp32':>9}{'acc %':>7}"
    f"{'flushed % (param / act)':>25}{'skipped':>9}{'final scale':>13}",
  ]
  for row in result["summary"]:
    flushed = (
      "-"
      if np.isnan(row["flushed_pct"])
      else f"{row['flushed_pct']:.3f} / {row['act_flushed_pct']:.2f}"
    )
    lines.append(
      f"{row['run']:<14}{row['eval_loss']:>10.4f}{row['vs_fp32']:>+9.4f}"
      f"{100 * row['eval_acc']:>7.2f}{flushed:>25}{row['skipped']:>9d}"
      f"{row['final_scale']:>13g}"
    )
  return "\n".join(lines)


def pow2(x):
  """ "2**k" for a power of two."""
  return f"2**{math.log2(x):g}"


def format_scales(result) -> str:
  lines = []
  for run in ("fp16_static", "fp16_dynamic", "fp16_dynamic_g5"):
    r = result["runs"].get(run)
    if r is None:
      continue
    spec = r["spec"]
    how = (
      f"dynamic from {pow2(r['initial_scale'])}, growth every "
      f"{spec['growth_steps'] or 2000} finite steps"
      if spec["dynamic"]
      else f"static {pow2(r['initial_scale'])}"
    )
    n = len(r["scale"])
    at = sorted({0, 1, 2, 4, 8, n // 4, n // 2, 3 * n // 4, n - 1})
    traj = ", ".join(f"{i + 1}:{pow2(r['scale'][i])}" for i in at if i < n)
    lines.append(f"{run} ({how}): scale after step {traj}")
    lines.append(
      f"  backoffs {r['backoffs']}, growths {r['growths']},"
      f" skipped steps {r['skipped_total']}"
    )
  lines.append(
    "flushed % of activation (param) gradients per checkpoint,"
    " fp16 / static / dynamic / dynamic_g5:"
  )
  runs = [result["runs"][k] for k in RUNS[1:] if k in result["runs"]]
  if runs:
    for i, f in enumerate(runs[0]["flush"]):
      vals = " / ".join(
        f"{100 * r['flush'][i]['act_flushed']:.2f}"
        f" ({100 * r['flush'][i]['flushed']:.3f})"
        for r in runs
      )
      lines.append(f"  step {f['step']}: {vals}")
  return "\n".join(lines)


def format_sweep(out) -> str:
  cfg, sw = out["config"], out["sweep"]
  ref = out["runs"]["fp32"]["eval_loss"]
  lines = [
    f"{cfg['steps']} steps, {cfg['batch']} tokens per mean; usable:"
    f" held-out loss within {sw['tol']} of fp32 ({ref:.4f})",
    f"{'run':<16}{'eval loss':>10}{'vs fp32':>9}{'act flushed %':>14}"
    f"{'act overflow %':>15}{'skipped %':>10}{'final scale':>12}"
    f"{'backoffs':>9}{'growths':>8}",
  ]
  for name, r in out["runs"].items():
    fl = (
      "-"
      if np.isnan(r["act_flushed_mean"])
      else f"{100 * r['act_flushed_mean']:.2f}"
    )
    ov = (
      "-"
      if np.isnan(r["act_nonfinite_mean"])
      else f"{100 * r['act_nonfinite_mean']:.2f}"
    )
    lines.append(
      f"{name:<16}{r['eval_loss']:>10.4f}{r['eval_loss'] - ref:>+9.4f}"
      f"{fl:>14}{ov:>15}"
      f"{100 * r['skipped_total'] / len(r['skipped']):>10.1f}"
      f"{pow2(r['final_scale']):>12}{r['backoffs']:>9}{r['growths']:>8}"
    )
  w = out["window"]
  if w is None:
    lines.append("no static scale is usable")
  else:
    lines.append(
      f"window: {pow2(w[0])} .. {pow2(w[1])} "
      f"({math.log2(w[1] / w[0]):g} octaves); best static "
      f"{pow2(out['best_static'])}"
    )
    for name, land in out["landing"].items():
      r = out["runs"][name]
      if land is None:
        lines.append(
          f"  {name}: never in the window (ends at {pow2(r['final_scale'])})"
        )
      else:
        lines.append(
          f"  {name}: in the window after {land['steps']} steps "
          f"({land['skips']} skipped), stays {100 * land['stays']:.0f}% of"
          f" the rest; {r['skipped_total']} skipped in all"
        )
  if "sawtooth" in out:
    saw = out["sawtooth"]
    ref_s = saw["fp32"]["eval_loss"]
    lines.append(f"sawtooth, {len(saw['fp32']['loss'])} steps:")
    for name, r in saw.items():
      lines.append(
        f"  {name:<16} eval {r['eval_loss']:.4f}"
        f" ({r['eval_loss'] - ref_s:+.4f}); skipped {r['skipped_total']},"
        f" backoffs {r['backoffs']}, growths {r['growths']}, final scale"
        f" {pow2(r['final_scale'])}, skipped at steps "
        f"{(np.nonzero(r['skipped'])[0] + 1).tolist()}"
      )
  if "replicas" in out:
    rr = out["replicas"]
    R = out["sweep"]["replicas"]
    lines.append(
      f"data-parallel token mean: each of {R} replicas divides "
      f"its {cfg['batch']} tokens' loss by {R * cfg['batch']}"
    )
    ref_r = rr["fp32"]["eval_loss"]
    for name, r in rr.items():
      lo = r["loss"]
      fl = (
        "-"
        if np.isnan(r["act_flushed_mean"])
        else f"{100 * r['act_flushed_mean']:.2f}"
      )
      lines.append(
        f"  {name:<13} eval {r['eval_loss']:.4f}"
        f" ({r['eval_loss'] - ref_r:+.4f})"
        f", train loss min {lo.min():.4f} at step {int(lo.argmin()) + 1},"
        f" last {lo[-1]:.4f}; act flushed {fl}%, final scale "
        f"{pow2(r['final_scale'])}"
      )
  return "\n".join(lines)


def to_json(obj):
  """Numbers and per-step curves as plain JSON (NaN as null)."""
  if isinstance(obj, dict):
    return {
      str(k): to_json(v)
      for k, v in obj.items()
      if k not in ("params", "opt_state", "probe_batch")
    }
  if isinstance(obj, (list, tuple)):
    return [to_json(v) for v in obj]
  if isinstance(obj, np.ndarray):
    return to_json(obj.tolist())
  if isinstance(obj, (np.generic, jax.Array)):
    return to_json(obj.item())
  if isinstance(obj, float) and not math.isfinite(obj):
    return None
  return obj


def load_json(path):
  """A result saved with ``--json``, curves back as numpy arrays."""
  with open(path) as f:
    out = json.load(f)

  def fix(rec):
    for k in ("loss", "scale", "skipped"):
      rec[k] = np.asarray(rec[k])
    for k, v in rec.items():
      if v is None:
        rec[k] = float("nan")
    for f in rec.get("flush", []):
      for k, v in f.items():
        f[k] = float("nan") if v is None else v
    return rec

  for group in ("runs", "replicas", "sawtooth"):
    for rec in out.get(group, {}).values():
      fix(rec)
  if out.get("window") is not None:
    out["window"] = tuple(out["window"])
  return out


# ---------------------------------------------------------------- figures


def save_figure(result, path):
  """The main job's figure: gap to float32 per step, and the scale."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
  ref = result["runs"]["fp32"]["loss"]
  for run, r in result["runs"].items():
    # Same seed, same batches: the per-step difference to fp32 is the
    # effect of float16 alone.
    a.plot(np.arange(1, len(ref) + 1), r["loss"] - ref, label=run, lw=1.2)
  a.axhline(0, color="k", lw=0.5)
  a.set(
    xlabel="step",
    ylabel="train loss - fp32 train loss",
    title=f"char-LM, mean over {result['config']['batch']} tokens",
  )
  a.legend(fontsize=8)
  plot_scales(
    b, {k: result["runs"][k] for k in RUNS[2:] if k in result["runs"]}
  )
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def _shade(ax, window, axis="x"):
  if window is not None:
    lo, hi = np.log2(window[0]), np.log2(window[1])
    span = ax.axvspan if axis == "x" else ax.axhspan
    span(lo, hi, color="green", alpha=0.12, label="usable window")


def plot_window(ax, out):
  """Held-out loss against float32 per static scale, the window shaded, the
  dynamic runs marked at their final scale."""
  ref = out["runs"]["fp32"]["eval_loss"]
  static = {k: r for k, r in out["runs"].items() if k.startswith("static")}
  x = [np.log2(r["initial_scale"]) for r in static.values()]
  y = [r["eval_loss"] - ref for r in static.values()]
  ax.plot(x, y, "o-", color="k", ms=4, label="static scale")
  ax.axhline(
    out["runs"]["fp16"]["eval_loss"] - ref,
    color="C1",
    ls="--",
    label="fp16, no scaling",
  )
  ax.axhline(0, color="k", lw=0.5)
  _shade(ax, out["window"])
  for i, (k, r) in enumerate(
    (k, r) for k, r in out["runs"].items() if k.startswith("dyn")
  ):
    ax.plot(
      np.log2(r["final_scale"]),
      r["eval_loss"] - ref,
      "*",
      ms=11,
      color=f"C{i + 2}",
      label=f"{k} (final scale)",
    )
  ax.set(
    xlabel="log2 loss scale",
    ylabel="held-out loss - fp32",
    yscale="symlog",
    title="the window",
  )
  ax.set_yscale("symlog", linthresh=1e-3)
  ax.legend(fontsize=6)


def plot_shares(ax, out):
  """Flushed activation gradients, overflowed activation gradients and
  skipped steps, in % against the static scale."""
  static = [r for k, r in out["runs"].items() if k.startswith("static")]
  x = [np.log2(r["initial_scale"]) for r in static]
  ax.plot(
    x,
    [100 * r["act_flushed_mean"] for r in static],
    "o-",
    ms=4,
    label="activation grads flushed to 0",
  )
  ax.plot(
    x,
    [100 * r["act_nonfinite_mean"] for r in static],
    "s-",
    ms=4,
    label="activation grads inf/NaN",
  )
  ax.plot(
    x,
    [100 * np.mean([f["nonfinite"] for f in r["flush"]]) for r in static],
    "d-",
    ms=4,
    label="parameter grads inf/NaN",
  )
  ax.plot(
    x,
    [100 * r["skipped_total"] / len(r["skipped"]) for r in static],
    "^-",
    ms=4,
    label="steps skipped",
  )
  _shade(ax, out["window"])
  ax.set(xlabel="log2 loss scale", ylabel="%", title="underflow, overflow")
  ax.legend(fontsize=6)


def plot_scales(ax, runs, window=None):
  """log2 scale after each step, skipped steps marked."""
  for i, (name, r) in enumerate(runs.items()):
    steps = np.arange(1, len(r["scale"]) + 1)
    ax.step(steps, np.log2(r["scale"]), where="post", label=name, color=f"C{i}")
    sk = np.nonzero(r["skipped"])[0]
    ax.plot(steps[sk], np.log2(r["scale"][sk]), "x", color=f"C{i}", ms=5)
  if window is not None:
    _shade(ax, window, axis="y")
  ax.set(
    xlabel="step (x: skipped)",
    ylabel="log2 loss scale after step",
    title="loss scale",
  )
  ax.legend(fontsize=6)


def plot_loss_gap(ax, runs, ref, title):
  for i, (name, r) in enumerate(runs.items()):
    ax.plot(
      np.arange(1, len(r["loss"]) + 1),
      r["loss"] - ref["loss"],
      label=name,
      lw=1,
      color=f"C{i}",
    )
  ax.axhline(0, color="k", lw=0.5)
  ax.set(xlabel="step", ylabel="train loss - fp32", title=title)
  ax.legend(fontsize=6)


def dynamic_runs(out):
  return {k: r for k, r in out["runs"].items() if k.startswith("dyn")}


def plot_sawtooth(a, b, out):
  """The longer runs' scales (skips marked) and their loss against
  float32's."""
  saw = {k: r for k, r in out["sawtooth"].items() if k != "fp32"}
  plot_scales(a, saw)
  a.set_title("sawtooth: growth every 20 finite steps vs 2000")
  plot_loss_gap(b, saw, out["sawtooth"]["fp32"], "the loss beside it")


def save_sweep_figure(out, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(2, 3, figsize=(15, 7.5), dpi=80)
  plot_window(ax[0, 0], out)
  plot_shares(ax[0, 1], out)
  plot_scales(ax[0, 2], dynamic_runs(out), out["window"])
  if "sawtooth" in out:
    plot_sawtooth(ax[1, 0], ax[1, 1], out)
  if "replicas" in out:
    rr = out["replicas"]
    for name, r in rr.items():
      ax[1, 2].plot(np.arange(1, len(r["loss"]) + 1), r["loss"], label=name)
    ax[1, 2].set(
      xlabel="step",
      ylabel="train loss",
      title=f"loss / global count, {out['sweep']['replicas']} replicas",
    )
    ax[1, 2].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


# ---------------------------------------------------------------- main


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument(
    "--short",
    action="store_true",
    help="a smoke run: 10 steps (too few to read much)",
  )
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--static-scale", type=float, default=None)
  parser.add_argument("--dynamic-scale", type=float, default=None)
  parser.add_argument("--growth-steps", type=int, default=None)
  parser.add_argument(
    "--replicas",
    type=int,
    default=None,
    help="divide each replica's loss by the global count",
  )
  parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
  parser.add_argument(
    "--sweep", action="store_true", help="the whole study (see RESULTS.md)"
  )
  parser.add_argument(
    "--scales",
    default=None,
    help="with --sweep: the static scales' log2, e.g. 1,3",
  )
  parser.add_argument(
    "--parts",
    default=None,
    help="with --sweep: some of static,dynamic,sawtooth,"
    "replicas (default: all)",
  )
  parser.add_argument(
    "--merge",
    nargs="+",
    default=None,
    help="print (and save) sweeps saved with --json as one",
  )
  parser.add_argument("--figure", default=None, help="save a PNG here")
  parser.add_argument(
    "--json", default=None, help="write every number (curves too) to this path"
  )
  args = parser.parse_args(argv)
  overrides = {"seed": args.seed}
  for k in ("batch", "static_scale", "dynamic_scale", "growth_steps"):
    if getattr(args, k) is not None:
      overrides[k] = getattr(args, k)
  from tqdm import tqdm

  t0 = time.perf_counter()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)

  if args.merge:
    args.sweep = True
    result = merge_sweeps([load_json(p) for p in args.merge])
    bar = None
  elif args.sweep:
    sweep = dict(SWEEP)
    if args.steps is not None:
      sweep["steps"] = args.steps
      sweep["sawtooth_steps"] = 3 * args.steps
    if args.replicas is not None:
      sweep["replicas"] = args.replicas
    if args.scales is not None:
      sweep["static_log2"] = tuple(int(e) for e in args.scales.split(","))
    parts = (args.parts or "static,dynamic,sawtooth,replicas").split(",")
    if "static" not in parts:
      sweep["static_log2"] = ()
    if "dynamic" not in parts:
      sweep["dynamic"] = ()
    if "sawtooth" not in parts:
      sweep["sawtooth_steps"] = 0
    if "replicas" not in parts:
      sweep["replicas"] = 0
    overrides.pop("static_scale", None)
    bar = tqdm(total=sweep_steps(sweep), unit="step", file=sys.stderr)
  else:
    steps = 10 if args.short else (args.steps or DEFAULTS["steps"])
    if args.replicas is not None:
      overrides["replicas"] = args.replicas
    bar = tqdm(total=steps * len(RUNS), unit="step", file=sys.stderr)

  def progress(run, n):
    bar.set_description(run)
    bar.update(n)

  if args.merge:
    pass
  elif args.sweep:
    result = run_sweep(sweep, progress=progress, **overrides)
  else:
    result = run_study(steps=steps, progress=progress, **overrides)
  if bar is not None:
    bar.close()
  cfg = result["config"]
  print(
    f"char-MLP LM on {cfg['corpus_chars']} chars of stdlib source, "
    f"vocab {cfg['vocab']}, context {cfg['context']}, depth "
    f"{cfg['depth']}x{cfg['width']}, {cfg['batch']} tokens/batch "
    f"(token-mean loss), Adam lr {cfg['lr']}, {cfg['steps']} steps, "
    f"seed {cfg['seed']}; eval on {cfg['eval_tokens']} held-out tokens"
  )
  if args.sweep:
    print(format_sweep(result))
  else:
    if cfg["replicas"] > 1:
      print(
        f"loss of {cfg['batch']} tokens divided by "
        f"{cfg['replicas']} x {cfg['batch']} (replicas)"
      )
    print(format_table(result))
    print(format_scales(result))
  seconds = time.perf_counter() - t0
  print(f"{seconds:.0f} s in all")
  if args.figure:
    (save_sweep_figure if args.sweep else save_figure)(result, args.figure)
    print(f"figure saved to {args.figure}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        to_json(
          {
            **result,
            "seconds": seconds,
            "jax": jax.__version__,
            "device": jax.devices()[0].device_kind,
          }
        ),
        f,
      )
    print(f"numbers saved to {args.json}")
  return result


if __name__ == "__main__":
  main()
