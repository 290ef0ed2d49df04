"""Tests for mpfunc._src.autocast: op-level autocast for JAX."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import mpfunc
from mpfunc import AutocastLists

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


def ops(fn, *args):
    """(primitive name, input float dtypes, output dtypes) of every equation, recursively."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            ins = tuple(np.dtype(v.aval.dtype) for v in e.invars
                        if hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.floating))
            outs = tuple(np.dtype(v.aval.dtype) for v in e.outvars if hasattr(v.aval, "dtype"))
            out.append((e.primitive.name, ins, outs))
            for p in e.params.values():
                subs = p if isinstance(p, tuple) else (p,)
                for sub in subs:
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def dtypes_of(recorded, name):
    return [r for r in recorded if r[0] == name]


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def layer_norm(x, scale, bias):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * scale + bias


def attention_block(p, x):
    h = layer_norm(x, p["ln_scale"], p["ln_bias"])
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    att = jax.nn.softmax(jnp.einsum("td,sd->ts", q, k) / np.sqrt(q.shape[-1]))
    return x + jnp.einsum("ts,sd->td", att, v) @ p["wo"]


def conv_bn(p, x):
    y = jax.lax.conv_general_dilated(x, p["kernel"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    mean = jnp.mean(y, (0, 1, 2))
    var = jnp.var(y, (0, 1, 2))
    return (y - mean) * jax.lax.rsqrt(var + 1e-5) * p["gamma"] + p["beta"]


def rand(*shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


MLP_P = {"w1": rand(8, 16), "b1": jnp.zeros(16), "w2": rand(16, 4, seed=1), "b2": jnp.zeros(4)}
ATT_P = {"ln_scale": jnp.ones(8), "ln_bias": jnp.zeros(8), "wq": rand(8, 8, seed=1),
         "wk": rand(8, 8, seed=2), "wv": rand(8, 8, seed=3), "wo": rand(8, 8, seed=4)}
CONV_P = {"kernel": rand(3, 3, 2, 4), "gamma": jnp.ones(4), "beta": jnp.zeros(4)}


class TestOpDtypes:
    def test_mlp(self):
        rec = ops(mpfunc.autocast(mlp), MLP_P, rand(2, 8))
        dots = dtypes_of(rec, "dot_general")
        assert len(dots) == 2
        for _, ins, outs in dots:
            assert ins == (F16, F16) and outs == (F32,)  # f16 inputs, f32 accumulation
        assert all(r[2] != (F16,) or r[0] != "add" for r in rec)  # f16 + f32 bias -> f32

    def test_attention_block(self):
        rec = ops(mpfunc.autocast(attention_block), ATT_P, rand(5, 8))
        for _, ins, _ in dtypes_of(rec, "dot_general"):
            assert ins == (F16, F16)
        for name in ("exp", "reduce_sum", "rsqrt"):
            found = dtypes_of(rec, name)
            assert found and all(r[1] == (F32,) for r in found), name
        assert len(dtypes_of(rec, "dot_general")) == 6

    def test_conv_batchnorm(self):
        rec = ops(mpfunc.autocast(conv_bn, compute_dtype=jnp.bfloat16), CONV_P, rand(2, 5, 5, 2))
        (conv,) = dtypes_of(rec, "conv_general_dilated")
        assert conv[1] == (BF16, BF16) and conv[2] == (F32,)
        assert all(r[1] == (F32,) for r in dtypes_of(rec, "reduce_sum"))  # mean and var

    def test_everything_else_follows_inputs(self):
        f = mpfunc.autocast(lambda x: jnp.tanh(x) * 3.0 + 1)
        assert f(jnp.ones(3, jnp.float16)).dtype == F16
        assert f(jnp.ones(3, jnp.float32)).dtype == F32
        g = mpfunc.autocast(lambda a, b: a + b)
        with jax.numpy_dtype_promotion("standard"):  # the traced function mixes dtypes
            assert g(jnp.ones(2, jnp.float16), jnp.ones(2, jnp.bfloat16)).dtype == F32
            assert g(jnp.ones(2, jnp.float16), jnp.ones(2, jnp.float32)).dtype == F32

    def test_integer_and_static_arguments(self):
        f = mpfunc.autocast(lambda x, idx, scale: (x @ x.T)[idx] * scale)
        out = f(jnp.ones((3, 3)), jnp.array([0, 2]), 2)
        assert out.dtype == F16 and out.shape == (2, 3)

    def test_explicit_casts_are_kept(self):
        f = mpfunc.autocast(lambda x: jnp.tanh((x @ x).astype(jnp.bfloat16)))
        assert f(jnp.ones((2, 2))).dtype == BF16

    def test_lists_can_be_overridden(self):
        lists = AutocastLists(half_ops={"dot_general"}, float32_ops={"tanh"})
        rec = ops(mpfunc.autocast(lambda x: jnp.tanh(x @ x), lists=lists), jnp.ones((2, 2)))
        assert dtypes_of(rec, "tanh")[0][1] == (F32,)
        rec = ops(mpfunc.autocast(lambda x: jnp.exp(x @ x),
                                  lists=AutocastLists(float32_ops=set())), jnp.ones((2, 2)))
        assert dtypes_of(rec, "exp")[0][1] == (F16,)


class TestComposition:
    def test_jit_grad_value_and_grad(self):
        f = mpfunc.autocast(lambda p, x: jnp.mean(mlp(p, x) ** 2))
        x = rand(4, 8)
        v, g = jax.jit(jax.value_and_grad(f))(MLP_P, x)
        g2 = jax.grad(f)(MLP_P, x)
        assert v.dtype == F32
        for k in MLP_P:
            assert g[k].dtype == F32 and g[k].shape == MLP_P[k].shape
            np.testing.assert_allclose(g[k], g2[k], rtol=1e-6)
        ref = jax.grad(lambda p, x: jnp.mean(mlp(p, x) ** 2))(MLP_P, x)
        np.testing.assert_allclose(g["w1"], ref["w1"], rtol=0.05, atol=1e-2)

    def test_gradients_flow_in_autocast_dtypes(self):
        f = mpfunc.autocast(lambda w, x: jnp.sum(x @ w))
        rec = ops(jax.grad(f), rand(8, 4), rand(2, 8))
        dots = dtypes_of(rec, "dot_general")
        assert dots and all(ins == (F16, F16) for _, ins, _ in dots)
        # autocast(grad(f)) reaches the backward ops too
        rec = ops(mpfunc.autocast(jax.grad(lambda w, x: jnp.sum(x @ w))), rand(8, 4), rand(2, 8))
        assert all(ins == (F16, F16) for _, ins, _ in dtypes_of(rec, "dot_general"))

    def test_vmap(self):
        f = jax.vmap(mpfunc.autocast(lambda w, x: x @ w), in_axes=(None, 0))
        assert f(rand(8, 4), rand(3, 2, 8)).dtype == F16

    def test_checkpoint_scan_while_cond(self):
        def f(w, x):
            x = jax.checkpoint(lambda z: jnp.tanh(z @ w))(x)
            x, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)
            x = jax.lax.cond(jnp.sum(x) > 0, lambda z: z @ w, lambda z: z, x)
            return jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ w),
                                      (0, x))[1]

        g = mpfunc.autocast(f)
        rec = ops(g, rand(4, 4), rand(2, 4))
        dots = dtypes_of(rec, "dot_general")
        assert len(dots) == 4 and all(ins == (F16, F16) for _, ins, _ in dots)
        out = jax.jit(g)(rand(4, 4) * 0.1, rand(2, 4))
        assert out.dtype == F32  # the original dtypes at the control-flow edges
        np.testing.assert_allclose(out, f(rand(4, 4) * 0.1, rand(2, 4)), rtol=0.02, atol=1e-3)
        def differentiable(w, x):  # jax cannot reverse-differentiate while_loop
            x = jax.checkpoint(lambda z: jnp.tanh(z @ w))(x)
            x, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)
            return jnp.sum(jax.lax.cond(jnp.sum(x) > 0, lambda z: z @ w, lambda z: z, x))

        w = rand(4, 4) * 0.1
        gw = jax.grad(mpfunc.autocast(differentiable))(w, rand(2, 4))
        np.testing.assert_allclose(gw, jax.grad(differentiable)(w, rand(2, 4)), rtol=0.05,
                                   atol=5e-3)

    def test_custom_jvp_functions_are_autocast_inside(self):
        f = mpfunc.autocast(lambda x: jax.nn.softmax(jax.nn.relu(x @ x)))
        rec = ops(f, rand(3, 3))
        assert dtypes_of(rec, "max")[0][1][0] == F16  # relu ran on the f16 matmul output
        assert all(r[1] == (F32,) for r in dtypes_of(rec, "exp"))
        g = jax.grad(lambda x: jnp.sum(f(x) * jnp.arange(3.0)))(rand(3, 3))
        ref = jax.grad(lambda x: jnp.sum(jax.nn.softmax(jax.nn.relu(x @ x)) * jnp.arange(3.0)))(
            rand(3, 3))
        np.testing.assert_allclose(g, ref, rtol=0.05, atol=5e-3)

    def test_custom_vjp_backward_is_preserved(self):
        @jax.custom_vjp
        def reverse_grad(x):
            return x

        reverse_grad.defvjp(lambda x: (x, None), lambda _, g: (-g,))
        f = mpfunc.autocast(lambda w, x: jnp.sum(reverse_grad(x @ w)))
        g = jax.grad(f)(rand(3, 2), rand(4, 3))
        ref = jax.grad(lambda w, x: jnp.sum(x @ w))(rand(3, 2), rand(4, 3))
        np.testing.assert_allclose(g, -ref, rtol=0.02, atol=1e-2)  # reversed, as defined

    def test_nested_jit(self):
        inner = jax.jit(lambda a, b: a @ b)
        rec = ops(mpfunc.autocast(lambda a, b: inner(a, b) + 1), rand(2, 3), rand(3, 2))
        assert dtypes_of(rec, "dot_general")[0][1] == (F16, F16)

    def test_shard_map(self):
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

        def per_shard(w, x):
            return jax.lax.psum(x @ w, "model")

        f = jax.jit(jax.shard_map(mpfunc.autocast(per_shard), mesh=mesh,
                                  in_specs=(P("model", None), P("data", "model")),
                                  out_specs=P("data", None)))
        w, x = rand(8, 4), rand(8, 8)
        out = f(w, x)
        assert out.dtype == F16
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(x @ w), rtol=0.02,
                                   atol=0.05)


def _hlo_op_dtypes(fn, *args):
    text = jax.jit(fn).lower(*args).as_text()
    found = re.findall(r"stablehlo\.(dot_general|convolution|exponential|rsqrt|reduce|"
                       r"convert|add|multiply|maximum)\b[^\n]*->\s*tensor<([^>]*)>", text)
    return collections.Counter((op, t.split("x")[-1]) for op, t in found)


def test_compiled_program_equals_hand_cast_version():
    def hand(p, x):
        h16 = jax.lax.dot_general(x.astype(jnp.float16), p["w1"].astype(jnp.float16),
                                  (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32).astype(jnp.float16)
        h = jax.nn.relu(h16.astype(jnp.float32) + p["b1"])
        o16 = jax.lax.dot_general(h.astype(jnp.float16), p["w2"].astype(jnp.float16),
                                  (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32).astype(jnp.float16)
        return o16.astype(jnp.float32) + p["b2"]

    x = rand(4, 8)
    ours = _hlo_op_dtypes(mpfunc.autocast(mlp), MLP_P, x)
    theirs = _hlo_op_dtypes(hand, MLP_P, x)
    assert ours == theirs
    assert ours[("dot_general", "f32")] == 2


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(compute_dtype=jnp.float32), ValueError, "`compute_dtype` must be float16 or bfloat16"),
    # numpy alone reads "f16" as a 16-byte float and does not know "bf16"
    (dict(compute_dtype="fp16"), ValueError, "`compute_dtype`: unknown dtype 'fp16'. Valid "
                                            "names: .*'bf16'"),
    (dict(compute_dtype="f32"), ValueError, "or 'f16', 'bf16', 'half'\\), got 'f32'"),
    (dict(lists="dot_general"), TypeError, "`lists` must be an AutocastLists"),
])
def test_bad_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        mpfunc.autocast(lambda x: x, **kwargs)


@pytest.mark.parametrize("name, dtype", [("f16", jnp.float16), ("half", jnp.float16),
                                         ("bf16", jnp.bfloat16), ("bfloat16", jnp.bfloat16)])
def test_compute_dtype_takes_the_policy_names(name, dtype):
    out = mpfunc.autocast(lambda x, w: x @ w, compute_dtype=name)(jnp.ones((2, 3)), jnp.ones((3, 4)))
    assert out.dtype == dtype


def test_bad_lists():
    with pytest.raises(ValueError, match="in both `half_ops` and `float32_ops`"):
        AutocastLists(half_ops={"exp"}, float32_ops={"exp"})
    with pytest.raises(TypeError, match="`half_ops` must be a set"):
        AutocastLists(half_ops="dot_general")
    with pytest.raises(TypeError, match="`fn` must be callable"):
        mpfunc.autocast(3)


@pytest.fixture
def standard_promotion():
    # jax.nn.dot_product_attention mixes float16 and float32 itself (strict refuses it)
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.usefixtures("standard_promotion")
def test_float16_attention_compiles_on_every_backend():
    # jax.nn.dot_product_attention asks for the F16_F16_F32 dot algorithm with float16
    # inputs, which XLA:CPU refuses under jit. autocast expresses the float32
    # accumulation with preferred_element_type instead.
    q = rand(2, 5, 2, 8).astype(jnp.float16)

    def attention(q):
        return jax.nn.dot_product_attention(q, q, q).astype(jnp.float32).sum()

    if jax.default_backend() == "cpu":
        with pytest.raises(Exception, match="F16_F16_F32"):
            jax.jit(attention)(q)  # the problem, pinned: jax's own jit path
    ours = mpfunc.autocast(attention)
    assert "F16_F16_F32" not in str(jax.make_jaxpr(ours)(q))
    value, grad = jax.jit(jax.value_and_grad(ours))(q)
    assert grad.dtype == F16
    ref = attention(q.astype(jnp.float32))
    np.testing.assert_allclose(value, ref, rtol=2e-2)


@pytest.mark.usefixtures("standard_promotion")
def test_without_dot_algorithms_changes_nothing_else():
    from mpfunc._src.autocast import without_dot_algorithms

    q = rand(2, 5, 2, 8).astype(jnp.float16)

    def attention(q):
        return jax.nn.dot_product_attention(q, q, q, is_causal=True)

    routed = without_dot_algorithms(attention)
    def compute_ops(fn):  # nested jit is inlined by the rewrite; compare what it computes
        return [op for op in ops(fn, q) if op[0] not in ("jit", "pjit")]

    assert compute_ops(routed) == compute_ops(attention)  # same ops, dtypes and order
    assert "F16_F16_F32" in str(jax.make_jaxpr(attention)(q))
    assert "F16_F16_F32" not in str(jax.make_jaxpr(routed)(q))
    # eager jax falls back to exactly this when the preset is refused: same numbers
    np.testing.assert_array_equal(jax.jit(routed)(q), attention(q))
    g = jax.jit(jax.grad(lambda q: routed(q).astype(jnp.float32).sum()))(q)
    np.testing.assert_array_equal(g, jax.grad(lambda q: attention(q).astype(jnp.float32).sum())(q))


def bf16_attention_loss(w, x, heads=2):
    b, s, d = x.shape
    q, k, v = jnp.split(x @ w, 3, axis=-1)
    q, k, v = (t.reshape(b, s, heads, d // heads) for t in (q, k, v))
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
    return jnp.mean(jnp.einsum("bhqk,bkhd->bqhd", att, v).astype(jnp.float32) ** 2)


def test_bfloat16_attention_backward_runs_on_every_backend():
    # XLA:CPU runs some of the backward's bf16 x bf16 -> f32 dots with a kernel that
    # refuses them ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32",
    # jax 0.10.2): bf16 autocast of an attention block could not be trained on CPU.
    x = rand(2, 16, 32)
    w = rand(32, 96) / np.sqrt(32)
    f = mpfunc.autocast(bf16_attention_loss, compute_dtype=jnp.bfloat16)
    value, grad = jax.jit(jax.value_and_grad(f))(w, x)
    assert grad.dtype == F32 and np.all(np.isfinite(grad))
    ref_value, ref_grad = jax.value_and_grad(bf16_attention_loss)(w, x)
    np.testing.assert_allclose(value, ref_value, rtol=3e-2)
    np.testing.assert_allclose(grad, ref_grad, rtol=0.1, atol=0.1 * np.abs(ref_grad).max())


def test_bfloat16_dots_per_platform():
    # Elsewhere a bf16 x bf16 dot accumulates into float32 as one mixed dot; on CPU the
    # bf16-rounded operands are widened first (exact), so it computes the same products
    # and float32 sums, and compiles.
    a, b = rand(8, 16), rand(16, 4)
    f = mpfunc.autocast(lambda a, b: a @ b, compute_dtype=jnp.bfloat16)

    def dots(text):
        return [ln.split(": (")[1].split(") -> ")[0] for ln in text.splitlines()
                if "stablehlo.dot_general" in ln]

    cuda = jax.export.export(jax.jit(f), platforms=["cuda"])(a, b).mlir_module()
    assert dots(cuda) == ["tensor<8x16xbf16>, tensor<16x4xbf16>"]
    cpu = jax.export.export(jax.jit(f), platforms=["cpu"])(a, b).mlir_module()
    assert dots(cpu) == ["tensor<8x16xf32>, tensor<16x4xf32>"]
    assert re.search(r"stablehlo.convert .*tensor<8x16xbf16>\) -> tensor<8x16xf32>", cpu)
    if jax.default_backend() == "cpu":
        out = jax.jit(f)(a, b)
        assert out.dtype == BF16
        ref = np.asarray(a.astype(jnp.bfloat16), np.float32) @ np.asarray(
            b.astype(jnp.bfloat16), np.float32)
        np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=1e-2)
