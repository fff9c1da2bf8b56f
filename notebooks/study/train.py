"""Training: what every run of a job shares (``Setup``), one run
(``train``), and the main job (``run_study``)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_lossscale as ols

from . import data, model, probes, runs
from .config import BadBatchPlan, Config
from .results import BadBatchResult, RunResult, StudyResult
from .runs import RunSpec

# Called with a run's label and the number of steps just trained.
Progress = Callable[[str, int], None]
Batch = tuple[jax.Array, jax.Array]


@dataclasses.dataclass(frozen=True)
class Setup:
  """What every run of a job shares, so that runs differ only in their
  spec: the config (steps rounded up to whole chunks, the vocabulary's
  size), the training tokens, the initial parameters, the held-out batch,
  the probe batch of the flush statistics, the per-step keys (``[chunks,
  chunk, 2]``: the same batches for every run), and the chunks after which
  the flush statistics are taken."""

  config: Config
  train_tokens: jax.Array
  params0: model.Params
  eval_batch: Batch
  probe_batch: Batch
  keys: jax.Array
  checkpoints: tuple[int, ...]
  eval_fn: Callable[..., tuple[jax.Array, jax.Array]]


def _checkpoints(n_chunks: int, n_checkpoints: int) -> tuple[int, ...]:
  """The chunks after which 1/k, 2/k, ..., k/k of the training is done.

  >>> _checkpoints(4, 2), _checkpoints(1, 2)
  ((2, 4), (0, 1))
  """
  at = np.linspace(0, n_chunks, n_checkpoints + 1)[1:].round().astype(int)
  return tuple(sorted(set(at.tolist())))


def prepare(config: Config) -> Setup:
  """Loads the corpus (the last 10% held out) and draws the initial
  parameters and every batch's key from ``config.seed``."""
  chunk = min(config.chunk, config.steps)
  n_chunks = -(-config.steps // chunk)
  tokens_np, vocab = data.load_corpus(config.max_chars)
  config = dataclasses.replace(
    config,
    steps=n_chunks * chunk,
    chunk=chunk,
    vocab=vocab,
    corpus_chars=int(tokens_np.size),
  )
  split = int(tokens_np.size * 0.9)
  train, held = jnp.asarray(tokens_np[:split]), jnp.asarray(tokens_np[split:])
  key = jax.random.PRNGKey(config.seed)
  k_init, k_data, k_eval, k_probe = jax.random.split(key, 4)
  c = config
  return Setup(
    config=config,
    train_tokens=train,
    params0=model.init_params(
      k_init, vocab, c.context, c.embed, c.width, c.depth
    ),
    eval_batch=data.make_batch(k_eval, held, c.eval_tokens, c.context),
    probe_batch=data.make_batch(k_probe, train, c.batch, c.context),
    keys=jax.random.split(k_data, c.steps).reshape(n_chunks, chunk, -1),
    checkpoints=_checkpoints(n_chunks, c.n_checkpoints),
    eval_fn=jax.jit(functools.partial(model.evaluate, depth=c.depth)),
  )


def make_chunk(
  spec: RunSpec,
  tx: optax.GradientTransformation,
  tokens: jax.Array,
  config: Config,
) -> Callable[..., Any]:
  """A jitted function running ``config.chunk`` training steps with
  lax.scan, one host round trip per chunk. Each step returns the loss (of
  the global mean; NaN on a corrupted batch), the scale after it, and
  whether it was skipped."""
  replicas = spec.replicas
  share = spec.nan_batch_share

  def step(carry, key):
    params, opt_state = carry
    x, y = data.make_batch(key, tokens, config.batch, config.context)
    # Without corrupted batches, no draw and no NaN is traced at all.
    corrupt = data.is_corrupted(key, share) if share else None
    loss, grads = runs.value_and_grad(
      spec, params, opt_state, x, y, config.depth, corrupt
    )
    # One replica's share of the mean, times R: the all-reduce sum of R
    # replicas that hold the same batch.
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * replicas, grads)
    # The unscaled loss: the loss scaler checks it (a NaN loss is a bad
    # batch, not an overflow), and passes it on to Adam, which ignores it.
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    params = optax.apply_updates(params, updates)
    if spec.scaled:
      scale = ols.loss_scale(opt_state)
      skipped = ~ols.skip_stats(opt_state).last_finite
    else:
      scale, skipped = jnp.float32(1.0), ~ols.all_finite(grads)
    return (params, opt_state), (loss * replicas, scale, skipped)

  @jax.jit
  def chunk(params, opt_state, keys):
    return jax.lax.scan(step, (params, opt_state), keys)

  return chunk


def train(
  setup: Setup,
  spec: RunSpec,
  progress: Progress | None = None,
  label: str | None = None,
  keep_params: bool = False,
) -> RunResult:
  """Trains one run from the shared initial parameters, on the shared
  batches, taking the flush statistics at the checkpoints. ``label``
  (default: the spec's name) is what ``progress`` is told."""
  cfg = setup.config
  t0 = time.perf_counter()
  tx = runs.optimizer(spec, cfg.lr)
  params, opt_state = setup.params0, tx.init(setup.params0)
  chunk = make_chunk(spec, tx, setup.train_tokens, cfg)
  flush_fn = jax.jit(
    functools.partial(probes.flush_stats, spec, depth=cfg.depth)
  )
  losses, scales, skipped, flush = [], [], [], []
  for c in range(len(setup.keys) + 1):
    if c in setup.checkpoints:
      stats = flush_fn(params, opt_state, *setup.probe_batch)
      values = {k: float(v) for k, v in stats.items()}
      flush.append({"step": c * cfg.chunk, **values})
    if c == len(setup.keys):
      break
    (params, opt_state), (loss, s, k) = chunk(params, opt_state, setup.keys[c])
    losses.append(np.asarray(loss))
    scales.append(np.asarray(s))
    skipped.append(np.asarray(k))
    if progress is not None:
      progress(spec.name if label is None else label, cfg.chunk)
  eval_loss, eval_acc = (
    float(v) for v in setup.eval_fn(params, *setup.eval_batch)
  )
  stats, report = None, None
  if spec.scaled:
    # Read once, at the end: the library's own counts and its report.
    read = ols.skip_stats(opt_state)._asdict()
    stats = {k: int(v) for k, v in read.items() if k != "last_finite"}
    report = str(ols.skip_report(opt_state, tx))
  return RunResult(
    spec=spec,
    loss=np.concatenate(losses),
    scale=np.concatenate(scales),
    skipped=np.concatenate(skipped),
    eval_loss=eval_loss,
    eval_acc=eval_acc,
    flush=flush,
    initial_scale=float(runs.scale(spec, tx.init(setup.params0))),
    seconds=time.perf_counter() - t0,
    skip_stats=stats,
    skip_report=report,
    params=params if keep_params else None,
    opt_state=opt_state if keep_params else None,
  )


def train_all(
  setup: Setup,
  specs: Iterable[RunSpec],
  progress: Progress | None = None,
  label: str = "{}",
  keep_params: bool = False,
) -> dict[str, RunResult]:
  """Trains each run in turn; by name. ``label`` formats the name for
  ``progress``."""
  return {
    s.name: train(setup, s, progress, label.format(s.name), keep_params)
    for s in specs
  }


def run_study(
  config: Config | None = None,
  progress: Progress | None = None,
  keep_params: bool = False,
) -> StudyResult:
  """The main job: the six runs of ``runs.main_specs`` (default config:
  the README's command)."""
  setup = prepare(config or Config())
  return StudyResult(
    config=setup.config,
    runs=train_all(
      setup, runs.main_specs(setup.config), progress, keep_params=keep_params
    ),
    probe_batch=setup.probe_batch,
  )


def corrupted(setup: Setup, share: float) -> np.ndarray:
  """Which of the job's steps draw a corrupted batch at this share, a bool
  per step: the draw the training makes, from the same keys."""
  keys = setup.keys.reshape(-1, setup.keys.shape[-1])
  return np.asarray(jax.vmap(lambda k: data.is_corrupted(k, share))(keys))


def run_bad_batches(
  plan: BadBatchPlan | None = None,
  config: Config | None = None,
  progress: Progress | None = None,
) -> BadBatchResult:
  """``--corrupt``: the runs of ``runs.bad_batch_specs`` on ``config``
  (default: the main job's) with the plan's steps and replicas, and one
  flush checkpoint, at the end."""
  plan = plan or BadBatchPlan()
  config = dataclasses.replace(
    config or Config(),
    steps=plan.steps,
    replicas=plan.replicas,
    n_checkpoints=1,
  )
  setup = prepare(config)
  specs = runs.bad_batch_specs(plan.share, plan.replicas)
  return BadBatchResult(
    config=setup.config,
    plan=plan,
    corrupted=corrupted(setup, plan.share),
    runs=train_all(setup, specs, progress),
  )
