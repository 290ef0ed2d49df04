"""Tests for mpfunc._src.fp8.stacked: fp8 through stacked layer params and scan bodies.

A scanned model (``jax.lax.scan`` over params stacked along a layer axis) and the same
model unrolled over slices ``w[i]`` get every dense GEMM in fp8 (forward, input
gradient, weight gradient), with per-layer scales and, for delayed scaling, per-layer
state stacked along the layer axis. Each is checked against the model written by hand
with `mpfunc.fp8_dot` (bit for bit: the same ops in the same program structure) and
against each other.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpfunc

RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise"]
L, HIST = 2, 4
E4, E5 = "float8_e4m3fn", "float8_e5m2"


def recipe_of(name):
    return mpfunc.Fp8Recipe("delayed", amax_history_len=HIST) if name == "delayed" else name


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    def f32(*shape, s=0.3):
        return jnp.asarray(rng.standard_normal(shape) * s, jnp.float32)
    return {"blocks": {"w1": f32(L, 16, 32), "b1": f32(L, 32), "w2": f32(L, 32, 16)},
            "head": f32(16, 4)}


X = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)), jnp.float32)


def block(h, p):
    return h + jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"]


def scanned(p, x):
    h, _ = jax.lax.scan(lambda h, blk: (block(h, blk), None), x, p["blocks"])
    return h @ p["head"]


def unrolled(p, x):
    for i in range(L):
        x = block(x, jax.tree.map(lambda a, i=i: a[i], p["blocks"]))
    return x @ p["head"]


def by_hand(recipe, scan):
    """The model written with `mpfunc.fp8_dot`: ``fn(params, x, states)``, the blocks'
    states stacked ``[L, ...]`` (None unless delayed)."""
    def blk(h, p, s1, s2):
        return h + mpfunc.fp8_dot(jnp.tanh(mpfunc.fp8_dot(h, p["w1"], recipe, s1) + p["b1"]),
                                  p["w2"], recipe, s2)

    def fn(p, x, s):
        s = s or {"blocks/w1": None, "blocks/w2": None, "head": None}
        if scan:
            x, _ = jax.lax.scan(lambda h, a: (blk(h, *a), None), x,
                                (p["blocks"], s["blocks/w1"], s["blocks/w2"]))
        else:
            for i in range(L):
                at = jax.tree.map(lambda a, i=i: a[i], (p["blocks"], s["blocks/w1"],
                                                       s["blocks/w2"]))
                x = blk(x, *at)
        return mpfunc.fp8_dot(x, p["head"], recipe, s["head"])
    return fn


def train(fn, params, state, steps=2):
    """Gradients of a few steps on the same params, the delayed state carried along."""
    grad = jax.jit(jax.grad(lambda p, s: jnp.sum(fn(p, X, s) ** 2), argnums=(0, 1)))
    out = []
    for _ in range(steps):
        g, state = grad(params, state)
        out.append((g, state))
    return out


def dots(jaxpr, in_scan=False):
    """(operand dtypes, inside a scan body?) of every dot_general, sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield tuple(str(v.aval.dtype) for v in eqn.invars), in_scan
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from dots(sub, in_scan or eqn.primitive.name == "scan")


def fp8_gemms(fn, params, state):
    kw = {} if state is None else {"fp8_state": state}
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(fn(p, X, **kw) ** 2)))(params)
    return collections.Counter(dots(jaxpr.jaxpr))


@pytest.mark.parametrize("name", RECIPES)
def test_every_gemm_of_a_scanned_and_a_stacked_model_is_fp8(name):
    recipe, params = recipe_of(name), make_params()
    for fn, scan in ((scanned, True), (unrolled, False)):
        f = mpfunc.convert_to_fp8(fn, recipe)
        # One site per stacked kernel: all its layers share the key (and the state).
        assert f.sites(params, X) == ["blocks/w1", "blocks/w2", "head"]
        state = f.init(params, X) if name == "delayed" else None
        if state is not None:  # one history per layer, stacked along the layer axis
            assert state["blocks/w1"].input.amax_history.shape == (L, HIST)
            assert state["blocks/w2"].grad_output.scale.shape == (L,)
            assert state["head"].weight.amax_history.shape == (HIST,)
        gemms = fp8_gemms(f, params, state)
        # Before: only the head's three GEMMs (the stacked kernels are 3-D leaves).
        n_body = 2 if scan else 2 * L   # forward GEMMs in the blocks
        where = {True: n_body, False: 1} if scan else {False: n_body + 1}
        if name == "blockwise":  # emulated: dequantised float32 operands
            assert gemms == {(("float32", "float32"), k): 3 * n for k, n in where.items()}
            continue
        # forward (x . w), input gradient (g . w), weight gradient (x . g); in a scan,
        # the backward GEMMs are in the transposed scan's body.
        assert gemms == {(dtypes, k): n for dtypes in ((E4, E4), (E5, E4), (E4, E5))
                         for k, n in where.items()}


# Compiles four steps each: rowwise and blockwise run with the slow tests.
@pytest.mark.parametrize("name", ["tensorwise", "delayed",
                                  pytest.param("rowwise", marks=pytest.mark.slow),
                                  pytest.param("blockwise", marks=pytest.mark.slow)])
def test_scanned_and_unrolled_match_fp8_dot_by_hand(name):
    recipe, params = recipe_of(name), make_params()
    results = {}
    for fn, scan in ((scanned, True), (unrolled, False)):
        f = mpfunc.convert_to_fp8(fn, recipe)
        state = f.init(params, X) if name == "delayed" else None

        def conv(p, x, s, f=f):
            return f(p, x, fp8_state=s) if s is not None else f(p, x)

        got, want = train(conv, params, state), train(by_hand(recipe, scan), params, state)
        # The same ops in the same program: bit for bit, per-layer histories included.
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
        results[scan] = got
    if name == "delayed":
        hist = results[True][0][1]["blocks/w1"].input.amax_history
        assert len(set(np.asarray(hist[:, 0]).tolist())) == L  # each layer its own amax
        assert float(hist[0, 0]) == float(jnp.abs(X).max())   # layer 0 reads x itself
    # Scanned against unrolled: the same math, but XLA compiles a loop body apart from
    # what surrounds it, so a float32 reduction may round differently (the demo's fp32
    # step shows ~4e-8); here they agree to float32 rounding.
    for a, b in zip(jax.tree.leaves(results[True]), jax.tree.leaves(results[False])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_loop_invariant_kernel_gets_one_state_per_iteration():
    # A kernel closed over by a scan body (a weight used at every iteration) is fp8
    # too; delayed scaling gives it one state per iteration, stacked along the scan.
    w, v = make_params()["blocks"]["w1"][0, :, :16], make_params()["head"]

    def f(p, x):
        h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ p["w"]), None), x, None, length=2)
        return h @ p["v"]

    def hand(p, x, s):
        for i in range(2):
            s_i = jax.tree.map(lambda a, i=i: a[i], s["w"])
            x = jnp.tanh(mpfunc.fp8_dot(x, p["w"], recipe, s_i))
        return mpfunc.fp8_dot(x, p["v"], recipe, s["v"])

    recipe = recipe_of("delayed")
    g = mpfunc.convert_to_fp8(f, recipe)
    state = g.init({"w": w, "v": v}, X)
    assert state["w"].input.amax_history.shape == (2, HIST)
    got = train(lambda p, x, s: g(p, x, fp8_state=s), {"w": w, "v": v}, state)
    want = train(hand, {"w": w, "v": v}, state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_fori_loop_over_stacked_params_converts_each_layer():
    # fori_loop indexes the stacked kernel with its (traced) counter: converted, and in
    # delayed scaling one state per iteration, which is per layer here.
    def looped(p, x):
        def body(i, h):
            return block(h, jax.tree.map(lambda a: a[i], p["blocks"]))
        return jax.lax.fori_loop(0, L, body, x) @ p["head"]

    params = make_params()
    f = mpfunc.convert_to_fp8(looped, "tensorwise")
    assert f.sites(params, X) == ["blocks/w1", "blocks/w2", "head"]
    want = mpfunc.convert_to_fp8(scanned, "tensorwise")
    np.testing.assert_allclose(jax.jit(f)(params, X), jax.jit(want)(params, X), rtol=1e-6)
    d = mpfunc.convert_to_fp8(looped, recipe_of("delayed")).init(params, X)
    assert d["blocks/w2"].input.amax_history.shape == (L, HIST)


def test_layer_slots_share_a_key_and_a_reused_slot_gets_its_own():
    w = make_params()["blocks"]["w1"][:, :, :16]  # [L, 16, 16]
    # w[0] and w[1] are two slots of one stacked state; w[0] again needs another.
    f = mpfunc.convert_to_fp8(lambda p, x: (x @ p["w"][0]) @ p["w"][1] @ p["w"][0],
                              recipe_of("delayed"))
    assert f.sites({"w": w}, X) == ["w", "w#1"]
    state = f.init({"w": w}, X)
    assert state["w#1"].input.amax_history.shape == (L, HIST)
    new = jax.jit(jax.grad(lambda s: jnp.sum(f({"w": w}, X, fp8_state=s))))(state)
    hist = np.asarray(new["w"].weight.amax_history[:, 0])
    np.testing.assert_array_equal(hist, [jnp.abs(w[0]).max(), jnp.abs(w[1]).max()])
    assert float(new["w#1"].weight.amax_history[0, 0]) == float(jnp.abs(w[0]).max())


def test_a_state_of_the_wrong_stack_shape_is_a_clear_error():
    params = make_params()
    f = mpfunc.convert_to_fp8(scanned, recipe_of("delayed"))
    state = f.init(params, X)
    state["blocks/w1"] = mpfunc.fp8_dot_state(recipe_of("delayed"))  # one, not per layer
    with pytest.raises(ValueError, match=r"`fp8_state\['blocks/w1'\]` has amax histories of "
                       r"shape \(4,\); its matmul needs \(2, 4\) \(one history per layer"):
        f(params, X, fp8_state=state)


def test_a_while_loop_body_is_left_alone():
    # Documented limit: only scan bodies are followed (while_loop's trip count is not
    # known, so there is no axis to stack a state along).
    def f(p, x):
        h = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (jnp.tanh(c[0] @ p["w"]),
                                                              c[1] + 1), (x, 0))[0]
        return h @ p["v"]

    p = {"w": make_params()["blocks"]["w1"][0, :, :16], "v": make_params()["head"]}
    assert mpfunc.convert_to_fp8(f).sites(p, X) == ["v"]


# ------------------------------------------------------------------------------ flax
# Every recipe's sites, state shapes and GEMM dtypes (traced only); the numbers against
# the same variables applied layer by layer, compiled (rowwise and blockwise: slow).
NUMBER_RECIPES = ["tensorwise", "delayed", pytest.param("rowwise", marks=pytest.mark.slow),
                  pytest.param("blockwise", marks=pytest.mark.slow)]


def flax_check(scanned_fn, unrolled_fn, variables, sites, name, numbers):
    """The fp8 mode on a flax model scanned over its layers (and on the same variables
    applied layer by layer): its sites, per-layer states, every GEMM in fp8 inside the
    scan body, and (``numbers``) the same gradients and new states."""
    import optax

    recipe = recipe_of(name)
    results = []
    for fn in (scanned_fn, unrolled_fn) if numbers else (scanned_fn,):
        amp = mpfunc.convert_to_amp(fn, optax.adam(1e-3), mode="fp8", recipe=recipe)
        assert amp.apply_fn.sites(variables, X) == sites
        state = amp.apply_fn.init(variables, X) if name == "delayed" else None
        if state is not None:
            assert {k: s.input.amax_history.shape for k, s in state.items()} == {
                k: (L, HIST) if k != sites[-1] else (HIST,) for k in sites}
        if numbers:
            kw = {} if state is None else {"fp8_state": state}
            grad = jax.grad(lambda v, s, f=amp.apply_fn: jnp.sum(f(v, X, **s) ** 2),
                            argnums=(0, 1))
            results.append(jax.jit(grad)(variables, kw))
            continue
        gemms = fp8_gemms(amp.apply_fn, variables, state)
        if name != "blockwise":
            assert gemms == {(d, k): n for d in ((E4, E4), (E5, E4), (E4, E5))
                             for k, n in ((True, 2), (False, 1))}
        else:
            assert gemms == {(("float32", "float32"), True): 6,
                             (("float32", "float32"), False): 3}
    if numbers:
        # bf16 elementwise ops round where XLA ends a fusion, and a scan body is fused
        # apart from its surroundings: they agree to bfloat16 rounding, not to the bit.
        for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3 * float(jnp.abs(b).max()))


def linen_model():
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + nn.Dense(16)(jnp.tanh(nn.Dense(32)(nn.LayerNorm()(h)))), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=L)()(x, None)
            return nn.Dense(4)(x)

    def unrolled_net(v, x):
        for i in range(L):
            layer = jax.tree.map(lambda a, i=i: a[i], v["params"]["ScanBlock_0"])
            x, _ = Block().apply({"params": layer}, x, None)
        return nn.Dense(4).apply({"params": v["params"]["Dense_0"]}, x)

    sites = ["params/ScanBlock_0/Dense_1/kernel", "params/ScanBlock_0/Dense_0/kernel",
             "params/Dense_0/kernel"]
    return Net().apply, unrolled_net, Net().init(jax.random.key(0), X), sites


def nnx_model():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln = nnx.LayerNorm(16, rngs=rngs)
            self.fc, self.out = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, h):
            return h + self.out(jnp.tanh(self.fc(self.ln(h))))

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
        return Block(rngs)

    class Net(nnx.Module):
        def __init__(self):
            self.blocks = make_blocks(nnx.Rngs(0))
            self.head = nnx.Linear(16, 4, rngs=nnx.Rngs(1))

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(h, blk):
                return blk(h)
            return self.head(run(x, self.blocks))

    graphdef, state = nnx.split(Net())

    def scanned_net(s, x):
        return nnx.merge(graphdef, s)(x)

    def unrolled_net(s, x):
        net = nnx.merge(graphdef, s)
        block_def, blocks = nnx.split(net.blocks)
        for i in range(L):
            x = nnx.merge(block_def, jax.tree.map(lambda a, i=i: a[i], blocks))(x)
        return net.head(x)

    sites = ["blocks/fc/kernel/value", "blocks/out/kernel/value", "head/kernel/value"]
    return scanned_net, unrolled_net, state, sites


@pytest.mark.parametrize("model", [linen_model, nnx_model], ids=["linen", "nnx"])
@pytest.mark.parametrize("name", RECIPES)
def test_the_fp8_mode_converts_a_flax_scan_body(model, name):
    scanned_fn, _, variables, sites = model()
    flax_check(scanned_fn, None, variables, sites, name, numbers=False)


# The default suite checks tensorwise on Linen and delayed on NNX (each API and each
# recipe kind once); the other pairs and the rowwise/blockwise recipes in the slow suite.
FLAX_NUMBERS = [
    pytest.param(model, p.values[0] if hasattr(p, "values") else p,
                 id=f"{p.values[0] if hasattr(p, 'values') else p}-{api}",
                 marks=() if (p, api) in (("tensorwise", "linen"), ("delayed", "nnx"))
                 else pytest.mark.slow)
    for p in NUMBER_RECIPES for model, api in ((linen_model, "linen"), (nnx_model, "nnx"))]


@pytest.mark.parametrize("model, name", FLAX_NUMBERS)
def test_a_flax_scan_model_in_fp8_matches_its_layers_applied_one_by_one(model, name):
    flax_check(*model(), name, numbers=True)
