"""The one place that calls torch's private API: fused AMP kernels and dynamo's switches.

Each private name is used in one wrapper here, and tests/test_torch_private_ops.py
checks every wrapper on each torch version the project claims (the pinned, the newest
and the oldest; see the Makefile's test-latest and test-oldest):

* ``torch._amp_foreach_non_finite_check_and_unscale_`` (`_check_and_unscale_`): one
  fused pass that multiplies every gradient by ``inv_scale`` in place and raises
  ``found_inf`` if any is inf/NaN. It checks each value *before* multiplying; where the
  scale can be below 1 the caller runs a second, check-only pass (``inv_scale`` 1).
* ``torch._amp_update_scale_`` (`update_scale_`): torch's one-kernel GradScaler update,
  used only where it computes exactly our rule (see `mpfunc_torch._src.loss_scale`).
* ``torch._scaled_mm`` (`scaled_mm`): the fp8 GEMM (cuBLASLt) of the fp8 mode's linears
  on CUDA with compute capability >= 8.9; CPU has a reference kernel, used in tests.
* ``torch._disable_dynamo`` (`eager`) and ``torch._dynamo.eval_frame.OptimizedModule``
  (`compiled_inner`): run a method outside dynamo, and look inside
  ``torch.compile(module)``.
* ``torch.ops.aten._fused_adam_`` / ``_fused_adamw_`` (`ADAM_KERNELS`), seen through a
  ``torch.utils._python_dispatch.TorchDispatchMode`` (`DispatchMode`), and the step
  hooks of ``torch.optim.optimizer`` (`has_step_hooks`): the fused Adam kernel that
  `mpfunc_torch._src.storage_kernels` takes over from inside ``Adam.step``.

Sparse gradients are handled through their (coalesced) values, complex ones through
their real view, so both real and imaginary parts are unscaled and checked.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
import torch.optim.optimizer as _optimizer_module
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "ADAM_KERNELS",
    "DispatchMode",
    "has_step_hooks",
    "fused_adam_takes_state_of_another_dtype",
    "eager",
    "compiled_inner",
    "unscale_and_check_",
    "nonfinite_flags_",
    "update_scale_",
    "clip_grads_",
    "step_with_found_inf_",
    "scaled_mm",
    "scaled_mm_available",
    "scaled_mm_fits",
    "cpu_scaled_mm_rowwise",
]


# The step state machine runs outside dynamo: dynamo drops attribute writes on
# torch.optim.Optimizer subclasses (its OptimizerVariable), so a compiled train step
# would see a backward that never happened. Each call is one graph break; the model's
# forward and backward stay compiled, and the step is the same foreach/fused kernels.
# torch.compiler.disable would import torch._dynamo (and with it torch.onnx) here, at
# class definition: about as long again as `import torch`. torch's lazy form,
# which torch.optim.Optimizer's own methods use, imports it at the first call instead;
# dynamo skips its wrapper (torch._compile is on its skip list), so a traced call is a
# graph break and the method runs with dynamo off, as with torch.compiler.disable.
eager = torch._disable_dynamo  # pyright: ignore[reportPrivateImportUsage]  # torch's private op, used only here (tests/test_torch_private_ops.py)


def compiled_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module inside ``torch.compile(module)``, or None if ``module`` is not one."""
    if "_orig_mod" not in module._modules:
        return None  # checked first: importing torch._dynamo costs about an `import torch`
    from torch._dynamo.eval_frame import OptimizedModule

    return module._modules["_orig_mod"] if isinstance(module, OptimizedModule) else None


def _check_and_unscale_(tensors: list[torch.Tensor], found_inf: torch.Tensor,
                        inv_scale: torch.Tensor) -> None:
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported


def _dense(t: torch.Tensor, real: bool) -> torch.Tensor:
    if t.is_sparse:
        if not t.is_coalesced():
            # The values of an uncoalesced tensor may be a temporary: unscaling them would
            # leave the gradient scaled. The caller coalesces into ``param.grad`` first.
            raise ValueError("a sparse gradient is not coalesced; coalesce it into "
                             "`param.grad` first (param.grad = param.grad.coalesce()).")
        t = t._values()
    if real and t.is_complex():
        t = torch.view_as_real(t)
    return t


def _group(tensors: Iterable[torch.Tensor]) -> dict[tuple, list]:
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if t is None:
            continue
        t = _dense(t, real=True)
        groups[(t.device, t.dtype)].append(t)
    return groups


def unscale_and_check_(
    grads: Iterable[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor,
    flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multiplies ``grads`` by ``inv_scale`` in place; sets ``found_inf`` to 1 on inf/NaN.

    One fused kernel per (device, dtype) group. ``found_inf`` (float32, 0-dim) is only
    ever raised, never cleared, so several calls accumulate. Pass ``inv_scale`` = 1 for a
    check without unscaling. Nothing is copied to the host. Sparse grads must be
    coalesced; complex grads are unscaled and checked in both parts.

    With ``flags`` (float32, one per gradient, on ``found_inf``'s device) the kernel runs
    once per gradient instead, raising ``flags[i]`` for gradient ``i`` and then
    ``found_inf`` from them: the same bytes read and written, one launch per tensor,
    and it says which gradient was not finite (see `nonfinite_flags_`).

    Returns:
      ``found_inf``.
    """
    if found_inf.dtype != torch.float32 or found_inf.dim() != 0:
        raise ValueError(f"`found_inf` must be a 0-dim float32 tensor, got {found_inf.dtype} "
                         f"with shape {tuple(found_inf.shape)}.")
    if flags is not None:
        grads = [g for g in grads if g is not None]
        for i, g in enumerate(grads):
            g = _dense(g, real=True)
            inv = inv_scale if inv_scale.device == g.device else inv_scale.to(g.device)
            if g.device == flags.device:
                _check_and_unscale_([g], flags[i], inv)
            else:  # pragma: no cover - gradients on several devices
                fi = torch.zeros((), device=g.device)
                _check_and_unscale_([g], fi, inv)
                flags[i] = torch.maximum(flags[i], fi.to(flags.device))
        if grads:
            torch.maximum(found_inf, flags[:len(grads)].amax(), out=found_inf)
        return found_inf
    for (device, _dtype), group in _group(grads).items():
        fi = found_inf if found_inf.device == device else torch.zeros((), device=device)
        inv = inv_scale if inv_scale.device == device else inv_scale.to(device)
        _check_and_unscale_(group, fi, inv)
        if fi is not found_inf:
            found_inf.copy_(torch.maximum(found_inf, fi.to(found_inf.device)))
    return found_inf


def nonfinite_flags_(tensors: Sequence[torch.Tensor], flags: torch.Tensor) -> torch.Tensor:
    """Sets ``flags[i]`` (float32, on each tensor's device) to 1 where ``tensors[i]``
    holds an inf or NaN, never clearing one: the check kernel once per tensor (inverse
    scale 1, so it rewrites each tensor unchanged, as a check-only pass does).

    Measured on a 2-core CPU over 10.5M float32 values: 0.96 ms, against 0.87 ms for one
    multi-tensor check and 14 ms for ``torch._foreach_norm(..., inf)``; it also reads
    NaN for certain, which a max reduction need not.
    """
    one = torch.ones((), device=flags.device)
    for i, t in enumerate(tensors):
        _check_and_unscale_([_dense(t, real=True)], flags[i], one)
    return flags


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """torch's GradScaler update, in place, in one kernel."""
    torch._amp_update_scale_(  # pyright: ignore[reportPrivateImportUsage]  # torch's private op, used only here (tests/test_torch_private_ops.py)
        scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
    )


def clip_grads_(grads: Iterable[torch.Tensor], max_norm: float,
                norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on gradient tensors, sparse ones included (via
    their coalesced values). Returns the total norm before clipping (a device tensor)."""
    tensors = [_dense(g, real=False) for g in grads if g is not None]
    if not tensors:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(tensors, norm_type, foreach=True)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (device, _dtype), group in _group(tensors).items():
        torch._foreach_mul_(group, coef.to(device))  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported
    return total


def step_with_found_inf_(optimizer: torch.optim.Optimizer, grad_scale, found_inf) -> None:
    """One step of a fused optimizer (``_step_supports_amp_scaling``) that unscales by
    ``grad_scale`` (None: already unscaled) and skips where ``found_inf`` is 1, undoing
    its step count, all on the device."""
    # torch's fused optimizers read these attributes, as GradScaler sets them.
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf  # pyright: ignore[reportAttributeAccessIssue]  # not declared on Optimizer
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale, optimizer.found_inf = None, None  # pyright: ignore[reportAttributeAccessIssue]  # as above


# ------------------------------------------------------- the fused Adam kernel, taken over
# The overloads of the kernel that torch.optim.Adam/AdamW(fused=True) call once per
# device and dtype (``tensor_lr``: a tensor learning rate).
ADAM_KERNELS = frozenset(getattr(getattr(torch.ops.aten, name), overload)
                         for name in ("_fused_adam_", "_fused_adamw_")
                         for overload in ("default", "tensor_lr"))
DispatchMode = TorchDispatchMode  # sees every aten call made while it is entered


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step pre- or post-hook is registered on ``optimizer`` or globally
    (``register_optimizer_step_pre_hook``): such a hook may read the params."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or _optimizer_module._global_optimizer_pre_hooks
                or _optimizer_module._global_optimizer_post_hooks)


_MIXED_STATE: list[bool] = []


def fused_adam_takes_state_of_another_dtype() -> bool:
    """Whether the installed torch's ``Adam(fused=True).step`` hands its kernel state
    tensors of another dtype than their params (2.13 does; 2.11 refuses them before the
    kernel: "Tensors of the same index must be on the same device and the same dtype").
    Asked once, on a one-element step whose kernel call is swallowed."""
    if not _MIXED_STATE:
        class Swallow(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return None if func in ADAM_KERNELS else func(*args, **(kwargs or {}))

        p = torch.nn.Parameter(torch.zeros(1))
        p.grad = torch.zeros(1)
        opt = torch.optim.Adam([p], fused=True)
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(1, dtype=torch.bfloat16),
                        "exp_avg_sq": torch.zeros(1, dtype=torch.bfloat16)}
        try:
            with Swallow():
                opt.step()
            _MIXED_STATE.append(True)
        except RuntimeError:
            _MIXED_STATE.append(False)
    return _MIXED_STATE[0]


# ------------------------------------------------------------------ torch._scaled_mm
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def scaled_mm_available(device: torch.device) -> bool:
    """True on CUDA devices with compute capability >= 8.9 (Ada, Hopper and newer)."""
    device = torch.device(device)
    return device.type == "cuda" and _capability(device) >= (8, 9)


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None, *,
              use_fast_accum: bool = False) -> torch.Tensor:
    """``dequantize_fp8(a) @ dequantize_fp8(b).T`` on ``torch._scaled_mm`` (the one call site).

    ``a`` is ``(M, K)`` and ``b`` ``(N, K)``, both fp8 with the contraction dim last and
    row-major (the callers write them so; ``.contiguous()`` is then free);
    ``a_scale``/``b_scale`` are `quantize_fp8`'s scales: 0-dim (tensorwise) or ``(M, 1)``
    / ``(N, 1)`` (rowwise). ``_scaled_mm`` wants a row-major ``a``, a column-major second
    operand (``b.T`` of a row-major ``b``) and the reciprocal scales; rowwise needs a
    bfloat16 output, so another ``out_dtype`` is that bfloat16 result cast; a bias is
    fused only into a 16-bit output. ``use_fast_accum``: cuBLASLt's fast fp8
    accumulation (torchao uses it for the forward GEMM only).
    """
    a = a.contiguous()
    b = b.contiguous()
    inv_a = torch.reciprocal(a_scale.to(torch.float32))
    inv_b = torch.reciprocal(b_scale.to(torch.float32))
    rowwise = a_scale.dim() > 0
    if rowwise:
        inv_a = inv_a.reshape(-1, 1).contiguous()
        inv_b = inv_b.reshape(1, -1).contiguous()
    mm_dtype = torch.bfloat16 if rowwise else out_dtype
    # cuBLASLt takes a bias only in a 16-bit type; a float32 result adds it afterwards.
    fused_bias = bias is not None and mm_dtype in (torch.bfloat16, torch.float16)
    out = torch._scaled_mm(a, b.t(), inv_a, inv_b, out_dtype=mm_dtype,  # pyright: ignore[reportPrivateImportUsage]  # torch's private op, used only here (tests/test_torch_private_ops.py)
                           bias=bias.to(mm_dtype) if fused_bias and bias is not None else None,
                           use_fast_accum=use_fast_accum)
    if bias is not None and not fused_bias:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)


_CPU_ROWWISE: list[bool] = []


def cpu_scaled_mm_rowwise() -> bool:
    """Whether the installed torch's CPU ``_scaled_mm`` takes row-wise scales (2.13's
    does; 2.11's takes per-tensor scales only). Asked once, on a 16 x 16 product."""
    if not _CPU_ROWWISE:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        s = torch.ones(16, 1)
        try:
            torch._scaled_mm(a, a.t(), s, s.t(), out_dtype=torch.bfloat16)  # pyright: ignore[reportPrivateImportUsage]  # torch's private op, used only here (tests/test_torch_private_ops.py)
            _CPU_ROWWISE.append(True)
        except RuntimeError:
            _CPU_ROWWISE.append(False)
    return _CPU_ROWWISE[0]


def scaled_mm_fits(a: torch.Tensor, b: torch.Tensor, block, out_dtype) -> bool:
    """Whether `scaled_mm` takes these fp8 operands (``block``: the recipe's, for ``a``).

    Tensorwise everywhere ``_scaled_mm`` runs; rowwise on CUDA only with compute
    capability >= 9.0 (the rowwise kernels are Hopper's; on Ada it is emulated) and on
    CPU where torch's reference kernel takes row-wise scales (`cpu_scaled_mm_rowwise`;
    used in tests); blockwise never (emulated).
    """
    if block is not None and block != (1, None):
        return False  # blockwise: emulated (its cuBLAS kernels are not wrapped yet)
    if block == (1, None) and a.device.type == "cuda" and _capability(a.device) < (9, 0):
        return False
    if block == (1, None) and a.device.type == "cpu" and not cpu_scaled_mm_rowwise():
        return False
    if a.dtype == b.dtype == torch.float8_e5m2:
        return False  # cuBLASLt has no e5m2 x e5m2 GEMM (format="e5m2"): emulated
    k, n = a.shape[1], b.shape[0]
    return k % 16 == 0 and n % 16 == 0 and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
