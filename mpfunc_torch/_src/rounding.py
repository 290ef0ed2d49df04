"""The shared bit-level rules of `_mpfunc_common.rounding` as torch ops, bit for bit.

The torch side of ``mpfunc/_src/rounding.py``: counter-based random bits, stochastic
rounding float32 -> bfloat16, 16-bit remainders and Kahan-compensated updates, each equal
to the NumPy reference bit for bit (tests/test_torch_rounding.py), on any device.

uint32 arithmetic is done in int32 with wrap-around (torch's integer ``mul``/``add`` wrap
on CPU and CUDA, and a narrowing int32 -> int16 copy keeps the low 16 bits: the tests
check both against the reference), logical right shifts as arithmetic ones then masked.
The ops are plain contiguous elementwise kernels, in place where they can be, with one
int32 scratch buffer reused through a call: no strided views (a strided int16 kernel
costs several contiguous ones on CPU) and no boolean masks (a select is a sign mask
and an AND). Callers stepping in chunks (`mpfunc_torch._src.chunked_step`) keep the
temporaries bounded.

8-bit state: `quantize_state_8bit` is the blockwise fp8 rule (``mpfunc_torch._src.fp8.rule``)
on a flattened state tensor, rounded to nearest or stochastically onto the fp8 grid
(`stochastic_round_fp8_`: `_mpfunc_common.rounding.stochastic_round_fp8`).

NaN: stochastic rounding keeps a NaN's sign and top mantissa bits (quiet), as the
reference does. Round to nearest is torch's own cast (``Tensor.to(torch.bfloat16)``),
equal to the reference on every non-NaN value; a NaN stays a NaN but its bit pattern is
torch's (``0xFFFF`` on CPU), as JAX's cast has its own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from _mpfunc_common.fp8 import FP8_MAX
from _mpfunc_common.rounding import FP8_MANTISSA_BITS, FP8_MIN_NORMAL, MIX_CONSTANTS, step_key
from mpfunc_torch._src.fp8.quantize import quantize_fp8
from mpfunc_torch._src.fp8.rule import _cast, block_amax, scale_from_amax
from mpfunc_torch._src.sharding import is_dtensor, local

__all__ = [
    "as_int32",
    "mix32_",
    "random_bits",
    "random_bits_at",
    "element_index",
    "bits_for",
    "stochastic_round_",
    "stochastic_round_fp8_",
    "quantize_state_8bit",
    "split_remainder_",
    "join_remainder_",
    "kahan_update_",
    "foreach_split_remainder_",
    "foreach_join_remainder_",
    "foreach_kahan_step_",
    "scratch_for",
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


def mix32_(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """lowbias32 in place on an int32 tensor (its bits read as uint32); ``scratch``: an
    int32 tensor of ``x``'s shape to reuse (else one is made)."""
    t = torch.empty_like(x) if scratch is None else scratch
    for shift, mask, mul in ((16, 0xFFFF, _A), (15, 0x1FFFF, _B), (16, 0xFFFF, None)):
        torch.bitwise_right_shift(x, shift, out=t)
        t.bitwise_and_(mask)  # the logical shift
        x.bitwise_xor_(t)
        if mul is not None:
            x.mul_(mul)
    return x


_SMALL: dict = {}  # device -> int32 arange(4096), to build long runs by one broadcast add


def _arange_(x: torch.Tensor, start: int) -> torch.Tensor:
    """``x`` (1-D int32) = start, start + 1, ... (all below 2**31): a broadcast add of a
    cached row to a short column (a plain int arange is a serial loop on CPU)."""
    k, n = 4096, x.numel()
    rows = n // k
    if rows:
        small = _SMALL.get(x.device)
        if small is None:
            small = _SMALL[x.device] = torch.arange(k, dtype=_I32, device=x.device)
        col = torch.arange(start, start + rows * k, k, dtype=_I32, device=x.device)
        torch.add(col[:, None], small[None, :], out=x[:rows * k].view(rows, k))
    if n > rows * k:
        torch.arange(start + rows * k, start + n, dtype=_I32, device=x.device,
                     out=x[rows * k:])
    return x


def _key(seed: int, stream: int, step: int) -> int:
    """The reference's step key (three host-side hashes of Python ints), as int32."""
    return as_int32(step_key(int(seed), int(stream), int(step)))


def random_bits(seed: int, stream: int, step: int, start: int, n: int,
                device: torch.device | str | None = None,
                scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``_mpfunc_common.rounding.random_bits`` of the element indices ``start .. start+n``
    (a contiguous run of a leaf's row-major positions), as int32 bit patterns
    (``scratch``: an int32 tensor of ``n`` elements to reuse)."""
    key = _key(seed, stream, step)
    if start + n <= 1 << 31:  # every index below 2**31: its high word is 0
        x = _arange_(torch.empty(n, dtype=_I32, device=device), start)
        x.bitwise_xor_(key)
        return mix32_(mix32_(x, scratch), scratch)
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
             index: int | torch.Tensor | None = None,
             scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The shared random bits (int32) of each of this rank's elements of ``t``, in the
    local shard's row-major order (``index``: `element_index` of ``t``, if known;
    ``scratch``: an int32 buffer of at least its size to reuse)."""
    index = element_index(t) if index is None else index
    n = local(t).numel()
    if isinstance(index, int):
        return random_bits(seed, stream, step, index, n, local(t).device,
                           None if scratch is None else scratch[:n])
    return random_bits_at(seed, stream, step, index)


def scratch_for(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One flat buffer of ``dtype`` as large as the largest of ``tensors`` (local shards),
    for the ops below to reuse across a list: one allocation, not one per tensor."""
    n = max((local(t).numel() for t in tensors), default=0)
    device = local(tensors[0]).device if tensors else None
    return torch.empty(n, dtype=dtype, device=device)


def _view(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return buf[:like.numel()].view(like.shape)


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, bits: torch.Tensor,
                      scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` (bfloat16) = ``x`` (float32) rounded stochastically with ``bits`` (int32,
    one per element, consumed): ``_mpfunc_common.rounding.stochastic_round_bf16``.

    ``bits(x) + (bits & 0xFFFF)``, wrapped, then its top 16 bits; a NaN adds nothing and
    sets its quiet bit (``bits(x) | 0x00400000``). All tensors are contiguous with
    ``x``'s number of elements (``scratch``: int32, at least that many); ``out`` may not
    alias ``x``.
    """
    b = x.reshape(-1).view(_I32)
    r = bits.reshape(-1)
    t = torch.empty_like(r) if scratch is None else _view(scratch, r)
    torch.bitwise_and(b, 0x7FFFFFFF, out=t)
    t.sub_(0x7F800001)
    t.bitwise_right_shift_(31)      # -1 where x is not a NaN, 0 where it is
    r.bitwise_and_(0xFFFF)
    r.bitwise_and_(t)               # a NaN adds nothing ...
    r.add_(b)
    t.bitwise_not_()
    t.bitwise_and_(0x00400000)      # ... and is made quiet
    r.bitwise_or_(t)
    r.bitwise_right_shift_(16)
    out.reshape(-1).view(_I16).copy_(r)  # a narrowing copy: the top 16 bits
    return out


def stochastic_round_fp8_(y: torch.Tensor, bits: torch.Tensor, name: str) -> torch.Tensor:
    """``y`` (float32, contiguous; its finite values within +-fp8 max) rounded onto the
    fp8 grid of ``name`` stochastically with ``bits`` (int32, one per element, consumed),
    in place: `_mpfunc_common.rounding.stochastic_round_fp8`.

    The bfloat16 rule on ``|y|`` with ``d = 23 - mantissa bits`` dropped bits; below the
    smallest normal ``n`` on ``|y| + n`` (a float32 add), ``n`` taken off again (exact);
    then ``y``'s sign. Non-finite values stay as they are.
    """
    d = 23 - FP8_MANTISSA_BITS[name]
    n = FP8_MIN_NORMAL[name]
    z = y.abs()
    off = (z < n).to(_F32).mul_(n)  # n below the smallest normal, else 0 (exact)
    z.add_(off)
    zi = z.view(_I32)
    zi.add_(bits.reshape(z.shape).bitwise_and_((1 << d) - 1))  # wraps only for a NaN
    zi.bitwise_and_(-(1 << d))  # clears the low d bits
    z.sub_(off)
    torch.copysign(z, y, out=z)
    return y.copy_(torch.where(torch.isfinite(y), z, y))


def quantize_state_8bit(x: torch.Tensor, name: str, block: int,
                        bits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 state tensor (a local shard) -> (fp8 codes of its shape, float32 scales
    per ``block`` elements of it flattened row-major): `_mpfunc_common.rounding.
    quantize_state_8bit` (there with blocks of 128), rounded stochastically with ``bits``
    (int32, one per element in row-major order; consumed). The scales are the blockwise
    fp8 rule's (`mpfunc_torch._src.fp8.rule`), as ``quantize_fp8(x.reshape(-1), name,
    (1, block))`` gives them; ``bits`` None rounds to nearest (that call)."""
    flat = x.detach().reshape(-1)
    if flat.numel() == 0:  # an empty param's state: no codes, no blocks
        return torch.empty(x.shape, dtype=getattr(torch, name)), torch.empty(0, dtype=_F32)
    if bits is None:
        q, scale = quantize_fp8(flat, name, (1, block))
        return q.reshape(x.shape), scale.reshape(-1)
    n = flat.numel()
    scale = scale_from_amax(block_amax(flat, (1, block)), name, 0, False, 1.0).reshape(-1)
    nb = scale.numel()
    y = torch.nn.functional.pad(flat.to(_F32), (0, nb * block - n)).view(nb, block)
    y = (y * scale[:, None]).view(-1)[:n].contiguous()  # a new tensor: x is not written
    m = FP8_MAX[name]
    y = torch.where(torch.isfinite(y), y.clamp(-m, m), y)  # saturate finite values
    return _cast(stochastic_round_fp8_(y, bits, name), name).reshape(x.shape), scale


def split_remainder_(work: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """float32 ``work`` -> ``hi`` (bfloat16) and ``lo`` (int16) with ``bits(work) ==
    (bits(hi) << 16) + lo``: `_mpfunc_common.rounding.split_remainder` (``hi`` rounded
    to nearest, ties away from zero). ``work`` is consumed. Contiguous tensors."""
    foreach_split_remainder_([work], [hi], [lo])


def join_remainder_(work: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``work`` (float32) = the master that ``hi`` (bfloat16) and ``lo`` (int16) split:
    `_mpfunc_common.rounding.join_remainder`, exact."""
    foreach_join_remainder_([work], [hi], [lo])


def foreach_split_remainder_(works: Sequence[torch.Tensor], his: Sequence[torch.Tensor],
                             los: Sequence[torch.Tensor]) -> None:
    """`split_remainder_` over lists (``works`` consumed): the remainder is the low 16
    bits read as signed (a narrowing copy), ``hi`` the top 16 after adding 0x8000."""
    if not works:
        return
    s = [w.reshape(-1).view(_I32) for w in works]
    torch._foreach_copy_([lo.reshape(-1) for lo in los], s)  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported
    torch._foreach_add_(s, 0x8000)  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported
    for x in s:
        x.bitwise_right_shift_(16)
    torch._foreach_copy_([h.reshape(-1).view(_I16) for h in his], s)  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported


def foreach_join_remainder_(works: Sequence[torch.Tensor], his: Sequence[torch.Tensor],
                            los: Sequence[torch.Tensor],
                            scratch: torch.Tensor | None = None) -> None:
    """`join_remainder_` over lists: ``hi`` widened to float32 (its bits shifted up,
    exactly, NaNs included), then ``lo`` added to the bits (a negative remainder
    borrows from the high half). ``scratch``: an int32 buffer of at least the largest
    ``lo``'s size, to widen each ``lo`` into first (an int32 + int32 add, several times
    faster on CPU than adding the int16 itself, which casts it into a temporary)."""
    if not works:
        return
    torch._foreach_copy_(list(works), list(his))  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported
    if scratch is None:
        torch._foreach_add_([w.reshape(-1).view(_I32) for w in works],  # pyright: ignore[reportPrivateImportUsage]  # as above
                            [lo.reshape(-1) for lo in los])
        return
    for w, lo in zip(works, los):
        t = scratch[:lo.numel()]
        t.copy_(lo.reshape(-1))
        w.reshape(-1).view(_I32).add_(t)


def _kahan_(p: torch.Tensor, c: torch.Tensor, y: torch.Tensor, pf: torch.Tensor,
            t: torch.Tensor) -> None:
    """The rule on one tensor: ``y`` holds the update (consumed), ``pf`` the param in
    float32, ``t`` a float32 scratch of the same shape."""
    t.copy_(c)
    y.add_(t)              # y = update + c
    torch.add(pf, y, out=t)  # t = p + y
    p.copy_(t)             # p' = bf16(t), to nearest
    t.copy_(p)
    t.sub_(pf)             # p' - p, exact
    y.sub_(t)              # y - (p' - p)
    c.copy_(y)             # c' = bf16(...), to nearest


def kahan_update_(p: torch.Tensor, c: torch.Tensor, update: torch.Tensor) -> None:
    """One Kahan-compensated step of bfloat16 ``p`` (with bfloat16 compensation ``c``) by
    a float32 ``update``, in place: `_mpfunc_common.rounding.kahan_update`. In float32::

        y = update + c;  t = p + y;  p' = bf16(t);  c' = bf16(y - (p' - p))

    ``update`` is consumed."""
    _kahan_(p, c, update, p.to(_F32), torch.empty_like(update))


def foreach_kahan_step_(ps: Sequence[torch.Tensor], cs: Sequence[torch.Tensor],
                        works: Sequence[torch.Tensor]) -> None:
    """`kahan_update_` of each bfloat16 ``p`` by ``work - p``, where ``work`` is the
    float32 value an optimizer stepped ``p`` to (consumed)."""
    if not ps:
        return
    bufs = scratch_for(works, _F32), scratch_for(works, _F32)
    for p, c, w in zip(ps, cs, works):
        pf = _view(bufs[0], w).copy_(p)
        w.sub_(pf)         # the update the optimizer made, in float32
        _kahan_(p, c, w, pf, _view(bufs[1], w))
