"""The shared bit-level rules of `_mpfunc_common.rounding` as torch ops, bit for bit.

The torch side of ``mpfunc/_src/rounding.py``: counter-based random bits, stochastic
rounding float32 -> bfloat16, 16-bit remainders and Kahan-compensated updates, each equal
to the NumPy reference bit for bit (tests/test_torch_rounding.py), on any device.

uint32 arithmetic is done in int32 with wrap-around (torch's integer ``mul``/``add`` wrap
on CPU and CUDA, which the tests check against the reference), logical right shifts as
arithmetic ones then masked. Halves of a 32-bit word are reached through an int16 view
(little-endian: element ``2i`` is the low half of word ``i``), so ``x ^= x >> 16``,
taking the top 16 bits and reading a remainder are one strided op each, with no
temporary. Every op works in
place on one int32 buffer per tensor (4 bytes per element, 8 during a shift): callers
stepping in chunks (`mpfunc_torch._src.chunked_step`) keep that bounded.

NaN: stochastic rounding keeps a NaN's sign and top mantissa bits (quiet), as the
reference does. Round to nearest is torch's own cast (``Tensor.to(torch.bfloat16)``),
equal to the reference on every non-NaN value; a NaN stays a NaN but its bit pattern is
torch's (``0xFFFF`` on CPU), as JAX's cast has its own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from _mpfunc_common.rounding import MIX_CONSTANTS, step_key
from mpfunc_torch._src.sharding import is_dtensor, local

__all__ = [
    "as_int32",
    "mix32_",
    "random_bits",
    "random_bits_at",
    "element_index",
    "bits_for",
    "stochastic_round_",
    "split_remainder_",
    "join_remainder_",
    "kahan_update_",
    "foreach_split_remainder_",
    "foreach_join_remainder_",
    "foreach_kahan_update_",
]

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("mpfunc_torch's rounding rules read 32-bit words as little-endian "
                      "int16 halves; this machine is big-endian.")


def as_int32(v: int) -> int:
    """A 32-bit pattern (taken modulo 2**32) as the int32 value with the same bits."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


_A, _B = (as_int32(c) for c in MIX_CONSTANTS)
_I32, _I16, _F32, _BF16 = torch.int32, torch.int16, torch.float32, torch.bfloat16


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) 16-bit halves of a contiguous 1-D 32-bit tensor, as int16 views."""
    h = x.view(_I16)
    return h[0::2], h[1::2]


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on a contiguous 1-D int32 tensor (its bits read as uint32)."""
    lo, hi = _halves(x)
    lo.bitwise_xor_(hi)  # x ^= x >> 16: the high half is unchanged, the low one takes it
    x.mul_(_A)
    t = torch.bitwise_right_shift(x, 15)
    t.bitwise_and_(0x1FFFF)  # the logical shift
    x.bitwise_xor_(t)
    del t
    x.mul_(_B)
    lo.bitwise_xor_(hi)
    return x


def _key(seed: int, stream: int, step: int) -> int:
    """The reference's step key (three host-side hashes of Python ints), as int32."""
    return as_int32(step_key(int(seed), int(stream), int(step)))


def random_bits(seed: int, stream: int, step: int, start: int, n: int,
                device: torch.device | str | None = None) -> torch.Tensor:
    """``_mpfunc_common.rounding.random_bits`` of the element indices ``start .. start+n``
    (a contiguous run of a leaf's row-major positions), as int32 bit patterns."""
    key = _key(seed, stream, step)
    if start + n <= 1 << 31:  # every index below 2**31: its high word is 0
        x = torch.arange(start, start + n, dtype=_I32, device=device)
        x.bitwise_xor_(key)
        return mix32_(mix32_(x))
    return random_bits_at(seed, stream, step,
                          torch.arange(start, start + n, dtype=torch.int64, device=device))


def random_bits_at(seed: int, stream: int, step: int, index: torch.Tensor) -> torch.Tensor:
    """``_mpfunc_common.rounding.random_bits`` of any int64 element indices (>= 0), as a
    1-D int32 tensor in ``index``'s (flattened) order."""
    index = index.reshape(-1)
    x = (index & 0xFFFFFFFF).to(_I32)  # the low word, wrapped into int32
    x.bitwise_xor_(_key(seed, stream, step))
    mix32_(x)
    x.bitwise_xor_((index >> 32).to(_I32))
    return mix32_(x)


def element_index(t: torch.Tensor) -> int | torch.Tensor:
    """The row-major positions in the whole tensor of this rank's elements of ``t``: an
    int (the first of a contiguous run, the local shard's elements in order) or, for a
    shard that is not one run of the whole (sharded along a later dimension), an int64
    tensor of the local shard's shape."""
    if not is_dtensor(t):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                          t.placements)
    if tuple(shape) != tuple(local(t).shape):  # pragma: no cover - e.g. strided sharding
        raise ValueError(f"a DTensor sharded as {t.placements} has no row-major layout of "
                         "its shard that the shared random bits can index.")
    inner = 1
    for n in t.shape[1:]:
        inner *= n
    if tuple(shape[1:]) == tuple(t.shape[1:]):
        return offset[0] * inner if shape else 0
    index = torch.zeros(shape, dtype=torch.int64, device=local(t).device)
    stride = 1
    for d in reversed(range(len(shape))):
        pos = torch.arange(offset[d], offset[d] + shape[d], dtype=torch.int64,
                           device=index.device) * stride
        index += pos.reshape([-1] + [1] * (len(shape) - d - 1))
        stride *= t.shape[d]
    return index


def bits_for(t: torch.Tensor, seed: int, stream: int, step: int,
             index: int | torch.Tensor | None = None) -> torch.Tensor:
    """The shared random bits (int32) of each of this rank's elements of ``t``, in the
    local shard's row-major order (``index``: `element_index` of ``t``, if known)."""
    index = element_index(t) if index is None else index
    if isinstance(index, int):
        return random_bits(seed, stream, step, index, local(t).numel(), local(t).device)
    return random_bits_at(seed, stream, step, index)


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``out`` (bfloat16) = ``x`` (float32) rounded stochastically with ``bits`` (int32,
    one per element, consumed): ``_mpfunc_common.rounding.stochastic_round_bf16``.

    ``bits(x) + (bits & 0xFFFF)``, wrapped, then its top 16 bits; a NaN takes the top
    bits of ``bits(x) | 0x00400000`` instead. All three tensors are contiguous and have
    ``x``'s number of elements; ``out`` may not alias ``x``.
    """
    b = x.reshape(-1).view(_I32)
    r = bits.reshape(-1)
    r.bitwise_and_(0xFFFF)
    r.add_(b)
    quiet = torch.bitwise_or(b, 0x00400000)
    torch.where(torch.isnan(x.reshape(-1)), quiet, r, out=r)
    out.reshape(-1).view(_I16).copy_(_halves(r)[1])
    return out


def split_remainder_(work: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """float32 ``work`` -> ``hi`` (bfloat16) and ``lo`` (int16) with ``bits(work) ==
    (bits(hi) << 16) + lo``: `_mpfunc_common.rounding.split_remainder` (``hi`` rounded
    to nearest, ties away from zero). ``work`` is left as it was. Contiguous tensors."""
    s = work.reshape(-1).view(_I32)
    lo.reshape(-1).copy_(_halves(s)[0])  # the low half, read as signed, is the remainder
    s.add_(0x8000)                       # ... and the carry into the high half rounds
    hi.reshape(-1).view(_I16).copy_(_halves(s)[1])
    s.sub_(0x8000)


def join_remainder_(work: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``work`` (float32) = the master that ``hi`` (bfloat16) and ``lo`` (int16) split:
    `_mpfunc_common.rounding.join_remainder`, exact: ``(hi << 16) + lo`` in int32."""
    foreach_join_remainder_([work], [hi], [lo])


def kahan_update_(p: torch.Tensor, c: torch.Tensor, update: torch.Tensor) -> None:
    """One Kahan-compensated step of bfloat16 ``p`` (with bfloat16 compensation ``c``) by
    a float32 ``update``, in place: `_mpfunc_common.rounding.kahan_update`. ``update``
    is consumed (it ends holding the new compensation in float32)."""
    foreach_kahan_update_([p], [c], [update])


def foreach_split_remainder_(works: Sequence[torch.Tensor], his: Sequence[torch.Tensor],
                             los: Sequence[torch.Tensor]) -> None:
    """`split_remainder_` over lists (one foreach add per direction)."""
    if not works:
        return
    s = [w.reshape(-1).view(_I32) for w in works]
    torch._foreach_copy_([lo.reshape(-1) for lo in los], [_halves(x)[0] for x in s])
    torch._foreach_add_(s, 0x8000)
    torch._foreach_copy_([h.reshape(-1).view(_I16) for h in his], [_halves(x)[1] for x in s])
    torch._foreach_sub_(s, 0x8000)


def foreach_join_remainder_(works: Sequence[torch.Tensor], his: Sequence[torch.Tensor],
                            los: Sequence[torch.Tensor]) -> None:
    """`join_remainder_` over lists: the sign-extended ``hi`` shifted up, plus ``lo``
    (a negative remainder borrows from the high half, so no copy of halves will do)."""
    if not works:
        return
    s = [w.reshape(-1).view(_I32) for w in works]
    torch._foreach_copy_(s, [hi.reshape(-1).view(_I16) for hi in his])
    for x in s:
        x.bitwise_left_shift_(16)
    torch._foreach_add_(s, [lo.reshape(-1) for lo in los])


def foreach_kahan_update_(ps: Sequence[torch.Tensor], cs: Sequence[torch.Tensor],
                          updates: Sequence[torch.Tensor]) -> None:
    """`kahan_update_` over lists; each ``update`` is consumed. In float32::

        y = update + c;  t = p + y;  p' = bf16(t);  c' = bf16(y - (p' - p))
    """
    if not ps:
        return
    ys = list(updates)
    torch._foreach_add_(ys, list(cs))              # y = update + c
    ts = torch._foreach_add(ys, list(ps))          # t = p + y (float32)
    news = [torch.empty_like(p) for p in ps]
    torch._foreach_copy_(news, ts)                 # p' = bf16(t), to nearest
    torch._foreach_copy_(ts, news)                 # p' in float32 (exact)
    torch._foreach_sub_(ts, list(ps))              # p' - p (exact)
    torch._foreach_sub_(ys, ts)                    # y - (p' - p)
    del ts
    torch._foreach_copy_(list(cs), ys)             # c' = bf16(...), to nearest
    torch._foreach_copy_(list(ps), news)
