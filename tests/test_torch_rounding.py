"""mpfunc_torch._src.rounding: the shared rules as torch ops, bit for bit with the NumPy
reference (_mpfunc_common.rounding), on CPU and, where there is one, on CUDA."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _mpfunc_common import rounding as R
from _mpfunc_common.fp8 import FP8_MAX
from mpfunc_torch._src import rounding as T

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
u32 = st.integers(0, 2**32 - 1)
# Every float32 bit pattern: finite values, subnormals, zeros, infinities, NaNs.
any_bits = st.lists(u32, min_size=1, max_size=64)
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def f32(bits, device="cpu"):
    return torch.from_numpy(np.asarray(bits, np.uint32).view(np.int32).copy()).view(
        torch.float32).to(device)


def u16(t):
    return t.cpu().view(torch.int16).numpy().view(np.uint16)


def bf16(bits16, device="cpu"):
    return torch.from_numpy(np.asarray(bits16, np.uint16).view(np.int16).copy()).view(
        torch.bfloat16).to(device)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(seed=u32, stream=st.integers(0, 2**32 - 1), step=u32,
       start=st.one_of(st.integers(0, 2**20), st.integers(2**31 - 40, 2**31 + 40),
                       st.integers(2**32 - 40, 2**40)),
       n=st.integers(1, 70))
def test_random_bits_equal_the_reference(device, seed, stream, step, start, n):
    want = R.random_bits(seed, stream, step, np.arange(start, start + n, dtype=np.int64))
    got = T.random_bits(seed, stream, step, start, n, device=device)
    assert got.dtype == torch.int32 and got.device.type == device
    assert (got.cpu().numpy().view(np.uint32) == want).all()
    index = torch.arange(start, start + n, dtype=torch.int64, device=device).flip(0)
    at = T.random_bits_at(seed, stream, step, index)
    assert (at.cpu().numpy().view(np.uint32) == want[::-1]).all()


def test_mix32_equals_the_reference_on_edge_words():
    words = np.array([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x12345678], np.uint64)
    got = T.mix32_(torch.from_numpy(words.astype(np.uint32).view(np.int32).copy()))
    assert (got.numpy().view(np.uint32) == R.mix32(words)).all()


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=80, deadline=None)
@given(bits=any_bits, rand=st.lists(u32, min_size=64, max_size=64))
def test_stochastic_rounding_equals_the_reference_on_every_bit_pattern(device, bits, rand):
    rand = np.asarray(rand[:len(bits)], np.uint32)
    want = R.stochastic_round_bf16(np.asarray(bits, np.uint32).view(np.float32), rand)
    out = torch.empty(len(bits), dtype=torch.bfloat16, device=device)
    r = torch.from_numpy(rand.view(np.int32).copy()).to(device)
    T.stochastic_round_(out, f32(bits, device), r)
    assert (u16(out) == want).all()


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=80, deadline=None)
@given(bits=any_bits)
def test_remainders_split_and_join_like_the_reference(device, bits):
    # Every bit pattern, NaNs included, splits and joins exactly (modulo 2**32, as the
    # reference); finite ones give the reference's nearest-ties-away `hi`.
    x = np.asarray(bits, np.uint32).view(np.float32)
    hi, lo = R.split_remainder(x)
    work = f32(bits, device)
    th = torch.empty(len(bits), dtype=torch.bfloat16, device=device)
    tl = torch.empty(len(bits), dtype=torch.int16, device=device)
    T.split_remainder_(work, th, tl)
    assert (u16(th) == hi).all() and (tl.cpu().numpy() == lo).all()
    back = torch.full((len(bits),), 7.0, device=device)
    T.join_remainder_(back, th, tl)
    assert (back.cpu().view(torch.int32).numpy().view(np.uint32) == bits).all()


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=80, deadline=None)
@given(xs=st.lists(st.tuples(finite_f32, finite_f32, finite_f32), min_size=1, max_size=48))
def test_kahan_update_equals_the_reference(device, xs):
    p0, c0, u = (np.asarray(v, np.float32) for v in zip(*xs))
    p, c = R.round_nearest_bf16(p0), R.round_nearest_bf16(c0 * np.float32(2**-9))
    with np.errstate(all="ignore"):  # the reference overflows to inf, as torch does
        want_p, want_c = R.kahan_update(p, c, u)
    finite = np.isfinite(R.bits_f32(want_p.astype(np.uint32) << 16)) & np.isfinite(
        R.bits_f32(want_c.astype(np.uint32) << 16))
    tp, tc = bf16(p, device), bf16(c, device)
    T.kahan_update_(tp, tc, torch.from_numpy(u.copy()).to(device))
    # NaN (inf - inf) keeps being a NaN, in torch's own NaN pattern (see the module).
    assert (u16(tp)[finite] == want_p[finite]).all() and (u16(tc)[finite] == want_c[finite]).all()
    assert (np.isnan(tp.cpu().float().numpy()) == np.isnan(R.bits_f32(
        want_p.astype(np.uint32) << 16))).all()


@settings(max_examples=40, deadline=None)
@given(xs=st.lists(st.tuples(finite_f32, finite_f32, finite_f32), min_size=1, max_size=48))
def test_kahan_step_is_the_rule_on_the_update_an_optimizer_made(xs):
    # The storage's form: the optimizer stepped p (bfloat16, read in float32) to w; the
    # rule runs on the update w - p, computed in float32.
    p0, c0, w = (np.asarray(v, np.float32) for v in zip(*xs))
    p, c = R.round_nearest_bf16(p0), R.round_nearest_bf16(c0 * np.float32(2**-9))
    with np.errstate(all="ignore"):
        update = (w - R.bits_f32(p.astype(np.uint32) << 16)).astype(np.float32)
        want_p, want_c = R.kahan_update(p, c, update)
    ok = np.isfinite(R.bits_f32(want_p.astype(np.uint32) << 16)) & np.isfinite(
        R.bits_f32(want_c.astype(np.uint32) << 16))
    tp, tc = bf16(p), bf16(c)
    T.foreach_kahan_step_([tp], [tc], [torch.from_numpy(w.copy())])
    assert (u16(tp)[ok] == want_p[ok]).all() and (u16(tc)[ok] == want_c[ok]).all()


def test_foreach_forms_equal_the_single_ones():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(n).astype(np.float32) for n in (5, 1, 300)]
    his = [torch.empty(len(x), dtype=torch.bfloat16) for x in xs]
    los = [torch.empty(len(x), dtype=torch.int16) for x in xs]
    T.foreach_split_remainder_([torch.from_numpy(x.copy()) for x in xs], his, los)
    for x, h, lo in zip(xs, his, los):
        want_h, want_l = R.split_remainder(x)
        assert (u16(h) == want_h).all() and (lo.numpy() == want_l).all()
    backs = [torch.empty(len(x)) for x in xs]
    T.foreach_join_remainder_(backs, his, los)
    assert all(np.array_equal(b.numpy().view(np.uint32), x.view(np.uint32))
               for b, x in zip(backs, xs))


def test_stochastic_rounding_is_unbiased_over_a_million_draws():
    n = 10**6
    v = 1.0 + 2.0**-10  # an eighth of a bfloat16 gap above 1.0
    out = torch.empty(n, dtype=torch.bfloat16)
    T.stochastic_round_(out, torch.full((n,), v), T.random_bits(11, 0, 3, 0, n))
    err = out.double() - v
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(float(err.mean())) < 4 * float(err.std()) / n**0.5
    assert abs(float((out.float() > 1).double().mean()) - 0.125) < 0.002


FP8 = ["float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FP8)
@settings(max_examples=60, deadline=None)
@given(bits=any_bits, rand=st.lists(u32, min_size=64, max_size=64))
def test_fp8_stochastic_rounding_equals_the_reference(device, fmt, bits, rand):
    # Any bit pattern clipped into the fp8 range (subnormals, zeros of both signs and
    # non-finite values kept): the grid values, bit for bit.
    rand = np.asarray(rand[:len(bits)], np.uint32)
    x = np.asarray(bits, np.uint32).view(np.float32)
    m = np.float32(FP8_MAX[fmt])
    y = np.where(np.isfinite(x), np.clip(x, -m, m), x).astype(np.float32)
    want = R.stochastic_round_fp8(y, rand, fmt)
    got = T.stochastic_round_fp8_(torch.from_numpy(y.copy()).to(device),
                                  torch.from_numpy(rand.view(np.int32).copy()).to(device), fmt)
    got = got.cpu().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    fin = ~np.isnan(want)
    assert (got[fin].view(np.uint32) == want[fin].view(np.uint32)).all()


def _state(seed, n, spread):
    g = np.random.default_rng(seed)
    return (g.standard_normal(n) * np.exp2(g.uniform(-spread, spread, n))).astype(np.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FP8)
@settings(max_examples=25, deadline=None)
@given(seed=u32, step=u32, rows=st.integers(1, 7), cols=st.integers(1, 90),
       spread=st.sampled_from([0.0, 20.0, 100.0]), special=st.lists(
           st.tuples(st.integers(0, 629), st.sampled_from(
               [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -3e-39])),
           max_size=6))
def test_8bit_state_quantiser_equals_the_reference(device, fmt, seed, step, rows, cols,
                                                   spread, special):
    # The block scales and the stochastically rounded codes of a state tensor (blocks
    # of 128 of the flattened tensor, a last partial one, all-zero and non-finite
    # blocks), given the shared random bits: the reference's, bit for bit.
    x = _state(seed, rows * cols, spread)
    for i, v in special:
        if i < x.size:
            x[i] = v
    x = x.reshape(rows, cols)
    rand = R.random_bits(seed, 1, step, np.arange(x.size))
    want_q, want_s = R.quantize_state_8bit(x, fmt, rand)
    q, s = T.quantize_state_8bit(torch.from_numpy(x.copy()).to(device), fmt, 128,
                                 T.random_bits(seed, 1, step, 0, x.size, device=device))
    assert q.dtype == getattr(torch, fmt) and q.shape == x.shape
    assert np.array_equal(s.cpu().numpy().view(np.uint32), want_s.view(np.uint32))
    got = q.cpu().float().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want_q))
    fin = ~np.isnan(want_q)
    assert (got[fin].view(np.uint32) == want_q[fin].view(np.uint32)).all()
    nearest_q, nearest_s = T.quantize_state_8bit(torch.from_numpy(x.copy()), fmt, 128)
    want_nq, _ = R.quantize_state_8bit(x, fmt)
    fin = ~np.isnan(want_nq)
    assert (nearest_q.float().numpy()[fin].view(np.uint32) == want_nq[fin].view(np.uint32)).all()


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("v", [1.0 + 2.0**-6, 3.3e-3, -1.7e-5])  # normal, subnormal grid
def test_fp8_stochastic_rounding_is_unbiased_over_a_million_draws(fmt, v):
    n = 10**6
    y = torch.full((n,), v)
    out = T.stochastic_round_fp8_(y.clone(), T.random_bits(12, 1, 4, 0, n), fmt)
    want = float(np.float32(v))
    vals = set(out.unique().tolist())
    assert len(vals) == 2  # the two fp8 neighbours of v
    assert min(vals) < want < max(vals)
    assert out.to(getattr(torch, fmt)).float().equal(out)  # on the fp8 grid
    err = out.double() - want
    # Unbiased to within 4 sigma; below the smallest normal the rule's float32 add
    # may shift the mean by up to 2**-21 of a grid step (see the reference).
    gap = max(vals) - min(vals)
    assert abs(float(err.mean())) < 4 * float(err.std()) / n**0.5 + gap * 2.0**-21
