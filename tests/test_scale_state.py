"""Tests for mpfunc._src.scale_state: metrics and the consecutive-skip counter (against
optax.apply_if_finite), and value_and_grad (against flax's DynamicScale)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from lenient import adam, lenient

import mpfunc

INT32_MAX = 2**31 - 1


# --- optax.apply_if_finite's behaviour, and where we differ on purpose ------------------
# optax's own tests (transforms/_conditionality_test.py) are not installed; these check
# what they check: params move only on finite steps, and the counters.

SEQ = [1.0, jnp.nan, jnp.inf, 1.0, jnp.nan, jnp.nan, jnp.nan, 1.0, -jnp.inf]


def test_counters_match_optax_apply_if_finite():
    params = {"w": jnp.ones((3,))}
    ours = mpfunc.no_scale(optax.sgd(0.5))
    theirs = lenient(optax.apply_if_finite(optax.sgd(0.5), max_consecutive_errors=100))
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    p_ours = p_theirs = params
    for v in SEQ:
        g = {"w": jnp.array([1.0, v, 2.0])}
        u, s_ours = jax.jit(ours.update)(g, s_ours, p_ours)
        p_ours = optax.apply_updates(p_ours, u)
        u, s_theirs = jax.jit(theirs.update)(g, s_theirs, p_theirs)
        p_theirs = optax.apply_updates(p_theirs, u)
        chex.assert_trees_all_equal(p_ours, p_theirs)
        m = mpfunc.scale_metrics(s_ours)
        assert int(m["consecutive_skips"]) == int(s_theirs.notfinite_count)
        assert int(m["skipped_steps"]) == int(s_theirs.total_notfinite)
        assert bool(m["last_finite"]) == bool(s_theirs.last_finite)
    assert int(m["consecutive_skips"]) == 1 and int(m["skipped_steps"]) == 6


def test_we_never_give_up_and_apply_a_bad_update():
    # optax applies the update after max_consecutive_errors skips (NaN params); we keep
    # skipping, and the counter says how long the run has been stuck.
    params = {"w": jnp.ones((2,))}
    ours = mpfunc.no_scale(optax.sgd(0.5))
    theirs = lenient(optax.apply_if_finite(optax.sgd(0.5), max_consecutive_errors=3))
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    p_ours = p_theirs = params
    for _ in range(6):
        g = {"w": jnp.full((2,), jnp.nan)}
        u, s_ours = ours.update(g, s_ours, p_ours)
        p_ours = optax.apply_updates(p_ours, u)
        u, s_theirs = theirs.update(g, s_theirs, p_theirs)
        p_theirs = optax.apply_updates(p_theirs, u)
    assert bool(jnp.isnan(p_theirs["w"]).all())
    chex.assert_trees_all_equal(p_ours, params)
    assert int(mpfunc.scale_metrics(s_ours)["consecutive_skips"]) == 6


def test_consecutive_skips_saturates():
    opt = mpfunc.dynamic_scale()
    state = opt.init({})._replace(consecutive_skips=jnp.int32(INT32_MAX - 1),
                                  skipped_steps=jnp.int32(INT32_MAX - 1))
    bad = {"g": jnp.array(jnp.inf)}
    for _ in range(3):
        _, state = jax.jit(opt.update)(bad, state)
    assert int(state.consecutive_skips) == INT32_MAX and int(state.skipped_steps) == INT32_MAX
    _, state = opt.update({"g": jnp.array(1.0)}, state)
    assert int(state.consecutive_skips) == 0 and int(state.skipped_steps) == INT32_MAX


def test_stop_after_n_skips_in_a_row_recipe():
    # The README's recipe: read the counter when logging; stop past a limit.
    params = {"w": jnp.ones((2,))}
    opt = mpfunc.dynamic_scale(optax.sgd(0.1))
    state = opt.init(params)
    step = jax.jit(opt.update)
    stopped_at = None
    for i in range(40):
        g = {"w": jnp.full((2,), jnp.inf if i >= 10 else 1.0)}  # stuck from step 10 on
        _, state = step(g, state, params)
        if i % 5 == 4 and int(mpfunc.scale_metrics(state)["consecutive_skips"]) >= 20:
            stopped_at = i
            break
    assert stopped_at == 29


# --- flax's DynamicScale: same decisions, unscaled values, growth one step apart -------

def f16_square(p):
    return jnp.asarray(p, jnp.float16) ** 2  # flax's own example / test loss


def test_value_and_grad_against_flax_dynamic_scale():
    from flax.training.dynamic_scale import DynamicScale

    p = jnp.array(1.0, jnp.float32)
    ds = DynamicScale(growth_interval=2, scale=jnp.float32(65536.0))

    @jax.jit
    def flax_step(ds, p):
        with jax.numpy_dtype_promotion("standard"):  # flax multiplies f32 by f16
            return ds.value_and_grad(f16_square)(p)
    # flax 0.12.8 grows after growth_interval + 1 clean steps (fin_steps is compared
    # before it is incremented); mpfunc follows torch: after growth_interval.
    opt = mpfunc.dynamic_scale(optax.sgd(0.0), growth_interval=3, min_scale=2.0**-126)
    state = opt.init(p)

    @jax.jit
    def our_step(state, p):
        out = mpfunc.value_and_grad(f16_square)(state, p)
        _, state = opt.update(out, state, p)
        return out, state

    for _ in range(12):
        ds, is_fin, loss, grad = flax_step(ds, p)
        out, state = our_step(state, p)
        assert bool(out.finite) == bool(is_fin)
        assert float(mpfunc.loss_scale(state)) == float(ds.scale)
        if bool(is_fin):  # flax divides the scaled loss back; ours is fun's own value
            assert float(out.value) == float(loss) == 1.0
            assert float(out.grads) == float(grad) == 2.0
            assert out.grads.dtype == jnp.float32 and out.value.dtype == jnp.float16


@functools.cache
def _flax_and_ours(k):
    from flax.training.dynamic_scale import DynamicScale

    opt = mpfunc.dynamic_scale(growth_interval=k + 1, min_scale=2.0**-126)

    @jax.jit
    def run(seq):
        def body(carry, finite):
            ds, state = carry
            bad = jnp.where(finite, jnp.float32(1.0), jnp.float32(jnp.inf))
            ds = ds.value_and_grad(lambda x: x * bad)(jnp.float32(1.0)).dynamic_scale
            _, state = opt.update({"g": jnp.float32(1.0) * bad}, state)
            return (ds, state), (ds.scale, state.loss_scale)

        ds = DynamicScale(growth_interval=k, scale=jnp.float32(65536.0),
                          fin_steps=jnp.int32(0))
        return jax.lax.scan(body, (ds, opt.init({})), seq)[1]

    return run


@given(st.lists(st.booleans(), min_size=1, max_size=40), st.integers(1, 4))
def test_flax_growth_interval_k_is_ours_k_plus_1(seq, k):
    n = len(seq)
    theirs, ours = _flax_and_ours(k)(jnp.asarray(list(seq) + [True] * (40 - n)))
    np.testing.assert_array_equal(np.asarray(ours)[:n].view(np.uint32),
                                  np.asarray(theirs, np.float32)[:n].view(np.uint32))


@functools.cache
def _flax_run_and_migrated(k):
    """flax's DynamicScale deciding the skips of a plain optax step, and the same run
    moved to mpfunc mid-way (its state carried over, README)."""
    from flax.training.dynamic_scale import DynamicScale

    tx = adam(0.1)
    opt = mpfunc.dynamic_scale(tx, growth_interval=k + 1, min_scale=2.0**-126)
    loss = lambda p, bad: jnp.sum((p["w"] * 3.0 - 1.0) ** 2) * bad  # noqa: E731

    # Gradients and updates are compiled apart on both sides, so that XLA fuses the two
    # updates alike. flax's own `where(fin, new, old)` over params and state moves the
    # update off the bare optimizer's by an ulp on CPU, so the reference takes or drops
    # the bare update on flax's decision instead.
    @jax.jit
    def flax_grads(p, ds, bad):
        with jax.numpy_dtype_promotion("standard"):  # flax mixes Python floats and int32
            ds, fin, _, g = ds.value_and_grad(loss)(p, bad)
        return g, ds, fin

    @functools.partial(jax.jit, static_argnums=0)
    def apply(tx, g, state, p):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    def flax_step(p, opt_state, ds, bad):
        g, ds, fin = flax_grads(p, ds, bad)
        return *apply(tx, g, opt_state, p), ds, fin

    def our_step(p, state, bad):
        return apply(opt, our_grads(state, p, bad), state, p)

    our_grads = jax.jit(mpfunc.value_and_grad(loss))

    def start(p):
        return tx.init(p), DynamicScale(growth_interval=k, scale=jnp.float32(2.0**15),
                                        fin_steps=jnp.int32(0))

    return start, flax_step, our_step, opt


@given(st.lists(st.booleans(), max_size=12), st.lists(st.booleans(), min_size=1, max_size=12),
       st.integers(1, 3))
def test_a_flax_dynamic_scale_run_moves_over_bit_for_bit(before, after, k):
    start, flax_step, our_step, opt = _flax_run_and_migrated(k)
    bad = lambda ok: jnp.float32(1.0 if ok else jnp.inf)  # noqa: E731

    def flax_run(p, opt_state, ds, ok):
        new_p, new_opt, ds, fin = flax_step(p, opt_state, ds, bad(ok))
        assert bool(fin) == ok
        return (new_p, new_opt, ds) if ok else (p, opt_state, ds)

    p = {"w": jnp.linspace(-1.0, 1.0, 5)}
    opt_state, ds = start(p)
    for ok in before:
        p, opt_state, ds = flax_run(p, opt_state, ds, ok)
    # The move: the optax state becomes the inner state, the scale and flax's fin_steps
    # the loss scale and growth tracker (with growth_interval=k + 1, see above).
    state = opt.init(p)._replace(loss_scale=ds.scale, growth_tracker=ds.fin_steps,
                                 inner_state=opt_state)
    q = p
    for ok in after:
        p, opt_state, ds = flax_run(p, opt_state, ds, ok)
        q, state = our_step(q, state, bad(ok))
        assert np.asarray(state.loss_scale).view(np.uint32) == np.asarray(ds.scale).view(
            np.uint32)
        np.testing.assert_array_equal(np.asarray(q["w"]).view(np.uint32),
                                      np.asarray(p["w"]).view(np.uint32))
    chex.assert_trees_all_equal(state.inner_state, opt_state)


class TestValueAndGrad:
    def test_argnums_and_has_aux(self):
        state = mpfunc.static_scale(2.0**10).init({})

        def fun(a, b, c):
            return jnp.sum(a * b) + c, {"aux": a}

        a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, -4.0])
        out = mpfunc.value_and_grad(fun, argnums=(0, 1), has_aux=True)(state, a, b, 0.5)
        (loss, aux), (ga, gb) = out.value, out.grads
        assert float(loss) == -4.5 and aux["aux"] is not None
        np.testing.assert_array_equal(ga, b)
        np.testing.assert_array_equal(gb, a)
        assert bool(out.finite)

    def test_update_takes_the_result_and_skips_exactly(self):
        params = {"w": jnp.array([1.0, -0.0])}
        opt = mpfunc.dynamic_scale(adam(0.1), growth_interval=2)
        state = opt.init(params)

        @jax.jit
        def step(params, state, bad):
            out = mpfunc.value_and_grad(lambda p: jnp.sum(p["w"] ** 2) * bad)(state, params)
            updates, state = opt.update(out, state, params)
            return optax.apply_updates(params, updates), state, out.finite

        p1, s1, fin = step(params, state, jnp.float32(1.0))
        assert bool(fin) and float(p1["w"][0]) == pytest.approx(0.9, rel=1e-5)
        p2, s2, fin = step(p1, s1, jnp.float32(jnp.inf))
        assert not bool(fin)
        np.testing.assert_array_equal(np.asarray(p2["w"]).view(np.uint32),
                                      np.asarray(p1["w"]).view(np.uint32))
        chex.assert_trees_all_equal(s2.inner_state, s1.inner_state)
        assert float(s2.loss_scale) == 2.0**15 and int(s2.consecutive_skips) == 1

    def test_helper_and_scale_loss_paths_agree(self):
        params = {"w": jnp.linspace(-1.0, 1.0, 5)}
        opt = mpfunc.dynamic_scale(adam(0.1), init_scale=3.0 * 2**10)  # not a power of 2
        state = opt.init(params)
        loss = lambda p: jnp.sum(jnp.sin(p["w"]) ** 2)  # noqa: E731
        out = mpfunc.value_and_grad(loss)(state, params)
        u1, s1 = opt.update(out, state, params)
        scaled = jax.grad(lambda p: mpfunc.scale_loss(loss(p), state))(params)
        u2, s2 = opt.update(scaled, state, params)
        chex.assert_trees_all_equal((u1, s1), (u2, s2))

    def test_with_flax_train_state(self):
        from flax.training import train_state

        params = {"w": jnp.ones((2,))}
        ts = train_state.TrainState.create(apply_fn=None, params=params,
                                           tx=mpfunc.dynamic_scale(optax.sgd(0.5)))
        out = mpfunc.value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(ts.opt_state, ts.params)
        ts = ts.apply_gradients(grads=out)
        np.testing.assert_array_equal(ts.params["w"], 0.0)

    @pytest.mark.parametrize("mode, cfg", [("apex", {"opt_level": "O2"}), ("naive", {})])
    def test_train_state_from_create_can_be_donated(self, mode, cfg):
        # flax's pattern: TrainState.create (init outside jit), then a jitted step that
        # donates the TrainState. O2's float32 norm masters once aliased their params.
        from flax.training import train_state

        def apply(p, x):
            h = x @ p["w"]
            return (h - h.mean()) * p["LayerNorm_0"]["scale"]

        amp = mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode=mode, **cfg)
        params = amp.cast_params({"w": jnp.ones((4, 3)),
                                  "LayerNorm_0": {"scale": jnp.ones((3,))}})
        x = jnp.arange(8.0).reshape(2, 4)

        def train_step(ts):
            def loss(p):
                with jax.numpy_dtype_promotion("standard"):
                    return mpfunc.scale_loss(jnp.mean(ts.apply_fn(p, x) ** 2), ts.opt_state)
            return ts.apply_gradients(grads=jax.grad(loss)(ts.params))

        def create():
            return train_state.TrainState.create(
                apply_fn=amp.apply_fn, params=jax.tree.map(jnp.copy, params),
                tx=amp.optimizer)

        expected = jax.jit(train_step)(create())
        got = jax.jit(train_step, donate_argnums=0)(create())
        chex.assert_trees_all_equal((got.params, got.opt_state),
                                    (expected.params, expected.opt_state))

    def test_axis_name_averages_like_flax(self):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
        opt = mpfunc.dynamic_scale(optax.sgd(1.0), axis_name="data")

        def step(x):
            state = opt.init(jnp.ones(()))
            out = mpfunc.value_and_grad(lambda w, x: jnp.sum(w * x), axis_name="data")(
                state, jnp.ones(()), x)
            return out.grads[None], out.finite[None]

        # Per-shard gradients, as under pmap (with check_vma, jax already sums the
        # gradient of a replicated input).
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"),
                                  out_specs=(P("data"), P("data")), check_vma=False))
        grads, finite = f(jnp.arange(8.0))
        np.testing.assert_array_equal(grads, 3.5)  # the mean over shards
        assert np.asarray(finite).all()
        grads, finite = f(jnp.arange(8.0).at[5].set(jnp.inf))
        assert not np.asarray(finite).any()

    def test_bad_arguments(self):
        with pytest.raises(TypeError, match="`fun` must be callable"):
            mpfunc.value_and_grad(3)
        with pytest.raises(ValueError, match="exactly one LossScaleState"):
            mpfunc.value_and_grad(jnp.sum)(optax.sgd(1.0).init({}), jnp.ones(2))


def test_metrics_keys():
    m = mpfunc.scale_metrics(mpfunc.dynamic_scale().init({}))
    assert sorted(m) == ["consecutive_skips", "last_finite", "loss_scale", "skipped_steps"]
    assert m["consecutive_skips"].dtype == jnp.int32
