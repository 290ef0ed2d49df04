"""Tests for mpfunc._src.fp8.quantize and mpfunc_torch._src.fp8.quantize: fp8 quantisation,
JAX and torch against a plain NumPy reference, and against each other.

Both sides implement ``_mpfunc_common.fp8.QUANTIZE_RULE``; the reference
(tests/fp8_reference.py) is written from the rule alone, with ml_dtypes' fp8 types.
Every comparison is bitwise: fp8 payloads as uint8, scales as uint32.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from fp8_reference import ref_dequantize, ref_quantize
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import mpfunc
import mpfunc_torch

NAMES = ["float8_e4m3fn", "float8_e5m2"]
F32_MAX = float(np.finfo(np.float32).max)
SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 2.0**-126, 1e-38,
           F32_MAX, -F32_MAX, 448.0, 464.0, 480.0, 57344.0, 61440.0, 2.0**-9, 1.5 * 2.0**-9,
           2.0**-16, 1e-30, 1e30, 1.0625, 1.1875]


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def jax_roundtrip(x, name, block, margin, pow2):
    q, s = mpfunc.quantize_fp8(x, name, block, margin=margin, power_of_2_scales=pow2)
    return q, s, mpfunc.dequantize_fp8(q, s, block)


def jax_quantize(x, name, block, margin, pow2):
    return jax_roundtrip(x, name, block, margin, pow2)[:2]


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def f32_bits(a):
    """float32 bits with every NaN made the same NaN (a dequantised NaN is "a NaN")."""
    a = np.asarray(a, np.float32)
    return np.where(np.isnan(a), np.float32(np.nan), a).view(np.uint32)


def check_all(x, name, block=None, margin=0, pow2=False):
    """JAX (jit), torch and the reference agree bit for bit on q, scale and dequantised."""
    qr, sr = ref_quantize(x, name, block, margin, pow2)
    qj, sj, dj = jax_roundtrip(jnp.asarray(x), name, block, margin, pow2)
    qt, st_ = mpfunc_torch.quantize_fp8(torch.from_numpy(np.asarray(x)), name, block,
                                        margin=margin, power_of_2_scales=pow2)
    assert qj.dtype == jnp.dtype(name) and qt.dtype == getattr(torch, name)
    np.testing.assert_array_equal(bits(qj), bits(qr), err_msg=f"jax q, {name} {block}")
    np.testing.assert_array_equal(qt.view(torch.uint8).numpy(), bits(qr),
                                  err_msg=f"torch q, {name} {block}")
    np.testing.assert_array_equal(bits(np.asarray(sj, np.float32)), bits(np.asarray(sr, np.float32)))
    np.testing.assert_array_equal(bits(st_.numpy()), bits(np.asarray(sr, np.float32)))
    dr = ref_dequantize(qr, sr, block)
    dt = mpfunc_torch.dequantize_fp8(qt, st_, block)
    np.testing.assert_array_equal(f32_bits(dj), f32_bits(dr))
    np.testing.assert_array_equal(f32_bits(dt.numpy()), f32_bits(dr))
    return qr, sr


elements = st.one_of(
    st.floats(-1e3, 1e3, width=32),
    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from(SPECIAL).map(np.float32),
)


@given(
    x=hnp.arrays(np.float32, st.sampled_from([(5,), (4, 40)]), elements=elements),
    name=st.sampled_from(NAMES),
    block=st.sampled_from([None, (1, None), (2, 16)]),
    config=st.sampled_from([(0, False), (0, True), (3, False)]),
)
def test_small_arrays_elementwise_from_hypothesis(x, name, block, config):
    # Every element drawn on its own: specials, fp8 and float32 subnormals, ties.
    check_all(x, name, block, *config)


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**31 - 1),
    log_mag=st.floats(-44, 38),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)), max_size=6),
    name=st.sampled_from(NAMES),
    block=st.sampled_from([None, (1, None), (1, 128), (128, 128)]),
)
def test_recipe_blocks_on_realistic_arrays(seed, log_mag, specials, name, block):
    # Normally distributed values at any magnitude (fp8 subnormals and float32
    # subnormals included), with inf/NaN/out-of-range values planted.
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore", under="ignore"):
        x = (rng.standard_normal((130, 260)) * np.float64(10.0) ** log_mag).astype(np.float32)
    flat = x.reshape(-1)
    for pos, v in specials:
        flat[pos % flat.size] = v
    check_all(x, name, block, 0, block == (1, None))


@pytest.mark.parametrize("name", NAMES)
def test_low_precision_inputs_quantise_as_their_float32_value(name):
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    for jd, td in ((jnp.bfloat16, torch.bfloat16), (jnp.float16, torch.float16)):
        xl = np.asarray(jnp.asarray(x).astype(jd))
        qj, _ = jax_quantize(jnp.asarray(xl), name, None, 0, False)
        q32, _ = jax_quantize(jnp.asarray(xl.astype(np.float32)), name, None, 0, False)
        np.testing.assert_array_equal(bits(qj), bits(q32))
        qt, _ = mpfunc_torch.quantize_fp8(torch.from_numpy(x).to(td), name)
        np.testing.assert_array_equal(qt.view(torch.uint8).numpy(), bits(q32))


def test_round_to_nearest_even_including_subnormals():
    # amax 448 -> scale exactly 1 in e4m3, so the cast alone decides.
    ties = [1.0625, 1.1875, -1.0625, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 2.0**-10, 448.0]
    want = [1.0, 1.25, -1.0, 2.0**-8, 2.0**-8, 0.0, 448.0]  # even mantissa wins every tie
    q, s = check_all(np.array(ties, np.float32), "float8_e4m3fn")
    assert float(s) == 1.0
    assert q.astype(np.float32).tolist() == want


@pytest.mark.parametrize("name, x, want", [
    ("float8_e4m3fn", [500.0, -1e6, 449.0, np.inf, -np.inf, np.nan, -np.nan],
     [0x7E, 0xFE, 0x7E, 0x7F, 0xFF, 0x7F, 0x7F]),
    ("float8_e5m2", [1e6, -61440.0, 57345.0, np.inf, -np.inf, np.nan, -np.nan],
     [0x7B, 0xFB, 0x7B, 0x7C, 0xFC, 0x7E, 0x7E]),
])
def test_saturating_cast_keeps_non_finite_values(name, x, want):
    # With a given (stale, e.g. delayed) scale finite values beyond the range saturate;
    # inf and NaN stay non-finite so a downstream overflow check still sees them.
    x = np.array(x, np.float32)
    one = np.float32(1.0)
    qj, _ = mpfunc.quantize_fp8(jnp.asarray(x), name, scale=jnp.asarray(one))
    qt, _ = mpfunc_torch.quantize_fp8(torch.from_numpy(x), name, scale=torch.tensor(one))
    assert bits(qj).tolist() == want
    assert qt.view(torch.uint8).tolist() == want


def test_the_frameworks_own_casts_differ_which_is_why_the_rule_spells_it_out():
    # A finding pinned (torch 2.13, jax 0.10.2): torch's e4m3fn cast saturates even inf
    # (hiding an overflow); XLA's gives NaN for finite values beyond 464; ml_dtypes too.
    x = np.array([500.0, np.inf], np.float32)
    assert torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [0x7E, 0x7E]
    assert bits(jnp.asarray(x).astype(jnp.float8_e4m3fn)).tolist() == [0x7F, 0x7F]
    assert bits(x.astype(ml_dtypes.float8_e4m3fn)).tolist() == [0x7F, 0x7F]
    # And their NaN encodings in e5m2 differ.
    n = np.array([np.nan], np.float32)
    assert torch.from_numpy(n).to(torch.float8_e5m2).view(torch.uint8).tolist() == [0x7F]
    assert bits(jnp.asarray(n).astype(jnp.float8_e5m2)).tolist() == [0x7E]


def test_amax_edge_cases():
    zeros = np.zeros((4, 8), np.float32)
    q, s = check_all(zeros, "float8_e4m3fn")
    assert float(s) == 1.0 and not q.astype(np.float32).any()
    # A NaN (or inf) anywhere: the scale falls back to 1, the NaN stays NaN and the
    # other values are quantised (saturating) with scale 1.
    x = np.array([[1.0, np.nan, 1000.0, 0.1]], np.float32)
    q, s = check_all(x, "float8_e4m3fn")
    assert float(s) == 1.0
    v = q.astype(np.float32)
    assert np.isnan(v[0, 1]) and v[0, 2] == 448.0 and v[0, 0] == 1.0
    # Rowwise: only the row holding the inf falls back.
    x = np.array([[2.0, np.inf], [2.0, 1.0]], np.float32)
    _, s = check_all(x, "float8_e4m3fn", (1, None))
    assert s.ravel().tolist() == [1.0, 224.0]
    # A float32-subnormal amax counts as zero (scale 1); a subnormal value becomes the
    # zero of its sign whether the backend flushes it (XLA on CPU) or not (torch, NumPy).
    q, s = check_all(np.array([1e-45, -1e-40, 0.0], np.float32), "float8_e5m2")
    assert float(s) == 1.0 and bits(q).tolist() == [0x00, 0x80, 0x00]
    # A tiny amax: the scale stops at 2**116 (e4m3fn) / 2**109 (e5m2), where a float32
    # subnormal times the scale is below half the smallest fp8 subnormal.
    q, s = check_all(np.array([2.0**-120, 2.0**-126, -1e-45], np.float32), "float8_e4m3fn")
    # (2**-126 * 2**116 = 2**-10 is a tie between 0 and 2**-9: to even, 0.)
    assert float(s) == 2.0**116 and q.astype(np.float32).tolist() == [2.0**-4, 0.0, -0.0]
    assert bits(q).tolist()[2] == 0x80
    _, s = check_all(np.array([2.0**-120, 2.0**-127], np.float32), "float8_e5m2")
    assert float(s) == 2.0**109
    # ... so every nonzero dequantised value is a normal float32 (nothing to flush).
    d = ref_dequantize(np.array([2.0**-9], ml_dtypes.float8_e4m3fn), np.float32(2.0**116))
    assert d.tolist() == [2.0**-125]
    # Leading dims are flattened: a 3-D activation is (tokens, features).
    x = np.random.default_rng(1).standard_normal((2, 65, 200)).astype(np.float32)
    _, s = check_all(x, "float8_e4m3fn", (1, 128))
    assert s.shape == (130, 2)
    # margin and power-of-two rounding.
    _, s = check_all(np.array([3.0], np.float32), "float8_e4m3fn", None, 2, False)
    assert float(s) == np.float32(np.float32(448.0) / np.float32(3.0)) / 4
    _, s = check_all(np.array([3.0], np.float32), "float8_e4m3fn", None, 0, True)
    assert float(s) == 128.0


def test_bad_arguments():
    x = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="`dtype` must be float8_e4m3fn or float8_e5m2"):
        mpfunc.quantize_fp8(x, "float16")
    with pytest.raises(ValueError, match="`dtype`"):
        mpfunc_torch.quantize_fp8(torch.ones(4), torch.float16)
    with pytest.raises(TypeError, match="`x` must be a floating"):
        mpfunc.quantize_fp8(jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="`x` must be a floating"):
        mpfunc_torch.quantize_fp8(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`scale` must have shape \(4, 1\)"):
        mpfunc.quantize_fp8(x, block=(1, None), scale=jnp.ones(()))
    with pytest.raises(ValueError, match=r"`scale` must have shape \(4, 1\)"):
        mpfunc_torch.quantize_fp8(torch.ones(4, 8), block=(1, None), scale=torch.ones(()))
    with pytest.raises(ValueError, match="`axis_name` applies to per-tensor scales"):
        mpfunc.quantize_fp8(x, block=(1, None), axis_name="data")
    # Blocks: ZeroDivisionError / IndexError before; the same ValueError on both sides.
    for block in ((0, 4), (1,), (2, -1), (True, 4), "rows"):
        with pytest.raises(ValueError, match="`block` must be None or \\(rows, cols\\)"):
            mpfunc.quantize_fp8(x, block=block)
        with pytest.raises(ValueError, match="`block` must be None or \\(rows, cols\\)"):
            mpfunc_torch.quantize_fp8(torch.ones(4, 8), block=block)
    # dequantize_fp8 of something that is not fp8 (it used to return x * 1/scale)
    with pytest.raises(TypeError, match="`q` must be an fp8 array .* got float32"):
        mpfunc.dequantize_fp8(x, jnp.ones(()))
    with pytest.raises(TypeError, match="`q` must be an fp8 tensor .* got torch.float32"):
        mpfunc_torch.dequantize_fp8(torch.ones(4, 8), torch.ones(()))
