"""The checks on a saved loss-scaler state's values and config (torch side).

The twin of ``mpfunc._src.scale_rule``'s checks: `LossScaler.check_state` reads a
`state_dict` through these, so a bad value is a ValueError naming its key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from _mpfunc_common.scale_config import (
    FLOAT32_MAX,
    FLOAT32_MIN_NORMAL,
    WARM_OFF,
    WARM_UP,
    ScaleConfig,
    as_python_number,
    to_float32,
)

__all__ = ["check_config", "check_saved_state", "scalar"]

_INT32_MAX = 2**31 - 1
_STATE_KEYS = ("kind", "loss_scale", "growth_tracker", "hysteresis_left", "skipped_steps",
               "consecutive_skips", "last_finite", "config")


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


def check_saved_state(state: Any, kind: str, config: ScaleConfig | None, static: float,
                      where: str = "state") -> dict[str, Any]:
    """Validates a `LossScaler.state_dict` (naming keys as ``where['key']``) for a scaler of
    ``kind`` with ``config`` (dynamic) or ``static`` scale, and returns the values its
    ``load_state_dict`` would write, changing nothing."""
    if not isinstance(state, Mapping):
        raise ValueError(f"`{where}` must be a dict from LossScaler.state_dict(), got "
                         f"{type(state).__name__}.")
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"`{where}` (a loss-scaler state) is missing keys {missing}.")
    if state["kind"] != kind:
        raise ValueError(f"`{where}['kind']`: saved {state['kind']!r}, this scaler is "
                         f"{kind!r}; a checkpoint loads into the same kind of scale.")
    saved_cfg = check_config(state["config"], kind, f"{where}['config']")

    def number(key, integer):
        return scalar(state[key], f"{where}[{key!r}]", integer)

    scale = number("loss_scale", False)
    lo, hi = FLOAT32_MIN_NORMAL, FLOAT32_MAX
    if saved_cfg is not None:
        lo, hi = max(lo, saved_cfg["min_scale"]), min(hi, saved_cfg["max_scale"])
    if not lo <= scale <= hi:
        raise ValueError(f"`{where}['loss_scale']` must be a finite scale in [{lo!r}, "
                         f"{hi!r}], got {scale!r}.")
    interval = saved_cfg["growth_interval"] if saved_cfg else 1
    hysteresis = saved_cfg["hysteresis"] if saved_cfg else 1
    tracker = number("growth_tracker", True)
    hyst_left = number("hysteresis_left", True)
    skipped = number("skipped_steps", True)
    consecutive = number("consecutive_skips", True)
    for key, v, top in (("growth_tracker", tracker, interval - 1),
                        ("hysteresis_left", hyst_left, hysteresis),
                        ("skipped_steps", skipped, _INT32_MAX),
                        ("consecutive_skips", consecutive, skipped)):
        if not 0 <= v <= top:
            raise ValueError(f"`{where}[{key!r}]` must be an int in [0, {top}], got {v!r}.")
    last = state["last_finite"]
    if isinstance(last, torch.Tensor) and last.dtype == torch.bool and last.numel() == 1:
        last = bool(last)
    if not isinstance(last, bool) or last != (consecutive == 0):
        raise ValueError(f"`{where}['last_finite']` must be a bool, True exactly when "
                         f"consecutive_skips is 0, got {state['last_finite']!r}.")
    warm = number("warm_phase", True) if "warm_phase" in state else WARM_OFF
    if not WARM_OFF <= warm <= WARM_UP or (
            warm != WARM_OFF and not (saved_cfg or {}).get("warm_start", False)):
        raise ValueError(f"`{where}['warm_phase']` must be an int in [{WARM_OFF}, "
                         f"{WARM_UP}], and {WARM_OFF} unless the saved config has "
                         f"warm_start=True, got {state['warm_phase']!r}.")
    if kind == "dynamic" and config is not None:  # a dynamic scaler always has one
        c = config
        scale = min(max(scale, c.min_scale), c.max_scale)
        tracker, hyst_left = min(tracker, c.growth_interval - 1), min(hyst_left, c.hysteresis)
        warm = warm if c.warm_start else WARM_OFF
    else:
        scale, tracker, hyst_left = static, 0, 1
    return {"loss_scale": scale, "growth_tracker": tracker, "hysteresis_left": hyst_left,
            "skipped_steps": skipped, "consecutive_skips": consecutive, "last_finite": last,
            "warm_phase": warm}

