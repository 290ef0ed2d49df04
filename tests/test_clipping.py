"""Tests for mpfunc._src.clipping: global-norm clipping that is global over mesh axes.

Inside ``shard_map`` each device sees only its gradient blocks. ``optax.clip_by_global_norm``
then clips by the local norm, so tensor-parallel blocks of one weight are scaled
differently and replicated params drift apart across devices. ``mpfunc.clip_by_global_norm``
psums the squares over the model axes, counting replicated leaves once.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from lenient import lenient

import mpfunc

D, H, OUT, B = 16, 32, 8, 32
# Megatron-style split on a ("data", "model") = (4, 2) mesh: w1 by columns, w2 by rows,
# b2 and the output gain g replicated across "model" (counted once in the norm).
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None),
         "b2": P(), "g": P()}


def mesh_2d():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": (rng.normal(size=(D, H)) / np.sqrt(D)).astype(np.float32),
            "b1": (rng.normal(size=H) * 0.1).astype(np.float32),
            "w2": (rng.normal(size=(H, OUT)) / np.sqrt(H)).astype(np.float32),
            "b2": (rng.normal(size=OUT) * 0.1).astype(np.float32),
            "g": np.ones(OUT, np.float32)}


def random_grads(seed=1, scale=3.0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: (rng.normal(size=p.shape) * scale).astype(np.float32),
                        init_params())


def place(tree, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in tree.items()}


def clip_in_shard_map(clip, check_vma, per_device_b2=False):
    """Runs ``clip`` on sharded gradients inside shard_map; returns the clipped tree.

    With ``per_device_b2`` the replicated b2's clipped value is returned from every
    device (stacked), so that copies which disagree are visible.
    """
    mesh = mesh_2d()

    def f(g):
        u, _ = clip.update(g, clip.init(g))
        if per_device_b2:
            return u, u["b2"][None]
        return u

    out_specs = (SPECS, P(("data", "model"))) if per_device_b2 else SPECS
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(SPECS,), out_specs=out_specs,
                                 check_vma=check_vma))(place(random_grads(), mesh))


def reference_clip(max_norm):
    g = random_grads()
    u, _ = optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())
    return g, u


# --- the problem ---------------------------------------------------------------------

def test_optax_clip_inside_shard_map_clips_each_shard_by_its_own_norm():
    grads, want = reference_clip(1.0)
    got, b2_copies = clip_in_shard_map(optax.clip_by_global_norm(1.0), check_vma=False,
                                       per_device_b2=True)
    # w1's two column blocks were scaled by different (local) factors.
    full = np.asarray(grads["w1"])
    ratios = [float(np.asarray(got["w1"])[0, c] / full[0, c]) for c in (0, H - 1)]
    assert abs(ratios[0] - ratios[1]) > 1e-3 * ratios[0], ratios
    assert not np.allclose(np.asarray(got["w1"]), np.asarray(want["w1"]), rtol=1e-3)
    # The replicated b2 gets a different update on the two model columns: replicas diverge.
    b2_copies = np.asarray(b2_copies)  # (8, OUT): devices in (data, model) order
    assert not np.allclose(b2_copies[0], b2_copies[1], rtol=1e-3)


def test_optax_clip_inside_shard_map_is_caught_by_varying_axes_typing():
    # With check_vma=True (the default) the divergence is a trace-time error instead: the
    # replicated b2's clipped value now varies over "model", contradicting its out_spec.
    with pytest.raises(ValueError, match=r"out_specs\['b2'\] is P\(\).*varying over \{model\}"):
        clip_in_shard_map(optax.clip_by_global_norm(1.0), check_vma=True)


# --- the fix -------------------------------------------------------------------------

@pytest.mark.parametrize("check_vma", [True, False])
def test_an_axis_left_out_of_axis_name_is_a_clear_error(check_vma):
    # specs (or the typing) say w1 is split over "model", axis_name names only "data".
    # With check_vma=False the "model" shards took their own norms and the replicated
    # b2 diverged, silently; with check_vma=True it was shard_map's out_specs error.
    specs = None if check_vma else SPECS
    clip = mpfunc.clip_by_global_norm(1.0, axis_name="data", specs=specs)
    with pytest.raises(ValueError, match=r"mesh axes \('model',\) that are not in "
                                         r"`axis_name` \('data'\).*"
                                         r"axis_name=\('data', 'model'\)"):
        clip_in_shard_map(clip, check_vma)


@pytest.mark.parametrize("check_vma", [True, False])
def test_axis_aware_clip_equals_unsharded_clip(check_vma):
    grads, want = reference_clip(1.0)
    assert float(optax.tree.norm(grads)) > 10  # clipping is active
    specs = None if check_vma else SPECS
    clip = mpfunc.clip_by_global_norm(1.0, axis_name=("data", "model"), specs=specs)
    got, b2_copies = clip_in_shard_map(clip, check_vma, per_device_b2=True)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=2e-6, atol=0)
    b2_copies = np.asarray(b2_copies)
    assert (b2_copies == b2_copies[0]).all()  # every device applied the same factor


@pytest.mark.parametrize("check_vma", [True, False])
def test_global_norm_counts_replicated_leaves_once(check_vma):
    mesh = mesh_2d()
    grads = random_grads()
    specs = None if check_vma else SPECS

    def f(g):
        return mpfunc.global_norm(g, ("data", "model"), specs=specs)[None]

    got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(SPECS,), out_specs=P(("data", "model")),
                                check_vma=check_vma))(place(grads, mesh))
    want = float(optax.tree.norm(grads))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_leaves_sharded_over_both_axes_and_spec_prefixes():
    # An FSDP-inside-shard_map leaf split over both axes, given as a tuple entry, and a
    # single spec standing for a whole subtree.
    mesh = mesh_2d()
    rng = np.random.default_rng(3)
    grads = {"big": rng.normal(size=(16, 4)).astype(np.float32),
             "rep": {"a": np.ones(3, np.float32), "b": np.full(2, 2.0, np.float32)}}
    specs = {"big": P(("data", "model"), None), "rep": P()}
    placed = {"big": jax.device_put(grads["big"], NamedSharding(mesh, specs["big"])),
              "rep": jax.device_put(grads["rep"], NamedSharding(mesh, P()))}
    want = float(optax.tree.norm(grads))
    for check_vma, s in ((True, None), (False, specs)):
        f = jax.shard_map(lambda g, s=s: mpfunc.global_norm(g, ("data", "model"), specs=s)[None],
                          mesh=mesh, in_specs=(specs,), out_specs=P(("data", "model")),
                          check_vma=check_vma)
        np.testing.assert_allclose(np.asarray(jax.jit(f)(placed)), want, rtol=1e-6)


SHAPES = {"a": (2, 3), "b": (6,), "c": (1,), "d": (3, 1, 2)}  # fixed: compiled once
values_st = st.lists(st.floats(-1e3, 1e3, width=32), min_size=19, max_size=19)


@given(values_st, st.floats(0.01, 100.0))
def test_without_axes_it_is_optax_clip_by_global_norm(values, max_norm):
    flat, tree = np.asarray(values, np.float32), {}
    for k, shape in SHAPES.items():
        n = int(np.prod(shape))
        tree[k], flat = jnp.asarray(flat[:n].reshape(shape)), flat[n:]
    want, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
    # Eager, with fixed shapes: every primitive compiles once for all examples.
    got, _ = mpfunc.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=0)
    assert float(mpfunc.global_norm(tree)) == pytest.approx(float(optax.tree.norm(tree)),
                                                             rel=1e-6)


def test_half_gradients_are_summed_in_float32():
    g = {"w": jnp.full((4096,), 8.0, jnp.float16)}  # sum of squares 262144 > f16 max
    assert float(mpfunc.global_norm(g)) == 512.0
    u, _ = mpfunc.clip_by_global_norm(1.0).update(g, optax.EmptyState())
    assert u["w"].dtype == jnp.float16 and float(u["w"][0]) == pytest.approx(1 / 64)


def test_bad_arguments():
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="`max_norm`"):
            mpfunc.clip_by_global_norm(bad)
    for bad in ("1.0", None, True):
        with pytest.raises(TypeError, match="`max_norm`"):
            mpfunc.clip_by_global_norm(bad)
    with pytest.raises(ValueError, match="`axis_name` too"):
        mpfunc.global_norm({"w": jnp.ones(2)}, specs={"w": P()})
    # A bad axis name is refused where it is passed, naming the argument (before: a
    # jax error from inside psum at the first traced update, or none at all).
    for bad in ((), 1.5, ("data", 2.0), {"data"}):
        with pytest.raises(TypeError, match="`axis_name`"):
            mpfunc.clip_by_global_norm(1.0, axis_name=bad)
        with pytest.raises(TypeError, match="`axis_name`"):
            mpfunc.global_norm({"w": jnp.ones(2)}, bad)
    mesh = mesh_2d()
    placed = place(random_grads(), mesh)

    def run(fn, check_vma):
        return jax.jit(jax.shard_map(lambda g: fn(g)[None], mesh=mesh, in_specs=(SPECS,),
                                     out_specs=P(("data", "model")), check_vma=check_vma))(placed)

    with pytest.raises(ValueError, match="`specs` is required"):
        run(lambda g: mpfunc.global_norm(g, "model"), check_vma=False)
    with pytest.raises(ValueError, match="`specs` must be a PartitionSpec"):
        run(lambda g: mpfunc.global_norm(g, "model", specs={"w1": P()}), check_vma=True)


# --- training: DP + TP equals one device, with clipping active -------------------------

def forward(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return (h @ p["w2"] + p["b2"]) * p["g"]


def sharded_forward(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])             # column-parallel
    out = jax.lax.psum(h @ p["w2"], "model") + p["b2"]  # row-parallel
    return out * p["g"]


def data(steps, seed=2):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.normal(size=(B, D)).astype(np.float32)
        yield x, (np.sin(x[:, :OUT] * 3) + x[:, OUT:2 * OUT]).astype(np.float32)


MAX_NORM = 0.05
STEPS = 8


def train_unsharded():
    opt = mpfunc.dynamic_scale(optax.chain(optax.clip_by_global_norm(MAX_NORM),
                                           lenient(optax.adam(1e-2))))
    params = init_params()
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):
        def loss_fn(p):
            loss = jnp.mean(jnp.square(forward(p, x) - y))
            return mpfunc.scale_loss(loss, state), loss

        g, loss = jax.grad(loss_fn, has_aux=True)(params)
        norm = optax.tree.norm(jax.tree.map(lambda a: a / state.loss_scale, g))
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss, norm

    out = []
    for x, y in data(STEPS):
        params, state, loss, norm = step(params, state, x, y)
        out.append((float(loss), float(norm)))
    return params, out


def train_sharded():
    mesh = mesh_2d()
    opt = mpfunc.dynamic_scale(
        optax.chain(mpfunc.clip_by_global_norm(MAX_NORM, axis_name=("data", "model")),
                    lenient(optax.adam(1e-2))),
        axis_name=("data", "model"))
    params = place(init_params(), mesh)
    state_specs = mpfunc.state_sharding(opt, SPECS)
    state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=(SPECS,),
                                  out_specs=state_specs))(params)

    def step(params, state, x, y):
        def loss_fn(p):
            loss = jax.lax.pmean(jnp.mean(jnp.square(sharded_forward(p, x) - y)), "data")
            return mpfunc.scale_loss(loss, state), loss

        g, loss = jax.grad(loss_fn, has_aux=True)(params)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    step = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(SPECS, state_specs, P("data"), P("data")),
        out_specs=(SPECS, state_specs, P())))
    losses = []
    for x, y in data(STEPS):
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    return params, losses, state


def test_dp_tp_training_with_clipping_equals_one_device():
    ref_params, ref = train_unsharded()
    params, losses, state = train_sharded()
    assert all(norm > 2 * MAX_NORM for _, norm in ref), ref  # clipping active every step
    assert int(state.skipped_steps) == 0
    # Tolerance: the sharded run sums the same float32 products in another order (the
    # psums), ~1e-7 relative per step; Adam over 8 steps keeps it below 1e-5.
    np.testing.assert_allclose(losses, [loss for loss, _ in ref], rtol=1e-5)
    for k in ref_params:
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(ref_params[k]),
                                   rtol=1e-5, atol=1e-6)


ALL_MODES = [("torch", {}), ("torch", {"dtype": "bfloat16"}), ("bf16", {}),
             ("naive", {"initial_scale": 2.0**12}), ("apex", {"opt_level": "O0"}),
             ("apex", {"opt_level": "O1"}), ("apex", {"opt_level": "O2"}),
             ("apex", {"opt_level": "O3"})]


@pytest.mark.parametrize("mode, cfg", ALL_MODES, ids=["torch", "torch-bf16", "bf16", "naive",
                                                      "O0", "O1", "O2", "O3"])
def test_every_mode_under_shard_map_dp_tp_with_global_clipping(mode, cfg):
    # convert_to_amp inside shard_map: the model's own psum under autocast or half
    # params, axis-aware clipping inside the scale link, and an inf in one model column's
    # w1 gradient shard (4 of 8 devices) on step 1: all 8 skip, nothing changes.
    mesh, axes = mesh_2d(), ("data", "model")
    inner = optax.chain(mpfunc.clip_by_global_norm(MAX_NORM, axis_name=axes),
                        lenient(optax.adam(1e-2)))
    amp = mpfunc.convert_to_amp(sharded_forward, inner, mode=mode, axis_name=axes, **cfg)
    params = place(amp.cast_params(init_params()), mesh)
    state_specs = mpfunc.state_sharding(amp.optimizer, SPECS)
    state = jax.jit(jax.shard_map(amp.optimizer.init, mesh=mesh, in_specs=(SPECS,),
                                  out_specs=state_specs))(params)

    def step(params, state, x, y, poison):
        def loss_fn(p):
            loss = jnp.mean(jnp.square(amp.apply_fn(p, x) - y))
            loss = jax.lax.pmean(loss, "data")
            return mpfunc.scale_loss(loss, state), loss

        g, loss = jax.grad(loss_fn, has_aux=True)(params)
        col = jax.lax.axis_index("model")
        g["w1"] = jnp.where(poison == col, g["w1"].at[0, 0].set(jnp.inf), g["w1"])
        u, state = amp.optimizer.update(g, state, params)
        decision = jnp.broadcast_to(state.last_finite, (1, 1))
        return optax.apply_updates(params, u), state, loss, decision

    step = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(SPECS, state_specs, P("data"), P("data"), P()),
        out_specs=(SPECS, state_specs, P(), P("data", "model"))))
    losses = []
    for i, (x, y) in enumerate(data(3)):
        before = jax.device_get((params, state.inner_state))
        params, state, loss, decision = step(params, state, x, y, jnp.int32(1 if i == 1 else -1))
        losses.append(float(loss))
        after = jax.device_get((params, state.inner_state))
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after),
                                                         jax.tree.leaves(before)))
        if i == 1:
            assert not np.asarray(decision).any() and same, "a device stepped on the overflow"
        else:
            assert np.asarray(decision).all() and not same
    assert np.isfinite(losses).all() and int(state.skipped_steps) == 1


@pytest.mark.parametrize("check_vma", [True, False])
def test_naive_clip_grad_and_zero_count_keys_are_global_under_shard_map(check_vma):
    # convert_to_amp's own clip_grad and log_num_zeros_in_grad keys with axis_name: the
    # norm and the count are the whole model's on every device (specs= tells them how
    # the gradients are sharded when the varying-axes typing is off), so DP + TP
    # training equals the unsharded run with the same keys.
    axes = ("data", "model")
    keys = dict(mode="naive", initial_scale=2.0**12, clip_grad=MAX_NORM,
                log_num_zeros_in_grad=True)
    batches = []
    for x, y in data(4):
        x = x.copy()
        x[:, :3] = 0.0  # w1's first 3 rows get exactly-zero gradients: 3 x H zeros
        batches.append((x, y))

    ref = mpfunc.convert_to_amp(forward, lenient(optax.adam(1e-2)), **keys)
    params = ref.cast_params(init_params())
    state = ref.optimizer.init(params)

    @jax.jit
    def ref_step(params, state, x, y):
        def loss_fn(p):
            return mpfunc.scale_loss(jnp.mean(jnp.square(ref.apply_fn(p, x) - y)), state)

        g = jax.grad(loss_fn)(params)
        u, state = ref.optimizer.update(g, state, params)
        return optax.apply_updates(params, u), state

    ref_zeros = []
    for x, y in batches:
        params, state = ref_step(params, state, x, y)
        ref_zeros.append(int(mpfunc.scale_metrics(state)["num_zeros_in_grad"]))
    assert all(z >= 3 * H for z in ref_zeros)

    mesh = mesh_2d()
    amp = mpfunc.convert_to_amp(sharded_forward, lenient(optax.adam(1e-2)), axis_name=axes,
                                specs=None if check_vma else SPECS, **keys)
    sparams = place(amp.cast_params(init_params()), mesh)
    state_specs = mpfunc.state_sharding(amp.optimizer, SPECS)
    sstate = jax.jit(jax.shard_map(amp.optimizer.init, mesh=mesh, in_specs=(SPECS,),
                                   out_specs=state_specs, check_vma=check_vma))(sparams)

    def step(params, state, x, y):
        def loss_fn(p):
            loss = jax.lax.pmean(jnp.mean(jnp.square(amp.apply_fn(p, x) - y)), "data")
            return mpfunc.scale_loss(loss, state)

        g = jax.grad(loss_fn)(params)
        if not check_vma:  # without the typing, the data-parallel mean is explicit
            g = jax.lax.pmean(g, "data")
        u, state = amp.optimizer.update(g, state, params)
        zeros = mpfunc.scale_metrics(state)["num_zeros_in_grad"]
        return optax.apply_updates(params, u), state, jnp.broadcast_to(zeros, (1, 1))

    step = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(SPECS, state_specs, P("data"), P("data")),
        out_specs=(SPECS, state_specs, P("data", "model")), check_vma=check_vma))
    for (x, y), want in zip(batches, ref_zeros):
        sparams, sstate, zeros = step(sparams, sstate, x, y)
        assert (np.asarray(zeros) == want).all(), (np.asarray(zeros), want)
    for k in params:
        np.testing.assert_allclose(np.asarray(sparams[k], np.float32),
                                   np.asarray(params[k], np.float32), rtol=2e-3, atol=2e-4)


def test_convert_to_amp_specs_needs_axis_name():
    with pytest.raises(ValueError, match="`specs` says how the gradients are sharded"):
        mpfunc.convert_to_amp(forward, optax.sgd(0.1), mode="naive", clip_grad=1.0,
                              specs=SPECS)
