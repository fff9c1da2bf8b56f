"""The corpus and the batches: Python's own standard-library sources as
characters, so that the study downloads nothing and runs anywhere Python
does."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

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

# Index 0 is "other" (any character outside printable ASCII), 1 newline.
VOCABULARY = ("\0", "\n", *(chr(c) for c in range(32, 127)))


def encode(text: str) -> np.ndarray:
  """Characters as int32 token ids over ``VOCABULARY``.

  >>> encode("a\\né").tolist()
  [67, 1, 0]
  """
  index = {c: i for i, c in enumerate(VOCABULARY)}
  return np.array([index.get(c, 0) for c in text], dtype=np.int32)


def load_corpus(max_chars: int | None = None) -> tuple[np.ndarray, int]:
  """The corpus as int32 tokens, and the vocabulary's size. Files missing
  from this Python's library are left out rather than failing the study."""
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
  return encode(text), len(VOCABULARY)


def make_batch(
  key: jax.Array, tokens: jax.Array, batch: int, context: int
) -> tuple[jax.Array, jax.Array]:
  """``batch`` random windows: the ``context`` characters ``[batch,
  context]`` and the one after each ``[batch]``. Drawn from a key inside
  the jitted step, so that every run sees the same batches without holding
  them all."""
  starts = jax.random.randint(key, (batch,), 0, tokens.shape[0] - context - 1)
  idx = starts[:, None] + jnp.arange(context + 1)[None, :]
  window = tokens[idx]
  return window[:, :context], window[:, context]


# Folded into a batch's key for the draw that decides whether the batch is
# corrupted, so that the draw is independent of the batch's contents.
_CORRUPTION_STREAM = 0xBAD


def is_corrupted(key: jax.Array, share: float) -> jax.Array:
  """Whether the batch drawn from ``key`` is a corrupted one, with
  probability ``share``: a bool scalar, drawn from the batch's own key, so
  that every run of a job has the same corrupted batches.

  >>> keys = jax.random.split(jax.random.PRNGKey(0), 1000)
  >>> int(jax.vmap(lambda k: is_corrupted(k, 0.05))(keys).sum())
  49
  >>> bool(is_corrupted(keys[0], 0.0))
  False
  """
  draw = jax.random.uniform(jax.random.fold_in(key, _CORRUPTION_STREAM))
  return draw < share
