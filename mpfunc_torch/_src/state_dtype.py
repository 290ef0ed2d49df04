"""Optimizer state in any dtype: stored small between steps, computed in float32.

The torch side of ``mpfunc/_src/state_dtype.py``. `StateDtype` keeps the floating state
tensors of any ``torch.optim`` optimizer (Adam's ``exp_avg``/``exp_avg_sq``, SGD's
``momentum_buffer``, ...) in bfloat16, float16 or 8 bits with per-block scales between
steps, in ``optimizer.state`` itself; around each (chunk of a) step, `begin_` puts
float32 copies in their place, the inner optimizer steps them as usual, and `end_`
rounds them back: to nearest (torch's cast), or stochastically with the shared random
bits (`mpfunc_torch._src.rounding`), or, for 8 bits, with the shared blockwise fp8
quantiser (`quantize_state_8bit`: blocks of ``block`` consecutive elements in row-major
order, one float32 scale each, kept under ``"<key>:scale"``, as torchao's ``AdamWFp8``;
the scaled values rounded to nearest, or stochastically onto the fp8 grid by
`_mpfunc_common.rounding.stochastic_round_fp8` with the same random bits). A sharded (DTensor) state is quantised per local shard: its blocks, and
so its codes, are those of the shard, not of the whole tensor.

Which tensors: every floating state tensor with at least one dimension (scalars such as
``step`` stay as they are). Random-bit streams: the compressed keys of a param, sorted by
name, take streams 1, 2, ... (Adam: ``exp_avg`` 1, ``exp_avg_sq`` 2, ``max_exp_avg_sq``
3; stream 0 is the params'), with each element's row-major index in the whole
(unsharded) state tensor, for 16-bit and 8-bit state alike.

Checkpoints: ``optimizer.state_dict()`` holds the stored tensors. torch's own
``load_state_dict`` casts every state tensor to the param's dtype (float32); `after_load_`
casts them back, exactly (a bfloat16, float16 or fp8 value, and an 8-bit code, is exact
in float32), so a resumed run continues bit for bit. A float32 state (a run moving to a
smaller state) is rounded to nearest, or quantised, once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from _mpfunc_common.storage import STATE_BLOCK
from _mpfunc_common.suggest import did_you_mean
from mpfunc_torch._src.fp8.quantize import dequantize_fp8
from mpfunc_torch._src.rounding import (
    bits_for,
    element_index,
    quantize_state_8bit,
    stochastic_round_,
)
from mpfunc_torch._src.sharding import is_dtensor, local

__all__ = ["STATE_DTYPES", "ROUNDINGS", "SCALE_SUFFIX", "StateDtype", "is_scale_key", "widen"]

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn,
                "float8_e5m2": torch.float8_e5m2}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_FP8 = ("float8_e4m3fn", "float8_e5m2")
ROUNDINGS = ("nearest", "stochastic")
SCALE_SUFFIX = ":scale"
# Squared-gradient accumulators of torch.optim's optimizers: float16 underflows them
# (a gradient below 2**-12 squares below float16's smallest subnormal), and a zero second
# moment under a non-zero first one makes Adam divide by eps.
_SQUARED_KEYS = {
    "Adam": ("exp_avg_sq", "max_exp_avg_sq"), "AdamW": ("exp_avg_sq", "max_exp_avg_sq"),
    "NAdam": ("exp_avg_sq",), "RAdam": ("exp_avg_sq",), "RMSprop": ("square_avg",),
    "Adagrad": ("sum",), "Adadelta": ("square_avg", "acc_delta"),
    "Adafactor": ("row_var", "col_var", "variance")}
_SQUARED = {k for keys in _SQUARED_KEYS.values() for k in keys}
_F32 = torch.float32


def is_scale_key(key: Any) -> bool:
    """Whether an optimizer-state key holds the per-block scales of an 8-bit state."""
    return isinstance(key, str) and key.endswith(SCALE_SUFFIX)


def _dtype_name(value: Any, where: str) -> str:
    name = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    name = _ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in STATE_DTYPES:
        raise ValueError(f"`{where}` must be one of {sorted(STATE_DTYPES)}, got {value!r}"
                         f"{did_you_mean(str(value), list(STATE_DTYPES))}.")
    return name


class StateDtype:
    """Keeps ``optimizer``'s floating state in ``dtype`` between steps (see the module).

    Args:
      optimizer: any ``torch.optim.Optimizer`` (the inner one).
      dtype: a dtype name (``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``,
        ``"float8_e5m2"``, ``"float32"``) for every state key, or a mapping from key to
        dtype name (keys not in it stay float32).
      rounding: ``"nearest"`` or ``"stochastic"`` (bfloat16 and 8-bit state).
      seed: the seed of the stochastic rounding's random bits.
      block: elements per scale of 8-bit state (`STATE_BLOCK`, 128, as JAX and
        `convert_checkpoint` use).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dtype: Any = "bfloat16",
                 rounding: str = "nearest", *, seed: int = 0, block: int = STATE_BLOCK):
        if isinstance(dtype, Mapping):
            self.dtypes = {k: _dtype_name(v, f"state_dtype[{k!r}]") for k, v in dtype.items()}
            self.default = None
        else:
            self.dtypes, self.default = {}, _dtype_name(dtype, "state_dtype")
        if rounding not in ROUNDINGS:
            raise ValueError(f"`rounding` must be one of {list(ROUNDINGS)}, got {rounding!r}"
                             f"{did_you_mean(str(rounding), list(ROUNDINGS))}.")
        names = set(self.dtypes.values()) | ({self.default} if self.default else set())
        if rounding == "stochastic" and "float16" in names:
            raise ValueError("`rounding='stochastic'` is defined for bfloat16 and 8-bit state "
                             "(the shared rules round float32 bit patterns onto their grids), "
                             "not float16; got state dtypes "
                             f"{sorted(names - {'float32'})}. Use rounding='nearest' or "
                             "state_dtype='bfloat16'.")
        for key, name in self.dtypes.items():
            if name == "float16" and key in _SQUARED:
                raise ValueError(_fp16_squared(key))
        squared = [k for c in type(optimizer).__mro__ for k in _SQUARED_KEYS.get(
            c.__name__, ()) if c.__module__.startswith("torch.optim")]
        if self.default == "float16" and squared:  # known before the first step
            raise ValueError(_fp16_squared(squared[0]))
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"`block` must be an int >= 1, got {block!r}.")
        self.optimizer, self.rounding, self.seed, self.block = optimizer, rounding, seed, block
        self._index: dict[int, Any] = {}

    def dtype_of(self, key: Any) -> str:
        """The stored dtype name of state ``key``."""
        return self.dtypes.get(key, self.default or "float32")

    def _keys(self, st: Mapping) -> list[tuple[str, int]]:
        """(key, stream) of the state tensors of one param that are stored small."""
        keys = sorted(k for k, v in st.items() if isinstance(k, str) and not is_scale_key(k)
                      and isinstance(v, torch.Tensor) and v.dim() > 0
                      and (v.is_floating_point()) and self.dtype_of(k) != "float32")
        return [(k, i + 1) for i, k in enumerate(keys)]

    # -- around the inner step ----------------------------------------------------------
    def begin_(self, params: Iterable[torch.Tensor]) -> list:
        """The stored state of ``params`` -> float32 tensors in ``optimizer.state``.
        Returns what `abort_` needs to put the stored state back."""
        saved = []
        for q in params:
            st = self.optimizer.state.get(q)
            if not st:
                continue
            for key, _ in self._keys(st):
                stored = st[key]
                if stored.dtype == _F32:
                    continue
                scale = st.pop(key + SCALE_SUFFIX, None)
                saved.append((st, key, stored, scale))
                st[key] = widen(stored, scale, self.block)
        return saved

    @staticmethod
    def abort_(saved: list) -> None:
        """Puts back the stored state `begin_` widened (the inner step failed)."""
        for st, key, stored, scale in saved:
            st[key] = stored
            if scale is not None:
                st[key + SCALE_SUFFIX] = scale

    def end_(self, params: Iterable[torch.Tensor], step: int, saved: Sequence = ()) -> None:
        """The float32 state of ``params`` -> stored dtypes (rounded as configured), for
        the step numbered ``step`` (its random bits); 16-bit results go into the stored
        tensors `begin_` returned (``saved``), not new ones."""
        reuse = {(id(st), key): stored for st, key, stored, _ in saved}
        scratch = None
        for q in params:
            st = self.optimizer.state.get(q)
            if not st:
                continue
            for key, stream in self._keys(st):
                value = st[key]
                if value.dtype != _F32:
                    continue
                name = self.dtype_of(key)
                bits = None
                if self.rounding == "stochastic":
                    n = local(value).numel()
                    if scratch is None or scratch.numel() < n:
                        scratch = torch.empty(n, dtype=torch.int32, device=local(value).device)
                    bits = bits_for(value, self.seed, stream, step, self._index_of(value),
                                    scratch)
                if name in _FP8:
                    st[key], st[key + SCALE_SUFFIX] = _quantize(value, name, self.block, bits)
                    continue
                out = reuse.get((id(st), key))
                if out is None or out.dtype != STATE_DTYPES[name] or out.shape != value.shape:
                    out = torch.empty_like(value, dtype=STATE_DTYPES[name])
                if bits is not None:
                    stochastic_round_(local(out), local(value), bits, scratch)
                else:
                    local(out).copy_(local(value))
                st[key] = out

    def _index_of(self, t: torch.Tensor) -> int | torch.Tensor:
        if not is_dtensor(t):
            return 0
        key = (tuple(t.shape), t.device_mesh, tuple(t.placements))
        found = self._index.get(hash(key))
        if found is None:
            found = self._index[hash(key)] = element_index(t)
        return found

    def after_load_(self, params: Sequence[torch.Tensor]) -> None:
        """After torch's ``load_state_dict`` widened every state tensor to float32: back
        to the stored dtypes, exactly (8-bit codes with their scales), or, for a float32
        state of another run, rounded to nearest / quantised once."""
        for q in params:
            st = self.optimizer.state.get(q)
            if not st:
                continue
            for key, _ in self._keys(st):
                name = self.dtype_of(key)
                scale = st.get(key + SCALE_SUFFIX)
                value = st[key]
                if name in _FP8 and scale is not None:
                    st[key] = value.to(STATE_DTYPES[name])  # the codes, exact
                    st[key + SCALE_SUFFIX] = scale.to(_F32)
                elif name in _FP8:
                    st[key], st[key + SCALE_SUFFIX] = _quantize(value.to(_F32), name, self.block)
                else:
                    st[key] = value.to(STATE_DTYPES[name])

    def check_saved(self, state: Mapping, where: str) -> None:
        """A saved inner state's 8-bit keys have their scales (and only those keys)."""
        for pid, st in state.items():
            if not isinstance(st, Mapping):
                continue
            for key, value in st.items():
                if not is_scale_key(key):
                    continue
                base = key[:-len(SCALE_SUFFIX)]
                if base not in st or self.dtype_of(base) not in _FP8:
                    raise ValueError(f"`{where}[{pid!r}][{key!r}]` holds 8-bit scales, but "
                                     f"this optimizer keeps {base!r} in {self.dtype_of(base)}.")
                if not isinstance(value, torch.Tensor) or value.numel() != _n_blocks(
                        st[base], self.block):
                    raise ValueError(f"`{where}[{pid!r}][{key!r}]` must hold "
                                     f"{_n_blocks(st[base], self.block)} scales (blocks of "
                                     f"{self.block}).")


def _fp16_squared(key: str) -> str:
    return (f"float16 state for {key!r} is refused: it holds squared gradients, which "
            "float16 flushes to zero below 2**-24 (gradients below 2**-12), and a zero "
            "second moment makes Adam-like updates divide by eps. Keep it in bfloat16 "
            f"(state_dtype={{{key!r}: 'bfloat16', ...}}) or 8 bits with scales.")


def _n_blocks(t: Any, block: int) -> int:
    n = local(t).numel() if isinstance(t, torch.Tensor) else 0
    return -(-n // block)


def _quantize(value: torch.Tensor, name: str, block: int,
              bits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 state -> (codes of its shape, float32 scales: one per ``block`` elements
    of the local shard, row-major), by the shared fp8 rule, rounded to nearest or, with
    ``bits`` (int32, the local shard's, consumed), stochastically."""
    v = local(value)
    q, scale = quantize_state_8bit(v, name, block, bits)
    codes = torch.empty_like(value, dtype=STATE_DTYPES[name])
    local(codes).copy_(q)
    return codes, scale


def widen(stored: torch.Tensor, scale: torch.Tensor | None, block: int) -> torch.Tensor:
    """A stored state tensor as float32 (exact for 16-bit dtypes; dequantised for 8)."""
    out = torch.empty_like(stored, dtype=_F32)
    s = local(stored)
    if scale is None:
        local(out).copy_(s)
    else:
        local(out).copy_(dequantize_fp8(s.reshape(-1), scale.reshape(1, -1), (1, block))
                         .reshape(s.shape))
    return out
