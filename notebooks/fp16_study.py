"""Float16 with and without loss scaling, on a small character-level LM.

A small-scale check of the claim behind this library (Micikevicius et al.,
2018, "Mixed Precision Training"): in float16, small gradients flush to zero
below 2**-24, and training can lose accuracy; scaling the loss keeps them in
range and float16 then matches float32.

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
and the float16 gradients cast back to float32 for Adam. Four runs, same
seeds, same batches, same steps:

  * ``fp32``:          everything float32;
  * ``fp16``:          float16 compute, no loss scaling;
  * ``fp16_static``:   float16, static loss scale (``--static-scale``);
  * ``fp16_dynamic``:  float16, ``loss_scale_optimizer`` at its defaults.

Run ``python notebooks/fp16_study.py`` (short default, < 2 min on a laptop
CPU) or ``--steps N``; ``--figure PATH`` saves a PNG.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_lossscale as ols  # noqa: E402

RUNS = ("fp32", "fp16", "fp16_static", "fp16_dynamic")

# Standard-library modules whose source is the corpus (present in every
# CPython 3.11+; the text differs slightly between versions).
CORPUS_FILES = (
    "argparse.py", "textwrap.py", "difflib.py", "typing.py", "inspect.py",
    "dataclasses.py", "functools.py", "pathlib.py", "shutil.py",
    "subprocess.py", "tarfile.py", "zipfile/__init__.py", "logging/__init__.py",
    "json/decoder.py", "json/encoder.py", "collections/__init__.py",
)

F16_TINY = 2.0**-24          # smallest positive (subnormal) float16
F16_NORMAL_MIN = 2.0**-14    # smallest positive normal float16
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
  tap = (lambda i: 0) if taps is None else (
      lambda i: taps[i].astype(dtype))
  h = params["embed"][x].reshape(x.shape[0], -1)
  for i in range(depth):
    layer = params[f"h{i}"]
    h = jnp.tanh(h @ layer["w"] + layer["b"] + tap(i))
  return h @ params["out"]["w"] + params["out"]["b"] + tap(depth)


def loss_fn(params, x, y, taps=None, *, depth, compute_dtype):
  """Token-level mean cross-entropy. The float32 master params are cast to
  ``compute_dtype`` here, inside the differentiated function, so that the
  backward pass runs (and rounds) in ``compute_dtype``; the logits go back
  to float32 for the softmax and the mean."""
  p = jax.tree.map(lambda a: a.astype(compute_dtype), params)
  logits = apply(p, x, depth, taps).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


# ---------------------------------------------------------------- training

def make_batch(key, tokens, batch, context):
  starts = jax.random.randint(key, (batch,), 0, tokens.shape[0] - context - 1)
  idx = starts[:, None] + jnp.arange(context + 1)[None, :]
  window = tokens[idx]
  return window[:, :context], window[:, context]


def make_optimizer(run, lr, static_scale):
  inner = optax.adam(lr)
  if run == "fp16_static":
    return ols.loss_scale_optimizer(inner, dynamic=False,
                                    initial_scale=static_scale)
  if run == "fp16_dynamic":
    return ols.loss_scale_optimizer(inner)
  return inner


def _scale_of(run, opt_state):
  if run in ("fp16_static", "fp16_dynamic"):
    return ols.loss_scale(opt_state)
  return jnp.float32(1.0)


def grads_for(run, params, opt_state, x, y, depth):
  """The float32 view of the gradients the run's update would receive
  (scaled for the loss-scaled runs), and the loss."""
  dtype = jnp.float32 if run == "fp32" else jnp.float16
  f = functools.partial(loss_fn, depth=depth, compute_dtype=dtype)
  if run in ("fp16_static", "fp16_dynamic"):
    return ols.value_and_grad(f)(opt_state, params, x, y)
  return jax.value_and_grad(f)(params, x, y)


def flush_stats(run, params, opt_state, x, y, depth):
  """Compares the run's float16 gradients with float32 gradients of the same
  params and batch: of the elements nonzero in float32, the fraction that
  are zero in float16 (flushed), and the fraction of float32 gradient
  magnitudes (times the run's scale) below 2**-24 and below 2**-14."""
  scale = _scale_of(run, opt_state)
  g32 = jax.grad(functools.partial(loss_fn, depth=depth,
                                   compute_dtype=jnp.float32))(params, x, y)
  g32 = jnp.concatenate([g.ravel() for g in jax.tree.leaves(g32)])
  nz = g32 != 0
  out = {
      "below_tiny": jnp.sum(nz & (jnp.abs(g32) * scale < F16_TINY)) / nz.sum(),
      "below_normal": (jnp.sum(nz & (jnp.abs(g32) * scale < F16_NORMAL_MIN))
                       / nz.sum()),
  }
  if run == "fp32":
    out["flushed"] = jnp.float32(jnp.nan)
  else:
    _, g16 = grads_for(run, params, opt_state, x, y, depth)
    g16 = jnp.concatenate([g.ravel() for g in jax.tree.leaves(g16)])
    out["flushed"] = jnp.sum(nz & (g16 == 0)) / nz.sum()
    out["nonfinite"] = jnp.mean(~jnp.isfinite(g16))
  # The same comparison for the activation gradients (the cotangents of
  # every pre-activation and of the logits), where the paper locates the
  # underflow: these are per token, so each carries the 1/n_tokens factor.
  taps = _zero_taps(params, x, depth)
  a32 = jax.grad(functools.partial(loss_fn, depth=depth,
                                   compute_dtype=jnp.float32),
                 argnums=3)(params, x, y, taps)
  a32 = jnp.concatenate([g.ravel() for g in a32])
  anz = a32 != 0
  out["act_below_normal"] = (jnp.sum(anz & (jnp.abs(a32) * scale
                                            < F16_NORMAL_MIN)) / anz.sum())
  if run != "fp32":
    f16 = functools.partial(loss_fn, depth=depth, compute_dtype=jnp.float16)
    scaled = lambda *a: f16(*a) * scale  # noqa: E731
    a16 = jax.grad(scaled, argnums=3)(params, x, y, taps)
    a16 = jnp.concatenate([g.ravel() for g in a16])
    out["act_flushed"] = jnp.sum(anz & (a16 == 0)) / anz.sum()
  else:
    out["act_flushed"] = jnp.float32(jnp.nan)
  return out


def _zero_taps(params, x, depth):
  width = params["h0"]["w"].shape[1]
  vocab = params["out"]["w"].shape[1]
  return [jnp.zeros((x.shape[0], width))] * depth + [
      jnp.zeros((x.shape[0], vocab))]


def gradient_magnitudes(run, params, opt_state, x, y, depth):
  """All gradient magnitudes (flattened numpy, float32) the run's update
  would receive, and the float32 reference times the run's scale."""
  scale = _scale_of(run, opt_state)
  g32 = jax.grad(functools.partial(loss_fn, depth=depth,
                                   compute_dtype=jnp.float32))(params, x, y)
  _, g = grads_for(run, params, opt_state, x, y, depth)
  flat = lambda t: np.concatenate(  # noqa: E731
      [np.abs(np.asarray(a, np.float32)).ravel() for a in jax.tree.leaves(t)])
  return flat(g), flat(g32) * float(scale)


def activation_gradient_magnitudes(run, params, opt_state, x, y, depth):
  """Magnitudes of the activation gradients (every pre-activation and the
  logits, per token) as the run's float16 backward pass holds them (times
  its scale), and the float32 reference times the same scale."""
  scale = float(_scale_of(run, opt_state))
  taps = _zero_taps(params, x, depth)
  flat = lambda t: np.concatenate(  # noqa: E731
      [np.abs(np.asarray(a, np.float32)).ravel() for a in t])
  g32 = jax.grad(functools.partial(loss_fn, depth=depth,
                                   compute_dtype=jnp.float32),
                 argnums=3)(params, x, y, taps)
  dtype = jnp.float32 if run == "fp32" else jnp.float16
  f = functools.partial(loss_fn, depth=depth, compute_dtype=dtype)
  g = jax.grad(lambda *a: f(*a) * scale, argnums=3)(params, x, y, taps)
  return flat(g), flat(g32) * scale


def make_chunk(run, tx, tokens, cfg):
  """A jitted function running ``chunk`` training steps with lax.scan."""
  depth, batch, context = cfg["depth"], cfg["batch"], cfg["context"]

  def step(carry, key):
    params, opt_state = carry
    x, y = make_batch(key, tokens, batch, context)
    loss, grads = grads_for(run, params, opt_state, x, y, depth)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if run in ("fp16_static", "fp16_dynamic"):
      scale = ols.loss_scale(opt_state)
      skipped = ~ols.skip_stats(opt_state).last_finite
    else:
      scale, skipped = jnp.float32(1.0), jnp.bool_(False)
    return (params, opt_state), (loss, scale, skipped)

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
    steps=40, batch=131072, context=8, embed=16, width=32, depth=4,
    lr=3e-3, static_scale=2.0**10, seed=0, chunk=10, n_checkpoints=2,
    eval_tokens=32768, max_chars=None,
)


def run_study(steps: int = DEFAULTS["steps"], runs=RUNS, progress=None,
              keep_params: bool = False, **overrides) -> dict:
  """Trains the four runs and returns every number the report needs.

  Returns a dict with ``config``, ``runs`` (per run: ``loss`` curve,
  ``scale`` and ``skipped`` per step, ``eval_loss``, ``eval_acc``,
  ``flush`` at checkpoints, ``skipped_total``, ``backoffs``, ``growths``,
  ``final_scale``, ``seconds``), and ``summary`` rows for the table.
  """
  cfg = dict(DEFAULTS, **overrides, steps=steps)
  chunk_len = min(cfg["chunk"], steps)
  n_chunks = -(-steps // chunk_len)
  steps = n_chunks * chunk_len
  cfg["steps"] = steps
  tokens_np, vocab = load_corpus(cfg["max_chars"])
  cfg["vocab"], cfg["corpus_chars"] = vocab, int(tokens_np.size)
  # Hold out the last 10% of the corpus.
  split = int(tokens_np.size * 0.9)
  train, held = jnp.asarray(tokens_np[:split]), jnp.asarray(tokens_np[split:])
  key = jax.random.PRNGKey(cfg["seed"])
  k_init, k_data, k_eval, k_probe = jax.random.split(key, 4)
  params0 = init_params(k_init, vocab, cfg["context"], cfg["embed"],
                        cfg["width"], cfg["depth"])
  ex, ey = make_batch(k_eval, held, cfg["eval_tokens"], cfg["context"])
  px, py = make_batch(k_probe, train, cfg["batch"], cfg["context"])
  step_keys = jax.random.split(k_data, steps).reshape(n_chunks, chunk_len, -1)
  # Flush statistics after 1/k, 2/k, ..., k/k of the training (k =
  # n_checkpoints), on one fixed training batch.
  checkpoints = sorted(set(
      np.linspace(0, n_chunks, cfg["n_checkpoints"] + 1)[1:]
      .round().astype(int).tolist()))
  depth = cfg["depth"]
  eval_fn = jax.jit(functools.partial(evaluate, depth=depth))

  out = {"config": cfg, "runs": {}}
  for run in runs:
    t0 = time.perf_counter()
    tx = make_optimizer(run, cfg["lr"], cfg["static_scale"])
    params, opt_state = params0, tx.init(params0)
    chunk = make_chunk(run, tx, train, cfg)
    flush_fn = jax.jit(functools.partial(flush_stats, run, depth=depth))
    losses, scales, skipped, flush = [], [], [], []
    for c in range(n_chunks + 1):
      if c in checkpoints:
        stats = {k: float(v) for k, v in
                 flush_fn(params, opt_state, px, py).items()}
        flush.append({"step": c * chunk_len, **stats})
      if c == n_chunks:
        break
      (params, opt_state), (l, s, k) = chunk(params, opt_state, step_keys[c])
      losses.append(np.asarray(l))
      scales.append(np.asarray(s))
      skipped.append(np.asarray(k))
      if progress is not None:
        progress(run, chunk_len)
    losses = np.concatenate(losses)
    scales = np.concatenate(scales)
    skipped = np.concatenate(skipped)
    eval_loss, eval_acc = (float(v) for v in eval_fn(params, ex, ey))
    prev = np.concatenate([[_initial_scale(run, cfg)], scales[:-1]])
    rec = {
        "loss": losses, "scale": scales, "skipped": skipped,
        "eval_loss": eval_loss, "eval_acc": eval_acc, "flush": flush,
        "flushed_mean": (float(np.nanmean([f["flushed"] for f in flush]))
                         if run != "fp32" else float("nan")),
        "act_flushed_mean": (
            float(np.nanmean([f["act_flushed"] for f in flush]))
            if run != "fp32" else float("nan")),
        "skipped_total": int(skipped.sum()),
        "backoffs": int(np.sum(scales < prev)),
        "growths": int(np.sum(scales > prev)),
        "final_scale": float(scales[-1]),
        "seconds": time.perf_counter() - t0,
    }
    if keep_params:
      rec["params"], rec["opt_state"] = params, opt_state
    out["runs"][run] = rec

  ref = out["runs"].get("fp32")
  out["summary"] = [
      {
          "run": run, "eval_loss": r["eval_loss"], "eval_acc": r["eval_acc"],
          "vs_fp32": (r["eval_loss"] - ref["eval_loss"]) if ref else
          float("nan"),
          "flushed_pct": 100 * r["flushed_mean"],
          "act_flushed_pct": 100 * r["act_flushed_mean"],
          "skipped": r["skipped_total"], "final_scale": r["final_scale"],
      }
      for run, r in out["runs"].items()
  ]
  out["probe_batch"] = (px, py)
  return out


def _initial_scale(run, cfg):
  if run == "fp16_static":
    return cfg["static_scale"]
  if run == "fp16_dynamic":
    return 2.0**15
  return 1.0


# ---------------------------------------------------------------- report

def format_table(result) -> str:
  lines = [
      f"{'run':<14}{'eval loss':>10}{'vs fp32':>9}{'acc %':>7}"
      f"{'flushed % (param / act)':>25}{'skipped':>9}{'final scale':>13}",
  ]
  for row in result["summary"]:
    flushed = ("-" if np.isnan(row["flushed_pct"])
               else f"{row['flushed_pct']:.3f} / {row['act_flushed_pct']:.2f}")
    lines.append(
        f"{row['run']:<14}{row['eval_loss']:>10.4f}{row['vs_fp32']:>+9.4f}"
        f"{100 * row['eval_acc']:>7.2f}{flushed:>25}{row['skipped']:>9d}"
        f"{row['final_scale']:>13g}")
  return "\n".join(lines)


def format_scales(result) -> str:
  lines = []
  for run in ("fp16_static", "fp16_dynamic"):
    r = result["runs"].get(run)
    if r is None:
      continue
    n = len(r["scale"])
    at = sorted({0, 1, 2, 4, 8, n // 4, n // 2, n - 1})
    traj = ", ".join(f"{i + 1}:{r['scale'][i]:g}" for i in at if i < n)
    lines.append(f"{run}: scale after step {traj}; backoffs {r['backoffs']},"
                 f" growths {r['growths']}, skipped {r['skipped_total']}")
  lines.append("flushed % of activation (param) gradients per checkpoint,"
               " fp16 / static / dynamic:")
  runs = [result["runs"][k] for k in RUNS[1:] if k in result["runs"]]
  if runs:
    for i, f in enumerate(runs[0]["flush"]):
      vals = " / ".join(
          f"{100 * r['flush'][i]['act_flushed']:.2f}"
          f" ({100 * r['flush'][i]['flushed']:.3f})" for r in runs)
      lines.append(f"  step {f['step']}: {vals}")
  return "\n".join(lines)


def save_figure(result, path):
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
  a.set(xlabel="step", ylabel="train loss - fp32 train loss",
        title=f"char-LM, mean over {result['config']['batch']} tokens")
  a.legend(fontsize=8)
  for run in ("fp16_static", "fp16_dynamic"):
    r = result["runs"].get(run)
    if r is None:
      continue
    steps = np.arange(1, len(r["scale"]) + 1)
    b.step(steps, np.log2(r["scale"]), where="post", label=run)
    sk = np.nonzero(r["skipped"])[0]
    b.plot(steps[sk], np.log2(r["scale"][sk]), "x", color="red",
           ms=5, label=f"{run} skipped" if len(sk) else None)
  b.set(xlabel="step", ylabel="log2 loss scale", title="loss scale")
  b.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
  parser.add_argument("--short", action="store_true",
                      help="a smoke run: 10 steps (too few to read much)")
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--static-scale", type=float, default=None)
  parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
  parser.add_argument("--figure", default=None, help="save a PNG here")
  args = parser.parse_args(argv)
  overrides = {"seed": args.seed}
  steps = args.steps
  if args.short:
    steps = 10
  if args.batch is not None:
    overrides["batch"] = args.batch
  if args.static_scale is not None:
    overrides["static_scale"] = args.static_scale

  from tqdm import tqdm
  bar = tqdm(total=steps * len(RUNS), unit="step", file=sys.stderr)

  def progress(run, n):
    bar.set_description(run)
    bar.update(n)

  result = run_study(steps=steps, progress=progress, **overrides)
  bar.close()
  cfg = result["config"]
  print(f"char-MLP LM on {cfg['corpus_chars']} chars of stdlib source, "
        f"vocab {cfg['vocab']}, context {cfg['context']}, depth "
        f"{cfg['depth']}x{cfg['width']}, {cfg['batch']} tokens/batch "
        f"(token-mean loss), Adam lr {cfg['lr']}, {cfg['steps']} steps, "
        f"seed {cfg['seed']}; eval on {cfg['eval_tokens']} held-out tokens")
  print(format_table(result))
  print(format_scales(result))
  if args.figure:
    save_figure(result, args.figure)
    print(f"figure saved to {args.figure}")
  return result


if __name__ == "__main__":
  main()
