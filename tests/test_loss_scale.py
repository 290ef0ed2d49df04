"""Tests for mpfunc._src.loss_scale: the rule, the transforms, sharding, multi-process."""

import functools
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from anchors import apex_loss_scaler, assert_matches_anchor, megatron_scaler, torch_gradscaler
from donation import assert_own_buffers
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from lenient import adam, lenient

import mpfunc
from _mpfunc_common.scale_config import resolve_scale_config
from mpfunc._src.scale_transform import _scale_transform

MAX_STEPS = 128  # keeps every reference scale a normal float32 (see the apex note)


def _scan_scales(opt):
    """A jitted run of ``opt`` over a boolean sequence: the scale after each step."""
    params = {"a": jnp.ones((3,), jnp.float32), "b": jnp.ones((2,), jnp.float16)}

    @jax.jit
    def run(seq):
        def body(state, finite):
            bad = jnp.where(finite, jnp.float32(1.0), jnp.float32(jnp.inf))
            grads = {"a": jnp.ones((3,), jnp.float32) * bad, "b": jnp.ones((2,), jnp.float16)}
            _, state = opt.update(grads, state, params)
            return state, state.loss_scale

        return jax.lax.scan(body, opt.init(params), seq)[1]

    return run


@functools.cache
def _cached_run(kwargs):
    return _scan_scales(mpfunc.dynamic_scale(**dict(kwargs)))


def trajectory(opt, finite_seq):
    """Scale after each step of ``opt`` fed a 2-leaf gradient, inf where not finite.

    ``opt`` is a transformation, or a dict of `dynamic_scale` keywords (compiled once per
    distinct dict, which keeps the hypothesis tests fast).
    """
    run = _cached_run(tuple(sorted(opt.items()))) if isinstance(opt, dict) else _scan_scales(opt)
    n = len(finite_seq)
    seq = jnp.asarray(list(finite_seq) + [True] * (MAX_STEPS - n))
    return np.asarray(run(seq))[:n]


seqs = st.lists(st.booleans(), min_size=1, max_size=MAX_STEPS)


def assert_bitwise(ours, ref):
    ref = np.asarray(ref, np.float32)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


class TestAnchors:
    @given(seqs, st.integers(1, 6))
    def test_torch_gradscaler(self, seq, interval):
        ours = trajectory(dict(preset="torch", growth_interval=interval), seq)
        assert_matches_anchor(ours, torch_gradscaler(seq, interval=interval))

    @given(seqs, st.integers(1, 6))
    def test_torch_gradscaler_with_the_smallest_floor(self, seq, interval):
        # min_scale=2**-126: GradScaler's trajectory exactly, down to the smallest normal.
        opt = dict(growth_interval=interval, min_scale=2.0**-126)
        assert_matches_anchor(trajectory(opt, seq), torch_gradscaler(seq, interval=interval),
                              floor=2.0**-126)

    @given(seqs)
    def test_torch_preset_defaults(self, seq):
        assert_matches_anchor(trajectory({}, seq), torch_gradscaler(seq))

    def test_long_overflow_runs_stop_at_the_floor(self):
        # 142 overflows from 2**16 took the old, unfloored rule to exactly 0 on CPU.
        for init, floor in ((2.0**16, 1.0), (2.0**-90, 2.0**-126)):
            opt = mpfunc.dynamic_scale(init_scale=init, min_scale=floor)
            ours = trajectory(opt, [False] * 120)
            assert ours.min() == np.float32(floor) and ours[-1] == np.float32(floor)

    @given(seqs, st.integers(1, 6), st.sampled_from([None, 1.0, 2.0**-3, 2.0**10]),
           st.sampled_from([2.0**24, 2.0**17, 2.0**14]))
    def test_apex_loss_scaler(self, seq, window, min_s, max_s):
        opt = dict(preset="apex", growth_interval=window, max_scale=max_s, min_scale=min_s)
        if min_s is not None and min_s > min(2.0**16, max_s):
            return
        ref = apex_loss_scaler(seq, min_loss_scale=min_s, max_loss_scale=max_s, window=window)
        assert_matches_anchor(trajectory(opt, seq), ref, floor=1.0 if min_s is None else min_s)

    @given(seqs)
    def test_apex_preset_defaults(self, seq):
        assert_matches_anchor(trajectory(dict(preset="apex"), seq),
                              apex_loss_scaler(seq))

    @given(seqs, st.integers(1, 6), st.integers(1, 4), st.sampled_from([1.0, 2.0**20]))
    def test_megatron_scaler(self, seq, interval, hysteresis, min_s):
        opt = dict(preset="naive", growth_interval=interval, hysteresis=hysteresis,
                   min_scale=min_s)
        ref = megatron_scaler(seq, interval=interval, hysteresis=hysteresis, min_scale=min_s)
        assert_bitwise(trajectory(opt, seq), ref)

    @given(seqs)
    def test_naive_preset_defaults(self, seq):
        assert_bitwise(trajectory(dict(preset="naive"), seq), megatron_scaler(seq))

    def test_hysteresis_refills_only_on_growth(self):
        # hysteresis 2, interval 3: F ok ok F -> the second overflow backs off because the
        # clean steps between did not reach a growth, so hysteresis was not refilled.
        opt = mpfunc.dynamic_scale(preset="naive", growth_interval=3, init_scale=2.0**10)
        ours = trajectory(opt, [False, True, True, False, True, True, True, False])
        assert list(ours) == [1024, 1024, 1024, 512, 512, 512, 1024, 1024]

    def test_torch_growth_to_inf_is_refused(self):
        opt = mpfunc.dynamic_scale(init_scale=2.0**127, growth_interval=1)
        assert list(trajectory(opt, [True, True])) == [2.0**127, 2.0**127]

    def test_non_power_of_two_factors_round_in_float32(self):
        opt = mpfunc.dynamic_scale(init_scale=3.0, growth_factor=1.1, backoff_factor=0.3,
                                   growth_interval=1, min_scale=2.0**-126)
        ours = trajectory(opt, [True, False, True])
        s = np.float32(3.0)
        expected = []
        for finite in [True, False, True]:
            s = np.float32(s * np.float32(1.1 if finite else 0.3))
            expected.append(s)
        assert_bitwise(ours, expected)


def adam_setup(inner=None, **kw):
    params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3),
              "b": jnp.zeros((3,), jnp.float32)}
    opt = mpfunc.dynamic_scale(inner if inner is not None else adam(1e-2), **kw)
    return params, opt, opt.init(params)


def loss_fn(params, x):
    return jnp.sum((x @ params["w"] + params["b"]) ** 2)


class TestWrapper:
    def test_clean_step_matches_plain_adam_on_unscaled_grads(self):
        params, opt, state = adam_setup()
        x = jnp.ones((4, 2))
        grads = jax.grad(lambda p: mpfunc.scale_loss(loss_fn(p, x), state))(params)
        updates, new_state = jax.jit(opt.update)(grads, state, params)
        ref_opt = adam(1e-2)
        ref_updates, _ = ref_opt.update(jax.grad(loss_fn)(params, x), ref_opt.init(params))
        chex.assert_trees_all_close(updates, ref_updates, rtol=1e-6)
        assert bool(new_state.last_finite)

    @pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
    def test_overflow_leaves_params_and_adam_state_bit_identical(self, bad):
        params, opt, state = adam_setup()
        step = jax.jit(lambda g, s, p: opt.update(g, s, p))
        good = jax.tree.map(lambda p: jnp.full_like(p, 3.0), params)
        for _ in range(3):  # warm the moments so that a skip is visible
            updates, state = step(good, state, params)
            params = optax.apply_updates(params, updates)
        before_params, before_inner = params, state.inner_state
        bad_grads = {"w": good["w"].at[1, 2].set(bad), "b": good["b"]}
        updates, new_state = step(bad_grads, state, params)
        new_params = optax.apply_updates(params, updates)
        chex.assert_trees_all_equal(new_params, before_params)
        chex.assert_trees_all_equal(new_state.inner_state, before_inner)
        assert float(new_state.loss_scale) == float(state.loss_scale) / 2
        assert int(new_state.skipped_steps) == 1 and not bool(new_state.last_finite)

    def test_hysteresis_absorbed_overflow_is_still_skipped(self):
        params, opt, state = adam_setup(preset="naive")
        grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
        updates, new_state = opt.update(grads, state, params)
        assert float(new_state.loss_scale) == 2.0**32  # absorbed: no backoff yet
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
        chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
        assert int(new_state.skipped_steps) == 1

    def test_updates_keep_gradient_dtype(self):
        params = {"w": jnp.ones((3,), jnp.float16)}
        opt = mpfunc.dynamic_scale(optax.sgd(0.5), init_scale=4.0)
        updates, _ = opt.update({"w": jnp.full((3,), 8.0, jnp.float16)}, opt.init(params), params)
        assert updates["w"].dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), -1.0)

    def test_non_float_leaves_pass_through(self):
        params = {"w": jnp.ones((2,)), "step": jnp.zeros((), jnp.int32)}
        opt = mpfunc.dynamic_scale(optax.identity(), init_scale=2.0)
        grads = {"w": jnp.full((2,), 4.0), "step": jnp.ones((), jnp.int32)}
        updates, state = opt.update(grads, opt.init(params), params)
        assert updates["step"].dtype == jnp.int32 and int(updates["step"]) == 1
        np.testing.assert_array_equal(updates["w"], 2.0)

    def test_select_and_cond_agree(self):
        params, _, _ = adam_setup()
        cfg_kw = dict(static_value=None, axis_name=None)
        from _mpfunc_common.scale_config import resolve_scale_config

        cfg = resolve_scale_config("torch", growth_interval=2)
        sel = _scale_transform(adam(1e-2), cfg=cfg, skip_with="select", **cfg_kw)
        cnd = _scale_transform(adam(1e-2), cfg=cfg, skip_with="cond", **cfg_kw)
        s1, s2 = sel.init(params), cnd.init(params)
        for i in range(4):
            g = jax.tree.map(lambda p, i=i: jnp.full_like(p, jnp.inf if i == 2 else 1.0), params)
            u1, s1 = jax.jit(sel.update)(g, s1, params)
            u2, s2 = jax.jit(cnd.update)(g, s2, params)
            chex.assert_trees_all_equal(u1, u2)
            chex.assert_trees_all_equal(s1, s2)

    @pytest.mark.parametrize("skip_with", ["select", "cond"])
    def test_inner_state_keeps_its_init_dtypes(self, skip_with):
        # Half params without master weights: momentum is made in float16 by init but
        # fed float32 grads; both skip implementations must keep it float16.
        from _mpfunc_common.scale_config import resolve_scale_config

        params = {"w": jnp.ones((3,), jnp.float16)}
        opt = _scale_transform(lenient(optax.sgd(0.1, momentum=0.9)),
                               cfg=resolve_scale_config("torch"), static_value=None,
                               axis_name=None, skip_with=skip_with)
        state = opt.init(params)
        traces = []

        @jax.jit
        def step(g, s):
            traces.append(1)
            return opt.update(g, s, params)

        for v in (1.0, jnp.inf, 1.0):
            _, state = step({"w": jnp.full((3,), v, jnp.float16)}, state)
        assert state.inner_state[0].trace["w"].dtype == jnp.float16
        assert len(traces) == 1

    def test_clipping_inside_sees_unscaled_grads(self):
        params, opt, state = adam_setup(
            lenient(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0))),
            init_scale=2.0**10,
        )
        x = jnp.ones((4, 2))
        grads = jax.grad(lambda p: mpfunc.scale_loss(loss_fn(p, x), state))(params)
        updates, _ = opt.update(grads, state, params)
        ref = lenient(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0)))
        ref_updates, _ = ref.update(jax.grad(loss_fn)(params, x), ref.init(params))
        chex.assert_trees_all_close(updates, ref_updates, rtol=1e-6)
        assert float(optax.tree.norm(updates)) == pytest.approx(0.5, rel=1e-5)

    def test_wrapping_multisteps_skips_only_the_bad_micro_batch(self):
        # Recommended placement: each micro-batch is unscaled with the scale it was
        # computed with, and an overflowing one is dropped before it is accumulated.
        params = {"w": jnp.ones((2,))}
        opt = mpfunc.dynamic_scale(
            lenient(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2)), growth_interval=1000
        )
        state = opt.init(params)
        step = jax.jit(opt.update)
        scale = lambda s: float(mpfunc.loss_scale(s))  # noqa: E731
        u, state = step({"w": jnp.full((2,), 1.0 * scale(state))}, state, params)
        np.testing.assert_array_equal(u["w"], 0.0)  # first micro-batch: accumulating
        u, state = step({"w": jnp.full((2,), jnp.inf)}, state, params)  # dropped
        np.testing.assert_array_equal(u["w"], 0.0)
        assert scale(state) == 2.0**15
        u, state = step({"w": jnp.full((2,), 3.0 * scale(state))}, state, params)
        np.testing.assert_array_equal(u["w"], -2.0)  # mean of the two good micro-batches
        assert int(mpfunc.scale_metrics(state)["skipped_steps"]) == 1

    def test_inside_multisteps(self):
        params, inner, _ = adam_setup(growth_interval=1)
        opt = lenient(optax.MultiSteps(inner, every_k_schedule=2))
        state = opt.init(params)
        step = jax.jit(opt.update)
        ones = jax.tree.map(jnp.ones_like, params)
        for _ in range(2):
            updates, state = step(ones, state, params)
        assert float(optax.tree.norm(updates)) > 0
        assert float(mpfunc.loss_scale(state)) == 2.0**17  # interval 1: grew once
        infs = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
        inner_before = mpfunc._src.scale_state._find_states(state)[0].inner_state
        _, state = step(ones, state, params)
        updates, state = step(infs, state, params)  # the accumulated batch overflows
        chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
        chex.assert_trees_all_equal(
            mpfunc._src.scale_state._find_states(state)[0].inner_state, inner_before)
        assert float(mpfunc.loss_scale(state)) == 2.0**16

    def test_optax_multisteps_reset_keeps_nan_after_an_overflow(self):
        # Why the wrapping placement is recommended: optax 0.2.8 resets its accumulator
        # with `(1 - emit) * acc`, and 0 * inf = nan. If optax fixes this, this test
        # fails and the README's advice can be relaxed.
        params = {"w": jnp.ones((2,))}
        opt = lenient(optax.MultiSteps(mpfunc.dynamic_scale(optax.sgd(1.0)), 2))
        state = opt.init(params)
        for v in (1.0, jnp.inf):
            _, state = opt.update({"w": jnp.full((2,), v)}, state, params)
        assert bool(jnp.isnan(state.acc_grads["w"]).all())

    def test_extra_args_reach_inner(self):
        params = {"w": jnp.ones((2,))}
        inner = lenient(optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau()))
        opt = mpfunc.dynamic_scale(inner, init_scale=1.0)
        state = opt.init(params)
        updates, state = opt.update({"w": jnp.ones((2,))}, state, params, value=jnp.float32(3.0))
        np.testing.assert_array_equal(updates["w"], -1.0)


class TestChainForm:
    def test_chain_runs_and_never_leaks_nonfinite(self):
        params = {"w": jnp.ones((3,))}
        opt = optax.chain(mpfunc.dynamic_scale(growth_interval=2), adam(1e-2))
        state = opt.init(params)
        step = jax.jit(opt.update)
        for i in range(5):
            fill = jnp.nan if i in (1, 3) else 2.0**16
            updates, state = step({"w": jnp.full((3,), fill)}, state, params)
            params = optax.apply_updates(params, updates)
            for leaf in jax.tree_util.tree_leaves((params, state, updates)):
                if jnp.issubdtype(leaf.dtype, jnp.floating):
                    assert bool(jnp.all(jnp.isfinite(leaf))), i
        assert float(mpfunc.loss_scale(state)) == 2.0**14
        assert int(mpfunc.scale_metrics(state)["skipped_steps"]) == 2

    def test_optax_chain_is_not_an_exact_skip_but_mpfunc_chain_is(self):
        params = {"w": jnp.ones((3,))}
        good, bad = {"w": jnp.full((3,), 2.0**16)}, {"w": jnp.full((3,), jnp.inf)}
        for chain_fn, exact in ((optax.chain, False), (mpfunc.chain, True)):
            opt = chain_fn(mpfunc.dynamic_scale(), adam(1e-2))
            state = opt.init(params)
            updates, state = opt.update(good, state, params)
            p1 = optax.apply_updates(params, updates)
            updates, state = opt.update(bad, state, p1)
            p2 = optax.apply_updates(p1, updates)
            assert bool(jnp.array_equal(p1["w"], p2["w"])) is exact
            assert float(mpfunc.loss_scale(state)) == 2.0**15

    def test_mpfunc_chain_errors(self):
        with pytest.raises(ValueError, match=r"`links\[1\]` is a loss-scale link"):
            mpfunc.chain(optax.sgd(1.0), mpfunc.dynamic_scale())
        with pytest.raises(ValueError, match=r"`links\[0\]` already wraps"):
            mpfunc.chain(mpfunc.dynamic_scale(optax.sgd(1.0)), optax.sgd(1.0))
        plain = mpfunc.chain(optax.sgd(1.0))
        params = {"w": jnp.ones(2)}
        u, _ = plain.update({"w": jnp.ones(2)}, plain.init(params))
        np.testing.assert_array_equal(u["w"], -1.0)


class TestStaticAndNoScale:
    def test_static_scale_unscales_and_skips(self):
        params = {"w": jnp.ones((2,))}
        opt = mpfunc.static_scale(8.0, optax.sgd(1.0))
        state = opt.init(params)
        u, state = opt.update({"w": jnp.full((2,), 16.0)}, state, params)
        np.testing.assert_array_equal(u["w"], -2.0)
        u, state = opt.update({"w": jnp.array([1.0, jnp.nan])}, state, params)
        np.testing.assert_array_equal(u["w"], 0.0)
        assert float(state.loss_scale) == 8.0 and int(state.skipped_steps) == 1

    def test_no_scale(self):
        params = {"w": jnp.ones((2,), jnp.bfloat16)}
        opt = mpfunc.no_scale(optax.sgd(1.0))
        state = opt.init(params)
        u, state = opt.update({"w": jnp.full((2,), 3.0, jnp.bfloat16)}, state, params)
        assert u["w"].dtype == jnp.bfloat16 and float(u["w"][0]) == -3.0
        u, state = opt.update({"w": jnp.array([1.0, jnp.inf], jnp.bfloat16)}, state, params)
        assert int(state.skipped_steps) == 1 and float(state.loss_scale) == 1.0

    @pytest.mark.parametrize("scale, err", [(0.0, ValueError), (-1.0, ValueError),
                                            (float("inf"), ValueError), ("8", TypeError)])
    def test_static_scale_validation(self, scale, err):
        with pytest.raises(err, match="`scale`"):
            mpfunc.static_scale(scale)


class TestState:
    def test_state_fields_and_dtypes(self):
        _, _, state = adam_setup()
        assert state._fields == ("loss_scale", "growth_tracker", "hysteresis_left",
                                 "skipped_steps", "consecutive_skips", "last_finite", "inner_state",
                                 "skip_leaves", "warm_phase")
        assert state.warm_phase is None  # only with warm_start=True (tests/test_warm_start.py)
        assert state.loss_scale.dtype == jnp.float32
        assert state.growth_tracker.dtype == jnp.int32
        assert state.hysteresis_left.dtype == jnp.int32
        assert state.skipped_steps.dtype == jnp.int32
        assert state.consecutive_skips.dtype == jnp.int32
        assert state.last_finite.dtype == jnp.bool_

    def test_jit_compiles_once_across_steps(self):
        params, opt, state = adam_setup(growth_interval=1)
        traces = []

        @jax.jit
        def step(params, state, x):
            traces.append(1)
            grads = jax.grad(lambda p: mpfunc.scale_loss(loss_fn(p, x), state))(params)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        x = jnp.ones((4, 2))
        for i in range(4):
            params, state = step(params, state, x * (jnp.inf if i == 2 else 1.0))
        assert len(traces) == 1
        init_state = opt.init(params)
        for a, b in zip(jax.tree_util.tree_leaves(init_state), jax.tree_util.tree_leaves(state)):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.weak_type == b.weak_type

    def test_hyperparameters_survive_round_trips(self, tmp_path):
        # jmp loses min_loss_scale through jit; here hyperparameters are not state at all.
        params = {"w": jnp.ones((2,))}
        opt = mpfunc.dynamic_scale(optax.sgd(1.0), preset="naive", init_scale=4.0,
                                   min_scale=2.0, hysteresis=1)
        state = opt.init(params)
        state = jax.jit(lambda s: s)(state)
        state = jax.tree.map(lambda x: x, state)
        path = tmp_path / "state.pkl"
        path.write_bytes(pickle.dumps(jax.device_get(state)))
        state = jax.tree.map(jnp.asarray, pickle.loads(path.read_bytes()))
        bad = {"w": jnp.full((2,), jnp.inf)}
        for _ in range(5):
            _, state = jax.jit(opt.update)(bad, state, params)
        assert float(state.loss_scale) == 2.0  # the floor held

    def test_flax_serialization_round_trip_continues_exactly(self):
        from flax import serialization

        params, opt, state = adam_setup(growth_interval=3)
        step = jax.jit(opt.update)
        seq = [1.0, jnp.inf, 1.0, 1.0, 1.0, jnp.inf, 1.0]
        g = lambda v: jax.tree.map(lambda p: jnp.full_like(p, v), params)  # noqa: E731
        for v in seq[:3]:
            _, state = step(g(v), state, params)
        restored = serialization.from_bytes(opt.init(params), serialization.to_bytes(state))
        a, b = state, restored
        for v in seq[3:]:
            ua, a = step(g(v), a, params)
            ub, b = step(g(v), b, params)
            chex.assert_trees_all_equal(ua, ub)
        chex.assert_trees_all_equal(a, b)


class TestFindState:
    def test_loss_scale_found_in_nested_states(self):
        params = {"w": jnp.ones((2,))}
        scaled = mpfunc.dynamic_scale(adam(1e-3), init_scale=64.0)
        variants = [
            scaled,
            optax.chain(optax.clip(1.0), optax.chain(scaled)),
            optax.MultiSteps(scaled, every_k_schedule=3),
            optax.inject_hyperparams(
                lambda learning_rate: mpfunc.dynamic_scale(optax.sgd(learning_rate),
                                                           init_scale=64.0)
            )(learning_rate=0.1),
            optax.chain(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), scaled),
        ]
        for opt in variants:
            state = opt.init(params)
            assert float(mpfunc.loss_scale(state)) == 64.0
            assert float(mpfunc.scale_loss(jnp.float16(0.5), state)) == 32.0
            metrics = mpfunc.scale_metrics(state)
            assert float(metrics["loss_scale"]) == 64.0
            assert int(metrics["skipped_steps"]) == 0 and bool(metrics["last_finite"])

    def test_scale_loss_is_float32(self):
        state = mpfunc.static_scale(2.0).init({})
        for dt in (jnp.float16, jnp.bfloat16, jnp.float32):
            assert mpfunc.scale_loss(jnp.ones((), dt), state).dtype == jnp.float32

    def test_missing_or_ambiguous_state(self):
        params = {"w": jnp.ones((2,))}
        with pytest.raises(ValueError, match="exactly one LossScaleState.*found 0"):
            mpfunc.loss_scale(adam(1e-3).init(params))
        two = optax.chain(mpfunc.no_scale(), mpfunc.no_scale()).init(params)
        with pytest.raises(ValueError, match="found 2"):
            mpfunc.scale_metrics(two)


class TestAllFinite:
    def test_basic(self):
        tree = {"a": jnp.ones(3), "i": jnp.array([1, 2]), "b": [jnp.zeros(2, jnp.float16)],
                "k": jax.random.key(0), "n": None}
        assert bool(jax.jit(mpfunc.all_finite)(tree))
        tree["b"][0] = tree["b"][0].at[1].set(jnp.nan)
        assert not bool(jax.jit(mpfunc.all_finite)(tree))
        assert bool(mpfunc.all_finite({}))

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
    @pytest.mark.parametrize("shape", [(256, 256), (1000, 37), (3, 5, 129), (7,)])
    def test_a_single_nan_or_inf_anywhere_is_seen(self, shape, dtype):
        # Why the check is any(~isfinite) and not the cheaper isfinite(max(|g|)): XLA:CPU
        # (jax 0.10.2) lowers a float32 2-D max reduction to a library kernel that drops
        # NaN, so a NaN gradient would step (seen: 40 of 40 NaNs missed at (256, 256) and
        # (1000, 37), and after a dot). Pins that the shipped check sees every one.
        rng = np.random.default_rng(0)
        check = jax.jit(lambda y, w: mpfunc.all_finite({"g": y @ w, "b": y[0]}))
        for bad in (np.nan, np.inf, -np.inf):
            for _ in range(5):
                x = rng.standard_normal(shape).astype(np.float32)
                x[tuple(rng.integers(0, n) for n in shape)] = bad
                x = jnp.asarray(x, dtype)
                assert not bool(jax.jit(mpfunc.all_finite)({"g": x}))
                if x.ndim == 2:  # the gradient as a dot produces it
                    assert not bool(check(jnp.eye(shape[0], dtype=dtype), x))
        assert bool(jax.jit(mpfunc.all_finite)({"g": jnp.full(shape, 6e4, dtype)}))

    def test_every_leaf_of_every_group_is_seen(self):
        # The check runs over groups of up to 16 leaves that share a role, shape and dtype
        # (40 layers make groups of 16, 16 and 8). One bad element in any leaf, whatever
        # its group, its place in it, its dtype or rank, is seen.
        tree = {f"layer_{i}": {"w": jnp.ones((8, 4)), "b": jnp.ones((4,), jnp.bfloat16)}
                for i in range(40)}
        tree.update(h=[jnp.ones((3,), jnp.float16)] * 3, s=jnp.float32(1.0),
                    e=jnp.ones((0, 2)), i=jnp.arange(3))
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        check = jax.jit(mpfunc.all_finite)
        assert bool(check(tree))
        bads = (np.nan, np.inf, -np.inf)
        for k, leaf in enumerate(leaves):
            if not jnp.issubdtype(leaf.dtype, jnp.floating) or not leaf.size:
                continue
            bad = leaf.reshape(-1).at[k % leaf.size].set(bads[k % 3]).reshape(leaf.shape)
            poisoned = jax.tree_util.tree_unflatten(
                treedef, leaves[:k] + [bad] + leaves[k + 1:])
            assert not bool(check(poisoned)), (k, leaf.shape, leaf.dtype)

    def test_one_reduction_per_group_not_per_leaf(self):
        # Compile time: a reduction per leaf doubled a 96-layer step's XLA time. The same
        # leaf of every layer is checked 16 at a time, so 64 layers' weights and biases
        # need 4 + 4 reductions, not 128 (the lowered program, before XLA touches it),
        # and one more: the sum of the 128 per-leaf flags (a vector, not a gradient).
        tree = {f"layer_{i}": {"w": jnp.ones((16, 8)), "b": jnp.ones((8,))} for i in range(64)}
        text = jax.jit(mpfunc.all_finite).lower(tree).as_text()
        assert text.count("stablehlo.reduce") == 8 + 1, text.count("stablehlo.reduce")


@pytest.mark.parametrize("bad", [
    dict(growth_factor=1.0), dict(growth_factor=0.5), dict(growth_factor=float("inf")),
    dict(backoff_factor=0.0), dict(backoff_factor=1.0), dict(backoff_factor=1.5),
    dict(growth_interval=0), dict(hysteresis=0),
    dict(init_scale=0.0), dict(init_scale=-2.0), dict(init_scale=float("inf")),
    dict(init_scale=float("nan")),
    dict(min_scale=8.0, max_scale=4.0),
    dict(preset="bogus"),
])
def test_bad_configuration(bad):
    name = next(iter(bad)) if "preset" not in bad else "preset"
    with pytest.raises(ValueError, match=f"`{name}`"):
        mpfunc.dynamic_scale(optax.sgd(1.0), **bad)


def test_bad_types():
    with pytest.raises(TypeError, match="`growth_interval` must be an int"):
        mpfunc.dynamic_scale(growth_interval=2.5)
    with pytest.raises(TypeError, match="`inner` must be an optax GradientTransformation"):
        mpfunc.dynamic_scale(lambda g: g)
    opt = mpfunc.dynamic_scale()
    with pytest.raises(TypeError, match="`state` must be the LossScaleState"):
        opt.update({}, optax.EmptyState())


class TestNoHostSync:
    @pytest.mark.parametrize("kw", [{}, {"preset": "naive", "warm_start": True}])
    def test_step_runs_under_transfer_guard(self, kw):
        params, opt, state = adam_setup(**kw)  # the warm start too: selects, no branch

        @jax.jit
        def step(params, state, x):
            grads = jax.grad(lambda p: mpfunc.scale_loss(loss_fn(p, x), state))(params)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        x = jax.device_put(jnp.ones((4, 2)))
        params, state = step(params, state, x)  # compile outside the guard
        with jax.transfer_guard("disallow"):
            for _ in range(3):
                params, state = step(params, state, x)
        hlo = step.lower(params, state, x).compile().as_text()
        for word in ("outfeed", "infeed", "send(", "recv(", "host-callback", "CustomCall"):
            assert word not in hlo, word


# --- sharding ------------------------------------------------------------------------

def mesh_2d():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


class TestSharding:
    def test_shard_map_one_bad_shard_makes_every_shard_skip(self):
        mesh = mesh_2d()
        opt = mpfunc.dynamic_scale(adam(1e-2), growth_interval=2,
                                   axis_name=("data", "model"))
        params = {"w": jnp.ones((8, 4)), "b": jnp.ones((4,))}
        specs = {"w": P("data", "model"), "b": P()}
        params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        state = jax.jit(opt.init)(params)
        state_specs = jax.tree.map(lambda x: P("data", "model") if x.ndim == 2 else P(), state)

        def step(grads, params, state):
            updates, state = opt.update(grads, state, params)
            # Every shard reports its own decision, so disagreement would be visible.
            decision = jnp.broadcast_to(state.last_finite, (1, 1))
            return optax.apply_updates(params, updates), state, decision

        f = jax.jit(jax.shard_map(
            step, mesh=mesh, in_specs=(specs, specs, state_specs),
            out_specs=(specs, state_specs, P("data", "model")),
        ))
        grads = {"w": jnp.ones((8, 4)), "b": jnp.ones((4,))}
        params1, state1, decision = f(grads, params, state)
        assert np.asarray(decision).all()
        bad = {"w": grads["w"].at[5, 3].set(jnp.inf), "b": grads["b"]}  # one shard of 8
        params2, state2, decision = f(bad, params1, state1)
        assert not np.asarray(decision).any(), "some shard did not skip"
        chex.assert_trees_all_equal(params2, params1)
        chex.assert_trees_all_equal(state2.inner_state, state1.inner_state)
        assert float(state2.loss_scale) == 2.0**15 and int(state2.skipped_steps) == 1

    @pytest.mark.parametrize("check_vma", [True, False])
    def test_grads_varying_over_one_axis_only(self, check_vma):
        # Data + tensor parallel: w1's gradient is summed over "data" (so identical across
        # it) and sharded over "model". An inf in one model column's shard must make the
        # other column skip too. With check_vma, jax rejects a psum over "data" here.
        mesh = mesh_2d()
        opt = mpfunc.dynamic_scale(adam(1e-2), axis_name=("data", "model"))
        w_spec = P(None, "model")

        def step(w, x, col):
            grads = jax.grad(lambda w: jax.lax.pmean(jnp.sum((x @ w) ** 2), "data"))(w)
            me = jax.lax.axis_index("model")
            grads = jnp.where(me == col, grads.at[0, 0].set(jnp.inf), grads)
            state = opt.init(w)
            _, state = opt.update(grads, state, w)
            return jnp.broadcast_to(state.last_finite, (1, 1))

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(w_spec, P("data", None), P()),
                                  out_specs=P("data", "model"), check_vma=check_vma))
        w, x = jnp.ones((4, 8)), jnp.ones((8, 4))
        assert np.asarray(f(w, x, jnp.int32(-1))).all()
        assert not np.asarray(f(w, x, jnp.int32(1))).any()

    @pytest.mark.parametrize("axis_name, match", [
        # Grads that vary over "model" with axis_name="data" only: the "model" shards
        # would decide alone (one steps, one skips).
        ("data", r"varying over \{model\}.*axis_name=\('data', 'model'\)"),
        # The likelier mistake, no axis_name at all: no check ran before.
        (None, r"varying over mesh axes \('model',\) .*no `axis_name` was given.*"
               r"axis_name=\('model',\)"),
    ])
    def test_an_axis_missing_from_axis_name_is_a_trace_time_error(self, axis_name, match):
        # Say which axes are missing, when tracing, instead of jax's own vma error deep
        # inside the inner update ("pow requires varying manual axes to match ...").
        opt = mpfunc.dynamic_scale(adam(1e-2), axis_name=axis_name)

        def step(w, x):
            grads = jax.grad(lambda w: jax.lax.pmean(jnp.sum((x @ w) ** 2), "data"))(w)
            _, state = opt.update(grads, opt.init(w), w)
            return state.loss_scale

        f = jax.jit(jax.shard_map(step, mesh=mesh_2d(), in_specs=(P(None, "model"), P("data")),
                                  out_specs=P()))
        with pytest.raises(ValueError, match=match):
            f(jnp.ones((4, 8)), jnp.ones((8, 4)))

    def test_axis_name_under_plain_jit_is_a_clear_error(self):
        # Moving from the shard_map recipe to sharded jit, where no axis_name is needed:
        # jax's NameError ("unbound axis name") named neither axis_name nor the fix.
        opt = mpfunc.dynamic_scale(adam(1e-2), axis_name="data")
        p = {"w": jnp.ones(3)}
        with pytest.raises(ValueError, match="`axis_name` \\('data'\\) names mesh axes that "
                                             "are not bound here.*leave axis_name out"):
            jax.jit(opt.update)(p, opt.init(p), p)

    def test_optax_apply_if_finite_decides_per_shard(self):
        # The prior art this replaces: without a psum, replicas disagree.
        mesh = mesh_2d()
        opt = optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=5)

        def step(grads):
            state = opt.init(grads)
            _, state = opt.update(grads, state, grads)
            return jnp.broadcast_to(state.last_finite, (1, 1))

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data", "model"),
                                  out_specs=P("data", "model")))
        decision = np.asarray(f(jnp.ones((8, 4)).at[5, 3].set(jnp.inf)))
        assert decision.any() and not decision.all()

    def test_plain_jit_with_named_sharding(self):
        mesh = mesh_2d()
        sharding = NamedSharding(mesh, P("data", "model"))
        params = {"w": jax.device_put(jnp.ones((8, 4)), sharding)}
        opt = mpfunc.dynamic_scale(adam(1e-2))
        state = jax.jit(opt.init)(params)
        step = jax.jit(lambda g, s, p: opt.update(g, s, p))
        bad = {"w": jax.device_put(jnp.ones((8, 4)).at[7, 0].set(jnp.nan), sharding)}
        updates, new_state = step(bad, state, params)
        assert not bool(new_state.last_finite)
        np.testing.assert_array_equal(np.asarray(updates["w"]), 0.0)
        assert float(new_state.loss_scale) == 2.0**15


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_skip_together():
    worker = Path(__file__).with_name("mp_jax_worker.py")
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    procs = [
        subprocess.Popen([sys.executable, str(worker), str(i), port], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    reports = {}
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        data = json.loads(line[len("RESULT "):])
        reports[data["process"]] = data["report"]
    r0, r1 = reports[0], reports[1]
    for a, b in zip(r0, r1):
        assert a["finite"] == b["finite"] and a["scale"] == b["scale"]
        assert a["skipped"] == b["skipped"]
    assert [r["finite"] for r in r0] == [True, False, True, True]
    assert r0[1]["params_unchanged"] and r1[1]["params_unchanged"]  # both skipped
    assert not r0[0]["params_unchanged"]
    assert [r["scale"] for r in r0] == [2.0**16, 2.0**15, 2.0**15, 2.0**16]


# --- issue 10: drop-in forms, long runs, restored states, validation ------------------

class TestMultiStepsAccepted:
    def test_readme_form(self):
        # The README's exact form: a MultiSteps (not a GradientTransformation) wrapped.
        params = {"w": jnp.ones((2,))}
        with jax.numpy_dtype_promotion("standard"):  # optax's adam is not strict-clean
            opt = mpfunc.dynamic_scale(optax.MultiSteps(optax.adam(1e-1), 2))
            state = opt.init(params)
            step = jax.jit(opt.update)
            for _ in range(2):
                g = {"w": jnp.full((2,), 1.0) * mpfunc.loss_scale(state)}
                u, state = step(g, state, params)
        assert float(u["w"][0]) == pytest.approx(-0.1, rel=1e-5)  # Adam's first step: -lr

    def test_everywhere_a_transformation_is_taken(self):
        ms = lambda: optax.MultiSteps(optax.sgd(1.0), 2)  # noqa: E731
        params = {"w": jnp.ones((2,))}
        made = [
            mpfunc.static_scale(2.0, ms()), mpfunc.no_scale(ms()),
            mpfunc.chain(mpfunc.dynamic_scale(), ms()), mpfunc.master_weights(ms()),
            mpfunc.convert_to_amp(lambda p, x: x, ms(), mode="bf16").optimizer,
        ]
        for opt in made:
            with jax.numpy_dtype_promotion("standard"):  # optax's MultiSteps is not strict
                state = opt.init(params)
                for _ in range(2):
                    g = {"w": jnp.ones((2,))}
                    if mpfunc._src.scale_state._find_states(state):
                        g = {"w": g["w"] * mpfunc.loss_scale(state)}
                    u, state = opt.update(g, state, params)
            np.testing.assert_array_equal(u["w"], -1.0)

    def test_not_a_transformation(self):
        for bad in (lambda g: g, "adam", optax.adam):
            with pytest.raises(TypeError, match="`inner` must be an optax Gradient.*MultiSteps"):
                mpfunc.dynamic_scale(bad)
        with pytest.raises(TypeError, match=r"`links\[1\]`"):
            mpfunc.chain(optax.sgd(1.0), "sgd")
        with pytest.raises(TypeError, match="`optimizer`"):
            mpfunc.convert_to_amp(lambda p, x: x, "adam")


class TestLongRuns:
    def test_200_overflows_then_500_clean_steps_all_train(self):
        # The unfloored rule reached a scale of exactly 0 after 142 overflows on CPU and
        # then skipped every step forever.
        params = {"w": jnp.ones((4,))}
        opt = mpfunc.dynamic_scale(optax.sgd(1e-3))
        seq = jnp.asarray([False] * 200 + [True] * 500)

        @jax.jit
        def run(params, state):
            def body(carry, finite):
                params, state = carry
                g = {"w": jnp.where(finite, jnp.ones((4,)), jnp.inf) * state.loss_scale}
                u, state = opt.update(g, state, params)
                new = optax.apply_updates(params, u)
                return (new, state), (jnp.any(new["w"] != params["w"]), state.loss_scale)

            return jax.lax.scan(body, (params, state), seq)

        (params, state), (moved, scales) = run(params, opt.init(params))
        moved, scales = np.asarray(moved), np.asarray(scales)
        assert not moved[:200].any() and moved[200:].all()  # all 500 clean steps trained
        assert scales.min() == 1.0 and scales[-1] == 1.0
        np.testing.assert_allclose(np.asarray(params["w"]), 1 - 500e-3, rtol=1e-4)
        assert int(state.skipped_steps) == 200 and int(state.consecutive_skips) == 0

    @pytest.mark.parametrize("preset", ["torch", "apex", "naive", "jmp"])
    def test_bit_identical_to_torch_loss_scaler_over_long_overflow_runs(self, preset):
        import torch

        from mpfunc_torch import LossScaler

        rng = np.random.default_rng(0)
        seq = []
        while len(seq) < 6000:  # clean stretches past growth_interval, overflow bursts
            seq += [True] * int(rng.integers(0, 2500)) + [False] * int(rng.integers(1, 400))
        kw = dict(growth_interval=300) if preset != "naive" else dict(growth_interval=150)
        cfg = resolve_scale_config(preset, **kw)
        opt = mpfunc.dynamic_scale(preset=preset, **kw)

        @jax.jit
        def run(seq):
            def body(state, finite):
                g = {"w": jnp.where(finite, 1.0, jnp.inf) * jnp.ones((2,))}
                _, state = opt.update(g, state)
                return state, (state.loss_scale, state.growth_tracker, state.hysteresis_left,
                               state.skipped_steps)

            return jax.lax.scan(body, opt.init({"w": jnp.ones((2,))}), seq)[1]

        ours = [np.asarray(a) for a in run(jnp.asarray(seq))]
        scaler = LossScaler("dynamic", config=cfg)
        theirs = [[], [], [], []]
        for finite in seq:
            scaler.update(torch.tensor(0.0 if finite else 1.0))
            sd = scaler.state_dict()
            for i, k in enumerate(("loss_scale", "growth_tracker", "hysteresis_left",
                                   "skipped_steps")):
                theirs[i].append(sd[k].numpy())
        np.testing.assert_array_equal(ours[0].view(np.uint32),
                                      np.asarray(theirs[0], np.float32).view(np.uint32))
        for a, b in zip(ours[1:], theirs[1:]):
            np.testing.assert_array_equal(a, np.asarray(b))
        assert ours[0].min() == np.float32(cfg.min_scale)  # the runs reached the floor


class TestRestoredStates:
    def test_trackers_out_of_range_are_clamped(self):
        opt = mpfunc.dynamic_scale(optax.sgd(1.0), preset="naive", init_scale=2.0**10,
                                   growth_interval=10)  # hysteresis 2, max 2**32
        params = {"w": jnp.ones((2,))}
        fresh = opt.init(params)
        bad, ok = {"w": jnp.full((2,), jnp.inf)}, {"w": jnp.ones((2,))}
        # hysteresis_left 5 (from a hysteresis-5 run) behaves as 2: backs off on the 2nd.
        s = fresh._replace(hysteresis_left=jnp.int32(5))
        for _ in range(2):
            _, s = opt.update(bad, s, params)
        assert float(s.loss_scale) == 2.0**9
        # A growth tracker past the interval grows at the next clean step, not never.
        s = fresh._replace(growth_tracker=jnp.int32(5000))
        _, s = opt.update(ok, s, params)
        assert float(s.loss_scale) == 2.0**11 and int(s.growth_tracker) == 0
        # A scale out of [min, max], NaN or negative is brought back inside the range.
        for raw, want in ((2.0**40, 2.0**32), (jnp.nan, 1.0), (-3.0, 1.0), (0.0, 1.0)):
            s = fresh._replace(loss_scale=jnp.float32(raw))
            _, s = opt.update(ok, s, params)
            assert float(s.loss_scale) == want, raw
        # Negative counters from a corrupted checkpoint count from 0.
        s = fresh._replace(skipped_steps=jnp.int32(-7), consecutive_skips=jnp.int32(-2))
        _, s = opt.update(bad, s, params)
        assert int(s.skipped_steps) == 1 and int(s.consecutive_skips) == 1

    @pytest.mark.parametrize("raw", [0.0, 0.25, float("nan"), -1.0])
    def test_a_restored_scale_below_one_never_lets_a_non_finite_through(self, raw):
        # The check reads the scaled gradients where the config keeps the scale >= 1.
        # A state restored from a run whose floor was lower (0.25), or holding 0 or NaN,
        # was unscaled by its own value: 1.5e38 * 4 overflowed, 0 * (1 / 0) was NaN, and
        # either reached the params. Now that step is skipped, and the next scale is in
        # this config's range.
        params = {"w": jnp.ones(3)}
        for opt in (mpfunc.dynamic_scale(lenient(optax.sgd(1e-3))),
                    mpfunc.static_scale(2.0**10, lenient(optax.sgd(1e-3))),
                    mpfunc.chain(mpfunc.dynamic_scale(), lenient(optax.sgd(1e-3)))):
            state = opt.init(params)
            state = jax.tree_util.tree_map(
                lambda s: s._replace(loss_scale=jnp.float32(raw))
                if isinstance(s, mpfunc.LossScaleState) else s,
                state, is_leaf=lambda s: isinstance(s, mpfunc.LossScaleState))

            @functools.partial(jax.jit, static_argnums=0)
            def step(opt, params, state):
                grads = jax.grad(lambda p: mpfunc.scale_loss(
                    jnp.sum(jnp.float32(1.5e38) * p["w"]) + jnp.sum(p["w"] ** 2), state))(params)
                updates, state = opt.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            new, state = step(opt, params, state)
            np.testing.assert_array_equal(new["w"], params["w"])
            metrics = mpfunc.scale_metrics(state)
            assert not bool(metrics["last_finite"]) and float(metrics["loss_scale"]) >= 1.0
        # With a floor below 1 the unscaled gradients are checked: 0.25 is a scale there.
        opt = mpfunc.dynamic_scale(lenient(optax.sgd(1e-3)), min_scale=2.0**-4)
        state = opt.init(params)._replace(loss_scale=jnp.float32(0.25))
        grads = jax.grad(lambda p: mpfunc.scale_loss(jnp.sum(p["w"] ** 2), state))(params)
        _, state = opt.update(grads, state, params)
        assert bool(state.last_finite)

    def test_gradients_of_other_shapes_are_a_clear_error(self):
        params = {"w": jnp.ones((3, 2))}
        opt = mpfunc.dynamic_scale(adam(1e-3))
        with pytest.raises(ValueError, match="`updates` \\(the gradients\\) must have the "
                                             "structure and leaf shapes of `params`: got "
                                             "shapes \\[\\(4, 2\\)\\]"):
            jax.jit(opt.update)({"w": jnp.ones((4, 2))}, opt.init(params), params)

    def test_state_of_another_inner_optimizer_is_a_clear_error(self):
        params = {"w": jnp.ones((2,))}
        adam_state = mpfunc.dynamic_scale(adam(1e-3)).init(params)
        sgd_m = mpfunc.dynamic_scale(lenient(optax.sgd(1.0, momentum=0.9)))
        with pytest.raises(ValueError, match="`state.inner_state` does not match"):
            jax.jit(sgd_m.update)({"w": jnp.ones((2,))}, adam_state, params)
        other_shapes = mpfunc.dynamic_scale(adam(1e-3)).init({"w": jnp.ones((3,))})
        with pytest.raises(ValueError, match="leaf shapes"):
            mpfunc.dynamic_scale(adam(1e-3)).update({"w": jnp.ones((2,))}, other_shapes, params)


    def test_inner_init_that_reads_values_on_the_host_still_works(self):
        # The structure check traces `inner.init`; an init that needs concrete values
        # (it reads params with NumPy) cannot be traced. That must not break `update`,
        # which worked before the check existed: the check is skipped for such inits.
        def init(params):
            return {"n": jnp.int32(sum(np.asarray(p).size for p in jax.tree.leaves(params)))}

        def update(updates, state, params=None):
            return updates, {"n": state["n"] + 1}

        opt = mpfunc.dynamic_scale(optax.GradientTransformation(init, update))
        params = {"w": jnp.ones((2,))}
        state = opt.init(params)
        u, state = opt.update({"w": jnp.full((2,), 2.0**16)}, state, params)
        np.testing.assert_array_equal(u["w"], 1.0)
        assert int(state.inner_state["n"]) == 3

    def test_a_good_state_costs_no_trace_of_inner_init(self):
        # Compile time: the comparison with `inner.init`'s state runs only when `inner`
        # fails on the state or returns it reshaped (the two tests above).
        calls = []
        base = adam(1e-3)

        def init(params):
            calls.append(1)
            return base.init(params)

        opt = mpfunc.dynamic_scale(optax.GradientTransformation(init, base.update))
        params = {"w": jnp.ones((2,))}
        state = opt.init(params)
        assert len(calls) == 1
        jax.jit(opt.update)({"w": jnp.ones((2,))}, state, params)
        assert len(calls) == 1

    @pytest.mark.parametrize("make", [
        lambda inner: mpfunc.static_scale(0.5, inner),
        lambda inner: mpfunc.dynamic_scale(inner, init_scale=0.5, min_scale=0.25),
    ])
    def test_below_one_the_unscaled_gradients_are_checked(self, make):
        # At a scale >= 1 the check reads the gradients as they came (unscaling cannot
        # change finiteness). Below 1 unscaling multiplies by more than 1: a finite
        # 2e38 becomes inf at scale 0.5, and that step must be skipped.
        opt = make(optax.sgd(1.0))
        params = {"w": jnp.ones((2,))}
        state = opt.init(params)
        u, state = jax.jit(opt.update)({"w": jnp.array([2e38, 1.0])}, state, params)
        assert not bool(state.last_finite) and int(state.skipped_steps) == 1
        np.testing.assert_array_equal(optax.apply_updates(params, u)["w"], params["w"])
        # 5e37 is finite after unscaling at 0.5 or at the backed-off 0.25: applied.
        u, state = jax.jit(opt.update)({"w": jnp.array([5e37, 1.0])}, state, params)
        assert bool(state.last_finite)

    def test_at_or_above_one_the_check_agrees_with_the_unscaled_one(self):
        opt = mpfunc.dynamic_scale(optax.sgd(1.0), init_scale=1.0)
        params = {"w": jnp.ones((3,))}
        for g, want in ((3.4e38, True), (np.inf, False), (np.nan, False), (-np.inf, False)):
            _, state = jax.jit(opt.update)({"w": jnp.array([g, 1.0, 0.0])},
                                           opt.init(params), params)
            assert bool(state.last_finite) == want, g

class TestValidation:
    @pytest.mark.parametrize("scale", [np.float32(2.0), jnp.float32(2.0), np.float64(2.0),
                                       jnp.asarray(2.0), 2, np.int32(2)])
    def test_static_scale_takes_numpy_and_jax_scalars(self, scale):
        opt = mpfunc.static_scale(scale, optax.sgd(1.0))
        state = opt.init({"w": jnp.ones(1)})
        assert float(mpfunc.loss_scale(state)) == 2.0
        u, _ = opt.update({"w": jnp.full((1,), 4.0)}, state)
        np.testing.assert_array_equal(u["w"], -2.0)

    @pytest.mark.parametrize("scale, err, match", [
        (1e39, ValueError, r"float32: inf"), (1e-50, ValueError, r"float32: 0.0"),
        (1e-40, ValueError, "normal float32"), (float("nan"), ValueError, "nan"),
        (0.0, ValueError, "normal"), (-1.0, ValueError, "normal"),
        ("8", TypeError, "real number"), (True, TypeError, "real number"),
        (jnp.ones(2), TypeError, "0-d"),
    ])
    def test_static_scale_rejects(self, scale, err, match):
        with pytest.raises(err, match=f"`scale`.*{match}"):
            mpfunc.static_scale(scale)

    def test_static_scale_refuses_a_traced_value(self):
        with pytest.raises(TypeError, match="`scale` must be a concrete number"):
            jax.jit(lambda s: mpfunc.static_scale(s).init({}))(2.0)

    @pytest.mark.parametrize("bad", [3.5, 3, True, np.float32(1.0), [], "", ("data", ""), ("data", 3.5),
                                     ["data", None], {"data"}, ("data", ["model"])])
    def test_axis_name_is_checked(self, bad):
        for make in (lambda: mpfunc.dynamic_scale(axis_name=bad),
                     lambda: mpfunc.static_scale(2.0, axis_name=bad),
                     lambda: mpfunc.no_scale(axis_name=bad),
                     lambda: mpfunc.all_finite({}, axis_name=bad),
                     lambda: mpfunc.value_and_grad(jnp.sum, axis_name=bad)):
            with pytest.raises(TypeError, match="`axis_name` must be None, a mesh axis name"):
                make()

    def test_axis_name_with_a_repeated_axis_is_refused(self):
        for make in (lambda: mpfunc.dynamic_scale(axis_name=("data", "data")),
                     lambda: mpfunc.clip_by_global_norm(1.0, axis_name=["model", "model"]),
                     lambda: mpfunc.convert_to_fp8(lambda p, x: x, axis_name=("d", "d"))):
            with pytest.raises(ValueError, match="`axis_name` names an axis twice"):
                make()

    @pytest.mark.parametrize("good", ["data", ("data", "model"), ["data", "model"], None])
    def test_axis_name_forms_accepted(self, good):
        mpfunc.dynamic_scale(axis_name=good)

    def test_jmp_style_hyperparameters(self):
        # As jmp's README builds its scales: concrete JAX scalars and integral floats.
        opt = mpfunc.dynamic_scale(init_scale=jnp.float32(2.0**15),
                                   min_scale=jnp.asarray(0.3125), growth_interval=5.0)
        state = opt.init({})
        assert float(state.loss_scale) == 2.0**15
        s = state
        for _ in range(5):
            _, s = opt.update({"w": jnp.ones(1)}, s)
        assert float(s.loss_scale) == 2.0**16  # interval 5
        s = state._replace(loss_scale=jnp.float32(0.5))
        _, s = opt.update({"w": jnp.full((1,), jnp.inf)}, s)
        assert float(s.loss_scale) == 0.3125  # the floor
        with pytest.raises(TypeError, match="`init_scale` must be a concrete number"):
            jax.jit(lambda v: mpfunc.dynamic_scale(init_scale=v).init({}))(2.0)


class TestSignedZerosSurviveASkip:
    @pytest.mark.parametrize("make", [
        lambda: mpfunc.dynamic_scale(adam(1e-2)),
        lambda: mpfunc.chain(mpfunc.dynamic_scale(), adam(1e-2)),
        lambda: mpfunc.static_scale(4.0, lenient(optax.sgd(0.1, momentum=0.9))),
    ])
    def test_every_bit_is_left_alone(self, make):
        opt = make()
        params = {"w": jnp.array([-0.0, 0.0, -1.0, 2.0]), "h": jnp.array([-0.0, 1.0], jnp.float16)}
        state = opt.init(params)
        bad = {"w": jnp.array([1.0, jnp.inf, 1.0, 1.0]), "h": jnp.ones((2,), jnp.float16)}
        u, state = jax.jit(opt.update)(bad, state, params)
        new = optax.apply_updates(params, u)
        for k in params:
            a, b = np.asarray(new[k]), np.asarray(params[k])
            np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))

    def test_master_weights_zero_step_keeps_negative_zero(self):
        params = {"w": jnp.array([-0.0, 0.0, 1.0], jnp.float16)}
        opt = mpfunc.master_weights(optax.sgd(1.0))
        u, _ = opt.update({"w": jnp.zeros((3,), jnp.float16)}, opt.init(params), params)
        new = np.asarray(optax.apply_updates(params, u)["w"])
        np.testing.assert_array_equal(new.view(np.uint16),
                                      np.asarray(params["w"]).view(np.uint16))


# --- adapted from jmp's loss_scale_test (jmp/_src/loss_scale_test.py) -------------------

@pytest.fixture(scope="module")
def jmp():
    # jmp is in the dev extra but not on every image (the CUDA one lacks it).
    return pytest.importorskip("jmp", reason="jmp is not installed (the dev extra has it); "
                               "these tests hold the jmp preset against jmp itself")


def _run_rule(opt, finite_seq, state=None):
    state = opt.init({}) if state is None else state
    step = jax.jit(opt.update)
    out = []
    for finite in finite_seq:
        _, state = step({"g": jnp.asarray(1.0 if finite else jnp.inf)}, state)
        out.append(state)
    return out


@functools.cache
def _jmp_run(jmp):
    """jmp's own rule over a padded sequence, jitted once (not once per example)."""

    @jax.jit
    def run(seq):
        def body(carry, finite):
            ls = jmp.DynamicLossScale(*carry)  # jmp's README form, period 2000
            ls = ls.adjust(finite)
            return (ls.loss_scale, ls.counter), ls.loss_scale

        init = (jnp.asarray(2.0**15, jnp.float32), jnp.zeros((), jnp.int32))
        return jax.lax.scan(body, init, seq)[1]

    return run


class TestFromJmp:
    @pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
    def test_adjust_increases_on_finite(self, period, factor):
        opt = mpfunc.dynamic_scale(init_scale=10.0, growth_interval=period,
                                   growth_factor=factor, backoff_factor=1 / factor)
        states = _run_rule(opt, [True] * period)
        for i, s in enumerate(states[:-1], start=1):
            assert float(s.loss_scale) == 10 and int(s.growth_tracker) == i
        assert float(states[-1].loss_scale) == 10 * factor  # wraps
        assert int(states[-1].growth_tracker) == 0

    @pytest.mark.parametrize("period, factor, min_scale", [
        (20, 2, None), (30, 3, None), (20, 2, 0.3125), (30, 3, 0.37)])
    def test_adjust_reduces_on_non_finite_down_to_the_floor(self, period, factor, min_scale):
        opt = mpfunc.dynamic_scale(init_scale=np.float32(10), growth_interval=period,
                                   growth_factor=factor, backoff_factor=1 / factor,
                                   min_scale=min_scale)
        floor = 1.0 if min_scale is None else min_scale
        states = _run_rule(opt, [False] * 100)
        for i, s in enumerate(states):
            np.testing.assert_allclose(float(s.loss_scale), max(floor, 10 / factor ** (i + 1)),
                                       rtol=1e-5)
            assert int(s.growth_tracker) == 0

    def test_a_zero_floor_is_refused(self):
        # jmp accepts min_loss_scale=0 (its 3rd parametrisation); ours must stay normal.
        with pytest.raises(ValueError, match="`min_scale`"):
            mpfunc.dynamic_scale(init_scale=10.0, min_scale=0.0)

    @pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
    def test_all_finite(self, bad):
        assert bool(mpfunc.all_finite(None)) and bool(mpfunc.all_finite({}))
        assert not bool(mpfunc.all_finite({"a": jnp.array(bad)}))
        assert not bool(mpfunc.all_finite({"a": jnp.ones([]), "b": jnp.array(bad)}))
        assert not bool(mpfunc.all_finite({"a": jnp.array(bad), "b": jnp.ones([])}))
        assert bool(mpfunc.all_finite({"a": jnp.ones([]), "b": jnp.ones([])}))

    @given(seqs)
    def test_jmp_preset_is_jmp_dynamic_loss_scale_bit_for_bit(self, jmp, seq):
        n = len(seq)
        padded = jnp.asarray(list(seq) + [True] * (MAX_STEPS - n))
        with jax.numpy_dtype_promotion("standard"):  # jmp multiplies an int by a bool
            ref = np.asarray(_jmp_run(jmp)(padded))[:n]
        assert_bitwise(trajectory(dict(preset="jmp"), seq), ref)

    def test_jmp_preset_with_a_short_period_matches_jmp(self, jmp):
        seq = [True] * 7 + [False] * 3 + [True] * 12 + [False] + [True] * 9
        ls = jmp.DynamicLossScale(jnp.float32(2.0**15), period=5)
        ref = []
        with jax.numpy_dtype_promotion("standard"):
            for finite in seq:
                ls = ls.adjust(jnp.bool_(finite))
                ref.append(float(ls.loss_scale))
        assert list(trajectory(dict(preset="jmp", growth_interval=5), seq)) == ref


@pytest.mark.parametrize("make", [
    lambda: mpfunc.dynamic_scale(adam(1e-3)),
    lambda: mpfunc.static_scale(128.0, adam(1e-3)),
    lambda: mpfunc.no_scale(adam(1e-3)),
    lambda: optax.chain(mpfunc.dynamic_scale(), adam(1e-3)),
], ids=["dynamic", "static", "none", "chain"])
def test_state_from_init_can_be_donated(make):
    # The counters once shared one zero array: the first donated step then failed with
    # "Attempt to donate the same buffer twice" unless init itself ran under jit.
    tx = make()
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros((2,))}
    state = tx.init(params)
    assert_own_buffers(params, state)

    def step(params, state):
        grads = jax.tree.map(jnp.ones_like, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    expected = jax.jit(step)(params, state)
    got = jax.jit(step, donate_argnums=(0, 1))(params, state)
    chex.assert_trees_all_equal(got, expected)
