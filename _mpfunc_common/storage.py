"""Training without float32 masters: the storage and state-dtype names, shared by both sides.

How the full-precision value of a half-precision parameter is kept (``master_weights``),
in which dtype the optimizer's state is stored (``state_dtype``) and how it is rounded
there (``state_rounding``), with one validation and one set of errors for mode
``"bf16"``'s config keys (`_mpfunc_common.amp_config`), for JAX's
``mpfunc.master_weights`` / ``mpfunc.state_dtype`` and for the torch optimizer. The bit
rules themselves are in `_mpfunc_common.rounding`. No framework is imported here.

Bytes per parameter of persistent state (params + masters or their stand-in + Adam's two
moments; gradients not counted):

=============  ======================  ==========  ===========  ============
storage        kept beside the param   f32 state   bf16 state   8-bit state
=============  ======================  ==========  ===========  ============
float32        float32 master (4)      14          10           8 + scales
remainder      int16 remainder (2)     12          8            6 + scales
kahan          bf16 compensation (2)   12          8            6 + scales
stochastic     nothing                 10          6            4 + scales
=============  ======================  ==========  ===========  ============

(8-bit state: one float32 scale per block of `STATE_BLOCK` = 128 elements per moment,
+0.03125 bytes per parameter per moment.)
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Literal, overload

from _mpfunc_common.suggest import closest, did_you_mean

__all__ = [
    "MASTER_STORAGES",
    "PARAM_DTYPES",
    "STATE_DTYPES",
    "BLOCK_STATE_DTYPES",
    "STATE_ROUNDINGS",
    "STATE_BLOCK",
    "SEED_MAX",
    "check_master_storage",
    "check_param_dtype",
    "check_state_dtype",
    "check_state_rounding",
    "check_seed",
    "check_storage_combination",
    "refuse_storage_elsewhere",
    "resolve_bf16_storage",
    "rounds_stochastically",
]

# How the exact value of a half-precision param is kept between steps.
MASTER_STORAGES = ("float32", "remainder", "kahan", "stochastic")
# The param dtypes each storage works with. remainder: a float32 master splits into a
# bfloat16 and 16 bits exactly, but not into a float16 (5 exponent bits) and 16 bits.
# stochastic: float16's rounding is not a 16-bit truncation (its grid changes below
# 2**-14 and the exponent field is narrower); it is not defined here.
PARAM_DTYPES = {
    "float32": ("bfloat16", "float16"),
    "remainder": ("bfloat16",),
    "kahan": ("bfloat16", "float16"),
    "stochastic": ("bfloat16",),
}
STATE_DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")
# 8-bit state: fp8 codes with one float32 scale per block of STATE_BLOCK elements of the
# flattened leaf (`_mpfunc_common.rounding.quantize_state_8bit`).
BLOCK_STATE_DTYPES = ("float8_e4m3fn", "float8_e5m2")
STATE_BLOCK = 128
# The default is stochastic: rounded to nearest, Adam's second moment freezes in
# bfloat16 (b2 * nu moves nu by 1e-3 of itself, below half of bfloat16's 2**-8 relative
# spacing, so both its decay and (1 - b2) * g**2 < nu * 2**-9 round away).
STATE_ROUNDINGS = ("stochastic", "nearest")
SEED_MAX = 2**32 - 1

_STATE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
}
_FLOAT16 = ("float16", "fp16", "f16", "half")

_FLOAT16_STATE = (
    "float16 optimizer state is refused: its 5 exponent bits cannot hold Adam's second "
    "moment (its step term (1 - b2) * g**2 rounds to 0 below |g| = 5e-3 with b2 = 0.999, "
    "and g**2 overflows above |g| = 256). Use 'bfloat16' (the same 2 bytes with "
    "float32's range) or an 8-bit block format ('float8_e4m3fn', 'float8_e5m2'), whose "
    "per-block scales carry the range."
)


def _dtype_key(value: Any) -> str:
    """A dtype given as a name, a framework dtype or a scalar type, as a lower-case name."""
    if isinstance(value, type) and value.__module__ != "builtins":
        key = value.__name__  # a scalar type: jnp.bfloat16, np.float16
    else:
        key = str(getattr(value, "name", None) or value)
    key = key.lower()
    return key[len("torch."):] if key.startswith("torch.") else key


@overload
def check_master_storage(value: Any, name: str = ..., *, allow_none: Literal[False]) -> str: ...
@overload
def check_master_storage(value: Any, name: str = ..., allow_none: bool = ...) -> str | None: ...
def check_master_storage(value: Any, name: str = "master_weights",
                         allow_none: bool = True) -> str | None:
    """``value`` as one of `MASTER_STORAGES` (or None where ``allow_none``).

    Examples:
      >>> check_master_storage("remainder")
      'remainder'
      >>> check_master_storage("kahn")
      Traceback (most recent call last):
      ...
      ValueError: `master_weights` must be None (float32 params, bf16 autocast) or one of ['float32', 'remainder', 'kahan', 'stochastic'], got 'kahn' (did you mean `kahan`?).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value in MASTER_STORAGES:
        return value
    what = (f"None (float32 params, bf16 autocast) or one of {list(MASTER_STORAGES)}"
            if allow_none else f"one of {list(MASTER_STORAGES)}")
    hint = ""
    if isinstance(value, bool):
        hint = (" A bool does not say where the master lives: 'float32' keeps float32 "
                "masters (apex's master_weights=True), None keeps float32 params.")
    raise ValueError(f"`{name}` must be {what}, got {value!r}"
                     f"{did_you_mean([value], MASTER_STORAGES)}.{hint}")


def check_param_dtype(storage: str, dtype: Any, name: str = "params") -> str:
    """The param dtype name, if ``storage`` works with it; else a ValueError saying why."""
    key = _dtype_key(dtype)
    key = "float16" if key in _FLOAT16 else "bfloat16" if key in ("bf16", "bfloat16") else key
    if key in PARAM_DTYPES[storage]:
        return key
    why = {
        "remainder": "a float32 master splits exactly into a bfloat16 and a 16-bit "
                     "remainder, not into a float16 (its 5 exponent bits cover less "
                     "than float32's range)",
        "stochastic": "stochastic rounding to float16 is not a 16-bit truncation of "
                      "float32 (its grid changes below 2**-14), and is not defined",
    }.get(storage, "")
    raise ValueError(
        f"`{name}` of dtype {key} cannot use storage {storage!r}; it works with "
        f"{list(PARAM_DTYPES[storage])} params" + (f": {why}." if why else ".")
        + (" For float16 params use 'kahan' or 'float32' (with loss scaling)."
           if key == "float16" else ""))


@overload
def check_state_dtype(value: Any, name: str = ..., *, allow_none: Literal[False]) -> str: ...
@overload
def check_state_dtype(value: Any, name: str = ..., allow_none: bool = ...) -> str | None: ...
def check_state_dtype(value: Any, name: str = "state_dtype",
                      allow_none: bool = True) -> str | None:
    """``value`` (a name, an alias or a framework dtype) as one of `STATE_DTYPES`.

    Examples:
      >>> check_state_dtype("bf16"), check_state_dtype("e4m3"), check_state_dtype(None)
      ('bfloat16', 'float8_e4m3fn', None)
    """
    if value is None and allow_none:
        return None
    key = _dtype_key(value)
    if key in _STATE_ALIASES:
        return _STATE_ALIASES[key]
    if key in _FLOAT16:
        raise ValueError(f"`{name}`={value!r}: {_FLOAT16_STATE}")
    none = "None (the inner optimizer's own float32) or " if allow_none else ""
    raise ValueError(f"`{name}` must be {none}one of {list(STATE_DTYPES)}, got {value!r}"
                     f"{did_you_mean([key], _STATE_ALIASES)}.")


def check_state_rounding(value: Any, name: str = "state_rounding") -> str:
    """``value`` as one of `STATE_ROUNDINGS`."""
    if isinstance(value, str) and value in STATE_ROUNDINGS:
        return value
    raise ValueError(f"`{name}` must be one of {list(STATE_ROUNDINGS)}, got {value!r}"
                     f"{did_you_mean([value], STATE_ROUNDINGS)}.")


def check_seed(value: Any, name: str = "seed") -> int:
    """``value`` as an int in [0, 2**32 - 1] (the random bits take it modulo 2**32)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int in [0, {SEED_MAX}], got "
                        f"{type(value).__name__}: {value!r}.")
    if not 0 <= int(value) <= SEED_MAX:
        raise ValueError(f"`{name}` must be an int in [0, {SEED_MAX}], got {int(value)}.")
    return int(value)


def rounds_stochastically(storage: str | None, state_dtype: str | None,
                          state_rounding: str) -> bool:
    """Whether anything draws random bits: stochastic params, or state stored below
    float32 and rounded stochastically."""
    rounded_state = state_dtype not in (None, "float32")
    return storage == "stochastic" or (rounded_state and state_rounding == "stochastic")


def check_storage_combination(storage: str | None, state_dtype: str | None,
                              state_rounding: str, seed: int) -> None:
    """Values that would have no effect are errors (a default value is never one).

    A non-default ``state_rounding`` needs state stored below float32; a nonzero
    ``seed`` needs something rounded stochastically. The defaults ("stochastic", 0)
    are accepted anywhere, so a config object carrying them is always valid.
    """
    if state_rounding != STATE_ROUNDINGS[0] and state_dtype in (None, "float32"):
        raise ValueError(
            f"`state_rounding={state_rounding!r}` has no effect: with "
            f"`state_dtype={state_dtype!r}` the optimizer state stays float32 and is never "
            "rounded. Set `state_dtype` ('bfloat16' or an 8-bit format) or drop the key.")
    if seed != 0 and not rounds_stochastically(storage, state_dtype, state_rounding):
        raise ValueError(
            f"`seed={seed}` has no effect: nothing is rounded stochastically "
            f"(master_weights={storage!r}, state_dtype={state_dtype!r}, "
            f"state_rounding={state_rounding!r}). It seeds master_weights='stochastic' "
            "and state stored below float32 with state_rounding='stochastic'.")


def resolve_bf16_storage(config: dict[str, Any]) -> dict[str, Any]:
    """Mode ``"bf16"``'s storage keys (defaults merged in) -> `AmpPlan` fields.

    ``master_weights`` set makes the params bfloat16 (a half-param mode: no autocast,
    outputs float32, no loss scale); None keeps today's autocast mode with float32
    params. ``state_dtype`` applies either way.
    """
    storage = check_master_storage(config["master_weights"])
    state = check_state_dtype(config["state_dtype"])
    rounding = check_state_rounding(config["state_rounding"])
    seed = check_seed(config["seed"])
    check_storage_combination(storage, state, rounding, seed)
    out: dict[str, Any] = dict(master_storage=storage, state_dtype=state,
                               state_rounding=rounding, seed=seed)
    if storage is None:
        return {**out, "autocast_dtype": "bfloat16"}
    return {**out, "cast_model_type": "bfloat16", "cast_model_outputs": "float32",
            "master_weights": storage == "float32"}


# What each other mode does with its params, for `refuse_storage_elsewhere`.
_OTHER_MODES = {
    "apex": "apex's `master_weights` is a bool (True: O2's float32 masters)",
    "naive": "naive keeps float16 params with float32 masters, always",
}


def refuse_storage_elsewhere(mode: str, config: Mapping[str, Any]) -> None:
    """An error pointing to mode "bf16" if ``config`` gives a mode other than "bf16" a
    storage name (or a near miss of one) as ``master_weights``: only mode "bf16" keeps
    params without float32 masters. A TypeError for apex (its key is a bool), a
    ValueError for the modes without the key. Nothing otherwise (other values meet the
    mode's own checks).

    Examples:
      >>> refuse_storage_elsewhere("apex", {"opt_level": "O2", "master_weights": "kahan"})
      Traceback (most recent call last):
      ...
      TypeError: `master_weights` must be a bool with mode 'apex', got 'kahan': the storages ['float32', 'remainder', 'kahan', 'stochastic'] belong to mode 'bf16', and apex's `master_weights` is a bool (True: O2's float32 masters). For bfloat16 params stored that way, use mode="bf16", master_weights='kahan'.
    """
    value = config.get("master_weights")
    if mode == "bf16" or not isinstance(value, str) or value in ("True", "False"):
        return
    fix = value if value in MASTER_STORAGES else closest(value, MASTER_STORAGES)
    if fix is None:
        return
    where = _OTHER_MODES.get(mode, f"mode {mode!r} keeps float32 params (autocast)")
    expected = "a bool" if mode == "apex" else "absent"
    # apex has the key (a bool: a string is the wrong type); the others do not have it.
    raise (TypeError if mode == "apex" else ValueError)(
        f"`master_weights` must be {expected} with mode {mode!r}, got {value!r}: the "
        f"storages {list(MASTER_STORAGES)} belong to mode 'bf16', and {where}. For bfloat16 "
        f"params stored that way, use mode=\"bf16\", master_weights={fix!r}.")
