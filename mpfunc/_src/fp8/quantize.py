"""fp8 quantisation for JAX: the rule in `_mpfunc_common.fp8`, bit for bit with torch's.

`quantize_fp8` / `dequantize_fp8` follow ``_mpfunc_common.fp8.QUANTIZE_RULE`` exactly, so
they give the same bits as ``mpfunc_torch``'s (``mpfunc_torch/_src/fp8/quantize.py``).
`mpfunc._src.fp8.matmul` builds the fp8 dot and delayed scaling on the helpers here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from _mpfunc_common.fp8 import (
    FLOAT32_MIN_NORMAL,
    FP8_MAX,
    MAX_SCALE,
    MIN_SCALE,
    check_block,
    scale_shape,
)
from mpfunc._src.distributed import _varying_axes, unbound_axis_error

__all__ = ["AxisName", "block_amax", "dequantize_fp8", "pmax_over", "quantize_fp8",
           "quantize_with", "scale_from_amax"]

_DTYPES = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}
_F32 = jnp.float32
AxisName = Hashable | Sequence[Hashable] | None


def _fp8_name(dtype: Any):
    if isinstance(dtype, str):
        name = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}.get(dtype, dtype)
    else:
        try:
            name = jnp.dtype(dtype).name
        except TypeError:
            name = None
    if name not in _DTYPES:
        raise ValueError(f"`dtype` must be float8_e4m3fn or float8_e5m2, got {dtype!r}.")
    return name


def pmax_over(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """MAX over ``axis_name``, over the axes ``x`` varies on (all of them without vma)."""
    if axis_name is None:
        return x
    axes = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    varying = _varying_axes(x)
    if varying:
        axes = tuple(a for a in axes if a in varying)
        return jax.lax.pmax(x, axes) if axes else x
    try:
        return jax.lax.pmax(x, axes)
    except ValueError:  # typed invariant over every axis: the same on all shards already
        return x
    except NameError as e:
        raise unbound_axis_error(axis_name, e) from None


def _tiled(x2d: jax.Array, block) -> tuple[jax.Array, tuple[int, int, int, int]]:
    """(R, C) -> (nR, br, nC, bc), zero-padded; zeros never change an amax."""
    r, c = x2d.shape
    br = r if block[0] is None else block[0]
    bc = c if block[1] is None else block[1]
    nr, nc = -(-r // br), -(-c // bc)
    if (nr * br, nc * bc) != (r, c):
        x2d = jnp.pad(x2d, ((0, nr * br - r), (0, nc * bc - c)))
    return x2d.reshape(nr, br, nc, bc), (r, c, br, bc)


def _untiled(t: jax.Array, info) -> jax.Array:
    r, c, _, _ = info
    nr, br, nc, bc = t.shape
    return t.reshape(nr * br, nc * bc)[:r, :c]


def _as_2d(x: jax.Array) -> jax.Array:
    return x.reshape(1, -1) if x.ndim < 2 else x.reshape(-1, x.shape[-1])


def block_amax(x: jax.Array, block) -> jax.Array:
    """max |x| per block (float32), a NaN counting as +inf.

    NaN is mapped to inf first because XLA's CPU reduction (the YNNPACK fusion) does not
    propagate NaN through ``max``; XLA fuses it into the reduction (one pass over x).
    """
    a = jnp.abs(x.astype(_F32))
    a = jnp.where(jnp.isnan(a), jnp.asarray(jnp.inf, _F32), a)
    if block is None:
        return jnp.max(a)
    t, _ = _tiled(_as_2d(a), block)
    return jnp.max(t, axis=(1, 3))


def scale_from_amax(amax: jax.Array, name: str, margin: int, power_of_2: bool, fallback):
    """The rule's scale of an fp8 format ``name`` from a block amax (scalar work)."""
    s = jnp.asarray(FP8_MAX[name], _F32) / amax
    if margin:
        s = s / jnp.asarray(2.0**margin, _F32)
    s = jnp.clip(s, jnp.asarray(MIN_SCALE, _F32), jnp.asarray(MAX_SCALE[name], _F32))
    if power_of_2:  # clear the mantissa: 2**floor(log2(s)), exactly (s is normal)
        bits = jax.lax.bitcast_convert_type(s, jnp.uint32) & jnp.uint32(0xFF800000)
        s = jax.lax.bitcast_convert_type(bits, _F32)
    ok = jnp.isfinite(amax) & (amax >= jnp.asarray(FLOAT32_MIN_NORMAL, _F32))
    return jnp.where(ok, s, jnp.asarray(fallback, _F32))


def _cast(y: jax.Array, name: str) -> jax.Array:
    m = jnp.asarray(FP8_MAX[name], _F32)
    nan = jnp.asarray(jnp.nan, _F32)  # any NaN -> the positive quiet NaN
    y = jnp.where(jnp.isfinite(y), jnp.clip(y, -m, m), jnp.where(jnp.isnan(y), nan, y))
    return y.astype(_DTYPES[name])


def quantize_with(x: jax.Array, scale: jax.Array, block, name: str) -> jax.Array:
    """``x`` quantised with given scales: one elementwise pass (XLA fuses it)."""
    x = x.astype(_F32)
    if block is None:
        return _cast(x * scale, name)
    t, info = _tiled(_as_2d(x), block)
    q = _cast(t * scale[:, None, :, None], name)
    return _untiled(q, info).reshape(x.shape)


def quantize_fp8(
    x: jax.Array,
    dtype: Any = "float8_e4m3fn",
    block: tuple[int | None, int | None] | None = None,
    *,
    margin: int = 0,
    power_of_2_scales: bool = False,
    axis_name: AxisName = None,
    scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Quantises ``x`` to fp8 with current scaling; bit-identical to ``mpfunc_torch``.

    The rule (shared with torch, word for word):

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
      x: a floating array; with a ``block`` its leading dims are flattened (the last dim
        is the contraction dim).
      dtype: ``"float8_e4m3fn"`` (``"e4m3"``) or ``"float8_e5m2"`` (``"e5m2"``), or the
        jnp dtype.
      block: None (one scale for the whole tensor) or ``(rows, cols)`` tiles, None
        meaning the whole dimension (``(1, None)``: one scale per row).
      margin: scales are divided by ``2**margin``.
      power_of_2_scales: round scales down to powers of two.
      axis_name: mesh axes to MAX-reduce the amax over (per-tensor scales only).
      scale: use these float32 scales (e.g. delayed scaling's) instead of computing
        them; values beyond the range then saturate.

    Returns:
      ``(q, scale)``: the fp8 array (shape of ``x``) and the float32 scales, shape ``()``
      or ``(row tiles, col tiles)``; ``x ~= q * (1 / scale)``.

    Examples:
      >>> import jax.numpy as jnp, mpfunc
      >>> q, s = mpfunc.quantize_fp8(jnp.array([1.0, -2.0, 4.0]), "e4m3")
      >>> q.dtype, float(s), mpfunc.dequantize_fp8(q, s).tolist()
      (dtype(float8_e4m3fn), 112.0, [1.0, -2.0, 4.0])
    """
    name = _fp8_name(dtype)
    block = check_block(block)
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"`x` must be a floating array, got {jnp.result_type(x)}.")
    if block is not None and axis_name is not None:
        raise ValueError("`axis_name` applies to per-tensor scales only (`block=None`); "
                         "row and tile scales are local to the rows they scale.")
    if scale is None:
        amax = pmax_over(block_amax(x, block), axis_name)
        scale = scale_from_amax(amax, name, margin, power_of_2_scales, 1.0)
    else:
        scale = jnp.asarray(scale, _F32)
        want = scale_shape(x.shape, block)
        if scale.shape != want:
            raise ValueError(f"`scale` must have shape {want} for this block, got {scale.shape}.")
    return quantize_with(x, scale, block, name), scale


def dequantize_fp8(q: jax.Array, scale: jax.Array, block=None, dtype: Any = _F32) -> jax.Array:
    """``float32(q) * (1 / scale)`` per block (the reciprocal rounded to float32), cast to
    ``dtype``; the inverse of `quantize_fp8` up to fp8 rounding."""
    if jnp.result_type(q) not in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        raise TypeError("`q` must be an fp8 array (float8_e4m3fn or float8_e5m2, from "
                        f"quantize_fp8), got {jnp.result_type(q)}.")
    block = check_block(block)
    inv = jnp.asarray(1, _F32) / scale
    v = q.astype(_F32)
    if block is None:
        out = v * inv
    else:
        t, info = _tiled(_as_2d(v), block)
        out = _untiled(t * inv[:, None, :, None], info).reshape(q.shape)
    return out.astype(dtype)
