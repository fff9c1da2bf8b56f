"""autocast against the same policy written by hand, and against float32
and the "everything in float16" conversion.

Three models with float32 parameters: an MLP (gelu layers, softmax
cross-entropy), a small decoder-only transformer (RMSNorm, causal softmax
attention masked with a large finite constant, gated gelu MLP, tied
decoding, no biases) and a GPT-2-style one (learned positions, LayerNorm
with a bias, biases on every product, gelu MLP, tied decoding). Each is
written once, with two hooks: what a product's operands go through, and
what a float32-list operation's operands go through. The variants of its
gradient step `jit(value_and_grad(loss))`:

- float32: the model as written (both hooks do nothing);
- autocast: `ols.autocast(loss)`;
- by_hand: the same policy written by hand: the same model with the hooks
  casting a product's operands to float16 and a float32-list operation's
  to float32 (promotion does the rest, as jnp promotes);
- cast: `ols.autocast(loss, mixed="cast")`;
- float16: every parameter cast to float16 at the top, nothing else.

Reported per model and variant: the float16 and float32 products in the
lowered program (StableHLO: XLA on CPU runs float16 products in float32,
so the compiled program would say less), the compiled program's temporary
bytes (`memory_analysis()`), the bytes the backward pass keeps (jax's
saved residuals, the arguments excluded: what bounds batch and sequence
length), trace-plus-compile time (the fastest of
several), and the run time (median over interleaved rounds, warm-up
excluded). Times are ratios: autocast's to by_hand's (the policy's own
cost), and every variant's to float32's.

  python benchmarks/autocast.py            # the default sizes (minutes)
  python benchmarks/autocast.py --tiny     # seconds, for the smoke test
  python benchmarks/autocast.py --study    # the study's task, trained
  python benchmarks/autocast.py --saved    # saved residuals only (traced)
"""

import argparse
import collections
import functools
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import optax_lossscale as ols

F16, F32 = jnp.float16, jnp.float32
VARIANTS = ("float32", "autocast", "by_hand", "cast", "float16")


class Hooks(NamedTuple):
  product: Callable[[Any], Any]  # a product's operand
  sensitive: Callable[[Any], Any]  # a float32-list operation's operand


def _same(x: Any) -> Any:
  return x


AS_WRITTEN = Hooks(_same, _same)
BY_HAND = Hooks(lambda x: x.astype(F16), lambda x: x.astype(F32))


def _log_softmax(logits: Any, hooks: Hooks) -> Any:
  """jax.nn.log_softmax, written out so that `hooks` reach its exp, log and
  sum (as the policy reaches them inside jax's)."""
  shifted = logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True))
  shifted = hooks.sensitive(shifted)
  return shifted - jnp.log(jnp.sum(jnp.exp(shifted), -1, keepdims=True))


def _cross_entropy(logits: Any, labels: Any, hooks: Hooks) -> Any:
  logp = _log_softmax(logits, hooks)
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


# The MLP.


def mlp_init(key: Any, width: int, depth: int, classes: int) -> list[Any]:
  keys = jax.random.split(key, depth + 1)
  sizes = [width] * (depth + 1) + [classes]
  return [
    {
      "w": jax.random.normal(k, (m, n)) / math.sqrt(m),
      "b": jnp.zeros(n),
    }
    for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def mlp_loss(params: list[Any], batch: Any, hooks: Hooks) -> Any:
  h = batch["x"]
  for i, layer in enumerate(params):
    h = hooks.product(h) @ hooks.product(layer["w"]) + layer["b"]
    if i < len(params) - 1:
      h = _gelu(h, hooks)
  return _cross_entropy(h, batch["y"], hooks)


def _gelu(x: Any, hooks: Hooks) -> Any:
  """jax.nn.gelu's tanh form, written out for the hooks (its cube is on
  the float32 list)."""
  wide = hooks.sensitive(x)
  inner = math.sqrt(2 / math.pi) * (wide + 0.044715 * wide**3)
  return 0.5 * x * (1 + jnp.tanh(inner))


# The transformer.

K_MASK = -2.3819763e38  # finite in float32, -inf in float16


def transformer_init(key: Any, vocab: int, width: int, layers: int) -> Any:
  keys = iter(jax.random.split(key, 1 + 6 * layers))

  def dense(*shape: int) -> Any:
    return jax.random.normal(next(keys), shape) / math.sqrt(shape[0])

  params = {"embed": 0.02 * jax.random.normal(next(keys), (vocab, width))}
  for i in range(layers):
    params[f"layer_{i}"] = {
      "norm1": jnp.zeros(width),
      "qkv": dense(width, 3 * width),
      "o": dense(width, width),
      "norm2": jnp.zeros(width),
      "gate": dense(width, 4 * width),
      "up": dense(width, 4 * width),
      "down": dense(4 * width, width),
    }
  params["final_norm"] = jnp.zeros(width)
  return params


def _rms_norm(x: Any, scale: Any, hooks: Hooks) -> Any:
  variance = jnp.mean(jnp.square(hooks.sensitive(x)), -1, keepdims=True)
  return x * jax.lax.rsqrt(variance + 1e-6) * (1 + scale)


def _attention(p: Any, x: Any, heads: int, hooks: Hooks) -> Any:
  batch, seq, width = x.shape
  qkv = hooks.product(x) @ hooks.product(p["qkv"])
  q, k, v = jnp.split(qkv.reshape(batch, seq, 3, heads, -1), 3, axis=2)
  q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
  logits = jnp.einsum("bqhd,bkhd->bhqk", hooks.product(q), hooks.product(k)) * (
    1.0 / math.sqrt(width // heads)
  )
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  # K_MASK is beyond float16: the select, and the softmax after it, are
  # float32 (by hand: the logits cast up, as the policy does).
  masked = jnp.where(causal, hooks.sensitive(logits), K_MASK)
  probs = jax.nn.softmax(masked, axis=-1)
  mixed = jnp.einsum("bhqk,bkhd->bqhd", hooks.product(probs), hooks.product(v))
  return hooks.product(mixed.reshape(batch, seq, width)) @ hooks.product(p["o"])


def transformer_loss(
  params: Any, batch: Any, hooks: Hooks, heads: int = 4
) -> Any:
  x = params["embed"][batch["tokens"]]
  layer = 0
  while f"layer_{layer}" in params:
    p = params[f"layer_{layer}"]
    x = x + _attention(p, _rms_norm(x, p["norm1"], hooks), heads, hooks)
    h = hooks.product(_rms_norm(x, p["norm2"], hooks))
    gate = _gelu(h @ hooks.product(p["gate"]), hooks)
    x = x + hooks.product(gate * (h @ hooks.product(p["up"]))) @ (
      hooks.product(p["down"])
    )
    layer += 1
  x = _rms_norm(x, params["final_norm"], hooks)
  logits = hooks.product(x) @ hooks.product(params["embed"].T)
  return _cross_entropy(logits, batch["targets"], hooks)


# The GPT-2-style model.


def gpt2_init(key: Any, vocab: int, width: int, layers: int, seq: int) -> Any:
  keys = iter(jax.random.split(key, 2 + 4 * layers))

  def dense(fan_in: int, fan_out: int) -> Any:
    w = jax.random.normal(next(keys), (fan_in, fan_out)) / math.sqrt(fan_in)
    return {"w": w, "b": jnp.zeros(fan_out)}

  def norm() -> Any:
    return {"scale": jnp.ones(width), "bias": jnp.zeros(width)}

  params = {
    "wte": 0.02 * jax.random.normal(next(keys), (vocab, width)),
    "wpe": 0.01 * jax.random.normal(next(keys), (seq, width)),
    "ln_f": norm(),
  }
  for i in range(layers):
    params[f"h_{i}"] = {
      "ln_1": norm(),
      "qkv": dense(width, 3 * width),
      "proj": dense(width, width),
      "ln_2": norm(),
      "fc": dense(width, 4 * width),
      "out": dense(4 * width, width),
    }
  return params


def _layer_norm(x: Any, p: Any, hooks: Hooks) -> Any:
  wide = hooks.sensitive(x)
  mean = jnp.mean(wide, -1, keepdims=True)
  variance = jnp.mean(jnp.square(wide - mean), -1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * p["scale"] + p["bias"]


def _dense(p: Any, x: Any, hooks: Hooks) -> Any:
  return hooks.product(x) @ hooks.product(p["w"]) + p["b"]


def _gpt2_attention(p: Any, x: Any, heads: int, hooks: Hooks) -> Any:
  batch, seq, width = x.shape
  qkv = _dense(p["qkv"], x, hooks).reshape(batch, seq, 3, heads, -1)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  logits = jnp.einsum("bqhd,bkhd->bhqk", hooks.product(q), hooks.product(k))
  logits = logits * (1.0 / math.sqrt(width // heads))
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  masked = jnp.where(causal, hooks.sensitive(logits), K_MASK)
  probs = jax.nn.softmax(masked, axis=-1)
  mixed = jnp.einsum("bhqk,bkhd->bqhd", hooks.product(probs), hooks.product(v))
  return _dense(p["proj"], mixed.reshape(batch, seq, width), hooks)


def gpt2_loss(params: Any, batch: Any, hooks: Hooks, heads: int = 4) -> Any:
  tokens = batch["tokens"]
  x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]
  layer = 0
  while f"h_{layer}" in params:
    p = params[f"h_{layer}"]
    x = x + _gpt2_attention(p, _layer_norm(x, p["ln_1"], hooks), heads, hooks)
    h = _gelu(_dense(p["fc"], _layer_norm(x, p["ln_2"], hooks), hooks), hooks)
    x = x + _dense(p["out"], h, hooks)
    layer += 1
  x = _layer_norm(x, params["ln_f"], hooks)
  logits = hooks.product(x) @ hooks.product(params["wte"].T)
  return _cross_entropy(logits, batch["targets"], hooks)


# The variants and their measurement.


def variant_loss(name: str, loss: Callable[..., Any]) -> Callable[..., Any]:
  if name == "float32":
    return functools.partial(loss, hooks=AS_WRITTEN)
  if name == "by_hand":
    return functools.partial(loss, hooks=BY_HAND)
  if name == "autocast":
    return ols.autocast(functools.partial(loss, hooks=AS_WRITTEN))
  if name == "cast":
    return ols.autocast(functools.partial(loss, hooks=AS_WRITTEN), mixed="cast")
  if name == "float16":

    def everything_in_float16(params: Any, batch: Any) -> Any:
      half = jax.tree.map(
        lambda a: a.astype(F16) if jnp.issubdtype(a.dtype, jnp.floating) else a,
        (params, batch),
      )
      return loss(*half, hooks=AS_WRITTEN).astype(F32)

    return everything_in_float16
  raise ValueError(name)


def products(lowered: Any) -> dict[str, int]:
  """The products of a lowered program, by result dtype."""
  counts: collections.Counter = collections.Counter()
  for line in lowered.as_text().splitlines():
    if "stablehlo.dot_general" in line or "stablehlo.convolution" in line:
      result = line.split("->")[-1]
      counts["float16" if "xf16>" in result else "float32"] += 1
  return dict(counts)


# `[ROOT] %name = TYPE opcode(`: an instruction of an optimized HLO module.
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s*"
  r"(?<![\w.\-])(?P<opcode>[a-z][a-z0-9\-]*)\("
)


def operations(compiled: Any) -> collections.Counter:
  """The compiled program's instructions, by opcode and result type."""
  counts: collections.Counter = collections.Counter()
  for line in compiled.as_text().splitlines():
    match = _INSTRUCTION.match(line)
    if match:
      dtype = re.match(r"\(?([a-z]+[0-9]*)", match["type"])
      counts[match["opcode"], dtype[1] if dtype else None] += 1
  return counts


def compile_best(fun: Callable[..., Any], args: Any, repeats: int) -> Any:
  """`(lowered, compiled, seconds)`: the fastest of `repeats` traces and
  compilations, each on a fresh `jit` (which caches traces per function)."""
  best, found = math.inf, None
  for _ in range(repeats):
    step = jax.jit(jax.value_and_grad(lambda *a: fun(*a)))
    start = time.perf_counter()
    lowered = step.lower(*args)
    compiled = lowered.compile()
    elapsed = time.perf_counter() - start
    if elapsed < best:
      best, found = elapsed, (lowered, compiled)
  assert found is not None
  return (*found, best)


def saved_bytes(fun: Callable[..., Any], args: Any) -> int:
  """The bytes of the residuals jax saves for `fun`'s backward pass, less
  those that are `fun`'s arguments (which live anyway)."""
  from jax._src.ad_checkpoint import saved_residuals

  return sum(
    aval.size * aval.dtype.itemsize
    for aval, origin in saved_residuals(fun, *args)
    if not origin.startswith("from the argument")
  )


def measure(
  loss: Callable[..., Any], args: Any, rounds: int, repeats: int
) -> dict[str, dict[str, Any]]:
  results, compiled = {}, {}
  for name in VARIANTS:
    fun = variant_loss(name, loss)
    lowered, c, seconds = compile_best(fun, args, repeats)
    memory = c.memory_analysis()
    compiled[name] = c
    jax.block_until_ready(c(*args))  # warm-up
    results[name] = {
      "products": products(lowered),
      "operations": operations(c),
      "temp_bytes": getattr(memory, "temp_size_in_bytes", math.nan),
      "saved_bytes": saved_bytes(fun, args),
      "compile_s": seconds,
      "times": [],
    }
  for _ in range(rounds):
    for name in VARIANTS:
      start = time.perf_counter()
      jax.block_until_ready(compiled[name](*args))
      results[name]["times"].append(time.perf_counter() - start)
  for r in results.values():
    r["run_s"] = statistics.median(r["times"])
  return results


def models(tiny: bool) -> dict[str, tuple[Callable[..., Any], Any]]:
  key = jax.random.key(0)
  if tiny:
    mlp_sizes, batch, (vocab, width, layers, seq, rows) = (
      (64, 2),
      32,
      (32, 32, 1, 8, 4),
    )
    gpt2_sizes = (32, 32, 1, 8, 2)
  else:
    mlp_sizes, batch, (vocab, width, layers, seq, rows) = (
      (1024, 4),
      1024,
      (512, 256, 4, 128, 16),
    )
    # vocab, width, layers, tokens per row, rows: 8 x 128 tokens.
    gpt2_sizes = (512, 256, 4, 128, 8)
  width_mlp, depth = mlp_sizes
  mlp_batch = {
    "x": jax.random.normal(key, (batch, width_mlp)),
    "y": jnp.arange(batch) % 10,
  }
  tokens = jax.random.randint(key, (rows, seq + 1), 0, vocab)
  lm_batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
  g_vocab, g_width, g_layers, g_seq, g_rows = gpt2_sizes
  tokens = jax.random.randint(key, (g_rows, g_seq + 1), 0, g_vocab)
  gpt2_batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
  return {
    "mlp": (
      mlp_loss,
      (mlp_init(key, width_mlp, depth, 10), mlp_batch),
    ),
    "transformer": (
      transformer_loss,
      (transformer_init(key, vocab, width, layers), lm_batch),
    ),
    "gpt2": (
      gpt2_loss,
      (gpt2_init(key, g_vocab, g_width, g_layers, g_seq), gpt2_batch),
    ),
  }


def report(name: str, results: dict[str, dict[str, Any]], out=print) -> None:
  own = results["by_hand"]
  base = results["float32"]
  same = results["autocast"]["operations"] == own["operations"]
  out(
    f"{name}: autocast compiles to {'the same' if same else 'other'}"
    " operations (kind and dtype) as by_hand"
  )
  for variant, r in results.items():
    p = r["products"]
    out(
      f"{name:<11} {variant:<8}"
      f" {p.get('float16', 0):>4} {p.get('float32', 0):>4}"
      f" {r['temp_bytes'] / 2**20:9.2f}"
      f" {r['saved_bytes'] / 2**20:9.2f}"
      f" {r['saved_bytes'] / base['saved_bytes']:6.2f}"
      f" {r['compile_s'] / own['compile_s']:8.2f}"
      f" {r['run_s'] / own['run_s']:7.2f}"
      f" {r['compile_s'] / base['compile_s']:8.2f}"
      f" {r['run_s'] / base['run_s']:7.2f}"
      f" {r['run_s'] * 1e3:9.2f}",
      flush=True,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tiny", action="store_true", help="seconds")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--study", action="store_true", help="train the study")
  parser.add_argument(
    "--saved", action="store_true", help="saved residuals only (no compile)"
  )
  args = parser.parse_args(argv)
  print(
    f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}),"
    f" jax {jax.__version__}, cpu threads: {os.cpu_count()}"
  )
  if args.study:
    return study()
  if args.saved:
    return saved_only(args.tiny)
  rounds = args.rounds or (3 if args.tiny else 20)
  repeats = 1 if args.tiny else 3
  print(
    "products: float16, float32 in the lowered program; temp: compiled"
    " temporaries (MiB); saved: the residuals the backward pass keeps,"
    " arguments excluded (MiB, and the ratio to float32's); compile"
    " (trace + compile) and run: ratios to"
    " by_hand, then to float32; ms: median run time"
  )
  print(
    f"{'model':<11} {'variant':<8} {'f16':>4} {'f32':>4} {'temp MiB':>9}"
    f" {'saved MiB':>9} {'/f32':>6}"
    f" {'compile':>8} {'run':>7} {'compile':>8} {'run':>7} {'ms':>9}"
  )
  found = {}
  for name, (loss, inputs) in models(args.tiny).items():
    found[name] = measure(loss, inputs, rounds, repeats)
    report(name, found[name])
  return found


def saved_only(tiny: bool) -> dict[str, dict[str, int]]:
  """The saved-residual bytes of each model and variant: traced, not
  compiled, and the same on every machine."""
  print("saved: the residuals the backward pass keeps, arguments excluded")
  found: dict[str, dict[str, int]] = {}
  for name, (loss, inputs) in models(tiny).items():
    found[name] = {
      variant: saved_bytes(variant_loss(variant, loss), inputs)
      for variant in VARIANTS
    }
    for variant, n in found[name].items():
      print(
        f"{name:<11} {variant:<8} {n / 2**20:9.2f} MiB"
        f" {n / found[name]['float32']:6.3f}x float32's",
        flush=True,
      )
  return found


def study() -> dict[str, Any]:
  """The float16 study's task (notebooks/study), 40 steps of Adam with the
  dynamic loss scaler: held-out loss after each 10 steps, in float32, under
  the study's own float16 conversion, and under autocast with each rule."""
  import optax

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, root)
  from notebooks.study import config, data, model, train

  setup = train.prepare(config.Config())
  c = setup.config
  as_written = functools.partial(
    model.loss_fn, depth=c.depth, compute_dtype=F32
  )
  losses = {
    "float32": (as_written, False),
    "study float16": (
      functools.partial(model.loss_fn, depth=c.depth, compute_dtype=F16),
      True,
    ),
    "autocast": (ols.autocast(as_written), True),
    "cast": (ols.autocast(as_written, mixed="cast"), True),
  }
  found = {}
  for name, (loss, scaled) in losses.items():
    tx = optax.adam(c.lr)
    if scaled:
      tx = ols.loss_scale_optimizer(
        tx, initial_scale=c.dynamic_scale, dynamic_growth_steps=c.growth_steps
      )

    def step(carry, key, loss=loss, scaled=scaled, tx=tx):
      params, state = carry
      x, y = data.make_batch(key, setup.train_tokens, c.batch, c.context)
      if scaled:
        value, grads = ols.value_and_grad(loss)(state, params, x, y)
      else:
        value, grads = jax.value_and_grad(loss)(params, x, y)
      grads = jax.tree.map(lambda g: g.astype(F32), grads)
      updates, state = tx.update(grads, state, params, value=value)
      return (optax.apply_updates(params, updates), state), value

    chunk = jax.jit(
      lambda p, s, keys, step=step: jax.lax.scan(step, (p, s), keys)
    )
    params, state = setup.params0, tx.init(setup.params0)
    held = []
    for keys in setup.keys:
      (params, state), _ = chunk(params, state, keys)
      held.append(float(setup.eval_fn(params, *setup.eval_batch)[0]))
    skipped = int(ols.skip_stats(state).total_skipped) if scaled else 0
    found[name] = {"held_out": held, "skipped": skipped}
    print(
      f"{name:<14} held-out {' '.join(f'{h:.4f}' for h in held)}"
      f"  skipped {skipped}",
      flush=True,
    )
  return found


if __name__ == "__main__":
  main()
