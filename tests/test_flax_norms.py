"""flax's own norm layers under the half-model modes (naive, apex O2) of
`mpfunc.convert_to_amp`: their statistics run in float32 whatever dtype the layer
declares, and their error stays within 2x the torch (autocast) mode's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxpr_walk import all_eqns

import mpfunc

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

F32 = jnp.float32
NORMS = ("BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm")
# The accumulating reductions: sums (means, variances, norms, softmax denominators).
SUMS = {"reduce_sum", "cumsum", "reduce_window_sum"}
HALF_MODES = [("naive", {}), ("apex", {"opt_level": "O2", "verbosity": 0})]


def reduce_dtypes(fn, *args):
    """The operand dtypes of every accumulating reduction in ``fn``'s jaxpr, sub-programs
    included."""
    return [(e.primitive.name, str(e.invars[0].aval.dtype)) for e in all_eqns(fn, *args)
            if e.primitive.name in SUMS]


def rel_err(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def inputs():
    # An offset mean makes E[x^2] - E[x]^2 cancel: float16 sums lose the variance.
    return jax.random.normal(jax.random.key(1), (4, 8, 8, 3)) * 3 + 1


class LinenNet(nn.Module):
    """A ResNet-style pair, as flax's examples write it: Conv (no bias) -> norm."""

    norm: str
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(16, (3, 3), use_bias=False, dtype=self.dtype)(x)
        if self.norm == "BatchNorm":
            return nn.BatchNorm(use_running_average=False, dtype=self.dtype)(x)
        if self.norm == "GroupNorm":
            return nn.GroupNorm(num_groups=4, dtype=self.dtype)(x)
        return getattr(nn, self.norm)(dtype=self.dtype)(x)


class NnxNet(nnx.Module):
    def __init__(self, norm, dtype, rngs):
        self.conv = nnx.Conv(3, 16, (3, 3), use_bias=False, dtype=dtype, rngs=rngs)
        kw = {"GroupNorm": {"num_groups": 4}, "BatchNorm": {"use_running_average": False}}
        self.norm = getattr(nnx, norm)(16, dtype=dtype, rngs=rngs, **kw.get(norm, {}))

    def __call__(self, x):
        return self.norm(self.conv(x))


def linen_case(norm, dtype):
    """(apply_fn(variables, x) -> y, float32 variables, float32 reference output)."""
    net = LinenNet(norm, dtype)
    x = inputs()
    variables = net.init(jax.random.key(0), x)

    def apply_fn(v, x):
        if norm == "BatchNorm":  # training mode: batch statistics, updated running ones
            return net.apply(v, x, mutable=["batch_stats"])[0]
        return net.apply(v, x)

    return apply_fn, variables, apply_fn(variables, x)


def nnx_case(norm, dtype):
    graph, params, rest = nnx.split(NnxNet(norm, dtype, nnx.Rngs(0)), nnx.Param, ...)

    def apply_fn(p, x):
        return nnx.merge(graph, p, rest, copy=True)(x)

    return apply_fn, params, apply_fn(params, inputs())


def amp_output(apply_fn, params, mode, cfg, x):
    amp = mpfunc.convert_to_amp(apply_fn, optax.sgd(0.1), mode=mode, **cfg)
    params = amp.cast_params(params)
    return amp, params, amp.apply_fn(params, x)


CASES = [(fw, norm, dtype) for fw in ("linen", "nnx") for norm in NORMS
         for dtype in (F32, None)]


@pytest.mark.parametrize("mode, cfg", HALF_MODES)
@pytest.mark.parametrize("framework, norm, dtype", CASES,
                         ids=[f"{f}-{n}-{'f32' if d else 'None'}" for f, n, d in CASES])
def test_norm_statistics_run_in_float32(framework, norm, dtype, mode, cfg):
    # flax's examples declare dtype=float32 on every Conv and norm: the Conv traced
    # float32 ran in float16 under the half-model rules, and its output reached the
    # norm's square / reduce_sum in float16 (1.9% off float32 for Conv+BatchNorm, 0.04%
    # in torch mode).
    apply_fn, params, ref = (linen_case if framework == "linen" else nnx_case)(norm, dtype)
    x = inputs()
    with jax.numpy_dtype_promotion("standard"):
        amp, half_params, y = amp_output(apply_fn, params, mode, cfg, x)
        sums = reduce_dtypes(amp.apply_fn, half_params, x)
        _, _, y_torch = amp_output(apply_fn, params, "torch", {}, x)
    assert sums and all(d == "float32" for _, d in sums), sums
    assert y.dtype == F32
    half, torch = rel_err(y, ref), rel_err(y_torch, ref)
    assert half <= 2 * torch, (half, torch)


STATE_MODES = [("naive", {}), ("apex", {"opt_level": "O2", "verbosity": 0}),
               ("apex", {"opt_level": "O3", "verbosity": 0}), ("torch", {}), ("bf16", {})]


class LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(4, dtype=F32)(x)
        return nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=F32)(x)


@pytest.mark.parametrize("mode, cfg", STATE_MODES)
def test_linen_batch_stats_stay_float32_and_update_at_float32(mode, cfg):
    # A running mean of 1.0001 is 1.0 in float16; one momentum-0.9 update with a zero
    # batch gave 0.8999 (float16) where float32 gives 0.90009.
    net = LinenBN()
    x = jnp.zeros((8, 3))
    variables = net.init(jax.random.key(0), x)
    variables = {"params": variables["params"],
                 "batch_stats": {"BatchNorm_0": {"mean": jnp.full(4, 1.0001, F32),
                                                 "var": jnp.ones(4, F32)}}}
    amp = mpfunc.convert_to_amp(net.apply, optax.sgd(0.1), mode=mode, **cfg)
    cast = amp.cast_params(variables)
    assert cast["batch_stats"]["BatchNorm_0"]["mean"].dtype == F32
    assert cast["params"]["Dense_0"]["kernel"].dtype == amp.policy.param_dtype
    with jax.numpy_dtype_promotion("standard"):
        y, new = amp.apply_fn(cast, x, mutable=["batch_stats"])
        y_eval = amp.apply_fn(cast, x, train=False)
    mean = new["batch_stats"]["BatchNorm_0"]["mean"]
    assert mean.dtype == F32 and y.dtype == y_eval.dtype == F32
    np.testing.assert_allclose(mean, np.float32(0.9) * np.float32(1.0001), rtol=1e-6)
    # f16 state passed in (an older cast of the whole variables dict) is read as float32
    f16_stats = jax.tree.map(lambda a: a.astype(jnp.float16), cast["batch_stats"])
    with jax.numpy_dtype_promotion("standard"):
        _, new = amp.apply_fn({"params": cast["params"], "batch_stats": f16_stats}, x,
                              mutable=["batch_stats"])
    assert new["batch_stats"]["BatchNorm_0"]["mean"].dtype == F32


class NnxBN(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(3, 4, dtype=F32, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.9, dtype=F32, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.fc(x))


@pytest.mark.parametrize("mode, cfg", STATE_MODES)
def test_nnx_batch_stats_stay_float32_and_update_at_float32(mode, cfg):
    graph, params, stats = nnx.split(NnxBN(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
    stats["bn"]["mean"].set_value(jnp.full(4, 1.0001, F32))

    def apply_fn(params, stats, x):
        model = nnx.merge(graph, params, stats, copy=True)
        return model(x), nnx.state(model, nnx.BatchStat)

    amp = mpfunc.convert_to_amp(apply_fn, optax.sgd(0.1), mode=mode, **cfg)
    params = amp.cast_params(params)
    assert params["fc"]["kernel"][...].dtype == amp.policy.param_dtype
    with jax.numpy_dtype_promotion("standard"):
        y, new = amp.apply_fn(params, stats, jnp.zeros((8, 3)))
    assert y.dtype == F32 and new["bn"]["mean"][...].dtype == F32
    np.testing.assert_allclose(new["bn"]["mean"][...], np.float32(0.9) * np.float32(1.0001),
                               rtol=1e-6)


def softmax_and_mean(p, x):
    # flax's Dense declares float32: traced float32, it runs float16 in the half modes
    h = nn.Dense(16, use_bias=False, dtype=F32).apply({"params": p}, x)
    return jax.nn.softmax(h), jnp.mean(h, axis=-1)


@pytest.mark.parametrize("mode, cfg", HALF_MODES)
def test_softmax_and_means_run_in_float32(mode, cfg):
    x = jax.random.normal(jax.random.key(1), (8, 12)) + 2
    params = nn.Dense(16, use_bias=False).init(jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda a: a * 4, params)  # logits spread over several units
    ref = softmax_and_mean(params, x)
    with jax.numpy_dtype_promotion("standard"):
        amp, half_params, out = amp_output(softmax_and_mean, params, mode, cfg, x)
        jaxpr = jax.make_jaxpr(amp.apply_fn)(half_params, x)
        _, _, out_torch = amp_output(softmax_and_mean, params, "torch", {}, x)
        sums = reduce_dtypes(amp.apply_fn, half_params, x)
    exps = [str(e.invars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "exp"]
    assert len(sums) == 2 and {d for _, d in sums} == {"float32"}, sums
    assert exps == ["float32"]
    for got, want, torch in zip(out, ref, out_torch):
        assert rel_err(got, want) <= 2 * rel_err(torch, want), (rel_err(got, want),
                                                                rel_err(torch, want))


class ResNetBlock(nn.Module):
    """flax's imagenet ResNet in miniature: every layer declares float32."""

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Conv(8, (3, 3), use_bias=False, dtype=F32)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=F32)(x)
        x = nn.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(10, dtype=F32)(x)


def naive_resnet_block():
    """``(net, x, variables, amp, cast)``: the block, its input and variables, the naive
    setup and the variables it cast."""
    net = ResNetBlock()
    x = inputs()
    variables = net.init(jax.random.key(0), x)
    amp = mpfunc.convert_to_amp(net.apply, optax.sgd(0.1), mode="naive")
    return net, x, variables, amp, amp.cast_params(variables)


def test_naive_resnet_block_runs_no_sum_in_float16():
    net, x, variables, amp, cast = naive_resnet_block()

    def fwd(v, x):
        return amp.apply_fn(v, x, mutable=["batch_stats"])

    with jax.numpy_dtype_promotion("standard"):
        jaxpr = jax.make_jaxpr(fwd)(cast, x)
        ref, _ = net.apply(variables, x, mutable=["batch_stats"])
        y, _ = fwd(cast, x)
        sums = reduce_dtypes(fwd, cast, x)
    # BatchNorm's two means and the spatial mean, all float32
    assert len(sums) == 3 and {d for _, d in sums} == {"float32"}, sums
    # ... while the conv and the dense still run float16 x float16
    mm = [tuple(str(v.aval.dtype) for v in e.invars) for e in jaxpr.eqns
          if e.primitive.name == "custom_vjp_call"
          and {q.primitive.name for q in e.params["call_jaxpr"].jaxpr.eqns}
          & {"dot_general", "conv_general_dilated"}]
    assert mm == [("float16", "float16")] * 2, mm
    assert rel_err(y, ref) < 2e-3


def test_naive_backward_sums_run_in_float32():
    # The gradients of what the forward broadcasts (BatchNorm's scale and bias, the
    # Dense bias) are sums over the batch and the image: float32, as torch's half
    # kernels accumulate them. (Plain JAX differentiates a float16 broadcast into a
    # float16 sum; this one did, for BatchNorm's scale.)
    net, x, variables, amp, cast = naive_resnet_block()

    def loss(params):
        y, _ = amp.apply_fn({**cast, "params": params}, x, mutable=["batch_stats"])
        return y.astype(jnp.float32).sum()

    with jax.numpy_dtype_promotion("standard"):
        sums = reduce_dtypes(jax.grad(loss), cast["params"])
        grads = jax.jit(jax.grad(loss))(cast["params"])
    ref = jax.grad(lambda p: net.apply({**variables, "params": p}, x,
                                       mutable=["batch_stats"])[0].sum())(variables["params"])
    assert len(sums) >= 8 and {d for _, d in sums} == {"float32"}, sums
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert g.dtype == jnp.float16, path  # the params' dtype, rounded once
    for name in ("BatchNorm_0", "Dense_0"):
        for leaf in ("scale", "bias"):
            if leaf in ref[name]:
                assert rel_err(grads[name][leaf], ref[name][leaf]) < 2e-3, (name, leaf)
