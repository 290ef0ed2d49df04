"""Tests for mpfunc._src.fp8.matmul and fp8_convert: the fp8 dot, delayed state, convert_to_fp8."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from donation import assert_own_buffers
from fp8_reference import ref_cast, ref_dequantize, ref_quantize, ref_scale
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import mpfunc
from _mpfunc_common.fp8 import resolve_recipe

RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise"]


def qdq(a, role, recipe, scale=None):
    """The reference's quantise-dequantise of one operand (contraction dim last), with
    its own scales, or with a given per-tensor ``scale`` (delayed scaling)."""
    r = resolve_recipe(recipe)
    if scale is not None:
        s = np.float32(scale)
        return ref_dequantize(ref_cast(a * s, r.dtype(role)), s)
    block = r.block(role)
    q, s = ref_quantize(a, r.dtype(role), block, r.margin, r.power_of_2_scales)
    return ref_dequantize(q, s, block)


def rel_err(a, b):
    a, b = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def data(m=48, k=256, n=160, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    r = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)  # the output gradient
    return x, w, r


@functools.partial(jax.jit, static_argnums=(3,))
def dot_and_grads(x, w, r, recipe, state=None):
    def loss(x, w, s):
        return jnp.sum(mpfunc.fp8_dot(x, w, recipe, s) * r)

    y = mpfunc.fp8_dot(x, w, recipe, state)
    gx, gw, ns = jax.grad(loss, argnums=(0, 1, 2))(x, w, state)
    return y, gx, gw, ns


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_dot_matches_the_reference_forward_and_backward(recipe):
    # Forward: e4m3 x and w. Backward: e5m2 output gradient, each operand quantised
    # along its own contraction dim (rowwise/blockwise re-quantise per GEMM).
    x, w, r = data()
    y, gx, gw, _ = dot_and_grads(x, w, r, recipe)
    ry = qdq(x, "input", recipe) @ qdq(w.T, "weight", recipe).T
    rgx = qdq(r, "grad_output", recipe) @ qdq(w, "weight", recipe).T
    rgw = qdq(x.T, "input", recipe) @ qdq(r.T, "grad_output", recipe).T
    np.testing.assert_allclose(y, ry, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(gx, rgx, rtol=2e-5, atol=1e-8)
    np.testing.assert_allclose(gw, rgw, rtol=2e-5, atol=1e-8)
    # ... and fp8 is fp8: a few % off the float32 products, not 1e-7.
    assert 1e-3 < rel_err(y, x @ w) < 0.1
    assert 1e-3 < rel_err(gw, x.T @ r) < 0.2


def _dots(jaxpr):
    """Every ``dot_general`` of a jaxpr and its sub-jaxprs, with the eqns that use its
    output (in the same jaxpr)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out = eqn.outvars[0]
            users = [e for e in jaxpr.eqns if any(v is out for v in e.invars)]
            yield eqn, users
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _dots(sub)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_gemm_is_a_dot_general_on_the_fp8_values(recipe):
    # The forward and both backward GEMMs take the fp8 arrays themselves (nothing
    # between the cast and the dot: no dequantise, clamp, select or flush), accumulate
    # in float32 and scale the output once: per tensor by one scalar (XLA's GEMM
    # rewriter pattern, flax's Fp8DirectDotGeneralOp), rowwise by row and column scales.
    # Blockwise stays emulated: its dots take dequantised float32 operands.
    x, w, r = map(jnp.asarray, data(16, 32, 16))
    state = mpfunc.fp8_dot_state(recipe) if recipe == "delayed" else None
    fwd = jax.make_jaxpr(lambda x, w: mpfunc.fp8_dot(x, w, recipe, state))(x, w)
    grad = jax.make_jaxpr(jax.grad(lambda x, w, s: jnp.sum(mpfunc.fp8_dot(x, w, recipe, s) * r),
                                   argnums=(0, 1, 2) if state else (0, 1)))(x, w, state)
    fp8 = {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)}
    for jaxpr, count in ((fwd.jaxpr, 1), (grad.jaxpr, 3)):
        dots = list(_dots(jaxpr))
        assert len(dots) == count
        for eqn, users in dots:
            dtypes = {v.aval.dtype for v in eqn.invars}
            assert eqn.params["preferred_element_type"] == jnp.float32
            if recipe == "blockwise":
                assert dtypes == {jnp.dtype(jnp.float32)}
                continue
            assert dtypes <= fp8, dtypes
            assert [u.primitive.name for u in users] == ["mul"]
            other = [v for v in users[0].invars if v is not eqn.outvars[0]][0]
            assert other.aval.shape == (() if recipe in ("tensorwise", "delayed")
                                        else (eqn.outvars[0].aval.shape[0], 1))
    # The backward's formats: e5m2 output gradient against e4m3 x and w.
    if recipe != "blockwise":
        back = [{str(v.aval.dtype) for v in e.invars} for e, _ in list(_dots(grad.jaxpr))[1:]]
        assert back == [{"float8_e5m2", "float8_e4m3fn"}] * 2


def test_xla_cpu_runs_the_fp8_dot_within_float32_rounding_of_the_emulation():
    # XLA:CPU runs dot_general on fp8 operands (jax 0.10.2: it upcasts them; their
    # products are exact in float32). Against the old emulation (dequantise, then a
    # float32 HIGHEST dot, here in float64) only the accumulation order and the one
    # output scaling differ: |difference| <= 1e-6 * max|output| (README's tolerance).
    x, w, r = data(256, 1024, 192, seed=3)
    for recipe in ("tensorwise", "rowwise"):
        y, gx, gw, _ = dot_and_grads(x, w, r, recipe)
        f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
        want = (f64(qdq(x, "input", recipe)) @ f64(qdq(w.T, "weight", recipe)).T,
                f64(qdq(r, "grad_output", recipe)) @ f64(qdq(w, "weight", recipe)).T,
                f64(qdq(x.T, "input", recipe)) @ f64(qdq(r.T, "grad_output", recipe)).T)
        for got, ref in zip((y, gx, gw), want):
            err = np.abs(np.asarray(got, np.float64) - ref).max()
            assert 0 <= err <= 1e-6 * np.abs(ref).max(), (recipe, err)


def test_the_backward_really_quantises_to_e5m2():
    x, w, r = map(jnp.asarray, data())
    text = jax.jit(jax.grad(lambda w: jnp.sum(mpfunc.fp8_dot(x, w) * r))).lower(w).as_text()
    assert "f8E4M3FN" in text and "f8E5M2" in text
    e4 = jax.jit(jax.grad(lambda w: jnp.sum(mpfunc.fp8_dot(x, w, mpfunc.Fp8Recipe(format="e4m3")) * r)))
    assert "f8E5M2" not in e4.lower(w).as_text()


def test_output_dtype_and_gradient_dtypes():
    x, w, r = data(16, 32, 16)
    xb = jnp.asarray(x, jnp.bfloat16)
    y = jax.eval_shape(lambda x, w: mpfunc.fp8_dot(x, w, out_dtype=jnp.bfloat16), xb, w)
    assert y.dtype == jnp.bfloat16
    gx, gw = jax.eval_shape(jax.grad(
        lambda x, w: jnp.sum(mpfunc.fp8_dot(x, w).astype(jnp.float32)), argnums=(0, 1)),
        xb, jnp.asarray(w))
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.float32


def ref_delayed(hist, prev, amax, name, reduction="max"):
    used = max(hist) if reduction == "max" else hist[0]
    scale = ref_scale(used, name, fallback=prev if np.isfinite(prev) and prev > 0 else 1.0)
    if np.isfinite(amax):
        hist = [np.float32(amax)] + hist[:-1]
    return scale, hist


@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_delayed_state_follows_the_rule_step_by_step(reduction):
    recipe = mpfunc.Fp8Recipe("delayed", amax_history_len=3, amax_reduction=reduction)
    x0, w, r = data(16, 32, 16)
    x0 = x0 / np.abs(x0).max()  # amax 1
    # Amaxes per step: first step (no history: the fresh scale 1.0), a zero tensor (not
    # a usable amax, still recorded), an inf (never recorded), a window of 3 rolling.
    factors = [2.0, 0.0, 8.0, np.inf, 3.0, 0.5, 0.25, 0.125]
    state = mpfunc.fp8_dot_state(recipe)
    ref = {role: ([np.float32(0)] * 3, np.float32(1)) for role in ("input", "weight", "grad_output")}
    for step, f in enumerate(factors):
        x = x0 * np.float32(f) if np.isfinite(f) else np.where(x0 == x0.max(), np.inf, x0)
        y, _, _, state = dot_and_grads(x, w, r, recipe, state)
        if step == 0:  # the cast did not wait for this step's amax: scale 1.0
            assert all(float(getattr(state, role).scale) == 1.0 for role in ref)
        amaxes = {"input": np.float32(np.abs(x).max()), "weight": np.float32(np.abs(w).max()),
                  "grad_output": np.float32(np.abs(r).max())}
        for role in ref:
            hist, prev = ref[role]
            scale, hist = ref_delayed(hist, prev, amaxes[role], recipe.dtype(role), reduction)
            ref[role] = (hist, scale)
            meta = getattr(state, role)
            np.testing.assert_array_equal(np.asarray(meta.amax_history), np.asarray(hist, np.float32))
            assert np.float32(meta.scale) == scale, (f, role)
        if np.isfinite(f):  # the forward used this step's scales
            want = qdq(x, "input", recipe, ref["input"][1]) @ qdq(w, "weight", recipe, ref["weight"][1])
            np.testing.assert_allclose(y, want, rtol=2e-5, atol=1e-6)
        else:
            assert np.isnan(np.asarray(y)).any()  # the inf is not hidden


def test_delayed_errors():
    x, w, _ = map(jnp.asarray, data(4, 16, 8))
    with pytest.raises(ValueError, match="delayed scaling needs `state`"):
        mpfunc.fp8_dot(x, w, "delayed")
    with pytest.raises(ValueError, match="`state` is only used by delayed scaling"):
        mpfunc.fp8_dot(x, w, "tensorwise", mpfunc.fp8_dot_state())
    with pytest.raises(ValueError, match=r"amax history of shape \(1024,\)"):
        mpfunc.fp8_dot(x, w, mpfunc.Fp8Recipe("delayed", amax_history_len=8),
                       mpfunc.fp8_dot_state())
    with pytest.raises(ValueError, match="`recipe` must use delayed scaling"):
        mpfunc.fp8_dot_state("rowwise")
    with pytest.raises(ValueError, match=r"`x` must be \[..., K\]"):
        mpfunc.fp8_dot(x, w.T)
    with pytest.raises(ValueError, match="`axis_name` applies to per-tensor"):
        mpfunc.fp8_dot(x, w, "rowwise", axis_name="data")


def test_delayed_state_never_goes_through_the_loss_scale():
    # The state's update comes back as its "gradient", but from its own argument: the
    # loss scale sees only the params' gradients, so it can neither unscale the
    # histories nor skip on them. The output-gradient history records the *scaled*
    # gradient (what really is quantised); the input/weight histories are exact.
    x, w, r = map(jnp.asarray, data(16, 32, 16))
    opt = mpfunc.dynamic_scale(optax.sgd(0.1), init_scale=2.0**10)

    @jax.jit
    def step(params, opt_state, fp8, x):
        def loss(p, s):
            return mpfunc.scale_loss(jnp.sum(mpfunc.fp8_dot(x, p["w"], "delayed", s) * r),
                                     opt_state)

        g, new_fp8 = jax.grad(loss, argnums=(0, 1))(params, fp8)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_fp8

    params = {"w": w}
    opt_state = opt.init(params)
    fp8 = mpfunc.fp8_dot_state()
    p1, opt_state, fp8 = step(params, opt_state, fp8, x)
    assert float(fp8.input.amax_history[0]) == float(jnp.abs(x).max())
    assert float(fp8.weight.amax_history[0]) == float(jnp.abs(w).max())
    assert float(fp8.grad_output.amax_history[0]) == 2.0**10 * float(jnp.abs(r).max())
    # From a state with a history, the same step without a loss scale moves the params
    # identically: the output gradient's history, so its scale, differs by the loss
    # scale, a power of two, which commutes with every rounding here.
    def plain_loss(w, fp8):
        return jnp.sum(mpfunc.fp8_dot(x, w, "delayed", fp8) * r)

    @jax.jit
    def plain_step(w, fp8):
        g = jax.grad(plain_loss)(w, fp8)
        sgd = optax.sgd(0.1)
        return optax.apply_updates(w, sgd.update(g, sgd.init(w))[0])

    plain_fp8 = jax.grad(plain_loss, argnums=1)(w, mpfunc.fp8_dot_state())
    assert float(plain_fp8.grad_output.amax_history[0]) == float(jnp.abs(r).max())
    scaled, _, _ = step(params, opt.init(params), fp8, x)
    np.testing.assert_array_equal(scaled["w"], plain_step(w, plain_fp8))
    # An overflow step is skipped for params and optimizer state; the fp8 state keeps
    # its finite history (the inf amax is not recorded).
    bad = x.at[0, 0].set(jnp.inf)
    p2, opt_state2, fp8_2 = step(p1, opt_state, fp8, bad)
    np.testing.assert_array_equal(p2["w"], p1["w"])
    assert int(mpfunc.scale_metrics(opt_state2)["skipped_steps"]) == 1
    np.testing.assert_array_equal(fp8_2.input.amax_history, fp8.input.amax_history)


def test_flax_dynamic_scale_corrupts_flax_fp8_meta():
    # Why the state must stay out of the loss scale (a finding pinned, flax 0.12.8):
    # flax's DynamicScale divides every "gradient" by the scale, including the fp8
    # meta that flax passes back through the gradient (overwrite-with-gradient).
    import flax.linen as nn
    from flax.training.dynamic_scale import DynamicScale

    x = jnp.asarray(data(8, 16, 4)[0])
    model = nn.Dense(4, dot_general_cls=nn.Fp8DirectDotGeneralOp)
    variables = model.init(jax.random.PRNGKey(0), x)
    loss = lambda v: jnp.sum(model.apply(v, x))  # noqa: E731
    plain = jax.jit(jax.grad(loss))(variables)["_overwrite_with_gradient"]
    ds = DynamicScale(scale=jnp.asarray(2.0**10, jnp.float32))
    scaled = jax.jit(ds.value_and_grad(loss))(variables).grad["_overwrite_with_gradient"]
    h_plain = plain["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
    h_scaled = scaled["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
    assert float(h_plain[0]) == float(jnp.abs(x).max())
    assert float(h_scaled[0]) == float(jnp.abs(x).max()) / 2.0**10  # corrupted


@pytest.mark.parametrize("check_vma", [True, False])
def test_amax_is_max_reduced_under_shard_map(check_vma):
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    x, w, r = data(8 * 4, 32, 16)
    x = x * np.repeat(2.0 ** np.arange(8), 4)[:, None].astype(np.float32)  # shards differ
    state = mpfunc.fp8_dot_state(mpfunc.Fp8Recipe("delayed", amax_history_len=4))
    recipe = mpfunc.Fp8Recipe("delayed", amax_history_len=4)

    def local(x, r, w, s, axis_name, sharded=True):
        def loss(w, s):
            return jnp.sum(mpfunc.fp8_dot(x, w, recipe, s, axis_name=axis_name) * r)

        gw, ns = jax.grad(loss, argnums=(0, 1))(w, s)
        y = mpfunc.fp8_dot(x, w, recipe, s, axis_name=axis_name)
        # As for a plain matmul: with varying-axes typing the replicated kernel's
        # gradient comes back summed over the shards; without it, sum it by hand.
        return y, jax.lax.psum(gw, "data") if sharded and not check_vma else gw, ns

    def sharded(axis_name):
        f = jax.shard_map(functools.partial(local, axis_name=axis_name), mesh=mesh,
                          in_specs=(P("data"), P("data"), P(), P()),
                          out_specs=(P("data"), P(), P()), check_vma=check_vma)
        return jax.jit(f)(x, r, w, state)

    y_g, gw_g, ns_g = jax.jit(functools.partial(local, axis_name=None, sharded=False))(
        x, r, w, state)
    y_s, gw_s, ns_s = sharded("data")
    # Every shard recorded the global amaxes and uses the global scales.
    for a, b in zip(jax.tree.leaves(ns_s), jax.tree.leaves(ns_g)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(y_s, y_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw_s, gw_g, rtol=1e-4, atol=1e-7)
    # The control: without the reduction each shard scales by its own amax.
    f = jax.shard_map(lambda x: mpfunc.fp8_dot(x, w), mesh=mesh, in_specs=P("data"),
                      out_specs=P("data"), check_vma=check_vma)
    assert rel_err(jax.jit(f)(x), mpfunc.fp8_dot(x, w)) > 1e-3
    if check_vma:  # and delayed state without the reduction is refused, clearly
        with pytest.raises(ValueError, match="`axis_name` must name every mesh axis"):
            sharded(None)


@pytest.mark.parametrize("check_vma", [True, False])
def test_convert_to_fp8_converts_under_shard_map(check_vma):
    # With varying-axes typing shard_map marks the replicated kernel `pvary` before it
    # meets the sharded batch; the converter lost the parameter there and converted
    # nothing (no error; delayed state came back all zeros).
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    x, w, r = data(8 * 4, 32, 16)
    recipe = mpfunc.Fp8Recipe("delayed", amax_history_len=4)
    fn = lambda p, x: x @ p["w"]  # noqa: E731
    state = mpfunc.convert_to_fp8(fn, recipe).init({"w": w}, x)
    f = mpfunc.convert_to_fp8(fn, recipe, axis_name="data")

    def local(p, s, x, r):
        gw, ns = jax.grad(lambda p, s: jnp.sum(f(p, x, fp8_state=s) * r), argnums=(0, 1))(p, s)
        return (jax.lax.psum(gw, "data") if not check_vma else gw), ns

    sm = jax.shard_map(local, mesh=mesh,
                       in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P()),
                       check_vma=check_vma)
    gw_s, ns_s = jax.jit(sm)({"w": w}, state, x, r)
    one = mpfunc.convert_to_fp8(fn, recipe)
    gw_1, ns_1 = jax.grad(lambda p, s: jnp.sum(one(p, x, fp8_state=s) * r),
                          argnums=(0, 1))({"w": w}, state)
    for a, b in zip(jax.tree.leaves(ns_s), jax.tree.leaves(ns_1)):
        np.testing.assert_array_equal(a, b)
    assert float(ns_s["w"].input.amax_history[0]) == float(jnp.abs(x).max())
    np.testing.assert_allclose(gw_s["w"], gw_1["w"], rtol=1e-4, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(sm)({"w": w}, state, x, r))
    assert "f8_e4m3fn" in jaxpr and "f8_e5m2" in jaxpr


def test_sharded_jit_fsdp_style_uses_global_amaxes_without_axis_name():
    # Under jit with sharded arrays (FSDP: kernel and batch split over "data") the amax
    # is a reduction over the global array, so every device has the same state.
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    x, w, r = data(8 * 4, 32, 16)
    x = x * np.repeat(2.0 ** np.arange(8), 4)[:, None].astype(np.float32)  # shards differ
    recipe = mpfunc.Fp8Recipe("delayed", amax_history_len=4)
    state = mpfunc.fp8_dot_state(recipe)

    @jax.jit
    def step(x, w, r, s):
        def loss(w, s):
            return jnp.sum(mpfunc.fp8_dot(x, w, recipe, s) * r)

        gw, ns = jax.grad(loss, argnums=(0, 1))(w, s)
        return mpfunc.fp8_dot(x, w, recipe, s), gw, ns

    def put(a):
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, P("data")))

    y_g, gw_g, ns_g = step(x, w, r, state)
    y_s, gw_s, ns_s = step(put(x), put(w), put(r), state)
    assert not y_s.sharding.is_fully_replicated  # it really ran sharded
    for a, b in zip(jax.tree.leaves(ns_s), jax.tree.leaves(ns_g)):
        np.testing.assert_array_equal(a, b)
    assert float(ns_s.input.amax_history[0]) == float(np.abs(x).max())  # the global one
    np.testing.assert_allclose(y_s, y_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw_s, gw_g, rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------- convert_to_fp8
def mlp(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    att = jax.nn.softmax(h @ h.T)                     # activation x activation: not fp8
    h = jnp.einsum("mk,nk->mn", att @ h, p["w2"])      # a transposed kernel
    return jnp.dot(p["w3"], h.T).T                     # the kernel on the left


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": jnp.asarray(rng.standard_normal((32, 16)) * 0.2, jnp.float32),
            "b1": jnp.zeros(16, jnp.float32),
            "w2": jnp.asarray(rng.standard_normal((24, 16)) * 0.2, jnp.float32),
            "w3": jnp.asarray(rng.standard_normal((8, 24)) * 0.2, jnp.float32)}


def mlp_by_hand(p, x, recipe="tensorwise"):
    h = jnp.tanh(mpfunc.fp8_dot(x, p["w1"], recipe) + p["b1"])
    att = jax.nn.softmax(h @ h.T)
    h = mpfunc.fp8_dot(att @ h, p["w2"].T, recipe)
    return mpfunc.fp8_dot(h, p["w3"].T, recipe)


def test_delayed_state_from_init_can_be_donated():
    # fp8_dot_state once gave its three roles one shared Fp8Meta: a step donating the
    # state then failed ("Attempt to donate the same buffer twice").
    p, x = mlp_params(), jnp.asarray(data(10, 32, 8)[0])
    f = mpfunc.convert_to_fp8(mlp, mpfunc.Fp8Recipe("delayed", amax_history_len=2))
    state = f.init(p, x)
    assert_own_buffers(state)
    assert_own_buffers(mpfunc.fp8_dot_state())

    def new_state(s):
        return jax.grad(lambda s: jnp.sum(f(p, x, fp8_state=s)))(s)

    expected = jax.jit(new_state)(state)
    chex.assert_trees_all_equal(jax.jit(new_state, donate_argnums=0)(state), expected)


def test_convert_to_fp8_finds_the_dense_matmuls_only():
    # x @ w, einsum with a transposed kernel and w @ x are converted; the attention
    # products are not. The result equals the model written with fp8_dot by hand.
    p, x = mlp_params(), jnp.asarray(data(10, 32, 8)[0])
    f = mpfunc.convert_to_fp8(jax.jit(mlp))
    assert f.sites(p, x) == ["w1", "w2", "w3"]
    got = jax.jit(jax.value_and_grad(lambda p: jnp.sum(f(p, x) ** 2)))(p)
    want = jax.jit(jax.value_and_grad(lambda p: jnp.sum(mlp_by_hand(p, x) ** 2)))(p)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    bw = mpfunc.convert_to_fp8(mlp, "blockwise")
    np.testing.assert_array_equal(jax.jit(bw)(p, x),
                                  jax.jit(functools.partial(mlp_by_hand, recipe="blockwise"))(p, x))


def test_convert_to_fp8_converts_a_kernel_inside_a_scan_body():
    # A kernel used inside a scan body was left in float32 (sites ['v']); it is fp8 at
    # every iteration now, and the matmul after the loop too (tests/test_fp8_stacked.py
    # has the stacked-layer cases).
    p = {"w": mlp_params()["w2"][:16, :16], "v": mlp_params()["w3"][:, :16].T}
    x = jnp.asarray(data(10, 16, 8)[0])

    def f(p, x):
        h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ p["w"]), None), x, None, length=2)
        return h @ p["v"]

    def by_hand(p, x):
        h = jnp.tanh(mpfunc.fp8_dot(jnp.tanh(mpfunc.fp8_dot(x, p["w"])), p["w"]))
        return mpfunc.fp8_dot(h, p["v"])

    g = mpfunc.convert_to_fp8(f)
    assert g.sites(p, x) == ["w", "v"]
    np.testing.assert_allclose(jax.jit(g)(p, x), jax.jit(by_hand)(p, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_convert_to_fp8_converts_inside_jax_checkpoint(recipe):
    # Matmuls under jax.checkpoint / nn.remat were silently left out (sites ['w2']).
    # They are rewritten inside and checkpointed again, the delayed state going in as
    # an input: gradients and new state are those of the same model without remat.
    p = {"w1": mlp_params()["w2"][:16, :16], "w2": mlp_params()["w3"][:, :16].T}
    x = jnp.asarray(data(10, 16, 8)[0])

    def plain(p, x):
        return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])

    def remat(p, x):
        return jnp.sum(jax.checkpoint(lambda x: jnp.tanh(x @ p["w1"]))(x) @ p["w2"])

    a, b = mpfunc.convert_to_fp8(remat, recipe), mpfunc.convert_to_fp8(plain, recipe)
    assert a.sites(p, x) == b.sites(p, x) == ["w1", "w2"]
    if recipe == "delayed":
        s = b.init(p, x)
        got = jax.jit(jax.grad(lambda p, s: a(p, x, fp8_state=s), argnums=(0, 1)))(p, s)
        want = jax.jit(jax.grad(lambda p, s: b(p, x, fp8_state=s), argnums=(0, 1)))(p, s)
        assert float(got[1]["w1"].input.amax_history[0]) == float(jnp.abs(x).max())
    else:
        got, want = jax.jit(jax.grad(a))(p, x), jax.jit(jax.grad(b))(p, x)
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(u, v)
    kw = {"fp8_state": b.init(p, x)} if recipe == "delayed" else {}
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: a(p, x, **kw)))(p))
    assert "remat" in jaxpr or "checkpoint" in jaxpr  # still rematerialised


def test_the_fp8_mode_converts_a_linen_remat_block():
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.remat(nn.Dense)(16)(x)
            return nn.Dense(4)(jnp.tanh(x))

    x = jnp.ones((4, 8))
    v = Net().init(jax.random.key(0), x)
    f = mpfunc.convert_to_fp8(Net().apply, "delayed")
    assert f.sites(v, x) == ["params/CheckpointDense_0/kernel", "params/Dense_0/kernel"]


def test_init_and_sites_take_static_arguments_and_run_outside_shard_map():
    # flax's `train=False` was traced by `init`/`sites` (TracerBoolConversionError),
    # though a call takes it; and a converter with `axis_name` could not `init` outside
    # shard_map (unbound axis name), where the state is made.
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Dropout(0.1, deterministic=not train)(nn.Dense(16)(x))
            return nn.Dense(4)(x)

    x = jnp.ones((4, 8))
    v = Net().init(jax.random.key(0), x, train=False)
    f = mpfunc.convert_to_fp8(Net().apply, "delayed", axis_name="data")
    state = f.init(v, x, train=False)
    assert sorted(state) == ["params/Dense_0/kernel", "params/Dense_1/kernel"]
    assert f.sites(v, x, False) == sorted(state)


def test_convert_to_fp8_delayed_state_and_errors():
    p, x = mlp_params(), jnp.asarray(data(10, 32, 8)[0])
    f = mpfunc.convert_to_fp8(mlp, mpfunc.Fp8Recipe("delayed", amax_history_len=2))
    state = f.init(p, x)
    assert sorted(state) == ["w1", "w2", "w3"]
    # A weight used twice gets two states (the same kernel, two matmuls).
    tied = mpfunc.convert_to_fp8(lambda p, x: (x @ p["w"]) @ p["w"].T, "delayed")
    w = p["w1"]
    assert tied.sites({"w": w}, x) == ["w", "w#1"]
    s = tied.init({"w": w}, x)
    new = jax.jit(jax.grad(lambda s: jnp.sum(tied({"w": w}, x, fp8_state=s))))(s)
    assert float(new["w"].input.amax_history[0]) == float(jnp.abs(x).max())
    assert float(new["w#1"].weight.amax_history[0]) == float(jnp.abs(w).max())
    assert float(new["w#1"].input.amax_history[0]) > 0
    with pytest.raises(ValueError, match="delayed scaling needs `fp8_state=`"):
        f(p, x)
    with pytest.raises(ValueError, match="has no entry 'w2'"):
        f(p, x, fp8_state={"w1": state["w1"]})
    with pytest.raises(ValueError, match="only used by delayed scaling"):
        mpfunc.convert_to_fp8(mlp)(p, x, fp8_state=state)
    with pytest.raises(ValueError, match="`compute_dtype` must be None, bfloat16 or float16"):
        mpfunc.convert_to_fp8(mlp, compute_dtype=jnp.float32)
    with pytest.raises(TypeError, match="`fn` must be callable"):
        mpfunc.convert_to_fp8(3)
    with pytest.raises(TypeError, match="`axis_name` must be None, a mesh axis name"):
        mpfunc.convert_to_fp8(mlp, axis_name=3)  # accepted before
    with pytest.raises(TypeError, match="`out_dtype` must be a dtype .* got 'foo'"):
        mpfunc.fp8_dot(x, p["w1"], out_dtype="foo")
    with pytest.raises(ValueError, match="`axis_name` \\('data'\\) names mesh axes that are "
                                         "not bound here"):
        mpfunc.fp8_dot(x, p["w1"], axis_name="data")  # outside shard_map


def test_a_matmul_whose_output_misses_the_loss_restarts_like_a_fresh_state():
    # Its state's "gradient" is JAX's zero: history and scale come back 0 (pinned: no
    # way around it from inside). The zero scale was then the fallback of a step whose
    # amax is 0 (an all-zero input): 0 * (1 / 0) = NaN. Now it falls back to 1.0, as a
    # fresh state does.
    p = {"w": jnp.full((8, 4), 0.1), "aux": jnp.full((8, 4), 0.1)}
    x = jnp.full((4, 8), 3.0)
    unused = mpfunc.convert_to_fp8(
        lambda p, x: jnp.sum(x @ p["w"]) + 0 * jnp.sum(jax.lax.stop_gradient(x @ p["aux"])),
        "delayed")
    state = unused.init(p, x)
    state = jax.grad(lambda s: unused(p, x, fp8_state=s))(state)
    assert float(state["aux"].input.scale) == 0.0
    assert not np.asarray(state["aux"].input.amax_history).any()
    assert float(state["w"].input.amax_history[0]) == 3.0
    used = mpfunc.convert_to_fp8(lambda p, x: jnp.sum(x @ p["aux"]), "delayed")
    zeros = jnp.zeros_like(x)
    out, new = jax.value_and_grad(lambda s: used(p, zeros, fp8_state=s))({"aux": state["aux"]})
    assert float(out) == 0.0 and float(new["aux"].input.scale) == 1.0
    out, new = jax.value_and_grad(lambda s: used(p, x, fp8_state=s))({"aux": state["aux"]})
    fresh = jax.value_and_grad(lambda s: used(p, x, fp8_state=s))(used.init(p, x))
    assert float(out) == float(fresh[0])  # a non-zero input: as from a fresh state
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(fresh[1])):
        np.testing.assert_array_equal(a, b)


def test_convert_to_fp8_under_autocast_rules():
    # The fp8 AMP mode: dense matmuls fp8 returning bfloat16, everything else under
    # autocast(bfloat16) (softmax in float32, attention's matmul in bfloat16).
    p, x = mlp_params(), jnp.asarray(data(10, 32, 8)[0])
    f = mpfunc.convert_to_fp8(mlp, compute_dtype=jnp.bfloat16)
    # Lowered for a GPU: on CPU, autocast widens bf16 dot operands to float32 (XLA:CPU
    # cannot run every bf16 x bf16 -> f32 dot; tests/test_autocast.py).
    text = jax.export.export(jax.jit(f), platforms=["cuda"])(p, x).mlir_module()
    dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln]
    operands = [ln.split(": (")[1].split(")")[0] for ln in dots]
    assert sum("bf16" in o for o in operands) == 2            # h @ h.T, att @ h
    assert sum(o.count("xf8E4M3FN>") == 2 for o in operands) == 3  # the fp8 GEMMs
    assert "f8E4M3FN" in text
    assert jax.eval_shape(f, p, x).dtype == jnp.bfloat16


def _fp8_gpu():
    """A JAX GPU with fp8 GEMMs (compute capability >= 8.9), or None. The suite's
    conftest selects CPU unless JAX_PLATFORMS is set: run with ``JAX_PLATFORMS=cuda,cpu``
    (the CPU stays available to the other tests)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this process
        return None
    for dev in gpus:
        cc = getattr(dev, "compute_capability", None)
        if cc and tuple(int(v) for v in str(cc).split(".")[:2]) >= (8, 9):
            return dev
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_fp8_gpu() is None, reason="needs a JAX GPU with compute capability >= 8.9 "
                    "(JAX_PLATFORMS=cuda,cpu)")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_xla_rewrites_every_fp8_gemm_into_a_cublaslt_fp8_gemm(recipe):  # pragma: no cover
    # The forward and both backward GEMMs of a step are cuBLASLt fp8 GEMMs in the
    # optimized HLO, and their results match the CPU's within fp8-GEMM tolerance.
    dev = _fp8_gpu()
    x, w, r = (jax.device_put(a, dev) for a in data(64, 256, 128))
    state = mpfunc.fp8_dot_state(recipe) if recipe == "delayed" else None
    text = dot_and_grads.lower(x, w, r, recipe, state).compile().as_text()
    calls = [ln for ln in text.splitlines()
             if "custom-call(" in ln and '"__cublas$lt$matmul$f8"' in ln]
    assert len(calls) == 3, text[:4000]
    got = dot_and_grads(x, w, r, recipe, state)[:3]
    cpu = jax.devices("cpu")[0]
    want = dot_and_grads(*(jax.device_put(a, cpu) for a in (x, w, r)), recipe,
                         jax.device_put(state, cpu))[:3]
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-2,
                                   atol=2e-2 * float(np.abs(np.asarray(b)).max()))


def test_the_fp8_mode_on_a_flax_linen_model():
    # Flax's Dense kernels are converted where they reach the dot (through flax's own
    # dtype promotion); the LayerNorm params and the bias add are not.
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.gelu(nn.LayerNorm()(nn.Dense(16)(x))))

    x = jnp.asarray(data(8, 32, 4)[0])
    variables = Net().init(jax.random.key(0), x)
    amp = mpfunc.convert_to_amp(Net().apply, optax.adam(1e-3), mode="fp8", recipe="delayed")
    state = amp.apply_fn.init(variables, x)
    assert sorted(state) == ["params/Dense_0/kernel", "params/Dense_1/kernel"]

    def loss(v, s):
        return jnp.sum(amp.apply_fn(v, x, fp8_state=s) ** 2)

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, state)
    text = lowered.as_text()
    assert "f8E4M3FN" in text and "f8E5M2" in text  # forward and backward formats
    grads, new = lowered.compile()(variables, state)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    # flax names the outer Dense(4) first: Dense_1 is the one that reads x.
    assert variables["params"]["Dense_1"]["kernel"].shape == (32, 16)
    assert float(new["params/Dense_1/kernel"].input.amax_history[0]) == float(jnp.abs(x).max())
