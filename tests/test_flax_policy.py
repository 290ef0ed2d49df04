"""Tests for mpfunc._src.flax_policy and mpfunc._src.nnx_policy: haiku's set_policy
semantics for flax Linen and NNX.

The dtypes checked are the ones the matmuls really run in (operands of the jaxpr's
``dot_general`` / ``conv_general_dilated``), not only the outputs. haiku itself is the
reference: the same model under ``hk.mixed_precision.set_policy`` must compute in the
same dtypes, and haiku's own mixed-precision tests are adapted for Linen and NNX.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jaxpr_walk import all_eqns
from lenient import adam

import mpfunc

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
MATMULS = ("dot_general", "conv_general_dilated")


def matmul_dtypes(fn, *args):
    """Operand dtypes of every matmul/conv in ``fn``'s jaxpr, in order, recursively."""
    return [tuple(str(v.aval.dtype) for v in e.invars) for e in all_eqns(fn, *args)
            if e.primitive.name in MATMULS]


def nnx_matmul_dtypes(model, x):
    """`matmul_dtypes` of ``model(x)`` for a stateful NNX model (split, then merged)."""
    graphdef, state = nnx.split(model)
    return matmul_dtypes(lambda s, x: nnx.merge(graphdef, s)(x), state, x)


def dtypes(tree):
    return jax.tree.map(lambda x: np.dtype(x.dtype), tree)


# -- Linen: the cases ---------------------------------------------------------


def test_linen_dense_computes_half_with_float32_params():
    amp = mpfunc.linen_policy(nn.Dense(4), "mixed_f16")  # p=f32, c=f16, o=f32
    x = jnp.ones((2, 3))
    v = amp.init(jax.random.key(0), x)
    assert v["params"]["kernel"].dtype == F32
    assert matmul_dtypes(amp.apply, v, x) == [("float16", "float16")]
    assert amp.apply(v, x).dtype == F32
    assert jax.jit(amp.apply)(v, x).dtype == F32


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=False)(x)
        return nn.Dense(2)(nn.relu(x).mean((1, 2)))


def test_linen_conv_and_norm_policies():
    norm = "p=f32,c=f32,o=bf16"  # haiku's recipe: BN in float32, hands bf16 on
    amp = mpfunc.linen_policy(ConvNet(), "mixed_bf16", {nn.BatchNorm: norm})
    x = jnp.ones((2, 6, 6, 3))
    v = amp.init(jax.random.key(0), x)
    got = matmul_dtypes(lambda v, x: amp.apply(v, x, mutable=["batch_stats"]), v, x)
    assert got == [("bfloat16", "bfloat16")] * 2
    y, state = amp.apply(v, x, mutable=["batch_stats"])
    assert y.dtype == F32 and state["batch_stats"]["BatchNorm_0"]["mean"].dtype == F32


def test_linen_policy_on_the_root_class_casts_its_output():
    # The root's class in per_class: that policy is the root's, output included.
    amp = mpfunc.linen_policy(nn.Dense(3), "mixed_f16", {nn.Dense: "p=f16,c=f32,o=bf16"})
    v = amp.init(jax.random.key(0), jnp.ones((1, 2)))
    assert v["params"]["kernel"].dtype == F16
    assert matmul_dtypes(amp.apply, v, jnp.ones((1, 2))) == [("float32", "float32")]
    assert amp.apply(v, jnp.ones((1, 2))).dtype == BF16


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.Dense(4)(x))


class TwoBlocks(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(Block()(nn.Dense(4)(x)))


def test_linen_children_inherit_their_policied_parent():
    amp = mpfunc.linen_policy(TwoBlocks(), "p=f32,c=bf16,o=f32", {Block: "p=f16,c=f32,o=bf16"})
    x = jnp.ones((2, 3))
    v = amp.init(jax.random.key(0), x)
    assert dtypes(v["params"]) == {
        "Dense_0": {"kernel": F32, "bias": F32}, "Dense_1": {"kernel": F32, "bias": F32},
        "Block_0": {"Dense_0": {"kernel": F16, "bias": F16},
                    "Dense_1": {"kernel": F16, "bias": F16}}}
    # outer Dense in bf16; the block's Denses (no policy of their own) in the block's f32
    assert matmul_dtypes(amp.apply, v, x) == [
        ("bfloat16", "bfloat16"), ("float32", "float32"), ("float32", "float32"),
        ("bfloat16", "bfloat16")]
    assert amp.apply(v, x).dtype == F32


# -- Linen: haiku's mixed_precision_test.py, adapted ----------------------------------


class InnerModule(nn.Module):
    @nn.compact
    def __call__(self):
        w = self.param("w", nn.initializers.ones, (), jnp.bfloat16)
        self.sow("seen", "w", w)
        return jnp.ones([], jnp.bfloat16)

    class InnerInnerModule(nn.Module):
        @nn.compact
        def __call__(self):
            w = self.param("w", nn.initializers.ones, (), jnp.bfloat16)
            self.sow("seen", "w", w)
            return jnp.ones([], jnp.bfloat16)


class OuterModule(nn.Module):
    @nn.compact
    def __call__(self):
        w = self.param("w", nn.initializers.ones, (), jnp.bfloat16)
        self.sow("seen", "w", w)
        inner_ret = InnerModule(name="inner_module")()
        self.sow("seen", "inner_ret", inner_ret)
        return jnp.ones([], jnp.bfloat16)


class Root(nn.Module):
    cls: type

    @nn.compact
    def __call__(self):
        out = self.cls(name="inner_module")()
        self.sow("seen", "ret", out)
        return out


def run_linen(amp):
    """(param dtypes after init, output dtype, dtypes seen inside) for a no-input net."""
    v = amp.init(jax.random.key(28))
    out, seen = amp.apply({"params": v["params"]}, mutable=["seen"])
    return dtypes(v["params"]), np.dtype(out.dtype), dtypes(seen["seen"])


@pytest.mark.parametrize("cls", [InnerModule, InnerModule.InnerInnerModule,
                                 type("LocalModule", (InnerModule,), {})],
                         ids=["class", "inner_class", "local_subclass"])
def test_haiku_set_global_policy(cls):
    amp = mpfunc.linen_policy(Root(cls), "f32", {cls: "p=f16,c=f32,o=f16"})
    params, ret, seen = run_linen(amp)
    assert seen["ret"] == (F16,) and ret == F32  # the module's, then the root's output dtype
    assert params == {"inner_module": {"w": F16}}
    assert seen["inner_module"]["w"] == (F32,)


def test_haiku_clear_policy_means_no_casts():
    amp = mpfunc.linen_policy(Root(InnerModule), "bf16")  # everything bfloat16, as created
    params, ret, seen = run_linen(amp)
    assert params == {"inner_module": {"w": BF16}} and ret == BF16 and seen["ret"] == (BF16,)
    assert seen["inner_module"]["w"] == (BF16,)


def test_haiku_set_global_policy_nested():
    amp = mpfunc.linen_policy(Root(OuterModule), "bf16", {
        OuterModule: "p=f32,c=f16,o=f32", InnerModule: "p=f16,c=f32,o=f32"})
    params, ret, seen = run_linen(amp)
    outer = seen["inner_module"]
    assert ret == BF16  # the root's own output dtype
    assert outer["inner_ret"] == (F32,)  # the inner module's output dtype
    assert outer["w"] == (F16,) and outer["inner_module"]["w"] == (F32,)  # compute dtypes
    assert params == {"inner_module": {"w": F32, "inner_module": {"w": F16}}}  # param dtypes


def test_haiku_policy_factory():
    def factory():
        class MyModule(nn.Module):
            def __call__(self, x):
                return x

        return MyModule

    cls1, cls2 = factory(), factory()

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return cls1()(x), cls2()(x)

    amp = mpfunc.linen_policy(Net(), "f32", {cls1: "o=f16", cls2: "o=bf16"})
    v = amp.init(jax.random.key(0), jnp.ones([]))
    spy = {}

    def record(next_fun, args, kwargs, ctx):
        out = next_fun(*args, **kwargs)
        if type(ctx.module) in (cls1, cls2):
            spy[type(ctx.module)] = np.dtype(out.dtype)
        return out

    with nn.intercept_methods(record):  # outermost: sees what each module returned
        amp.apply(v, jnp.ones([]))
    assert spy[cls1] == F16 and spy[cls2] == BF16


def test_policy_follows_the_exact_class_before_its_bases():
    class MyDense(nn.Dense):
        pass

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return MyDense(3)(nn.Dense(3)(x))

    amp = mpfunc.linen_policy(Net(), "f32", {nn.Dense: "bf16", MyDense: "f16"})
    v = amp.init(jax.random.key(0), jnp.ones((1, 2)))
    assert matmul_dtypes(amp.apply, v, jnp.ones((1, 2))) == [("bfloat16", "bfloat16"),
                                                            ("float16", "float16")]
    amp = mpfunc.linen_policy(Net(), "f32", {nn.Dense: "bf16"})  # a subclass inherits
    v = amp.init(jax.random.key(0), jnp.ones((1, 2)))
    assert matmul_dtypes(amp.apply, v, jnp.ones((1, 2))) == [("bfloat16", "bfloat16")] * 2


# -- Linen against haiku itself -------------------------------------------------------

def haiku_mlp():
    hk = pytest.importorskip("haiku")

    class HkMLP(hk.Module):
        def __call__(self, x):
            x = hk.LayerNorm(-1, True, True)(hk.Linear(8)(x))
            return hk.Linear(4)(jax.nn.relu(x))

    return hk, HkMLP


class LnMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(8)(x))
        return nn.Dense(4)(nn.relu(x))


@pytest.mark.parametrize("root, norm", [
    ("p=f32,c=f16,o=f32", "p=f32,c=f32,o=f16"),
    ("p=f32,c=bf16,o=f32", "p=f32,c=f32,o=bf16"),
    ("p=f16,c=f16,o=f32", "p=f32,c=f32,o=f16"),
    ("c=bf16", None),
    ("p=f32,c=f16,o=bf16", "p=f16,c=f32,o=f32"),
])
def test_linen_matches_haiku_set_policy(root, norm):
    hk, HkMLP = haiku_mlp()
    jmp = pytest.importorskip("jmp")
    x = jax.random.normal(jax.random.key(1), (2, 3))
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.numpy_dtype_promotion("standard"))  # haiku's own f16 x f32
        stack.enter_context(hk.mixed_precision.push_policy(HkMLP, jmp.get_policy(root)))
        if norm:
            stack.enter_context(hk.mixed_precision.push_policy(hk.LayerNorm,
                                                               jmp.get_policy(norm)))
        f = hk.without_apply_rng(hk.transform(lambda x: HkMLP()(x)))
        hp = f.init(jax.random.key(0), x)
        theirs = matmul_dtypes(f.apply, hp, x), np.dtype(f.apply(hp, x).dtype)
    amp = mpfunc.linen_policy(LnMLP(), jmp.get_policy(root),
                              {nn.LayerNorm: norm} if norm else None)
    v = amp.init(jax.random.key(0), x)
    with jax.numpy_dtype_promotion("standard"):  # haiku and flax both promote f16 x f32
        ours = matmul_dtypes(amp.apply, v, x), np.dtype(amp.apply(v, x).dtype)
    # hk.Linear's jnp.dot takes f32 x f16 as such while flax's Dense first promotes the
    # f16 kernel: the same float32 computation, so compare the dtype each matmul runs in.
    def computed(pairs):
        return [str(jnp.promote_types(a, b)) for a, b in pairs]

    with jax.numpy_dtype_promotion("standard"):
        assert (computed(ours[0]), ours[1]) == (computed(theirs[0]), theirs[1])
    assert all(a == b for a, b in ours[0])
    assert sorted(map(str, jax.tree.leaves(dtypes(v["params"])))) == \
        sorted(map(str, jax.tree.leaves(dtypes(hp))))


# -- Linen: training and collections --------------------------------------------------


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(16)(x)
        x = nn.LayerNorm()(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(4)(nn.relu(x))


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    w = rng.normal(size=(8, 4)).astype(np.float32)
    return x, np.argmax(x @ w, -1)


NORMS_F16 = {cls: "p=f32,c=f32,o=f16" for cls in mpfunc.norm_classes("linen")}


def test_linen_training_with_dynamic_scale_and_master_weights():
    amp = mpfunc.linen_policy(LinenNet(), "p=f16,c=f16,o=f32", NORMS_F16)
    x, y = data()
    v = amp.init(jax.random.key(0), x)
    params, stats = v["params"], v["batch_stats"]
    assert params["Dense_0"]["kernel"].dtype == F16 and params["LayerNorm_0"]["scale"].dtype == F32
    assert matmul_dtypes(lambda p: amp.apply({"params": p, "batch_stats": stats}, x,
                                             mutable=["batch_stats"]), params) == \
        [("float16", "float16")] * 2
    opt = mpfunc.dynamic_scale(mpfunc.master_weights(adam(1e-2)), preset="naive",
                               init_scale=2.0**10)
    state = opt.init(params)

    @jax.jit
    def step(params, stats, state):
        def lf(p):
            logits, new = amp.apply({"params": p, "batch_stats": stats}, x,
                                    mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return mpfunc.scale_loss(loss, state), (loss, new["batch_stats"])

        g, (loss, stats) = jax.grad(lf, has_aux=True)(params)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), stats, state, loss

    losses = []
    for _ in range(40):
        params, stats, state, loss = step(params, stats, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert params["Dense_0"]["kernel"].dtype == F16
    assert stats["BatchNorm_0"]["mean"].dtype == F32


def test_linen_apply_before_init_and_errors():
    amp = mpfunc.linen_policy(LinenNet(), "p=f16,c=f16,o=f32", NORMS_F16)
    v = LinenNet().init(jax.random.key(0), jnp.ones((2, 8)))  # plain float32 init
    with pytest.raises(RuntimeError, match="call `init`"):
        amp.cast_params(v["params"])
    y, _ = amp.apply(v, jnp.ones((2, 8)), mutable=["batch_stats"])
    assert y.dtype == F32
    assert amp.cast_params(v["params"])["Dense_0"]["kernel"].dtype == F16
    with pytest.raises(TypeError, match="`module` must be a flax.linen.Module"):
        mpfunc.linen_policy(lambda x: x)
    with pytest.raises(TypeError, match="`per_class` keys must be module classes"):
        mpfunc.linen_policy(LinenNet(), "f32", {"LayerNorm": "f32"})
    with pytest.raises(TypeError, match="`per_class` must be a mapping"):
        mpfunc.linen_policy(LinenNet(), "f32", [nn.LayerNorm])
    with pytest.raises(ValueError, match="`per_class\\[LayerNorm\\]`: .*unknown dtype 'bad'"):
        mpfunc.linen_policy(LinenNet(), "f32", {nn.LayerNorm: "bad"})


class WithMetadata(nn.Module):
    """Uses an fp8-style "overwrite with gradient" collection and an RNG stream."""

    @nn.compact
    def __call__(self, x):
        amax = self.variable("_overwrite_with_gradient", "amax", jnp.ones, (4,), jnp.float32)
        noise = jax.random.bernoulli(self.make_rng("dropout"), 0.5, (x.shape[0], 4))
        y = nn.Dense(4)(x)
        return jnp.where(noise, y, y * amax.value.astype(y.dtype))


def test_linen_never_casts_non_param_collections_or_rngs():
    amp = mpfunc.linen_policy(WithMetadata(), "p=f16,c=f16,o=f32")
    key = jax.random.key(0)
    v = amp.init({"params": key, "dropout": key}, jnp.ones((2, 3)))
    assert v["params"]["Dense_0"]["kernel"].dtype == F16
    assert v["_overwrite_with_gradient"]["amax"].dtype == F32  # metadata: never cast
    y = amp.apply(v, jnp.ones((2, 3)), rngs={"dropout": jax.random.key(1)})
    assert y.dtype == F32


# -- Linen: layers that declare a dtype ------------------------------------------------


class Declared(nn.Module):
    """flax's examples in miniature: every layer declares float32, but one."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(4, (3, 3), use_bias=False, dtype=jnp.float32)(x)
        x = nn.BatchNorm(use_running_average=not train, dtype=jnp.float32)(x)
        x = nn.Dense(4)(nn.relu(x).mean((1, 2)))  # no dtype: follows the policy
        return nn.Dense(2, dtype=jnp.float32)(x)


def test_linen_declared_dtypes_win_with_one_warning_naming_the_layers():
    # They used to win silently: the policy was a no-op on flax's own examples.
    amp = mpfunc.linen_policy(Declared(), "mixed_f16")
    x = jnp.ones((2, 6, 6, 3))
    with pytest.warns(mpfunc.DeclaredDtypeWarning) as record:
        v = amp.init(jax.random.key(0), x)
    (w,) = record
    msg = str(w.message)
    assert msg.startswith("linen_policy: 3 layer(s) declare a `dtype` other than")
    for name in ("Conv_0 (Conv: float32, policy float16)",
                 "BatchNorm_0 (BatchNorm: float32, policy float16)",
                 "Dense_1 (Dense: float32, policy float16)", "override_declared=True"):
        assert name in msg
    assert "Dense_0" not in msg
    fwd = lambda v, x: amp.apply(v, x, mutable=["batch_stats"])  # noqa: E731 - no warning
    with jax.numpy_dtype_promotion("standard"):
        # Conv_0 and Dense_1 in their declared float32 (Dense_0, with no policy of its
        # own, has its float32 input not cast, so it promotes to float32 too)
        assert matmul_dtypes(fwd, v, x) == [("float32", "float32")] * 3


def test_linen_override_declared_applies_the_policy():
    amp = mpfunc.linen_policy(Declared(), "mixed_f16", override_declared=True)
    x = jax.random.normal(jax.random.key(1), (2, 6, 6, 3))
    v = amp.init(jax.random.key(0), x)  # no warning: filterwarnings = error
    fwd = lambda v, x: amp.apply(v, x, mutable=["batch_stats"])  # noqa: E731
    with jax.numpy_dtype_promotion("standard"):
        assert matmul_dtypes(fwd, v, x) == [("float16", "float16")] * 3
        y, state = fwd(v, x)
        ref, _ = Declared().apply(v, x, mutable=["batch_stats"])
    assert y.dtype == F32 and state["batch_stats"]["BatchNorm_0"]["mean"].dtype == F32
    np.testing.assert_allclose(y, ref, rtol=0.02, atol=0.02)
    # the declared dtypes are back after the call (a plain flax apply still uses them)
    assert matmul_dtypes(lambda v, x: Declared().apply(v, x, mutable=["batch_stats"]), v,
                         x)[0] == ("float32", "float32")


def test_linen_declared_dtype_matching_its_policy_is_not_reported():
    # BatchNorm declared float32 under a float32 norm policy: nothing to say. The Conv and
    # the last Dense still differ, and override_declared takes them to float16 only.
    amp = mpfunc.linen_policy(Declared(), "mixed_f16", {nn.BatchNorm: "p=f32,c=f32,o=f16"})
    with pytest.warns(mpfunc.DeclaredDtypeWarning, match=r"^linen_policy: 2 layer\(s\)"):
        amp.init(jax.random.key(0), jnp.ones((2, 6, 6, 3)))
    with pytest.raises(TypeError, match=r"`override_declared` must be True or False, got "
                                        r"str: 'yes'"):
        mpfunc.linen_policy(Declared(), "mixed_f16", override_declared="yes")


def test_nnx_layers_declaring_a_dtype_take_the_policys():
    # NNX has no declared-versus-default distinction (nnx.Embed fills in its param
    # dtype): nnx_apply_policy sets every layer's `dtype`, so the policy always applies.
    m = nnx.Sequential(nnx.Linear(3, 4, dtype=jnp.float32, rngs=nnx.Rngs(0)),
                       nnx.Linear(4, 2, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    m = mpfunc.nnx_apply_policy(m, "mixed_f16")
    assert nnx_matmul_dtypes(m, jnp.ones((2, 3))) == [("float16", "float16")] * 2


# -- NNX ------------------------------------------------------------------------------


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = self.bn(self.ln(self.l1(x)))
        return self.l2(nnx.relu(h))


NNX_NORMS_BF16 = {cls: "p=f32,c=f32,o=bf16" for cls in mpfunc.norm_classes("nnx")}


class TestNnx:
    @pytest.fixture(autouse=True)
    def _flax_promotion(self):
        # flax's norm layers call jnp.promote_types(half, float32) on half inputs, which
        # strict promotion refuses; that is flax's code, so its tests use "standard".
        with jax.numpy_dtype_promotion("standard"):
            yield

    def test_float32_params_bfloat16_compute_float32_outputs(self):
        m = mpfunc.nnx_apply_policy(NnxNet(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
        x = jnp.ones((2, 8))
        assert m(x).dtype == F32  # the issue: it was bfloat16
        assert m.l1.kernel[...].dtype == F32
        assert nnx_matmul_dtypes(m, x) == [("bfloat16", "bfloat16")] * 2

    def test_per_class_params_and_dtypes(self):
        m = mpfunc.nnx_apply_policy(NnxNet(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32", NNX_NORMS_BF16)
        assert m.l1.kernel[...].dtype == BF16 and m.l1.dtype == BF16
        assert m.ln.scale[...].dtype == F32 and m.ln.dtype == F32
        assert m.bn.mean[...].dtype == F32  # a BatchStat, never cast
        assert m(jnp.ones((2, 8))).dtype == F32
        assert m.l1(jnp.ones((2, 8))).dtype == BF16  # no policy of its own: no output cast
        assert m.ln(jnp.ones((2, 16), jnp.bfloat16)).dtype == BF16  # its policy's output

    def test_same_dtypes_as_linen(self):
        x = jnp.ones((2, 8))
        m = mpfunc.nnx_apply_policy(NnxNet(nnx.Rngs(0)), "p=f32,c=f16,o=f32",
                                    {nnx.LayerNorm: "p=f32,c=f32,o=f16",
                                     nnx.BatchNorm: "p=f32,c=f32,o=f16"})
        amp = mpfunc.linen_policy(LinenNet(), "p=f32,c=f16,o=f32", NORMS_F16)
        v = amp.init(jax.random.key(0), x)
        linen = matmul_dtypes(lambda v: amp.apply(v, x, mutable=["batch_stats"]), v)
        assert nnx_matmul_dtypes(m, x) == linen == [("float16", "float16")] * 2
        assert m(x).dtype == amp.apply(v, x, mutable=["batch_stats"])[0].dtype == F32

    def test_nested_policies_and_reapplying(self):
        class Inner(nnx.Module):
            def __init__(self, rngs):
                self.fc = nnx.Linear(4, 4, rngs=rngs)

            def __call__(self, x):
                return self.fc(x)

        class Outer(nnx.Module):
            def __init__(self, rngs):
                self.fc = nnx.Linear(4, 4, rngs=rngs)
                self.inner = Inner(rngs)

            def __call__(self, x):
                return self.inner(self.fc(x))

        m = mpfunc.nnx_apply_policy(Outer(nnx.Rngs(0)), "p=f32,c=bf16,o=f32",
                                    {Inner: "p=f16,c=f32,o=bf16"})
        x = jnp.ones((1, 4))
        assert m.inner.fc.kernel[...].dtype == F16 and m.inner.fc.dtype == F32
        assert nnx_matmul_dtypes(m, x) == [("bfloat16", "bfloat16"),
                                                    ("float32", "float32")]
        assert m(x).dtype == F32 and m.inner(x).dtype == BF16
        assert isinstance(m, Outer) and isinstance(m.inner, Inner)
        mpfunc.nnx_apply_policy(m, "f32")  # replaces the previous policies
        assert type(m.inner) is Inner and type(m) is not Outer  # the root always casts
        assert nnx_matmul_dtypes(m, x) == [("float32", "float32")] * 2
        assert m.inner.fc.kernel[...].dtype == F32

    def test_jit_split_merge_keep_the_policy(self):
        m = mpfunc.nnx_apply_policy(NnxNet(nnx.Rngs(0)), "p=f32,c=bf16,o=f32", NNX_NORMS_BF16)
        graphdef, state = nnx.split(m)
        assert nnx.merge(graphdef, state)(jnp.ones((2, 8))).dtype == F32
        assert nnx.jit(lambda m, x: m(x))(m, jnp.ones((2, 8))).dtype == F32

    def test_training_with_nnx_optimizer(self):
        m = mpfunc.nnx_apply_policy(NnxNet(nnx.Rngs(0)), "p=f32,c=bf16,o=f32", NNX_NORMS_BF16)
        opt = nnx.Optimizer(m, mpfunc.no_scale(adam(1e-2)), wrt=nnx.Param)
        x, y = data()

        @nnx.jit
        def step(m, opt):
            def lf(m):
                return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

            loss, g = nnx.value_and_grad(lf)(m)
            opt.update(m, g)
            return loss

        losses = [float(step(m, opt)) for _ in range(40)]
        assert losses[-1] < 0.5 * losses[0]
        metrics = mpfunc.scale_metrics(opt.opt_state)  # found inside nnx.Optimizer's state
        assert float(metrics["loss_scale"][...]) == 1.0
        assert m.l1.kernel[...].dtype == F32 and m.bn.mean[...].dtype == F32

    def test_errors(self):
        with pytest.raises(TypeError, match="`model` must be a flax.nnx.Module"):
            mpfunc.nnx_apply_policy(object())
        with pytest.raises(ValueError, match="`framework` must be 'linen' or 'nnx'"):
            mpfunc.norm_classes("haiku")
