"""Tests for mpfunc._src.modes: convert_to_amp for JAX, every mode and opt level."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from lenient import adam, lenient

import mpfunc

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
VOCAB, C = 64, 8


def task(n=80, batch=64, seed=0):
    """Next-byte prediction on Python source (bytes folded into 64 symbols)."""
    import sysconfig
    from pathlib import Path

    data = b"".join(p.read_bytes() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("a*.py")))
    arr = np.frombuffer(data[:200_000], np.uint8).astype(np.int32) % VOCAB
    rng = np.random.default_rng(seed)
    for _ in range(n):
        s = rng.integers(0, len(arr) - C - 1, batch)
        idx = s[:, None] + np.arange(C + 1)
        yield arr[idx[:, :C]], arr[idx[:, C]]


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"embed": jax.random.normal(k1, (VOCAB, 16)) * 0.1,
            "w1": jax.random.normal(k2, (C * 16, 128)) / np.sqrt(C * 16), "b1": jnp.zeros(128),
            "LayerNorm_0": {"scale": jnp.ones(128), "bias": jnp.zeros(128)},
            "w2": jax.random.normal(k3, (128, VOCAB)) / np.sqrt(128), "b2": jnp.zeros(VOCAB)}


def apply(p, x):
    h = p["embed"][x].reshape(x.shape[0], -1) @ p["w1"] + p["b1"]
    m = h.mean(-1, keepdims=True)
    v = jnp.square(h - m).mean(-1, keepdims=True)
    ln = p["LayerNorm_0"]
    h = (h - m) * jax.lax.rsqrt(v + 1e-5) * ln["scale"] + ln["bias"]
    return jax.nn.relu(h) @ p["w2"] + p["b2"]


def run(mode, cfg, optimizer=None, steps=80):
    amp = mpfunc.convert_to_amp(apply, optimizer or adam(3e-3), mode=mode, **cfg)
    params = amp.cast_params(init(jax.random.key(0)))
    state = amp.optimizer.init(params)

    @jax.jit
    def step(params, state, x, y):
        def lf(p):
            logits = amp.apply_fn(p, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return mpfunc.scale_loss(loss, state), loss

        with jax.numpy_dtype_promotion("standard"):  # O2: half activations meet f32 norms
            g, loss = jax.grad(lf, has_aux=True)(params)
        u, state = amp.optimizer.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    losses = []
    for x, y in task(steps):
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    return amp, params, state, losses


MODES = [("torch", {}), ("torch", {"dtype": "bfloat16"}), ("bf16", {}),
         ("naive", {"initial_scale": 2.0**16}), ("apex", {"opt_level": "O0"}),
         ("apex", {"opt_level": "O1"}), ("apex", {"opt_level": "O2"}),
         ("apex", {"opt_level": "O3"})]
IDS = [f"{m}-{c.get('opt_level', c.get('dtype', ''))}" for m, c in MODES]
_REF = {}


def reference(kind):
    if kind not in _REF:
        opt = lenient(optax.sgd(0.3, momentum=0.9)) if kind == "sgd" else None
        _REF[kind] = run("torch", {"enabled": False}, optimizer=opt)[3]
    return _REF[kind]


@pytest.mark.parametrize("mode, cfg", MODES, ids=IDS)
def test_every_mode_trains_close_to_float32(mode, cfg):
    # O3 keeps the optimizer state in float16 too; Adam's second moment underflows there
    # (as in apex), so O3 is compared with SGD + momentum on both sides.
    o3 = cfg.get("opt_level") == "O3"
    opt = lenient(optax.sgd(0.3, momentum=0.9)) if o3 else None
    amp, params, state, losses = run(mode, cfg, optimizer=opt)
    ref = reference("sgd" if o3 else "adam")
    # Tolerance: last-10 mean within 5% of float32's. Rounding moves single losses by
    # ~1% and early skipped steps delay training a few of 80 steps; a mode that fails
    # to train stays near log(64) = 4.16, 70%+ above float32's final loss.
    ours, theirs = np.mean(losses[-10:]), np.mean(ref[-10:])
    assert abs(ours - theirs) / theirs < 0.05, (ours, theirs)
    assert losses[-1] < 0.8 * losses[0]


def test_param_and_compute_dtypes_per_mode():
    x = np.zeros((2, C), np.int32)
    expect = {
        ("torch", "f16"): (F32, F32),
        ("naive", ""): (F16, F16),
        ("apex", "O2"): (F16, F32),  # norm params stay float32
        ("apex", "O3"): (F16, F16),
        ("bf16", ""): (F32, F32),
    }
    for (mode, level), (w_dtype, norm_dtype) in expect.items():
        cfg = {"opt_level": level} if mode == "apex" else {}
        amp = mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode=mode, **cfg)
        p = amp.cast_params(init(jax.random.key(0)))
        assert p["w1"].dtype == w_dtype and p["LayerNorm_0"]["scale"].dtype == norm_dtype
        with jax.numpy_dtype_promotion("standard"):
            assert amp.apply_fn(p, x).dtype == F32  # outputs float32 in every mode


def test_autocast_modes_run_matmuls_in_half():
    amp = mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="torch")
    jaxpr = jax.make_jaxpr(amp.apply_fn)(init(jax.random.key(0)), np.zeros((2, C), np.int32))
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "custom_vjp_call"
            or e.primitive.name == "dot_general"]
    assert dots
    text = str(jaxpr)
    assert "f16[" in text


def test_modes_match_the_torch_side_table():
    amp = mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="naive")
    assert amp.plan.master_weights and amp.plan.scale_config.hysteresis == 2
    state = amp.optimizer.init(amp.cast_params(init(jax.random.key(0))))
    assert float(mpfunc.loss_scale(state)) == 2.0**32
    amp = mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="apex", opt_level="O1",
                                max_loss_scale=2.0**12)
    state = amp.optimizer.init(init(jax.random.key(0)))
    assert float(mpfunc.loss_scale(state)) == 2.0**12


def test_verbosity_prints_the_plan_like_the_torch_side(capsys):
    mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="apex", opt_level="O2")
    assert "mode=apex O2" in capsys.readouterr().out
    mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="apex", opt_level="O2", verbosity=0)
    mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="naive")
    assert capsys.readouterr().out == ""


def test_naive_clip_and_zero_count():
    amp = mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="naive", clip_grad=0.5,
                                log_num_zeros_in_grad=True, initial_scale=2.0**10)
    params = amp.cast_params(init(jax.random.key(0)))
    state = amp.optimizer.init(params)
    x, y = next(task(1))
    with jax.numpy_dtype_promotion("standard"):
        g = jax.grad(lambda p: mpfunc.scale_loss(optax.softmax_cross_entropy_with_integer_labels(
            amp.apply_fn(p, x), y).mean(), state))(params)
    _, state = amp.optimizer.update(g, state, params)
    metrics = mpfunc.scale_metrics(state)
    unscaled = jax.tree.map(lambda a: a.astype(jnp.float32) / 2.0**10, g)
    expected = sum(int(jnp.sum(a == 0)) for a in jax.tree.leaves(unscaled))
    assert int(metrics["num_zeros_in_grad"]) == expected > 0


def test_injected_inf_skips_in_every_scaled_mode():
    for mode, cfg in MODES:
        amp = mpfunc.convert_to_amp(apply, adam(1e-3), mode=mode, **cfg)
        params = amp.cast_params(init(jax.random.key(0)))
        state = amp.optimizer.init(params)
        bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
        u, new = amp.optimizer.update(bad, state, params)
        assert not bool(new.last_finite), mode
        for a, b in zip(jax.tree.leaves(optax.apply_updates(params, u)), jax.tree.leaves(params)):
            assert bool(jnp.array_equal(a, b))


@pytest.mark.parametrize("mode, cfg, match", [
    ("fp4", {}, "`mode` must be one of"),
    ("torch", {"hysteresis": 2}, "unknown config key"),
    ("apex", {"opt_level": "O9"}, "`opt_level` must be one of"),
    ("naive", {"min_scale": 4.0, "max_scale": 2.0, "initial_scale": 2.0}, "`min_scale`"),
])
def test_errors(mode, cfg, match):
    with pytest.raises(ValueError, match=match):
        mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode=mode, **cfg)


def test_type_errors():
    with pytest.raises(TypeError, match="`apply_fn` must be callable"):
        mpfunc.convert_to_amp(None, optax.sgd(0.1))
    with pytest.raises(TypeError, match="`optimizer` must be an optax"):
        mpfunc.convert_to_amp(apply, "adam")


def test_is_norm_param():
    from jax.tree_util import DictKey

    assert mpfunc.is_norm_param((DictKey("LayerNorm_0"), DictKey("scale")), None)
    assert mpfunc.is_norm_param((DictKey("ln_f"),), None)
    assert mpfunc.is_norm_param((DictKey("bn1"),), None)
    assert not mpfunc.is_norm_param((DictKey("Dense_0"), DictKey("kernel")), None)
    assert mpfunc.is_norm_param((DictKey("ln"),), None)
