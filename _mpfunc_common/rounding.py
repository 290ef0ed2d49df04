"""Bit-level rules for low-precision storage without float32 masters, shared by both sides.

`mpfunc` (JAX) and `mpfunc_torch` (PyTorch) implement exactly the rules written here, so
the same float32 values, seed and step give the same bfloat16 bits in both frameworks.
This module is the NumPy reference the two implementations are tested against; no
framework is imported.

* **Random bits** for stochastic rounding come from a counter-based hash of
  ``(seed, stream, step, element index)``: no generator state, so a resumed run, a
  sharded parameter and the other framework draw the same bits. ``stream`` separates the
  parameters (stream 0) from the optimizer-state leaves (streams 1, 2, ...), so that a
  parameter and its moments never share their bits. The index is the element's position
  in the whole (unsharded) leaf, in row-major order.
* **Stochastic rounding** float32 -> bfloat16 adds the low 16 random bits to the float32
  bit pattern and truncates the low 16 bits (so a value rounds up with probability equal
  to its distance from the bfloat16 below, in units of the gap): unbiased. NaN stays NaN;
  a value already a bfloat16 is unchanged; infinities stay.
* **Remainders**: a float32 master is split into a bfloat16 ``hi`` (the master rounded to
  nearest, ties away from zero: see `split_remainder`) and a signed 16-bit remainder
  ``lo`` with ``bits(master) == (bits(hi) << 16) + lo``, so ``join_remainder(hi, lo)``
  gives the master back bit for bit.
* **Kahan** compensated updates keep a bfloat16 compensation ``c`` beside the bfloat16
  param ``p``: see `kahan_update`.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "MIX_CONSTANTS",
    "mix32",
    "step_key",
    "random_bits",
    "stochastic_round_bf16",
    "round_nearest_bf16",
    "split_remainder",
    "join_remainder",
    "kahan_update",
    "f32_bits",
    "bits_f32",
]

# lowbias32 (C. Wellons' hash prospector): x ^= x >> 16; x *= A; x ^= x >> 15; x *= B;
# x ^= x >> 16, all modulo 2**32. A bijection of uint32 with good avalanche.
MIX_CONSTANTS = (0x7FEB352D, 0x846CA68B)
_MASK32 = np.uint64(0xFFFFFFFF)


def _u32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.uint64) & _MASK32


def mix32(x) -> np.ndarray:
    """lowbias32 over uint32 values (as uint64 arrays holding 32-bit values)."""
    a, b = (np.uint64(c) for c in MIX_CONSTANTS)
    x = _u32(x)
    x = x ^ (x >> np.uint64(16))
    x = (x * a) & _MASK32
    x = x ^ (x >> np.uint64(15))
    x = (x * b) & _MASK32
    x = x ^ (x >> np.uint64(16))
    return x


def step_key(seed: int, stream: int, step: int) -> int:
    """The 32-bit key of one (seed, stream, step): ``mix32(mix32(mix32(seed) ^ stream) ^ step)``.

    ``seed``, ``stream`` and ``step`` are taken modulo 2**32.
    """
    k = mix32(np.uint64(seed & 0xFFFFFFFF))
    k = mix32(k ^ np.uint64(stream & 0xFFFFFFFF))
    k = mix32(k ^ np.uint64(step & 0xFFFFFFFF))
    return int(k)


def random_bits(seed: int, stream: int, step: int, index) -> np.ndarray:
    """32 random bits per element index: ``mix32(mix32(index_lo ^ key) ^ index_hi)``.

    ``index`` is the element's row-major position in the whole leaf (int64 >= 0);
    ``index_lo`` / ``index_hi`` are its low and high 32 bits. Returns uint32.
    """
    index = np.asarray(index, dtype=np.uint64)
    lo = index & _MASK32
    hi = index >> np.uint64(32)
    key = np.uint64(step_key(seed, stream, step))
    return mix32(mix32(lo ^ key) ^ hi).astype(np.uint32)


def f32_bits(x) -> np.ndarray:
    """The bit pattern of float32 values, as uint32."""
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)


def bits_f32(b) -> np.ndarray:
    """Float32 values from their bit patterns (uint32)."""
    return np.ascontiguousarray(np.asarray(b, dtype=np.uint32)).view(np.float32)


def _bf16_from_upper(bits32: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) from float32 patterns whose low 16 bits are zero."""
    return (bits32 >> np.uint32(16)).astype(np.uint16)


def stochastic_round_bf16(x, rand) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding stochastically.

    ``bits = (bits(x) + (rand & 0xFFFF)) & 0xFFFF0000`` with 32-bit wrap-around, except
    that NaN keeps its NaN pattern rounded to nearest (quiet, sign kept).
    """
    b = f32_bits(x).astype(np.uint64)
    r = np.asarray(rand, dtype=np.uint64) & np.uint64(0xFFFF)
    out = ((b + r) & np.uint64(0xFFFF0000)).astype(np.uint32)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    out = np.where(nan, (f32_bits(x) | np.uint32(0x00400000)) & np.uint32(0xFFFF0000), out)
    return _bf16_from_upper(out.astype(np.uint32))


def round_nearest_bf16(x) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest, ties to even.

    What ``x.astype(bfloat16)`` does in both frameworks; written here as the reference.
    """
    b = f32_bits(x).astype(np.uint64)
    lsb = (b >> np.uint64(16)) & np.uint64(1)
    out = ((b + np.uint64(0x7FFF) + lsb) & np.uint64(0xFFFF0000)).astype(np.uint32)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    out = np.where(nan, (f32_bits(x) | np.uint32(0x00400000)) & np.uint32(0xFFFF0000), out)
    return _bf16_from_upper(out.astype(np.uint32))


def split_remainder(master) -> tuple[np.ndarray, np.ndarray]:
    """A float32 master -> (bfloat16 ``hi`` bits as uint16, int16 remainder ``lo``).

    ``hi`` is the master rounded to nearest with ties *away from zero* (in magnitude:
    the bit pattern is sign-magnitude): ``hi = (bits + 0x8000) >> 16``. Then
    ``lo = bits - (hi << 16)`` lies in ``[-32768, 32767]`` and fits an int16 exactly. Ties
    to even cannot be kept: for an odd ``hi`` the tie's remainder would be ``+32768``.
    Only masters exactly halfway between two bfloat16 values round differently from
    ``astype(bfloat16)`` (ties to even). NaN masters are not representable this way
    (rejected by the callers' finite checks); infinities split to (inf, 0).
    """
    b = f32_bits(master).astype(np.int64)
    hi = (b + 0x8000) >> 16
    lo = b - (hi << 16)
    return hi.astype(np.uint16), lo.astype(np.int16)


def join_remainder(hi, lo) -> np.ndarray:
    """(bfloat16 bits as uint16, int16 remainder) -> the float32 master, bit for bit."""
    hi = np.asarray(hi, dtype=np.uint16).astype(np.int64)
    lo = np.asarray(lo, dtype=np.int16).astype(np.int64)
    return bits_f32(((hi << 16) + lo) & 0xFFFFFFFF)


def _bf16_value(bits16: np.ndarray) -> np.ndarray:
    return bits_f32(np.asarray(bits16, dtype=np.uint32) << np.uint32(16))


def kahan_update(param_bits, comp_bits, update) -> tuple[np.ndarray, np.ndarray]:
    """One Kahan-compensated step of a bfloat16 param (bits) by a float32 ``update``.

    In float32: ``y = update + c``; ``t = p + y``; ``p' = bf16(t)`` (nearest, ties to
    even); ``c' = bf16(y - (p' - p))`` (nearest). ``p`` and ``c`` are read exactly from
    their bfloat16 bits. ``p' - p`` is exact in float32 (two bfloat16 values whose
    exponents differ by at most 16), so ``c'`` holds what the rounding of ``p'`` lost,
    to bfloat16 precision. Returns the new (param,
    compensation) bits as uint16.
    """
    p = _bf16_value(param_bits)
    c = _bf16_value(comp_bits)
    y = (np.asarray(update, dtype=np.float32) + c).astype(np.float32)
    t = (p + y).astype(np.float32)
    p_new = round_nearest_bf16(t)
    delta = (_bf16_value(p_new) - p).astype(np.float32)
    c_new = round_nearest_bf16((y - delta).astype(np.float32))
    return p_new, c_new
