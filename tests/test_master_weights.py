"""Tests for mpfunc._src.master_weights."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from donation import assert_own_buffers
from hypothesis import given
from hypothesis import strategies as st
from lenient import adam

import mpfunc


def test_small_updates_accumulate_where_plain_fp16_stalls():
    params = {"w": jnp.ones((4,), jnp.float16)}
    grads = {"w": jnp.ones((4,), jnp.float16)}
    lr = 1e-4  # float16's spacing at 1.0 is 2**-10 ~ 9.8e-4: each step rounds away
    plain, plain_opt = params, optax.sgd(lr)
    plain_state = plain_opt.init(plain)
    mw, mw_opt = params, mpfunc.master_weights(optax.sgd(lr))
    mw_state = mw_opt.init(mw)
    step = jax.jit(lambda p, s: mw_opt.update(grads, s, p))
    for _ in range(200):
        u, plain_state = plain_opt.update(grads, plain_state, plain)
        plain = optax.apply_updates(plain, u)
        u, mw_state = step(mw, mw_state)
        mw = optax.apply_updates(mw, u)
    assert float(plain["w"][0]) == 1.0  # stalled
    assert float(mw_state.master_params["w"][0]) == pytest.approx(1 - 200 * lr, rel=1e-5)
    assert mw["w"][0] == jnp.float16(1 - 200 * lr)  # the rounded master


steps_st = st.lists(st.floats(-0.0099, 0.0099, allow_nan=False), min_size=1, max_size=30)


@given(steps_st)
def test_params_are_exactly_the_rounded_master_for_small_steps(steps):
    # Steps small relative to the params (within a factor of two): exact every time.
    params = {"w": jnp.array([0.75, -3.0, 0.5], jnp.float16), "s": jnp.ones((2,), jnp.float32)}
    opt = mpfunc.master_weights(optax.sgd(1.0))
    state = opt.init(params)
    for g in steps:
        grads = jax.tree.map(lambda p, g=g: jnp.full_like(p, g), params)
        u, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, u)
        chex.assert_trees_all_equal(params["w"], state.master_params["w"].astype(jnp.float16))
        chex.assert_trees_all_equal(params["s"], state.master_params["s"])


@given(steps_st)
def test_large_relative_steps_stay_within_one_rounding_and_self_correct(steps):
    params = {"w": jnp.array([1e-3, -2e-4, 3e-3], jnp.float16)}
    opt = mpfunc.master_weights(optax.sgd(1.0))
    state = opt.init(params)
    for g in steps:
        prev = np.asarray(params["w"], np.float32)
        u, state = opt.update({"w": jnp.full((3,), g, jnp.float16)}, state, params)
        params = optax.apply_updates(params, u)
        target = np.asarray(state.master_params["w"].astype(jnp.float16), np.float32)
        got = np.asarray(params["w"], np.float32)
        # At most one float16 rounding of the update's own size, plus the target's.
        bound = (np.spacing(np.abs(target - prev).astype(np.float16))
                 + np.spacing(np.abs(target).astype(np.float16))).astype(np.float32)
        assert np.all(np.abs(got - target) <= bound), (got, target)
    # A zero step recomputes from the master: the deviation is gone, not accumulated.
    u, state = opt.update({"w": jnp.zeros((3,), jnp.float16)}, state, params)
    params = optax.apply_updates(params, u)
    target = state.master_params["w"].astype(jnp.float16)
    near = np.abs(np.asarray(params["w"], np.float32) - np.asarray(target, np.float32))
    assert np.all(near <= np.spacing(np.abs(np.asarray(target))).astype(np.float32))


def test_composes_with_dynamic_scale_and_skip_keeps_master():
    params = {"w": jnp.full((3,), 0.5, jnp.float16)}
    opt = mpfunc.dynamic_scale(mpfunc.master_weights(adam(1e-2)), preset="naive",
                               init_scale=2.0**8, hysteresis=1)
    state = opt.init(params)
    step = jax.jit(opt.update)
    u, state = step({"w": jnp.full((3,), 2.0**8, jnp.float16)}, state, params)
    params = optax.apply_updates(params, u)
    before_master = state.inner_state.master_params
    u, state2 = step({"w": jnp.full((3,), jnp.inf, jnp.float16)}, state, params)
    chex.assert_trees_all_equal(state2.inner_state, state.inner_state)
    chex.assert_trees_all_equal(state2.inner_state.master_params, before_master)
    chex.assert_trees_all_equal(optax.apply_updates(params, u), params)
    assert float(state2.loss_scale) == 2.0**7


def test_requires_params_and_an_optax_inner():
    opt = mpfunc.master_weights(optax.sgd(1.0))
    state = opt.init({"w": jnp.ones(2, jnp.float16)})
    with pytest.raises(ValueError, match="`params` is required"):
        opt.update({"w": jnp.ones(2, jnp.float16)}, state)
    with pytest.raises(TypeError, match="`inner` must be an optax GradientTransformation"):
        mpfunc.master_weights("sgd")


def test_state_dtypes():
    params = {"w": jnp.ones(2, jnp.bfloat16), "i": jnp.arange(2)}
    state = mpfunc.master_weights(optax.sgd(1.0)).init(params)
    assert state.master_params["w"].dtype == jnp.float32
    assert state.master_params["i"].dtype == jnp.int32
    np.testing.assert_array_equal(state.master_params["w"], 1.0)


def test_masters_of_float32_params_are_their_own_buffers():
    # apex O2 keeps norm params in float32: their masters once were the params' own
    # arrays, so donating params and state together failed on the first step.
    tx = mpfunc.master_weights(adam(1e-3))
    params = {"w": jnp.ones((4, 2), jnp.float16), "norm": jnp.ones((2,), jnp.float32)}
    state = tx.init(params)
    assert_own_buffers(params, state)
    chex.assert_trees_all_equal(state.master_params, jax.tree.map(
        lambda x: x.astype(jnp.float32), params))

    def step(params, state):
        grads = jax.tree.map(jnp.ones_like, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    expected = jax.jit(step)(params, state)
    chex.assert_trees_all_equal(jax.jit(step, donate_argnums=(0, 1))(params, state), expected)
