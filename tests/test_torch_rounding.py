"""mpfunc_torch._src.rounding: the shared rules as torch ops, bit for bit with the NumPy
reference (_mpfunc_common.rounding), on CPU and, where there is one, on CUDA."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _mpfunc_common import rounding as R
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
