"""Every mode on a scanned model.

apex O2 keeps its float32 norm params float32 inside scan, cond and checkpoint bodies.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpfunc

F32 = "float32"


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
