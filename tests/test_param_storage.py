"""Tests for mpfunc._src.param_storage: bf16 params without float32 masters (remainder,
Kahan, stochastic rounding), against the NumPy reference in _mpfunc_common.rounding.

Each jitted function is built once at module level for fixed shapes; hypothesis draws
values, never shapes, so nothing compiles inside a @given body more than once."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from donation import assert_own_buffers
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from lenient import adam, lenient

import mpfunc
from _mpfunc_common import rounding as R
from mpfunc._src.master_weights import MasterWeightsState
from mpfunc._src.param_storage import RemainderState

N = 64  # elements of the hypothesis tests' param


def bits(x):
    return np.asarray(x).view(np.uint16 if np.asarray(x).dtype.itemsize == 2 else np.uint32)


def standard(fn):
    """``fn`` traced under JAX's default (standard) dtype promotion, where the storages
    emit float32 updates and ``optax.apply_updates`` lands every param exactly."""
    def wrapped(*args):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args)
    return wrapped


def _trajectories(steps):
    """(float32-master run, remainder run) of Adam over ``steps`` gradients, one scan."""
    f32 = mpfunc.master_weights(adam(1e-3))
    rem = mpfunc.master_weights(adam(1e-3), storage="remainder")

    @standard
    def run(p0, key):
        def body(carry, i):
            (pa, sa), (pb, sb) = carry
            g = jax.random.normal(jax.random.fold_in(key, i), p0.shape).astype(jnp.bfloat16)
            ua, sa = f32.update(g, sa, pa)
            ub, sb = rem.update(g, sb, pb)
            pa, pb = optax.apply_updates(pa, ua), optax.apply_updates(pb, ub)
            joined = mpfunc._src.rounding.join_remainder(pb, sb.remainders)
            same_master = jnp.all(jax.lax.bitcast_convert_type(joined, jnp.uint32)
                                  == jax.lax.bitcast_convert_type(sa.master_params, jnp.uint32))
            tie = (jax.lax.bitcast_convert_type(sa.master_params, jnp.uint32)
                   & jnp.uint32(0xFFFF)) == jnp.uint32(0x8000)
            # Today's params are the masters rounded to nearest (ties to even).
            same_param = jnp.all((sa.master_params.astype(jnp.bfloat16) == pb) | tie)
            return ((pa, sa), (pb, sb)), (same_master, same_param, jnp.sum(tie))

        init = ((p0, f32.init(p0)), (p0, rem.init(p0)))
        return jax.lax.scan(body, init, jnp.arange(steps))[1]

    return jax.jit(run)


SHORT = _trajectories(60)
LONG = _trajectories(1000)
magnitudes = st.floats(2.0**-14, 8.0, width=32)  # small ones cross zero in 60 steps
signs = st.lists(st.booleans(), min_size=N, max_size=N)


def _params(mags, negative):
    x = np.asarray(mags, np.float32) * np.where(negative, -1, 1).astype(np.float32)
    return jnp.asarray(x).astype(jnp.bfloat16)


@given(st.lists(magnitudes, min_size=N, max_size=N), signs, st.integers(0, 2**31 - 1))
def test_remainder_masters_are_float32_masters_bit_for_bit(mags, negative, seed):
    same_master, same_param, _ = SHORT(_params(mags, negative), jax.random.key(seed))
    assert bool(same_master.all()), int(np.argmin(same_master))
    assert bool(same_param.all())  # bf16 params equal today's but at exact ties


@pytest.mark.slow  # 1,000 steps per draw
@given(st.lists(magnitudes, min_size=N, max_size=N), signs, st.integers(0, 2**31 - 1))
def test_remainder_masters_are_float32_masters_over_1000_steps(mags, negative, seed):
    same_master, same_param, ties = LONG(_params(mags, negative), jax.random.key(seed))
    assert bool(same_master.all()) and bool(same_param.all())



def test_remainder_a_huge_step_lands_exactly_with_float32_updates():
    opt = mpfunc.master_weights(optax.sgd(1.0), storage="remainder")
    params = {"w": jnp.array([1.0, -1.0, 3.0, 0.5, 1e-30], jnp.bfloat16)}
    g = {"w": jnp.array([0.999, -0.999, 3.001, -1000.0, 1e30], jnp.float32)}
    u, state = jax.jit(standard(opt.update))(g, opt.init(params), params)
    assert u["w"].dtype == jnp.float32
    with jax.numpy_dtype_promotion("standard"):
        params = optax.apply_updates(params, u)
    target = np.asarray([1.0, -1.0, 3.0, 0.5, 1e-30], np.float32) - np.asarray(g["w"])
    hi, lo = R.split_remainder(target)
    np.testing.assert_array_equal(bits(params["w"]), hi)
    np.testing.assert_array_equal(np.asarray(state.remainders["w"]), lo)


def test_remainder_under_strict_promotion_a_step_that_cannot_land_saturates():
    # Strict promotion: bf16 updates. 1.0 -> 0.001 in one step: no bfloat16 update lands
    # 1.0 on bf16(0.001) (those near -0.999 are 2**-8 apart), so the param lands on 0.0
    # and the remainder holds the master's closest value beside it, never a
    # wrapped-around pattern.
    opt = mpfunc.master_weights(optax.sgd(1.0), storage="remainder")
    params = {"w": jnp.array([1.0, -1.0, 3.0, 0.5], jnp.bfloat16)}
    state = opt.init(params)
    g = {"w": jnp.array([0.999, -0.999, 3.001, -1000.0], jnp.bfloat16)}
    u, state = jax.jit(opt.update)(g, state, params)
    assert u["w"].dtype == jnp.bfloat16
    params = optax.apply_updates(params, u)
    masters = np.asarray(mpfunc._src.rounding.join_remainder(params["w"], state.remainders["w"]))
    target = np.asarray([1.0, -1.0, 3.0, 0.5], np.float32) - np.asarray(g["w"], np.float32)
    ref = R.remainder_against(target, bits(params["w"]))
    np.testing.assert_array_equal(np.asarray(state.remainders["w"]), ref)
    assert np.isfinite(masters).all()
    # The master is within half a spacing of the landed param, as close to the target as
    # that allows; where the step landed (3.0 -> -0.001..., 0.5 -> 1000.5) it is exact.
    p = np.asarray(params["w"], np.float32)
    assert (np.abs(masters - target) <= np.abs(p - target) + 1e-30).all()
    # The next (zero) step keeps the param and the (saturated) master.
    u, state2 = jax.jit(opt.update)({"w": jnp.zeros(4, jnp.bfloat16)}, state, params)
    chex.assert_trees_all_equal(optax.apply_updates(params, u), params)
    chex.assert_trees_all_equal(state2.remainders, state.remainders)


def _kahan_step(p, c, g):
    opt = mpfunc.master_weights(optax.sgd(1.0), storage="kahan")
    u, s = opt.update(g, opt.init(p)._replace(compensation=c), p)
    return optax.apply_updates(p, u), s.compensation


KAHAN_STEP = jax.jit(standard(_kahan_step))  # compiles once per dtype
KAHAN_STRICT = jax.jit(_kahan_step)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@given(st.lists(st.floats(2.0**-10, 4, width=16), min_size=N, max_size=N), signs,
       st.lists(st.floats(-1, 1, width=32), min_size=N, max_size=N),
       st.lists(st.floats(-2.0**-10, 2.0**-10, width=32, allow_subnormal=False),
                min_size=N, max_size=N))
def test_kahan_matches_the_numpy_reference(dtype, ps, negative, cs, us):
    # No float32 subnormals: XLA on CPU flushes them to zero (NumPy and torch do not).
    jd = jnp.dtype(dtype)
    p = _params(ps, negative).astype(jnp.float32).astype(jd)
    c = (jnp.asarray(np.asarray(cs, np.float32)) * jnp.abs(p.astype(jnp.float32)) * 2**-8).astype(jd)
    u = np.asarray(us, np.float32)
    p2, c2 = KAHAN_STEP(p, c, jnp.asarray(-u).astype(jnp.float32))
    rp, rc = R.kahan_update(bits(p), bits(c), u, dtype=dtype)
    np.testing.assert_array_equal(bits(p2), rp)
    np.testing.assert_array_equal(bits(c2), rc)
    # Strict promotion (updates in the param's dtype): the same wherever the param is at
    # least 2**-2 (the step, below 2**-10, then lands); elsewhere the compensation holds
    # what the landing missed, so param + compensation stays the reference's to within
    # the compensation's own rounding.
    p3, c3 = KAHAN_STRICT(p, c, jnp.asarray(-u).astype(jnp.float32))
    big = np.abs(np.asarray(p, np.float32)) >= 0.25
    np.testing.assert_array_equal(bits(p3)[big], rp[big])
    total = np.asarray(p3, np.float32) + np.asarray(c3, np.float32)
    ref = (np.asarray(p2, np.float32) + np.asarray(c2, np.float32))
    assert (np.abs(total - ref) <= np.abs(np.asarray(c2, np.float32)) * 2**-7 + 2**-24).all()


def test_kahan_beats_plain_bfloat16_params_on_a_small_model():
    # Least squares on bf16 params, Adam at a learning rate whose steps are mostly
    # below half a bfloat16 spacing of the weights: plain bf16 stalls, Kahan does not.
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)
    w_true = jnp.asarray(rng.uniform(2, 4, (32, 1)), jnp.float32)
    y = x @ w_true
    w0 = {"w": (w_true + 0.05 * jnp.asarray(rng.standard_normal((32, 1)), jnp.float32))
          .astype(jnp.bfloat16)}

    def loss(p):
        return jnp.mean(jnp.square(x @ p["w"].astype(jnp.float32) - y))

    def train(opt, steps=300):
        @jax.jit
        def step(p, s):
            g = jax.grad(loss)(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s
        p, s = w0, opt.init(w0)
        for _ in range(steps):
            p, s = step(p, s)
        return float(loss(p))

    plain = train(mpfunc.state_dtype(adam(1e-4), "float32"))  # f32 Adam, bf16 params
    kahan = train(mpfunc.master_weights(adam(1e-4), storage="kahan"))
    masters = train(mpfunc.master_weights(adam(1e-4)))
    assert kahan < 0.5 * plain, (kahan, plain)
    assert abs(kahan - masters) < 0.1 * masters + 1e-4, (kahan, masters)


SR_STEP = jax.jit(standard(lambda p, s, g: mpfunc.master_weights(
    optax.sgd(1.0), "stochastic").update(g, s, p)))  # the seed is the state's


def test_stochastic_bits_are_the_numpy_reference_bits():
    # Every element, those crossing zero included: the params land exactly.
    opt = mpfunc.master_weights(optax.sgd(1.0), storage="stochastic", seed=1234)
    rng = np.random.default_rng(1)
    p = jnp.asarray(rng.standard_normal((16, 24)).astype(np.float32)).astype(jnp.bfloat16)
    state = opt.init({"w": p})
    params = {"w": p}
    for step in range(3):
        g = rng.standard_normal((16, 24)).astype(np.float32) * 1e-3
        u, state = SR_STEP(params, state, {"w": jnp.asarray(g)})
        target = np.asarray(params["w"], np.float32) - g
        with jax.numpy_dtype_promotion("standard"):
            params = optax.apply_updates(params, u)
        want = R.stochastic_round_bf16(target.reshape(-1), R.random_bits(
            1234, 0, step, np.arange(target.size))).reshape(target.shape)
        np.testing.assert_array_equal(bits(params["w"]), want)
    assert int(state.step) == 3 and int(state.seed) == 1234


def test_stochastic_rounding_is_unbiased_over_a_million_draws():
    # 10**6 elements at 1 + 2**-10 + 1e-4 (about 0.14 of the way to the next bfloat16).
    opt = mpfunc.master_weights(optax.sgd(1.0), storage="stochastic", seed=5)
    p = {"w": jnp.ones((1000, 1000), jnp.bfloat16)}
    u, _ = jax.jit(opt.update)({"w": jnp.full((1000, 1000), -(2**-10 + 1e-4))},
                               opt.init(p), p)
    got = np.asarray(optax.apply_updates(p, u)["w"], np.float64)
    err = got - float(np.float32(1.0) + np.float32(2**-10 + 1e-4))
    assert set(np.unique(got)) == {1.0, 1.0 + 2**-7}
    assert abs(err.mean()) < 4 * err.std() / np.sqrt(err.size)


def test_sharded_params_round_with_the_same_bits_as_unsharded_ones():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    opt = mpfunc.dynamic_scale(mpfunc.master_weights(
        mpfunc.state_dtype(adam(1e-2), "bfloat16", seed=3), storage="stochastic", seed=9))
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.standard_normal((64, 24)), jnp.bfloat16),
              "b": jnp.asarray(rng.standard_normal((24,)), jnp.bfloat16)}
    grads = [jax.tree.map(lambda p, i=i: jnp.asarray(
        rng.standard_normal(p.shape), p.dtype), params) for i in range(3)]

    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def run(p, s, place):
        f = jax.jit(step, out_shardings=place) if place else jax.jit(step)
        for g in grads:
            p, s = f(p, s, g)
        return p, s

    want = run(params, opt.init(params), None)
    sharded = jax.device_put(params, {"w": NamedSharding(mesh, P("x", None)),
                                      "b": NamedSharding(mesh, P("x"))})
    shardings = mpfunc.state_sharding(opt, sharded)
    state = jax.jit(opt.init, out_shardings=shardings)(sharded)
    got = run(sharded, state, (jax.tree.map(lambda a: a.sharding, sharded), shardings))
    chex.assert_trees_all_equal(jax.device_get(got), jax.device_get(want))
    assert got[0]["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("x", None)), 2)
    mu = got[1].inner_state.inner_state.inner_state[0].mu["w"]
    assert mu.dtype == jnp.bfloat16 and mu.sharding.is_equivalent_to(
        NamedSharding(mesh, P("x", None)), 2)


@pytest.mark.parametrize("storage", ["remainder", "kahan", "stochastic"])
def test_a_skipped_step_keeps_everything_bit_for_bit(storage):
    opt = mpfunc.dynamic_scale(mpfunc.master_weights(
        mpfunc.state_dtype(adam(1e-2), "bfloat16", seed=1), storage=storage), preset="naive",
        init_scale=2.0**4, hysteresis=1)
    params = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4).astype(jnp.bfloat16),
              "n": jnp.ones((4,), jnp.float32)}
    state = opt.init(params)
    step = jax.jit(opt.update)
    for i in range(3):  # some history: nonzero remainders, compensation, moments
        g = jax.tree.map(lambda p, i=i: jnp.full_like(p, 2.0**4 * (0.3 + i)), params)
        u, state = step(g, state, params)
        params = optax.apply_updates(params, u)
    poisoned = jax.tree.map(lambda p: jnp.full_like(p, 1.0).at[0].set(jnp.inf), params)
    u, state2 = step(poisoned, state, params)
    chex.assert_trees_all_equal(optax.apply_updates(params, u), params)
    chex.assert_trees_all_equal(state2.inner_state, state.inner_state)
    assert int(state2.skipped_steps) == int(state.skipped_steps) + 1


@pytest.mark.parametrize("storage", ["remainder", "kahan", "stochastic"])
def test_a_resumed_run_continues_bit_for_bit_and_donation_works(storage):
    opt = mpfunc.master_weights(mpfunc.state_dtype(adam(1e-2), "bfloat16", seed=2),
                                storage=storage, seed=7 if storage == "stochastic" else 0)
    params = {"w": jnp.linspace(-2, 2, 40, dtype=jnp.float32).reshape(5, 8).astype(jnp.bfloat16)}

    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    grads = [{"w": jnp.full((5, 8), 0.1 * (i + 1), jnp.bfloat16)} for i in range(6)]
    state = opt.init(params)
    assert_own_buffers(params, state)
    f = jax.jit(step)
    p, s = params, state
    for g in grads:
        p, s = f(p, s, g)
    # Three steps, a checkpoint (host copies), then three more from the restored state.
    q, t = params, state
    for g in grads[:3]:
        q, t = f(q, t, g)
    q, t = jax.tree.map(jnp.asarray, jax.device_get((q, t)))
    donated = jax.jit(step, donate_argnums=(0, 1))
    for g in grads[3:]:
        q, t = donated(q, t, g)
    chex.assert_trees_all_equal((q, t), (p, s))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"`storage` must be one of .*got 'remaindr' "
                                         r"\(did you mean `remainder`\?\)"):
        mpfunc.master_weights(optax.sgd(1.0), storage="remaindr")
    with pytest.raises(ValueError, match=r"`seed=3` has no effect with storage='kahan'"):
        mpfunc.master_weights(optax.sgd(1.0), storage="kahan", seed=3)
    for storage in ["remainder", "stochastic"]:
        opt = mpfunc.master_weights(optax.sgd(1.0), storage=storage)
        with pytest.raises(ValueError, match=r"`params\['w'\]` of dtype float16 cannot use "
                                             f"storage '{storage}'"):
            opt.init({"w": jnp.ones(2, jnp.float16)})
    opt = mpfunc.master_weights(optax.sgd(1.0), storage="kahan")
    state = opt.init({"w": jnp.ones(2, jnp.float16)})  # float16 Kahan is supported
    with pytest.raises(ValueError, match="`params` is required"):
        opt.update({"w": jnp.ones(2, jnp.float16)}, state)


def test_state_dtypes_and_non_float_leaves():
    params = {"w": jnp.ones((2, 3), jnp.bfloat16), "s": jnp.ones(3), "i": jnp.arange(2)}
    rem = mpfunc.master_weights(optax.sgd(1.0), storage="remainder").init(params)
    assert rem.remainders["w"].dtype == jnp.int16 and rem.remainders["s"] is None
    kah = mpfunc.master_weights(optax.sgd(1.0), storage="kahan").init(params)
    assert kah.compensation["w"].dtype == jnp.bfloat16 and kah.compensation["i"] is None
    sto = mpfunc.master_weights(optax.sgd(1.0), storage="stochastic", seed=2**32 - 1).init(params)
    assert sto.seed.dtype == jnp.uint32 and int(sto.seed) == 2**32 - 1
    # float32 and integer leaves pass through: the float32 one gets the inner's update.
    u, _ = mpfunc.master_weights(lenient(optax.sgd(0.5)), storage="remainder").update(
        jax.tree.map(jnp.ones_like, params), rem, params)
    assert u["s"].dtype == jnp.float32 and float(u["s"][0]) == -0.5


def test_bytes_per_parameter_measured_from_the_buffers():
    # An MLP big enough that the scalars (counts, seed, step, loss scale) are noise.
    rng = np.random.default_rng(0)
    params = {f"l{i}": {"w": jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16),
                        "b": jnp.zeros((256,), jnp.bfloat16)} for i in range(3)}
    n = sum(x.size for x in jax.tree.leaves(params))

    def per_param(opt, p=params):
        state = jax.eval_shape(opt.init, p)
        leaves = jax.tree.leaves(p) + jax.tree.leaves(state)
        return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves) / n

    f32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    got = {
        "float32 params, Adam": per_param(optax.adam(1e-3), f32),
        "float32 masters": per_param(mpfunc.dynamic_scale(mpfunc.master_weights(optax.adam(1e-3)))),
        "remainder + bf16": per_param(mpfunc.master_weights(
            mpfunc.state_dtype(optax.adam(1e-3), "bf16"), "remainder")),
        "kahan + bf16": per_param(mpfunc.master_weights(
            mpfunc.state_dtype(optax.adam(1e-3), "bf16"), "kahan")),
        "stochastic + bf16": per_param(mpfunc.master_weights(
            mpfunc.state_dtype(optax.adam(1e-3), "bf16"), "stochastic")),
        "stochastic + 8-bit": per_param(mpfunc.master_weights(
            mpfunc.state_dtype(optax.adam(1e-3), "float8_e4m3fn"), "stochastic")),
    }
    assert 12 <= got["float32 params, Adam"] < 12.01
    assert 14 <= got["float32 masters"] < 14.01
    assert got["remainder + bf16"] <= 8.1 and got["kahan + bf16"] <= 8.1
    assert got["stochastic + bf16"] <= 6.1
    assert got["stochastic + 8-bit"] <= 4.1


def _found(state, kind):
    return next(x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind))
                if isinstance(x, kind))


@pytest.mark.parametrize("storage", ["float32", "remainder", "kahan", "stochastic"])
@pytest.mark.parametrize("through", ["convert_to_amp", "dynamic_scale"])
def test_a_loss_scale_around_a_storage_passes_its_float32_updates_on(storage, through):
    # The loss-scale transform cast every update to its param's dtype, so a step that
    # carries a param past zero or shrinks it by more than half (a bias near zero under
    # Adam) landed one rounding off and the remainder saturated: the run left float32
    # masters' trajectory (and float32 masters' own params landed off their rounded
    # masters). Under standard promotion the float32 updates pass through, and land
    # where float32 masters' do.
    def build(storage):
        sgd = optax.sgd(0.3)  # float32 steps from bfloat16 gradients, as Adam's are
        if through == "convert_to_amp":
            return mpfunc.convert_to_amp(lambda p, x: x, sgd, mode="bf16",
                                         master_weights=storage).optimizer
        return mpfunc.dynamic_scale(mpfunc.master_weights(sgd, storage=storage))

    params = {"w": jnp.asarray([0.00274658203125, -0.0091552734375, -0.0096435546875,
                                0.006256103515625], jnp.bfloat16)}  # exact bfloat16s
    # Steps the size of the params: rounded to bfloat16 and added in bfloat16, three of
    # the four land off their targets.
    g = jnp.asarray([0.01013, -0.03223, -0.04042, 0.02759], jnp.bfloat16)

    def step(tx):
        state = tx.init(params)
        grads = {"w": g * mpfunc.loss_scale(state).astype(jnp.bfloat16)}  # scaled loss's
        u, state = jax.jit(standard(tx.update))(grads, state, params)
        with jax.numpy_dtype_promotion("standard"):
            return u, optax.apply_updates(params, u), state

    u, new, state = step(build(storage))
    assert u["w"].dtype == jnp.float32
    master = np.asarray(_found(step(build("float32"))[2], MasterWeightsState)
                        .master_params["w"])
    if storage == "float32":  # the params are the masters rounded to nearest, as torch's
        np.testing.assert_array_equal(bits(new["w"]), bits(master.astype(jnp.bfloat16)))
    elif storage == "remainder":
        joined = R.join_remainder(bits(new["w"]), _found(state, RemainderState)
                                  .remainders["w"])
        np.testing.assert_array_equal(R.f32_bits(joined), R.f32_bits(master))
    elif storage == "kahan":
        np.testing.assert_array_equal(bits(new["w"]), bits(master.astype(jnp.bfloat16)))
    else:  # stochastic: one of the two bfloat16 neighbours of the master
        toward_zero = (R.f32_bits(master) >> 16).astype(np.uint16)
        assert np.isin(bits(new["w"]) - toward_zero, [0, 1]).all()


def test_eager_calls_compile_one_program_per_function_and_traced_ones_inline():
    # Outside jit, master_weights (each storage) and state_dtype run their work on the
    # leaves as one program each (mpfunc/_src/eager_jit.py), not one per op and leaf
    # shape; under jit nothing of it is a nested call: the step is one program, as before.
    from jax import monitoring

    compiles = []

    def count(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    monitoring.register_event_duration_secs_listener(count)
    params = {f"w{i}": jnp.full((3 + i, 5), 0.5, jnp.bfloat16) for i in range(6)}
    grads = jax.tree.map(jnp.ones_like, params)
    tx = mpfunc.master_weights(mpfunc.state_dtype(optax.sgd(1e-3, momentum=0.9),
                                                  "bfloat16"), storage="remainder")
    try:
        with jax.numpy_dtype_promotion("standard"):
            state = tx.init(params)
            tx.update(grads, state, params)  # warms up optax's own eager ops
            n = len(compiles)
            params2 = {k: v[:, :4] for k, v in params.items()}  # new shapes: compiled anew
            grads2 = jax.tree.map(jnp.ones_like, params2)
            state2 = tx.init(params2)
            tx.update(grads2, state2, params2)
            ours_and_optax = len(compiles) - n
    finally:
        monitoring.unregister_event_duration_listener(count)
    with jax.numpy_dtype_promotion("standard"):
        jaxpr = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(grads2, state2, params2)
    # 248 compiles for the 6 new leaf shapes with every op eager (measured); 49 now: 5
    # programs of ours (init: the state's encoding; update: join, decode, encode, steps)
    # beside optax's own eager ops.
    assert ours_and_optax < 60, ours_and_optax
    assert "eager_" not in str(jaxpr)
