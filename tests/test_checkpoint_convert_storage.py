"""Tests for mpfunc.convert_checkpoint to and from mode "bf16"'s storages without float32
masters (remainder, kahan, stochastic; state_dtype), checked bit for bit against the
NumPy reference of `_mpfunc_common.rounding` (the torch twin is
tests/test_torch_convert_storage.py; both sides agree in
tests/test_convert_storage_parity.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpfunc
from _mpfunc_common import rounding as R

# One optax optimizer for every setup (its state carries over). Its steps stay far below
# the params (at least 0.25): through `convert_to_amp` the updates of bfloat16 params
# come out in bfloat16, and a step that shrinks a param by more than half could land
# one rounding off (`mpfunc.master_weights`' landing note), which is not what is tested.
OPT = optax.adam(2.0**-10)
SHAPES = {"b": (12,), "w": (8, 12)}


def apply_fn(p, x):
    return x @ p["w"] + p["b"]


def setup(**keys):
    return mpfunc.convert_to_amp(apply_fn, OPT, mode="bf16", **keys)


F32 = setup(master_weights="float32")
REM = setup(master_weights="remainder")
KAHAN = setup(master_weights="kahan")
SR = setup(master_weights="stochastic", seed=7)


def masters_with_ties(seed=0):
    """Float32 masters of magnitude >= 0.25, the first 8 of ``w`` exactly halfway between
    two bfloat16s."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, s in SHAPES.items():
        x = rng.standard_normal(s)
        out[k] = (np.sign(x) * (0.25 + np.abs(x))).astype(np.float32)
    w = out["w"].reshape(-1).view(np.uint32)
    w[:8] = (w[:8] & 0xFFFF0000) | 0x8000
    return out


def grads(n, seed=1):
    rng = np.random.default_rng(seed)
    return [{k: jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(jnp.bfloat16)
             for k, s in SHAPES.items()} for _ in range(n)]


_STEPS = {}


def train(amp, params, state, gs):
    step = _STEPS.get(amp.plan)  # one compile per setup
    if step is None:
        @jax.jit
        def step(p, s, g):
            with jax.numpy_dtype_promotion("standard"):  # float32 updates land exactly
                u, s = amp.optimizer.update(g, s, p)
                return optax.apply_updates(p, u), s
        _STEPS[amp.plan] = step
    for g in gs:
        params, state = step(params, state, g)
    return params, state


def start(masters, amp=F32):
    """A float32-master run whose masters are ``masters`` (params: their casts)."""
    params = amp.cast_params({k: jnp.asarray(v) for k, v in masters.items()})
    state = amp.optimizer.init(params)
    inner = state.inner_state._replace(
        master_params={k: jnp.asarray(v) for k, v in masters.items()})
    return params, state._replace(inner_state=inner)


def u16(x):
    return np.asarray(x).view(np.uint16)


def u32(x):
    return np.asarray(x, np.float32).view(np.uint32)


def np_masters(state):
    return {k: np.asarray(v) for k, v in state.inner_state.master_params.items()}


@pytest.mark.parametrize("source", ["bf16-float32", "naive"])
def test_remainder_is_the_master_split_exactly_and_comes_back_bit_for_bit(source):
    amp = F32 if source == "bf16-float32" else mpfunc.convert_to_amp(
        apply_fn, OPT, mode="naive", initial_scale=2.0**10)
    m = masters_with_ties()
    params, state = start(m, amp)
    p2, s2 = mpfunc.convert_checkpoint(params, state, amp, REM)
    for k in SHAPES:
        hi, lo = R.split_remainder(m[k])
        np.testing.assert_array_equal(u16(p2[k]), hi, err_msg=k)
        np.testing.assert_array_equal(np.asarray(s2.inner_state.remainders[k]), lo)
        assert p2[k].dtype == jnp.bfloat16
    # At a tie the param is rounded away from zero, not to even as astype does: those
    # with an odd upper neighbour differ (the rule the remainder storage itself keeps).
    ties = u16(p2["w"]).reshape(-1)[:8]
    even = R.round_nearest_bf16(m["w"].reshape(-1)[:8])
    assert (ties != even).any() and (ties == even).any()
    fresh = REM.optimizer.init(p2)
    assert jax.tree.structure(s2) == jax.tree.structure(fresh)
    p3, s3 = mpfunc.convert_checkpoint(p2, s2, REM, F32)  # back: the masters, exactly
    for k in SHAPES:
        np.testing.assert_array_equal(u32(np_masters(s3)[k]), u32(m[k]))
    p4, s4 = mpfunc.convert_checkpoint(p2, s2, REM, OPT)  # and to a plain float32 run
    for k in SHAPES:
        np.testing.assert_array_equal(u32(p4[k]), u32(m[k]))
    jax.tree.map(np.testing.assert_array_equal, s4, state.inner_state.inner_state)


def test_a_converted_remainder_run_goes_on_the_float32_masters_trajectory():
    gs = grads(6)
    params, state = train(F32, *start(masters_with_ties()), gs[:3])
    p2, s2 = mpfunc.convert_checkpoint(params, state, F32, REM)
    for g in gs[3:]:  # step by step: the remainder run's masters are float32's, bit for bit
        params, state = train(F32, params, state, [g])
        p2, s2 = train(REM, p2, s2, [g])
        for k in SHAPES:
            joined = R.join_remainder(u16(p2[k]), np.asarray(s2.inner_state.remainders[k]))
            np.testing.assert_array_equal(u32(joined), u32(np_masters(state)[k]))
        jax.tree.map(np.testing.assert_array_equal, s2.inner_state.inner_state,
                     state.inner_state.inner_state)  # Adam's moments and count
    moved = u32(np_masters(state)["w"]) != u32(masters_with_ties()["w"])
    assert moved.mean() > 0.9


def test_kahan_compensation_is_the_masters_residual_never_zeroed():
    params, state = train(F32, *start(masters_with_ties()), grads(2))
    m = np_masters(state)
    p2, s2 = mpfunc.convert_checkpoint(params, state, F32, KAHAN)
    for k in SHAPES:
        want_p, want_c = R.kahan_from_master(m[k])
        np.testing.assert_array_equal(u16(p2[k]), want_p)
        np.testing.assert_array_equal(u16(s2.inner_state.compensation[k]), want_c)
        c = np.asarray(s2.inner_state.compensation[k], np.float32)
        assert (c != 0).mean() > 0.9  # the residual, not zeros
        residual = m[k] - np.asarray(p2[k], np.float32)
        np.testing.assert_array_equal(c, R.bits_f32(R.round_nearest_bf16(residual)
                                                    .astype(np.uint32) << 16))
    p3, s3 = mpfunc.convert_checkpoint(p2, s2, KAHAN, F32)  # back: param + compensation
    for k in SHAPES:
        want = R.kahan_master(u16(p2[k]), u16(s2.inner_state.compensation[k]))
        np.testing.assert_array_equal(u32(np_masters(s3)[k]), u32(want))
        assert np.abs(want - m[k]).max() <= np.abs(m[k]).max() * 2.0**-16
    # Resumed, Kahan's values follow the float32 masters' to within 2**-14 (a bfloat16
    # param alone is 2**-8 apart; the bfloat16 compensation rounds each step).
    p4, s4 = train(KAHAN, p2, s2, grads(2, seed=5))
    _, s5 = train(F32, params, state, grads(2, seed=5))
    for k in SHAPES:
        got = R.kahan_master(u16(p4[k]), u16(s4.inner_state.compensation[k]))
        want = np_masters(s5)[k]
        assert (u32(want) != u32(m[k])).mean() > 0.9  # they moved
        np.testing.assert_allclose(got, want, rtol=2.0**-14, atol=0)


def test_stochastic_params_are_rounded_to_nearest_and_the_step_count_goes_on():
    params, state = train(F32, *start(masters_with_ties()), grads(3))
    m = np_masters(state)
    p2, s2 = mpfunc.convert_checkpoint(params, state, F32, SR)
    for k in SHAPES:
        np.testing.assert_array_equal(u16(p2[k]), R.round_nearest_bf16(m[k]))
    # the target's seed; the step count of the run (Adam's count: 3 steps taken)
    assert int(s2.inner_state.seed) == 7 and int(s2.inner_state.step) == 3
    p3, s3 = train(SR, p2, s2, grads(2, seed=5))
    assert int(s3.inner_state.step) == 5
    p4, s4 = mpfunc.convert_checkpoint(p3, s3, SR, F32)  # back: the params' values
    for k in SHAPES:
        np.testing.assert_array_equal(np_masters(s4)[k], np.asarray(p3[k], np.float32))
    # a source without a count (SGD) starts the bits at step 0
    sgd = optax.sgd(2.0**-6)
    sr_sgd = mpfunc.convert_to_amp(apply_fn, sgd, mode="bf16", master_weights="stochastic")
    plain = {k: jnp.asarray(v) for k, v in masters_with_ties().items()}
    _, s5 = mpfunc.convert_checkpoint(plain, sgd.init(plain), sgd, sr_sgd)
    assert int(s5.inner_state.step) == 0


def test_state_dtype_is_rounded_to_nearest_once_and_widened_back():
    params, state = train(F32, *start(masters_with_ties()), grads(2))
    adam = state.inner_state.inner_state[0]
    rem16 = setup(master_weights="remainder", state_dtype="bfloat16")
    p2, s2 = mpfunc.convert_checkpoint(params, state, F32, rem16)
    stored = s2.inner_state.inner_state
    assert int(stored.step) == 2  # the state's step count goes on with the params'
    for k in SHAPES:
        for name in ("mu", "nu"):
            got = getattr(stored.inner_state[0], name)[k]
            assert got.dtype == jnp.bfloat16
            np.testing.assert_array_equal(
                u16(got), R.round_nearest_bf16(np.asarray(getattr(adam, name)[k])))
    p3, s3 = mpfunc.convert_checkpoint(p2, s2, rem16, F32)
    back = s3.inner_state.inner_state[0]
    for k in SHAPES:
        np.testing.assert_array_equal(
            np.asarray(back.mu[k]), np.asarray(stored.inner_state[0].mu[k], np.float32))
        np.testing.assert_array_equal(u32(np_masters(s3)[k]), u32(np_masters(state)[k]))
    train(rem16, p2, s2, grads(1))  # resumes
    kahan8 = setup(master_weights="kahan", state_dtype="float8_e4m3fn",
                   state_rounding="nearest")
    p5, s5 = mpfunc.convert_checkpoint(params, state, F32, kahan8)
    stored = s5.inner_state.inner_state
    for k in SHAPES:
        want, scale = R.quantize_state_8bit(np.asarray(adam.nu[k]), "float8_e4m3fn")
        np.testing.assert_array_equal(np.asarray(stored.inner_state[0].nu[k], np.float32),
                                      want)
        np.testing.assert_array_equal(np.asarray(stored.scales[0].nu[k]), scale)
    _, s6 = mpfunc.convert_checkpoint(p5, s5, kahan8, F32)
    for k in SHAPES:
        np.testing.assert_array_equal(
            np.asarray(s6.inner_state.inner_state[0].nu[k]),
            R.dequantize_state_8bit(np.asarray(stored.inner_state[0].nu[k], np.float32),
                                    np.asarray(stored.scales[0].nu[k])))


def test_storage_to_storage_goes_through_float32():
    params, state = train(F32, *start(masters_with_ties()), grads(2))
    pk, sk = mpfunc.convert_checkpoint(params, state, F32, KAHAN)
    pr, sr = mpfunc.convert_checkpoint(pk, sk, KAHAN, REM)  # kahan -> remainder
    for k in SHAPES:
        want = R.kahan_master(u16(pk[k]), u16(sk.inner_state.compensation[k]))
        joined = R.join_remainder(u16(pr[k]), np.asarray(sr.inner_state.remainders[k]))
        np.testing.assert_array_equal(u32(joined), u32(want))
    ps, ss = mpfunc.convert_checkpoint(pr, sr, REM, SR)  # remainder -> stochastic
    pk2, sk2 = mpfunc.convert_checkpoint(ps, ss, SR, KAHAN)  # stochastic -> kahan
    for k in SHAPES:
        np.testing.assert_array_equal(u16(pk2[k]), u16(ps[k]))  # a bf16 value stays
        assert not np.asarray(sk2.inner_state.compensation[k], np.float32).any()
    assert int(ss.inner_state.step) == 2


def test_bad_combinations_are_clear_errors():
    params, state = start(masters_with_ties())
    p2, s2 = mpfunc.convert_checkpoint(params, state, F32, REM)
    with pytest.raises(ValueError, match="holds no RemainderState.*keeps its masters as "
                                         "'remainder'"):
        mpfunc.convert_checkpoint(params, state, REM, F32)
    with pytest.raises(ValueError, match="holds no KahanState"):
        mpfunc.convert_checkpoint(p2, s2, KAHAN, F32)
    rem16 = setup(master_weights="remainder", state_dtype="bfloat16")
    with pytest.raises(ValueError, match="holds no StateDtypeState.*'bfloat16'"):
        mpfunc.convert_checkpoint(p2, s2, rem16, F32)
    with pytest.raises(ValueError, match="`params` do not fit the remainder state"):
        mpfunc.convert_checkpoint({"w": p2["w"]}, s2, REM, F32)
    sgd_rem = mpfunc.convert_to_amp(apply_fn, optax.sgd(0.1, momentum=0.9), mode="bf16",
                                    master_weights="remainder")
    with pytest.raises(ValueError, match="does not fit `target`'s optimizer"):
        mpfunc.convert_checkpoint(p2, s2, REM, sgd_rem)
    with pytest.raises(TypeError, match="`target` must be an AmpSetup"):
        mpfunc.convert_checkpoint(p2, s2, REM, "remainder")
