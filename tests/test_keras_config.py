"""`from_keras_config` / `to_keras_config`: Keras LossScaleOptimizer configs,
current (TF >= 2.4, Keras 3) and legacy (TF <= 2.3, `loss_scale` entry)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols

INNER = optax.sgd(0.1)


def cfg_of(config):
  return ols.from_keras_config(config, INNER).loss_scale_config


def summary(c):
  return (
    c.dynamic,
    c.initial_scale,
    c.growth_steps,
    c.growth_factor,
    c.backoff_factor,
    c.min_scale,
    c.hysteresis,
  )


# --- current format ---


@pytest.mark.parametrize(
  "config, expected",
  [
    (
      {"dynamic": True, "initial_scale": 1024.0, "dynamic_growth_steps": 100},
      (True, 1024.0, 100, 2.0, 0.5, 1.0, 1),
    ),
    (
      {"dynamic": True, "initial_scale": 32768.0, "dynamic_growth_steps": 2000},
      (True, 32768.0, 2000, 2.0, 0.5, 1.0, 1),
    ),
    (
      {"dynamic": False, "initial_scale": 128.0, "dynamic_growth_steps": None},
      (False, 128.0, 2000, 2.0, 0.5, 1.0, 1),
    ),
    (
      {"dynamic": False, "initial_scale": 64},
      (False, 64.0, 2000, 2.0, 0.5, 1.0, 1),
    ),
    ({}, (True, 32768.0, 2000, 2.0, 0.5, 1.0, 1)),
    # Keras 3: no `dynamic` key (always dynamic), `name` and the inner
    # optimizer's entries alongside.
    (
      {
        "name": "loss_scale_optimizer",
        "inner_optimizer": {
          "module": "keras.optimizers",
          "class_name": "SGD",
          "config": {"learning_rate": 0.01},
        },
        "initial_scale": 4096.0,
        "dynamic_growth_steps": 500,
      },
      (True, 4096.0, 500, 2.0, 0.5, 1.0, 1),
    ),
    # Keras 3 base-optimizer keys, at their defaults, are ignored.
    (
      {
        "name": "lso",
        "learning_rate": 0.5,
        "weight_decay": None,
        "clipnorm": None,
        "global_clipnorm": None,
        "clipvalue": None,
        "use_ema": False,
        "ema_momentum": 0.99,
        "ema_overwrite_frequency": None,
        "loss_scale_factor": None,
        "gradient_accumulation_steps": None,
        "initial_scale": 8.0,
        "dynamic_growth_steps": 3,
      },
      (True, 8.0, 3, 2.0, 0.5, 1.0, 1),
    ),
    # Keras 2 (tf.keras) extras: `optimizer`/`inner_optimizer`,
    # `is_legacy_optimizer`, `jit_compile`, `decay`.
    (
      {
        "inner_optimizer": {"class_name": "Adam", "config": {}},
        "is_legacy_optimizer": False,
        "jit_compile": True,
        "decay": 0.0,
        "dynamic": True,
        "initial_scale": 2.0,
        "dynamic_growth_steps": 7,
      },
      (True, 2.0, 7, 2.0, 0.5, 1.0, 1),
    ),
  ],
)
def test_current_format(config, expected):
  assert summary(cfg_of(config)) == expected


def test_imported_optimizer_is_usable():
  tx = ols.from_keras_config(
    {"dynamic": True, "initial_scale": 4.0, "dynamic_growth_steps": 1},
    optax.sgd(1.0),
  )
  params = jnp.ones(2)
  state = tx.init(params)
  updates, state = tx.update(jnp.full(2, 4.0), state, params)
  assert updates.tolist() == [-1.0, -1.0]
  assert float(ols.loss_scale(state)) == 8.0


# --- TF <= 2.3 format ---


def legacy(class_name, **config):
  return {"loss_scale": {"class_name": class_name, "config": config}}


@pytest.mark.parametrize(
  "config, expected",
  [
    (
      legacy("FixedLossScale", loss_scale_value=256.0),
      (False, 256.0, 2000, 2.0, 0.5, 1.0, 1),
    ),
    (
      legacy(
        "DynamicLossScale",
        initial_loss_scale=1024.0,
        increment_period=50,
        multiplier=2.0,
      ),
      (True, 1024.0, 50, 2.0, 0.5, 1.0, 1),
    ),
    (legacy("DynamicLossScale"), (True, 32768.0, 2000, 2.0, 0.5, 1.0, 1)),
    # A multiplier other than 2 is mapped, not refused (Keras refuses it).
    (
      legacy(
        "DynamicLossScale",
        initial_loss_scale=256.0,
        increment_period=10,
        multiplier=4.0,
      ),
      (True, 256.0, 10, 4.0, 0.25, 1.0, 1),
    ),
    (
      legacy("DynamicLossScale", multiplier=3),
      # Factors are kept as the float32 values the rule multiplies by.
      (True, 32768.0, 2000, 3.0, float(np.float32(1.0 / 3)), 1.0, 1),
    ),
    ({"loss_scale": 128.0}, (False, 128.0, 2000, 2.0, 0.5, 1.0, 1)),
    ({"loss_scale": 512}, (False, 512.0, 2000, 2.0, 0.5, 1.0, 1)),
    ({"loss_scale": "dynamic"}, (True, 32768.0, 2000, 2.0, 0.5, 1.0, 1)),
    # The inner optimizer's entries are ignored in this form too.
    (
      {
        "name": "LossScaleOptimizer",
        "optimizer": {"class_name": "SGD"},
        "loss_scale": "dynamic",
      },
      (True, 32768.0, 2000, 2.0, 0.5, 1.0, 1),
    ),
  ],
)
def test_legacy_format(config, expected):
  assert summary(cfg_of(config)) == expected


# --- round trips ---


@pytest.mark.parametrize(
  "config",
  [
    {"dynamic": True, "initial_scale": 1024.0, "dynamic_growth_steps": 100},
    {"dynamic": True, "initial_scale": 32768.0, "dynamic_growth_steps": 2000},
    {"dynamic": False, "initial_scale": 128.0, "dynamic_growth_steps": None},
  ],
)
def test_round_trip_from_then_to(config):
  assert ols.to_keras_config(ols.from_keras_config(config, INNER)) == config


@pytest.mark.parametrize(
  "kwargs",
  [
    {},
    {"initial_scale": 8.0, "dynamic_growth_steps": 3},
    {"dynamic": False, "initial_scale": 2.0**20},
  ],
)
def test_round_trip_to_then_from(kwargs):
  tx = ols.loss_scale_optimizer(INNER, **kwargs)
  back = ols.from_keras_config(ols.to_keras_config(tx), INNER)
  assert back.loss_scale_config == tx.loss_scale_config


def test_legacy_imports_export_in_current_format():
  tx = ols.from_keras_config(
    legacy(
      "DynamicLossScale",
      initial_loss_scale=64.0,
      increment_period=9,
      multiplier=2.0,
    ),
    INNER,
  )
  assert ols.to_keras_config(tx) == {
    "dynamic": True,
    "initial_scale": 64.0,
    "dynamic_growth_steps": 9,
  }
  tx = ols.from_keras_config({"loss_scale": 16}, INNER)
  assert ols.to_keras_config(tx) == {
    "dynamic": False,
    "initial_scale": 16.0,
    "dynamic_growth_steps": None,
  }


def test_legacy_multiplier_other_than_two_does_not_export():
  tx = ols.from_keras_config(legacy("DynamicLossScale", multiplier=4.0), INNER)
  with pytest.raises(ValueError, match="cannot express") as info:
    ols.to_keras_config(tx)
  assert "growth_factor" in str(info.value)
  assert "backoff_factor" in str(info.value)


# --- errors ---


@pytest.mark.parametrize(
  "config, exc, fragment",
  [
    (
      {"dynamic": True, "initial_scale": 8.0, "foo": 1},
      ValueError,
      "keys a Keras LossScaleOptimizer config does not have: ['foo']",
    ),
    ({"initial_loss_scale": 8.0}, ValueError, "['initial_loss_scale']"),
    (
      {"loss_scale": "dynamic", "initial_scale": 8.0},
      ValueError,
      "mixes the TF <= 2.3 'loss_scale' entry with the current keys"
      " ['initial_scale']",
    ),
    (
      legacy("WeirdLossScale"),
      ValueError,
      "`config['loss_scale']['class_name']` must be 'FixedLossScale' or"
      " 'DynamicLossScale', got 'WeirdLossScale'",
    ),
    (
      legacy("fixedlossscale", loss_scale_value=2.0),
      ValueError,
      "got 'fixedlossscale'",
    ),
    (
      {"loss_scale": "static"},
      ValueError,
      "`config['loss_scale']` must be 'dynamic', a number, or a dict with"
      " 'class_name' and 'config', got 'static'",
    ),
    ({"loss_scale": [2.0]}, ValueError, "got [2.0]"),
    ({"loss_scale": True}, ValueError, "got True"),
    ({"loss_scale": None}, ValueError, "got None"),
    ({"loss_scale": {"config": {}}}, ValueError, "'class_name'"),
    (
      legacy("DynamicLossScale", multiplier=1.0),
      ValueError,
      "`multiplier` of a DynamicLossScale must be a number > 1 whose"
      " float32 value m and 1/m are usable growth and backoff factors"
      " (from 1 + 2**-23 to 2**126), got 1.0",
    ),
    (
      legacy("DynamicLossScale", multiplier=float("nan")),
      ValueError,
      "got nan",
    ),
    (
      legacy("DynamicLossScale", multiplier=float("inf")),
      ValueError,
      "got inf",
    ),
    (legacy("DynamicLossScale", multiplier=True), ValueError, "got True"),
    (legacy("DynamicLossScale", multiplier="2"), ValueError, "got '2'"),
    # Values go through loss_scale_optimizer's own validation.
    (
      {"loss_scale": float("nan")},
      ValueError,
      "`initial_scale` must be a normal float32",
    ),
    ({"loss_scale": 0}, ValueError, "`initial_scale` must be a normal float32"),
    (
      legacy("FixedLossScale", loss_scale_value=-1.0),
      ValueError,
      "`initial_scale` must be a normal float32",
    ),
    (
      legacy("DynamicLossScale", increment_period=0),
      ValueError,
      "`dynamic_growth_steps` must be an int >= 1",
    ),
    ({"dynamic": "yes"}, TypeError, "`dynamic` must be a bool"),
    (
      {"dynamic": False},
      ValueError,
      "`initial_scale` must be given when `dynamic=False`",
    ),
    (
      {"dynamic": False, "initial_scale": 8.0, "dynamic_growth_steps": 10},
      ValueError,
      "`dynamic_growth_steps` must be None when `dynamic=False`",
    ),
    ({"initial_scale": float("inf")}, ValueError, "got inf"),
    ([("dynamic", True)], TypeError, "`config` must be a dict"),
    (None, TypeError, "`config` must be a dict"),
  ],
)
def test_from_keras_config_errors(config, exc, fragment):
  with pytest.raises(exc) as info:
    ols.from_keras_config(config, INNER)
  assert type(info.value) is exc
  assert fragment in str(info.value), str(info.value)


def test_from_keras_config_bad_inner():
  with pytest.raises(TypeError, match="`inner` must be an optax"):
    ols.from_keras_config({"dynamic": True}, "sgd")


def test_fixed_loss_scale_without_value_is_a_value_error():
  with pytest.raises(ValueError, match="loss_scale_value"):
    ols.from_keras_config(legacy("FixedLossScale"), INNER)


def test_legacy_unknown_inner_key_is_refused():
  with pytest.raises(ValueError, match="increment_periods"):
    ols.from_keras_config(
      legacy("DynamicLossScale", increment_periods=10), INNER
    )


# --- to_keras_config refuses what Keras cannot express ---


@pytest.mark.parametrize(
  "kwargs, name",
  [
    ({"growth_factor": 3.0}, "growth_factor"),
    ({"backoff_factor": 0.25}, "backoff_factor"),
    ({"min_scale": 0.5}, "min_scale"),
    ({"max_scale": 2.0**20}, "max_scale"),
    ({"hysteresis": 2}, "hysteresis"),
  ],
)
def test_to_keras_config_refuses_extensions(kwargs, name):
  tx = ols.loss_scale_optimizer(INNER, **kwargs)
  with pytest.raises(ValueError) as info:
    ols.to_keras_config(tx)
  assert "Keras's LossScaleOptimizer cannot express" in str(info.value)
  assert name in str(info.value)


def test_to_keras_config_extension_at_default_exports():
  tx = ols.loss_scale_optimizer(
    INNER, growth_factor=2, backoff_factor=0.5, min_scale=1, hysteresis=1
  )
  assert ols.to_keras_config(tx)["dynamic"] is True


@pytest.mark.parametrize(
  "tx",
  [
    optax.adam(1e-3),
    ols.unscale_and_check(),
    None,
    optax.chain(ols.unscale_and_check(), optax.sgd(0.1)),
  ],
)
def test_to_keras_config_refuses_non_loss_scale_optimizer(tx):
  with pytest.raises(
    TypeError, match="`tx` must be made by `loss_scale_optimizer`"
  ):
    ols.to_keras_config(tx)


# --- a static scale below 1 (issue 22) ---


@pytest.mark.parametrize(
  "config",
  [
    {"dynamic": False, "initial_scale": 0.5, "dynamic_growth_steps": None},
    {"loss_scale": 0.5},
    {
      "loss_scale": {
        "class_name": "FixedLossScale",
        "config": {"loss_scale_value": 0.25},
      }
    },
  ],
)
def test_a_static_scale_below_one_imports(config):
  """Keras-TF2 accepts `LossScaleOptimizer(opt, dynamic=False,
  initial_scale=0.5)`; the floor `min_scale` is a dynamic-mode bound."""
  tx = ols.from_keras_config(config, INNER)
  scale = tx.loss_scale_config.initial_scale
  assert scale < 1 and not tx.loss_scale_config.dynamic
  assert ols.to_keras_config(tx) == {
    "dynamic": False,
    "initial_scale": scale,
    "dynamic_growth_steps": None,
  }


# --- legacy multipliers checked in float32 (issue 22) ---


@pytest.mark.parametrize("multiplier", [1e308, 1e39, 2.0**127, 1.00000001])
def test_a_multiplier_unusable_in_float32_is_refused(multiplier):
  """1e308 gave growth_factor=inf and backoff_factor=0.0; 1.00000001 is 1.0
  in float32."""
  config = {
    "loss_scale": {
      "class_name": "DynamicLossScale",
      "config": {"multiplier": multiplier},
    }
  }
  with pytest.raises(ValueError) as info:
    ols.from_keras_config(config, INNER)
  message = str(info.value)
  assert "`multiplier`" in message and repr(multiplier) in message, message
  assert "float32" in message, message


def test_the_largest_usable_multiplier():
  config = {
    "loss_scale": {
      "class_name": "DynamicLossScale",
      "config": {"multiplier": 2.0**126},
    }
  }
  c = ols.from_keras_config(config, INNER).loss_scale_config
  assert (c.growth_factor, c.backoff_factor) == (2.0**126, 2.0**-126)


# --- legacy numbers: NumPy scalars, and out-of-range values (issue 22) ---


@pytest.mark.parametrize(
  "multiplier", [np.float32(2.0), np.float64(4.0), np.int64(2), np.array(2.0)]
)
def test_a_numpy_multiplier_is_accepted(multiplier):
  c = cfg_of(legacy("DynamicLossScale", multiplier=multiplier))
  assert c.growth_factor == float(multiplier)
  assert c.backoff_factor == 1.0 / float(multiplier)


@pytest.mark.parametrize("value", [np.float32(8.0), np.int32(8), np.array(8.0)])
def test_a_numpy_bare_legacy_scale_is_accepted(value):
  c = cfg_of({"loss_scale": value})
  assert (c.dynamic, c.initial_scale) == (False, 8.0)


@pytest.mark.parametrize(
  "config, name",
  [
    (legacy("DynamicLossScale", multiplier=2**1100), "`multiplier`"),
    (legacy("DynamicLossScale", multiplier=-(2**1100)), "`multiplier`"),
    (legacy("DynamicLossScale", initial_loss_scale=2**1100), "`initial_scale`"),
    ({"loss_scale": 2**1100}, "`initial_scale`"),
    ({"dynamic": True, "initial_scale": 2**1100}, "`initial_scale`"),
  ],
)
def test_an_int_beyond_float_range_is_a_value_error(config, name):
  with pytest.raises(ValueError, match=name):
    ols.from_keras_config(config, INNER)
