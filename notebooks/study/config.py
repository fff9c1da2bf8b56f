"""The study's settings, as frozen records rather than dicts of defaults, so
that a misspelt setting fails where it is written instead of being ignored.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  """The model, the data and the training shared by every run of a job.

  ``static_scale``, ``dynamic_scale`` and ``growth_steps`` are the main
  job's scaled runs (``runs.main_specs``); ``replicas`` divides each run's
  loss by a global token count (``RunSpec.replicas``). ``vocab`` and
  ``corpus_chars`` come from the corpus: ``train.prepare`` fills them in,
  and rounds ``steps`` up to whole chunks.

  >>> Config(steps=30, growth_steps=3).batch
  131072
  """

  steps: int = 40
  # 2**17 tokens in one mean: every per-token gradient carries 2**-17,
  # which is what makes plain float16 underflow here.
  batch: int = 131072
  context: int = 8
  embed: int = 16
  width: int = 32
  depth: int = 4
  lr: float = 3e-3
  static_scale: float = 2.0**10
  dynamic_scale: float = 2.0**15
  growth_steps: int = 5
  replicas: int = 1
  seed: int = 0
  # Steps per jitted lax.scan call: the progress bar moves once per chunk.
  chunk: int = 10
  # Flush statistics after 1/k, ..., k/k of the training.
  n_checkpoints: int = 2
  eval_tokens: int = 32768
  max_chars: int | None = None
  vocab: int | None = None
  corpus_chars: int | None = None


@dataclasses.dataclass(frozen=True)
class SweepPlan:
  """What ``--sweep`` trains (notebooks/RESULTS.md has its tables).

  ``dynamic`` and ``sawtooth`` list (initial scale, growth interval) pairs,
  None meaning the library's default interval of 2000 finite steps. A part
  is left out by emptying it: no static scales, no dynamic pairs,
  ``sawtooth_steps=0`` or ``replicas=0``.
  """

  steps: int = 100
  # static scales 2**0, 2**2, ..., 2**30, and every power of two at the
  # window's edges
  static_log2: tuple[int, ...] = (
    *(0, 1, 2, 3, 4, 6, 8, 10, 12, 14),
    *(16, 17, 18, 19, 20, 22, 24, 26, 28, 30),
  )
  dynamic: tuple[tuple[float, int | None], ...] = (
    (1.0, 20),
    (2.0**15, 20),
    (2.0**32, 20),
    (2.0**15, None),
    (2.0**32, None),
  )
  # the usable window: held-out loss within this of float32 (nats/char)
  tol: float = 0.005
  # the data-parallel token mean: replicas sharing one global mean, and
  # which of the main job's runs train that way
  replicas: int = 64
  divergence: tuple[str, ...] = ("fp32", "fp16", "fp16_dynamic")
  # the sawtooth: longer, growth every 20 finite steps against 2000
  sawtooth_steps: int = 300
  sawtooth: tuple[tuple[float, int | None], ...] = (
    (2.0**15, 20),
    (2.0**15, None),
  )


@dataclasses.dataclass(frozen=True)
class BadBatchPlan:
  """What ``--corrupt`` trains (notebooks/RESULTS.md, Table 5): the runs of
  ``runs.bad_batch_specs`` for ``steps`` steps, each batch corrupted with
  probability ``share`` (the same batches for every run), on a global
  token mean over ``replicas``: there the gradients sit low in float16's
  range, so a scale that falls costs (plain float16 diverges there, Table
  4). With seed 0 and 200 steps, 13 batches are corrupted."""

  share: float = 0.04
  steps: int = 200
  replicas: int = 64
