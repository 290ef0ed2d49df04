"""torch's private API, through the one wrapper of each in mpfunc_torch/_src/fused.py.

These are what moves between torch releases, so `make test-latest` and `make
test-oldest` run this file on the newest and the oldest torch the project claims, as
the default suite does on the pinned one. Each test checks what the library relies on.
"""

import pytest
import torch

from mpfunc_torch._src import fused


def test_private_names_are_used_in_fused_only():
    import pathlib

    root = pathlib.Path(fused.__file__).parents[1]
    names = ("_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_",
             "torch._scaled_mm(", "_disable_dynamo", "OptimizedModule", "_python_dispatch",
             "_fused_adamw_", "_global_optimizer_pre_hooks")
    for path in root.rglob("*.py"):
        text = path.read_text()
        for name in names:
            count = text.count(name)
            if path == pathlib.Path(fused.__file__):  # not fp8/fused.py
                assert count >= 1, name
            else:
                assert count == 0, f"{path.name} uses {name} outside fused.py"


def test_check_and_unscale_checks_before_multiplying_and_only_raises_the_flag():
    grads = [torch.tensor([2.0, -4.0]), torch.tensor([1.0], dtype=torch.float16)]
    found = torch.zeros(())
    fused.unscale_and_check_(grads, found, torch.tensor(0.5))
    assert grads[0].tolist() == [1.0, -2.0] and grads[1].tolist() == [0.5]
    assert found.item() == 0.0
    grads = [torch.tensor([float("inf"), 1.0]), torch.tensor([float("nan")])]
    fused.unscale_and_check_(grads, found, torch.tensor(0.5))
    assert found.item() == 1.0
    fused.unscale_and_check_([torch.ones(3)], found, torch.tensor(1.0))
    assert found.item() == 1.0  # never cleared
    flags = torch.zeros(2)
    fused.unscale_and_check_([torch.ones(2), torch.tensor([float("-inf")])], torch.zeros(()),
                             torch.tensor(1.0), flags=flags)
    assert flags.tolist() == [0.0, 1.0]


def test_update_scale_grows_after_the_interval_and_backs_off_on_an_overflow():
    scale, tracker = torch.tensor(2.0**16), torch.zeros((), dtype=torch.int32)
    for _ in range(3):
        fused.update_scale_(scale, tracker, torch.zeros(()), 2.0, 0.5, 3)
    assert (scale.item(), tracker.item()) == (2.0**17, 0)
    fused.update_scale_(scale, tracker, torch.zeros(()), 2.0, 0.5, 3)
    fused.update_scale_(scale, tracker, torch.ones(()), 2.0, 0.5, 3)
    assert (scale.item(), tracker.item()) == (2.0**16, 0)


def test_scaled_mm_is_the_dequantised_product():
    torch.manual_seed(0)
    a, b = torch.randn(16, 32), torch.randn(16, 32)
    sa, sb = torch.tensor(4.0), torch.tensor(8.0)
    qa, qb = (a * sa).to(torch.float8_e4m3fn), (b * sb).to(torch.float8_e4m3fn)
    want = (qa.float() / sa) @ (qb.float() / sb).T
    try:
        got = fused.scaled_mm(qa, sa, qb, sb, torch.float32)
    except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - no CPU kernel
        pytest.skip(f"torch {torch.__version__} has no CPU _scaled_mm: {e}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings(  # torch 2.13's own import path when dynamo loads
    "ignore:.*torch.jit.script_method. is deprecated:DeprecationWarning")
def test_rowwise_scales_on_cpu_follow_the_installed_kernel():
    # torch 2.11's CPU _scaled_mm takes per-tensor scales only; 2.13's takes rows too.
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version <= (2, 11):
        assert not fused.cpu_scaled_mm_rowwise()
    elif version >= (2, 13):
        assert fused.cpu_scaled_mm_rowwise()
    q = torch.ones(16, 32).to(torch.float8_e4m3fn)
    fits = fused.scaled_mm_fits(q, q, (1, None), torch.bfloat16)
    assert fits == fused.cpu_scaled_mm_rowwise()  # else the emulation runs
    assert fused.scaled_mm_fits(q, q, None, torch.bfloat16)  # tensorwise: always


@pytest.mark.filterwarnings(  # torch 2.13's own import path when dynamo loads
    "ignore:.*torch.jit.script_method. is deprecated:DeprecationWarning")
def test_compiled_inner_looks_inside_torch_compile_without_compiling():
    net = torch.nn.Linear(2, 2)
    assert fused.compiled_inner(net) is None
    assert fused.compiled_inner(torch.compile(net)) is net


@pytest.mark.filterwarnings(
    "ignore:.*torch.jit.script_method. is deprecated:DeprecationWarning")
def test_eager_runs_a_method_outside_dynamo_so_its_writes_are_kept():
    class Counter:
        calls = 0

        @fused.eager
        def bump(self, x):
            self.calls += 1
            return x * 2

    c = Counter()

    @torch.compile(backend="eager")
    def f(x):
        return c.bump(x + 1)

    assert f(torch.ones(2)).tolist() == [4.0, 4.0]
    assert c.calls == 1
    assert f(torch.ones(2)).tolist() == [4.0, 4.0]
    assert c.calls == 2  # ran again: a graph break, not a traced-away call


def test_fused_adam_and_adamw_call_the_kernels_taken_over_through_a_dispatch_mode():
    # storage_kernels relies on: torch.optim.Adam/AdamW(fused=True) calling one of
    # ADAM_KERNELS per step, with the params and state tensors themselves (not copies) in
    # its lists, after counting the step; and on the probe of whether a 16-bit state
    # beside float32 params reaches the kernel (2.13: yes; 2.11 refuses it before).
    seen = []

    class Record(fused.DispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in fused.ADAM_KERNELS:
                seen.append((func, args[0], args[2], dict(kwargs or {})))
                return None  # not stepped: the caller's to do
            return func(*args, **(kwargs or {}))

    for cls, lr in [(torch.optim.Adam, 1e-3), (torch.optim.AdamW, torch.tensor(1e-3))]:
        p = torch.nn.Parameter(torch.ones(3))
        opt = cls([p], lr=lr, fused=True)
        p.grad = torch.ones(3)
        opt.step()  # makes the state
        seen.clear()
        with Record():
            opt.step()
        [(func, params, avgs, kwargs)] = seen
        assert params[0] is p and avgs[0] is opt.state[p]["exp_avg"]
        assert {"beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize"} <= set(kwargs)
        assert opt.state[p]["step"].item() == 2  # torch counts the step before the kernel
        opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].bfloat16()
        seen.clear()
        try:
            with Record():
                opt.step()
            reached = seen[0][2][0].dtype == torch.bfloat16
        except RuntimeError as e:
            assert "same dtype" in str(e)
            reached = False
        assert fused.fused_adam_takes_state_of_another_dtype() == reached
    assert not fused.has_step_hooks(opt)
    handle = opt.register_step_pre_hook(lambda *a: None)
    assert fused.has_step_hooks(opt)
    handle.remove()
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda *a: None)
    assert fused.has_step_hooks(opt)
    handle.remove()
    assert not fused.has_step_hooks(opt)
