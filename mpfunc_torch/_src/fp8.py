"""The fp8 linear for PyTorch, with current or delayed scaling (the rule in
`_mpfunc_common.fp8`).

Quantisation itself is in `mpfunc_torch._src.fp8_quantize`. `fp8_linear` is an
``autograd.Function``: inputs and weights in the recipe's forward format, output
gradients in its backward format. On CPU (and GPUs without fp8) each GEMM is emulated:
dequantise, then multiply in float32. On CUDA with compute capability >= 8.9,
per-tensor and rowwise GEMMs run on ``torch._scaled_mm``, wrapped in one place with
torch's other private kernels (`mpfunc_torch._src.fused.scaled_mm`).
"""

from __future__ import annotations

from typing import Any

import torch

from _mpfunc_common.fp8 import Fp8Recipe
from mpfunc_torch._src.fp8_quantize import (
    all_reduce_max,
    block_amax,
    dequantize_fp8,
    quantize_with,
    scale_from_amax,
)
from mpfunc_torch._src.fused import scaled_mm, scaled_mm_available, scaled_mm_fits

__all__ = ["fp8_linear"]

_F32 = torch.float32


# ---------------------------------------------------------------- the fp8 linear
class _Operand:
    """One quantised GEMM operand: fp8 data, scales and their block (contraction last)."""

    def __init__(self, x2d: torch.Tensor, role: str, recipe: Fp8Recipe, groups,
                 scale: torch.Tensor | None = None):
        name = recipe.dtype(role)
        self.block = recipe.block(role)
        if scale is None:
            amax = block_amax(x2d, self.block)
            if self.block is None:
                amax = all_reduce_max(amax, groups)
            scale = scale_from_amax(amax, name, recipe.margin, recipe.power_of_2_scales, 1.0)
        self.scale = scale
        self.q = quantize_with(x2d, scale, self.block, name)

    def dequantized(self) -> torch.Tensor:
        return dequantize_fp8(self.q, self.scale, self.block)


def _gemm(a: _Operand, b: _Operand, out_dtype, use_scaled_mm: bool, bias=None):
    """a (M, K) @ b (N, K)^T: ``torch._scaled_mm`` where it applies, else emulated."""
    if use_scaled_mm and scaled_mm_fits(a.q, b.q, a.block, out_dtype):
        return scaled_mm(a.q, a.scale, b.q, b.scale, out_dtype, bias)
    out = a.dequantized() @ b.dequantized().t()
    if bias is not None:
        out = out + bias.to(_F32)
    return out.to(out_dtype)


def _delayed_scale(x: torch.Tensor, layer, role: str, recipe: Fp8Recipe, groups):
    """This step's scale from ``layer``'s history; updates the buffers in place."""
    hist = getattr(layer, f"fp8_amax_history_{role}")
    prev = getattr(layer, f"fp8_scale_{role}")
    amax = block_amax(x, None)
    if hasattr(amax, "full_tensor"):  # a DTensor operand (tensor parallelism): its amax
        amax = amax.full_tensor()     # over the whole tensor, as the history records it
    amax = all_reduce_max(amax, groups)
    used = hist.max() if recipe.amax_reduction == "max" else hist[0]  # the history alone
    fallback = torch.where(torch.isfinite(prev) & (prev > 0), prev, torch.ones_like(prev))
    scale = scale_from_amax(used, recipe.dtype(role), recipe.margin,
                   recipe.power_of_2_scales, fallback)
    rolled = torch.cat([amax.reshape(1), hist[:-1]])
    hist.copy_(torch.where(torch.isfinite(amax), rolled, hist))
    prev.copy_(scale)
    return scale


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, out_dtype, use_scaled_mm):
        recipe, groups = layer.recipe, layer._groups
        x2 = x.reshape(-1, x.shape[-1])
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            sx = sw = None
            if recipe.delayed:
                sx = _delayed_scale(x2, layer, "input", recipe, groups)
                sw = _delayed_scale(weight, layer, "weight", recipe, groups)
            qx = _Operand(x2, "input", recipe, groups, sx)
            qw = _Operand(weight, "weight", recipe, groups, sw)
            y = _gemm(qx, qw, out_dtype, use_scaled_mm, bias)
        per_tensor = recipe.block("input") is None
        ctx.save_for_backward(x, weight, qx.scale if per_tensor else None,
                              qw.scale if per_tensor else None)
        ctx.layer, ctx.use_scaled_mm, ctx.has_bias = layer, use_scaled_mm, bias is not None
        if x.dim() == 2:
            return y
        # As F.linear's matmul folding does: an output autograd does not track as a view
        # (FSDP2 warns about module outputs that are views: an in-place op on one would
        # skip its pre-backward hook).
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, g):
        x, weight, sx, sw = ctx.saved_tensors
        layer, use_mm = ctx.layer, ctx.use_scaled_mm
        recipe, groups = layer.recipe, layer._groups
        x2 = x.reshape(-1, x.shape[-1])
        g2 = g.reshape(-1, g.shape[-1])
        with torch.no_grad(), torch.autocast(g.device.type, enabled=False):
            if recipe.block("grad_output") is None:
                # One scale per tensor: quantise each tensor once and transpose the fp8
                # data (x and w keep their forward scales).
                sg = (_delayed_scale(g2, layer, "grad_output", recipe, groups)
                      if recipe.delayed else None)
                qg = _Operand(g2, "grad_output", recipe, groups, sg)
                qx = _Operand(x2, "input", recipe, groups, sx)
                qw = _Operand(weight, "weight", recipe, groups, sw)
                qg_t, qx_t, qw_t = (_transposed(o) for o in (qg, qx, qw))
            else:
                # Each operand quantised with its contraction dim last, as its GEMM needs.
                qg = _Operand(g2, "grad_output", recipe, groups)
                qw_t = _Operand(weight.t(), "weight", recipe, groups)
                qg_t = _Operand(g2.t(), "grad_output", recipe, groups)
                qx_t = _Operand(x2.t(), "input", recipe, groups)
            dx = _gemm(qg, qw_t, x.dtype, use_mm) if ctx.needs_input_grad[0] else None
            dw = _gemm(qg_t, qx_t, weight.dtype, use_mm) if ctx.needs_input_grad[1] else None
            db = g2.to(_F32).sum(0).to(weight.dtype) if ctx.has_bias else None
        if dx is not None:
            dx = dx.reshape(x.shape)
        return dx, dw, db, None, None, None


def _transposed(op: _Operand) -> _Operand:
    out = _Operand.__new__(_Operand)
    out.block, out.scale, out.q = op.block, op.scale, op.q.t()
    return out


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
    return _Fp8Linear.apply(x, layer.weight, layer.bias, layer, out_dtype, use_mm)
