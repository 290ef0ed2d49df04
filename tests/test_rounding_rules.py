"""The NumPy reference of the shared low-precision storage rules (_mpfunc_common.rounding)."""

import numpy as np
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
