"""Tests for mpfunc._src.checkpoint.convert: a run's params and optimizer state moved
between modes (issue 40, item 5; the torch twin is tests/test_torch_resume.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from lenient import adam, lenient
from test_modes import apply as apply_fn
from test_modes import init, task, train_step

import mpfunc

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
OPT = adam(3e-3)  # one optax optimizer for every setup: its state carries over
SETUPS = {
    "naive": ("naive", {"initial_scale": 2.0**10}),
    "O2": ("apex", {"opt_level": "O2"}),
    "torch": ("torch", {"init_scale": 2.0**12}),
    "bf16": ("bf16", {}),
    "naive-chained": ("naive", {"initial_scale": 2.0**10, "clip_grad": 1.0,
                                "log_num_zeros_in_grad": True}),
}


def setup(name, optimizer=OPT):
    mode, cfg = SETUPS[name]
    return mpfunc.convert_to_amp(apply_fn, optimizer, mode=mode, **cfg)


_STEPS = {}


def train(amp, params, state, start, steps):
    step = _STEPS.get(amp.plan)  # one compile per mode (the setups share OPT)
    if step is None:
        step = _STEPS[amp.plan] = jax.jit(train_step(amp))
    for i, (x, y) in enumerate(task(start + steps)):
        if i >= start:
            params, state = step(params, state, x, y)
    return params, state


def masters(state):
    return state.inner_state.master_params


def start(name):
    amp = setup(name)
    params = amp.cast_params(init(jax.random.key(0)))
    return amp, params, amp.optimizer.init(params)


def test_naive_to_torch_to_naive_keeps_masters_moments_and_scale():
    naive, params, state = start("naive")
    params, state = train(naive, params, state, 0, 4)
    torch_amp = setup("torch")
    p2, s2 = mpfunc.convert_checkpoint(params, state, naive, torch_amp)
    chex.assert_trees_all_equal(p2, masters(state))  # the masters are the params now
    assert all(x.dtype == F32 for x in jax.tree.leaves(p2))
    chex.assert_trees_all_equal(s2.inner_state, state.inner_state.inner_state)  # Adam
    # dynamic -> dynamic: the scale goes on (torch mode's own start is 2**12)
    assert float(s2.loss_scale) == float(state.loss_scale) == 2.0**10
    chex.assert_trees_all_equal_structs(s2, torch_amp.optimizer.init(p2))
    p2, s2 = train(torch_amp, p2, s2, 4, 2)

    p3, s3 = mpfunc.convert_checkpoint(p2, s2, torch_amp, naive)
    chex.assert_trees_all_equal(masters(s3), p2)  # the params are the masters now
    chex.assert_trees_all_equal(p3, naive.cast_params(p2))
    assert all(x.dtype == F16 for x in jax.tree.leaves(p3))
    chex.assert_trees_all_equal(s3.inner_state.inner_state, s2.inner_state)
    assert float(s3.loss_scale) == float(s2.loss_scale)
    chex.assert_trees_all_equal_structs(s3, state)
    p3, s3 = train(naive, p3, s3, 6, 2)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(p3))


def test_o2_to_bf16_takes_every_master_norms_included_and_drops_the_scale():
    o2, params, state = start("O2")
    params, state = train(o2, params, state, 0, 3)
    assert params["LayerNorm_0"]["scale"].dtype == F32 and params["w1"].dtype == F16
    bf16 = setup("bf16")
    p2, s2 = mpfunc.convert_checkpoint(params, state, o2, bf16)
    chex.assert_trees_all_equal(p2, masters(state))
    chex.assert_trees_all_equal(s2.inner_state, state.inner_state.inner_state)
    chex.assert_trees_all_equal(s2.loss_scale, jnp.float32(1.0))  # bf16 scales nothing
    assert int(s2.skipped_steps) == 0
    train(bf16, p2, s2, 3, 1)


def test_a_plain_float32_run_moves_to_naive_and_back():
    params = init(jax.random.key(0))
    plain_state = OPT.init(params)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)
    updates, plain_state = OPT.update(grads, plain_state, params)
    params = optax.apply_updates(params, updates)
    naive = setup("naive")
    p2, s2 = mpfunc.convert_checkpoint(params, plain_state, OPT, naive)
    chex.assert_trees_all_equal(masters(s2), params)
    chex.assert_trees_all_equal(p2, naive.cast_params(params))
    chex.assert_trees_all_equal(s2.inner_state.inner_state, plain_state)
    assert float(s2.loss_scale) == 2.0**10  # naive's own start: the plain run had none
    p2, s2 = train(naive, p2, s2, 0, 2)
    p3, s3 = mpfunc.convert_checkpoint(p2, s2, naive, OPT)  # and back to plain optax
    chex.assert_trees_all_equal(p3, masters(s2))
    chex.assert_trees_all_equal(s3, s2.inner_state.inner_state)


def test_the_links_convert_to_amp_chains_start_afresh():
    chained, params, state = start("naive-chained")
    params, state = train(chained, params, state, 0, 2)
    torch_amp = setup("torch")
    p2, s2 = mpfunc.convert_checkpoint(params, state, chained, torch_amp)
    chex.assert_trees_all_equal(s2.inner_state, state.inner_state.inner_state[-1])
    p3, s3 = mpfunc.convert_checkpoint(p2, s2, torch_amp, chained)
    zeros, _, user = s3.inner_state.inner_state
    assert int(zeros.num_zeros_in_grad) == 0
    chex.assert_trees_all_equal(user, s2.inner_state)


def test_the_scale_is_brought_into_the_target_range():
    naive, params, state = start("naive")
    state = state._replace(loss_scale=jnp.float32(2.0**30), hysteresis_left=jnp.int32(2),
                           growth_tracker=jnp.int32(999))
    apex = mpfunc.convert_to_amp(apply_fn, OPT, mode="apex", opt_level="O2")
    _, s2 = mpfunc.convert_checkpoint(params, state, naive, apex)
    assert float(s2.loss_scale) == 2.0**24  # apex's ceiling
    assert int(s2.hysteresis_left) == 1 and int(s2.growth_tracker) == 999  # < 2000


def test_errors_change_nothing_and_name_the_problem():
    naive, params, state = start("naive")
    sgd = setup("torch", optimizer=lenient(optax.sgd(0.1, momentum=0.9)))
    with pytest.raises(ValueError, match="does not fit `target`'s optimizer"):
        mpfunc.convert_checkpoint(params, state, naive, sgd)
    with pytest.raises(ValueError, match="must be the state of `source.optimizer`"):
        mpfunc.convert_checkpoint(params, state.inner_state, naive, sgd)
    with pytest.raises(ValueError, match="holds no MasterWeightsState"):
        mpfunc.convert_checkpoint(params, state._replace(inner_state=OPT.init(params)),
                                  naive, setup("torch"))
    with pytest.raises(TypeError, match="`source` must be an AmpSetup"):
        mpfunc.convert_checkpoint(params, state, "naive", setup("torch"))
    with pytest.raises(TypeError, match="`target` must be an AmpSetup"):
        mpfunc.convert_checkpoint(params, state, naive, "torch")
