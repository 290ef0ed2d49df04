"""Precision policies: which dtype parameters, computation and outputs use."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Policy", "get_policy", "cast_floating", "cast_to_full", "cast_to_half",
           "half_dtype", "DTYPE_ALIASES", "POLICY_PRESETS"]

# Every accepted spelling of a dtype. "half" is IEEE float16 (binary16), as in torch's
# `Tensor.half()`; it never means bfloat16 (jmp's "half" is bfloat16 on TPU; use
# `half_dtype()` for that).
DTYPE_ALIASES: dict[str, Any] = {
    "float64": jnp.float64,
    "f64": jnp.float64,
    "float32": jnp.float32,
    "f32": jnp.float32,
    "full": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "f16": jnp.float16,
    "half": jnp.float16,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "f8e4m3": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
    "f8e5m2": jnp.float8_e5m2,
}

# The short name `str(policy)` prints for each dtype.
_SHORT_NAMES = {
    np.dtype(jnp.float64): "f64",
    np.dtype(jnp.float32): "f32",
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float16): "f16",
    np.dtype(jnp.float8_e4m3fn): "f8e4m3",
    np.dtype(jnp.float8_e5m2): "f8e5m2",
}

# Named policies accepted by `get_policy`.
POLICY_PRESETS: dict[str, str] = {
    "mixed_bf16": "params=float32,compute=bfloat16,output=float32",
    "mixed_f16": "params=float32,compute=float16,output=float32",
    "mixed_float16": "params=float32,compute=float16,output=float32",
}

_KEYS = {
    "params": "params",
    "p": "params",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
}


def _to_dtype(value: Any, role: str) -> np.dtype:
    """Turns a dtype-like (name, alias, numpy or jax type) into a floating np.dtype."""
    if isinstance(value, str):
        name = value.strip().lower()
        if name in DTYPE_ALIASES:
            return np.dtype(DTYPE_ALIASES[name])
        try:
            dtype = np.dtype(jnp.dtype(name))
        except TypeError:
            raise ValueError(
                f"`{role}`: unknown dtype {value!r}. Valid names: {sorted(DTYPE_ALIASES)}."
            ) from None
    else:
        try:
            dtype = np.dtype(jnp.dtype(value))
        except TypeError:
            raise TypeError(
                f"`{role}` must be a floating dtype or its name, got {value!r} "
                f"of type {type(value).__name__}."
            ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"`{role}` must be a floating dtype, got {dtype.name}. "
            f"Valid names: {sorted(DTYPE_ALIASES)}."
        )
    return dtype


def _short_name(dtype: np.dtype) -> str:
    return _SHORT_NAMES.get(dtype, dtype.name)


def _is_floating_array(x: Any) -> bool:
    # Tracers are jax.Array instances, so this also holds under jit.
    if not isinstance(x, (jax.Array, np.ndarray)):
        return False
    dtype = x.dtype
    # PRNG key arrays have an extended dtype that is not floating.
    return jnp.issubdtype(dtype, jnp.floating)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts the floating-point array leaves of ``tree`` to ``dtype``.

    Integer, bool and PRNG-key arrays, ``None`` and Python scalars pass through unchanged,
    and the tree structure is preserved. Leaves already in ``dtype`` are returned as is.

    Args:
      tree: any pytree.
      dtype: the target floating dtype.

    Returns:
      A pytree of the same structure.

    Examples:
      >>> import jax.numpy as jnp
      >>> out = cast_floating({"w": jnp.ones(2), "step": 3}, jnp.bfloat16)
      >>> out["w"].dtype, out["step"]
      (dtype(bfloat16), 3)
    """
    dtype = _to_dtype(dtype, "dtype")

    def cast(x):
        if _is_floating_array(x) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtypes parameters, computation and outputs use.

    A policy is immutable and hashable, so it can be a static argument to ``jax.jit``.
    Casting touches only floating-point array leaves (jax and numpy arrays); integer,
    bool and PRNG-key leaves, ``None`` and Python scalars pass through unchanged.

    Attributes:
      param_dtype: dtype parameters are stored in.
      compute_dtype: dtype the forward and backward computation runs in.
      output_dtype: dtype of the model's outputs.

    Examples:
      >>> import jax.numpy as jnp
      >>> policy = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
      >>> str(policy)
      'p=f32,c=bf16,o=f32'
      >>> policy.cast_to_compute({"w": jnp.ones(3)})["w"].dtype
      dtype(bfloat16)
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self):
        for field, role in (
            ("param_dtype", "param_dtype"),
            ("compute_dtype", "compute_dtype"),
            ("output_dtype", "output_dtype"),
        ):
            object.__setattr__(self, field, _to_dtype(getattr(self, field), role))

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``param_dtype``."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``compute_dtype``."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``output_dtype``."""
        return cast_floating(tree, self.output_dtype)

    def with_output_dtype(self, dtype: Any) -> Policy:
        """Returns a copy of this policy with another ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=dtype)

    def __str__(self) -> str:
        return (
            f"p={_short_name(self.param_dtype)},"
            f"c={_short_name(self.compute_dtype)},"
            f"o={_short_name(self.output_dtype)}"
        )


def half_dtype() -> np.dtype:
    """The half-precision dtype for the default backend: bfloat16 on TPU, else float16.

    The same rule as jmp's ``half_dtype()``.

    Examples:
      >>> import jax
      >>> half_dtype() == ("bfloat16" if jax.default_backend() == "tpu" else "float16")
      True
    """
    return np.dtype(jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16)


def cast_to_half(tree: Any) -> Any:
    """Casts the floating leaves of ``tree`` to `half_dtype()` (jmp's ``cast_to_half``)."""
    return cast_floating(tree, half_dtype())


def cast_to_full(tree: Any) -> Any:
    """Casts the floating leaves of ``tree`` to float32 (jmp's ``cast_to_full``)."""
    return cast_floating(tree, jnp.float32)


def _duck_policy(spec: Any) -> Policy | None:
    # A policy from another library (jmp.Policy, haiku's) with the same three fields.
    fields = ("param_dtype", "compute_dtype", "output_dtype")
    if all(hasattr(spec, f) for f in fields):
        return Policy(*(getattr(spec, f) for f in fields))
    return None


def get_policy(spec: Any) -> Policy:
    """Parses a policy from a string such as ``"params=float32,compute=bfloat16"``.

    The grammar is jmp's: keys ``params``/``p``, ``compute``/``c``, ``output``/``o``; an
    omitted ``params`` is float32 (full precision), an omitted ``compute`` follows
    ``params`` and an omitted ``output`` follows ``compute``, so ``"c=f16"`` is
    ``p=f32,c=f16,o=f16`` and ``"o=bf16"`` is ``p=f32,c=f32,o=bf16``. A bare dtype
    (``"bf16"``) means all three. ``str(policy)`` round-trips through this function.

    dtype names:

    ==============================  ======================================================
    names                           dtype
    ==============================  ======================================================
    ``float32``, ``f32``, ``full``  float32
    ``bfloat16``, ``bf16``          bfloat16
    ``float16``, ``f16``, ``half``  float16 (IEEE binary16; ``half`` never means bfloat16)
    ``float64``, ``f64``            float64 (needs ``jax_enable_x64`` to take effect)
    ``float8_e4m3fn``, ``f8e4m3``   float8_e4m3fn
    ``float8_e5m2``, ``f8e5m2``     float8_e5m2
    ==============================  ======================================================

    Presets:

    =================  ==========  ==========  ==========
    name               params      compute     output
    =================  ==========  ==========  ==========
    ``mixed_bf16``     float32     bfloat16    float32
    ``mixed_f16``      float32     float16     float32
    ``mixed_float16``  float32     float16     float32
    =================  ==========  ==========  ==========

    Args:
      spec: a policy string, a ``Policy`` (returned unchanged), or any object with
        ``param_dtype``, ``compute_dtype`` and ``output_dtype`` (e.g. a ``jmp.Policy``).

    Returns:
      The ``Policy``.

    Raises:
      TypeError: ``spec`` is neither a string nor a policy.
      ValueError: an empty spec, a malformed ``key=value`` pair, an unknown or duplicated
        key, or an unknown or non-floating dtype. The message names the offending part
        and lists what is valid.

    Examples:
      >>> str(get_policy("c=bf16"))
      'p=f32,c=bf16,o=bf16'
      >>> str(get_policy("c=f16,o=full"))
      'p=f32,c=f16,o=f32'
      >>> str(get_policy("mixed_f16"))
      'p=f32,c=f16,o=f32'
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        duck = _duck_policy(spec)
        if duck is not None:
            return duck
        raise TypeError(
            f"`spec` must be a policy string or a Policy, got {type(spec).__name__}: {spec!r}."
        )
    text = spec.strip()
    if not text:
        raise ValueError(
            "`spec` is empty. Expected e.g. 'params=float32,compute=bfloat16', a bare dtype "
            f"such as 'bf16', or a preset {sorted(POLICY_PRESETS)}."
        )
    if text.lower() in POLICY_PRESETS:
        text = POLICY_PRESETS[text.lower()]
    if "=" not in text and "," not in text:
        dtype = _to_dtype(text, "spec")
        return Policy(dtype, dtype, dtype)

    roles: dict[str, np.dtype] = {}
    for part in text.split(","):
        pair = part.strip()
        key, sep, value = pair.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not key or not value:
            raise ValueError(
                f"`spec` {spec!r}: malformed part {part!r}; expected 'key=dtype' with a key "
                f"in {sorted(_KEYS)}."
            )
        if key not in _KEYS:
            raise ValueError(
                f"`spec` {spec!r}: unknown key {key!r}; valid keys are {sorted(_KEYS)}."
            )
        role = _KEYS[key]
        if role in roles:
            raise ValueError(f"`spec` {spec!r}: key {key!r} sets {role!r} twice.")
        roles[role] = _to_dtype(value, role)
    params = roles.get("params", np.dtype(jnp.float32))  # jmp: unset params are full
    compute = roles.get("compute", params)
    output = roles.get("output", compute)
    return Policy(params, compute, output)
