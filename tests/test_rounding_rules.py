"""The NumPy reference of the shared low-precision storage rules (_mpfunc_common.rounding)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _mpfunc_common import rounding as R

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@given(st.lists(finite_f32, min_size=1, max_size=64))
def test_remainder_split_join_is_exact_and_hi_is_nearest_but_at_ties(xs):
    x = np.asarray(xs, np.float32)
    hi, lo = R.split_remainder(x)
    assert (R.f32_bits(R.join_remainder(hi, lo)) == R.f32_bits(x)).all()
    rne = R.round_nearest_bf16(x)
    tie = (R.f32_bits(x) & 0xFFFF) == 0x8000
    assert (hi[~tie] == rne[~tie]).all()
    # A tie rounds away from zero: one bfloat16 step up in magnitude from truncation.
    assert (hi[tie].astype(np.int64) == (R.f32_bits(x[tie]) >> 16).astype(np.int64) + 1).all()


def test_round_nearest_matches_numpy_style_bfloat16_cast():
    ml_dtypes = __import__("ml_dtypes")
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 1e3
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert (R.round_nearest_bf16(x) == want).all()


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    v = np.float32(1.0 + 2**-10)  # an eighth of the way from 1.0 to the next bfloat16 (2**-7)
    bits = R.random_bits(seed=3, stream=0, step=7, index=np.arange(10**6))
    r = R.stochastic_round_bf16(np.full(10**6, v, np.float32), bits)
    assert set(np.unique(r)) == {0x3F80, 0x3F81}
    vals = (r.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    err = vals - float(v)
    assert abs(err.mean()) < 4 * err.std() / np.sqrt(err.size)
    assert abs((r == 0x3F81).mean() - 0.125) < 0.005


def test_stochastic_rounding_keeps_nan_inf_and_exact_values():
    x = np.array([np.nan, np.inf, -np.inf, 1.0, -2.5], np.float32)
    r = R.stochastic_round_bf16(x, np.full(5, 0xFFFF, np.uint32))
    vals = (r.astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(vals[0]) and vals[1] == np.inf and vals[2] == -np.inf
    assert vals[3] == 1.0 and vals[4] == -2.5


def test_random_bits_depend_on_every_input():
    base = R.random_bits(0, 0, 0, np.arange(1024))
    for args in [(1, 0, 0), (0, 1, 0), (0, 0, 1)]:
        assert (R.random_bits(*args, np.arange(1024)) != base).mean() > 0.99
    assert len(np.unique(base)) == 1024


def test_kahan_update_recovers_updates_below_half_an_ulp():
    p, c = R.round_nearest_bf16(np.ones(1, np.float32)), np.zeros(1, np.uint16)
    for _ in range(1000):
        p, c = R.kahan_update(p, c, np.full(1, 1e-4, np.float32))
    got = float((p.astype(np.uint32) << 16).view(np.float32)[0])
    assert abs(got - 1.1) < 2**-7  # plain bfloat16 would still be 1.0


@given(st.lists(finite_f32, min_size=1, max_size=64))
def test_remainder_against_its_own_hi_is_the_split(xs):
    x = np.asarray(xs, np.float32)
    hi, lo = R.split_remainder(x)
    assert (R.remainder_against(x, hi) == lo).all()


@given(st.lists(finite_f32, min_size=1, max_size=32), st.lists(finite_f32, min_size=32,
                                                                    max_size=32))
def test_remainder_against_another_param_is_the_closest_join(ms, ps):
    m = np.asarray(ms, np.float32)
    p = R.round_nearest_bf16(np.asarray(ps[:m.size], np.float32))
    lo = R.remainder_against(m, p)
    got = R.join_remainder(p, lo).astype(np.float64)
    assert not np.isnan(got).any()
    # No remainder joins closer to the master (all 65536 candidates of each param).
    cands = np.arange(-32768, 32768, dtype=np.int64)
    for i in range(m.size):
        joined = R.join_remainder(np.full(cands.size, p[i]), cands.astype(np.int16))
        ok = ~np.isnan(joined)  # past inf the patterns are (signalling) NaNs
        joined = np.where(ok, joined, np.float32(0)).astype(np.float64)
        best = np.min(np.abs(joined[ok] - float(m[i])))
        assert abs(got[i] - float(m[i])) == best


@given(st.lists(st.floats(-448, 448, width=32), min_size=1, max_size=64),
       st.sampled_from(["float8_e4m3fn", "float8_e5m2"]))
def test_fp8_rounding_matches_the_cast_and_lands_on_a_neighbour(ys, fmt):
    ml_dtypes = __import__("ml_dtypes")
    dt = getattr(ml_dtypes, fmt)
    y = np.asarray(ys, np.float32)
    want = y.astype(dt).astype(np.float32)
    assert (R.f32_bits(R.round_nearest_fp8(y, fmt)) == R.f32_bits(want)).all()
    rand = R.random_bits(5, 1, 9, np.arange(y.size))
    q = R.stochastic_round_fp8(y, rand, fmt)
    assert (q.astype(dt).astype(np.float32) == q).all()  # on the grid
    # ... and one of the two grid points around |y| (|y| itself if on the grid).
    a, w = np.abs(y), np.abs(want)
    code = w.astype(dt).view(np.uint8).astype(np.int32)
    step = lambda c: np.clip(c, 0, 255).astype(np.uint8).view(dt).astype(np.float32)  # noqa: E731
    down = np.where(w <= a, w, step(code - 1))
    up = np.where(w >= a, w, step(code + 1))
    q = np.abs(q)
    assert ((q == down) | (q == up)).all()


@pytest.mark.parametrize("fmt, value", [("float8_e4m3fn", 1.0 + 2**-5),   # normal: 1/4 step
                                        ("float8_e4m3fn", 2**-9 * 0.3),    # below subnormal min
                                        ("float8_e4m3fn", 2**-7 + 2**-11),  # subnormal range
                                        ("float8_e5m2", 3.0 * 2**-17)])
def test_fp8_stochastic_rounding_is_unbiased(fmt, value):
    n = 10**6
    rand = R.random_bits(11, 2, 4, np.arange(n))
    q = R.stochastic_round_fp8(np.full(n, value, np.float32), rand, fmt).astype(np.float64)
    err = q - np.float64(np.float32(value))
    assert len(np.unique(q)) == 2
    assert abs(err.mean()) < 4 * err.std() / np.sqrt(n)


def test_state_8bit_round_trip_follows_the_fp8_rule():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 100)) * np.logspace(-6, 2, 300).reshape(3, 100)).astype(np.float32)
    x[1, :] = 0.0  # an all-zero block: scale 1
    q, s = R.quantize_state_8bit(x, "float8_e4m3fn")
    assert q.shape == x.shape and s.shape == (3,)  # 300 elements: 3 blocks of 128
    flat = np.zeros(384, np.float32)
    flat[:300] = x.reshape(-1)
    amax = np.abs(flat.reshape(3, 128)).max(1)
    np.testing.assert_array_equal(s, np.where(amax > 0, np.float32(448) / amax, 1).astype(np.float32))
    back = R.dequantize_state_8bit(q, s)
    assert (np.abs(back - x) <= np.abs(x) * 2**-4 + amax.repeat(128)[:300].reshape(3, 100) * 2**-17).all()
    qs, _ = R.quantize_state_8bit(x, "float8_e4m3fn", rand=R.random_bits(0, 1, 0, np.arange(300)))
    assert (np.abs(qs - q) <= np.abs(q) * 2**-3 + 2**-9).all() and (qs != q).any()


def test_kahan_update_in_float16():
    p, c = np.ones(1, np.float16).view(np.uint16), np.zeros(1, np.uint16)
    for _ in range(1000):
        p, c = R.kahan_update(p, c, np.full(1, 1e-5, np.float32), dtype="float16")
    got = float(p.view(np.float16)[0])
    assert abs(got - 1.01) < 2**-10  # float16's spacing at 1.0: plain float16 stays 1.0
