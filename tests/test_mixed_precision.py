"""Tests for _mpfunc_common.mixed_precision (Colossal-AI's Booster names and config
objects) and their use in `mpfunc.convert_to_amp`."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from colossal_seed import REQUIRED, SEED_001_NAIVE, SEED_SIGNATURES, available_booster_names
from hypothesis import given
from hypothesis import strategies as st
from lenient import lenient
from misspellings import MISSPELT

import mpfunc
from _mpfunc_common.amp_config import MODE_DEFAULTS, dtype_name, resolve_amp
from _mpfunc_common.mixed_precision import (
    MIXED_PRECISION,
    BF16MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
    mode_and_config,
)

CLASSES = [FP16TorchMixedPrecision, FP16ApexMixedPrecision, FP16NaiveMixedPrecision,
           BF16MixedPrecision]

def test_the_name_table():
    assert {n: c.mode for n, c in MIXED_PRECISION.items()} == available_booster_names()
    assert mode_and_config(None, "fp8", {})[0] == "fp8"  # the seed's next mode has landed
    for name, cls in MIXED_PRECISION.items():
        assert cls.booster_name == name


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_seed_fields_first_in_seed_order_with_seed_defaults(cls):
    seed = SEED_SIGNATURES[cls.__name__]
    fields = dataclasses.fields(cls)
    assert [f.name for f in fields[:len(seed)]] == [name for name, _ in seed]
    for f, (name, default) in zip(fields, seed):
        assert not f.kw_only, name  # positional, as in the seed
        if default is REQUIRED or name == "verbose":
            assert f.default == SEED_001_NAIVE[name], name
        else:
            assert f.default == default and type(f.default) is type(default), name
    assert all(f.kw_only for f in fields[len(seed):])  # mpfunc's extras: keyword-only


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_defaults_are_the_mode_defaults(cls):
    """One field per key of the mode, defaulting to the keys' defaults, so a Booster name,
    its class and ``mode=`` mean the same (and a key added to a mode needs a field)."""
    assert cls().to_config() == MODE_DEFAULTS[cls.mode]
    assert mode_and_config(None, cls.booster_name, {}) == (cls.mode, MODE_DEFAULTS[cls.mode])
    assert resolve_amp(*mode_and_config(None, cls(), {})) == resolve_amp(cls.mode, {})


def test_seed_positional_calls_port_unchanged():
    naive = FP16NaiveMixedPrecision(False, 2**32, 2, 0.5, 2, 2**32)
    assert naive == FP16NaiveMixedPrecision()
    assert FP16TorchMixedPrecision(2.**16, 2.0, 0.5, 2000) == FP16TorchMixedPrecision()
    assert FP16ApexMixedPrecision("O2").opt_level == "O2"


# Bad values: the object raises exactly what `mode=` + the same key raises.
BAD = [
    (FP16TorchMixedPrecision, dict(init_scale=1e39)),
    (FP16TorchMixedPrecision, dict(growth_factor=1.0)),
    (FP16TorchMixedPrecision, dict(growth_interval=0)),
    (FP16TorchMixedPrecision, dict(growth_interval="2000")),
    (FP16TorchMixedPrecision, dict(enabled=1)),
    (FP16TorchMixedPrecision, dict(dtype="float32")),
    (FP16ApexMixedPrecision, dict(opt_level="O4")),
    (FP16ApexMixedPrecision, dict(num_losses=0)),
    (FP16ApexMixedPrecision, dict(cast_model_type="int8")),
    (FP16ApexMixedPrecision, dict(loss_scale=8.0, min_loss_scale=1.0)),
    (FP16ApexMixedPrecision, dict(opt_level="O2", patch_torch_functions=True)),
    (FP16ApexMixedPrecision, dict(min_loss_scale=1e-50)),
    (FP16NaiveMixedPrecision, dict(hysteresis=0)),
    (FP16NaiveMixedPrecision, dict(verbose=1)),
    (FP16NaiveMixedPrecision, dict(clip_grad=-1.0)),
    (FP16NaiveMixedPrecision, dict(initial_scale=0.5)),
    (FP16NaiveMixedPrecision, dict(backoff_factor=1 - 1e-12)),
]


@pytest.mark.parametrize("cls, bad", BAD, ids=lambda x: str(x))
def test_construction_errors_are_the_keys_errors(cls, bad):
    with pytest.raises((ValueError, TypeError)) as from_keys:
        resolve_amp(cls.mode, bad)
    with pytest.raises(from_keys.type) as from_object:
        cls(**bad)
    assert str(from_object.value) == str(from_keys.value)
    assert "`" in str(from_object.value)  # the key is named


def test_frozen_hashable_and_normalised():
    cfg = FP16NaiveMixedPrecision(hysteresis=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hysteresis = 4
    same = FP16NaiveMixedPrecision(hysteresis=np.int32(3), initial_scale=jnp.float32(2.0**32))
    assert same == cfg and hash(same) == hash(cfg)
    assert type(same.hysteresis) is int and type(same.initial_scale) is float
    assert {cfg: 1}[same] == 1
    assert FP16NaiveMixedPrecision() != FP16NaiveMixedPrecision(hysteresis=3)
    assert BF16MixedPrecision() == BF16MixedPrecision() and hash(BF16MixedPrecision())
    assert FP16TorchMixedPrecision(dtype=jnp.bfloat16).dtype == "bfloat16"
    # Scalar types name their dtype (they used to be refused as "<class '...'>").
    assert dtype_name(jnp.bfloat16, "x") == "bfloat16" and dtype_name(np.float16, "x") == "float16"
    with pytest.raises(ValueError, match="`x` must be one of"):
        dtype_name(float, "x")
    amp = mpfunc.convert_to_amp(apply_fn, optax.sgd(0.1), "torch", dtype=jnp.bfloat16)
    assert amp.policy.compute_dtype == jnp.bfloat16
    assert FP16ApexMixedPrecision("O2", cast_model_outputs=jnp.float32).cast_model_outputs \
        == "float32"


NS = {c.__name__: c for c in CLASSES}


@pytest.mark.parametrize("cfg", [
    FP16TorchMixedPrecision(), FP16TorchMixedPrecision(1024, dtype="bf16", enabled=False),
    FP16ApexMixedPrecision(), FP16ApexMixedPrecision("O2", loss_scale=128.0,
                                                     max_loss_scale=math.inf),
    FP16ApexMixedPrecision("O1", keep_batchnorm_fp32="True", loss_scale="dynamic"),
    FP16NaiveMixedPrecision(), FP16NaiveMixedPrecision(max_scale=math.inf, clip_grad=1.0),
    BF16MixedPrecision(),
], ids=repr)
def test_repr_round_trips(cfg):
    assert eval(repr(cfg), NS) == cfg
    assert repr(eval(repr(cfg), NS)) == repr(cfg)


@given(initial_scale=st.integers(0, 40).map(lambda e: 2.0**e),
       growth=st.sampled_from([1.5, 2.0, 4.0]),
       backoff=st.floats(0.0625, 0.9375).map(lambda v: round(v * 16) / 16),
       interval=st.integers(1, 10_000), hysteresis=st.integers(1, 8),
       max_scale=st.sampled_from([2.0**32, 2.0**40, math.inf]),
       clip=st.floats(0, 10, allow_nan=False), zeros=st.booleans())
def test_naive_repr_round_trips_and_plans_match_the_keys(initial_scale, growth, backoff,
                                                         interval, hysteresis, max_scale,
                                                         clip, zeros):
    keys = dict(initial_scale=initial_scale, growth_factor=growth, backoff_factor=backoff,
                growth_interval=interval, hysteresis=hysteresis, max_scale=max_scale,
                clip_grad=clip, log_num_zeros_in_grad=zeros)
    cfg = FP16NaiveMixedPrecision(**keys)
    assert eval(repr(cfg), NS) == cfg and hash(eval(repr(cfg), NS)) == hash(cfg)
    assert resolve_amp(*mode_and_config(None, cfg, {})) == resolve_amp("naive", keys)
    assert resolve_amp(*mode_and_config(None, "fp16_naive", keys)) == resolve_amp("naive", keys)


def test_mode_and_config_errors():
    with pytest.raises(ValueError, match="both given"):
        mode_and_config("naive", "fp16_naive", {})
    with pytest.raises(ValueError, match=r"config keys \['hysteresis'\] were given with a "
                                         r"FP16NaiveMixedPrecision"):
        mode_and_config(None, FP16NaiveMixedPrecision(), {"hysteresis": 3})
    with pytest.raises(ValueError, match=r"`mixed_precision` must be one of \["
                                         r"'fp16', 'fp16_apex', 'fp16_naive', 'bf16', 'fp8'\]"):
        mode_and_config(None, "fp4", {})
    with pytest.raises(ValueError, match=r"`mode` must be one of \[.torch.*a Booster name \[.fp16."):
        mode_and_config(3, None, {})
    assert mode_and_config(None, None, {}) == ("torch", {})
    assert mode_and_config("FP16_Naive", None, {})[0] == "naive"


# --- JAX -------------------------------------------------------------------------------

def apply_fn(params, x):
    h = jnp.tanh(x @ params["dense"]["w"])
    mu = jnp.mean(h, axis=-1, keepdims=True)
    scale = params["norm"]["scale"]  # float32 in apex O2 (norms stay float32)
    h = (h - mu).astype(scale.dtype) * scale
    w = params["out"]["w"]
    return h.astype(w.dtype) @ w


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"dense": {"w": jax.random.normal(k1, (6, 16)) * 0.3},
            "norm": {"scale": jnp.ones((16,))},
            "out": {"w": jax.random.normal(k2, (16, 3)) * 0.3}}


def jax_program(**how):
    """The setup, the cast params, and the jaxpr of one train step (traced, not compiled:
    equal text means the same program)."""
    mode = how.pop("mode", None)
    amp = mpfunc.convert_to_amp(apply_fn, lenient(optax.adamw(1e-2)), mode, **how)
    params = amp.cast_params(init_params())
    state = amp.optimizer.init(params)
    x = jax.random.normal(jax.random.key(1), (8, 6))
    y = jnp.arange(8) % 3

    def step(params, state):
        def loss_fn(p):
            logits = amp.apply_fn(p, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return mpfunc.scale_loss(loss, state)
        grads = jax.grad(loss_fn)(params)
        updates, state = amp.optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return amp, (params, state), str(jax.make_jaxpr(step)(params, state))


JAX_SPELLINGS = [
    [dict(mixed_precision="fp16"), dict(mixed_precision=mpfunc.FP16TorchMixedPrecision()),
     dict(mode="torch")],
    [dict(mixed_precision="fp16_naive"), dict(mode=mpfunc.FP16NaiveMixedPrecision()),
     dict(mode="naive")],
    [dict(mixed_precision="fp16_apex", opt_level="O2", verbosity=0),
     dict(mixed_precision=mpfunc.FP16ApexMixedPrecision("O2", verbosity=0)),
     dict(mode="apex", opt_level="O2", verbosity=0), dict(mode="apex-O2", verbosity=0)],
    [dict(mixed_precision="bf16"), dict(mixed_precision=mpfunc.BF16MixedPrecision()),
     dict(mode="bf16")],
    [dict(mixed_precision="fp16_naive", initial_scale=1024.0, hysteresis=3, clip_grad=1.0),
     dict(mixed_precision=mpfunc.FP16NaiveMixedPrecision(initial_scale=1024, hysteresis=3,
                                                         clip_grad=1.0)),
     dict(mode="naive", initial_scale=1024.0, hysteresis=3, clip_grad=1.0)],
]


@pytest.mark.parametrize("spellings", JAX_SPELLINGS, ids=lambda s: str(s[0]))
def test_jax_every_spelling_gives_the_same_setup(spellings):
    results = [jax_program(**dict(how)) for how in spellings]
    ref_amp, ref_init, ref_program = results[0]
    assert "dot_general" in ref_program
    for how, (amp, init, program) in zip(spellings[1:], results[1:]):
        assert amp.plan == ref_amp.plan and amp.policy == ref_amp.policy, how
        leaves, ref_leaves = jax.tree_util.tree_leaves(init), jax.tree_util.tree_leaves(ref_init)
        assert [a.dtype for a in leaves] == [b.dtype for b in ref_leaves], how
        for a, b in zip(leaves, ref_leaves):
            np.testing.assert_array_equal(a, b)
        assert program == ref_program, how


def test_different_configs_give_different_programs():
    """The program comparison above can tell modes apart."""
    programs = {jax_program(**how)[2] for how in JAX_SPELLINGS[1][:1] + JAX_SPELLINGS[4][:1]}
    assert len(programs) == 2


def test_config_object_is_a_static_jit_argument():
    traces = []

    @jax.jit(static_argnums=1)
    def forward(x, mixed_precision):
        traces.append(mixed_precision)
        amp = mpfunc.convert_to_amp(lambda p, x: x @ p, optax.sgd(0.1),
                                    mixed_precision=mixed_precision)
        return amp.apply_fn(amp.cast_params(jnp.ones((4, 2))), x)

    x = jnp.ones((3, 4))
    assert forward(x, mpfunc.FP16NaiveMixedPrecision(hysteresis=3)).dtype == jnp.float32
    forward(x, mpfunc.FP16NaiveMixedPrecision(hysteresis=3))            # equal: cached
    forward(x, mpfunc.FP16NaiveMixedPrecision(hysteresis=np.int64(3)))  # equal: cached
    assert len(traces) == 1
    forward(x, mpfunc.FP16NaiveMixedPrecision(hysteresis=4))            # differs: retraced
    forward(x, mpfunc.BF16MixedPrecision())
    assert len(traces) == 3
    # And the mode it names is what runs: the dot's operands are float16 / bfloat16 (as
    # lowered for a GPU: on CPU autocast widens bf16 dot operands, see test_autocast).
    for cfg, dtype in [(mpfunc.FP16NaiveMixedPrecision(), "f16"),
                       (mpfunc.BF16MixedPrecision(), "bf16"),
                       (mpfunc.FP16ApexMixedPrecision(enabled=False), "f32")]:
        hlo = jax.export.export(forward, platforms=["cuda"])(x, cfg).mlir_module()
        dots = re.findall(r"stablehlo\.dot_general .*: \(tensor<3x4x(\w+)>, tensor<4x2x(\w+)>\)",
                          hlo)
        assert dots == [(dtype, dtype)], (cfg, dots)


def test_jax_errors_name_the_argument():
    with pytest.raises(ValueError, match="both given"):
        mpfunc.convert_to_amp(apply_fn, optax.sgd(0.1), "naive", mixed_precision="fp16")
    with pytest.raises(ValueError, match="`mixed_precision` must be one of \\[.fp16."):
        mpfunc.convert_to_amp(apply_fn, optax.sgd(0.1), mixed_precision="fp4")
    assert mpfunc.convert_to_amp(apply_fn, optax.sgd(0.1)).plan.mode == "torch"


@pytest.mark.parametrize("how, message", MISSPELT)
def test_jax_misspelt_modes_and_keys_name_the_closest_valid_one(how, message):
    with pytest.raises(ValueError, match=message):
        mpfunc.convert_to_amp(apply_fn, optax.sgd(0.1), **how)


def test_apex_level_names_and_suggestions():
    assert mode_and_config("APEX-o3", None, {}) == ("apex", {"opt_level": "O3"})
    assert mode_and_config(None, "apex-O1", {"opt_level": "O1"}) == ("apex", {"opt_level": "O1"})
    assert resolve_amp(*mode_and_config("apex-O2", None, {})) == resolve_amp(
        "apex", {"opt_level": "O2"})
    with pytest.raises(ValueError, match=r"`mixed_precision='apex-O1'` sets opt_level 'O1'"):
        mode_and_config(None, "apex-O1", {"opt_level": None})
    # No suggestion where nothing is close, and several misspelt keys each get theirs.
    with pytest.raises(ValueError, match=r"got 'xyzzy'\. apex's levels"):
        mode_and_config("xyzzy", None, {})
    with pytest.raises(ValueError, match=r"\(did you mean `initial_scale` for `inital_scale`, "
                                         r"`max_scale` for `max_scal`\?\)"):
        resolve_amp("naive", {"inital_scale": 1.0, "max_scal": 2.0, "zzz": 0})
