"""Tests for _mpfunc_common.amp_config: mode keys, defaults and apex's table."""

import math

import pytest

from _mpfunc_common.amp_config import APEX_OPT_LEVELS, MODE_DEFAULTS, dtype_name, resolve_amp


def test_seed_doc_defaults():
    assert MODE_DEFAULTS["torch"] == dict(init_scale=2.0**16, growth_factor=2.0,
                                          backoff_factor=0.5, growth_interval=2000,
                                          enabled=True, dtype="float16")
    assert MODE_DEFAULTS["naive"]["initial_scale"] == 2.0**32
    assert MODE_DEFAULTS["naive"]["hysteresis"] == 2
    assert MODE_DEFAULTS["naive"]["clip_grad"] == 0.0
    assert MODE_DEFAULTS["apex"]["max_loss_scale"] == 2.0**24
    assert MODE_DEFAULTS["apex"]["opt_level"] == "O1"


def test_apex_table():
    assert APEX_OPT_LEVELS["O0"]["loss_scale"] == 1.0
    assert APEX_OPT_LEVELS["O2"]["keep_batchnorm_fp32"] is True
    assert APEX_OPT_LEVELS["O3"]["master_weights"] is False


@pytest.mark.parametrize("level, cast, autocast, master, kind", [
    ("O0", "float32", None, False, "static"),
    ("O1", None, "float16", False, "dynamic"),
    ("O2", "float16", None, True, "dynamic"),
    ("O3", "float16", None, False, "static"),
])
def test_apex_levels_resolve(level, cast, autocast, master, kind):
    plan = resolve_amp("apex", {"opt_level": level})
    assert (plan.cast_model_type, plan.autocast_dtype, plan.master_weights, plan.scale_kind) == (
        cast, autocast, master, kind)
    if kind == "dynamic":
        assert plan.scale_config.max_scale == 2.0**24 and plan.scale_config.hysteresis == 1


def test_modes_resolve():
    torch_plan = resolve_amp("torch", {})
    assert torch_plan.scale_config.max_scale == math.inf and torch_plan.autocast_dtype == "float16"
    naive = resolve_amp("naive", {"clip_grad": 1.0})
    assert naive.master_weights and naive.scale_config.hysteresis == 2 and naive.clip_grad == 1.0
    assert resolve_amp("bf16", {}).scale_kind == "none"
    assert not resolve_amp("torch", {"enabled": False}).enabled
    assert "master_weights=True" in resolve_amp("naive", {}).describe()


@pytest.mark.parametrize("mode, cfg, err, match", [
    ("nope", {}, ValueError, "`mode` must be one of"),
    ("torch", {"opt_level": "O1"}, ValueError, "unknown config key"),
    ("naive", {"clip_grad": -1.0}, ValueError, "`clip_grad`"),
    ("naive", {"verbose": 1}, TypeError, "`verbose` must be a bool"),
    ("apex", {"num_losses": 0}, ValueError, "`num_losses`"),
    ("apex", {"cast_model_type": "int8"}, ValueError, "`cast_model_type` must be one of"),
    ("apex", {"loss_scale": 8.0, "min_loss_scale": 1.0}, ValueError, "only applies"),
    ("apex", {"opt_level": "O2", "patch_torch_functions": True}, ValueError, "not a supported"),
    ("torch", {"dtype": "float32"}, ValueError, "`dtype` must be one of"),
])
def test_errors(mode, cfg, err, match):
    with pytest.raises(err, match=match):
        resolve_amp(mode, cfg)


def test_dtype_names():
    assert dtype_name("half", "x") == "float16" and dtype_name("bf16", "x") == "bfloat16"
    assert dtype_name(None, "x") is None


@pytest.mark.parametrize("mode, config, key", [
    ("torch", {"enabled": False, "init_scale": "big"}, "init_scale"),
    ("torch", {"enabled": False, "dtype": "int8"}, "dtype"),
    ("apex", {"enabled": False, "opt_level": "O2", "min_loss_scale": -1.0}, "min_loss_scale"),
    ("apex", {"enabled": False, "opt_level": "O1", "verbosity": -3}, "verbosity"),
])
def test_a_disabled_mode_still_checks_its_values(mode, config, key):
    # Turning the mode on later must not be the first time a bad value surfaces.
    with pytest.raises((ValueError, TypeError), match=f"`{key}`"):
        resolve_amp(mode, config)
    plan = resolve_amp(mode, {**config, key: MODE_DEFAULTS[mode][key]})
    assert not plan.enabled


def test_a_disabled_torch_mode_accepts_dtype_none():
    assert not resolve_amp("torch", {"enabled": False, "dtype": None}).enabled


def test_bf16_storage_keys_default_to_todays_autocast_mode():
    assert MODE_DEFAULTS["bf16"] == dict(master_weights=None, state_dtype=None,
                                         state_rounding="stochastic", seed=0)
    plan = resolve_amp("bf16", {})
    assert (plan.autocast_dtype, plan.cast_model_type, plan.master_storage, plan.state_dtype) \
        == ("bfloat16", None, None, None)


@pytest.mark.parametrize("storage", ["float32", "remainder", "kahan", "stochastic"])
def test_bf16_master_weights_make_a_half_param_mode(storage):
    plan = resolve_amp("bf16", {"master_weights": storage, "state_dtype": "bf16"})
    assert (plan.autocast_dtype, plan.cast_model_type, plan.cast_model_outputs) == (
        None, "bfloat16", "float32")
    assert plan.master_storage == storage and plan.scale_kind == "none"
    assert plan.master_weights == (storage == "float32")  # float32 masters only for "float32"
    assert plan.state_dtype == "bfloat16" and plan.state_rounding == "stochastic"
    assert f"storage={storage}" in plan.describe() or storage == "float32"


def test_float32_masters_of_the_other_modes_name_their_storage():
    assert resolve_amp("naive", {}).master_storage == "float32"
    assert resolve_amp("apex", {"opt_level": "O2"}).master_storage == "float32"
    assert resolve_amp("apex", {"opt_level": "O3"}).master_storage is None


@pytest.mark.parametrize("cfg, err, match", [
    ({"master_weights": "kahn"}, ValueError, r"`master_weights` must be None .*got 'kahn' "
                                             r"\(did you mean `kahan`\?\)"),
    ({"master_weights": True}, ValueError, r"`master_weights` must be .* 'float32' keeps "
                                           r"float32 masters"),
    ({"state_dtype": "float16"}, ValueError, r"`state_dtype`='float16': float16 optimizer "
                                             r"state is refused.*Use 'bfloat16'"),
    ({"state_dtype": "bfloat61"}, ValueError, r"`state_dtype` must be None .*\(did you mean "
                                              r"`bfloat16`\?\)"),
    ({"state_dtype": "int8"}, ValueError, r"`state_dtype` must be None .*'float8_e4m3fn'"),
    ({"state_dtype": "bf16", "state_rounding": "stochastc"}, ValueError,
     r"`state_rounding` must be one of \['stochastic', 'nearest'\], got 'stochastc' \(did you"),
    ({"state_rounding": "nearest"}, ValueError, r"`state_rounding='nearest'` has no effect"),
    ({"state_dtype": "float32", "state_rounding": "nearest"}, ValueError, "has no effect"),
    ({"master_weights": "remainder", "seed": 3}, ValueError, r"`seed=3` has no effect"),
    ({"state_dtype": "bf16", "state_rounding": "nearest", "seed": 3}, ValueError,
     "`seed=3` has no effect"),
    ({"master_weights": "stochastic", "seed": -1}, ValueError, r"`seed` must be an int in "
                                                               r"\[0, 4294967295\], got -1"),
    ({"master_weights": "stochastic", "seed": 2**32}, ValueError, r"`seed` must be an int"),
    ({"master_weights": "stochastic", "seed": 1.5}, TypeError, r"`seed` must be an int"),
    ({"master_weight": "kahan"}, ValueError, r"\(did you mean `master_weights`\?\)"),
])
def test_bf16_storage_errors(cfg, err, match):
    with pytest.raises(err, match=match):
        resolve_amp("bf16", cfg)


@pytest.mark.parametrize("cfg", [
    {"master_weights": "stochastic", "seed": 7},
    {"state_dtype": "bfloat16", "seed": 7},  # state rounded stochastically by default
    {"state_dtype": "e4m3", "state_rounding": "nearest"},
    {"master_weights": "remainder", "state_rounding": "stochastic", "seed": 0},  # defaults
])
def test_bf16_storage_combinations_that_take_effect(cfg):
    plan = resolve_amp("bf16", cfg)
    assert plan.seed == cfg.get("seed", 0)


@pytest.mark.parametrize("mode, cfg, err, fix", [
    ("apex", {"opt_level": "O2", "master_weights": "remainder"}, TypeError, "remainder"),
    ("apex", {"opt_level": "O1", "master_weights": "stochastic"}, TypeError, "stochastic"),
    ("naive", {"master_weights": "kahan"}, ValueError, "kahan"),
    ("torch", {"master_weights": "kahn"}, ValueError, "kahan"),  # a near miss: the closest
    ("fp8", {"master_weights": "float32"}, ValueError, "float32"),
    ("torch", {"enabled": False, "master_weights": "remainder"}, ValueError, "remainder"),
])
def test_a_storage_given_to_another_mode_points_to_bf16(mode, cfg, err, fix):
    expected = "a bool" if mode == "apex" else "absent"
    with pytest.raises(err, match=(
            rf"^`master_weights` must be {expected} with mode '{mode}', got "
            rf"'{cfg['master_weights']}': the storages \['float32', 'remainder', 'kahan', "
            rf"'stochastic'\] belong to mode 'bf16', and .*\. For bfloat16 params stored that "
            rf"way, use mode=\"bf16\", master_weights='{fix}'\.$")):
        resolve_amp(mode, cfg)
    # What is not a storage keeps the mode's own error.
    with pytest.raises(TypeError, match=r"`master_weights` must be a bool or None, got str"):
        resolve_amp("apex", {"opt_level": "O2", "master_weights": "yes"})
    assert resolve_amp("apex", {"opt_level": "O2", "master_weights": "True"}).master_weights

