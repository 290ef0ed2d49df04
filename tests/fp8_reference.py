"""A plain NumPy reference of the fp8 quantisation rule (`_mpfunc_common.fp8.QUANTIZE_RULE`).

Written independently of both packages: loops over blocks, ``numpy.float32`` scalars
and ``ml_dtypes`` for the fp8 formats. ml_dtypes' own cast rounds to nearest even but
does not saturate, so the saturation is spelled out here as the rule says.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def max_scale(name):
    """2**125 times the format's smallest subnormal (the rule's upper scale bound)."""
    return np.float32(2.0**125 * float(ml_dtypes.finfo(F8[name]).smallest_subnormal))


def ref_scale(amax, name, margin=0, power_of_2=False, fallback=1.0):
    amax = np.float32(amax)
    fmax = np.float32(ml_dtypes.finfo(F8[name]).max)
    if not (np.isfinite(amax) and amax >= np.float32(2.0**-126)):
        return np.float32(fallback)
    with np.errstate(over="ignore", divide="ignore"):
        s = np.float32(fmax / amax)
        s = np.float32(s / np.float32(2.0**margin))
    s = min(max(s, np.float32(2.0**-126)), max_scale(name))
    s = np.float32(s)
    if power_of_2:
        s = np.float32(2.0 ** np.floor(np.log2(np.float64(s))))
    return s


def ref_cast(y, name):
    """float32 array -> fp8 with finite values saturated; returns the fp8 array."""
    y = np.asarray(y, np.float32)
    fmax = np.float32(ml_dtypes.finfo(F8[name]).max)
    sat = np.where(np.isfinite(y), np.clip(y, -fmax, fmax), 0).astype(F8[name]).view(np.uint8)
    nan, pos_inf, neg_inf = {"float8_e4m3fn": (0x7F, 0x7F, 0xFF),
                             "float8_e5m2": (0x7E, 0x7C, 0xFC)}[name]
    with np.errstate(invalid="ignore"):
        special = np.where(np.isnan(y), nan, np.where(y > 0, pos_inf, neg_inf))
    return np.where(np.isfinite(y), sat, special).astype(np.uint8).view(F8[name])


def ref_quantize(x, name, block=None, margin=0, power_of_2=False):
    """Returns (q, scale) exactly as the rule says (NumPy keeps float32 subnormals)."""
    x = np.asarray(x).astype(np.float32)
    if block is None:
        with np.errstate(invalid="ignore"):
            amax = np.max(np.abs(x)) if x.size else np.float32(0)
        s = ref_scale(amax, name, margin, power_of_2)
        with np.errstate(over="ignore", invalid="ignore"):
            q = ref_cast(x * s, name)
        return q, np.float32(s)
    x2 = x.reshape(1, -1) if x.ndim < 2 else x.reshape(-1, x.shape[-1])
    r, c = x2.shape
    br = r if block[0] is None else block[0]
    bc = c if block[1] is None else block[1]
    nr, nc = -(-r // br), -(-c // bc)
    scales = np.zeros((nr, nc), np.float32)
    q = np.zeros(x2.shape, F8[name])
    for i in range(nr):
        for j in range(nc):
            tile = x2[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            with np.errstate(invalid="ignore"):
                amax = np.max(np.abs(tile))
            s = ref_scale(amax, name, margin, power_of_2)
            scales[i, j] = s
            with np.errstate(over="ignore", invalid="ignore"):
                q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = ref_cast(tile * s, name)
    return q.reshape(x.shape), scales


def ref_dequantize(q, scale, block=None):
    with np.errstate(over="ignore", invalid="ignore"):  # near float32's max: inf
        return _dequantize(q, scale, block)


def _dequantize(q, scale, block):
    v = np.asarray(q).astype(np.float32)
    inv = (np.float32(1) / np.asarray(scale, np.float32)).astype(np.float32)
    if block is None:
        return v * inv
    v2 = v.reshape(1, -1) if v.ndim < 2 else v.reshape(-1, v.shape[-1])
    r, c = v2.shape
    br = r if block[0] is None else block[0]
    bc = c if block[1] is None else block[1]
    rows = np.repeat(inv, br, axis=0)[:r]
    full = np.repeat(rows, bc, axis=1)[:, :c]
    return (v2 * full).reshape(v.shape)
