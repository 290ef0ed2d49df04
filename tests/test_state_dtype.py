"""Tests for mpfunc._src.state_dtype: any optax transformation's state stored in bfloat16
or 8-bit blocks, computed in float32, against the NumPy reference (_mpfunc_common.rounding)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lenient import lenient

import mpfunc
from _mpfunc_common import rounding as R

INNERS = {
    "adam": lambda: lenient(optax.adam(1e-2)),
    "adamw": lambda: lenient(optax.adamw(1e-2, weight_decay=0.1)),
    "lion": lambda: lenient(optax.lion(1e-3)),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "multisteps": lambda: lenient(optax.MultiSteps(
        optax.adam(1e-2), every_k_schedule=2).gradient_transformation()),
}


def params_and_grads(seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.standard_normal((8, 130)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((130,)), jnp.float32)}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32),
                          params) for _ in range(6)]
    return params, grads


def run(opt, params, grads):
    step = jax.jit(opt.update)
    state = opt.init(params)
    for g in grads:
        u, state = step(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


@pytest.mark.parametrize("name", list(INNERS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_wraps_any_optax_transformation(name, dtype):
    params, grads = params_and_grads()
    inner = INNERS[name]()
    want, want_state = run(inner, params, grads)
    got, state = run(mpfunc.state_dtype(inner, dtype, seed=1), params, grads)
    stored = jax.tree.leaves(state.inner_state)
    floats = [x for x in stored if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.dtype(dtype) for x in floats)
    # Counts untouched, and the same as the plain run's.
    ints = [x for x in stored if jnp.issubdtype(x.dtype, jnp.integer)]
    want_ints = [x for x in jax.tree.leaves(want_state) if jnp.issubdtype(x.dtype, jnp.integer)]
    chex.assert_trees_all_equal(ints, want_ints)
    assert int(state.step) == len(grads)
    # Updates close to the float32 state's (bfloat16 state: 2**-8 relative per step).
    tol = 0.05 if dtype == "bfloat16" else 0.3
    for a, b, p in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(params)):
        moved = np.abs(np.asarray(b - p))
        err = np.abs(np.asarray(a - b))
        assert np.median(err / np.maximum(moved, 1e-12)) < tol, (name, float(np.median(err / moved)))


STEP = jax.jit(lambda s, g, p: mpfunc.state_dtype(
    optax.sgd(1.0, momentum=0.5), "bfloat16", seed=0).update(g, s, p))


@given(st.lists(st.floats(-100, 100, width=32, allow_subnormal=False), min_size=64,
                max_size=64), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_bfloat16_state_rounds_with_the_reference_bits(gs, seed, step):
    # Momentum from zero: the new trace is the gradient; it is stored rounded with the
    # bits of (seed, stream 1, step, index), whatever the state's seed and step are.
    g = np.asarray(gs, np.float32).reshape(8, 8)
    opt = mpfunc.state_dtype(optax.sgd(1.0, momentum=0.5), "bfloat16", seed=seed)
    state = opt.init(jnp.zeros((8, 8)))._replace(step=jnp.uint32(step))
    _, state = STEP(state, jnp.asarray(g), jnp.zeros((8, 8)))
    trace = (g + np.float32(0)).reshape(-1)  # momentum's g + 0.5 * 0 (-0.0 becomes 0.0)
    want = R.stochastic_round_bf16(trace, R.random_bits(seed, 1, step, np.arange(64)))
    got = state.inner_state[0].trace
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16).reshape(-1), want)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_8bit_state_is_the_reference_quantisation(fmt, rounding):
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((5, 100)) * np.logspace(-5, 1, 500).reshape(5, 100)).astype(np.float32)
    seed = 0 if rounding == "nearest" else 77
    opt = mpfunc.state_dtype(optax.sgd(1.0, momentum=0.5), fmt, rounding=rounding, seed=seed)
    _, state = jax.jit(opt.update)(jnp.asarray(g), opt.init(jnp.zeros((5, 100))),
                                   jnp.zeros((5, 100)))
    rand = None if rounding == "nearest" else R.random_bits(seed, 1, 0, np.arange(500))
    q, s = R.quantize_state_8bit(g, fmt, rand)
    codes, scales = state.inner_state[0].trace, state.scales[0].trace
    assert codes.dtype == jnp.dtype(fmt) and codes.shape == (5, 100) and scales.shape == (4,)
    np.testing.assert_array_equal(np.asarray(codes.astype(jnp.float32)).view(np.uint32),
                                  q.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(scales), s)


def test_nearest_rounding_freezes_the_second_moment_and_stochastic_does_not():
    # After a burst of gradient 1, the gradient drops to 0: Adam's nu should decay as
    # 0.999**t. Rounded to nearest in bfloat16, 0.999 * nu rounds back to nu every step.
    grads = [jnp.ones((4096,))] * 10 + [jnp.zeros((4096,))] * 400
    nus = {}
    for rounding in ["nearest", "stochastic"]:
        opt = mpfunc.state_dtype(lenient(optax.adam(1e-3)), "bfloat16", rounding=rounding)
        step = jax.jit(opt.update)
        state = opt.init(jnp.zeros((4096,)))
        for g in grads:
            _, state = step(g, state, jnp.zeros((4096,)))
        nus[rounding] = np.asarray(state.inner_state[0].nu, np.float64)
    exact = (1 - 0.999**10) * 0.999**400
    assert np.all(nus["nearest"] >= 0.99 * (1 - 0.999**10))  # frozen at its peak
    mean = nus["stochastic"].mean()
    assert abs(mean - exact) < 0.01 * exact, (mean, exact)


def test_a_skipped_step_keeps_8bit_state_bit_for_bit():
    opt = mpfunc.dynamic_scale(mpfunc.state_dtype(lenient(optax.adam(1e-2)), "e4m3", seed=4),
                               preset="naive", init_scale=1.0, hysteresis=1)
    params, grads = params_and_grads(1)
    state = opt.init(params)
    step = jax.jit(opt.update)
    for g in grads[:2]:
        u, state = step(g, state, params)
        params = optax.apply_updates(params, u)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads[2])
    u, state2 = step(bad, state, params)
    chex.assert_trees_all_equal(state2.inner_state, state.inner_state)
    chex.assert_trees_all_equal(optax.apply_updates(params, u), params)


def test_state_sharding_places_codes_with_their_params_and_scales_replicated():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    opt = mpfunc.state_dtype(optax.adam(1e-3), "float8_e4m3fn")
    params = jax.device_put({"w": jnp.ones((64, 128))}, NamedSharding(mesh, P("x", None)))
    shardings = mpfunc.state_sharding(opt, params)
    assert shardings.inner_state[0].mu["w"].spec == P("x", None)
    assert shardings.scales[0].mu["w"].spec == P()
    state = jax.jit(opt.init, out_shardings=shardings)(params)
    assert state.inner_state[0].mu["w"].dtype == jnp.float8_e4m3fn


def test_non_float_and_scalar_leaves_stay_as_they_are():
    opt = mpfunc.state_dtype(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1,
                                                                   momentum=0.9), "bf16")
    state = opt.init({"w": jnp.ones((3,))})
    hp = state.inner_state.hyperparams
    assert hp["learning_rate"].dtype == jnp.float32  # a scalar: never rounded
    assert state.inner_state.inner_state[0].trace["w"].dtype == jnp.bfloat16


def test_updates_come_back_in_the_params_dtype():
    opt = mpfunc.state_dtype(lenient(optax.adam(1e-2)), "bfloat16")
    p = {"w": jnp.ones((4,), jnp.bfloat16)}
    u, _ = opt.update({"w": jnp.ones((4,), jnp.bfloat16)}, opt.init(p), p)
    assert u["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(dtype="float16"), ValueError, r"`dtype`='float16': float16 optimizer state is refused"),
    (dict(dtype=jnp.float16), ValueError, "float16 optimizer state is refused"),
    (dict(dtype="bfloat15"), ValueError, r"`dtype` must be one of .*\(did you mean `bfloat16`\?\)"),
    (dict(dtype="bf16", rounding="round"), ValueError, r"`rounding` must be one of"),
    (dict(dtype="bf16", rounding="nearest", seed=2), ValueError, "`seed=2` has no effect"),
    (dict(dtype="float32", seed=2), ValueError, "`seed=2` has no effect"),
    (dict(dtype="bf16", seed=-1), ValueError, r"`seed` must be an int in \[0, 4294967295\]"),
])
def test_errors(kwargs, err, match):
    with pytest.raises(err, match=match):
        mpfunc.state_dtype(optax.sgd(0.1), **kwargs)
