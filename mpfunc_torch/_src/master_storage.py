"""bfloat16 params without float32 masters: remainders, Kahan or stochastic rounding.

The torch side of the storages of ``mpfunc/_src/master_weights.py``. The inner optimizer
still steps a float32 master per param (any ``torch.optim`` optimizer, its foreach and
fused paths unchanged), but that master is a placeholder whose storage exists only
during the step (between steps it is one NaN seen at every position: 4 bytes, safe to
print): `MasterStorage.begin_` builds its float32 value into it, the inner optimizer
steps it, and `end_` writes the result back and frees it. With
``step_chunks > 1`` (`mpfunc_torch._src.chunked_step`) that happens chunk by chunk, so
the float32 values, like the float32 grads, never all exist at once. Between steps:

* ``"remainder"``: the bfloat16 param and an int16 remainder; together they are the
  float32 master, bit for bit (`rounding.split_remainder_` / `join_remainder_`), so the
  trajectory is that of float32 masters. The param is the master rounded to nearest
  with ties away from zero (torch's cast rounds ties to even: the two differ only on a
  master exactly halfway between two bfloat16 values). TransformerEngine's
  ``store_param_remainders`` keeps the same 16 bits.
* ``"kahan"``: the bfloat16 param and a bfloat16 compensation; the inner step runs on
  the param in float32 and its update (new - old) is added with Kahan summation
  (`rounding.foreach_kahan_step_`), as optimi does.
* ``"stochastic"``: the bfloat16 param only; the inner step runs on it in float32 and
  the result is rounded stochastically with the shared random bits of (seed, stream 0,
  step, element index) (`rounding.stochastic_round_`), as torchao's ``_AdamW(
  bf16_stochastic_round=True)``, but reproducible and identical in JAX.

bfloat16 only: a float16 master is not a float16 value plus 16 bits (float16's exponent
range is float32's minus 3 bits), and the stochastic and Kahan rules are bfloat16's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from _mpfunc_common.suggest import did_you_mean
from mpfunc_torch._src.master_weights import replace_master_, store_master
from mpfunc_torch._src.rounding import (
    bits_for,
    element_index,
    foreach_join_remainder_,
    foreach_kahan_step_,
    foreach_split_remainder_,
    scratch_for,
    stochastic_round_,
)
from mpfunc_torch._src.sharding import is_dtensor, local

__all__ = ["STORAGES", "MasterStorage", "raw"]

STORAGES = ("float32", "remainder", "kahan", "stochastic")
_EXTRA = {"remainder": torch.int16, "kahan": torch.bfloat16, "stochastic": None}
_F32, _BF16 = torch.float32, torch.bfloat16


def raw(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` through ``.data``: writes to it bump no version counter
    (the params' counters tell writes from outside apart from the optimizer's own)."""
    return local(t).data


def _impl(w: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage a placeholder's values live in (a DTensor's shard)."""
    return w._local_tensor if is_dtensor(w) else w


@torch.no_grad()
def _free_(w: torch.Tensor) -> None:
    """A placeholder between steps: one NaN seen at every position (stride 0), so it
    holds 4 bytes, yet prints and reads safely (and visibly as no value)."""
    t = _impl(w)
    t.set_(torch.full((1,), float("nan"), dtype=t.dtype, device=t.device).expand(t.shape))  # pyright: ignore[reportArgumentType]  # torch's stub lists set_(Storage) only; set_(Tensor) is documented


@torch.no_grad()
def _alloc_(w: torch.Tensor) -> torch.Tensor:
    """A placeholder for the step: its own contiguous float32 storage (its shard's)."""
    t = _impl(w)
    t.set_(torch.empty(t.shape, dtype=t.dtype, device=t.device))  # pyright: ignore[reportArgumentType]  # torch's stub lists set_(Storage) only; set_(Tensor) is documented
    return raw(w)


def check_storage(storage: Any) -> str:
    if storage not in STORAGES:
        raise ValueError(f"`master_weights` must be one of {list(STORAGES)}, got "
                         f"{storage!r}{did_you_mean(str(storage), list(STORAGES))}.")
    return storage


class MasterStorage:
    """The bfloat16 params of ``pairs`` with their masters stored as ``kind`` says.

    Args:
      kind: ``"remainder"``, ``"kahan"`` or ``"stochastic"``.
      pairs: ``(model param, float32 master)``: the params (bfloat16, contiguous) and
        masters holding their exact float32 values (`make_masters`); the params are set
        from them (a remainder's param is the master rounded ties away from zero; a
        Kahan compensation starts as the master's residual, rounded to bfloat16).
      seed: the seed of the stochastic rounding's random bits.

    ``pairs`` (the attribute) then holds ``(param, placeholder)`` pairs: put the
    placeholders in the inner optimizer with `swap_into_`.
    """

    def __init__(self, kind: str, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 *, seed: int = 0):
        if kind not in _EXTRA:
            raise ValueError(f"`kind` must be one of {list(_EXTRA)}, got {kind!r}.")
        for i, (p, _) in enumerate(pairs):
            if p.dtype != _BF16:
                raise ValueError(
                    f"master_weights={kind!r} keeps bfloat16 params; param {i} is {p.dtype}. "
                    "A float16 master is no float16 value plus 16 bits (float16's exponent "
                    "range is narrower), and the stochastic and Kahan rules are "
                    "bfloat16's: use float32 master weights with float16 params.")
            if not raw(p).is_contiguous():
                raise ValueError(f"master_weights={kind!r} needs contiguous params; param {i} "
                                 f"(shape {tuple(p.shape)}) has strides {raw(p).stride()}: "
                                 "make it contiguous before convert_to_amp.")
        self.kind, self.seed = kind, seed
        self.extra: list[torch.Tensor | None] = []
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._masters = [m for _, m in pairs]  # until swap_into_
        self._at: dict[int, int] = {}
        self._index: list[Any] = []
        for i, (p, m) in enumerate(pairs):
            dtype = _EXTRA[kind]
            self.extra.append(None if dtype is None else torch.zeros_like(p, dtype=dtype))
            w = nn.Parameter(torch.empty_like(m), requires_grad=m.requires_grad)
            _free_(w)
            store_master(w, self)
            self.pairs.append((p, w))
            self._at[id(w)] = i
            self._index.append(element_index(p) if kind == "stochastic" else None)
            self._set_([i], [raw(m)])

    def _extra_at(self, i: int) -> torch.Tensor:
        """The remainder or compensation of pair ``i`` (there is one for every pair with
        storage remainder or kahan)."""
        extra = self.extra[i]
        if extra is None:
            raise RuntimeError(f"pair {i} keeps no remainder or compensation "
                               f"(storage={self.kind!r}).")
        return extra

    def swap_into_(self, optimizer: torch.optim.Optimizer) -> None:
        """Replaces the float32 masters by the placeholders in ``optimizer`` (and in
        `master_of`); the masters' memory goes with the last reference to them."""
        for (p, w), m in zip(self.pairs, self._masters):
            replace_master_(optimizer, p, m, w)
        self._masters = []

    def positions(self, params: Sequence[torch.Tensor]) -> list[int]:
        """The positions in `pairs` of the placeholders among ``params``."""
        at = self._at
        return [at[id(q)] for q in params if id(q) in at]

    # -- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def begin_(self, idx: Sequence[int]) -> None:
        """Builds the float32 masters of the placeholders at ``idx``."""
        works = [_alloc_(self.pairs[i][1]) for i in idx]
        ps = [raw(self.pairs[i][0]) for i in idx]
        if self.kind == "remainder":
            foreach_join_remainder_(works, ps, [raw(self._extra_at(i)) for i in idx])
        elif works:
            torch._foreach_copy_(works, ps)  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported

    @torch.no_grad()
    def end_(self, idx: Sequence[int], step: int) -> None:
        """Writes the stepped masters at ``idx`` back (step number ``step``) and frees
        them."""
        works = [raw(self.pairs[i][1]) for i in idx]
        ps = [raw(self.pairs[i][0]) for i in idx]
        if self.kind == "remainder":
            foreach_split_remainder_(works, ps, [raw(self._extra_at(i)) for i in idx])
        elif self.kind == "kahan":
            foreach_kahan_step_(ps, [raw(self._extra_at(i)) for i in idx], works)
        elif works:
            scratch = scratch_for(works, torch.int32)
            for i, w, p in zip(idx, works, ps):
                bits = bits_for(self.pairs[i][0], self.seed, 0, step, self._index[i], scratch)
                stochastic_round_(p, w, bits, scratch)
        self.abort_(idx)

    def abort_(self, idx: Sequence[int]) -> None:
        """Frees the placeholders at ``idx`` without writing anything back."""
        for i in idx:
            _free_(self.pairs[i][1])

    # -- values outside the step --------------------------------------------------------
    @torch.no_grad()
    def _set_(self, idx: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        """The masters at ``idx`` become ``values`` (float32 local shards), exactly for a
        remainder; a Kahan param is the value rounded to nearest and its compensation
        the rest rounded; a stochastic param the value rounded to nearest."""
        for i, v in zip(idx, values):
            p = raw(self.pairs[i][0])
            if self.kind == "remainder":
                work = v.to(_F32, copy=True).contiguous()
                foreach_split_remainder_([work], [p], [raw(self._extra_at(i))])
                continue
            p.copy_(v)
            if self.kind == "kahan":
                raw(self._extra_at(i)).copy_(v.to(_F32) - p.to(_F32))

    def master_value(self, i: int) -> torch.Tensor:
        """The float32 master at position ``i`` (this rank's shard): the remainder's
        exactly, Kahan's as param + compensation, stochastic's as the param."""
        p = raw(self.pairs[i][0])
        out = torch.empty_like(p, dtype=_F32)
        if self.kind == "remainder":
            foreach_join_remainder_([out], [p], [raw(self._extra_at(i))])
        else:
            out.copy_(p)
            if self.kind == "kahan":
                out.add_(raw(self._extra_at(i)))
        return out

    @torch.no_grad()
    def reset_to_param_(self, w: torch.Tensor) -> None:
        """The param of placeholder ``w`` was written from outside: it is the master."""
        extra = self.extra[self._at[id(w)]]
        if extra is not None:
            raw(extra).zero_()

    def load_mask(self, w: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Before a model load of a bfloat16 ``value`` into ``w``'s param: where the
        stored master already rounds to it (the param equals it)."""
        p = self.pairs[self._at[id(w)]][0].detach()
        return p == value.to(device=p.device, dtype=_BF16)

    @torch.no_grad()
    def follow_load_(self, w: torch.Tensor, value: torch.Tensor,
                     keep: torch.Tensor | None) -> None:
        """After a model load of ``value`` into ``w``'s param: a float32 value becomes
        the master (`_set_`); a bfloat16 one keeps the remainder or compensation where
        ``keep`` (the master already rounded to it), else zeroes it."""
        i = self._at[id(w)]
        if keep is None:
            self._set_([i], [local(value).to(raw(self.pairs[i][0]).device)])
        elif (extra := self.extra[i]) is not None:
            e = raw(extra)
            e.copy_(torch.where(local(keep), e, torch.zeros((), dtype=e.dtype, device=e.device)))

