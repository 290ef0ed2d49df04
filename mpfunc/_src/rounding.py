"""The shared low-precision storage rules in JAX, bit for bit with `_mpfunc_common.rounding`.

Counter-based random bits, bfloat16 rounding (nearest and stochastic), 16-bit remainders,
fp8 stochastic rounding and the 8-bit block state. Every rounding that the rules define
on bit patterns is written here with integer ops on the float32 patterns, never as a
float round trip (``x.astype(bfloat16).astype(float32)``), which a compiler allowed
excess precision may drop; the results are then the NumPy reference's on any backend.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from _mpfunc_common.fp8 import FP8_MAX
from _mpfunc_common.rounding import FP8_MANTISSA_BITS, FP8_MIN_NORMAL, MIX_CONSTANTS
from _mpfunc_common.storage import STATE_BLOCK
from mpfunc._src.fp8.quantize import _cast, scale_from_amax

__all__ = [
    "bf16_from_pattern",
    "dequantize_state_8bit",
    "f32_bits",
    "flat_index",
    "join_remainder",
    "mix32",
    "quantize_state_8bit",
    "random_bits",
    "remainder_against",
    "rne_bf16_pattern",
    "split_remainder",
    "sr_bf16_pattern",
    "sr_fp8",
]

_U32, _F32 = jnp.uint32, jnp.float32
_HI16 = 0xFFFF0000


def _u32(v: int) -> jax.Array:
    return jnp.asarray(v & 0xFFFFFFFF, _U32)


def mix32(x: jax.Array) -> jax.Array:
    """lowbias32 on uint32 (wrapping multiplies), as `_mpfunc_common.rounding.mix32`."""
    a, b = MIX_CONSTANTS
    x = x ^ (x >> 16)
    x = x * _u32(a)
    x = x ^ (x >> 15)
    x = x * _u32(b)
    return x ^ (x >> 16)


def flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position in an array of ``shape`` (uint32).

    Built from one iota per dimension in ``shape`` itself (no reshape of a 1-D iota), so
    under ``jit`` with a sharded leaf each shard computes its own global positions.

    Raises:
      ValueError: a leaf of 2**32 elements or more (its index needs 64 bits).
    """
    size = math.prod(shape)
    if size >= 2**32:
        raise ValueError(f"a leaf of shape {shape} has {size} >= 2**32 elements: its "
                         "random bits need a 64-bit element index; split the leaf.")
    idx = jnp.zeros(shape, _U32)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        idx = idx + jax.lax.broadcasted_iota(_U32, shape, d) * _u32(stride)
        stride *= shape[d]
    return idx


def random_bits(seed: jax.Array, stream: int, step: jax.Array,
                shape: tuple[int, ...]) -> jax.Array:
    """32 random bits per element (uint32), equal to
    ``_mpfunc_common.rounding.random_bits(seed, stream, step, flat index)``."""
    k = mix32(jnp.asarray(seed).astype(_U32))
    k = mix32(k ^ _u32(stream))
    k = mix32(k ^ jnp.asarray(step).astype(_U32))
    return mix32(mix32(flat_index(shape) ^ k))  # the index's high 32 bits are 0


def f32_bits(x: jax.Array) -> jax.Array:
    """The bit patterns of float32 values (uint32)."""
    return jax.lax.bitcast_convert_type(x, _U32)


def _f32(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, _F32)


def _nan_pattern(b: jax.Array) -> jax.Array:
    return (b | _u32(0x00400000)) & _u32(_HI16)


def rne_bf16_pattern(x: jax.Array) -> jax.Array:
    """float32 -> the float32 pattern of its bfloat16 rounding (nearest, ties to even)."""
    b = f32_bits(x)
    out = (b + _u32(0x7FFF) + ((b >> 16) & _u32(1))) & _u32(_HI16)
    return jnp.where(jnp.isnan(x), _nan_pattern(b), out)


def sr_bf16_pattern(x: jax.Array, rand: jax.Array) -> jax.Array:
    """float32 -> the pattern of its stochastic bfloat16 rounding with ``rand`` (uint32)."""
    b = f32_bits(x)
    out = (b + (rand & _u32(0xFFFF))) & _u32(_HI16)
    return jnp.where(jnp.isnan(x), _nan_pattern(b), out)


def bf16_from_pattern(bits: jax.Array) -> jax.Array:
    """bfloat16 values from float32 patterns whose low 16 bits are zero."""
    return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)


def _bf16_pattern(p: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(p, jnp.uint16).astype(_U32) << 16


def split_remainder(master: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 -> (pattern of ``hi``: nearest, ties away from zero; int16 ``lo``)."""
    b = f32_bits(master)
    hi = ((b + _u32(0x8000)) >> 16) << 16
    lo = jax.lax.bitcast_convert_type(b - hi, jnp.int32).astype(jnp.int16)
    return hi, lo


def join_remainder(p: jax.Array, lo: jax.Array) -> jax.Array:
    """(bfloat16 param, int16 remainder) -> the float32 master, bit for bit."""
    lo32 = jax.lax.bitcast_convert_type(lo.astype(jnp.int32), _U32)
    return _f32(_bf16_pattern(p) + lo32)


def remainder_against(master: jax.Array, p_bits: jax.Array) -> jax.Array:
    """The int16 remainder of ``master`` beside a param given by its float32 pattern
    ``p_bits``: exact where it fits, else saturated to the closest join
    (`_mpfunc_common.rounding.remainder_against`)."""
    b = f32_bits(master)
    mask = _u32(0x7FFFFFFF)
    mag_m = jax.lax.bitcast_convert_type(b & mask, jnp.int32)
    mag_p = jax.lax.bitcast_convert_type(p_bits & mask, jnp.int32)
    same = (b >> 31) == (p_bits >> 31)
    low = jnp.where(mag_p == 0, jnp.int32(0), jnp.int32(-32768))
    diff = jnp.where(same, mag_m - mag_p, jnp.int32(-(2**31)))
    return jnp.clip(diff, low, jnp.int32(32767)).astype(jnp.int16)


def sr_fp8(y: jax.Array, rand: jax.Array, name: str) -> jax.Array:
    """float32 (finite ones within +-fp8 max) -> the fp8 grid, stochastically, as float32
    (`_mpfunc_common.rounding.stochastic_round_fp8`)."""
    d = 23 - FP8_MANTISSA_BITS[name]
    n = jnp.asarray(FP8_MIN_NORMAL[name], _F32)
    a = jnp.abs(y)
    small = a < n
    z = jnp.where(small, a + n, a)
    zb = (f32_bits(z) + (rand & _u32((1 << d) - 1))) & _u32(0xFFFFFFFF & ~((1 << d) - 1))
    q = _f32(zb) - jnp.where(small, n, jnp.zeros((), _F32))
    return jnp.where(jnp.isfinite(y), jnp.copysign(q, y), y)


def _blocks(x: jax.Array) -> jax.Array:
    """A leaf flattened row-major, zero-padded into (blocks, STATE_BLOCK)."""
    flat = x.reshape(-1)
    nb = -(-flat.size // STATE_BLOCK)
    if nb * STATE_BLOCK != flat.size:
        flat = jnp.pad(flat, (0, nb * STATE_BLOCK - flat.size))
    return flat.reshape(nb, STATE_BLOCK)


def _unblock(t: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return t.reshape(-1)[:math.prod(shape)].reshape(shape)


def quantize_state_8bit(x: jax.Array, name: str, rand: jax.Array | None = None):
    """A float32 state leaf -> (fp8 codes, shape of ``x``; float32 scales per block).

    `_mpfunc_common.rounding.quantize_state_8bit`: the blockwise fp8 rule (fp8/quantize.py's
    amax and scale) on the flattened leaf in blocks of `STATE_BLOCK`, rounded to
    nearest (``rand`` None) or stochastically with ``rand`` (uint32, shape of ``x``).
    """
    t = _blocks(x.astype(_F32))
    a = jnp.abs(t)
    amax = jnp.max(jnp.where(jnp.isnan(a), jnp.asarray(jnp.inf, _F32), a), axis=1)
    scale = scale_from_amax(amax, name, 0, False, 1.0)
    y = _unblock(t * scale[:, None], x.shape)
    if rand is not None:
        m = jnp.asarray(FP8_MAX[name], _F32)
        y = sr_fp8(jnp.where(jnp.isfinite(y), jnp.clip(y, -m, m), y), rand, name)
    return _cast(y, name), scale


def dequantize_state_8bit(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """``float32(codes) * (1 / scale)`` per block: the float32 state leaf."""
    inv = jnp.asarray(1, _F32) / scale
    return _unblock(_blocks(codes.astype(_F32)) * inv[:, None], codes.shape)
