"""Tests for _mpfunc_common.fp8: the recipe table both frameworks share."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from _mpfunc_common.fp8 import FP8_MAX, RECIPES, Fp8Recipe, resolve_recipe, scale_shape


def test_presets_match_their_anchors():
    # TransformerEngine DelayedScaling / flax fp8_ops: history 1024, max reduction.
    from flax.linen import fp8_ops

    d = RECIPES["delayed"]
    assert d.delayed and d.amax_history_len == 1024 == fp8_ops.Fp8DotGeneralBase.amax_history_length
    assert d.amax_reduction == "max" and d.margin == 0
    for r in RECIPES.values():  # the hybrid format by default
        assert (r.forward_dtype, r.backward_dtype) == ("float8_e4m3fn", "float8_e5m2")
        assert r.dtype("grad_output") == "float8_e5m2" and r.dtype("weight") == "float8_e4m3fn"
    assert RECIPES["rowwise"].power_of_2_scales  # torchao's rowwise recipe
    assert not RECIPES["tensorwise"].power_of_2_scales


def test_fp8_max_is_the_formats_own():
    assert FP8_MAX["float8_e4m3fn"] == float(jnp.finfo(jnp.float8_e4m3fn).max)
    assert FP8_MAX["float8_e5m2"] == float(jnp.finfo(jnp.float8_e5m2).max)


@pytest.mark.parametrize("scaling, blocks", [
    ("tensorwise", (None, None, None)),
    ("delayed", (None, None, None)),
    ("rowwise", ((1, None), (1, None), (1, None))),
    ("blockwise", ((1, 128), (128, 128), (1, 128))),   # DeepSeek-V3's tiles
])
def test_blocks_per_role(scaling, blocks):
    r = RECIPES[scaling]
    assert (r.block("input"), r.block("weight"), r.block("grad_output")) == blocks


def test_format_override():
    r = Fp8Recipe("tensorwise", format="e4m3")
    assert r.backward_dtype == "float8_e4m3fn"
    assert Fp8Recipe(format="e5m2").forward_dtype == "float8_e5m2"


def test_frozen_hashable_and_a_static_jit_argument():
    r = resolve_recipe("delayed", amax_history_len=16)
    assert hash(r) == hash(Fp8Recipe("delayed", amax_history_len=16))
    assert {r: 1}[Fp8Recipe("delayed", amax_history_len=16)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.margin = 1
    f = jax.jit(lambda x, recipe: x * recipe.amax_history_len, static_argnums=1)
    assert int(f(jnp.ones((), jnp.int32), r)) == 16


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(scaling="per_channel"), ValueError, "`scaling`"),
    (dict(format="e3m4"), ValueError, "`format`"),
    (dict(amax_history_len=0), ValueError, "`amax_history_len`"),
    (dict(amax_history_len=2.0), TypeError, "`amax_history_len` must be an int"),
    (dict(amax_history_len=True), TypeError, "`amax_history_len`"),
    (dict(amax_reduction="mean"), ValueError, "`amax_reduction`"),
    (dict(margin=-1), ValueError, "`margin`"),
    (dict(power_of_2_scales=1), TypeError, "`power_of_2_scales`"),
    (dict(block_size=100), ValueError, "power of two"),
])
def test_validation_names_the_field(kwargs, err, match):
    with pytest.raises(err, match=match):
        Fp8Recipe(**kwargs)


def test_resolve_recipe():
    assert resolve_recipe(None) == RECIPES["tensorwise"]
    assert resolve_recipe("rowwise") is RECIPES["rowwise"]
    assert resolve_recipe(RECIPES["blockwise"], block_size=64).block("weight") == (64, 64)
    with pytest.raises(ValueError, match="`recipe` must be one of"):
        resolve_recipe("mxfp8")
    with pytest.raises(TypeError, match="`recipe`"):
        resolve_recipe(3)
    with pytest.raises(ValueError, match=r"unknown fp8 recipe field\(s\) \['history'\]"):
        resolve_recipe("delayed", history=8)
    with pytest.raises(ValueError, match=r"\['amax_history_lenn'\] \(did you mean "
                                         r"`amax_history_len`\?\); valid fields"):
        resolve_recipe("delayed", amax_history_lenn=8)
    with pytest.raises(ValueError, match="`role`"):
        RECIPES["delayed"].block("output")


def test_scale_shape():
    assert scale_shape((4, 5, 300), None) == ()
    assert scale_shape((4, 5, 300), (1, None)) == (20, 1)
    assert scale_shape((4, 5, 300), (1, 128)) == (20, 3)
    assert scale_shape((300, 200), (128, 128)) == (3, 2)


def test_both_packages_export_the_same_recipe_class():
    import mpfunc
    import mpfunc_torch

    assert mpfunc.Fp8Recipe is mpfunc_torch.Fp8Recipe is Fp8Recipe


def test_the_fp8_mode_in_the_shared_mode_table():
    from _mpfunc_common.amp_config import MODE_DEFAULTS, resolve_amp
    from _mpfunc_common.mixed_precision import FP8MixedPrecision, mode_and_config

    assert MODE_DEFAULTS["fp8"] == {"recipe": "tensorwise"}
    plan = resolve_amp("fp8", {})
    assert (plan.autocast_dtype, plan.scale_kind, plan.master_weights) == ("bfloat16", "none",
                                                                           False)
    assert plan.fp8_recipe == RECIPES["tensorwise"] and "fp8 linear matmuls" in plan.describe()
    assert resolve_amp("fp8", {"recipe": "delayed"}).fp8_recipe.delayed
    # The Booster name and the config object mean the same plan.
    assert resolve_amp(*mode_and_config(None, "fp8", {"recipe": "rowwise"})) == resolve_amp(
        *mode_and_config(None, FP8MixedPrecision("rowwise"), {}))
    assert FP8MixedPrecision("delayed") == FP8MixedPrecision(Fp8Recipe("delayed"))
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['dtype'\] for mode 'fp8'; "
                                         r"valid keys for this mode: \['recipe'\]"):
        resolve_amp("fp8", {"dtype": "float16"})
    with pytest.raises(ValueError, match="`recipe` must be one of"):
        FP8MixedPrecision("mxfp8")
