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
CPU cores) trains six runs, same seeds, same batches, same steps:

  * ``fp32``:             everything float32;
  * ``fp16``:             float16 compute, no loss scaling;
  * ``fp16_static``:      float16, static loss scale (``--static-scale``);
  * ``fp16_dynamic``:     float16, ``loss_scale_optimizer`` at its defaults
                          (2**15, growth after 2000 finite steps);
  * ``fp16_autocast``:    the same scaling, the float32 model's loss under
                          ``ols.autocast`` instead of the casts above;
  * ``fp16_dynamic_g5``:  the same from ``--dynamic-scale`` (2**15) with
                          growth after ``--growth-steps`` (5) finite steps,
                          so that the scale moves within the short run: it
                          grows, overflows, backs off.

``--sweep`` runs the whole study instead (see RESULTS.md for its time): static
scales 2**0 .. 2**30, dynamic runs from 2**0, 2**15 and 2**32, the sawtooth
with a short growth interval against the default one, and a data-parallel
token mean (``--replicas``) where plain float16 breaks down. ``--corrupt
SHARE`` runs the bad-batch job: on that 64-replica mean, a share of the
batches corrupted (one NaN each), float32 against dynamic scaling that
halves its scale on a NaN loss (Keras's rule) and dynamic scaling with
``backoff_on_nonfinite_loss=False``, with each run's ``ols.skip_report``.
``--json PATH`` writes every number (per-step curves included) to PATH.

The modules, in the order the study uses them: ``config`` (the settings),
``data`` (the corpus, the batches), ``model``, ``runs`` (what a run is:
``RunSpec``), ``probes`` (float16 against float32 gradients), ``train``,
``sweep``, ``results`` (and their JSON), ``report`` (the printed tables),
``figures`` and ``cli``. None of them chooses the platform: the entry
point ``notebooks/fp16_study.py`` does (CPU unless ``JAX_PLATFORMS`` says
otherwise), and the notebook and the tests run on the default one.
"""
