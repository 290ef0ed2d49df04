"""Fused fp8 quantisation in eager mode: one or two kernels per operand, in every recipe.

Three custom ops (``torch.ops.mpfunc.*``) carry the quantisation of `Fp8Linear` and
`quantize_fp8`:

* ``fp8_cast``: one per-tensor scale (given, from an amax, or delayed scaling's from the
  history's amax and the last scale), the cast, the row-major fp8 copy and its
  transpose, and (delayed scaling) the tile amaxes of the same read.
* ``fp8_quantize_blocks``: row or tile scales (rowwise, blockwise) and the cast.
* ``fp8_record_amax``: delayed scaling's history and scale update, in place.

On CUDA each is one Triton kernel (`mpfunc_torch._src.fp8.triton_kernels`), so a tensorwise
operand is two kernels (torch's amax reduction, then the cast), a delayed one three (the
history's max, the cast with the amax, the update) and a rowwise or blockwise one
one. Elsewhere (CPU) each op runs the rule with torch ops (`rule`),
or the Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``). Both give
the rule's bits (`_mpfunc_common.fp8.QUANTIZE_RULE`).

Under ``torch.compile`` the same functions trace the rule as plain torch ops instead,
which inductor fuses with the neighbouring elementwise work (one reduction and one
cast kernel per operand); tensor subclasses (DTensor), empty tensors and float64
inputs also take that path. The ops have fake implementations, so they trace too.
"""

from __future__ import annotations

import functools
import os

import torch

from mpfunc_torch._src.fp8.rule import (
    _DTYPES,
    all_reduce_max,
    block_amax,
    cast_pair,
    quantize_with,
    scale_from_amax,
)

__all__ = ["TILE", "cast_current", "cast_delayed", "cast_given", "fusable", "quantize_blocks",
           "triton_kernels"]

_F32 = torch.float32
_INF = float("inf")
TILE = 64  # fp8_cast's tiles (TILE x TILE): one partial amax each
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _import_kernels():
    try:
        from mpfunc_torch._src.fp8 import triton_kernels
    except ImportError:  # no Triton (CPU wheels of torch, Windows, macOS)
        return None
    return triton_kernels


def triton_kernels(x: torch.Tensor):
    """`triton_kernels` if its kernels run on ``x``'s device (CUDA with Triton installed, or
    CPU under Triton's interpreter), else None."""
    dev = x.device.type
    if dev != "cuda" and not (dev == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    kernels = _import_kernels()
    if kernels is None or (dev == "cpu" and not kernels.INTERPRET):
        return None
    return kernels


def n_tiles(m, n):
    return ((m + TILE - 1) // TILE) * ((n + TILE - 1) // TILE)


# ------------------------------------------------------------------- the custom ops
@torch.library.custom_op("mpfunc::fp8_cast", mutates_args=())
def _fp8_cast(x: torch.Tensor, src: torch.Tensor, prev: torch.Tensor | None, name: str,
              margin: int, pow2: bool, scale_from: int, transposed: bool,
              partials: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    kernels = triton_kernels(x)
    if kernels is not None:
        return kernels.cast_per_tensor(x, src, prev, name, margin, pow2, scale_from,
                                       transposed, partials, TILE)
    if scale_from == 0:
        scale, out_scale = src, src.new_empty((0,))
    else:
        # ``prev`` (the last scale) comes with scale_from 2 (`cast_delayed`).
        fallback = 1.0 if scale_from == 1 or prev is None else torch.where(
            torch.isfinite(prev) & (prev > 0), prev, torch.ones_like(prev))
        scale = out_scale = scale_from_amax(src, name, margin, pow2, fallback)
    q, q_t = cast_pair(x, scale, name, transposed)
    if q_t is not None and q_t.untyped_storage().data_ptr() == q.untyped_storage().data_ptr():
        q_t = q_t.clone()  # a (m, 1) or (1, n) operand: its transpose is a view of q, and
        #                    a custom op's outputs may not alias each other
    parts = (block_amax(x, (TILE, TILE)).reshape(-1) if partials
             else x.new_empty((0,), dtype=_F32))
    return q, (q_t if q_t is not None else q.new_empty((0,))), out_scale, parts


@_fp8_cast.register_fake
def _(x, src, prev, name, margin, pow2, scale_from, transposed, partials):
    m, n = x.shape
    dt = _DTYPES[name]
    return (x.new_empty((m, n), dtype=dt), x.new_empty((n, m) if transposed else (0,), dtype=dt),
            x.new_empty(() if scale_from else (0,), dtype=_F32),
            x.new_empty((n_tiles(m, n),) if partials else (0,), dtype=_F32))


@torch.library.custom_op("mpfunc::fp8_quantize_blocks", mutates_args=())
def _fp8_quantize_blocks(x: torch.Tensor, name: str, rows: int, cols: int, margin: int,
                         pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = triton_kernels(x)
    if kernels is not None:
        return kernels.quantize_blocks(x, name, rows, cols, margin, pow2)
    block = (rows, cols)
    scale = scale_from_amax(block_amax(x, block), name, margin, pow2, 1.0)
    return quantize_with(x, scale, block, name).contiguous(), scale


@_fp8_quantize_blocks.register_fake
def _(x, name, rows, cols, margin, pow2):
    m, k = x.shape
    return (x.new_empty((m, k), dtype=_DTYPES[name]),
            x.new_empty(((m + rows - 1) // rows, (k + cols - 1) // cols), dtype=_F32))


@torch.library.custom_op("mpfunc::fp8_record_amax", mutates_args=("history", "prev_scale"))
def _fp8_record_amax(history: torch.Tensor, prev_scale: torch.Tensor, parts: torch.Tensor,
                     scale: torch.Tensor) -> None:
    kernels = triton_kernels(history)
    if kernels is not None:
        return kernels.record_amax(history, prev_scale, parts, scale)
    amax = parts.max()
    rolled = torch.cat([amax.reshape(1), history[:-1]])
    history.copy_(torch.where(torch.isfinite(amax), rolled, history))
    prev_scale.copy_(scale)


@_fp8_record_amax.register_fake
def _(history, prev_scale, parts, scale):
    return None


# ---------------------------------------------------------------------- the entries
def fusable(*tensors: torch.Tensor) -> bool:
    """True where the custom ops apply: eager mode, plain tensors, a non-empty float
    operand (the first)."""
    x = tensors[0]
    return (not torch.compiler.is_compiling() and all(type(t) in _PLAIN for t in tensors)
            and x.dtype in _FLOATS and x.numel() > 0)


def _nan_to_inf(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax.isnan(), _INF, amax)


def cast_given(x2d, scale, name: str, transposed: bool = False):
    """``x2d`` cast with a given per-tensor ``scale``: ``(q, q_t or None)``."""
    if not fusable(x2d, scale):
        return cast_pair(x2d, scale, name, transposed)
    q, q_t, _, _ = torch.ops.mpfunc.fp8_cast(x2d.detach(), scale, None, name, 0, False, 0,
                                             transposed, False)
    return q, (q_t if transposed else None)


def cast_current(x2d, name: str, margin: int, pow2: bool, groups,
                 transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Current per-tensor scaling: ``(q, q_t or None, scale)``; the amax is one
    reduction, MAX-reduced over ``groups``, and the scale and cast one kernel."""
    if not fusable(x2d):
        amax = all_reduce_max(block_amax(x2d, None), groups)
        scale = scale_from_amax(amax, name, margin, pow2, 1.0)
        return (*cast_pair(x2d, scale, name, transposed), scale)
    x2d = x2d.detach()
    amax = torch.linalg.vector_norm(x2d, _INF, dtype=_F32)  # a NaN stays NaN: no scale
    if groups:
        amax = all_reduce_max(_nan_to_inf(amax), groups)
    q, q_t, scale, _ = torch.ops.mpfunc.fp8_cast(x2d, amax, None, name, margin, pow2, 1,
                                                 transposed, False)
    return q, (q_t if transposed else None), scale


def cast_delayed(x2d, history, prev, recipe, name: str, groups,
                 transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Delayed scaling: the scale from ``history`` and the last scale ``prev`` alone,
    the cast, and this step's amax recorded (``history`` and ``prev`` updated in
    place): ``(q, q_t or None, scale)``."""
    used = history.max() if recipe.amax_reduction == "max" else history[0]
    if not fusable(x2d, history, prev):
        fallback = torch.where(torch.isfinite(prev) & (prev > 0), prev, torch.ones_like(prev))
        scale = scale_from_amax(used, name, recipe.margin, recipe.power_of_2_scales, fallback)
        amax = block_amax(x2d, None)  # independent of the cast: one pass under compile
        full = getattr(amax, "full_tensor", None)
        if full is not None:  # a DTensor operand (tensor parallelism): its
            amax = full()     # amax over the whole tensor, as recorded
        _record(history, prev, all_reduce_max(amax, groups), scale)
        return (*cast_pair(x2d, scale, name, transposed), scale)
    q, q_t, scale, parts = torch.ops.mpfunc.fp8_cast(
        x2d.detach(), used, prev, name, recipe.margin, recipe.power_of_2_scales, 2,
        transposed, True)
    if groups:
        parts = all_reduce_max(parts.max().reshape(1), groups)
    torch.ops.mpfunc.fp8_record_amax(history, prev, parts, scale)
    return q, (q_t if transposed else None), scale


def _record(history, prev, amax, scale) -> None:
    rolled = torch.cat([amax.reshape(1), history[:-1]])
    history.copy_(torch.where(torch.isfinite(amax), rolled, history))
    prev.copy_(scale)


def quantize_blocks(x2d, name: str, block, margin: int,
                    pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Row or tile scales with current scaling: ``(q, scale)``, ``q`` row-major."""
    rows, cols = block
    if rows is None or not fusable(x2d):
        scale = scale_from_amax(block_amax(x2d, block), name, margin, pow2, 1.0)
        return quantize_with(x2d, scale, block, name).contiguous(), scale
    return torch.ops.mpfunc.fp8_quantize_blocks(
        x2d.detach(), name, rows, x2d.shape[-1] if cols is None else cols, margin, pow2)
