"""fp8 quantisation for PyTorch: the rule in `_mpfunc_common.fp8`, bit for bit with JAX's.

`quantize_fp8` / `dequantize_fp8` follow ``_mpfunc_common.fp8.QUANTIZE_RULE`` exactly, so
they give the same bits as ``mpfunc``'s (``mpfunc/_src/fp8_quantize.py``).
`mpfunc_torch._src.fp8` builds the fp8 linear and delayed scaling on the helpers here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from _mpfunc_common.fp8 import (
    FLOAT32_MIN_NORMAL,
    FP8_MAX,
    MAX_SCALE,
    MIN_SCALE,
    check_block,
    scale_shape,
)
from mpfunc_torch._src.distributed import normalize_groups

__all__ = ["all_reduce_max", "block_amax", "cast_pair", "dequantize_fp8", "quantize_fp8",
           "quantize_with", "scale_from_amax"]

_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_F32 = torch.float32
_INF = float("inf")
# Bit patterns of (NaN, +inf, -inf): e4m3fn has no inf, so +-inf become its NaNs.
_NONFINITE_BITS = {"float8_e4m3fn": (0x7F, 0x7F, 0xFF), "float8_e5m2": (0x7E, 0x7C, 0xFC)}
_MANTISSA_OFF = -8388608  # 0xFF800000 as an int32: sign and exponent bits of a float32


def _fp8_name(dtype: Any) -> str:
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}.get(dtype, dtype)
    if name not in _DTYPES:
        raise ValueError(f"`dtype` must be float8_e4m3fn or float8_e5m2, got {dtype!r}.")
    return name


def all_reduce_max(x: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])


def _tiled(x2d: torch.Tensor, block):
    """(R, C) -> (nR, br, nC, bc), zero-padded; zeros never change an amax."""
    r, c = x2d.shape
    br = r if block[0] is None else block[0]
    bc = c if block[1] is None else block[1]
    nr, nc = -(-r // br), -(-c // bc)
    if (nr * br, nc * bc) != (r, c):
        x2d = torch.nn.functional.pad(x2d, (0, nc * bc - c, 0, nr * br - r))
    return x2d.reshape(nr, br, nc, bc), (r, c)


def _untiled(t: torch.Tensor, info) -> torch.Tensor:
    r, c = info
    nr, br, nc, bc = t.shape
    return t.reshape(nr * br, nc * bc)[:r, :c]


def block_amax(x: torch.Tensor, block) -> torch.Tensor:
    """max |x| per block (float32), a NaN counting as +inf (as on the JAX side).

    One pass over ``x``: ``vector_norm(ord=inf)`` is one reduction kernel (the max of
    |x|, exact in any float dtype, propagating NaN); the NaN -> inf fix-up is on the
    (small) result only.
    """
    x = x.detach()
    if block is None:
        a = (torch.linalg.vector_norm(x, _INF, dtype=_F32) if x.numel()
             else torch.zeros((), device=x.device))
    elif block == (1, None):
        a = torch.linalg.vector_norm(_as_2d(x), _INF, dim=1, keepdim=True, dtype=_F32)
    else:
        t, _ = _tiled(_as_2d(x), block)
        a = torch.linalg.vector_norm(t, _INF, dim=(1, 3), dtype=_F32)
    return torch.where(a.isnan(), _INF, a)


def scale_from_amax(amax: torch.Tensor, name: str, margin: int, power_of_2: bool,
                    fallback) -> torch.Tensor:
    """The rule's scale of an fp8 format ``name`` from a block amax (scalar work)."""
    # Constants as fills (a kernel), not torch.tensor(..., device=...): that copies from
    # pageable host memory and synchronizes a CUDA stream, several times a layer.
    s = torch.full_like(amax, FP8_MAX[name], dtype=_F32) / amax
    if margin:
        s = s / torch.full_like(s, 2.0**margin)
    s = s.clamp(MIN_SCALE, MAX_SCALE[name])
    if power_of_2:  # clear the mantissa: 2**floor(log2(s)), exactly (s is normal)
        s = (s.view(torch.int32) & _MANTISSA_OFF).view(_F32)
    ok = torch.isfinite(amax) & (amax >= FLOAT32_MIN_NORMAL)
    if not isinstance(fallback, torch.Tensor):
        fallback = torch.full_like(s, fallback)
    return torch.where(ok, s, fallback)


def _cast(y: torch.Tensor, name: str) -> torch.Tensor:
    """float32 -> fp8 by the rule: one clamp, the cast (round to nearest even), and the
    non-finite encodings selected bitwise; one elementwise expression, which inductor
    fuses into one kernel with the multiply before it (reading ``x`` once)."""
    m = FP8_MAX[name]
    q = y.clamp(-m, m).to(_DTYPES[name]).view(torch.uint8)  # saturate finite values
    # torch's eager cast saturates inf in e4m3fn, its NaN encodings differ from XLA's,
    # and a generated kernel's cast need not match either: the non-finite bit patterns
    # are the rule's, selected bitwise.
    nan, pos_inf, neg_inf = _NONFINITE_BITS[name]
    special = torch.where(y.isnan(), nan, torch.where(y > 0, pos_inf, neg_inf))
    return torch.where(torch.isfinite(y), q, special.to(torch.uint8)).view(_DTYPES[name])


def quantize_with(x: torch.Tensor, scale: torch.Tensor, block, name: str) -> torch.Tensor:
    """``x`` quantised with given float32 scales (shape of `scale_shape`)."""
    x = x.detach()
    if block is None:
        return _cast(x.to(_F32) * scale, name)
    t, info = _tiled(_as_2d(x), block)
    q = _cast(t.to(_F32) * scale[:, None, :, None], name)
    return _untiled(q, info).reshape(x.shape)


def cast_pair(x: torch.Tensor, scale: torch.Tensor, name: str,
              transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (2-D) quantised with one per-tensor ``scale``, and its transpose as a
    row-major copy (``transposed=True``): the layouts ``torch._scaled_mm`` takes.

    One multiply, one clamp and the cast, elementwise: under ``torch.compile`` inductor
    fuses them into a kernel that reads ``x`` once and writes both fp8 copies (the
    transposed one is the same bits, so the backward needs no second read of ``x``).
    """
    q = _cast(x.detach().to(_F32) * scale, name)
    return q.contiguous(), (q.t().contiguous() if transposed else None)


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
    # The fused kernels (mpfunc_torch._src.fp8_fused, which builds on this module).
    from mpfunc_torch._src import fp8_fused

    x2 = _as_2d(x)
    if scale is None:
        if block is None:
            q, _, scale = fp8_fused.cast_current(x2, name, margin, power_of_2_scales, groups,
                                                 False)
        else:
            q, scale = fp8_fused.quantize_blocks(x2, name, block, margin, power_of_2_scales)
        return q.reshape(x.shape), scale
    scale = torch.as_tensor(scale, dtype=_F32, device=x.device)
    want = scale_shape(tuple(x.shape), block)
    if tuple(scale.shape) != want:
        raise ValueError(f"`scale` must have shape {want} for this block, got "
                         f"{tuple(scale.shape)}.")
    if block is None:
        return fp8_fused.cast_given(x2, scale, name)[0].reshape(x.shape), scale
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
