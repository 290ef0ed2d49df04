"""Colossal-AI's Booster vocabulary: ``mixed_precision`` names and config objects.

Colossal-AI's Booster tutorial spells a mode as a name (``Booster(mixed_precision=
"fp16")``) or as a frozen config object (``FP16TorchMixedPrecision(init_scale=2.**16)``).
Both translate here, through one table, into today's ``mode`` + config keys, which
`_mpfunc_common.amp_config.resolve_amp` validates and resolves. So the three spellings
of a mode (a Booster name, a config object, ``mode=`` plus keys) give the same plan in
both frameworks. No framework is imported here.

A config object has the seed tutorial's fields, in its order and with its defaults
(so positional calls port unchanged), then, keyword-only, the mode's other keys that
mpfunc accepts (``enabled``, ``dtype``, ``min_scale``, ...). It validates at
construction with the same errors as the keys, is frozen and hashable (a valid static
``jax.jit`` argument), and its ``repr`` round-trips.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from _mpfunc_common.amp_config import APEX_OPT_LEVELS, MODES, dtype_name, resolve_amp
from _mpfunc_common.fp8 import Fp8Recipe, resolve_recipe
from _mpfunc_common.scale_config import as_python_number
from _mpfunc_common.storage import check_state_dtype
from _mpfunc_common.suggest import did_you_mean

__all__ = [
    "MixedPrecisionConfig",
    "FP16TorchMixedPrecision",
    "FP16ApexMixedPrecision",
    "FP16NaiveMixedPrecision",
    "BF16MixedPrecision",
    "FP8MixedPrecision",
    "MIXED_PRECISION",
    "APEX_MODE_NAMES",
    "mode_and_config",
]

# How each field is normalised after validation, so that equal configs compare and
# hash equal and the repr is plain Python (NumPy/JAX scalars -> int/float, framework
# dtypes -> their names).
_INT_FIELDS = frozenset({"growth_interval", "hysteresis", "num_losses", "verbosity", "seed"})
_FLOAT_FIELDS = frozenset({
    "init_scale", "initial_scale", "growth_factor", "backoff_factor", "min_scale",
    "max_scale", "clip_grad", "min_loss_scale", "max_loss_scale", "loss_scale",
})
_DTYPE_FIELDS = frozenset({"dtype", "cast_model_type", "cast_model_outputs"})


def _normalise(name: str, value: Any) -> Any:
    if value is None:
        return None
    if name in _INT_FIELDS:
        return as_python_number(name, value, integer=True)
    if name in _FLOAT_FIELDS:
        if name == "loss_scale" and value == "dynamic":
            return value
        return as_python_number(name, value)
    if name in _DTYPE_FIELDS:
        return dtype_name(value, name)
    if name == "recipe":
        return resolve_recipe(value)
    if name == "state_dtype":
        return check_state_dtype(value)
    return value


def _literal(value: Any) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "float('inf')" if value > 0 else "float('-inf')"
    return repr(value)


@dataclasses.dataclass(frozen=True)
class MixedPrecisionConfig:
    """Base of the config objects: one subclass per mode (``mode``), named as in
    Colossal-AI (``booster_name`` is its Booster ``mixed_precision`` string)."""

    mode: ClassVar[str]
    booster_name: ClassVar[str]

    def __post_init__(self) -> None:
        config = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        resolve_amp(self.mode, config)  # the keys' own errors, word for word
        for name, value in config.items():
            object.__setattr__(self, name, _normalise(name, value))

    def to_config(self) -> dict[str, Any]:
        """The ``mode`` keys this object stands for: ``convert_to_amp(..., mode=obj.mode,
        **obj.to_config())`` is the same conversion as ``mixed_precision=obj``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __repr__(self) -> str:
        args = ", ".join(f"{f.name}={_literal(getattr(self, f.name))}"
                         for f in dataclasses.fields(self))
        return f"{type(self).__name__}({args})"


@dataclasses.dataclass(frozen=True, repr=False)
class FP16TorchMixedPrecision(MixedPrecisionConfig):
    """Mode ``"torch"`` (Booster ``"fp16"``): autocast float16, GradScaler's rule.

    Seed fields: init_scale, growth_factor, backoff_factor, growth_interval. mpfunc's
    keyword-only extras: ``enabled`` (False = plain float32) and ``dtype`` (the autocast
    dtype, ``"float16"`` or ``"bfloat16"``; a framework dtype is stored by name).

    Examples:
      >>> FP16TorchMixedPrecision(growth_interval=1000)
      FP16TorchMixedPrecision(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000, enabled=True, dtype='float16')
    """

    mode: ClassVar[str] = "torch"
    booster_name: ClassVar[str] = "fp16"

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    _: dataclasses.KW_ONLY
    enabled: bool = True
    dtype: str = "float16"


@dataclasses.dataclass(frozen=True, repr=False)
class FP16ApexMixedPrecision(MixedPrecisionConfig):
    """Mode ``"apex"`` (Booster ``"fp16_apex"``): apex's O0-O3, natively.

    Seed fields: every apex key (opt_level ... max_loss_scale), same order and defaults.
    mpfunc's keyword-only extra: ``enabled``. The properties (cast_model_type,
    patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale) override
    the opt level's table, as in apex.

    Examples:
      >>> FP16ApexMixedPrecision("O2").opt_level
      'O2'
    """

    mode: ClassVar[str] = "apex"
    booster_name: ClassVar[str] = "fp16_apex"

    opt_level: str | None = "O1"
    cast_model_type: str | None = None
    patch_torch_functions: bool | None = None
    keep_batchnorm_fp32: bool | str | None = None
    master_weights: bool | None = None
    loss_scale: float | str | None = None
    cast_model_outputs: str | None = None
    num_losses: int | None = 1
    verbosity: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24
    _: dataclasses.KW_ONLY
    enabled: bool = True


@dataclasses.dataclass(frozen=True, repr=False)
class FP16NaiveMixedPrecision(MixedPrecisionConfig):
    """Mode ``"naive"`` (Booster ``"fp16_naive"``): float16 params, float32 masters,
    the Megatron/Colossal hysteresis scaler.

    Seed fields, in the seed's order: log_num_zeros_in_grad, initial_scale,
    growth_factor, backoff_factor, hysteresis, max_scale, verbose (the seed gives them
    no defaults; these are Colossal's ``AMP_TYPE.NAIVE`` defaults). mpfunc's
    keyword-only extras: ``min_scale``, ``growth_interval``, ``clip_grad`` and
    ``warm_start`` (the scale's warm start; False is Colossal's exact trajectory).

    Examples:
      >>> FP16NaiveMixedPrecision(hysteresis=3).hysteresis
      3
    """

    mode: ClassVar[str] = "naive"
    booster_name: ClassVar[str] = "fp16_naive"

    log_num_zeros_in_grad: bool = False
    initial_scale: float = 2.0**32
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis: int = 2
    max_scale: float = 2.0**32
    verbose: bool = False
    _: dataclasses.KW_ONLY
    min_scale: float = 1.0
    growth_interval: int = 1000
    clip_grad: float = 0.0
    warm_start: bool = True


@dataclasses.dataclass(frozen=True, repr=False)
class BF16MixedPrecision(MixedPrecisionConfig):
    """Mode ``"bf16"`` (Booster ``"bf16"``): autocast bfloat16, no loss scale.

    The seed has no fields. mpfunc's keyword-only extras, for training without float32
    masters (`_mpfunc_common.storage`): ``master_weights`` (None: float32 params under
    autocast; ``"float32"``, ``"remainder"``, ``"kahan"`` or ``"stochastic"``: bfloat16
    params whose exact value lives there), ``state_dtype``, ``state_rounding``, ``seed``.

    Examples:
      >>> BF16MixedPrecision(master_weights="remainder", state_dtype="bf16").state_dtype
      'bfloat16'
    """

    mode: ClassVar[str] = "bf16"
    booster_name: ClassVar[str] = "bf16"

    _: dataclasses.KW_ONLY
    master_weights: str | None = None
    state_dtype: str | None = None
    state_rounding: str = "stochastic"
    seed: int = 0


@dataclasses.dataclass(frozen=True, repr=False)
class FP8MixedPrecision(MixedPrecisionConfig):
    """Mode ``"fp8"`` (Booster ``"fp8"``): bf16 everywhere except the matmuls of
    linear/dense layers, which run in fp8 with ``recipe`` (a preset name or an
    `Fp8Recipe`; stored resolved, so equal recipes give equal configs).

    Examples:
      >>> FP8MixedPrecision("delayed").recipe.amax_history_len
      1024
    """

    mode: ClassVar[str] = "fp8"
    booster_name: ClassVar[str] = "fp8"

    recipe: str | Fp8Recipe = "tensorwise"


# `mode="apex-O2"` spells `mode="apex", opt_level="O2"` (the demo table's names).
APEX_MODE_NAMES: dict[str, str] = {f"apex-{level}": level for level in APEX_OPT_LEVELS}

# Colossal-AI Booster's `mixed_precision` names, each with its config class: the name
# means the class with its defaults, i.e. exactly that mode with the seed's defaults.
MIXED_PRECISION: dict[str, type[MixedPrecisionConfig]] = {
    "fp16": FP16TorchMixedPrecision,
    "fp16_apex": FP16ApexMixedPrecision,
    "fp16_naive": FP16NaiveMixedPrecision,
    "bf16": BF16MixedPrecision,
    "fp8": FP8MixedPrecision,
}


def mode_and_config(
    mode: Any, mixed_precision: Any, config: Mapping[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """Translates ``convert_to_amp``'s ``mode`` / ``mixed_precision`` / ``**config`` into
    the mode and keys `resolve_amp` takes.

    ``mode`` and ``mixed_precision`` accept the same things: a mode (``"naive"``, an
    ``AMP_TYPE``), apex's level as ``"apex-O0"`` ... ``"apex-O3"`` (``"apex"`` with that
    ``opt_level``), a Booster name (``"fp16_naive"``) or a config object. At most one of
    the two may be given; neither means ``"torch"``. Keys may accompany a name, not an
    object (set them on the object).

    Raises:
      ValueError: both given, keys with a config object, an ``"apex-O2"`` with another
        ``opt_level``, or an unknown name (the message lists the valid ones and the
        closest).

    Examples:
      >>> mode_and_config(None, "fp16_naive", {"hysteresis": 3})[1]["hysteresis"]
      3
      >>> mode_and_config(None, FP16TorchMixedPrecision(growth_interval=10), {})[0]
      'torch'
      >>> mode_and_config("apex-O2", None, {"verbosity": 0})
      ('apex', {'verbosity': 0, 'opt_level': 'O2'})
    """
    arg = "mode"
    if mixed_precision is not None:
        if mode is not None:
            raise ValueError(
                f"`mode` ({mode!r}) and `mixed_precision` ({mixed_precision!r}) were both "
                "given; pass one of them."
            )
        mode, arg = mixed_precision, "mixed_precision"
    if mode is None:
        return "torch", dict(config)
    if isinstance(mode, MixedPrecisionConfig):
        if config:
            raise ValueError(
                f"config keys {sorted(config)} were given with a {type(mode).__name__} "
                f"object; set them on the object instead, e.g. "
                f"{type(mode).__name__}({sorted(config)[0]}=...) or "
                "dataclasses.replace(obj, ...)."
            )
        return mode.mode, mode.to_config()
    name = getattr(mode, "value", mode)  # an AMP_TYPE member
    if isinstance(name, str):
        if name.lower() in MIXED_PRECISION:
            cls = MIXED_PRECISION[name.lower()]
            return cls.mode, {**cls().to_config(), **config}
        if name.lower() in MODES:
            return mode, dict(config)
        apex = {k.lower(): k for k in APEX_MODE_NAMES}.get(name.lower())
        if apex is not None:
            level = APEX_MODE_NAMES[apex]
            given = config.get("opt_level", level)
            if given != level:
                raise ValueError(
                    f"`{arg}={mode!r}` sets opt_level {level!r}, and `opt_level={given!r}` "
                    f"was given too. Give the level once: `{arg}={mode!r}` alone, or "
                    f"`{arg}=\"apex\", opt_level=...` with the level you want.")
            return "apex", {**config, "opt_level": level}
    classes = ", ".join(c.__name__ for c in MIXED_PRECISION.values())
    modes, names = f"{list(MODES)}", f"{list(MIXED_PRECISION)}"
    first, other = (modes, f"a Booster name {names}") if arg == "mode" else (
        names, f"a mode {modes}")
    choices = [*MODES, *MIXED_PRECISION, *APEX_MODE_NAMES]
    raise ValueError(
        f"`{arg}` must be one of {first}, {other} or a config object ({classes}); "
        f"got {mode!r}{did_you_mean([name], choices)}. apex's levels are "
        f"`{arg}=\"apex\", opt_level=\"O2\"` or, the same, `{arg}=\"apex-O2\"` "
        f"({', '.join(APEX_MODE_NAMES)})."
    )
