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
  in the whole (unsharded) leaf, in row-major order. ``step`` counts the optimizer's
  applied (not skipped) steps from 0, modulo 2**32.

  Every parameter leaf draws from stream 0: the leaves' order differs between the
  frameworks (a JAX pytree sorts dict keys, torch lists parameters as registered), and a
  leaf's shape and its element index are all both sides agree on. So two leaves round
  their elements at one index with the same bits in one step (their rounding errors are
  correlated across leaves, not biased). State leaf ``k`` (0-based, in the framework's
  own order of the stored floating state leaves) draws from stream ``1 + k``; the state's
  bits are not promised to agree across frameworks.
* **Stochastic rounding** float32 -> bfloat16 adds the low 16 random bits to the float32
  bit pattern and truncates the low 16 bits (so a value rounds up with probability equal
  to its distance from the bfloat16 below, in units of the gap): unbiased. NaN stays NaN;
  a value already a bfloat16 is unchanged; infinities stay.
* **Remainders**: a float32 master is split into a bfloat16 ``hi`` (the master rounded to
  nearest, ties away from zero: see `split_remainder`) and a signed 16-bit remainder
  ``lo`` with ``bits(master) == (bits(hi) << 16) + lo``, so ``join_remainder(hi, lo)``
  gives the master back bit for bit.
* **Kahan** compensated updates keep a bfloat16 compensation ``c`` beside the bfloat16
  param ``p``: see `kahan_update`. From a float32 master (a checkpoint's conversion),
  ``p`` is the master rounded to nearest and ``c`` the residual, rounded to nearest
  (`kahan_from_master`); back, the master is ``p + c`` in float32 (`kahan_master`).
* **Conversions** (``convert_checkpoint``) between a float32 master and a storage use
  `split_remainder` / `join_remainder`, `kahan_from_master` / `kahan_master`, and for
  ``"stochastic"`` the master rounded to nearest (`round_nearest_bf16`; back: the
  param's value). State moving below float32 is rounded to nearest (one rounding: half
  the error bound of a stochastic one, and the same bits in both frameworks).
* **8-bit state** (`quantize_state_8bit`): the blockwise fp8 rule of
  `_mpfunc_common.fp8.QUANTIZE_RULE` on the flattened leaf in blocks of 128, rounded to
  nearest or stochastically (`stochastic_round_fp8`).
"""

from __future__ import annotations

import numpy as np

from _mpfunc_common.fp8 import FLOAT32_MIN_NORMAL, FP8_MAX, MAX_SCALE, MIN_SCALE
from _mpfunc_common.storage import STATE_BLOCK

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
    "kahan_from_master",
    "kahan_master",
    "remainder_against",
    "stochastic_round_fp8",
    "round_nearest_fp8",
    "quantize_state_8bit",
    "dequantize_state_8bit",
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

    What ``x.astype(bfloat16)`` does in both frameworks on every non-NaN value; written
    here as the reference. A NaN becomes a quiet NaN with its sign and top payload bits
    (as in `stochastic_round_bf16`; `mpfunc._src.rounding.rne_bf16_pattern` does the
    same). The frameworks' own casts keep a NaN a NaN but not its bits (measured on CPU,
    torch 2.13 and jax 0.10.2): torch's ``.to(torch.bfloat16)`` gives ``0xFFFF`` for every
    NaN; JAX's ``astype`` gives ``0x7FC0`` / ``0xFFC0`` (sign kept, payload dropped).
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


def kahan_update(param_bits, comp_bits, update, dtype: str = "bfloat16"):
    """One Kahan-compensated step of a half param (bits) by a float32 ``update``.

    In float32: ``y = update + c``; ``t = p + y``; ``p' = half(t)`` (nearest, ties to
    even); ``c' = half(y - (p' - p))`` (nearest). ``p`` and ``c`` are read exactly from
    their bits. ``p' - p`` is exact in float32 whenever the two exponents differ by at
    most 16 (a step below 2**16 times the param); beyond that it rounds at float32
    precision of the larger, far below the param's own rounding. So ``c'`` holds what
    the rounding of ``p'`` lost, to half precision. ``dtype`` is ``"bfloat16"`` or
    ``"float16"`` (the param's and the compensation's). Returns the new (param,
    compensation) bits as uint16.
    """
    if dtype == "bfloat16":
        value, rne = _bf16_value, round_nearest_bf16
    else:
        value = lambda b: np.asarray(b, np.uint16).view(np.float16).astype(np.float32)  # noqa: E731
        rne = lambda x: np.asarray(x, np.float32).astype(np.float16).view(np.uint16)  # noqa: E731
    p = value(param_bits)
    c = value(comp_bits)
    y = (np.asarray(update, dtype=np.float32) + c).astype(np.float32)
    t = (p + y).astype(np.float32)
    p_new = rne(t)
    delta = (value(p_new) - p).astype(np.float32)
    c_new = rne((y - delta).astype(np.float32))
    return p_new, c_new


def kahan_from_master(master, dtype: str = "bfloat16") -> tuple[np.ndarray, np.ndarray]:
    """A float32 master -> Kahan's (param bits, compensation bits) as uint16.

    ``p = half(master)`` (nearest, ties to even) and ``c = half(master - p)`` (the
    residual, exact in float32, rounded to nearest): ``p + c`` is the master to within
    half an ulp of ``c``, and ``c`` is zero only where the master is a half value.
    """
    m = np.asarray(master, dtype=np.float32)
    if dtype == "bfloat16":
        p = round_nearest_bf16(m)
        residual = (m - _bf16_value(p)).astype(np.float32)
        return p, round_nearest_bf16(residual)
    p16 = m.astype(np.float16)
    residual = (m - p16.astype(np.float32)).astype(np.float32)
    return p16.view(np.uint16), residual.astype(np.float16).view(np.uint16)


def kahan_master(param_bits, comp_bits, dtype: str = "bfloat16") -> np.ndarray:
    """Kahan's (param, compensation) bits -> the float32 value they stand for: ``p + c``
    (one float32 add, as the step reads them)."""
    if dtype == "bfloat16":
        p, c = _bf16_value(param_bits), _bf16_value(comp_bits)
    else:
        p = np.asarray(param_bits, np.uint16).view(np.float16).astype(np.float32)
        c = np.asarray(comp_bits, np.uint16).view(np.float16).astype(np.float32)
    return (p + c).astype(np.float32)


def remainder_against(master, param_bits) -> np.ndarray:
    """The int16 remainder of a float32 ``master`` beside a given bfloat16 param.

    Where the param is the master's `split_remainder` ``hi`` this is its ``lo``. Where
    it is not (JAX applies updates with ``optax.apply_updates``, which cannot always
    land a param on ``hi``: a step larger than the param's new magnitude), the
    remainder is the one whose `join_remainder` is closest to the master: in
    magnitude space ``clip(|m| - |p|, low, 32767)`` with ``low = -32768``
    (``0`` for a zero param), and ``low`` when the signs differ. So it is exact
    whenever the master lies within half a bfloat16 spacing of the param, and
    saturates otherwise.
    """
    m = f32_bits(master).astype(np.int64)
    p = np.asarray(param_bits, dtype=np.uint16).astype(np.int64) << 16
    mag_m, mag_p = m & 0x7FFFFFFF, p & 0x7FFFFFFF
    low = np.where(mag_p == 0, 0, -32768)
    diff = np.where((m >> 31) == (p >> 31), mag_m - mag_p, -(2**40))
    return np.clip(diff, low, 32767).astype(np.int16)


# fp8 formats: mantissa bits and the smallest normal (the OCP 8-bit spec).
FP8_MANTISSA_BITS = {"float8_e4m3fn": 3, "float8_e5m2": 2}
FP8_MIN_NORMAL = {"float8_e4m3fn": 2.0**-6, "float8_e5m2": 2.0**-14}


def stochastic_round_fp8(y, rand, fmt: str) -> np.ndarray:
    """float32 values (scaled, finite ones within +-fp8 max) -> the fp8 grid, stochastically.

    The bfloat16 rule with ``d = 23 - mantissa bits`` dropped bits (20 for e4m3fn, 21
    for e5m2): ``bits = (bits(|y|) + (rand & (2**d - 1))) & ~(2**d - 1)``. Below the
    smallest normal ``n`` the grid is the subnormals' (spacing ``n * 2**-mbits``, the
    same as the binade above it), so there ``|y| + n`` (a float32 add) is rounded by
    that rule and ``n`` subtracted again (exact). That add rounds ``|y|`` to float32's
    spacing at ``n`` (``n * 2**-23``): the rounding is unbiased to within ``2**-21``
    (e4m3fn) of one grid step there. Sign kept (``-0.0`` stays ``-0.0``), non-finite
    values pass through. Returns float32 values on the grid (an exact fp8 cast away).
    """
    y = np.asarray(y, dtype=np.float32)
    d = 23 - FP8_MANTISSA_BITS[fmt]
    n = np.float32(FP8_MIN_NORMAL[fmt])
    a = np.abs(y)
    small = a < n
    with np.errstate(invalid="ignore", over="ignore"):
        z = np.where(small, a + n, a).astype(np.float32)
        r = np.asarray(rand, dtype=np.uint64) & np.uint64((1 << d) - 1)
        zb = (f32_bits(z).astype(np.uint64) + r) & np.uint64(0xFFFFFFFF & ~((1 << d) - 1))
        q = (bits_f32(zb.astype(np.uint32)) - np.where(small, n, np.float32(0))).astype(np.float32)
    return np.where(np.isfinite(y), np.copysign(q, y), y).astype(np.float32)


def round_nearest_fp8(y, fmt: str) -> np.ndarray:
    """float32 values (finite ones within +-fp8 max) -> the fp8 grid, nearest, ties to even.

    What the frameworks' fp8 casts do (XLA and torch), written exactly in float64.
    """
    y = np.asarray(y, dtype=np.float32)
    mbits = FP8_MANTISSA_BITS[fmt]
    emin = int(np.log2(FP8_MIN_NORMAL[fmt]))
    a = np.abs(y).astype(np.float64)
    with np.errstate(invalid="ignore"):
        _, e = np.frexp(np.where(np.isfinite(a), a, 1.0))
        g = np.ldexp(1.0, np.maximum(e - 1, emin) - mbits)
        q = np.round(a / g) * g
    return np.where(np.isfinite(y), np.copysign(q, y), y).astype(np.float32)


def quantize_state_8bit(x, fmt: str, rand=None) -> tuple[np.ndarray, np.ndarray]:
    """A state leaf -> (fp8 values as float32, shape of ``x``; float32 scales per block).

    `_mpfunc_common.fp8.QUANTIZE_RULE` (margin 0, no power-of-2 scales, fallback 1.0) on
    the leaf flattened row-major into one row of 1 x `STATE_BLOCK` tiles (the last one
    zero-padded): ``amax`` per block (NaN counts as inf), ``scale = fp8_max / amax``
    clipped to ``[2**-126, max_scale]``, ``y = x * scale`` with finite values clipped to
    +-fp8_max, then rounded to nearest (``rand`` None) or stochastically with ``rand``
    (uint32 per element: `random_bits` over the flat index). The fp8 cast of the result
    is exact, but for e4m3fn's inf, which becomes NaN (it has no inf).
    """
    x = np.asarray(x, dtype=np.float32)
    flat = x.reshape(-1)
    nb = -(-flat.size // STATE_BLOCK)
    blocks = np.zeros(nb * STATE_BLOCK, np.float32)
    blocks[:flat.size] = flat
    blocks = blocks.reshape(nb, STATE_BLOCK)
    a = np.abs(blocks)
    a[np.isnan(a)] = np.inf
    amax = a.max(axis=1) if nb else np.zeros(0, np.float32)
    m = np.float32(FP8_MAX[fmt])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = np.clip(m / amax, np.float32(MIN_SCALE), np.float32(MAX_SCALE[fmt]))
        ok = np.isfinite(amax) & (amax >= np.float32(FLOAT32_MIN_NORMAL))
        scale = np.where(ok, scale, np.float32(1.0)).astype(np.float32)
        y = (blocks * scale[:, None]).astype(np.float32).reshape(-1)[:flat.size]
    y = np.where(np.isfinite(y), np.clip(y, -m, m), y)
    q = round_nearest_fp8(y, fmt) if rand is None else stochastic_round_fp8(y, rand, fmt)
    if fmt == "float8_e4m3fn":
        q = np.where(np.isinf(q), np.float32(np.nan), q)
    return q.reshape(x.shape).astype(np.float32), scale


def dequantize_state_8bit(q, scale) -> np.ndarray:
    """``float32(q) * (1 / scale)`` per block of `STATE_BLOCK` (the reciprocal rounded)."""
    q = np.asarray(q, dtype=np.float32)
    flat = q.reshape(-1)
    nb = -(-flat.size // STATE_BLOCK)
    blocks = np.zeros(nb * STATE_BLOCK, np.float32)
    blocks[:flat.size] = flat
    inv = (np.float32(1) / np.asarray(scale, np.float32)).astype(np.float32)
    out = (blocks.reshape(nb, STATE_BLOCK) * inv[:, None]).astype(np.float32)
    return out.reshape(-1)[:flat.size].reshape(q.shape)
