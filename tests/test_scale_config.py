"""Tests for _mpfunc_common.scale_config (presets and validation shared by both sides)."""

import math

import pytest

from _mpfunc_common.scale_config import SCALE_PRESETS, ScaleConfig, resolve_scale_config


def test_presets_match_the_anchors_defaults():
    # GradScaler and apex have no floor; ours is 1.0 (README: "Loss scaling").
    assert SCALE_PRESETS["torch"] == ScaleConfig(2.0**16, 2.0, 0.5, 2000, 1, 1.0, math.inf)
    assert SCALE_PRESETS["apex"] == ScaleConfig(2.0**16, 2.0, 0.5, 2000, 1, 1.0, 2.0**24)
    assert SCALE_PRESETS["naive"] == ScaleConfig(2.0**32, 2.0, 0.5, 1000, 2, 1.0, 2.0**32)
    assert SCALE_PRESETS["jmp"] == ScaleConfig(2.0**15, 2.0, 0.5, 2000, 1, 1.0, math.inf)


def test_overrides_win_and_none_keeps_the_preset():
    cfg = resolve_scale_config("naive", growth_interval=7, min_scale=2.0**-126)
    assert cfg.growth_interval == 7 and cfg.min_scale == 2.0**-126
    assert cfg.hysteresis == 2 and cfg.init_scale == 2.0**32
    with pytest.raises(ValueError, match="`min_scale`"):  # 0.0 is a value, not "unset"
        resolve_scale_config("naive", min_scale=0.0)


def test_initial_scale_clamps_to_max_like_apex():
    assert resolve_scale_config("apex", max_scale=2.0**10).initial_scale == 2.0**10


@pytest.mark.parametrize("kwargs, name", [
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=2**31), "growth_interval"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(init_scale=math.nan), "init_scale"),
    (dict(min_scale=-1.0), "min_scale"),
    (dict(max_scale=0.0), "max_scale"),
    (dict(min_scale=4.0, max_scale=2.0), "min_scale"),
    (dict(init_scale=1.0, min_scale=2.0), "init_scale"),
])
def test_range_errors_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        resolve_scale_config("torch", **kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(growth_interval=True), "growth_interval"),
    (dict(hysteresis=1.5), "hysteresis"),
    (dict(init_scale="big"), "init_scale"),
])
def test_type_errors_name_the_argument(kwargs, name):
    with pytest.raises(TypeError, match=f"`{name}`"):
        resolve_scale_config("torch", **kwargs)


@pytest.mark.parametrize("preset", ["", "Torch", None, "megatron"])
def test_unknown_preset(preset):
    with pytest.raises(ValueError,
                       match=r"`preset` must be one of \['apex', 'jmp', 'naive', 'torch'\]"):
        resolve_scale_config(preset)


@pytest.mark.parametrize("kwargs, name", [
    (dict(init_scale=1e39), "init_scale"),          # float32 inf
    (dict(init_scale=1e-50, min_scale=2.0**-126), "init_scale"),   # rounds to 0
    (dict(init_scale=2.0**-130, min_scale=2.0**-126), "init_scale"),  # subnormal
    (dict(max_scale=1e-50), "max_scale"),
    (dict(max_scale=1e39), "max_scale"),             # rounds to inf: say inf explicitly
    (dict(min_scale=0.0), "min_scale"),
    (dict(min_scale=2.0**-127), "min_scale"),
    (dict(backoff_factor=1 - 1e-12), "backoff_factor"),  # rounds to 1.0: never backs off
    (dict(backoff_factor=1e-50), "backoff_factor"),      # rounds to 0
    (dict(growth_factor=1 + 1e-12), "growth_factor"),    # rounds to 1.0: never grows
    (dict(growth_factor=1e39), "growth_factor"),
])
def test_values_that_do_not_survive_float32_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`.*float32|`{name}` must be in"):
        resolve_scale_config("torch", **kwargs)


def test_errors_name_the_key_the_user_passed():
    with pytest.raises(ValueError, match="`min_loss_scale`"):
        resolve_scale_config("apex", min_scale=-1.0, names={"min_scale": "min_loss_scale"})


def test_values_are_stored_rounded_to_float32():
    import numpy as np

    cfg = resolve_scale_config("torch", growth_factor=1.1, backoff_factor=0.3, init_scale=3.3)
    for key in ("growth_factor", "backoff_factor", "init_scale"):
        value = getattr(cfg, key)
        assert value == float(np.float32(value)), key


def test_numpy_and_jax_scalars_and_integral_floats_are_accepted():
    import jax.numpy as jnp
    import numpy as np

    cfg = resolve_scale_config("jmp", init_scale=jnp.float32(2.0**15),
                               min_scale=np.asarray(0.3125), growth_interval=5.0)
    assert (cfg.init_scale, cfg.min_scale, cfg.growth_interval) == (2.0**15, 0.3125, 5)
    with pytest.raises(TypeError, match="`growth_interval` must be an int"):
        resolve_scale_config("torch", growth_interval=5.5)
    with pytest.raises(TypeError, match="`init_scale`"):
        resolve_scale_config("torch", init_scale=np.ones(2))
