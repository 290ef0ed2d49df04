"""Tests for mpfunc_torch._src.fp8.matmul / fp8_convert: Fp8Linear, _scaled_mm, convert_to_fp8."""

import io

import numpy as np
import pytest
import torch

pytest.importorskip("ml_dtypes", reason="the fp8 NumPy reference needs ml_dtypes (the "
                    "`jax` extra installs it)")
from fp8_reference import ref_cast, ref_dequantize, ref_quantize  # noqa: E402

import mpfunc_torch  # noqa: E402
from _mpfunc_common.fp8 import resolve_recipe  # noqa: E402
from mpfunc_torch._src.fused import cpu_scaled_mm_rowwise, scaled_mm_available  # noqa: E402

try:  # the JAX side, for the cross-checks only: a torch-only install skips those
    import jax
    import jax.numpy as jnp

    import mpfunc
except ModuleNotFoundError:
    jax = jnp = mpfunc = None
needs_jax = pytest.mark.skipif(mpfunc is None, reason="a cross-check with mpfunc (JAX), "
                               "which is not installed (the `jax` extra)")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The suite runs one pytest worker per core: more torch threads only oversubscribe
    # (13x slower measured on a busy 2-core machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise"]
HAS_FP8_GPU = torch.cuda.is_available() and scaled_mm_available(torch.device("cuda"))


def qdq(a, role, recipe, scale=None):
    r = resolve_recipe(recipe)
    a = np.asarray(a, np.float32)
    if scale is not None:
        return ref_dequantize(ref_cast(a * np.float32(scale), r.dtype(role)),
                              np.float32(scale))
    q, s = ref_quantize(a, r.dtype(role), r.block(role), r.margin, r.power_of_2_scales)
    return ref_dequantize(q, s, r.block(role))


def data(m=48, k=256, n=160, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)  # torch layout (N, K)
    b = rng.standard_normal(n).astype(np.float32)
    r = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
    return x, w, b, r


def run_layer(recipe, x, w, b, r, gemm="emulate"):
    layer = mpfunc_torch.Fp8Linear(w.shape[1], w.shape[0], recipe=recipe, gemm=gemm)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
        layer.bias.copy_(torch.from_numpy(b))
    xt = torch.from_numpy(x).requires_grad_()
    y = layer(xt)
    (y * torch.from_numpy(r)).sum().backward()
    return layer, y.detach(), xt.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_linear_matches_the_reference(recipe):
    x, w, b, r = data()
    _, y, gx, gw, gb = run_layer(recipe, x, w, b, r)
    np.testing.assert_allclose(y, qdq(x, "input", recipe) @ qdq(w, "weight", recipe).T + b,
                               rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(gx, qdq(r, "grad_output", recipe) @ qdq(w.T, "weight", recipe).T,
                               rtol=2e-5, atol=1e-8)
    np.testing.assert_allclose(gw, qdq(r.T, "grad_output", recipe) @ qdq(x.T, "input", recipe).T,
                               rtol=2e-5, atol=1e-8)
    np.testing.assert_allclose(gb, r.sum(0), rtol=1e-5, atol=1e-7)  # the bias: unquantised


@needs_jax
@pytest.mark.parametrize("recipe", RECIPES)
def test_torch_linear_and_jax_dot_agree(recipe):
    # The same quantised operands on both sides; only float32 GEMM order differs.
    x, w, b, r = data(32, 128, 64)
    layer, y, gx, gw, _ = run_layer(recipe, x, w, np.zeros_like(b), r)
    state = mpfunc.fp8_dot_state(recipe) if recipe == "delayed" else None

    def loss(x, w, s):
        return jnp.sum(mpfunc.fp8_dot(x, w, recipe, s) * r)

    yj = jax.jit(lambda x, w, s: mpfunc.fp8_dot(x, w, recipe, s))(x, w.T, state)
    gxj, gwj, sj = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w.T, state)
    # The GEMMs agree to float32 accumulation: |difference| <= 1e-6 * max|output|.
    for a, b in ((y, yj), (gx, gxj), (gw, np.asarray(gwj).T)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()
    if recipe == "delayed":  # the states are bit-identical
        for role in ("input", "weight", "grad_output"):
            meta = getattr(sj, role)
            np.testing.assert_array_equal(getattr(layer, f"fp8_amax_history_{role}").numpy(),
                                          np.asarray(meta.amax_history))
            np.testing.assert_array_equal(getattr(layer, f"fp8_scale_{role}").numpy(),
                                          np.asarray(meta.scale))


@needs_jax
def test_delayed_layers_match_jax_over_steps_with_a_non_finite_one():
    recipe = mpfunc_torch.Fp8Recipe("delayed", amax_history_len=3)
    x0, w, _, r = data(16, 32, 16)
    layer = mpfunc_torch.Fp8Linear(32, 16, bias=False, recipe=recipe, gemm="emulate")
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
    state = mpfunc.fp8_dot_state(recipe)
    step = jax.jit(jax.grad(lambda x, s: jnp.sum(mpfunc.fp8_dot(x, w.T, recipe, s) * r),
                            argnums=1))
    for f in [2.0, 0.0, 8.0, np.inf, 3.0, 0.5, 0.25]:
        x = x0 * np.float32(f) if np.isfinite(f) else np.where(x0 == x0.max(), np.inf, x0)
        layer.weight.grad = None
        (layer(torch.from_numpy(x)) * torch.from_numpy(r)).sum().backward()
        state = step(x, state)
        for role in ("input", "weight", "grad_output"):
            meta = getattr(state, role)
            np.testing.assert_array_equal(getattr(layer, f"fp8_amax_history_{role}").numpy(),
                                          np.asarray(meta.amax_history), err_msg=f"{f} {role}")
            np.testing.assert_array_equal(getattr(layer, f"fp8_scale_{role}").numpy(),
                                          np.asarray(meta.scale))
        if not np.isfinite(f):
            assert not torch.isfinite(layer.weight.grad).all()  # the inf is not hidden


def checked_scaled_mm(calls):
    """torch._scaled_mm with CUDA's layout contract asserted (CPU does not check it)."""
    real = torch._scaled_mm

    def fake(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False, **kw):
        m, k = a.shape
        n = b.shape[1]
        assert bias is None or bias.dtype in (torch.bfloat16, torch.float16)
        assert a.stride() == (k, 1), "a must be row-major"
        assert b.stride() == (1, k), "b must be column-major"
        assert k % 16 == 0 and n % 16 == 0
        if scale_a.numel() > 1:
            assert scale_a.shape == (m, 1) and scale_b.shape == (1, n)
            assert scale_a.is_contiguous() and scale_b.is_contiguous()
            assert out_dtype == torch.bfloat16
        else:
            assert scale_a.dtype == scale_b.dtype == torch.float32
        calls.append((a.dtype, b.dtype, use_fast_accum))
        return real(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                    use_fast_accum=use_fast_accum, **kw)

    return fake


@pytest.fixture
def operands_written_in_layout(monkeypatch):
    """Fails if `scaled_mm` gets an operand it has to copy: the quantiser writes each fp8
    operand (and the transposed copies the backward needs) row-major already."""
    from mpfunc_torch._src.fp8 import matmul as fp8_mod

    real = fp8_mod.scaled_mm

    def spy(a, a_scale, b, b_scale, *args, **kw):
        assert a.is_contiguous() and b.is_contiguous(), (a.stride(), b.stride())
        return real(a, a_scale, b, b_scale, *args, **kw)

    monkeypatch.setattr(fp8_mod, "scaled_mm", spy)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_scaled_mm_path_equals_the_emulation(recipe, monkeypatch, operands_written_in_layout):
    # The GPU code path, run on torch's CPU reference kernel, with the CUDA layout
    # contract asserted: the same numbers as the emulation (rowwise: up to the
    # bfloat16 output the rowwise kernel produces). Fast accumulation in the forward
    # GEMM only (as torchao).
    if recipe == "rowwise" and not cpu_scaled_mm_rowwise():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales "
                    "only (rowwise is emulated there)")
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", checked_scaled_mm(calls))
    x, w, b, r = data(32, 128, 64)
    _, y, gx, gw, gb = run_layer(recipe, x, w, b, r, gemm="scaled_mm")
    _, y0, gx0, gw0, gb0 = run_layer(recipe, x, w, b, r, gemm="emulate")
    assert len(calls) == 3  # forward, input gradient, weight gradient
    assert calls[0] == (torch.float8_e4m3fn, torch.float8_e4m3fn, True)
    assert calls[1] == (torch.float8_e5m2, torch.float8_e4m3fn, False)   # dx = g @ w
    assert calls[2] == (torch.float8_e5m2, torch.float8_e4m3fn, False)   # dw = g.T @ x
    # rowwise: output and bias in bfloat16 (bias ~1: atol of its bfloat16 rounding).
    tol = dict(rtol=1e-5, atol=1e-6) if recipe != "rowwise" else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(y, y0, **tol)
    np.testing.assert_allclose(gx, gx0, **tol)
    np.testing.assert_allclose(gw, gw0, **(tol if recipe != "rowwise" else dict(rtol=2e-2, atol=1e-5)))
    np.testing.assert_array_equal(gb, gb0)


def test_blockwise_and_odd_shapes_fall_back_to_the_emulation(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: pytest.fail("not emulated"))
    x, w, b, r = data(8, 40, 24)            # K=40, N=24: not multiples of 16
    run_layer("tensorwise", x, w, b, r, gemm="scaled_mm")
    x, w, b, r = data(8, 128, 32)
    run_layer("blockwise", x, w, b, r, gemm="scaled_mm")
    run_layer(mpfunc_torch.Fp8Recipe(format="e5m2"), x, w, b, r, gemm="scaled_mm")


def test_rowwise_scaled_mm_only_on_hopper_and_newer(monkeypatch):
    # cuBLAS's rowwise fp8 GEMM is Hopper's (sm90+): on Ada (sm89) rowwise is emulated,
    # tensorwise is not; torch's CPU reference kernel takes both from torch 2.13 on
    # (tests; 2.11's takes per-tensor scales only).
    from types import SimpleNamespace

    from mpfunc_torch._src import fused

    def operand(dev):
        return SimpleNamespace(device=torch.device(dev), dtype=torch.float8_e4m3fn,
                               shape=(32, 64))

    for cc, rowwise in (((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(fused, "_capability", lambda device, cc=cc: cc)
        a = operand("cuda")
        assert fused.scaled_mm_fits(a, a, (1, None), torch.bfloat16) is rowwise
        assert fused.scaled_mm_fits(a, a, None, torch.bfloat16)
    cpu = operand("cpu")
    assert fused.scaled_mm_fits(cpu, cpu, (1, None), torch.bfloat16) is \
        fused.cpu_scaled_mm_rowwise()
    assert fused.scaled_mm_fits(cpu, cpu, None, torch.bfloat16)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_backward_keeps_fp8_copies_not_the_input(recipe, monkeypatch):
    # Per-tensor recipes save the transposed fp8 copies the backward GEMMs read (written
    # by the forward's cast, in _scaled_mm's layout), not x and w; rowwise and blockwise
    # re-quantise along other dims, so they keep x and w.
    saved = []
    layer = mpfunc_torch.Fp8Linear(64, 32, bias=False, recipe=recipe, gemm="emulate")
    x = torch.randn(48, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    y.sum().backward()
    fp8 = [(t.dtype, tuple(t.shape), t.is_contiguous()) for t in saved if t.element_size() == 1]
    if recipe in ("tensorwise", "delayed"):
        assert fp8 == [(torch.float8_e4m3fn, (64, 48), True), (torch.float8_e4m3fn, (64, 32), True)]
        assert not any(t is x or t is layer.weight for t in saved)
    else:
        assert fp8 == [] and any(t is x for t in saved)
    from mpfunc_torch._src.fp8 import matmul as fp8_mod

    real, asked = fp8_mod._quantize_pair, []
    monkeypatch.setattr(fp8_mod, "_quantize_pair", lambda *a: asked.append(a[-1]) or real(*a))
    layer(x).sum().backward()
    with torch.no_grad():  # inference writes no transposed copies
        layer(x)
    per_tensor = recipe in ("tensorwise", "delayed")
    assert asked == ([True, True, True, False, False] if per_tensor else [])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs CUDA with compute capability >= 8.9")
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # dynamo
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method. is deprecated:DeprecationWarning")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_cuda_scaled_mm_matches_the_emulation(recipe):  # pragma: no cover - GPU only
    # _scaled_mm (eager, and under torch.compile with inductor's fused casts) against the
    # float32 emulation, forward and both gradients. Rowwise needs sm90 (else emulated).
    x, w, b, r = data(64, 256, 128)
    dev = torch.device("cuda")
    outs = {}
    for variant in ("auto", "compiled", "emulate"):
        layer = mpfunc_torch.Fp8Linear(256, 128, recipe=recipe, device=dev,
                                       gemm="emulate" if variant == "emulate" else "auto")
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(w))
            layer.bias.copy_(torch.from_numpy(b))
        run = torch.compile(layer, fullgraph=True) if variant == "compiled" else layer
        xt = torch.from_numpy(x).to(dev).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = run(xt)
        (y.float() * torch.from_numpy(r).to(dev)).sum().backward()
        outs[variant] = [t.float().cpu() for t in (y, xt.grad, layer.weight.grad)]
    for variant in ("auto", "compiled"):
        for a, b_ in zip(outs[variant], outs["emulate"]):
            torch.testing.assert_close(a, b_, rtol=2e-2, atol=2e-2 * float(b_.abs().max()))


def test_autocast_output_dtype_and_gradient_dtypes():
    layer = mpfunc_torch.Fp8Linear(32, 16)
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert layer(x.detach()).dtype == torch.float32


def test_delayed_buffers_round_trip_through_state_dict():
    layer = mpfunc_torch.Fp8Linear(16, 8, recipe=mpfunc_torch.Fp8Recipe("delayed", amax_history_len=4))
    for _ in range(3):
        layer(torch.randn(5, 16)).sum().backward()
    sd = layer.state_dict()
    assert sd["fp8_amax_history_grad_output"].shape == (4,)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh = mpfunc_torch.Fp8Linear(16, 8, recipe=mpfunc_torch.Fp8Recipe("delayed", amax_history_len=4))
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    for k, v in sd.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert not torch.equal(fresh.fp8_amax_history_input, torch.zeros(4))


def test_convert_to_fp8_swaps_linears_and_keeps_the_parameters():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                              torch.nn.Sequential(torch.nn.Linear(16, 4)),
                              torch.nn.MultiheadAttention(4, 1))
    params = list(net.parameters())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mpfunc_torch.convert_to_fp8(net, "rowwise",
                                module_filter_fn=lambda m, fqn: not fqn.startswith("4."))
    assert type(net[0]) is mpfunc_torch.Fp8Linear and type(net[3][0]) is mpfunc_torch.Fp8Linear
    assert type(net[1]) is torch.nn.LayerNorm
    assert not isinstance(net[4].out_proj, mpfunc_torch.Fp8Linear)  # filtered out
    assert list(net.parameters()) == params  # the same Parameter objects, in order
    w0 = net[0].weight.detach().clone()
    net[:4](torch.randn(3, 8)).sum().backward()
    opt.step()
    assert not torch.equal(net[0].weight, w0)
    assert mpfunc_torch.convert_to_fp8(net) is net  # idempotent: Fp8Linear stays
    assert type(mpfunc_torch.convert_to_fp8(torch.nn.Linear(4, 4))) is mpfunc_torch.Fp8Linear
    assert "scaling=rowwise" in repr(net[0])


def test_convert_to_fp8_keeps_the_layers_hooks_and_identity():
    # A user's (or HuggingFace's) hooks on a Linear keep running after the conversion.
    class Sub(torch.nn.Linear):  # a subclass is replaced, and takes its hooks along
        pass

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), Sub(8, 4)).eval()
    first, seen = net[0], []
    for m in net:
        m.register_forward_hook(lambda mod, a, out: seen.append((type(mod).__name__, out.dtype)))
    net[1].register_forward_pre_hook(lambda mod, a: seen.append("pre"))
    mpfunc_torch.convert_to_fp8(net)
    assert net[0] is first and type(first) is mpfunc_torch.Fp8Linear
    assert type(net[1]) is mpfunc_torch.Fp8Linear and not net[1].training
    net(torch.randn(2, 8))
    assert seen == [("Fp8Linear", torch.float32), "pre", ("Fp8Linear", torch.float32)]
    # A conversion that fails leaves the layer a plain, working nn.Linear.
    layer = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="`gemm` must be"):
        mpfunc_torch.convert_to_fp8(layer, gemm="cublas")
    assert type(layer) is torch.nn.Linear and layer(torch.ones(1, 4)).shape == (1, 4)


def test_a_zero_previous_scale_falls_back_to_one():
    # The rule shared with JAX, where a state whose matmul missed the loss comes back
    # zeroed: an all-zero input then fell back to scale 0, and 0 * (1 / 0) was NaN.
    layer = mpfunc_torch.Fp8Linear(8, 4, recipe="delayed", gemm="emulate")
    with torch.no_grad():
        layer.fp8_scale_input.zero_()
    out = layer(torch.zeros(2, 8))
    assert torch.isfinite(out).all() and float(layer.fp8_scale_input) == 1.0


def test_bad_arguments():
    with pytest.raises(TypeError, match="`model` must be a torch.nn.Module"):
        mpfunc_torch.convert_to_fp8(3)
    with pytest.raises(TypeError, match="`module_filter_fn` must be callable"):
        mpfunc_torch.convert_to_fp8(torch.nn.Linear(2, 2), module_filter_fn=1)
    with pytest.raises(ValueError, match="`gemm` must be"):
        mpfunc_torch.Fp8Linear(2, 2, gemm="cublas")
    with pytest.raises(ValueError, match="`recipe` must be one of"):
        mpfunc_torch.Fp8Linear(2, 2, recipe="mx")
    with pytest.raises(TypeError, match="`linear` must be an nn.Linear"):
        mpfunc_torch.Fp8Linear.from_linear(torch.nn.Conv1d(1, 1, 1))
