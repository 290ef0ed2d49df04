"""Every mode on a scanned model: the demo's transformer (examples/compare_modes.py) with
its blocks under ``jax.lax.scan`` over stacked params, against the same model unrolled.

The matmuls inside the scan body run in the mode's dtypes (read from the jaxpr of the
train step), apex O2's float32 norm params enter the scan in float32, the scanned
step's program does not grow with depth (the compile-time proxy: its StableHLO has as
many ``dot_general`` ops at 12 layers as at 2), and it trains as the unrolled one does.
"""

import collections
import functools
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpfunc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from compare_modes import MODES as DEMO_MODES  # noqa: E402
from compare_modes import jax_apply, jax_train_step, torch_model, torch_to_jax_params  # noqa: E402,I001

MODES = {**{k: v for k, v in DEMO_MODES.items() if k != "tf32"},
         "apex-O3": ("apex", {"opt_level": "O3", "verbosity": 0})}
CFG = types.SimpleNamespace(width=32, heads=4, layers=2, context=8, batch=2, seed=0)
X = jnp.asarray(np.random.default_rng(0).integers(0, 96, (CFG.batch, CFG.context)), jnp.int32)
F32, F16, BF16 = "float32", "float16", "bfloat16"
E4, E5 = "float8_e4m3fn", "float8_e5m2"


@functools.cache
def torch_init(layers, stacked):
    cfg = types.SimpleNamespace(**{**vars(CFG), "layers": layers})
    return cfg, torch_to_jax_params(torch_model(cfg), stacked=stacked)


def setup(name, layers=CFG.layers, scan=True):
    """``(step, args)``: the demo's train step in mode ``name`` and its arguments."""
    cfg, init = torch_init(layers, scan)
    mode, config = MODES[name]
    amp = mpfunc.convert_to_amp(jax_apply(types.SimpleNamespace(**vars(cfg), scan=scan)),
                                optax.adam(1e-3), mode=mode, **config)
    params = amp.cast_params(jax.tree.map(jnp.asarray, init))
    return jax_train_step(amp)[0], (params, amp.optimizer.init(params), X, X)


def scan_bodies(jaxpr):
    """The body jaxpr of every scan in ``jaxpr`` and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn.params["jaxpr"].jaxpr
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from scan_bodies(sub)


def dot_dtypes(jaxpr):
    """Operand dtypes of every dot_general that ``jaxpr`` and its sub-jaxprs compute:
    not the dead ones (autocast's backward of a half matmul traces the matmul again
    inside ``jax.vjp``, an unused output that XLA drops)."""
    used = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    out = collections.Counter()
    for eqn in jaxpr.eqns:
        if not any(id(o) in used for o in eqn.outvars):
            continue
        if eqn.primitive.name == "dot_general":
            out[tuple(str(v.aval.dtype) for v in eqn.invars)] += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += dot_dtypes(sub)
    return out


def traced(step, args):
    with jax.numpy_dtype_promotion("standard"):
        return jax.make_jaxpr(step)(*args).jaxpr


# Per mode: the dot_general operand dtypes in the scan bodies of one train step (the
# forward scan and its transpose), 6 matmuls per block forward (4 dense, 2 attention),
# 18 with the backward. On CPU a bfloat16 dot also has its float32 route
# (`autocast._accumulate_in_float32`), traced beside it.
BODY_DOTS = {
    "fp32": {(F32, F32): 18},
    **{m: {(F16, F16): 18} for m in ("torch", "apex-O1", "apex-O2", "apex-O3", "naive")},
    "bf16": {(BF16, BF16): 18, (F32, F32): 18},
    # bfloat16 params without float32 masters: the dots of bf16 mode's step.
    **{m: {(BF16, BF16): 18, (F32, F32): 18} for m in ("bf16-remainder", "bf16-stochastic")},
    # fp8: every dense GEMM (forward, dx, dw); attention's products under bf16 autocast.
    "fp8": {(E4, E4): 4, (E5, E4): 4, (E4, E5): 4, (BF16, BF16): 6, (F32, F32): 6},
}


@pytest.mark.parametrize("name", list(MODES))
def test_every_mode_runs_the_scan_body_in_its_dtypes(name):
    jaxpr = traced(*setup(name))
    bodies = list(scan_bodies(jaxpr))
    assert len(bodies) == 2  # one forward, one backward: the demo's step is unrolled no more
    got = sum((dot_dtypes(b) for b in bodies), collections.Counter())
    assert got == BODY_DOTS[name]
    if name == "fp8":  # and the head's three: every dense GEMM of the step (was 3 of 15)
        step_dots = dot_dtypes(jaxpr)
        assert sum(n for d, n in step_dots.items() if E4 in d or E5 in d) == 15
    if name == "apex-O2":  # the scanned norm params enter the body in float32
        forward = bodies[0]
        vec = [str(v.aval.dtype) for v in forward.invars if v.aval.shape == (CFG.width,)]
        assert vec.count(F32) == 4 and F16 in vec  # ln1, ln2 (scale, bias); linear biases


# The default suite lowers fp32 (and its unrolled form), naive (float32 masters),
# bf16-stochastic (no masters) and fp8 at two depths; the other modes in the slow suite:
# their scans are the same body with other dtypes, held by the dtype test above.
DEPTH_MODES = [m if m in ("fp32", "naive", "bf16-stochastic", "fp8")
               else pytest.param(m, marks=pytest.mark.slow) for m in MODES]


@pytest.mark.parametrize("name", DEPTH_MODES)
def test_the_scanned_step_does_not_grow_with_depth(name):
    # The proxy for compile time (measured in BENCHMARKS.md): the program XLA compiles
    # has as many matmuls at 12 layers as at 2.
    def dots(layers, scan):
        step, args = setup(name, layers, scan)
        with jax.numpy_dtype_promotion("standard"):
            return jax.jit(step).lower(*args).as_text().count("stablehlo.dot_general")

    assert dots(2, True) == dots(12, True)
    if name == "fp32":  # ... where the unrolled one has one block's worth per layer more
        assert dots(12, False) - dots(2, False) == 10 * 18


def test_the_demo_step_computes_the_forward_once():
    # It called the loss twice inside jax.grad (once for the loss it reports): a second
    # forward scan in every step.
    step, args = setup("fp32")
    kinds = [b for b in scan_bodies(traced(step, args))]
    assert len(kinds) == 2  # the forward, differentiated, and its transpose


def test_the_demo_models_scanned_and_unrolled_agree():
    # The same torch init, stacked for the scan or listed for the loop.
    _, stacked = torch_init(2, True)
    _, listed = torch_init(2, False)
    assert isinstance(listed["blocks"], list) and len(listed["blocks"]) == 2
    assert stacked["blocks"]["fc"]["w"].shape == (2, CFG.width, 4 * CFG.width)
    np.testing.assert_array_equal(stacked["blocks"]["ln2"]["scale"][1],
                                  listed["blocks"][1]["ln2"]["scale"])
    cfg = vars(CFG)
    scanned = jax.jit(jax_apply(types.SimpleNamespace(**cfg, scan=True)))(stacked, X)
    unrolled = jax.jit(jax_apply(types.SimpleNamespace(**cfg, scan=False)))(listed, X)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-6)


# Two compiled steps per mode: O2 (the mode that needed a change) and fp8 run by default.
# The default suite trains apex O2's (half params, float32 masters and norms) here; fp8
# (about 19 s) and the rest in the slow suite.
NUMBER_MODES = [m if m == "apex-O2" else pytest.param(m, marks=pytest.mark.slow)
                for m in MODES]


@pytest.mark.parametrize("name", NUMBER_MODES)
def test_every_mode_trains_a_scanned_model_like_the_unrolled_one(name):
    runs = {}
    for scan in (True, False):
        step, (params, state, x, y) = setup(name, scan=scan)
        with jax.numpy_dtype_promotion("standard"):
            step = jax.jit(step)
            losses, states = [], []
            for _ in range(2):
                params, state, loss, _ = step(params, state, x, y)
                losses.append(float(loss))
                states.append(mpfunc.scale_metrics(state))
        mu = optax.tree_utils.tree_get(state, "mu")  # adam's (1 - b1) * the gradients
        if not scan:
            mu = dict(mu, blocks=jax.tree.map(lambda *a: jnp.stack(a), *mu["blocks"]))
        runs[scan] = losses, states, mu
    (l_s, m_s, mu_s), (l_u, m_u, mu_u) = runs[True], runs[False]
    assert m_s == m_u  # the same loss scales and skipped steps (naive skips both here)
    # float32 elementwise math agrees to float32 rounding; float16 rounds where XLA ends
    # a fusion, and a scan body is fused apart from its surroundings (plain JAX in
    # float16 differs as much between the two; measured here: gradients 1.6e-3 of their
    # largest apart, losses 1.4e-5).
    # bfloat16 params (8 significant bits to float16's 11) round 8x coarser still.
    half = name in ("torch", "apex-O1", "apex-O2", "apex-O3", "naive")
    bf16_params = name in ("bf16-remainder", "bf16-stochastic")
    rtol, atol = (1e-4, 5e-3) if half else (1e-3, 4e-2) if bf16_params else (1e-6, 1e-5)
    np.testing.assert_allclose(l_s, l_u, rtol=rtol)
    for a, b in zip(jax.tree.leaves(mu_s), jax.tree.leaves(mu_u)):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol * float(jnp.abs(b).max()))


def test_apex_o2_norm_params_enter_control_flow_in_float32():
    # O2 traces the model with its float32 norm params seen as float16 (so a scan's
    # carry keeps one dtype); they still reach every body in float32, and the model
    # computes as it does without the control flow.
    def norm(x, p):
        return x * p["ln"]["scale"] + p["ln"]["bias"]

    def plain(p, x):
        return norm(x, p) @ p["w"]

    def wrapped(p, x):
        y = jax.checkpoint(norm)(x, p)
        y = jax.lax.cond(x[0, 0] > -100, lambda y: norm(x, p) + 0 * y, lambda y: y, y)
        y, _ = jax.lax.scan(lambda c, _: (norm(x, p) + 0 * c, None), y, None, length=1)
        return y @ p["w"]

    rng = np.random.default_rng(0)
    p = {"ln": {"scale": jnp.asarray(1 + 1e-4 * rng.standard_normal(8), jnp.float32),
                "bias": jnp.asarray(1e-4 * rng.standard_normal(8), jnp.float32)},
         "w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((2, 8)), jnp.float32)
    out = []
    for fn in (plain, wrapped):
        amp = mpfunc.convert_to_amp(fn, optax.sgd(0.1), mode="apex", opt_level="O2",
                                    verbosity=0)
        params = amp.cast_params(p)
        out.append(jax.jit(amp.apply_fn)(params, x))
    np.testing.assert_array_equal(out[0], out[1])
    bodies = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for v in eqn.params.values():
                for sub in v if isinstance(v, tuple) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        bodies.append((eqn.primitive.name, sub))
                        walk(sub)

    walk(jax.make_jaxpr(amp.apply_fn)(params, x).jaxpr)
    norm_inputs = {"remat2" if name in ("checkpoint", "remat") else name:
                   {str(v.aval.dtype) for v in b.invars if v.aval.shape == (8,)}
                   for name, b in bodies if name in ("checkpoint", "remat", "remat2", "cond",
                                                     "scan")}
    assert norm_inputs == {"remat2": {F32}, "cond": {F32}, "scan": {F32}}


@pytest.mark.parametrize("scan", [True, False])
def test_apex_o2_runs_the_model_in_half_but_its_norms(scan):
    # O2 is model.half() with float32 norms: attention's reshapes and masking and GELU
    # run in float16, as in naive mode. Traced with its float32 norm params, the model's
    # own dtype promotion cast every activation after the first norm to float32 in the
    # traced program: attention's transposes ran in float32 (and a scanned model could
    # not be traced at all).
    def ops(name):
        cfg, init = torch_init(CFG.layers, scan)
        mode, config = MODES[name]
        amp = mpfunc.convert_to_amp(jax_apply(types.SimpleNamespace(**vars(cfg), scan=scan)),
                                    optax.adam(1e-3), mode=mode, **config)
        params = amp.cast_params(jax.tree.map(jnp.asarray, init))
        out = collections.Counter()

        def walk(j):
            for eqn in j.eqns:
                if eqn.primitive.name in ("transpose", "split", "select_n", "tanh"):
                    out[eqn.primitive.name, str(eqn.outvars[0].aval.dtype)] += 1
                for p in eqn.params.values():
                    for sub in p if isinstance(p, tuple | list) else (p,):
                        sub = getattr(sub, "jaxpr", sub)
                        if hasattr(sub, "eqns"):
                            walk(sub)

        walk(traced(amp.apply_fn, (params, X)))
        return out

    o2 = ops("apex-O2")
    assert o2 == ops("naive") and o2["transpose", F16] > 0 and ("transpose", F32) not in o2
