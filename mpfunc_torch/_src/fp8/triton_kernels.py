"""Triton kernels of the fp8 quantisation rule (`_mpfunc_common.fp8.QUANTIZE_RULE`).

Imported only where they run: CUDA tensors, or any tensor under Triton's interpreter
(``TRITON_INTERPRET=1`` when this module is first imported; the tests use it on CPU).
`mpfunc_torch._src.fp8.fused` calls them through its custom ops. Three kernels:

* `cast_per_tensor`: one pass over ``x`` (any strides) that computes the scale from a
  per-tensor amax (or takes it), casts, and writes the row-major fp8 copy and, if
  asked, its transpose (the layouts ``torch._scaled_mm`` takes), and, if asked, the
  per-tile amax of ``x`` (delayed scaling's history entry, from the same read).
* `quantize_blocks`: per-row or per-tile scales (rowwise, blockwise): each program
  takes the amax of its rows or tile, its scales, and casts it, in one kernel.
* `record_amax`: delayed scaling's bookkeeping, one program: the tile amaxes reduced,
  the history shifted by one (if the amax is finite) and the scale kept.

The fp8 bits are computed in integer arithmetic (clamp, then round to nearest even by
hand, then the non-finite encodings), not with the hardware's conversion, so they are
the rule's on every GPU and in the interpreter; the divisions are ``div_rn`` (correctly
rounded, as the rule says; Triton's ``/`` is approximate on NVIDIA GPUs) and floating
point contraction is off (``x * scale`` is rounded on its own). The format, margin and
power-of-two choice are run-time arguments, not specialisations: one compiled kernel
per input dtype serves every recipe.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.knobs
import triton.language as tl

from _mpfunc_common.fp8 import FP8_MAX, MAX_SCALE, scale_shape

__all__ = ["INTERPRET", "cast_per_tensor", "quantize_blocks", "record_amax"]

INTERPRET = bool(triton.knobs.runtime.interpret)  # decided when the kernels are defined

# format -> mantissa bits, exponent bias, bits of (NaN, +inf, -inf).
_FORMAT = {"float8_e4m3fn": (3, 7, 0x7F, 0x7F, 0xFF), "float8_e5m2": (2, 15, 0x7E, 0x7C, 0xFC)}
# The format's and the recipe's run-time arguments (never specialised on their values).
_RULE_ARGS = ["FMAX", "MBITS", "BIAS", "NAN", "PINF", "NINF", "MARGIN", "MAX_SCALE", "POW2"]
_OPTIONS = dict(enable_fp_fusion=False)


def _rule_args(name: str, margin: int,
               pow2: bool) -> tuple[float, int, int, int, int, int, float, float, int]:
    mbits, bias, nan, pinf, ninf = _FORMAT[name]
    return (FP8_MAX[name], mbits, bias, nan, pinf, ninf, float(2.0**margin), MAX_SCALE[name],
            int(pow2))


@triton.jit
def _fp8_bits(y, FMAX, MBITS, BIAS, NAN, PINF, NINF):
    """float32 -> the rule's fp8 bits (uint8): finite values saturated to +-FMAX and
    rounded to nearest even, NaN and +-inf encoded as the rule says."""
    c = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    b = c.to(tl.int32, bitcast=True)
    a = b & 0x7FFFFFFF
    e = a >> 23  # the float32 biased exponent
    # fp8 normals: drop 23 - MBITS mantissa bits, to nearest even (a carry moves into
    # the exponent, which is right); then rebias the exponent.
    sh = 23 - MBITS
    r = a + ((1 << (sh - 1)) - 1) + ((a >> sh) & 1)
    normal = (r >> sh) - ((127 - BIAS) << MBITS)
    # fp8 subnormals: |c| = full * 2**(e - 150) in units of the smallest subnormal
    # 2**(1 - BIAS - MBITS), to nearest even (2**MBITS units is the smallest normal,
    # encoded the same way). A shift of 25 or more leaves 0 and rounds down (full <
    # 2**24): float32 subnormals (e = 0) become zeros of their sign.
    full = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    shift = tl.minimum(tl.maximum((151 - BIAS - MBITS) - e, 1), 25)
    sub = full >> shift
    rem = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = sub + ((rem > half) | ((rem == half) & ((sub & 1) == 1))).to(tl.int32)
    mag = tl.where(e > 127 - BIAS, normal, sub)
    bits = mag | ((b >> 24) & 0x80)  # the sign of c (a zero keeps its sign)
    special = tl.where(y != y, NAN, tl.where(y > 0, PINF, NINF))
    return tl.where(tl.abs(y) < float("inf"), bits, special).to(tl.uint8)


@triton.jit
def _scale(amax, fallback, FMAX, MARGIN, MAX_SCALE, POW2):
    """The rule's scale from an amax (a scalar or a vector of them)."""
    ok = (amax == amax) & (amax < float("inf")) & (amax >= 1.1754943508222875e-38)
    s = tl.math.div_rn(tl.zeros_like(amax) + FMAX, tl.where(ok, amax, 1.0))
    s = tl.math.div_rn(s, tl.zeros_like(s) + MARGIN)  # 2**margin: exact (or clamped)
    s = tl.minimum(tl.maximum(s, 1.1754943508222875e-38), MAX_SCALE)
    # power of two: the mantissa cleared, 2**floor(log2(s)), exactly (s is normal)
    p2 = (s.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    s = tl.where(POW2 != 0, p2, s)
    return tl.where(ok, s, fallback)


@triton.jit(do_not_specialize=_RULE_ARGS + ["FROM", "TRANSPOSED", "PARTIALS"])
def _cast_per_tensor_kernel(
        x_ptr, q_ptr, qt_ptr, src_ptr, prev_ptr, scale_ptr, part_ptr, M, N, sxm, sxn,
        FMAX, MBITS, BIAS, NAN, PINF, NINF, MARGIN, MAX_SCALE, POW2, FROM, TRANSPOSED,
        PARTIALS, BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # The scale: FROM 0, src is it; 1, src is the amax (current scaling, fallback 1);
    # 2, src is the history's amax (delayed scaling, fallback the last scale if valid).
    src = tl.load(src_ptr)
    prev = tl.load(prev_ptr)  # (src again unless FROM is 2)
    valid = (FROM == 2) & (prev == prev) & (prev < float("inf")) & (prev > 0)
    s = _scale(src, tl.where(valid, prev, 1.0), FMAX, MARGIN, MAX_SCALE, POW2)
    s = tl.where(FROM == 0, src, s)
    tl.store(scale_ptr, s, mask=(FROM != 0) & (pid_m == 0) & (pid_n == 0))
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0)
    x = x.to(tl.float32)
    bits = _fp8_bits(x * s, FMAX, MBITS, BIAS, NAN, PINF, NINF)
    tl.store(q_ptr + rm[:, None] * N + rn[None, :], bits, mask=mask)
    if TRANSPOSED:
        tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(bits), mask=tl.trans(mask))
    if PARTIALS:
        a = tl.where(x != x, float("inf"), tl.abs(x))
        tl.store(part_ptr + pid_m * tl.num_programs(1) + pid_n, tl.max(tl.max(a, axis=1), axis=0))


def _on(x: torch.Tensor):
    """Launches on ``x``'s GPU (Triton launches on the current device)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def cast_per_tensor(x, src, prev, name: str, margin: int, pow2: bool, scale_from: int,
                    transposed: bool, partials: bool, tile: int):
    """``x`` (2-D) cast with one scale: ``scale_from`` 0 (``src`` is the scale), 1 (``src``
    is the amax; current scaling) or 2 (``src`` is the history's amax and ``prev`` the
    last scale; delayed scaling), in ``tile`` x ``tile`` tiles. Returns ``(q, q_t,
    scale, parts)``: the row-major fp8 copy, its row-major transpose (or an empty
    tensor), the scale used (or an empty one for ``scale_from`` 0) and the tile amaxes
    of ``x`` (or an empty tensor)."""
    m, n = x.shape
    dtype = getattr(torch, name)
    q = torch.empty((m, n), dtype=dtype, device=x.device)
    q_t = torch.empty((n, m) if transposed else (0,), dtype=dtype, device=x.device)
    scale = torch.empty(() if scale_from else (0,), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, tile), triton.cdiv(n, tile))
    parts = torch.empty((grid[0] * grid[1],) if partials else (0,), dtype=torch.float32,  # pyright: ignore[reportCallIssue, reportArgumentType]  # triton.cdiv is typed as returning a constexpr; on the host it is an int
                        device=x.device)
    with _on(x):
        _cast_per_tensor_kernel[grid](
            x, q.view(torch.uint8), q_t.view(torch.uint8), src, src if prev is None else prev,
            scale, parts, m, n, x.stride(0), x.stride(1), *_rule_args(name, margin, pow2),
            scale_from, int(transposed), int(partials), BM=tile, BN=tile, **_OPTIONS)  # pyright: ignore[reportArgumentType]  # triton types tl.constexpr params as constexpr; a launch passes Python values
    return q, q_t, scale, parts


@triton.jit
def _block_tile(x_ptr, M, K, sxm, sxk, r0, c0, r, k, ROWS, COLS, RB: tl.constexpr,
                CHUNK: tl.constexpr):
    """Rows r0 + r + [0, RB) by columns c0 + k + [0, CHUNK) of a ROWS x COLS block:
    (int64 rows, int64 columns, the in-bounds mask, the float32 values)."""
    i = tl.arange(0, RB)
    j = tl.arange(0, CHUNK)
    rows = (r0 + r + i).to(tl.int64)
    cols = (c0 + k + j).to(tl.int64)
    mask = ((r + i < ROWS) & (rows < M))[:, None] & ((k + j < COLS) & (cols < K))[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0)
    return rows, cols, mask, x.to(tl.float32)


@triton.jit(do_not_specialize=_RULE_ARGS)
def _quantize_blocks_kernel(
        x_ptr, q_ptr, s_ptr, M, K, sxm, sxk, ROWS, COLS, NCB,
        FMAX, MBITS, BIAS, NAN, PINF, NINF, MARGIN, MAX_SCALE, POW2,
        TILE_ROWS: tl.constexpr, RB: tl.constexpr, CHUNK: tl.constexpr):
    # A program: one block of ROWS x COLS (TILE_ROWS: one scale for all of it), or RB
    # rows with a scale each by COLS columns; read twice (amax, then the cast) in
    # RB x CHUNK pieces.
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r0 = pid_r * ROWS
    c0 = pid_c * COLS
    amax = tl.zeros([RB], dtype=tl.float32)
    for r in range(0, ROWS, RB):
        for k in range(0, COLS, CHUNK):
            _, _, _, x = _block_tile(x_ptr, M, K, sxm, sxk, r0, c0, r, k, ROWS, COLS, RB, CHUNK)
            amax = tl.maximum(amax, tl.max(tl.where(x != x, float("inf"), tl.abs(x)), axis=1))
    if TILE_ROWS:
        s = _scale(tl.max(amax, axis=0), 1.0, FMAX, MARGIN, MAX_SCALE, POW2)
        tl.store(s_ptr + pid_r * NCB + pid_c, s)
        s = tl.zeros([RB], dtype=tl.float32) + s
    else:
        s = _scale(amax, 1.0, FMAX, MARGIN, MAX_SCALE, POW2)
        rows = (r0 + tl.arange(0, RB)).to(tl.int64)
        tl.store(s_ptr + rows * NCB + pid_c, s, mask=rows < M)
    for r in range(0, ROWS, RB):
        for k in range(0, COLS, CHUNK):
            rows, cols, mask, x = _block_tile(x_ptr, M, K, sxm, sxk, r0, c0, r, k, ROWS, COLS,
                                              RB, CHUNK)
            bits = _fp8_bits(x * s[:, None], FMAX, MBITS, BIAS, NAN, PINF, NINF)
            tl.store(q_ptr + rows[:, None] * K + cols[None, :], bits, mask=mask)


def quantize_blocks(x, name: str, rows: int, cols: int, margin: int, pow2: bool):
    """``x`` (2-D, any strides) quantised in ``rows`` x ``cols`` blocks with current
    scaling (``rows`` 1: a scale per row of each block). Returns the row-major fp8
    tensor and the ``(row blocks, col blocks)`` float32 scales."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=getattr(torch, name), device=x.device)
    s = torch.empty(scale_shape((m, k), (rows, cols)), dtype=torch.float32, device=x.device)
    tile = rows > 1
    # Pieces of about 2048 elements. A row per scale: 8 rows of 256 (enough programs
    # to fill the GPU from 8 rows each), or, reading a transposed view (its rows are
    # columns in memory), 16 by 128 so that each piece's columns are 16 contiguous
    # elements. A shared scale: 32-row pieces of a 128-wide tile.
    row_major = x.stride(1) == 1
    if tile:
        rb, chunk = min(32, triton.next_power_of_2(rows)), 128
    else:
        rb, chunk = (8, 256) if row_major else (16, 128)
    chunk = min(chunk, triton.next_power_of_2(cols))
    grid = (triton.cdiv(m, rows if tile else rb), triton.cdiv(k, cols))
    with _on(x):
        _quantize_blocks_kernel[grid](
            x, q.view(torch.uint8), s, m, k, x.stride(0), x.stride(1), rows if tile else rb,
            cols, grid[1], *_rule_args(name, margin, pow2), TILE_ROWS=tile, RB=rb,  # pyright: ignore[reportArgumentType]  # triton types tl.constexpr params as constexpr; a launch passes Python values
            CHUNK=chunk, **_OPTIONS)
    return q, s


@triton.jit
def _record_amax_kernel(hist_ptr, L, part_ptr, P, scale_ptr, prev_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, P, BLOCK):
        acc = tl.maximum(acc, tl.load(part_ptr + k + i, mask=k + i < P, other=0.0))
    amax = tl.max(acc, axis=0)
    tl.store(prev_ptr, tl.load(scale_ptr))
    if amax < float("inf"):  # only a finite amax is recorded (a NaN became inf)
        # history[1:] = history[:-1], from the end, one chunk at a time: a chunk reads
        # only entries no earlier chunk wrote; the barrier orders its reads before
        # its writes across the program's threads.
        for c in range(0, L - 1, BLOCK):
            idx = L - 1 - c - BLOCK + i
            ok = idx >= 0
            v = tl.load(hist_ptr + idx, mask=ok, other=0.0)
            tl.debug_barrier()
            tl.store(hist_ptr + idx + 1, v, mask=ok)
        tl.store(hist_ptr, amax)


def record_amax(hist, prev, parts, scale) -> None:
    """Delayed scaling's update, in place: ``hist`` (newest first) gets the max of the
    tile amaxes ``parts`` if it is finite; ``prev`` gets ``scale``."""
    with _on(hist):
        _record_amax_kernel[(1,)](hist, hist.numel(), parts, parts.numel(), scale, prev,
                                  BLOCK=1024, **_OPTIONS)  # pyright: ignore[reportArgumentType]  # triton types tl.constexpr params as constexpr; a launch passes Python values
