"""Tests for mpfunc._src.flax_policy: per-class policies for flax Linen and NNX."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from lenient import adam

import mpfunc

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


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


class TestLinen:
    def make(self):
        return mpfunc.linen_policy(LinenNet(), "p=f16,c=f16,o=f32",
                                   {cls: "f32" for cls in mpfunc.norm_classes("linen")})

    def test_params_per_class_and_collections_untouched(self):
        amp = self.make()
        v = amp.init(jax.random.key(0), jnp.ones((2, 8)))
        assert v["params"]["Dense_0"]["kernel"].dtype == F16
        assert v["params"]["LayerNorm_0"]["scale"].dtype == F32
        assert v["params"]["BatchNorm_0"]["scale"].dtype == F32
        assert v["batch_stats"]["BatchNorm_0"]["mean"].dtype == F32  # never cast

    def test_computation_dtypes(self):
        amp = self.make()
        v = amp.init(jax.random.key(0), jnp.ones((2, 8)))
        seen = {}

        def spy(next_fun, args, kwargs, ctx):
            out = next_fun(*args, **kwargs)
            if ctx.method_name == "__call__" and ctx.module is not amp.module:
                seen[type(ctx.module).__name__ + str(len(seen))] = (args[0].dtype, out.dtype)
            return out

        with nn.intercept_methods(spy):
            y, _ = amp.apply(v, jnp.ones((2, 8)), mutable=["batch_stats"])
        assert y.dtype == F32
        # (the spy sees each module's inputs before mpfunc casts them; outputs tell the
        # dtype each module computed in)
        kinds = {k.rstrip("0123456789"): d[1] for k, d in seen.items()}
        assert kinds["Dense"] == F16
        assert kinds["LayerNorm"] == F32
        assert kinds["BatchNorm"] == F32

    def test_training_with_dynamic_scale(self):
        amp = self.make()
        x, y = data()
        v = amp.init(jax.random.key(0), x)
        params, stats = v["params"], v["batch_stats"]
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

            with jax.numpy_dtype_promotion("standard"):
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

    def test_apply_before_init_and_errors(self):
        amp = self.make()
        v = LinenNet().init(jax.random.key(0), jnp.ones((2, 8)))  # plain float32 init
        with pytest.raises(RuntimeError, match="call `init`"):
            amp.cast_params(v["params"])
        y, _ = amp.apply(v, jnp.ones((2, 8)), mutable=["batch_stats"])
        assert y.dtype == F32
        with pytest.raises(TypeError, match="`module` must be a flax.linen.Module"):
            mpfunc.linen_policy(lambda x: x)
        with pytest.raises(TypeError, match="`per_class` keys must be module classes"):
            mpfunc.linen_policy(LinenNet(), "f32", {"LayerNorm": "f32"})


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


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = self.bn(self.ln(self.l1(x)))
        return self.l2(nnx.relu(h)).astype(jnp.float32)


class TestNnx:
    def test_per_class_params_and_dtypes(self):
        m = mpfunc.nnx_apply_policy(NnxNet(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32",
                                    {cls: "f32" for cls in mpfunc.norm_classes("nnx")})
        assert m.l1.kernel[...].dtype == BF16 and m.l1.dtype == BF16
        assert m.ln.scale[...].dtype == F32 and m.ln.dtype == F32
        assert m.bn.mean[...].dtype == F32  # a BatchStat, never cast
        with jax.numpy_dtype_promotion("standard"):
            assert m(jnp.ones((2, 8))).dtype == F32
            assert m.l1(jnp.ones((2, 8))).dtype == BF16
            assert m.ln(jnp.ones((2, 16), jnp.bfloat16)).dtype == F32

    def test_training_with_nnx_optimizer(self):
        m = mpfunc.nnx_apply_policy(NnxNet(nnx.Rngs(0)), "p=f32,c=bf16,o=f32",
                                    {nnx.LayerNorm: "f32", nnx.BatchNorm: "f32"})
        opt = nnx.Optimizer(m, mpfunc.no_scale(adam(1e-2)), wrt=nnx.Param)
        x, y = data()

        @nnx.jit
        def step(m, opt):
            def lf(m):
                with jax.numpy_dtype_promotion("standard"):
                    logits = m(x)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

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
