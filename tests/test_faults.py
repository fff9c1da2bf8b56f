"""Fault injection: nothing non-finite is ever lost into the weights.

A small MLP trains in float16 (float32 master weights, float16 forward and
backward, scaled loss) while NaN, +inf, -inf and overflow-sized values are
injected into random gradient leaves at random steps, alone and in bursts.
Gradients reach `update` in float16 (one configuration: cast to float32, as
`jax.grad` returns them for float32 master weights). One `lax.scan` over the
steps is jitted once per configuration; hypothesis feeds the schedules as
data. Across all schedules:

- no non-finite value reaches a parameter or the inner optimizer state;
- a skipped step leaves parameters and inner state bit for bit as they were;
- the scale stays finite and within [min_scale, max_scale];
- scale, counter and skip statistics equal tests/_model.py step for step.

Each configuration's test also asserts on its own totals (schedules run,
faults injected, non-finite steps skipped, no corruption); they are
reported in the terminal summary.
"""

import collections
import functools

import _model
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from jax import lax

import optax_lossscale as ols

T = 48  # steps per schedule
F16_MAX = float(np.finfo(np.float16).max)
INT32_MAX = _model.INT32_MAX
N_LEAVES = 4

# Injection codes, fed as data.
NONE, NAN, POS_INF, NEG_INF, SCALED_OVERFLOW, UNSCALED_OVERFLOW = range(6)
CODE_NAMES = ("none", "nan", "+inf", "-inf", "6e4*scale", "3e38")

EXAMPLES = 50  # schedules per configuration

CONFIGS = {
  # Keras defaults but a short growth period, so the scale moves.
  "keras-like": dict(dynamic_growth_steps=4),
  # Hysteresis, odd factors (not powers of two), min and max.
  "hysteresis3-odd-factors": dict(
    initial_scale=2.0**8,
    dynamic_growth_steps=2,
    growth_factor=3.0,
    backoff_factor=0.3,
    min_scale=4.0,
    max_scale=2.0**12,
    hysteresis=3,
  ),
  # A scale below 1, float32 gradients: 3e38 overflows when unscaled.
  "below-one": dict(
    initial_scale=0.25,
    dynamic_growth_steps=5,
    min_scale=2.0**-4,
    max_scale=64.0,
  ),
  # Grows after every finite step, pinned at max_scale.
  "hysteresis2-pinned-max": dict(
    initial_scale=2.0**14,
    dynamic_growth_steps=1,
    max_scale=2.0**16,
    hysteresis=2,
  ),
  # Static: non-finite steps are skipped, the scale never moves.
  "static": dict(dynamic=False, initial_scale=128.0),
  # An inner state with float hyperparameters and a schedule driven by the
  # inner count (inject_hyperparams), which must not advance on skips.
  "inject-hyperparams": dict(
    initial_scale=2.0**12,
    dynamic_growth_steps=3,
    backoff_factor=0.125,
    max_scale=2.0**13,
  ),
}

# Configurations whose (float16-computed) gradients reach `update` cast to
# float32, as `jax.grad` with respect to float32 master weights returns them.
F32_GRADS = {"inject-hyperparams", "below-one"}

# The inner optimizer of the configurations that do not use make_tx's default.
INNER_OF_CONFIG = {
  "inject-hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
    learning_rate=optax.linear_schedule(1e-2, 1e-3, 40), weight_decay=1e-4
  ),
}


def model_config(kwargs):
  cfg = _model.ModelConfig()
  cfg.dynamic = kwargs.get("dynamic", True)
  if "initial_scale" in kwargs:
    cfg.initial_scale = kwargs["initial_scale"]
  for ours, theirs in [
    ("dynamic_growth_steps", "growth_steps"),
    ("growth_factor", "growth_factor"),
    ("backoff_factor", "backoff_factor"),
    ("min_scale", "min_scale"),
    ("max_scale", "max_scale"),
    ("hysteresis", "hysteresis"),
  ]:
    if ours in kwargs:
      setattr(cfg, theirs, kwargs[ours])
  return cfg


def _bits_equal(a, b):
  a, b = jnp.asarray(a), jnp.asarray(b)
  if a.dtype != b.dtype or a.shape != b.shape:
    return jnp.zeros([], jnp.bool_)
  if jnp.issubdtype(a.dtype, jnp.floating):
    uint = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[a.dtype.itemsize]
    a, b = lax.bitcast_convert_type(a, uint), lax.bitcast_convert_type(b, uint)
  return jnp.all(a == b)


def _tree_bits_equal(a, b):
  if jax.tree.structure(a) != jax.tree.structure(b):
    return jnp.zeros([], jnp.bool_)
  flags = [
    _bits_equal(x, y)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  ]
  return jnp.all(jnp.stack(flags)) if flags else jnp.ones([], jnp.bool_)


def _tree_finite(tree):
  flags = [
    jnp.all(jnp.isfinite(x))
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(flags)) if flags else jnp.ones([], jnp.bool_)


def init_params():
  k1, k2 = jax.random.split(jax.random.key(42))
  return {
    "w1": jax.random.normal(k1, (4, 8), jnp.float32) * 0.5,
    "b1": jnp.zeros((8,), jnp.float32),
    "w2": jax.random.normal(k2, (8, 2), jnp.float32) * 0.5,
    "b2": jnp.zeros((2,), jnp.float32),
  }


def make_tx(config_name):
  inner = INNER_OF_CONFIG.get(
    config_name,
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
  )()
  return ols.loss_scale_optimizer(inner, **CONFIGS[config_name])


def _mlp_loss(p16, x, y):
  h = jnp.tanh(x @ p16["w1"] + p16["b1"])
  return jnp.mean((h @ p16["w2"] + p16["b2"] - y) ** 2)


@functools.cache
def compiled_run(config_name):
  tx = make_tx(config_name)

  def body(carry, xs):
    params, opt_state = carry
    t, code, leaf, pos = xs
    key = jax.random.fold_in(jax.random.key(7), t)
    x = jax.random.normal(key, (16, 4), jnp.float32).astype(jnp.float16)
    y = jnp.stack([jnp.sum(x, 1), x[:, 0]], 1) * jnp.float16(0.5)
    p16 = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    grads = jax.grad(lambda p: ols.scale_loss(_mlp_loss(p, x, y), opt_state))(
      p16
    )
    scale = ols.loss_scale(opt_state)
    value = jnp.stack(
      [
        jnp.float32(0),
        jnp.float32(jnp.nan),
        jnp.float32(jnp.inf),
        jnp.float32(-jnp.inf),
        jnp.float32(6e4) * scale,  # overflows float16 once scale > 1.09
        # Overflows when unscaled by a scale below 1 (float32 gradients). A
        # finite gradient that large would overflow adam's own square
        # wherever unscaling keeps it finite, which is not the loss scaler's
        # to prevent: only the configuration whose scale stays below 1 and
        # whose inner clips gets it; the others get a harmless 6e4.
        jnp.float32(3e38 if config_name == "below-one" else 6e4),
      ]
    )[code]
    value = value.astype(
      jnp.float32 if config_name in F32_GRADS else jnp.float16
    )
    leaves, treedef = jax.tree.flatten(grads)
    if config_name in F32_GRADS:
      leaves = [g.astype(jnp.float32) for g in leaves]
    leaves = [
      jnp.where(
        (code != NONE) & (leaf == i),
        g.ravel().at[pos % g.size].set(value).reshape(g.shape),
        g,
      )
      for i, g in enumerate(leaves)
    ]
    grads = jax.tree.unflatten(treedef, leaves)
    # The harness's own finiteness verdict: every element of every gradient,
    # unscaled in float32 (the master params' dtype), is finite.
    expected_finite = jnp.all(
      jnp.stack(
        [jnp.all(jnp.isfinite(g.astype(jnp.float32) / scale)) for g in leaves]
      )
    )

    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    lss = new_opt_state.loss_scale_state
    out = dict(
      expected_finite=expected_finite,
      scale=lss.loss_scale,
      counter=(
        lss.counter if lss.counter is not None else jnp.zeros([], jnp.int32)
      ),
      in_a_row=lss.skipped_in_a_row,
      total=lss.total_skipped,
      last_finite=lss.last_finite,
      params_finite=_tree_finite(new_params),
      inner_finite=_tree_finite(new_opt_state.inner_state),
      params_same=_tree_bits_equal(new_params, params),
      inner_same=_tree_bits_equal(
        new_opt_state.inner_state, opt_state.inner_state
      ),
      dtypes_same=jnp.asarray(
        jax.tree.map(lambda a: a.dtype, new_opt_state)
        == jax.tree.map(lambda a: a.dtype, opt_state)
      ),
    )
    return (new_params, new_opt_state), out

  @jax.jit
  def run(code, leaf, pos):
    params = init_params()
    carry = (params, tx.init(params))
    xs = (jnp.arange(T, dtype=jnp.int32), code, leaf, pos)
    (params, opt_state), outs = lax.scan(body, carry, xs)
    return params, opt_state, outs

  return run


def schedule_strategy():
  event = st.tuples(
    st.integers(0, T - 1),  # start
    st.sampled_from([1, 1, 1, 2, 3, 5, 8, 20]),  # length: alone or burst
    st.integers(NAN, UNSCALED_OVERFLOW),  # code
    st.integers(0, N_LEAVES - 1),  # leaf
    st.integers(0, 2**20),  # element (mod leaf size)
    st.booleans(),  # mixed codes in the burst
  )
  return st.lists(event, max_size=8)


def build_schedule(events):
  code = np.zeros(T, np.int32)
  leaf = np.zeros(T, np.int32)
  pos = np.zeros(T, np.int32)
  for start, length, c, lf, p, mixed in events:
    for i, t in enumerate(range(start, min(T, start + length))):
      code[t] = (c - 1 + i) % 5 + 1 if mixed else c
      leaf[t] = (lf + i * mixed) % N_LEAVES
      pos[t] = p + 7 * i
  return code, leaf, pos


def check_against_model(config_name, code, outs):
  """Returns the list of discrepancies (corruptions) for one schedule."""
  cfg = model_config(CONFIGS[config_name])
  outs = jax.tree.map(np.asarray, outs)
  state = _model.initial(cfg)
  problems = []
  for t in range(T):
    finite = bool(outs["expected_finite"][t])
    if code[t] in (NAN, POS_INF, NEG_INF) and finite:
      problems.append((t, "harness: an injected NaN/inf counted finite"))
    state = _model.step(state, finite, cfg)
    got = (
      float(outs["scale"][t]),
      int(outs["counter"][t]),
      int(outs["in_a_row"][t]),
      int(outs["total"][t]),
      bool(outs["last_finite"][t]),
    )
    want = (
      state.scale,
      state.counter,
      state.in_a_row,
      state.total,
      state.last_finite,
    )
    if got != want:
      problems.append((t, f"state {got} != model {want}"))
    scale = got[0]
    if not (np.isfinite(scale) and cfg.min_scale <= scale <= cfg.max_scale):
      problems.append((t, f"scale {scale} out of range"))
    if not outs["params_finite"][t]:
      problems.append((t, "non-finite parameter"))
    if not outs["inner_finite"][t]:
      problems.append((t, "non-finite inner state"))
    if not outs["dtypes_same"][t]:
      problems.append((t, "state dtypes drifted"))
    if not got[4] and not (outs["params_same"][t] and outs["inner_same"][t]):
      problems.append((t, "skipped step changed params or inner state"))
  return problems


@pytest.mark.parametrize(
  "config_name",
  # 50 schedules each: the keras-like configuration stays in the fast
  # subset.
  [
    c if c == "keras-like" else pytest.param(c, marks=pytest.mark.slow)
    for c in CONFIGS
  ],
)
def test_random_fault_schedules(config_name, record_property):
  totals = collections.Counter(corruptions=0)

  @settings(
    derandomize=True,
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
  )
  @given(events=schedule_strategy())
  def one_schedule(events):
    code, leaf, pos = build_schedule(events)
    params, opt_state, outs = compiled_run(config_name)(code, leaf, pos)
    problems = check_against_model(config_name, code, outs)
    injected = code != NONE
    totals["schedules"] += 1
    totals["steps"] += T
    totals["faults_injected"] += int(np.sum(injected))
    totals["faults_non_finite"] += int(
      np.sum(injected & ~np.asarray(outs["expected_finite"]))
    )
    totals["steps_skipped"] += int(np.sum(~np.asarray(outs["last_finite"])))
    totals["corruptions"] += len(problems)
    assert not problems, (config_name, code.tolist(), problems[:5])
    assert bool(_tree_finite(params)) and bool(_tree_finite(opt_state))

  one_schedule()
  record_property("fault_totals", dict(totals))  # see conftest.py
  # The schedules exercised the harness: every one ran, faults were
  # injected, and non-finite steps were skipped, none of them corrupting.
  assert totals["corruptions"] == 0
  assert totals["schedules"] >= EXAMPLES, totals
  assert totals["faults_injected"] >= 5 * EXAMPLES, totals
  assert totals["faults_non_finite"] >= 3 * EXAMPLES, totals
  assert totals["steps_skipped"] >= totals["faults_non_finite"], totals


def test_every_fault_kind_is_exercised():
  """The configurations reach each code's non-finite case: 6e4*scale
  overflows float16 at scale > 1, a float32 3e38 overflows when unscaled
  below 1."""
  for name, kind in [
    ("keras-like", SCALED_OVERFLOW),
    ("below-one", UNSCALED_OVERFLOW),
  ]:
    code = np.zeros(T, np.int32)
    code[2] = kind
    _, _, outs = compiled_run(name)(
      code, np.zeros(T, np.int32), np.zeros(T, np.int32)
    )
    assert not bool(outs["last_finite"][2]), (name, kind)
    assert not check_against_model(name, code, outs)


def test_finite_float16_gradient_cannot_poison_inner_state():
  tx = ols.loss_scale_optimizer(optax.adam(1e-3), initial_scale=1.0)
  params = {"w": jnp.ones(2, jnp.float32)}
  state = tx.init(params)
  grads = {"w": jnp.array([6e4, 1.0], jnp.float16)}  # finite, unscaled by 1
  _, state = tx.update(grads, state, params)
  assert bool(ols.skip_stats(state).last_finite)
  assert bool(_tree_finite(state.inner_state))


# --- Long runs ---


def _nan_grads(params):
  return jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)


def test_saturating_counters_do_not_wrap():
  params = {"w": jnp.ones(3)}
  tx = ols.loss_scale_optimizer(
    optax.sgd(0.1), initial_scale=8.0, dynamic_growth_steps=INT32_MAX
  )
  cfg = _model.ModelConfig(initial_scale=8.0, growth_steps=INT32_MAX)
  state = tx.init(params)
  near = jnp.int32(INT32_MAX - 2)
  state = state._replace(
    loss_scale_state=state.loss_scale_state._replace(
      skipped_in_a_row=near, total_skipped=near
    )
  )
  model = _model.ModelState(
    scale=8.0, in_a_row=INT32_MAX - 2, total=INT32_MAX - 2
  )
  update = jax.jit(tx.update)
  for _ in range(5):
    _, state = update(_nan_grads(params), state, params)
    model = _model.step(model, False, cfg)
    stats = ols.skip_stats(state)
    assert int(stats.total_skipped) == model.total
    assert int(stats.skipped_in_a_row) == model.in_a_row
  assert int(stats.total_skipped) == INT32_MAX
  assert int(stats.skipped_in_a_row) == INT32_MAX
  _, state = update({"w": jnp.ones(3)}, state, params)
  stats = ols.skip_stats(state)
  assert int(stats.skipped_in_a_row) == 0
  assert int(stats.total_skipped) == INT32_MAX

  # The growth counter at the largest growth period: counter + 1 reaches
  # 2**31 - 1 exactly, the scale grows, the counter resets, nothing wraps.
  state = state._replace(
    loss_scale_state=state.loss_scale_state._replace(
      counter=jnp.int32(INT32_MAX - 3)
    )
  )
  model = _model.ModelState(
    scale=float(ols.loss_scale(state)), counter=INT32_MAX - 3
  )
  seen = []
  for _ in range(4):
    _, state = update({"w": jnp.ones(3)}, state, params)
    model = _model.step(model, True, cfg)
    seen.append(int(ols.dynamic_counter(state)))
    assert seen[-1] == model.counter
    assert float(ols.loss_scale(state)) == model.scale
  assert seen == [INT32_MAX - 2, INT32_MAX - 1, 0, 1]
  assert float(ols.loss_scale(state)) == 2.0  # 8 -> 1 (floor) -> 2


N_LONG = 100_000


def _long_scan(tx, finite):
  params = {"w": jnp.ones(2)}

  @jax.jit
  def run():
    def body(carry, _):
      p, s = carry
      g = jnp.where(finite, 1.0, jnp.nan) * jnp.ones(2)
      u, s = tx.update({"w": g}, s, p)
      scale = ols.loss_scale(s)
      return (optax.apply_updates(p, u), s), (scale.min(), scale.max())

    (p, s), (lo, hi) = lax.scan(
      body, (params, tx.init(params)), None, length=N_LONG
    )
    return p, s, lo.min(), hi.max()

  return run()


@pytest.mark.parametrize(
  "kwargs, finite, expected",
  [
    # Pinned at min_scale by 100k overflows in a row; backoff 0.3 is not a
    # power of two, so the floor is reached by clamping, not exactly.
    (
      dict(
        initial_scale=2.0**15, min_scale=0.125, backoff_factor=0.3, hysteresis=4
      ),
      False,
      0.125,
    ),
    # Pinned at a max_scale that growth by 3 cannot hit exactly: 3**12.
    (
      dict(
        initial_scale=1.0,
        dynamic_growth_steps=1,
        growth_factor=3.0,
        max_scale=2.0**20,
      ),
      True,
      3.0**12,
    ),
    # No max_scale: growth stops below float32 overflow, at 2**127.
    (dict(dynamic_growth_steps=1), True, 2.0**127),
  ],
)
def test_scale_pinned_for_100k_steps(kwargs, finite, expected):
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), **kwargs)
  params, state, lo, hi = _long_scan(tx, finite)
  cfg = model_config(kwargs)
  scale = float(ols.loss_scale(state))
  assert scale == expected and np.isfinite(scale)
  assert cfg.min_scale <= float(lo) and float(hi) <= cfg.max_scale
  assert np.isfinite(float(hi))
  # The model, run to a fixed point, agrees (it is pinned long before 100k).
  model = _model.initial(cfg)
  for _ in range(300):
    model = _model.step(model, finite, cfg)
  assert model.scale == scale
  stats = ols.skip_stats(state)
  if finite:
    assert int(stats.total_skipped) == 0
    assert bool(_tree_finite(params))
  else:
    assert int(stats.total_skipped) == N_LONG
    assert int(stats.skipped_in_a_row) == N_LONG
    assert int(ols.dynamic_counter(state)) == 0
    assert np.array_equal(np.asarray(params["w"]), np.ones(2, np.float32))
