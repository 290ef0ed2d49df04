"""The loss-scale rule's configuration, presets and validation (no framework imports).

`mpfunc.dynamic_scale` (JAX) and `mpfunc_torch`'s scaler (torch) both resolve their
arguments here, so a preset and its validation mean the same thing on both sides.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

__all__ = ["ScaleConfig", "SCALE_PRESETS", "UPDATE_RULE", "resolve_scale_config"]

# The update rule, shared word for word by the JAX and torch docstrings.
UPDATE_RULE = """\
    # once per optimizer step; finite = every gradient leaf is finite (on every shard)
    if not finite:                                   # the step is skipped
        growth_tracker = 0
        hysteresis_left = max(hysteresis_left - 1, 0)
        if hysteresis_left == 0:
            loss_scale = max(loss_scale * backoff_factor, min_scale)
    else:
        growth_tracker += 1
        if growth_tracker == growth_interval:
            growth_tracker = 0
            hysteresis_left = hysteresis              # refills only when the scale grows
            grown = min(loss_scale * growth_factor, max_scale)
            if isfinite(grown):
                loss_scale = grown

    All arithmetic is float32: the factors are cast to float32 first and each product
    is rounded to the nearest float32. With power-of-two factors every product is exact,
    which is why the presets reproduce their anchors bit for bit. The initial scale is
    min(init_scale, max_scale), as apex does.
"""


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    """Hyperparameters of the dynamic loss-scale rule (see `UPDATE_RULE`).

    ``min_scale=0.0`` means no floor and ``max_scale=inf`` no ceiling.
    """

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float

    @property
    def initial_scale(self) -> float:
        return min(self.init_scale, self.max_scale)


SCALE_PRESETS: dict[str, ScaleConfig] = {
    # torch.amp.GradScaler defaults.
    "torch": ScaleConfig(2.0**16, 2.0, 0.5, 2000, 1, 0.0, math.inf),
    # apex.amp LossScaler (dynamic): window 2000, no floor, ceiling 2**24.
    "apex": ScaleConfig(2.0**16, 2.0, 0.5, 2000, 1, 0.0, 2.0**24),
    # Megatron-LM / Colossal-AI naive DynamicGradScaler with Colossal's defaults.
    "naive": ScaleConfig(2.0**32, 2.0, 0.5, 1000, 2, 1.0, 2.0**32),
}


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}: {value!r}.")
    return float(value)


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}: {value!r}.")
    return int(value)


def resolve_scale_config(
    preset: str = "torch",
    *,
    init_scale=None,
    growth_factor=None,
    backoff_factor=None,
    growth_interval=None,
    hysteresis=None,
    min_scale=None,
    max_scale=None,
) -> ScaleConfig:
    """Returns the preset's config with every argument that is not None overriding it.

    Raises:
      ValueError: an unknown preset, or an argument out of its range; the message names
        the argument, what was expected and what was found.
      TypeError: an argument of the wrong type.
    """
    if not isinstance(preset, str) or preset not in SCALE_PRESETS:
        raise ValueError(
            f"`preset` must be one of {sorted(SCALE_PRESETS)}, got {preset!r}."
        )
    base = SCALE_PRESETS[preset]
    overrides = dict(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
    )
    values = dataclasses.asdict(base)
    for name, value in overrides.items():
        if value is None:
            continue
        if name in ("growth_interval", "hysteresis"):
            values[name] = _int(name, value)
        else:
            values[name] = _real(name, value)
    cfg = ScaleConfig(**values)
    if not (math.isfinite(cfg.init_scale) and cfg.init_scale > 0):
        raise ValueError(f"`init_scale` must be finite and > 0, got {cfg.init_scale!r}.")
    if not (math.isfinite(cfg.growth_factor) and cfg.growth_factor > 1):
        raise ValueError(f"`growth_factor` must be finite and > 1, got {cfg.growth_factor!r}.")
    if not (0 < cfg.backoff_factor < 1):
        raise ValueError(f"`backoff_factor` must be in (0, 1), got {cfg.backoff_factor!r}.")
    if cfg.growth_interval < 1:
        raise ValueError(f"`growth_interval` must be >= 1, got {cfg.growth_interval!r}.")
    if cfg.growth_interval > 2**31 - 1:
        raise ValueError(f"`growth_interval` must fit in int32, got {cfg.growth_interval!r}.")
    if cfg.hysteresis < 1:
        raise ValueError(f"`hysteresis` must be >= 1, got {cfg.hysteresis!r}.")
    if cfg.hysteresis > 2**31 - 1:
        raise ValueError(f"`hysteresis` must fit in int32, got {cfg.hysteresis!r}.")
    if not (cfg.min_scale >= 0 and math.isfinite(cfg.min_scale)):
        raise ValueError(f"`min_scale` must be finite and >= 0, got {cfg.min_scale!r}.")
    if not cfg.max_scale > 0:
        raise ValueError(f"`max_scale` must be > 0, got {cfg.max_scale!r}.")
    if cfg.min_scale > cfg.max_scale:
        raise ValueError(
            f"`min_scale` ({cfg.min_scale!r}) must be <= `max_scale` ({cfg.max_scale!r})."
        )
    if cfg.initial_scale < cfg.min_scale:
        raise ValueError(
            f"`init_scale` ({cfg.init_scale!r}) must be >= `min_scale` ({cfg.min_scale!r})."
        )
    return cfg
