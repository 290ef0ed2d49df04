"""`nnx_apply_policy`: the per-module-class precision policies of `flax_policy` for NNX.

NNX has no method interceptor and no param getter: each module's ``dtype`` (flax's
layers cast their params and inputs to it) and ``param_dtype`` are set, stored params are
cast to the param dtype, and a policied module's ``__call__`` casts its inputs and output
(its class is swapped for a subclass that does, cached per class and policy). See the
`flax_policy` module docstring for the semantics, shared with Linen.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpfunc._src.flax_policy import _flax, _keys, _own_policy, _owner, _resolve
from mpfunc._src.policy import Policy, cast_floating

__all__ = ["nnx_apply_policy"]


_POLICY_CLASSES: dict[tuple[type, Policy], type] = {}


def _policy_class(base: type, policy: Policy) -> type:
    """``base`` whose ``__call__`` casts inputs to compute and its result to output."""
    key = (base, policy)
    if key not in _POLICY_CLASSES:
        def __call__(self, *args, **kwargs):
            args, kwargs = policy.cast_to_compute((args, kwargs))
            return policy.cast_to_output(base.__call__(self, *args, **kwargs))

        __call__.__doc__, __call__.__wrapped__ = base.__call__.__doc__, base.__call__
        namespace = {"__call__": __call__, "__module__": base.__module__,
                     "__qualname__": f"{base.__qualname__}[{policy}]", "__doc__": base.__doc__,
                     "_mpfunc_base": base, "_mpfunc_policy": policy}
        extra = {"pytree": base._pytree__is_pytree} if hasattr(base, "_pytree__is_pytree") else {}
        _POLICY_CLASSES[key] = type(base)(base.__name__, (base,), namespace, **extra)
    return _POLICY_CLASSES[key]


_ROUTED_ATTENTION: dict[str, Any] = {}


def _attention_fns():
    """(flax's default attention, the same routed past dot algorithm presets)."""
    nnx = _flax("nnx", "mpfunc.nnx_apply_policy")
    if "fn" not in _ROUTED_ATTENTION:
        from mpfunc._src.autocast import without_dot_algorithms

        default = nnx.dot_product_attention
        stripped = without_dot_algorithms(default)

        def dot_product_attention(query, key, value, *args, **kwargs):
            # With `module` (sow_weights) or dropout flax takes its own einsum path, which
            # has no preset; only the jax.nn path needs the route.
            if kwargs.get("module") is not None:
                return default(query, key, value, *args, **kwargs)
            return stripped(query, key, value, *args, **kwargs)

        dot_product_attention.__doc__ = (
            "flax's `dot_product_attention` with float16 allowed under jit on CPU (its "
            "F16_F16_F32 preset is replaced by float32 accumulation; see mpfunc README).")
        _ROUTED_ATTENTION["fn"] = (default, dot_product_attention)
    return _ROUTED_ATTENTION["fn"]


def nnx_apply_policy(model, policy: Any = "mixed_f16",
                     per_class: Mapping[type, Any] | None = None):
    """Applies precision policies to an NNX model, in place, and returns it.

    The same semantics as `linen_policy` (see the `flax_policy` module docstring):
    ``model(x)`` gets ``x`` in the root policy's compute dtype and returns its output
    dtype; each module computes in its policy's compute dtype (its ``dtype``) with params
    stored in the param dtype. Every module's ``dtype`` is set, also one a layer was built
    with: NNX keeps no trace of what was declared (``nnx.Embed`` fills in its param
    dtype), so unlike Linen's, a declared ``dtype`` never overrides the policy (give the
    class a float32 policy in ``per_class`` to keep it float32). On CPU, float16 ``nnx.MultiHeadAttention`` with flax's default
    attention is routed past the ``F16_F16_F32`` preset that XLA:CPU refuses under jit.
    Applying again with another policy replaces the previous one.

    Args:
      model: an ``nnx.Module``.
      policy: the root policy.
      per_class: module class -> policy, e.g. ``{nnx.LayerNorm: "p=f32,c=f32,o=bf16"}``.

    Returns:
      ``model``.

    Examples:
      >>> from flax import nnx
      >>> import jax.numpy as jnp, mpfunc
      >>> m = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
      >>> m = mpfunc.nnx_apply_policy(m, "p=f32,c=bf16,o=f32", {nnx.LayerNorm: "f32"})
      >>> m.layers[0].kernel[...].dtype, m.layers[0].dtype, m(jnp.ones((1, 3))).dtype
      (dtype('float32'), dtype(bfloat16), dtype('float32'))
    """
    nnx = _flax("nnx", "mpfunc.nnx_apply_policy")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"`model` must be a flax.nnx.Module, got {type(model).__name__}.")
    base, overrides = _resolve(policy, per_class)
    root = _own_policy(model, overrides) or base
    default_attention, routed_attention = _attention_fns()
    route = jax.default_backend() == "cpu"
    effective: dict[tuple, Policy] = {}
    for path, module in sorted(nnx.iter_modules(model), key=lambda pm: len(pm[0])):
        keys = _keys(path)
        own = root if not keys else _own_policy(module, overrides)
        p = effective[keys] = own or _owner(keys[:-1], effective, root)
        cls = getattr(type(module), "_mpfunc_base", type(module))
        object.__setattr__(module, "__class__", cls if own is None else _policy_class(cls, own))
        if hasattr(module, "dtype"):
            module.dtype = jnp.dtype(p.compute_dtype)
        if hasattr(module, "param_dtype"):
            module.param_dtype = jnp.dtype(p.param_dtype)
        if getattr(module, "attention_fn", None) in (default_attention, routed_attention):
            f16 = np.dtype(p.compute_dtype) == np.dtype(jnp.float16)
            module.attention_fn = routed_attention if f16 and route else default_attention
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            dtype = _owner(_keys(path), effective, root).param_dtype
            value = node.get_raw_value() if hasattr(node, "get_raw_value") else node.value
            if isinstance(value, jax.Array | np.ndarray):
                cast = cast_floating(value, dtype)
                if cast is not value:
                    if hasattr(node, "set_raw_value"):
                        node.set_raw_value(cast)
                    else:  # older flax
                        node.value = cast
    return model
