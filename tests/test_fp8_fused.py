"""Tests for mpfunc_torch._src.fp8.fused / fp8_triton: the fused eager quantisation.

Each operand of an eager `Fp8Linear` is quantised by at most three dispatched kernels
(custom ops ``torch.ops.mpfunc.*`` plus torch's amax reduction), counted with a
``TorchDispatchMode``. The ops run the rule with torch ops on CPU and as Triton kernels
on CUDA; here the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
in a subprocess that re-runs the bit-for-bit suites), are compiled for sm_90 without a
GPU, and are checked on CUDA by the gpu-marked tests.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fp8_reference import ref_quantize
from torch.utils._python_dispatch import TorchDispatchMode

import mpfunc_torch
from _mpfunc_common.fp8 import resolve_recipe
from mpfunc_torch._src.fp8 import fused as fp8_fused
from mpfunc_torch._src.fp8 import matmul as fp8_mod

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise"]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
# What each operand's quantisation dispatches on the fused path (per role).
FUSED_OPS = {
    "tensorwise": ["aten.linalg_vector_norm.default", "mpfunc.fp8_cast.default"],
    "delayed": ["aten.max.default", "mpfunc.fp8_cast.default", "mpfunc.fp8_record_amax.default"],
    "rowwise": ["mpfunc.fp8_quantize_blocks.default"],
    "blockwise": ["mpfunc.fp8_quantize_blocks.default"],
}


class KernelLog(TorchDispatchMode):
    """The ops that launch work: views and allocations of uninitialised memory are not
    kernels."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.name().startswith(("aten::empty", "aten::_unsafe_view"))):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def quantize_operand(x2d, layer, role, transposed=True):
    """What `Fp8Linear` does for one operand (its forward for input/weight, its backward
    for the output gradient)."""
    recipe = layer.recipe
    if recipe.block(role) is None:
        return fp8_mod._quantize_pair(x2d, layer, role, recipe, layer._groups, transposed)
    return (fp8_mod._quantize(x2d, role, recipe),)


@pytest.fixture
def reference_path(monkeypatch):
    """The rule as plain torch ops (the path under torch.compile), in eager mode."""
    monkeypatch.setattr(fp8_fused, "fusable", lambda *t: False)


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_eager_cast_is_at_most_three_kernels_per_operand(recipe, monkeypatch):
    layer = mpfunc_torch.Fp8Linear(96, 64, recipe=recipe, device="cpu")
    x = torch.randn(40, 96, dtype=torch.bfloat16)
    for role, t in (("input", x), ("weight", layer.weight), ("grad_output", x)):
        with KernelLog() as log:
            quantize_operand(t, layer, role)
        assert log.ops == FUSED_OPS[recipe], (role, log.ops)
    # The same quantisation as torch ops (before the custom ops): 6 to 18 kernels each.
    monkeypatch.setattr(fp8_fused, "fusable", lambda *t: False)
    with KernelLog() as log:
        quantize_operand(x, layer, "input")
    assert len(log.ops) > 5, log.ops


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_linear_forward_and_backward_dispatches_few_ops(recipe, monkeypatch):
    # The whole Fp8Linear (GEMMs emulated on CPU: each is an upcast, a matmul and the
    # output scaling), fused against the plain torch ops of the compiled path.
    def count():
        layer = mpfunc_torch.Fp8Linear(64, 32, recipe=recipe, gemm="emulate")
        x = torch.randn(48, 64, requires_grad=True)
        with KernelLog() as log:
            layer(x).sum().backward()
        return len(log.ops)

    fused = count()
    monkeypatch.setattr(fp8_fused, "fusable", lambda *t: False)
    assert fused < count() - 10


def _run_linear(recipe, steps, dtype=torch.float32):
    torch.manual_seed(0)
    layer = mpfunc_torch.Fp8Linear(96, 40, recipe=resolve_recipe(recipe, amax_history_len=4)
                                   if recipe == "delayed" else recipe, gemm="emulate")
    outs = []
    for i, f in enumerate(steps):
        x = torch.randn(72, 96, generator=torch.Generator().manual_seed(i)) * f
        if not np.isfinite(f):
            x = torch.where(x == x.max(), torch.inf, torch.randn(72, 96))
        x = x.to(dtype).requires_grad_()
        y = layer(x)
        (y.float() * torch.linspace(-1, 1, 40)).sum().backward()
        outs += [y.detach(), x.grad]
    return outs + [p.grad for p in layer.parameters()] + list(layer.buffers())


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_fused_path_gives_the_reference_paths_bits(recipe, monkeypatch):
    # Outputs, gradients and delayed scaling's histories and scales, over steps with
    # a zero input and an inf in it. On CPU the ops run torch ops (the plumbing is
    # what is checked); under TRITON_INTERPRET=1 (the subprocess test below) and on
    # CUDA (test_cuda_triton_bits_match_the_reference), the Triton kernels.
    steps = [1.0, 0.0, 30.0, np.inf, 1e-3]
    fused = _run_linear(recipe, steps, torch.bfloat16)
    monkeypatch.setattr(fp8_fused, "fusable", lambda *t: False)
    ref = _run_linear(recipe, steps, torch.bfloat16)
    assert len(fused) == len(ref)
    for a, b in zip(fused, ref, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num())
        assert torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(8, 1), (1, 8), (1, 1)])
def test_a_single_row_or_column_operand_gives_the_reference_bits(recipe, shape, monkeypatch):
    # Linear(32, 1), or a batch of one: an operand of shape (m, 1) or (1, n), whose
    # transposed copy has the same memory layout as the operand itself. A custom op's
    # outputs may not alias each other, so that copy must be a tensor of its own.
    def run():
        torch.manual_seed(0)
        m, n = shape
        layer = mpfunc_torch.Fp8Linear(n, m, recipe=resolve_recipe(
            recipe, amax_history_len=4) if recipe == "delayed" else recipe, gemm="emulate")
        x = torch.randn(m, n, requires_grad=True)
        y = layer(x)
        y.float().sum().backward()
        return [y.detach(), x.grad, *(p.grad for p in layer.parameters())]

    fused = run()
    monkeypatch.setattr(fp8_fused, "fusable", lambda *t: False)
    for a, b in zip(fused, run(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_ops_pass_torchs_custom_op_checks():
    # Schema, fake (meta) implementations, and tracing under torch.compile / AOT
    # autograd: torch.library.opcheck's own checks.
    x = torch.randn(70, 130)
    hist, prev = torch.tensor([3.0, 0.0, 5.0]), torch.tensor(2.0)
    amax = torch.linalg.vector_norm(x, float("inf"))
    torch.library.opcheck(torch.ops.mpfunc.fp8_cast.default,
                          (x, amax, None, "float8_e4m3fn", 0, False, 1, True, False))
    torch.library.opcheck(torch.ops.mpfunc.fp8_cast.default,
                          (x.t(), hist.max(), prev, "float8_e5m2", 2, True, 2, False, True))
    torch.library.opcheck(torch.ops.mpfunc.fp8_quantize_blocks.default,
                          (x.t(), "float8_e4m3fn", 128, 128, 0, False))
    parts = torch.tensor([1.0, 7.0])
    torch.library.opcheck(torch.ops.mpfunc.fp8_record_amax.default,
                          (hist, prev, parts, torch.tensor(4.0)))


def test_the_ops_compile_in_one_graph():
    # A user calling the ops under torch.compile gets them in the graph, no break.
    from torch._dynamo.testing import CompileCounterWithBackend

    def f(x, hist, prev):
        q, q_t, scale, parts = torch.ops.mpfunc.fp8_cast(x, hist.max(), prev, "float8_e4m3fn",
                                                         0, False, 2, True, True)
        torch.ops.mpfunc.fp8_record_amax(hist, prev, parts, scale)
        return q.float() + q_t.float().t()

    x = torch.randn(70, 130)
    h1, p1, h2, p2 = torch.tensor([3.0, 0.0]), torch.tensor(2.0), torch.tensor([3.0, 0.0]), \
        torch.tensor(2.0)
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(f, backend=counter, fullgraph=True)(x, h1, p1)
    assert counter.frame_count == 1
    assert torch.equal(out, f(x, h2, p2)) and torch.equal(h1, h2) and torch.equal(p1, p2)
    assert float(h1[0]) == float(x.abs().max())


@pytest.mark.filterwarnings(  # dynamo instantiates the autograd.Function (test_torch_compile)
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning")
def test_compiled_models_trace_the_rule_as_torch_ops():
    # Under torch.compile the layer emits the rule as torch ops, which inductor fuses
    # with its neighbours; the custom ops are for eager mode.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layer = mpfunc_torch.Fp8Linear(64, 32, recipe="delayed", gemm="emulate")
    torch.compile(layer, backend=backend, fullgraph=True)(torch.randn(8, 64))
    targets = {str(n.target) for g in graphs for n in g.graph.nodes}
    assert not any("mpfunc" in t for t in targets), targets
    assert any("vector_norm" in t or "max" in t for t in targets)


def test_quantize_fp8_takes_the_fused_ops(monkeypatch):
    seen = []
    for op in ("fp8_cast", "fp8_quantize_blocks"):
        real = getattr(torch.ops.mpfunc, op)
        monkeypatch.setattr(torch.ops.mpfunc, op, lambda *a, real=real, op=op:
                            seen.append(op) or real(*a))
    x = torch.randn(3, 40)
    for block in (None, (1, None), (2, 16)):
        q, s = mpfunc_torch.quantize_fp8(x, "e5m2", block)
        qr, sr = ref_quantize(x.numpy(), "float8_e5m2", block)
        assert np.array_equal(q.view(torch.uint8).numpy(), qr.view(np.uint8))
    mpfunc_torch.quantize_fp8(x, "e4m3", scale=torch.tensor(2.0))
    assert seen == ["fp8_cast", "fp8_quantize_blocks", "fp8_quantize_blocks", "fp8_cast"]


# ------------------------------------------------------------- the Triton kernels
def run_interpreted(*files):
    """pytest on ``files`` in a process where the Triton kernels run interpreted."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         "-W", "ignore::RuntimeWarning",  # NumPy's overflow warnings, in the interpreter
         # Not ours: triton 3.6's interpreter (torch 2.11's triton, make test-oldest)
         # converts one-element arrays to scalars, which NumPy >= 1.25 deprecates.
         "-W", "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning",
         *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
    return proc.stdout


@pytest.mark.skipif(INTERPRETED, reason="runs the interpreter itself")
@pytest.mark.slow  # triton's interpreter in a child, about 23 s; the kernels' torch references stay
def test_triton_kernels_under_the_interpreter():
    # This file again, with the Triton kernels doing every quantisation (interpreted
    # on CPU): the reference path's bits in every recipe, one launch per op.
    out = run_interpreted("tests/test_fp8_fused.py")
    assert "needs TRITON_INTERPRET" not in out  # the interpreted-only tests ran (-ra)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED, reason="runs the interpreter itself")
def test_the_bit_for_bit_suites_under_the_interpreter():
    # The hypothesis suites against the NumPy reference and JAX, and the Fp8Linear
    # tests, with the Triton kernels interpreted (~3 minutes on 2 busy cores).
    run_interpreted("tests/test_fp8_quantize.py", "tests/test_fp8_torch.py")


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (the test above)")
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_op_is_one_triton_kernel(recipe, monkeypatch):
    from mpfunc_torch._src.fp8 import triton_kernels as fp8_triton

    launches = []
    for name in ("cast_per_tensor", "quantize_blocks", "record_amax"):
        real = getattr(fp8_triton, name)
        monkeypatch.setattr(fp8_triton, name, lambda *a, real=real, name=name:
                            launches.append(name) or real(*a))
    layer = mpfunc_torch.Fp8Linear(96, 64, recipe=recipe)
    x = torch.randn(40, 96)
    with KernelLog() as log:
        quantize_operand(x, layer, "input")
    assert log.ops == FUSED_OPS[recipe]
    assert len(launches) == sum(op.startswith("mpfunc") for op in log.ops)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels do not compile")
def test_the_kernels_compile_for_hopper():
    # Triton compiles for a GPU it does not have: every kernel builds for sm_90 with
    # correctly rounded divisions (div.rn, never the approximate div.full) and no
    # multiply fused into an add.
    pytest.importorskip("triton")
    from fp8_triton_aot import compile_all

    for label, _seconds, ptx, cubin in compile_all(cc=90):
        assert cubin, label
        assert "div.full" not in ptx and "div.approx" not in ptx and "fma.rn.f32" not in ptx
        if label.startswith(("cast", "blocks")):
            assert "div.rn.f32" in ptx, label


# ------------------------------------------------------------------------ on CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_triton_bits_match_the_reference(recipe, monkeypatch):  # pragma: no cover
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-40, 3e38, -3e38, 448.0, 464.0,
                57344.0, 61440.0, 1.0625, 1.1875, 2.0**-10, 2.0**-17, 1.5 * 2.0**-9]
    x = np.random.default_rng(0).standard_normal((200, 300)).astype(np.float32)
    x[0, :len(specials)] = specials
    out = {}
    for path in ("fused", "reference"):
        if path == "reference":
            monkeypatch.setattr(fp8_fused, "fusable", lambda *t: False)
        layer = mpfunc_torch.Fp8Linear(300, 200, recipe=recipe, device="cuda")  # fresh state
        got = []
        for dtype in (torch.float32, torch.bfloat16):
            xt = torch.from_numpy(x).to("cuda", dtype)
            for role, t in (("input", xt), ("weight", xt.t()), ("grad_output", xt)):
                for op in quantize_operand(t, layer, role):
                    got += [op.q.view(torch.uint8).cpu(), op.scale.cpu()]
        out[path] = got + [b.cpu() for b in layer.buffers()]
    for a, b in zip(out["fused"], out["reference"], strict=True):
        assert torch.equal(a, b)
    if recipe != "delayed":  # and the NumPy reference's (the float32 input's, first)
        r = resolve_recipe(recipe)
        qr, sr = ref_quantize(x, r.dtype("input"), r.block("input"), r.margin,
                              r.power_of_2_scales)
        assert np.array_equal(out["fused"][0].numpy(), qr.view(np.uint8))
        assert np.array_equal(out["fused"][1].numpy().view(np.uint32),
                              np.asarray(sr, np.float32).view(np.uint32))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_kernels_per_operand(recipe):  # pragma: no cover
    # The GPU kernels one operand's quantisation launches (Triton's and torch's).
    from torch.profiler import ProfilerActivity, profile

    layer = mpfunc_torch.Fp8Linear(512, 256, recipe=recipe, device="cuda")
    x = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    quantize_operand(x, layer, "input")  # compiles the kernels
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, KernelLog() as log:
        quantize_operand(x, layer, "input")
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    assert log.ops == FUSED_OPS[recipe]
    assert 1 <= len(kernels) <= 3, [e.name for e in kernels]
