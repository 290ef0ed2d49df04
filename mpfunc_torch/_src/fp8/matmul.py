"""The fp8 linear for PyTorch, with current or delayed scaling (the rule in
`_mpfunc_common.fp8`).

Quantisation itself is in `mpfunc_torch._src.fp8.fused` (eager: custom ops, Triton
kernels on CUDA) on `mpfunc_torch._src.fp8.quantize`'s rule. `fp8_linear` is an
``autograd.Function``: inputs and weights in the recipe's forward format, output
gradients in its backward format. Per tensor (tensorwise, delayed) each operand is read
once for its amax and once by the cast, which also writes the transposed fp8 copy the
backward GEMM needs (delayed scaling takes this step's amax in the cast's pass: its
scale comes from the history); the backward keeps those fp8 copies, not the inputs.
Rowwise and blockwise take each block's amax and cast it in one kernel. Under
``torch.compile`` (``fullgraph=True`` works) the same rule is traced as torch ops and
inductor fuses each cast into one kernel.

On CUDA with compute capability >= 8.9 tensorwise and delayed GEMMs run on
``torch._scaled_mm`` (fast accumulation in the forward GEMM, as torchao), rowwise ones
with compute capability >= 9.0, all through one wrapper
(`mpfunc_torch._src.fused.scaled_mm`). Elsewhere (CPU, blockwise) each GEMM is
emulated in float32: the fp8 values multiplied and the output scaled, as the GPU does;
blockwise multiplies dequantised operands.
"""

from __future__ import annotations

from typing import Any

import torch

from _mpfunc_common.fp8 import Fp8Recipe
from mpfunc_torch._src.fp8.fused import cast_current, cast_delayed, quantize_blocks
from mpfunc_torch._src.fp8.quantize import dequantize_fp8
from mpfunc_torch._src.fused import scaled_mm, scaled_mm_available, scaled_mm_fits

__all__ = ["fp8_linear"]

_F32 = torch.float32


# ---------------------------------------------------------------- the fp8 linear
class _Operand:
    """One quantised GEMM operand: fp8 data with the contraction dim last, contiguous
    (row-major), its float32 scales and their block."""

    __slots__ = ("q", "scale", "block")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, block):
        self.q, self.scale, self.block = q, scale, block


def _quantize(x2d, role: str, recipe: Fp8Recipe) -> _Operand:
    """Row or tile scales (rowwise, blockwise): quantised along the last dim."""
    block = recipe.block(role)
    q, scale = quantize_blocks(x2d, recipe.dtype(role), block, recipe.margin,
                               recipe.power_of_2_scales)
    return _Operand(q, scale, block)


def _quantize_pair(x2d, layer, role: str, recipe: Fp8Recipe, groups, transposed: bool):
    """Per-tensor scales: the fp8 copy and, if asked, its transpose (both row-major, as
    ``_scaled_mm`` wants them), from one read of ``x2d``; delayed scaling also records
    this step's amax of ``x2d`` in ``layer``'s buffers."""
    name = recipe.dtype(role)
    if recipe.delayed:
        q, q_t, scale = cast_delayed(x2d, getattr(layer, f"fp8_amax_history_{role}"),
                                     getattr(layer, f"fp8_scale_{role}"), recipe, name, groups,
                                     transposed)
    else:
        q, q_t, scale = cast_current(x2d, name, recipe.margin, recipe.power_of_2_scales,
                                     groups, transposed)
    return _Operand(q, scale, None), (_Operand(q_t, scale, None) if q_t is not None else None)


def _gemm(a: _Operand, b: _Operand, out_dtype, use_scaled_mm: bool, bias=None,
          fast_accum: bool = False):
    """a (M, K) @ b (N, K)^T: ``torch._scaled_mm`` where it applies, else emulated.

    The emulation is the same computation in float32: per-tensor and rowwise GEMMs
    multiply the fp8 values (exact in float32), accumulate, and scale the output by
    ``1/scale_a`` and ``1/scale_b`` (as ``_scaled_mm`` and JAX's `fp8_dot` do); blockwise
    multiplies the dequantised operands.
    """
    if use_scaled_mm and scaled_mm_fits(a.q, b.q, a.block, out_dtype):
        return scaled_mm(a.q, a.scale, b.q, b.scale, out_dtype, bias, use_fast_accum=fast_accum)
    if a.block is None or a.block == (1, None):
        out = a.q.to(_F32) @ b.q.to(_F32).t()
        inv_a, inv_b = torch.reciprocal(a.scale), torch.reciprocal(b.scale)
        out = out * (inv_a * inv_b) if a.block is None else out * inv_a * inv_b.reshape(1, -1)
    else:
        out = dequantize_fp8(a.q, a.scale, a.block) @ dequantize_fp8(b.q, b.scale, b.block).t()
    if bias is not None:
        out = out + bias.to(_F32)
    return out.to(out_dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, out_dtype, use_scaled_mm, grad_enabled):
        recipe, groups = layer.recipe, layer._groups
        x2 = x.reshape(-1, x.shape[-1])
        per_tensor = recipe.block("input") is None
        # (needs_input_grad says True under no_grad too: no backward comes then.)
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            if per_tensor:
                # The backward's operands are the transposed fp8 copies, written now.
                qx, qx_t = _quantize_pair(x2, layer, "input", recipe, groups, need_dw)
                qw, qw_t = _quantize_pair(weight, layer, "weight", recipe, groups, need_dx)
                sx, sw = qx.scale, qw.scale
            else:
                qx = _quantize(x2, "input", recipe)
                qw = _quantize(weight, "weight", recipe)
            y = _gemm(qx, qw, out_dtype, use_scaled_mm, bias, fast_accum=True)
        if per_tensor:  # fp8 residuals: what the backward GEMMs read
            ctx.save_for_backward(qx_t.q if qx_t else None, qw_t.q if qw_t else None, sx, sw)
        else:           # re-quantised along the backward's contraction dims
            ctx.save_for_backward(x, weight)
        ctx.layer, ctx.use_scaled_mm, ctx.has_bias = layer, use_scaled_mm, bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        if x.dim() == 2:
            return y
        # As F.linear's matmul folding does: an output autograd does not track as a view
        # (FSDP2 warns about module outputs that are views: an in-place op on one would
        # skip its pre-backward hook).
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, g):
        layer, use_mm = ctx.layer, ctx.use_scaled_mm
        recipe, groups = layer.recipe, layer._groups
        g2 = g.reshape(-1, g.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = None
        with torch.no_grad(), torch.autocast(g.device.type, enabled=False):
            if recipe.block("grad_output") is None:
                qx_t, qw_t, sx, sw = ctx.saved_tensors
                qg, qg_t = _quantize_pair(g2, layer, "grad_output", recipe, groups, need_dw)
                if need_dx:
                    dx = _gemm(qg, _Operand(qw_t, sw, None), ctx.x_dtype, use_mm)
                if qg_t is not None:  # asked for exactly when need_dw
                    dw = _gemm(qg_t, _Operand(qx_t, sx, None), ctx.w_dtype, use_mm)
            else:
                # Each operand quantised with its contraction dim last, as its GEMM needs.
                x, weight = ctx.saved_tensors
                if need_dx:
                    dx = _gemm(_quantize(g2, "grad_output", recipe),
                               _quantize(weight.t(), "weight", recipe), ctx.x_dtype, use_mm)
                if need_dw:
                    dw = _gemm(_quantize(g2.t(), "grad_output", recipe),
                               _quantize(x.reshape(-1, x.shape[-1]).t(), "input", recipe),
                               ctx.w_dtype, use_mm)
            db = g2.to(_F32).sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db, None, None, None, None


def fp8_linear(x: torch.Tensor, layer: Any, out_dtype: torch.dtype | None = None,
               gemm: str = "auto") -> torch.Tensor:
    """``x @ layer.weight.T + layer.bias`` with fp8 operands, differentiable.

    ``layer`` carries ``weight`` ``(N, K)``, ``bias``, ``recipe`` (an `Fp8Recipe`),
    ``_groups`` (process groups for per-tensor amaxes) and, for delayed scaling, the
    ``fp8_amax_history_<role>`` / ``fp8_scale_<role>`` buffers (see ``Fp8Linear``).
    ``gemm``: ``"auto"`` (``torch._scaled_mm`` where available), ``"emulate"`` or
    ``"scaled_mm"`` (also on CPU, where torch has a reference kernel; for tests).
    """
    if gemm not in ("auto", "emulate", "scaled_mm"):
        raise ValueError(f"`gemm` must be 'auto', 'emulate' or 'scaled_mm', got {gemm!r}.")
    use_mm = gemm == "scaled_mm" or (gemm == "auto" and scaled_mm_available(x.device))
    if out_dtype is None:
        dev = x.device.type
        out_dtype = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev)
                     else x.dtype)
    return _Fp8Linear.apply(x, layer.weight, layer.bias, layer, out_dtype, use_mm,
                            torch.is_grad_enabled())
