"""The fp8 quantisation rule (`_mpfunc_common.fp8.QUANTIZE_RULE`) with plain torch ops.

The amaxes, the scales and the saturating cast, bit for bit with JAX's
(``mpfunc/_src/fp8/quantize.py``). They are the reference the fused kernels
(``fused``) match, the path they take under ``torch.compile`` and on CPU, and what
`quantize_fp8` (``quantize``) and the fp8 linear build on.
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
)

__all__ = ["all_reduce_max", "block_amax", "cast_pair", "quantize_with", "scale_from_amax"]

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
