"""The AMP modes, their config keys, defaults and apex's opt-level table.

Shared by `mpfunc_torch.convert_to_amp` and `mpfunc.convert_to_amp`, so a mode means
the same thing in both frameworks. No framework is imported here: dtypes are names
(``"float16"``, ``"bfloat16"``, ``"float32"``) that each side maps to its own dtype.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from _mpfunc_common.apex_lists import APEX_O1_FP16_FUNCTIONS, APEX_O1_FP32_FUNCTIONS
from _mpfunc_common.fp8 import Fp8Recipe, resolve_recipe
from _mpfunc_common.scale_config import (
    FLOAT32_MAX,
    FLOAT32_MIN_NORMAL,
    ScaleConfig,
    resolve_scale_config,
    to_float32,
)
from _mpfunc_common.storage import refuse_storage_elsewhere, resolve_bf16_storage
from _mpfunc_common.suggest import did_you_mean

__all__ = [
    "MODES",
    "MODE_DEFAULTS",
    "APEX_OPT_LEVELS",
    "APEX_O1_FP32_FUNCTIONS",
    "APEX_O1_FP16_FUNCTIONS",
    "AmpPlan",
    "resolve_amp",
    "dtype_name",
    "check_bool",
]

MODES = ("torch", "apex", "naive", "bf16", "fp8")

# Every key each mode accepts, with its default (the seed docs' defaults).
MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "torch": {
        "init_scale": 2.0**16,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "enabled": True,
        "dtype": "float16",
    },
    "apex": {
        "enabled": True,
        "opt_level": "O1",
        "cast_model_type": None,
        "patch_torch_functions": None,
        "keep_batchnorm_fp32": None,
        "master_weights": None,
        "loss_scale": None,
        "cast_model_outputs": None,
        "num_losses": 1,
        "verbosity": 1,
        "min_loss_scale": None,
        "max_loss_scale": 2.0**24,
    },
    "naive": {
        "log_num_zeros_in_grad": False,
        "initial_scale": 2.0**32,
        "min_scale": 1.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 1000,
        "hysteresis": 2,
        "max_scale": 2.0**32,
        "clip_grad": 0.0,
        "verbose": False,
        # The scale's warm start (scale_config.UPDATE_RULE): False is Colossal-AI's and
        # Megatron's exact trajectory, which skips ~17 steps from 2**32 at the start.
        "warm_start": True,
    },
    # bf16's keys: training without float32 masters (_mpfunc_common.storage).
    "bf16": {"master_weights": None, "state_dtype": None, "state_rounding": "stochastic",
             "seed": 0},
    # bf16 for everything but the matmuls of linear/dense layers, which run in fp8.
    "fp8": {"recipe": "tensorwise"},
}

# apex's opt-level table: the properties each level sets before overrides.
APEX_OPT_LEVELS: dict[str, dict[str, Any]] = {
    "O0": dict(cast_model_type="float32", patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type="float16", patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type="float16", patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}

_DTYPE_NAMES = {
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16",
    "torch.float16": "float16", "torch.half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "torch.float32": "float32", "torch.float": "float32",
}


def dtype_name(value: Any, arg: str, allowed=("float16", "bfloat16", "float32")) -> str | None:
    """Canonical name of a dtype given as a name or a framework dtype (``None`` passes)."""
    if value is None:
        return None
    if isinstance(value, type) and value.__module__ != "builtins":
        key = value.__name__.lower()  # a scalar type: jnp.bfloat16, np.float16
    else:
        key = str(getattr(value, "name", None) or value).lower()
    key = {"dtype(float16)": "float16"}.get(key, key)
    name = _DTYPE_NAMES.get(key)
    if name is None or name not in allowed:
        raise ValueError(f"`{arg}` must be one of {list(allowed)}, got {value!r}.")
    return name


@dataclasses.dataclass(frozen=True)
class AmpPlan:
    """What a mode does, resolved from its name and config, framework-neutral.

    Attributes:
      mode: ``"torch"``, ``"apex"``, ``"naive"``, ``"bf16"`` or ``"fp8"``.
      enabled: False turns the whole mode into plain float32 training.
      opt_level: apex's level (apex mode only).
      autocast_dtype: op-level autocast dtype, or None for no autocast.
      apex_fp32_functions: enforce apex O1's fp32 list on top of autocast.
      cast_model_type: dtype the model's params are cast to, or None.
      keep_norm_fp32: keep normalisation layers' params (and compute) in float32.
      master_weights: keep float32 master weights for half-precision params.
      master_storage: where half params' exact values live: ``"float32"`` (masters),
        ``"remainder"``, ``"kahan"``, ``"stochastic"``, or None (no half params, or none).
      state_dtype: the optimizer state's storage dtype (None: the optimizer's own),
        rounded by ``state_rounding`` with random bits seeded by ``seed``.
      scale_kind: ``"dynamic"``, ``"static"`` or ``"none"`` (scale 1).
      scale_config: the dynamic rule's config (``scale_kind == "dynamic"``).
      static_scale: the fixed scale (``scale_kind == "static"``).
      cast_model_outputs: dtype the model outputs are cast to, or None.
      num_losses: independent loss scales (apex ``num_losses``).
      clip_grad: global-norm clip of unscaled grads, 0 = off (naive).
      log_num_zeros_in_grad: count zero grads each step (naive).
      verbose: log what the conversion did (INFO, the `mpfunc` / `mpfunc_torch` logger).
      fp8_recipe: the fp8 mode's `Fp8Recipe` (linear/dense matmuls in fp8), or None.
    """

    mode: str
    enabled: bool = True
    opt_level: str | None = None
    autocast_dtype: str | None = None
    apex_fp32_functions: bool = False
    cast_model_type: str | None = None
    keep_norm_fp32: bool = False
    master_weights: bool = False
    scale_kind: str = "none"
    scale_config: ScaleConfig | None = None
    static_scale: float = 1.0
    cast_model_outputs: str | None = None
    num_losses: int = 1
    clip_grad: float = 0.0
    log_num_zeros_in_grad: bool = False
    verbose: bool = False
    fp8_recipe: Fp8Recipe | None = None
    master_storage: str | None = None
    state_dtype: str | None = None
    state_rounding: str = "stochastic"
    seed: int = 0

    def __post_init__(self):
        if self.master_weights and self.master_storage is None:
            object.__setattr__(self, "master_storage", "float32")

    @property
    def keeps_masters(self) -> bool:
        """Whether the optimizer steps float32 masters in place of half params (kept as
        float32 tensors, or below float32 by a bf16 storage: remainder, kahan,
        stochastic)."""
        return self.enabled and (self.master_weights
                                 or self.master_storage not in (None, "float32"))

    def describe(self) -> str:
        if not self.enabled:
            return f"mode={self.mode}: disabled (plain float32)"
        parts = [f"mode={self.mode}" + (f" {self.opt_level}" if self.opt_level else "")]
        parts.append(f"autocast={self.autocast_dtype}")
        if self.fp8_recipe is not None:
            parts.append(f"fp8 linear matmuls ({self.fp8_recipe.describe()})")
        if self.apex_fp32_functions:
            parts.append("apex O1 fp32 list")
        parts.append(f"cast_model_type={self.cast_model_type}")
        if self.cast_model_type:
            parts.append(f"keep_norm_fp32={self.keep_norm_fp32}")
        parts.append(f"master_weights={self.master_weights}")
        if self.master_storage not in (None, "float32") or self.state_dtype:
            parts.append(f"storage={self.master_storage}, state_dtype={self.state_dtype} "
                         f"({self.state_rounding}), seed={self.seed}")
        if self.scale_kind == "dynamic" and (c := self.scale_config) is not None:
            parts.append(
                f"loss_scale=dynamic(init={c.initial_scale:g}, growth={c.growth_factor:g}, "
                f"backoff={c.backoff_factor:g}, interval={c.growth_interval}, "
                f"hysteresis={c.hysteresis}, min={c.min_scale:g}, max={c.max_scale:g}"
                + (", warm start)" if c.warm_start else ")")
            )
        else:
            parts.append(f"loss_scale={self.scale_kind}"
                         + (f"({self.static_scale:g})" if self.scale_kind == "static" else ""))
        if self.cast_model_outputs:
            parts.append(f"outputs={self.cast_model_outputs}")
        if self.num_losses > 1:
            parts.append(f"num_losses={self.num_losses}")
        if self.clip_grad:
            parts.append(f"clip_grad={self.clip_grad:g}")
        return ", ".join(parts)


def check_bool(name: str, value: Any) -> bool:
    """``value``, which must be True or False (not 1, not "yes"); errors name ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {type(value).__name__}: {value!r}.")
    return value


def _bool(config: Mapping[str, Any], key: str) -> bool:
    return check_bool(key, config[key])


def _opt_bool(config: Mapping[str, Any], key: str) -> bool | None:
    value = config[key]
    if value is None:
        return None
    if isinstance(value, str) and value in ("True", "False"):  # apex accepts strings
        return value == "True"
    if not isinstance(value, bool):
        raise TypeError(f"`{key}` must be a bool or None, got {type(value).__name__}: {value!r}.")
    return value


def _check_keys(mode: str, config: Mapping[str, Any]) -> dict[str, Any]:
    valid = MODE_DEFAULTS[mode]
    unknown = sorted(set(config) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown config key(s) {unknown} for mode {mode!r}{did_you_mean(unknown, valid)}; "
            f"valid keys for this mode: {sorted(valid) if valid else 'none'}.")
    merged = dict(valid)
    merged.update(config)
    return merged


def resolve_amp(mode: Any, config: Mapping[str, Any]) -> AmpPlan:
    """Validates ``config`` for ``mode`` and resolves it into an `AmpPlan`.

    Raises:
      ValueError: an unknown mode, an unknown key for the mode (listing the valid ones),
        an unknown opt level, or an inconsistent config.
      TypeError: a value of the wrong type.
    """
    mode_name = getattr(mode, "value", mode)
    if not isinstance(mode_name, str) or mode_name.lower() not in MODES:
        raise ValueError(f"`mode` must be one of {list(MODES)}, got {mode!r}.")
    mode_name = mode_name.lower()
    refuse_storage_elsewhere(mode_name, config)
    cfg = _check_keys(mode_name, config)
    if "enabled" in cfg and not _bool(cfg, "enabled"):
        # A disabled mode still gets every value checked, so that turning it on later
        # cannot be the first time a typo in its config surfaces.
        check = {**config, "enabled": True}
        if mode_name == "torch" and cfg["dtype"] is None:
            check["dtype"] = "float16"  # dtype=None is how plain float32 is spelled
        resolve_amp(mode_name, check)
        return AmpPlan(mode=mode_name, enabled=False,
                       **({"opt_level": cfg["opt_level"]} if mode_name == "apex" else {}))

    if mode_name == "torch":
        scale = resolve_scale_config(
            "torch",
            init_scale=cfg["init_scale"],
            growth_factor=cfg["growth_factor"],
            backoff_factor=cfg["backoff_factor"],
            growth_interval=cfg["growth_interval"],
        )
        if cfg["dtype"] is None:
            raise ValueError("`dtype` must be 'float16' or 'bfloat16' (the autocast dtype), "
                             "got None; for plain float32 training pass enabled=False.")
        dtype = dtype_name(cfg["dtype"], "dtype", allowed=("float16", "bfloat16"))
        return AmpPlan(mode="torch", autocast_dtype=dtype, scale_kind="dynamic",
                       scale_config=scale)

    if mode_name == "bf16":
        return AmpPlan(mode="bf16", scale_kind="none", **resolve_bf16_storage(cfg))

    if mode_name == "fp8":
        return AmpPlan(mode="fp8", autocast_dtype="bfloat16", scale_kind="none",
                       fp8_recipe=resolve_recipe(cfg["recipe"]))

    if mode_name == "naive":
        for key in ("log_num_zeros_in_grad", "verbose", "warm_start"):
            _bool(cfg, key)
        clip = cfg["clip_grad"]
        if isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not (
            math.isfinite(clip) and float(clip) >= 0
        ):
            raise ValueError(f"`clip_grad` must be a finite number >= 0 (0 = off), got {clip!r}.")
        scale = resolve_scale_config(
            "naive",
            init_scale=cfg["initial_scale"],
            growth_factor=cfg["growth_factor"],
            backoff_factor=cfg["backoff_factor"],
            growth_interval=cfg["growth_interval"],
            hysteresis=cfg["hysteresis"],
            min_scale=cfg["min_scale"],
            max_scale=cfg["max_scale"],
            warm_start=cfg["warm_start"],
            names={"init_scale": "initial_scale"},
        )
        return AmpPlan(
            mode="naive", cast_model_type="float16", keep_norm_fp32=False,
            master_weights=True, scale_kind="dynamic", scale_config=scale,
            cast_model_outputs="float32", clip_grad=float(clip),
            log_num_zeros_in_grad=cfg["log_num_zeros_in_grad"], verbose=cfg["verbose"],
        )

    # apex
    level = cfg["opt_level"]
    if level not in APEX_OPT_LEVELS:
        raise ValueError(f"`opt_level` must be one of {sorted(APEX_OPT_LEVELS)}, got {level!r}"
                         f"{did_you_mean([level], APEX_OPT_LEVELS)}.")
    props = dict(APEX_OPT_LEVELS[level])
    for key in ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                "master_weights", "loss_scale"):
        if cfg[key] is not None:
            props[key] = cfg[key]
    num_losses = cfg["num_losses"]
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"`num_losses` must be an int >= 1, got {num_losses!r}.")
    verbosity = cfg["verbosity"]
    if isinstance(verbosity, bool) or not isinstance(verbosity, int) or verbosity < 0:
        raise ValueError(f"`verbosity` must be an int >= 0, got {verbosity!r}.")
    cast_type = dtype_name(props["cast_model_type"], "cast_model_type")
    if cast_type == "float32":
        cast_type = None if level != "O0" else "float32"
    patch = props["patch_torch_functions"]
    if not isinstance(patch, bool):
        raise TypeError(f"`patch_torch_functions` must be a bool, got {patch!r}.")
    cfg_keep = dict(props)
    keep_bn = _opt_bool(cfg_keep, "keep_batchnorm_fp32")
    master = _opt_bool(cfg_keep, "master_weights")
    half_model = cast_type in ("float16", "bfloat16")
    if master and not half_model:
        raise ValueError(
            "`master_weights=True` needs a half-precision model (`cast_model_type` float16 "
            f"or bfloat16); at opt_level {level} the params are float32 already."
        )
    if patch and half_model:
        raise ValueError(
            "`patch_torch_functions=True` (autocast) with a half-precision "
            "`cast_model_type` is not a supported combination; use O1 (autocast, float32 "
            "params) or O2 (half params, master weights)."
        )
    loss_scale = props["loss_scale"]
    min_s, max_s = cfg["min_loss_scale"], cfg["max_loss_scale"]
    if loss_scale == "dynamic":
        scale_cfg = resolve_scale_config(
            "apex", min_scale=min_s, max_scale=max_s,
            names={"min_scale": "min_loss_scale", "max_scale": "max_loss_scale"},
        )
        kind, static = "dynamic", 1.0
    elif isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool):
        static = to_float32(float(loss_scale))
        if not FLOAT32_MIN_NORMAL <= static <= FLOAT32_MAX:
            raise ValueError("`loss_scale` must be 'dynamic' or a number in [2**-126, 3.4e38] "
                             f"(a normal float32), got {loss_scale!r}.")
        scale_cfg, kind = None, "static"
        if min_s is not None:
            # apex silently ignores a floor with a static scale; we say so instead.
            raise ValueError(
                "`min_loss_scale` only applies with loss_scale='dynamic'; "
                f"got loss_scale={loss_scale!r}."
            )
    else:
        raise ValueError(f"`loss_scale` must be 'dynamic' or a number > 0, got {loss_scale!r}.")
    outputs = dtype_name(cfg["cast_model_outputs"], "cast_model_outputs")
    if outputs is None and half_model:
        outputs = "float32"  # apex casts O2/O3 outputs back to float32 by default
    return AmpPlan(
        mode="apex",
        opt_level=level,
        autocast_dtype="float16" if patch else None,
        apex_fp32_functions=patch,
        cast_model_type=cast_type,
        keep_norm_fp32=bool(keep_bn) if half_model else False,
        master_weights=bool(master),
        scale_kind=kind,
        scale_config=scale_cfg,
        static_scale=static,
        cast_model_outputs=outputs,
        num_losses=num_losses,
        verbose=verbosity > 0,
    )
