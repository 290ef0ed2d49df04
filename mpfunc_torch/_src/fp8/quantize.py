"""fp8 quantisation for PyTorch: the rule in `_mpfunc_common.fp8`, bit for bit with JAX's.

`quantize_fp8` / `dequantize_fp8` follow ``_mpfunc_common.fp8.QUANTIZE_RULE`` exactly, so
they give the same bits as ``mpfunc``'s (``mpfunc/_src/fp8/quantize.py``).
The rule's torch ops are in ``rule``, the fused kernels in ``fused``.
"""

from __future__ import annotations

from typing import Any

import torch

from _mpfunc_common.fp8 import check_block, scale_shape
from mpfunc_torch._src.distributed import normalize_groups
from mpfunc_torch._src.fp8 import fused
from mpfunc_torch._src.fp8.rule import _F32, _as_2d, _fp8_name, _tiled, _untiled, quantize_with

__all__ = ["dequantize_fp8", "quantize_fp8"]


def quantize_fp8(
    x: torch.Tensor,
    dtype: Any = "float8_e4m3fn",
    block: tuple[int | None, int | None] | None = None,
    *,
    margin: int = 0,
    power_of_2_scales: bool = False,
    process_group: Any = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantises ``x`` to fp8 with current scaling; bit-identical to ``mpfunc``'s.

    The rule (shared with JAX, word for word):

    Each operand of each matmul is quantised with its contraction dimension last, as a
    2-D array (leading dimensions flattened); a *block* is the set of elements that
    share one scale: the whole tensor (tensorwise, delayed), one row (rowwise), 1x128
    tiles of inputs and output gradients and 128x128 tiles of weights (blockwise). All
    arithmetic is float32 (a bfloat16/float16 input is upcast exactly first). Nothing
    is flushed: the scale range below makes every result the same whether or not the
    hardware flushes float32 subnormals (XLA on CPU does, torch does not). Step by
    step::

        amax  = max(|x|) over the block          # a NaN counts as +inf
        if amax is finite and amax >= 2**-126:   # a subnormal amax counts as zero
            scale = (fp8_max / amax) / 2**margin # correctly rounded float32 divisions
            scale = min(max(scale, 2**-126), max_scale)
            if power_of_2_scales:
                scale = 2**floor(log2(scale))    # mantissa bits cleared: exact
        else:                                    # all zeros, or inf/NaN in the block
            scale = fallback                     # 1.0 (current scaling), or the
                                                 # previous scale (delayed scaling)
        q = x * scale                            # float32 multiply, rounded
        q = clamp(q, -fp8_max, fp8_max) if q is finite else q   # saturate finite values
        q = fp8(q)                               # round to nearest, ties to even
        dequantised = float32(q) * (1 / scale)   # the reciprocal rounded to float32

    max_scale is 2**125 times the smallest fp8 subnormal (2**116 for e4m3fn, 2**109
    for e5m2): a float32 subnormal (below 2**-126) times the scale is then below half
    the smallest fp8 subnormal, so it becomes a zero of its sign whether it was flushed
    first or not, and every nonzero dequantised value is at least 2**-125, a normal
    float32.

    Finite values beyond the range saturate to +-fp8_max, written out because the
    frameworks' own casts disagree (torch's e4m3fn cast saturates, even inf; XLA's
    gives NaN; both overflow to inf in e5m2). Non-finite values are never hidden, so an
    overflow upstream still makes the step non-finite and the loss scale skips it: any
    NaN becomes the positive NaN (0x7F in e4m3fn, 0x7E in e5m2); +-inf becomes +-inf in
    e5m2 (0x7C, 0xFC) and a NaN in e4m3fn, which has no inf (0x7F, 0xFF).

    A GEMM of two per-tensor or rowwise quantised operands multiplies the fp8 values
    (exact in float32), accumulates in float32 and scales the result once:
    out = dot(q_a, q_b) * (1/scale_a * 1/scale_b); its accumulation order is the
    backend's, so GEMM results agree to float32 rounding, not bit for bit.

    Delayed scaling (per tensor) keeps an amax history (newest first, length
    ``amax_history_len``) and the last scale; this step's scale comes from them alone
    (as in TransformerEngine and flax), so the cast never waits for this step's amax::

        amax_used = max(history)  (or history[0] with amax_reduction="most_recent")
        scale = rule above with amax_used, fallback = the previous scale
                (1.0 if it is not a finite scale > 0: a fresh state, or a JAX state
                zeroed because its matmul's output did not reach the loss)
        history = [amax of this step's tensor] + history[:-1]   # only if finite

    So the first step (an all-zero history) uses the previous scale, 1.0 when fresh.

    A per-tensor amax (tensorwise, delayed) is MAX-reduced over the data-parallel group
    (``axis_name`` in JAX, ``process_group`` in torch) before it is used or recorded,
    so every rank has the same scales and histories. Row and tile scales are local.

    Args:
      x: a floating tensor; with a ``block`` its leading dims are flattened (the last
        dim is the contraction dim).
      dtype: ``"float8_e4m3fn"`` (``"e4m3"``), ``"float8_e5m2"`` (``"e5m2"``) or the
        torch dtype.
      block: None (one scale for the whole tensor) or ``(rows, cols)`` tiles, None
        meaning the whole dimension (``(1, None)``: one scale per row).
      margin: scales are divided by ``2**margin``.
      power_of_2_scales: round scales down to powers of two.
      process_group: a group (or a list of them) to MAX-reduce the amax over
        (per-tensor scales only).
      scale: use these float32 scales (e.g. delayed scaling's) instead of computing
        them; values beyond the range then saturate.

    Returns:
      ``(q, scale)``: the fp8 tensor (shape of ``x``) and the float32 scales, shape
      ``()`` or ``(row tiles, col tiles)``; ``x ~= q * (1 / scale)``.

    Examples:
      >>> import torch, mpfunc_torch
      >>> q, s = mpfunc_torch.quantize_fp8(torch.tensor([1.0, -2.0, 4.0]), "e4m3")
      >>> q.dtype, float(s), mpfunc_torch.dequantize_fp8(q, s).tolist()
      (torch.float8_e4m3fn, 112.0, [1.0, -2.0, 4.0])
    """
    name = _fp8_name(dtype)
    block = check_block(block)
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        raise TypeError(f"`x` must be a floating tensor, got {getattr(x, 'dtype', type(x))}.")
    groups = normalize_groups(process_group)
    if block is not None and groups:
        raise ValueError("`process_group` applies to per-tensor scales only (`block=None`); "
                         "row and tile scales are local to the rows they scale.")
    x2 = _as_2d(x)
    if scale is None:
        if block is None:
            q, _, scale = fused.cast_current(x2, name, margin, power_of_2_scales, groups,
                                                 False)
        else:
            q, scale = fused.quantize_blocks(x2, name, block, margin, power_of_2_scales)
        return q.reshape(x.shape), scale
    scale = torch.as_tensor(scale, dtype=_F32, device=x.device)
    want = scale_shape(tuple(x.shape), block)
    if tuple(scale.shape) != want:
        raise ValueError(f"`scale` must have shape {want} for this block, got "
                         f"{tuple(scale.shape)}.")
    if block is None:
        return fused.cast_given(x2, scale, name)[0].reshape(x.shape), scale
    return quantize_with(x, scale, block, name), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block=None,
               dtype: torch.dtype = _F32) -> torch.Tensor:
    """``float32(q) * (1 / scale)`` per block (the reciprocal rounded to float32), cast to
    ``dtype``; the inverse of `quantize_fp8` up to fp8 rounding."""
    if not (isinstance(q, torch.Tensor) and q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)):
        raise TypeError("`q` must be an fp8 tensor (float8_e4m3fn or float8_e5m2, from "
                        f"quantize_fp8), got {getattr(q, 'dtype', type(q).__name__)}.")
    block = check_block(block)
    inv = torch.reciprocal(scale.to(_F32))
    v = q.to(_F32)
    if block is None:
        out = v * inv
    else:
        t, info = _tiled(_as_2d(v), block)
        out = _untiled(t * inv[:, None, :, None], info).reshape(q.shape)
    return out.to(dtype)
