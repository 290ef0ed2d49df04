"""Tests for _mpfunc_common.scale_config (presets and validation shared by both sides)."""

import math

import pytest

from _mpfunc_common.scale_config import SCALE_PRESETS, ScaleConfig, resolve_scale_config


def test_presets_match_the_anchors_defaults():
    assert SCALE_PRESETS["torch"] == ScaleConfig(2.0**16, 2.0, 0.5, 2000, 1, 0.0, math.inf)
    assert SCALE_PRESETS["apex"] == ScaleConfig(2.0**16, 2.0, 0.5, 2000, 1, 0.0, 2.0**24)
    assert SCALE_PRESETS["naive"] == ScaleConfig(2.0**32, 2.0, 0.5, 1000, 2, 1.0, 2.0**32)


def test_overrides_win_and_none_keeps_the_preset():
    cfg = resolve_scale_config("naive", growth_interval=7, min_scale=0.0)
    assert cfg.growth_interval == 7 and cfg.min_scale == 0.0  # 0.0 is a value, not "unset"
    assert cfg.hysteresis == 2 and cfg.init_scale == 2.0**32


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
    with pytest.raises(ValueError, match=r"`preset` must be one of \['apex', 'naive', 'torch'\]"):
        resolve_scale_config(preset)


def _normalized(text):
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_both_packages_document_the_same_rule():
    import mpfunc
    import mpfunc_torch
    from _mpfunc_common.scale_config import UPDATE_RULE

    rule = _normalized(UPDATE_RULE)
    for doc in (mpfunc.dynamic_scale.__doc__, mpfunc_torch.LossScaler.__doc__):
        lines = _normalized(doc)
        start = lines.index(rule[0])
        assert lines[start:start + len(rule)] == rule
