"""The checks on a saved loss-scaler state's values and config (torch side).

The twin of ``mpfunc._src.scale_rule``'s checks: `LossScaler.check_state` reads a
`state_dict` through these, so a bad value is a ValueError naming its key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from _mpfunc_common.scale_config import ScaleConfig, as_python_number, to_float32

__all__ = ["check_config", "scalar"]

_INT32_MAX = 2**31 - 1


def scalar(value: Any, name: str, integer: bool) -> float | int:
    """A state value (0-dim tensor or Python number) as a Python number, or ValueError."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"`{name}` must be a real 0-dim tensor, got {value.dtype} with "
                             f"shape {tuple(value.shape)}.")
        value = value.item()
    try:
        out = as_python_number(name, value, integer=integer)
    except TypeError as e:
        raise ValueError(str(e)) from None
    if not integer and math.isfinite(out) and out != to_float32(out):
        raise ValueError(f"`{name}` must be a float32 value, got {value!r}.")
    return out


def check_config(cfg: Any, kind: str, name: str) -> dict[str, Any] | None:
    """A saved ``config`` (None for a static or unit scale) as a dict of numbers, or
    ValueError naming ``name``. A config saved before ``warm_start`` existed has no such
    key and reads as ``warm_start=False``."""
    if kind != "dynamic":
        if cfg is not None:
            raise ValueError(f"`{name}` must be None for a {kind} scale, got {cfg!r}.")
        return None
    fields = ScaleConfig.__dataclass_fields__
    if not isinstance(cfg, Mapping) or set(cfg) not in (set(fields), set(fields) - {"warm_start"}):
        raise ValueError(f"`{name}` must be a dict with keys {sorted(fields)}, got {cfg!r}.")
    out = {"warm_start": cfg.get("warm_start", False)}  # saved before it existed: False
    if not isinstance(out["warm_start"], bool):
        raise ValueError(f"`{name}['warm_start']` must be a bool, got {out['warm_start']!r}.")
    for key in [k for k in fields if k != "warm_start"]:
        integer = key in ("growth_interval", "hysteresis")
        try:
            out[key] = as_python_number(key, cfg[key], integer=integer)
        except TypeError as e:
            raise ValueError(f"`{name}['{key}']`: {e}") from None
        if integer and not 1 <= out[key] <= _INT32_MAX:
            raise ValueError(f"`{name}['{key}']` must be an int >= 1, got {cfg[key]!r}.")
    if math.isnan(out["min_scale"]) or math.isnan(out["max_scale"]):
        raise ValueError(f"`{name}` has a NaN bound: {cfg!r}.")
    return out
