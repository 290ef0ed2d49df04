"""The loss-scale rule's configuration, presets and validation (no framework imports).

`mpfunc.dynamic_scale` (JAX) and `mpfunc_torch`'s scaler (torch) both resolve their
arguments here, so a preset and its validation mean the same thing on both sides.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from collections.abc import Mapping
from typing import Any

from _mpfunc_common.suggest import did_you_mean

__all__ = [
    "ScaleConfig",
    "SCALE_PRESETS",
    "UPDATE_RULE",
    "FLOAT32_MIN_NORMAL",
    "FLOAT32_MAX",
    "DEFAULT_MIN_SCALE",
    "WARM_DROP",
    "WARM_CLIMB",
    "WARM_OFF",
    "WARM_START",
    "WARM_DOWN",
    "WARM_UP",
    "resolve_scale_config",
    "to_float32",
    "as_python_number",
]

# The smallest normal and the largest finite float32. A scale is always inside
# [FLOAT32_MIN_NORMAL, FLOAT32_MAX]: never 0, subnormal (XLA on CPU flushes those to 0,
# torch does not, so the two frameworks would diverge), inf or NaN.
FLOAT32_MIN_NORMAL = 2.0**-126
FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]

# The floor every preset uses unless `min_scale` is given (Megatron-LM's value). With a
# scale >= 1, unscaling multiplies by <= 1, so it cannot turn a finite gradient into an
# inf; below 1 an extra check after unscaling is needed (both sides do it then).
DEFAULT_MIN_SCALE = 1.0

# The warm start (`ScaleConfig.warm_start`): until the first finite step a skip divides
# the scale by 2**16 (a binary search's first cut of float16's useful 2**0..2**32); after
# such a drop the scale climbs x4 per finite step until its first overflow, which goes
# back to the last finite scale (or a finite step at the ceiling). Both are powers of two, so every product is exact.
WARM_DROP = 2.0**-16
WARM_CLIMB = 4.0
# Its phases, the state's ``warm_phase``. OFF: the plain rule (and every state saved
# before the warm start existed). START: no step yet. DOWN: skipped, no finite step yet.
# UP: climbing after the drop.
WARM_OFF, WARM_START, WARM_DOWN, WARM_UP = 0, 1, 2, 3

# The update rule, shared word for word by the JAX and torch docstrings: the code under
# their `.. code-block::` directive (indented one level more), then the prose.
UPDATE_RULE = """\
        # once per optimizer step; finite = every gradient leaf is finite (on every shard)
        if warm_phase == START and finite:               # warm_start=True only; a
            warm_phase = OFF                             # good initial scale is kept
        if warm_phase != OFF:                            # the warm start
            growth_tracker, hysteresis_left = 0, hysteresis
            top = min(max_scale, FLOAT32_MAX)
            if finite and loss_scale == top:             # nothing above to look for
                warm_phase = OFF
            elif finite:                                 # climb, x4 per finite step
                loss_scale = min(loss_scale * 4, top)
                warm_phase = UP
            elif warm_phase == UP:                       # the climb's first overflow:
                loss_scale = max(loss_scale / 4, min_scale)   # the last finite scale
                warm_phase = OFF                         # (or top / 4)
            else:                                        # no finite step yet
                loss_scale = max(loss_scale * 2**-16, min_scale)
                warm_phase = DOWN
        elif not finite:                                 # the step is skipped
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

    All arithmetic is float32: every hyperparameter is rounded to float32 once, at
    construction (a value that does not survive that rounding is a ValueError), and each
    product is rounded to the nearest float32. With power-of-two factors every product
    is exact, which is why the presets reproduce their anchors bit for bit. The initial
    scale is min(init_scale, max_scale), as apex does. min_scale defaults to 1.0 and is
    at least 2**-126 (the smallest normal float32), so the scale is never 0, subnormal,
    inf or NaN; GradScaler and apex have no floor and follow the same trajectory as
    long as theirs stays >= 1.

    warm_phase starts at START with warm_start=True (naive mode's default) and at OFF
    otherwise, where the rule is exactly Megatron's / GradScaler's. The warm start costs
    at most 3 skipped steps from 2**32 down to any overflow threshold >= 1, and settles
    within 2x below the scale the plain rule settles at (both on the powers of two from
    the initial scale; within 4x otherwise).
"""


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    """Hyperparameters of the dynamic loss-scale rule (see `UPDATE_RULE`).

    Build one with `from_preset` (``mpfunc_torch.ScaleConfig.from_preset``, for
    ``LossScaler(config=...)``), which rounds every float to float32 once and checks it;
    the fields are ``mpfunc.dynamic_scale``'s keyword arguments. ``max_scale=inf``
    means no ceiling; there is always a floor, ``min_scale`` >= 2**-126.
    ``warm_start``: search down, then up, for the scale until the first overflow after a
    finite step (see `UPDATE_RULE`); False in every preset, True in naive mode.

    Examples:
      >>> cfg = ScaleConfig.from_preset("naive", growth_interval=500)
      >>> cfg.init_scale, cfg.growth_interval, cfg.hysteresis, cfg.warm_start
      (4294967296.0, 500, 2, False)
    """

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float
    warm_start: bool = False

    @classmethod
    def from_preset(cls, preset: str = "torch", **overrides: Any) -> ScaleConfig:
        """The preset's config (``"torch"``, ``"apex"``, ``"naive"`` or ``"jmp"``) with
        the given fields overridden: ``init_scale``, ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``hysteresis``, ``min_scale``,
        ``max_scale``, ``warm_start``. Floats are rounded to float32 once and checked after rounding.

        Raises:
          ValueError: an unknown preset or field, or a value out of its range (named).
          TypeError: a value of the wrong type.
        """
        unknown = sorted(set(overrides) - set(_FIELDS))
        if unknown:
            raise ValueError(f"`{unknown[0]}` is not a loss-scale field; the fields are "
                             f"{list(_FIELDS)}{did_you_mean(unknown, _FIELDS)}.")
        return resolve_scale_config(preset, **overrides)

    @property
    def initial_scale(self) -> float:
        """The scale a fresh state starts at: ``min(init_scale, max_scale)``."""
        return min(self.init_scale, self.max_scale)

    @property
    def may_go_below_one(self) -> bool:
        """Whether the scale can fall below 1, where unscaling multiplies by more than 1
        and can turn a finite gradient into an inf (so a check after unscaling is due)."""
        return self.min_scale < 1.0 or self.initial_scale < 1.0


_FIELDS = tuple(f.name for f in dataclasses.fields(ScaleConfig))

SCALE_PRESETS: dict[str, ScaleConfig] = {
    # torch.amp.GradScaler defaults (GradScaler has no floor; ours is 1.0).
    "torch": ScaleConfig(2.0**16, 2.0, 0.5, 2000, 1, DEFAULT_MIN_SCALE, math.inf),
    # apex.amp LossScaler (dynamic): window 2000, ceiling 2**24 (apex: no floor; ours 1.0).
    "apex": ScaleConfig(2.0**16, 2.0, 0.5, 2000, 1, DEFAULT_MIN_SCALE, 2.0**24),
    # Megatron-LM / Colossal-AI naive DynamicGradScaler with Colossal's defaults.
    "naive": ScaleConfig(2.0**32, 2.0, 0.5, 1000, 2, 1.0, 2.0**32),
    # jmp.DynamicLossScale as jmp's README builds it: period 2000, factor 2, min 1.
    "jmp": ScaleConfig(2.0**15, 2.0, 0.5, 2000, 1, 1.0, math.inf),
}


def to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (inf beyond float32's range), as a float."""
    if math.isnan(value) or math.isinf(value):
        return value
    if abs(value) >= 2.0**128 * (1 - 2.0**-25):  # rounds past FLOAT32_MAX
        return math.copysign(math.inf, value)
    return struct.unpack("<f", struct.pack("<f", value))[0]


def as_python_number(name: str, value, *, integer: bool = False) -> int | float:
    """A hyperparameter as a Python int/float, from a Python, NumPy, JAX or torch scalar.

    Concrete 0-d arrays (``jnp.float32(2.**15)``, ``np.float32(2.0)``) are accepted, as jmp
    users write them; integral floats are accepted where an int is due
    (``growth_interval=5.``). Bools, strings, non-scalars and traced values are not.

    Raises:
      TypeError: naming ``name``, the expected type and what was found.
    """
    if isinstance(value, bool | str | bytes):
        kind = "an int" if integer else "a real number"
        raise TypeError(f"`{name}` must be {kind}, got {type(value).__name__}: {value!r}.")
    if not isinstance(value, numbers.Real):
        shape = getattr(value, "shape", None)
        dtype = str(getattr(value, "dtype", ""))
        if shape is None or tuple(shape) != () or "bool" in dtype or not (
            "float" in dtype or "int" in dtype
        ):
            kind = "an int" if integer else "a real number"
            raise TypeError(f"`{name}` must be {kind} (or a 0-d numeric array), got "
                            f"{type(value).__name__}: {value!r}.")
        try:
            value = value.item()
        except Exception as e:  # a jax tracer: hyperparameters must be concrete
            raise TypeError(
                f"`{name}` must be a concrete number, got a traced value "
                f"({type(value).__name__}); build the transformation outside `jit`/`grad` "
                "or pass a Python number."
            ) from e
    if integer:
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
            return int(math.trunc(value))  # numbers.Real has __trunc__, not __int__
        raise TypeError(f"`{name}` must be an int (an integral float like 5.0 is accepted), "
                        f"got {type(value).__name__}: {value!r}.")
    return float(value)


_CHECKS = (
    # key, description of the allowed range, predicate on the float32 value
    ("init_scale", "in [2**-126, 3.4e38] (a normal float32)",
     lambda v: FLOAT32_MIN_NORMAL <= v <= FLOAT32_MAX),
    ("min_scale", "in [2**-126, 3.4e38] (a normal float32; the default floor is 1.0)",
     lambda v: FLOAT32_MIN_NORMAL <= v <= FLOAT32_MAX),
    ("max_scale", "in [2**-126, 3.4e38] or inf",
     lambda v: FLOAT32_MIN_NORMAL <= v <= FLOAT32_MAX or v == math.inf),
    ("growth_factor", "> 1 and finite after rounding to float32",
     lambda v: 1.0 < v <= FLOAT32_MAX),
    ("backoff_factor", "in (0, 1) after rounding to float32",
     lambda v: 0.0 < v < 1.0),
)


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
    warm_start=None,
    names: Mapping[str, str] | None = None,
) -> ScaleConfig:
    """Returns the preset's config with every argument that is not None overriding it.

    Every float is rounded to float32 here, once, and checked after rounding: a value
    that overflows float32, rounds to 0 or to a subnormal, or a factor that rounds to
    1.0, is refused rather than silently changing the rule.

    Args:
      preset: ``"torch"``, ``"apex"``, ``"naive"`` or ``"jmp"``.
      init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
        max_scale: overrides (None keeps the preset's value). Python, NumPy or concrete
        JAX/torch scalars.
      warm_start: a bool, or None for the preset's (False).
      names: how the caller's user spells each key (e.g. ``{"min_scale":
        "min_loss_scale"}`` for apex), so that errors name what the user typed.

    Raises:
      ValueError: an unknown preset, or an argument out of its range; the message names
        the argument, what was expected and what was found.
      TypeError: an argument of the wrong type.
    """
    names = dict(names or {})

    def nm(key: str) -> str:
        return names.get(key, key)

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
    if warm_start is not None:
        if not isinstance(warm_start, bool):
            raise TypeError(f"`{nm('warm_start')}` must be a bool, got "
                            f"{type(warm_start).__name__}: {warm_start!r}.")
        values["warm_start"] = warm_start
    given = {}
    for name, value in overrides.items():
        if value is None:
            continue
        if name in ("growth_interval", "hysteresis"):
            values[name] = as_python_number(nm(name), value, integer=True)
        else:
            given[name] = as_python_number(nm(name), value)
            values[name] = to_float32(given[name])
    for key, allowed, ok in _CHECKS:
        v = values[key]
        overflowed = key in given and math.isfinite(given[key]) and math.isinf(v)
        if overflowed or not ok(v):
            raw = given.get(key, v)
            shown = f"{raw!r}" + (f" (float32: {v!r})" if raw != v and not math.isnan(raw) else "")
            raise ValueError(f"`{nm(key)}` must be {allowed}, got {shown}.")
    cfg = ScaleConfig(**values)
    for key, limit in (("growth_interval", 1), ("hysteresis", 1)):
        v = getattr(cfg, key)
        if v < limit:
            raise ValueError(f"`{nm(key)}` must be >= {limit}, got {v!r}.")
        if v > 2**31 - 1:
            raise ValueError(f"`{nm(key)}` must fit in int32 (<= 2**31 - 1), got {v!r}.")
    if cfg.min_scale > cfg.max_scale:
        raise ValueError(
            f"`{nm('min_scale')}` ({cfg.min_scale!r}) must be <= `{nm('max_scale')}` "
            f"({cfg.max_scale!r})."
        )
    if cfg.initial_scale < cfg.min_scale:
        raise ValueError(
            f"`{nm('init_scale')}` ({cfg.init_scale!r}) must be >= `{nm('min_scale')}` "
            f"({cfg.min_scale!r})."
        )
    return cfg
