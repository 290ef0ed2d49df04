"""Tests for mpfunc._src.exact_skip: an exact skip for any optax inner transformation, at
no memory cost under buffer donation, and compile cost linear in the number of leaves."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from lenient import adam, lenient

import mpfunc
from _mpfunc_common.scale_config import resolve_scale_config
from mpfunc._src.scale_transform import _scale_transform


def bits(x):
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.floating):
        return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])
    return x


def assert_bitwise(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(bits(x), bits(y))


def jitted_update(tx):
    return jax.jit(lambda g, s, p: tx.update(g, s, p))


# Params with signed zeros, so that a skip that turns -0.0 into +0.0 is caught.
PARAMS = {"w": jnp.array([[0.5, -0.0], [0.0, -1.5]], jnp.float32),
          "b": jnp.array([-0.0, 0.25], jnp.float32)}

INNERS = {
    "adam": lambda: adam(1e-2),
    "adamw": lambda: lenient(optax.adamw(1e-2, weight_decay=0.1)),
    "sgd_momentum": lambda: lenient(optax.sgd(0.1, momentum=0.9)),
    "sgd_nesterov": lambda: lenient(optax.sgd(0.1, momentum=0.9, nesterov=True)),
    "lion": lambda: lenient(optax.lion(1e-3)),
    "adafactor": lambda: lenient(optax.adafactor(1e-2)),
    "adam_schedule": lambda: lenient(optax.adam(optax.linear_schedule(1e-2, 1e-3, 5))),
    "inject_hyperparams": lambda: lenient(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)),
    "clip_chain": lambda: lenient(optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))),
    "multisteps": lambda: lenient(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)),
    "jitted_update": lambda: (lambda a: optax.GradientTransformation(a.init, jax.jit(a.update)))(
        adam(1e-2)),
    "master_weights": lambda: mpfunc.master_weights(adam(1e-2)),
    # Per-leaf routing and frozen leaves (MaskedNode state), state kept by the inner's
    # own where (apply_if_finite), a PRNG key in the state (noisy_sgd), a state that
    # shadows the params (schedule-free), and an orthogonalising update (muon).
    "multi_transform": lambda: lenient(optax.multi_transform(
        {"a": optax.adam(1e-2), "s": optax.sgd(0.1, momentum=0.9)}, {"w": "a", "b": "s"})),
    "masked": lambda: lenient(optax.masked(optax.adam(1e-2), {"w": True, "b": False})),
    "apply_if_finite": lambda: lenient(optax.apply_if_finite(optax.adam(1e-2), 3)),
    "noisy_sgd": lambda: lenient(optax.noisy_sgd(0.1, key=0)),
    "schedule_free": lambda: lenient(optax.contrib.schedule_free_adamw(1e-2)),
    "muon": lambda: lenient(optax.contrib.muon(1e-2)),
}

# Inners whose update XLA:CPU compiles to different roundings when the select sits after
# it (muon's Newton-Schulz matmuls: a few ulp apart). The fused skip, which is what users
# run, still matches the bare inner optimizer bit for bit on every clean step.
SELECT_COMPILES_OTHERWISE = {"muon"}

# Step 2 overflows, 4 is NaN, 5 is -inf: skips right after a clean step and in a row.
BAD = {2: jnp.inf, 4: jnp.nan, 5: -jnp.inf}


def grads_for(step, params):
    g = jax.tree.map(lambda p: (jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape) - 1.5)
                     * (step + 1) * 64.0, params)
    if step in BAD:
        g["w"] = g["w"].at[0, 1].set(BAD[step])
    return jax.tree.map(lambda x, p: x.astype(p.dtype), g, params)


@pytest.mark.parametrize("name", sorted(INNERS))
def test_skip_is_exact_and_every_implementation_agrees(name):
    params = PARAMS
    if name == "master_weights":  # half params with float32 masters
        params = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    cfg = resolve_scale_config("torch", init_scale=64.0, growth_interval=3)
    txs = {how: _scale_transform(INNERS[name](), cfg=cfg, static_value=None, axis_name=None,
                                 skip_with=how) for how in ("fused", "select")}
    steps = {how: jitted_update(tx) for how, tx in txs.items()}
    runs = {how: (params, tx.init(params)) for how, tx in txs.items()}
    # Reference: the bare inner optimizer, which never sees the bad steps, fed the same
    # float32-unscaled gradients.
    inner = INNERS[name]()
    ref_step = jax.jit(lambda g, inv, s, p: inner.update(
        jax.tree.map(lambda x: x.astype(jnp.float32) * inv, g), s, p))
    ref = (params, inner.init(params))
    for step in range(7):
        if step not in BAD:
            scale = runs["fused"][1].loss_scale
            u, s_ref = ref_step(grads_for(step, params), jnp.float32(1) / scale, ref[1], ref[0])
            ref = (optax.apply_updates(ref[0], u), s_ref)
        outs = {}
        for how in txs:
            p, s = runs[how]
            u, s2 = steps[how](grads_for(step, params), s, p)
            p2 = optax.apply_updates(p, u)
            outs[how] = (u, p2, s2)
            if step in BAD:  # every bit of params and inner state stays, -0.0 included
                assert_bitwise(p2, p)
                assert_bitwise(s2.inner_state, s.inner_state)
                for leaf in jax.tree_util.tree_leaves(u):
                    assert np.all(np.signbit(np.asarray(leaf))) and not np.any(np.asarray(leaf))
            else:
                assert bool(s2.last_finite)
            runs[how] = (p2, s2)
        if name not in SELECT_COMPILES_OTHERWISE:
            assert_bitwise(outs["fused"], outs["select"])
        assert_bitwise(runs["fused"][0], ref[0])
        assert_bitwise(runs["fused"][1].inner_state, ref[1])
    assert not np.array_equal(bits(runs["fused"][0]["w"]), bits(params["w"]))  # it trained
    assert int(runs["fused"][1].skipped_steps) == 3


def test_unredirectable_state_is_still_selected():
    # A state leaf that is an input passed through (count for a frozen link), one that is
    # produced in another dtype, and one value feeding two leaves: all selected at the
    # output, and the skip is still exact.
    def init(params):
        return {"same": jnp.zeros((), jnp.int32), "half": jnp.zeros((2,), jnp.float16),
                "a": jnp.zeros((2,)), "b": jnp.zeros((2,))}

    def update(g, state, params=None):
        twice = g["w"] * 2.0
        new = {"same": state["same"], "half": g["w"] + state["half"].astype(jnp.float32),
               "a": twice, "b": twice}
        return {"w": -twice}, new

    tx = mpfunc.no_scale(optax.GradientTransformation(init, update))
    p = {"w": jnp.ones((2,))}
    state = tx.init(p)
    step = jitted_update(tx)
    _, state = step({"w": jnp.ones((2,))}, state, p)
    assert state.inner_state["half"].dtype == jnp.float16
    u, s2 = step({"w": jnp.array([1.0, jnp.nan])}, state, p)
    assert_bitwise(s2.inner_state, state.inner_state)
    assert np.all(np.signbit(np.asarray(u["w"])))


def test_inner_that_changes_its_state_structure_is_refused():
    tx = optax.GradientTransformation(lambda p: (), lambda g, s, p=None: (g, (jnp.zeros(()),)))
    opt = mpfunc.no_scale(tx)
    with pytest.raises(TypeError, match="structure differs"):
        opt.update({"w": jnp.ones(2)}, opt.init({"w": jnp.ones(2)}), {"w": jnp.ones(2)})


# --- memory and compile cost of the donated step ----------------------------------------

WIDTH = 128


def mlp_params(depth):
    keys = jax.random.split(jax.random.key(0), depth)
    return [{"w": jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH),
             "b": jnp.zeros((WIDTH,))} for k in keys]


def mlp_loss(params, x):
    for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean(x**2)


def compiled_step(tx, depth, batch, scaled, policy=None):
    params = mlp_params(depth)
    state = tx.init(params)

    def step(params, state, x):
        def loss(p):
            if policy is not None:  # e.g. float32 params, float16 compute
                p, x_ = policy.cast_to_compute((p, x))
                value = policy.cast_to_output(mlp_loss(p, x_))
            else:
                value = mlp_loss(p, x)
            return mpfunc.scale_loss(value, state) if scaled else value

        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    with jax.numpy_dtype_promotion("standard"):  # optax's adam is not strict-clean
        return jax.jit(step, donate_argnums=(0, 1)).lower(
            params, state, jnp.ones((batch, WIDTH))).compile()


F16 = "params=float32,compute=float16,output=float32"


@pytest.fixture(scope="module")
def step_of():
    """`compiled_step` of a named optimizer (wrapped in `mpfunc.dynamic_scale` and its
    loss scaled when ``scaled``), compiled once per module and shared by the tests that
    need the same one (plain float16-compute Adam, for one, is the baseline of three)."""
    made = {}

    def get(name, depth, batch, scaled, policy=None):
        key = (name, depth, batch, scaled, policy)
        if key not in made:
            tx = OPTIMIZERS[name]()
            made[key] = compiled_step(mpfunc.dynamic_scale(tx) if scaled else tx, depth,
                                      batch, scaled, policy and mpfunc.get_policy(policy))
        return made[key]

    return get


def peak_bytes(compiled):
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def hlo_instructions(compiled):
    return sum(1 for line in compiled.as_text().splitlines() if " = " in line)


def grad_bytes(depth):
    return depth * (WIDTH * WIDTH + WIDTH) * 4


def test_donated_peak_memory_equals_plain_adam(step_of):
    # Batch 256: activations outweigh one gradient buffer, so the step's peak is where
    # plain Adam's is. Before: every Adam state leaf was copied (1.9x).
    plain = peak_bytes(step_of("adam", 8, 256, False))
    ours = peak_bytes(step_of("adam", 8, 256, True))
    assert ours <= 1.02 * plain, ours / plain


def test_donated_peak_memory_small_batch_is_one_gradient_buffer(step_of):
    # Batch 8: plain Adam updates each layer as soon as its gradient exists. An exact skip
    # must see every gradient before it writes any state, so one gradient buffer is live
    # at once: that is all it may cost (no copy of params or optimizer state).
    plain = peak_bytes(step_of("adam", 8, 8, False))
    clipped = peak_bytes(step_of("clipped_adam", 8, 8, False))
    ours = peak_bytes(step_of("adam", 8, 8, True))
    assert ours - plain <= 1.02 * grad_bytes(8), (ours - plain) / grad_bytes(8)
    assert ours <= clipped  # plain Adam with global-norm clipping holds them too


def test_donated_peak_memory_small_batch_where_loss_scaling_is_used(step_of):
    # Loss scaling is for float16 compute. There, at the same small batch, the exact skip
    # costs nothing over plain Adam: XLA:CPU's plain float16 step holds the gradients
    # too (measured 1.000x at 8 and 24 layers of width 256, BENCHMARKS.md section 6).
    plain = peak_bytes(step_of("adam", 8, 8, False, F16))
    ours = peak_bytes(step_of("adam", 8, 8, True, F16))
    assert ours <= 1.02 * plain, ours / plain
    # With global-norm clipping (it needs every gradient before any update too), the
    # skip adds nothing, in float32 as well.
    plain = peak_bytes(step_of("clipped_adam", 8, 8, False))
    ours = peak_bytes(step_of("clipped_adam", 8, 8, True))
    assert ours <= 1.02 * plain, ours / plain


# Optimizers whose update reads the new state (or only the gradient): the fused select
# lets XLA write every state leaf in place, as the bare optimizer does. Lion and
# schedule-free AdamW compute the update from the *old* state, which XLA:CPU keeps a copy
# of (README, known limits), so they are not in this list.
IN_PLACE = {
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adagrad": lambda: optax.adagrad(1e-2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.adam(1e-3), "s": optax.sgd(1e-2, momentum=0.9)},
        [{"w": "a", "b": "s"}] * 8),
    "masked_weight_decay": lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(1e-2), [{"w": True, "b": False}] * 8),
        optax.adam(1e-3)),
    "noisy_sgd": lambda: optax.noisy_sgd(1e-2, key=0),
}


OPTIMIZERS = {"adam": lambda: optax.adam(1e-3),
              "clipped_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                                  optax.adam(1e-3)),
              **IN_PLACE}


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_donated_peak_memory_other_optimizers(name, step_of):
    plain = peak_bytes(step_of(name, 8, 8, False, F16))
    ours = peak_bytes(step_of(name, 8, 8, True, F16))
    assert ours <= 1.02 * plain, ours / plain


@pytest.mark.parametrize("mode, config", [("naive", {}), ("apex", {"opt_level": "O2"}),
                                          ("torch", {})])
def test_donated_peak_memory_of_the_modes(mode, config):
    amp = mpfunc.convert_to_amp(lambda p, x: x, optax.adam(1e-3), mode=mode, **config)
    bare = mpfunc.master_weights(optax.adam(1e-3)) if amp.plan.master_weights else optax.adam(1e-3)
    params = amp.cast_params(mlp_params(4))

    def compiled(tx, scaled):
        state = tx.init(params)

        def step(params, state, x):
            def loss(p):
                value = mlp_loss(jax.tree.map(lambda a: a.astype(jnp.float32), p), x)
                return mpfunc.scale_loss(value, state) if scaled else value

            updates, state = tx.update(jax.grad(loss)(params), state, params)
            return optax.apply_updates(params, updates), state

        with jax.numpy_dtype_promotion("standard"):
            return jax.jit(step, donate_argnums=(0, 1)).lower(
                params, state, jnp.ones((256, WIDTH))).compile()

    assert peak_bytes(compiled(amp.optimizer, True)) <= 1.02 * peak_bytes(compiled(bare, False))


def test_compiled_program_grows_linearly_with_depth(step_of):
    # The finite decision is computed once, not copied into every select: before, each
    # of ~3L fusions carried an L-term sum (O(L**2) HLO; 15x plain Adam's compile time
    # at 48 leaves).
    ratios = []
    for depth in (4, 16):
        plain = hlo_instructions(step_of("adam", depth, 8, False))
        ours = hlo_instructions(step_of("adam", depth, 8, True))
        ratios.append(ours / plain)
    assert max(ratios) <= 2.0, ratios
    assert ratios[1] <= ratios[0] * 1.1, ratios


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="pins XLA:CPU code generation")
def test_a_lax_cond_skip_is_not_bit_identical_on_cpu():
    # Why the skip is not a lax.cond (as optax.apply_if_finite's is): XLA:CPU contracts
    # g + 0.9 * trace into a fused multiply-add inside a conditional, and not outside, so
    # the trajectory moves off the bare optimizer's by one ulp. If XLA changes this, this
    # test fails and lax.cond can be reconsidered on its memory/compile merits alone.
    cfg = resolve_scale_config("torch", init_scale=64.0, growth_interval=3)
    out = {}
    for how in ("fused", "cond"):
        tx = _scale_transform(INNERS["sgd_momentum"](), cfg=cfg, static_value=None,
                              axis_name=None, skip_with=how)
        p, s = PARAMS, tx.init(PARAMS)
        for step in range(4):
            u, s = jitted_update(tx)(grads_for(step, PARAMS), s, p)
            p = optax.apply_updates(p, u)
        out[how] = s.inner_state
    ours, cond = (np.asarray(out[h][0].trace["b"]) for h in ("fused", "cond"))
    f32 = np.float32
    no_fma = f32(f32(-4.0) + f32(f32(0.9) * f32(-1.45)))  # -0.5 * 4 * 64 / 32 + 0.9 * t
    assert ours[1] == no_fma and cond[1] != no_fma, (ours, cond)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="pins XLA:CPU code generation")
def test_the_finite_check_adds_no_transpose_with_float16_compute(step_of):
    # With float16 compute, the weight gradients reach the optimizer as transposes XLA
    # has not applied; a reduction reads them in place. A check written with
    # `lax.select` over `lax.full_like` arrays made XLA:CPU materialise each group
    # transposed (a strided copy per group; 1.25x plain Adam's step at 24 layers).
    def transposes(compiled):
        return sum(" transpose(" in line for line in compiled.as_text().splitlines())

    plain = transposes(step_of("adam", 8, 8, False, F16))
    ours = transposes(step_of("adam", 8, 8, True, F16))
    assert ours <= plain, (ours, plain)


# --- random combinations of forms, modes and optimizers -----------------------------
# Each seed draws a form (the wrapper over a float16-compute model, the same through
# `value_and_grad`, or a `convert_to_amp` mode with its options), an inner optimizer
# (Adam, AdamW, SGD with momentum, Lion, MultiSteps, inject_hyperparams, a clipping
# chain) and whether the jitted step donates its inputs, then runs 12 steps with faults
# (inf/NaN in the loss or in one gradient element) at ~30% of them. After every step:
# a fault was skipped; a skipped step left params and the inner state bit for bit;
# nothing non-finite reached the params or the state.
_COMBO_OPTS = {
    "adam": lambda: optax.adam(1e-2), "adamw": lambda: optax.adamw(1e-2),
    "sgdm": lambda: optax.sgd(1e-2, momentum=0.9), "lion": lambda: optax.lion(1e-3),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
    "inject": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "clipchain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
}


def _combo_apply(p, x):
    h = jnp.tanh(x @ p["dense_0"]["w"] + p["dense_0"]["b"])
    h = (h - h.mean(-1, keepdims=True)) * p["LayerNorm_0"]["scale"]
    return h @ p["dense_1"]["w"]


def _combo_setup(rng, seed):
    form = rng.choice(["wrapper", "value_and_grad", "torch", "apex-O1", "apex-O2",
                       "apex-O3", "naive", "bf16"])
    inner = lenient(_COMBO_OPTS[rng.choice(sorted(_COMBO_OPTS))]())
    k = jax.random.split(jax.random.key(seed), 2)
    params = {"dense_0": {"w": jax.random.normal(k[0], (6, 8)) * 0.3, "b": jnp.zeros(8)},
              "LayerNorm_0": {"scale": jnp.ones(8)},
              "dense_1": {"w": jax.random.normal(k[1], (8, 3)) * 0.3}}
    if form in ("wrapper", "value_and_grad"):
        tx = mpfunc.dynamic_scale(inner, init_scale=2.0**10, growth_interval=2)
        pol = mpfunc.get_policy("params=float32,compute=float16,output=float32")
        return form, (lambda p, x: pol.cast_to_output(
            _combo_apply(pol.cast_to_compute(p), pol.cast_to_compute(x)))), tx, params
    name, kw = form.split("-")[0], {}
    if name == "apex":
        kw = {"opt_level": form[5:], **({"loss_scale": "dynamic"} if form == "apex-O3" else {})}
    elif name == "naive":
        kw = {"initial_scale": 2.0 ** rng.choice([4, 12]), "hysteresis": rng.choice([1, 2]),
              "clip_grad": rng.choice([0, 0.5]), "log_num_zeros_in_grad": rng.random() < 0.5}
    elif name == "torch":
        kw = {"init_scale": 2.0 ** rng.choice([4, 12]), "growth_interval": rng.choice([1, 4])}
    amp = mpfunc.convert_to_amp(_combo_apply, inner, mode=name, **kw)
    return form, amp.apply_fn, amp.optimizer, amp.cast_params(params)


# Seeds 0-15 draw every form and every inner optimizer at least once; the other 24 run in
# the slow suite (about 16 s of the default suite's time).
@pytest.mark.parametrize("seed", [s if s < 16 else pytest.param(s, marks=pytest.mark.slow)
                                  for s in range(40)])
def test_random_combinations_skip_exactly(seed):
    rng, data = random.Random(seed), np.random.default_rng(seed)
    form, apply_fn, tx, params = _combo_setup(rng, seed)

    def step(params, state, x, y, fault, pos):
        def loss_fn(p):
            with jax.numpy_dtype_promotion("standard"):
                loss = jnp.mean(jnp.square(apply_fn(p, x).astype(jnp.float32) - y))
            # A factor, not a where over the loss: where's gradient would be 0 * inf.
            loss = loss * jnp.where(fault == 1, jnp.inf, jnp.where(fault == 2, jnp.nan, 1.0))
            return loss if form == "value_and_grad" else mpfunc.scale_loss(loss, state)

        if form == "value_and_grad":
            out = mpfunc.value_and_grad(loss_fn)(state, params)
            grads = out.grads
        else:
            grads = jax.grad(loss_fn)(params)
        w = grads["dense_1"]["w"].reshape(-1)
        bad = jnp.where(fault == 3, jnp.inf, jnp.nan).astype(w.dtype)
        w = jnp.where((fault >= 3) & (jnp.arange(w.size) == pos), bad, w)
        grads = {**grads, "dense_1": {"w": w.reshape(grads["dense_1"]["w"].shape)}}
        if form == "value_and_grad":
            grads = out._replace(grads=grads, finite=out.finite & mpfunc.all_finite(grads))
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1) if rng.random() < 0.5 else ())
    state = tx.init(params)
    taken = 0
    for i in range(12):
        x = jnp.asarray(data.standard_normal((4, 6)), jnp.float32)
        y = jnp.asarray(data.standard_normal((4, 3)), jnp.float32)
        fault = rng.randint(1, 4) if rng.random() < 0.3 else 0
        before = [np.array(a) for a in jax.tree.leaves((params, state.inner_state))]
        skipped_before = int(state.skipped_steps)
        params, state = step(params, state, x, y, jnp.int32(fault), jnp.int32(i % 24))
        skipped = int(state.skipped_steps) > skipped_before
        assert skipped or not fault, (form, i, fault)
        assert skipped != bool(state.last_finite)
        if skipped:
            after = [np.array(a) for a in jax.tree.leaves((params, state.inner_state))]
            for a, b in zip(before, after, strict=True):
                np.testing.assert_array_equal(bits(a), bits(b))
        taken += not skipped
        for leaf in jax.tree.leaves((params, state)):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert np.isfinite(np.asarray(leaf, np.float32)).all(), (form, i)
    assert taken, form  # not vacuous: some steps were taken


# Issue 30: outside `jit` (and with the state closed over under `jit`/`pmap`) an inner
# state's Python constants reach the jaxpr as Literals. The whole class: a literal that
# stays, a literal that changes (a Python counter), an input passed through, one value
# feeding two leaves, and a literal in the updates.
def _odd_inner(kind):
    def init(params):
        return {"foo": 1, "count": 0, "arr": jnp.zeros((2,), jnp.float32)}

    def update(g, state, params=None, **extra):
        twice = g["w"] * 2.0
        new = dict(state)
        if kind == "literal_counter":
            new["count"] = state["count"] + 1
        if kind == "duplicated":
            new["arr"], new["foo"] = twice, twice
        if kind == "produced":
            new["arr"] = state["arr"] + g["w"]
        upd = {"w": -twice} if kind != "literal_update" else {"w": jnp.float32(0.5) + 0 * twice}
        return upd, new

    def init_dup(params):
        return {**init(params), "foo": jnp.zeros((2,), jnp.float32)}

    return optax.GradientTransformationExtraArgs(init_dup if kind == "duplicated" else init,
                                                 update)


ODD_KINDS = ["literal", "literal_counter", "passthrough", "duplicated", "literal_update",
             "produced"]


def _odd_tx(kind, form):
    inner = optax.chain(optax.sgd(0.1), _odd_inner(kind))
    if form == "wrapper":
        return mpfunc.dynamic_scale(inner, init_scale=8.0, growth_interval=2)
    return mpfunc.chain(mpfunc.dynamic_scale(init_scale=8.0, growth_interval=2),
                        optax.sgd(0.1), _odd_inner(kind))


def _run_odd(tx, how, n=5):
    p = {"w": jnp.array([0.5, -0.0], jnp.float32)}
    s = tx.init(p)
    history = []
    for step in range(n):
        g = {"w": jnp.array([1.0, 2.0], jnp.float32) * (step + 1)}
        if step in (1, 3):
            g["w"] = g["w"].at[1].set(jnp.inf if step == 1 else jnp.nan)
        if how == "eager":
            u, s2 = tx.update(g, s, p)
        elif how == "jit":
            u, s2 = jax.jit(tx.update)(g, s, p)
        elif how == "jit_closure":  # the state's constants stay Python values
            u, s2 = jax.jit(lambda g, s=s, p=p: tx.update(g, s, p))(g)
        else:  # pmap over one device, state closed over
            out = jax.pmap(lambda g, s=s, p=p: tx.update(g, s, p))(
                jax.tree.map(lambda x: x[None], g))
            u, s2 = jax.tree.map(lambda x: x[0], out)
        p2 = optax.apply_updates(p, u)
        if step in (1, 3):  # skipped: params and every inner state value unchanged
            assert not bool(s2.last_finite)
            assert_bitwise(p2, p)
            assert_bitwise(jax.tree.map(jnp.asarray, s2.inner_state),
                           jax.tree.map(jnp.asarray, s.inner_state))
        else:
            assert bool(s2.last_finite)
        history.append((p2, jax.tree.map(jnp.asarray, s2)))
        p, s = p2, s2
    return history


# The wrapper form for every kind, the chain form for two (the chain's own state handling
# is one code path for all kinds); the other chain cases run in the slow suite (5 s).
@pytest.mark.parametrize("kind, form", [
    (k, f) if f == "wrapper" or k in ("literal", "produced") else
    pytest.param(k, f, marks=pytest.mark.slow)
    for k in ODD_KINDS for f in ("wrapper", "chain")])
def test_inner_state_constants_eager_jit_and_pmap_agree(kind, form):
    runs = {how: _run_odd(_odd_tx(kind, form), how)
            for how in ("eager", "jit", "jit_closure", "pmap")}
    for how in ("jit", "jit_closure", "pmap"):
        # The same skips and scales exactly; values to an ulp (XLA fuses a jitted step's
        # arithmetic, eager runs op by op). The skips' exactness is asserted in the run.
        la, ta = jax.tree.flatten(runs["eager"])
        lb, tb = jax.tree.flatten(runs[how])
        assert ta == tb, how
        for a, b in zip(la, lb, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-7, err_msg=how)
    final = runs["eager"][-1][1].inner_state
    if kind == "literal_counter":  # three steps taken, two skipped: the counter says 3
        assert int(jax.tree.leaves(final)[1]) == 3


def test_issue_30_snippet_runs_eagerly():
    def init_fn(params):
        return {"foo": 1}

    def update_fn(grads, state, params=None, **extra):
        return grads, state

    inner = optax.chain(optax.sgd(0.1), optax.GradientTransformationExtraArgs(init_fn, update_fn))
    tx = mpfunc.dynamic_scale(inner)
    p = {"w": jnp.ones(3)}
    u, s = tx.update({"w": jnp.ones(3)}, tx.init(p), p)
    np.testing.assert_allclose(np.asarray(u["w"]), -0.1 / 65536, rtol=1e-6)
    assert int(s.inner_state[1]["foo"]) == 1


# optax's own stateful transforms, eagerly: skips exact to the bit, taken steps equal to
# the bare optimizer run eagerly (to an ulp: optax jits some helpers, which then fuse,
# while the skip evaluates their body op by op).
EAGER_INNERS = ["adam", "inject_hyperparams", "multisteps", "schedule_free", "muon",
                "apply_if_finite", "masked", "adam_schedule", "noisy_sgd"]


# The wrapper form for every inner, the chain form for three; the other chain cases run
# in the slow suite (4 s).
@pytest.mark.parametrize("name, form", [
    (n, f) if f == "wrapper" or n in ("adam", "multisteps", "muon") else
    pytest.param(n, f, marks=pytest.mark.slow)
    for n in EAGER_INNERS for f in ("wrapper", "chain")])
def test_optax_stateful_inners_run_eagerly(name, form):
    def make():
        inner = INNERS[name]()
        if form == "wrapper":
            return mpfunc.dynamic_scale(inner, init_scale=64.0, growth_interval=3)
        return mpfunc.chain(mpfunc.dynamic_scale(init_scale=64.0, growth_interval=3), inner)

    tx = make()
    # The bare inner, eagerly, on the steps that are taken: the skipped ones never reach it.
    inner = INNERS[name]()
    ref = (PARAMS, inner.init(PARAMS))
    params, state = PARAMS, tx.init(PARAMS)
    for step in range(7):
        g = grads_for(step, PARAMS)
        before = (params, state.inner_state)
        scale = state.loss_scale
        u, state = tx.update(jax.tree.map(lambda x, scale=scale: x * scale, g), state, params)
        params = optax.apply_updates(params, u)
        if step in BAD:
            assert not bool(state.last_finite)
            assert_bitwise((params, state.inner_state), before)
            continue
        assert bool(state.last_finite)
        ru, rs = inner.update(g, ref[1], ref[0])
        ref = (optax.apply_updates(ref[0], ru), rs)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref[0]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert int(state.skipped_steps) == 3
