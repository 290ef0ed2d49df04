"""The flax ecosystem: Linen and NNX transformers under mpfunc's policies and AMP modes.

Each check reads the dtypes the matmuls really run in (the jaxpr's ``dot_general``
operands), for pre-LN and post-LN blocks, through `linen_policy`, `nnx_apply_policy` and
`convert_to_amp` (apex O2, with flax's ``model.apply`` and with an NNX split/merge).
"""

import collections

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
VOCAB, D, T = 32, 16, 6


@pytest.fixture(autouse=True)
def _flax_promotion():
    # flax's norm and attention layers promote half with float32 internally, which strict
    # promotion refuses; that is flax's code, so these tests run under "standard".
    with jax.numpy_dtype_promotion("standard"):
        yield


def dot_dtypes(fn, *args):
    """Counter of (lhs, rhs) dtypes of every dot_general in ``fn``'s jaxpr, recursively,
    and the set of dot algorithm presets seen."""
    count, presets = collections.Counter(), set()
    for e in all_eqns(fn, *args):
        if e.primitive.name == "dot_general":
            count[tuple(str(v.aval.dtype) for v in e.invars)] += 1
            if e.params.get("precision") is not None:
                presets.add(str(e.params["precision"]))
    return count, presets


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, T)).astype(np.int32)


# -- Linen ----------------------------------------------------------------------------


class LinenBlock(nn.Module):
    pre: bool

    @nn.compact
    def __call__(self, x):
        att = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=D)
        mlp = nn.Sequential([nn.Dense(2 * D), nn.gelu, nn.Dense(D)])
        if self.pre:
            x = x + att(nn.LayerNorm()(x))
            return x + mlp(nn.LayerNorm()(x))
        x = nn.LayerNorm()(x + att(x))
        return nn.LayerNorm()(x + mlp(x))


class LinenLM(nn.Module):
    pre: bool = True

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        for _ in range(2):
            x = LinenBlock(self.pre)(x)
        if self.pre:
            x = nn.LayerNorm()(x)
        return nn.Dense(VOCAB)(x)


# 2 blocks x (q, k, v, out, attention logits, attention values, mlp in, mlp out) + head
N_DOTS = 2 * 8 + 1


@pytest.mark.parametrize("pre", [True, False], ids=["pre_ln", "post_ln"])
def test_linen_transformer_policy_computes_in_half(pre):
    amp = mpfunc.linen_policy(LinenLM(pre), "p=f32,c=f16,o=f32",
                              {nn.LayerNorm: "p=f32,c=f32,o=f16"})
    v = amp.init(jax.random.key(0), TOKENS)
    assert v["params"]["Dense_0"]["kernel"].dtype == F32
    count, _ = dot_dtypes(amp.apply, v, TOKENS)
    assert count == {("float16", "float16"): N_DOTS}
    assert amp.apply(v, TOKENS).dtype == F32
    grads = jax.eval_shape(jax.grad(lambda p: amp.apply({"params": p}, TOKENS).sum()), v["params"])
    assert {np.dtype(g.dtype) for g in jax.tree.leaves(grads)} == {F32}


@pytest.mark.parametrize("pre", [True, False], ids=["pre_ln", "post_ln"])
def test_linen_transformer_apex_o2(pre):
    model = LinenLM(pre)
    amp = mpfunc.convert_to_amp(model.apply, optax.sgd(0.1), mode="apex", opt_level="O2",
                                verbosity=0)
    variables = model.init(jax.random.key(0), TOKENS)
    v = amp.cast_params(variables)
    assert v["params"]["Dense_0"]["kernel"].dtype == F16
    assert v["params"]["LinenBlock_0"]["LayerNorm_0"]["scale"].dtype == F32
    count, _ = dot_dtypes(amp.apply_fn, v, TOKENS)
    assert count == {("float16", "float16"): N_DOTS}, count  # the issue: 17 of 17 in f32
    assert amp.apply_fn(v, TOKENS).dtype == F32


def test_linen_transformer_trains_under_a_policy():
    amp = mpfunc.linen_policy(LinenLM(), "p=f32,c=f16,o=f32", {nn.LayerNorm: "p=f32,c=f32,o=f16"})
    params = amp.init(jax.random.key(0), TOKENS)["params"]
    opt = mpfunc.dynamic_scale(adam(1e-2))
    state = opt.init(params)
    x, y = TOKENS[:, :-1], TOKENS[:, 1:]

    @jax.jit
    def step(params, state):
        def lf(p):
            logits = amp.apply({"params": p}, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return mpfunc.scale_loss(loss, state), loss

        g, loss = jax.grad(lf, has_aux=True)(params)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    losses = []
    for _ in range(15):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert int(state.skipped_steps) == 0


# -- NNX ------------------------------------------------------------------------------


class NnxBlock(nnx.Module):
    def __init__(self, pre, rngs):
        self.pre = pre
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.att = nnx.MultiHeadAttention(2, D, decode=False, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)

    def mlp(self, x):
        return self.fc2(nnx.gelu(self.fc1(x)))

    def __call__(self, x):
        if self.pre:
            x = x + self.att(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.att(x))
        return self.ln2(x + self.mlp(x))


class NnxLM(nnx.Module):
    def __init__(self, rngs, pre=True):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(pre, rngs) for _ in range(2)])
        self.ln_f = nnx.LayerNorm(D, rngs=rngs) if pre else None
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return self.head(x)


def nnx_dots(model, tokens):
    graphdef, state = nnx.split(model)
    return dot_dtypes(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)


@pytest.mark.parametrize("compute", ["f16", "bf16"])
@pytest.mark.parametrize("pre", [True, False], ids=["pre_ln", "post_ln"])
def test_nnx_transformer_policy_computes_in_half(pre, compute):
    model = mpfunc.nnx_apply_policy(NnxLM(nnx.Rngs(0), pre), f"p=f32,c={compute},o=f32",
                                    {nnx.LayerNorm: f"p=f32,c=f32,o={compute}"})
    half = str(np.dtype(mpfunc.get_policy(compute).compute_dtype))
    count, presets = nnx_dots(model, TOKENS)
    assert count == {(half, half): N_DOTS}
    out = nnx.jit(lambda m, t: m(t))(model, TOKENS)  # float16 attention compiles on CPU
    assert out.dtype == F32
    if jax.default_backend() == "cpu" and compute == "f16":
        assert not any("F16_F16_F32" in p for p in presets)  # routed past the preset


def test_nnx_float16_attention_matches_float32_and_trains():
    ref = NnxLM(nnx.Rngs(0))
    model = mpfunc.nnx_apply_policy(NnxLM(nnx.Rngs(0)), "p=f32,c=f16,o=f32",
                                    {nnx.LayerNorm: "p=f32,c=f32,o=f16"})
    out = nnx.jit(lambda m, t: m(t))(model, TOKENS)
    np.testing.assert_allclose(out, ref(TOKENS), atol=0.05, rtol=0.05)
    opt = nnx.Optimizer(model, mpfunc.dynamic_scale(adam(1e-2)), wrt=nnx.Param)
    x, y = TOKENS[:, :-1], TOKENS[:, 1:]

    @nnx.jit
    def step(model, opt):
        def lf(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        loss, g = nnx.value_and_grad(lf)(model)
        opt.update(model, g)
        return loss

    losses = [float(step(model, opt)) for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]
    assert model.head.kernel[...].dtype == F32


def test_nnx_transformer_apex_o2_via_split_merge():
    model = NnxLM(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def apply_fn(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    amp = mpfunc.convert_to_amp(apply_fn, optax.sgd(0.1), mode="apex", opt_level="O2",
                                verbosity=0)
    s = amp.cast_params(nnx.to_pure_dict(state))
    half_state = nnx.State(state)
    nnx.replace_by_pure_dict(half_state, s)
    assert s["head"]["kernel"].dtype == F16 and s["ln_f"]["scale"].dtype == F32
    count, _ = dot_dtypes(amp.apply_fn, half_state, TOKENS)
    assert count == {("float16", "float16"): N_DOTS}, count
