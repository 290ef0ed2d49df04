"""Tests for mpfunc._src.modes: convert_to_amp for JAX, every mode and opt level."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from donation import assert_own_buffers
from jaxpr_walk import all_eqns
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
         ("apex", {"opt_level": "O3"}), ("fp8", {})]
IDS = [f"{m}-{c.get('opt_level', c.get('dtype', ''))}" for m, c in MODES]


def rotated(offset, keep=5):
    """MODES for one of the three per-mode step checks below: ``keep`` of the nine in the
    default suite, the rest in the slow one. The three checks take offsets 0, 3 and 6, so
    every mode runs in at least one of them in the default suite (and all in CI's slow
    suite); the three together took 36 s of the default suite."""
    return [pytest.param(*m, id=i) if (k - offset) % len(MODES) < keep else
            pytest.param(*m, id=i, marks=pytest.mark.slow)
            for k, (m, i) in enumerate(zip(MODES, IDS))]


_REF = {}


def reference(kind):
    if kind not in _REF:
        opt = lenient(optax.sgd(0.3, momentum=0.9)) if kind == "sgd" else None
        _REF[kind] = run("torch", {"enabled": False}, optimizer=opt)[3]
    return _REF[kind]


def train_step(amp):
    """One un-jitted training step of ``amp`` on the task: (params, state, x, y) -> both."""

    def step(params, state, x, y):
        def lf(p):
            logits = amp.apply_fn(p, x)
            return mpfunc.scale_loss(
                optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state)

        with jax.numpy_dtype_promotion("standard"):  # O2: half activations meet f32 norms
            g = jax.grad(lf)(params)
        u, state = amp.optimizer.update(g, state, params)
        return optax.apply_updates(params, u), state

    return step


@pytest.mark.parametrize("mode, cfg", MODES + [("torch", {"enabled": False})],
                         ids=IDS + ["disabled"])
def test_cast_params_never_hands_back_the_arrays_passed_in(mode, cfg):
    # In the float32 modes the result was the very arrays passed in, so a donating step
    # deleted the caller's params (a loop comparing modes from one init failed).
    amp = mpfunc.convert_to_amp(apply, adam(3e-3), mode=mode, **cfg)
    ref = init(jax.random.key(0))
    params = amp.cast_params(ref)
    step = jax.jit(train_step(amp), donate_argnums=(0, 1))
    x, y = next(iter(task(1)))
    step(params, amp.optimizer.init(params), x, y)
    assert not any(a.is_deleted() for a in jax.tree.leaves(ref))
    assert all(a.is_deleted() for a in jax.tree.leaves(params))


@pytest.mark.parametrize("mode, cfg", rotated(0))
def test_every_mode_steps_with_params_and_state_donated_straight_from_init(mode, cfg):
    # How large models train: jit(step, donate_argnums=(0, 1)) on the state `init` made,
    # outside jit. Leaves sharing a buffer (float32 params and their masters in O2, the
    # loss scale's counters) made the first call fail ("donate the same buffer twice").
    amp = mpfunc.convert_to_amp(apply, adam(3e-3), mode=mode, **cfg)
    params = amp.cast_params(init(jax.random.key(0)))
    state = amp.optimizer.init(params)
    assert_own_buffers(params, state)
    step = train_step(amp)
    donated = jax.jit(step, donate_argnums=(0, 1))
    plain_params, plain_state = params, state
    for x, y in task(2):
        plain_params, plain_state = jax.jit(step)(plain_params, plain_state, x, y)
    fresh = amp.optimizer.init(amp.cast_params(init(jax.random.key(0))))
    params = amp.cast_params(init(jax.random.key(0)))
    for x, y in task(2):
        params, fresh = donated(params, fresh, x, y)
    chex.assert_trees_all_equal((params, fresh), (plain_params, plain_state))


@pytest.mark.parametrize("mode, cfg", rotated(3))
def test_orbax_round_trip_continues_bit_for_bit(mode, cfg, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    amp = mpfunc.convert_to_amp(apply, adam(3e-3), mode=mode, **cfg)

    step = jax.jit(train_step(amp), donate_argnums=(0, 1))
    params = amp.cast_params(init(jax.random.key(0)))
    state = amp.optimizer.init(params)
    batches = list(task(6))
    for x, y in batches[:3]:
        params, state = step(params, state, x, y)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": params, "state": state})
    checkpointer.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert type(restored["state"]) is type(state)
    resumed = restored["params"], restored["state"]
    for x, y in batches[3:]:
        params, state = step(params, state, x, y)
        resumed = step(*resumed, x, y)
    chex.assert_trees_all_equal(resumed, (params, state))


@pytest.mark.parametrize("mode, cfg", rotated(6))
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
        ("fp8", ""): (F32, F32),
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


STORAGE_CFGS = [dict(master_weights="remainder", state_dtype="bfloat16"),
                dict(master_weights="kahan"),
                dict(master_weights="stochastic", state_dtype="float8_e4m3fn", seed=3),
                dict(master_weights="float32"), dict(state_dtype="bfloat16", seed=5)]


@pytest.mark.parametrize("cfg", STORAGE_CFGS, ids=lambda c: "-".join(map(str, c.values())))
def test_bf16_without_float32_masters_trains_close_to_float32(cfg):
    amp, params, state, losses = run("bf16", cfg)
    half = "master_weights" in cfg
    assert {x.dtype for x in jax.tree.leaves(params)} == {
        np.dtype(jnp.bfloat16) if half else F32}
    assert (amp.policy.compute_dtype == jnp.bfloat16) and amp.plan.scale_kind == "none"
    inner = state.inner_state
    if half:
        kind = {"remainder": mpfunc.RemainderState, "kahan": mpfunc.KahanState,
                "stochastic": mpfunc.StochasticRoundingState,
                "float32": mpfunc.MasterWeightsState}[cfg["master_weights"]]
        assert isinstance(inner, kind)
        inner = inner.inner_state
    if "state_dtype" in cfg:
        assert isinstance(inner, mpfunc.StateDtypeState)
        assert int(inner.seed) == cfg.get("seed", 0)
        moments = inner.inner_state[0]
        assert moments.mu["w1"].dtype == np.dtype(cfg["state_dtype"])
    ours, theirs = np.mean(losses[-10:]), np.mean(reference("adam")[-10:])
    assert abs(ours - theirs) / theirs < 0.05, (ours, theirs)


def test_convert_checkpoint_maps_a_float32_run_to_remainder_storage_and_back():
    # (It refused the storages before; tests/test_checkpoint_convert_storage.py has the rest.)
    f32 = mpfunc.convert_to_amp(apply, adam(1e-3), mode="torch", enabled=False)
    rem = mpfunc.convert_to_amp(apply, adam(1e-3), mode="bf16", master_weights="remainder")
    params = init(jax.random.key(0))
    p, s = mpfunc.convert_checkpoint(params, f32.optimizer.init(params), f32, rem)
    assert {x.dtype for x in jax.tree.leaves(p)} == {jnp.dtype(jnp.bfloat16)}
    back, _ = mpfunc.convert_checkpoint(p, s, rem, f32)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_modes_match_the_torch_side_table():
    amp = mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="naive")
    assert amp.plan.master_weights and amp.plan.scale_config.hysteresis == 2
    state = amp.optimizer.init(amp.cast_params(init(jax.random.key(0))))
    assert float(mpfunc.loss_scale(state)) == 2.0**32
    amp = mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="apex", opt_level="O1",
                                max_loss_scale=2.0**12)
    state = amp.optimizer.init(init(jax.random.key(0)))
    assert float(mpfunc.loss_scale(state)) == 2.0**12


def test_verbosity_logs_the_plan_like_the_torch_side(capsys, caplog):
    with caplog.at_level("INFO", logger="mpfunc"):
        mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="apex", opt_level="O2")
    (record,) = caplog.records
    assert record.name.startswith("mpfunc.") and record.levelname == "INFO"
    assert "mode=apex O2" in record.getMessage()
    caplog.clear()
    with caplog.at_level("INFO", logger="mpfunc"):
        mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="apex", opt_level="O2", verbosity=0)
        mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="naive")
    assert caplog.records == []
    assert capsys.readouterr().out == ""  # the library prints nothing


def test_naive_clip_and_zero_count():
    amp = mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="naive", clip_grad=0.5,
                                log_num_zeros_in_grad=True, initial_scale=2.0**10)
    params = amp.cast_params(init(jax.random.key(0)))
    state = amp.optimizer.init(params)
    x, y = next(task(1))

    @jax.jit  # eagerly, each of the step's ops compiled on its own: 9 s of the suite
    def step(params, state):
        with jax.numpy_dtype_promotion("standard"):
            g = jax.grad(lambda p: mpfunc.scale_loss(
                optax.softmax_cross_entropy_with_integer_labels(amp.apply_fn(p, x), y).mean(),
                state))(params)
        return g, amp.optimizer.update(g, state, params)[1]

    g, state = step(params, state)
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
    ("naive", {"master_weights": "kahan"}, r"use mode=\"bf16\", master_weights='kahan'"),
])
def test_errors(mode, cfg, match):
    with pytest.raises(ValueError, match=match):
        mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode=mode, **cfg)


def test_type_errors():
    with pytest.raises(TypeError, match="`apply_fn` must be callable"):
        mpfunc.convert_to_amp(None, optax.sgd(0.1))
    with pytest.raises(TypeError, match="`optimizer` must be an optax"):
        mpfunc.convert_to_amp(apply, "adam")
    with pytest.raises(TypeError, match=r"`master_weights` must be a bool with mode 'apex'.*"
                                        r"use mode=\"bf16\", master_weights='remainder'"):
        mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="apex", opt_level="O2",
                              master_weights="remainder")


def test_is_norm_param():
    from jax.tree_util import DictKey

    assert mpfunc.is_norm_param((DictKey("LayerNorm_0"), DictKey("scale")), None)
    assert mpfunc.is_norm_param((DictKey("ln_f"),), None)
    assert mpfunc.is_norm_param((DictKey("bn1"),), None)
    assert not mpfunc.is_norm_param((DictKey("Dense_0"), DictKey("kernel")), None)
    assert mpfunc.is_norm_param((DictKey("ln"),), None)


# -- apex O2: a half model whose norms stay float32 ----------------------------------


def ln_raw(x, p):
    m = x.mean(-1, keepdims=True)
    v = jnp.square(x - m).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * p["scale"] + p["bias"]


def transformer(pre):
    """A raw-function 2-block transformer (pre-LN or post-LN), as users write by hand."""

    def block(p, x):
        def attn(h):
            q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
            a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / 4.0)
            return jnp.einsum("bts,bsd->btd", a, v) @ p["wo"]

        def mlp(h):
            return jax.nn.gelu(h @ p["w1"]) @ p["w2"]

        if pre:
            x = x + attn(ln_raw(x, p["ln1"]))
            return x + mlp(ln_raw(x, p["ln2"]))
        x = ln_raw(x + attn(x), p["ln1"])
        return ln_raw(x + mlp(x), p["ln2"])

    def apply_fn(p, tokens):
        x = p["embed"][tokens]
        for b in p["blocks"]:
            x = block(b, x)
        if pre:
            x = ln_raw(x, p["ln_f"])
        return x @ p["head"]

    return apply_fn


def transformer_params(key, d=16):
    keys = iter(jax.random.split(key, 32))

    def r(*shape):
        return jax.random.normal(next(keys), shape) * 0.1

    def ln():
        return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

    blocks = [dict(wq=r(d, d), wk=r(d, d), wv=r(d, d), wo=r(d, d), w1=r(d, 4 * d),
                   w2=r(4 * d, d), ln1=ln(), ln2=ln()) for _ in range(2)]
    return {"embed": r(VOCAB, d), "blocks": blocks, "ln_f": ln(), "head": r(d, VOCAB)}


def dot_operand_dtypes(fn, *args):
    count = {}
    for e in all_eqns(fn, *args):
        if e.primitive.name == "dot_general":
            key = tuple(str(v.aval.dtype) for v in e.invars)
            count[key] = count.get(key, 0) + 1
    return count


@pytest.mark.parametrize("pre", [True, False], ids=["pre_ln", "post_ln"])
def test_apex_o2_runs_matmuls_in_half_around_float32_norms(pre):
    amp = mpfunc.convert_to_amp(transformer(pre), optax.sgd(0.1), mode="apex", opt_level="O2",
                                verbosity=0)
    params = amp.cast_params(transformer_params(jax.random.key(0)))
    assert params["blocks"][0]["wq"].dtype == F16 and params["ln_f"]["scale"].dtype == F32
    tokens = np.zeros((2, 8), np.int32)
    with jax.numpy_dtype_promotion("standard"):
        # 2 blocks x (q, k, v, logits, values, out, mlp in, mlp out) + head = 17 matmuls;
        # before, float32 norm outputs made most of them float32 (17 of 17 pre-LN).
        assert dot_operand_dtypes(amp.apply_fn, params, tokens) == {("float16", "float16"): 17}
        assert amp.apply_fn(params, tokens).dtype == F32
        grad_fn = jax.grad(lambda p: amp.apply_fn(p, tokens).sum())
        assert set(dot_operand_dtypes(grad_fn, params)) == {("float16", "float16")}
        grads = jax.eval_shape(grad_fn, params)
    assert grads["blocks"][0]["ln1"]["scale"].dtype == F32
    assert grads["blocks"][0]["wq"].dtype == F16


@pytest.mark.parametrize("mode, cfg", [("naive", {}), ("apex", {"opt_level": "O3"}),
                                       ("apex", {"opt_level": "O2"})])
def test_half_modes_run_a_stock_nnx_models_matmuls_in_half(mode, cfg):
    # nnx.Embed fixes its `dtype` (float32) when it is built, so with float16 params its
    # output was float32 and every later matmul ran f32 x f32 in naive and O3 (O2's
    # half-model rules already caught it): float16 storage, no float16 compute.
    from flax import nnx

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(32, 16, rngs=rngs)
            self.fc = nnx.Linear(16, 32, rngs=rngs)

        def __call__(self, tok):
            return self.fc(self.embed(tok))

    graph, params, rest = nnx.split(LM(nnx.Rngs(0)), nnx.Param, ...)
    amp = mpfunc.convert_to_amp(lambda p, t: nnx.merge(graph, p, rest)(t), optax.sgd(0.1),
                                mode=mode, **cfg, **({"verbosity": 0} if mode == "apex" else {}))
    p16 = amp.cast_params(params)
    tokens = jnp.zeros((4, 8), jnp.int32)
    with jax.numpy_dtype_promotion("standard"):
        assert dot_operand_dtypes(amp.apply_fn, p16, tokens) == {("float16", "float16"): 1}
        grad_fn = jax.grad(lambda p: amp.apply_fn(p, tokens).sum())
        assert set(dot_operand_dtypes(grad_fn, p16)) == {("float16", "float16")}
        assert amp.apply_fn(p16, tokens).dtype == F32


@pytest.mark.parametrize("mode, cfg", [("naive", {}), ("apex", {"opt_level": "O3"}),
                                       ("apex", {"opt_level": "O2"})])
def test_float32_constants_made_in_apply_fn_leave_the_matmuls_in_half(mode, cfg):
    # The torch side's demo Transformer case: a positional encoding and a mask made in
    # float32 inside the model. With standard promotion they promote the activations to
    # float32, and plain flax with float16 params then computes every matmul in float32;
    # the half modes still run each matmul f16 x f16 (float32 accumulation). With strict
    # promotion (as these tests run) the user's own `x + pe` is a TypePromotionError: loud,
    # never a silent float32 matmul.
    import flax.linen as nn

    class PosModel(nn.Module):
        @nn.compact
        def __call__(self, tok):
            t = tok.shape[1]
            x = nn.Embed(VOCAB, 16)(tok)
            pos = jnp.arange(t).astype(jnp.float32)[:, None]  # float32, made in apply
            pe = jnp.sin(pos * jnp.exp(-jnp.arange(16).astype(jnp.float32) / 16))
            h = nn.Dense(16)(x + pe)
            mask = jnp.where(jnp.tril(jnp.ones((t, t), bool)), 0.0, -1e4)  # float32
            att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", h, h) + mask, -1)
            return nn.Dense(VOCAB)(jnp.einsum("bts,bsd->btd", att, h))

    net, tokens = PosModel(), jnp.zeros((2, 8), jnp.int32)
    params = net.init(jax.random.key(0), tokens)
    amp = mpfunc.convert_to_amp(net.apply, optax.sgd(0.1), mode=mode, **cfg,
                                **({"verbosity": 0} if mode == "apex" else {}))
    p16 = amp.cast_params(params)
    with jax.numpy_dtype_promotion("standard"):
        assert dot_operand_dtypes(amp.apply_fn, p16, tokens) == {("float16", "float16"): 4}
        grad_fn = jax.grad(lambda p: amp.apply_fn(p, tokens).sum())
        assert set(dot_operand_dtypes(grad_fn, p16)) == {("float16", "float16")}
        plain = jax.tree.map(lambda a: a.astype(jnp.float16), params)  # model.half()
        assert dot_operand_dtypes(net.apply, plain, tokens) == {("float32", "float32"): 4}
    with pytest.raises(jax.dtypes.TypePromotionError, match="no available implicit"):
        amp.apply_fn(p16, tokens)


def test_apex_o2_norm_output_goes_back_to_the_compute_dtype():
    # The op after the norm (tanh here) sees float16, as the torch side's norm hooks give;
    # the norm's own arithmetic with its float32 params runs in float32.
    amp = mpfunc.convert_to_amp(lambda p, x: jnp.tanh(ln_raw(x, p["ln"])), optax.sgd(0.1),
                                mode="apex", opt_level="O2", verbosity=0)
    params = amp.cast_params({"ln": {"scale": jnp.full(4, 1.5, jnp.float32),
                                     "bias": jnp.full(4, 0.25, jnp.float32)}})
    x = jax.random.normal(jax.random.key(0), (3, 4))
    with jax.numpy_dtype_promotion("standard"):
        eqns = jax.make_jaxpr(amp.apply_fn)(params, x).eqns
        out = amp.apply_fn(params, x)
    tanh = [e for e in eqns if e.primitive.name == "tanh"]
    assert [str(e.invars[0].aval.dtype) for e in tanh] == ["float16"]
    # the ops applying the float32 statistic rsqrt(var), the scale and the bias run in
    # float32 (then go back to float16)
    applied = [e for e in eqns if e.primitive.name in ("mul", "add")
               and all(str(v.aval.dtype) == "float32" for v in e.invars)
               and e.outvars[0].aval.shape == (3, 4)]
    assert [e.primitive.name for e in applied] == ["mul", "mul", "add"]
    ref = jnp.tanh(ln_raw(x.astype(jnp.float16).astype(jnp.float32), params["ln"]))
    np.testing.assert_allclose(out, ref, atol=2e-3)


@pytest.mark.parametrize("mode, cfg", [("naive", {}),
                                       ("apex", {"opt_level": "O2", "verbosity": 0}),
                                       ("apex", {"opt_level": "O3", "verbosity": 0})])
def test_half_model_embedding_and_bias_gradients_sum_in_float32(mode, cfg):
    # A frequent token's embedding gradient is the sum of every row that looked it up
    # (here 16,384 of them per token), a bias's the sum over the batch. In float16 that
    # scatter-add lost 40% of the embedding gradient (relative error 0.40): past 2048 the
    # float16 accumulator's spacing swallows each small addend. torch's embedding and
    # bias backward accumulate in float32, and so do these now.
    def apply(p, idx):
        return jnp.tanh(p["tok"][idx] @ p["w"] + p["b"]).sum(-1)

    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"tok": jax.random.normal(k1, (50, 8)), "w": jax.random.normal(k2, (8, 4)) / 3,
              "b": jnp.full(4, 0.1)}
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 3, (64, 256)), jnp.int32)
    amp = mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode=mode, **cfg)
    p16 = amp.cast_params(params)

    def loss(f):
        return lambda p: (f(p, idx).astype(F32) * 0.01).sum()

    with jax.numpy_dtype_promotion("standard"):
        eqns = list(all_eqns(jax.grad(loss(amp.apply_fn)), p16))
        grads = jax.jit(jax.grad(loss(amp.apply_fn)))(p16)
    accumulating = [str(e.invars[0].aval.dtype) for e in eqns
                    if e.primitive.name in ("scatter-add", "reduce_sum")]
    assert "float16" not in accumulating and len(accumulating) >= 2, accumulating
    ref = jax.grad(loss(apply))(params)
    for name in ("tok", "b"):
        assert grads[name].dtype == jnp.float16
        err = float(jnp.linalg.norm(grads[name].astype(F32) - ref[name])
                    / jnp.linalg.norm(ref[name]))
        assert err < 2e-3, (name, err)


def test_num_losses_is_rejected_with_the_alternatives():
    with pytest.raises(ValueError, match=r"`num_losses=2`: per-loss scales are not supported "
                                         r"on JAX.*loss_a \+ loss_b"):
        mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="apex", num_losses=2)
    mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="apex", num_losses=1, verbosity=0)


@pytest.mark.parametrize("axis_name", [3.5, "", ("data", 2), ()])
def test_bad_axis_name(axis_name):
    with pytest.raises(TypeError, match="`axis_name` must be None, a mesh axis name"):
        mpfunc.convert_to_amp(apply, optax.sgd(0.1), axis_name=axis_name)


def test_good_axis_names_and_is_norm():
    for name in (None, "data", ("data", "model")):
        mpfunc.convert_to_amp(apply, optax.sgd(0.1), axis_name=name)
    with pytest.raises(TypeError, match=r"`is_norm` must be a callable `\(path, leaf\) -> bool`"
                                        r".*got str: 'ln'"):
        mpfunc.convert_to_amp(apply, optax.sgd(0.1), mode="apex", opt_level="O2", is_norm="ln")
