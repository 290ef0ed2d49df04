"""`convert_checkpoint`'s side of a run stored without float32 masters (the JAX twin is
``mpfunc/_src/checkpoint/storage.py``): the float32 values an `AmpOptimizer.state_dict`'s
``"low_precision"`` part stands for, its stored state widened to float32, and the count
of applied steps a stochastic target's random bits go on from. The way back (a storage
from float32 values) is the converted model's load (`MasterStorage.follow_load_`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from _mpfunc_common.storage import STATE_BLOCK
from mpfunc_torch._src.master_storage import STORAGES
from mpfunc_torch._src.master_weights import FROM_MODEL
from mpfunc_torch._src.rounding import join_remainder_
from mpfunc_torch._src.state_dtype import SCALE_SUFFIX, STATE_DTYPES, is_scale_key, widen

__all__ = ["stored_masters", "widen_state", "applied_steps"]

_LOW = ("storage", "seed", "step", "params", "extra")
_EXTRA = {"remainder": torch.int16, "kahan": torch.bfloat16, "stochastic": None}


def stored_masters(low: Any) -> list[torch.Tensor]:
    """The float32 values a ``"low_precision"`` part's params and remainders or
    compensations stand for: a remainder's masters exactly, Kahan's ``param +
    compensation`` (in float32), a stochastic param as it is; none for float32 masters,
    or where a converted checkpoint's come from the model (`FROM_MODEL`)."""
    where = "optimizer_state_dict['low_precision']"
    if not isinstance(low, Mapping) or any(k not in low for k in _LOW):
        raise ValueError(f"`{where}` must be a dict with keys {list(_LOW)} (as "
                         "AmpOptimizer.state_dict() saves it), got "
                         f"{sorted(low) if isinstance(low, Mapping) else type(low).__name__}.")
    kind, params, extra = low["storage"], low["params"], low["extra"]
    if kind not in STORAGES:
        raise ValueError(f"`{where}['storage']` must be one of {list(STORAGES)}, got {kind!r}.")
    step = low["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"`{where}['step']` must be an int >= 0, got {step!r}.")
    if kind == "float32" or (isinstance(params, str) and params == FROM_MODEL):
        return []
    if not isinstance(params, list | tuple) or not isinstance(extra, list | tuple) or len(
            extra) != len(params):
        raise ValueError(f"`{where}['params']` and `['extra']` must be lists of the same "
                         f"length (one per param), got {type(params).__name__} and "
                         f"{type(extra).__name__}.")
    out = []
    for i, (p, e) in enumerate(zip(params, extra)):
        want = _EXTRA[kind]
        if not isinstance(p, torch.Tensor) or p.dtype != torch.bfloat16 or (
                want is None) != (e is None) or (e is not None and (
                not isinstance(e, torch.Tensor) or e.dtype != want or e.shape != p.shape)):
            raise ValueError(f"`{where}` entry {i} must be a bfloat16 param with "
                             + (f"a {want} of its shape beside it" if want else "None beside it")
                             + f" (storage {kind!r}), got {_what(p)} and {_what(e)}.")
        m = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        if e is None:  # stochastic
            m.copy_(p)
        elif kind == "remainder":
            join_remainder_(m, p.contiguous(), e.contiguous())
        else:
            torch.add(p.float(), e.float(), out=m)
        out.append(m)
    return out


def _what(t: Any) -> str:
    return (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
            else type(t).__name__)


def widen_state(inner: Mapping[str, Any], keep: str | None) -> dict[str, Any]:
    """The inner state_dict with its stored state in float32: 16-bit tensors widened
    (exactly), 8-bit codes dequantised with their ``"<key>:scale"`` (blocks of
    `STATE_BLOCK`, as `convert_to_amp` stores them), except codes already in ``keep``
    (the target's state dtype), which stay as they are with their scales."""
    kept = STATE_DTYPES.get(keep) if keep is not None else None
    state = {}
    for pid, st in inner["state"].items():
        if not isinstance(st, Mapping):
            state[pid] = st
            continue
        new = {}
        for key, v in st.items():
            scale = st.get(key + SCALE_SUFFIX) if isinstance(key, str) else None
            if is_scale_key(key) and st.get(key[:-len(SCALE_SUFFIX)]) is not None and (
                    st[key[:-len(SCALE_SUFFIX)]].dtype != kept):
                continue  # the scales of codes dequantised here
            if (not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dim() == 0
                    or v.dtype in (torch.float32, kept)):
                new[key] = v
            elif scale is not None:
                if not isinstance(scale, torch.Tensor) or scale.numel() != -(
                        -v.numel() // STATE_BLOCK):
                    raise ValueError(
                        f"`optimizer_state_dict['optimizer']['state'][{pid!r}]"
                        f"[{key + SCALE_SUFFIX!r}]` must hold {-(-v.numel() // STATE_BLOCK)} "
                        f"scales (blocks of {STATE_BLOCK}), got {_what(scale)}.")
                new[key] = widen(v, scale.float(), STATE_BLOCK)
            else:
                new[key] = v.float()
        state[pid] = new
    return {**inner, "state": state}


def applied_steps(inner: Mapping[str, Any], step: Any) -> int:
    """The source's count of applied steps, which a stochastic target's random bits go
    on from: its ``"low_precision"`` step where it has one, else the largest per-param
    ``"step"`` in the inner state (Adam's: it counts the steps taken, skipped ones not),
    else 0 (SGD keeps none)."""
    if step is not None:
        return int(step)
    found = [float(st["step"]) for st in inner.get("state", {}).values()
             if isinstance(st, Mapping) and isinstance(st.get("step"), torch.Tensor | float | int)]
    return int(max(found)) if found else 0
