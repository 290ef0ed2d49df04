"""Per-module-class precision policies for flax Linen and NNX models.

How this interacts with flax's own ``dtype`` / ``param_dtype`` arguments: a flax layer
computes in its ``dtype`` when set, else in the promotion of its inputs and params.
mpfunc decides the dtype of the params each layer stores and of the inputs it receives,
per module class, so layers left at ``dtype=None`` compute in the policy's compute
dtype (and norm layers given a float32 policy compute in float32). A ``dtype`` you set
on a layer still wins inside that layer. Only the ``params`` collection is ever cast:
batch statistics, RNG state and fp8 scale/amax metadata ("overwrite with gradient"
collections) keep their dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from _mpfunc_common.extras import require_extra
from mpfunc._src.policy import Policy, cast_floating, get_policy

__all__ = ["LinenPolicy", "linen_policy", "nnx_apply_policy", "norm_classes"]


def norm_classes(framework: str = "linen") -> tuple[type, ...]:
    """flax's normalisation layer classes (``"linen"`` or ``"nnx"``), for ``per_class``."""
    require_extra("mpfunc.norm_classes", "flax", ("flax",))
    if framework == "linen":
        from flax import linen as mod
    elif framework == "nnx":
        from flax import nnx as mod
    else:
        raise ValueError(f"`framework` must be 'linen' or 'nnx', got {framework!r}.")
    names = ("LayerNorm", "BatchNorm", "RMSNorm", "GroupNorm", "InstanceNorm")
    return tuple(getattr(mod, n) for n in names if hasattr(mod, n))


def _resolve(policy, per_class) -> tuple[Policy, dict[type, Policy]]:
    base = get_policy(policy)
    overrides = {}
    for cls, p in (per_class or {}).items():
        if not isinstance(cls, type):
            raise TypeError(f"`per_class` keys must be module classes, got {cls!r}.")
        overrides[cls] = get_policy(p)
    return base, overrides


def _policy_for(module, base, overrides) -> Policy:
    for cls, p in overrides.items():
        if isinstance(module, cls):
            return p
    return base


class LinenPolicy:
    """A Linen module with a per-class precision policy. Made by `linen_policy`."""

    def __init__(self, module, policy, per_class):
        require_extra("mpfunc.linen_policy", "flax", ("flax",))
        from flax import linen as nn

        if not isinstance(module, nn.Module):
            raise TypeError(f"`module` must be a flax.linen.Module, got {type(module).__name__}.")
        self.module = module
        self.policy, self.per_class = _resolve(policy, per_class)
        self._paths: dict[tuple, Policy] | None = None

    def _interceptor(self, record: dict | None, cast: bool = True):
        base, overrides = self.policy, self.per_class

        def intercept(next_fun, args, kwargs, context):
            module = context.module
            if context.method_name != "__call__" or module is self.module:
                return next_fun(*args, **kwargs)
            p = _policy_for(module, base, overrides)
            if record is not None and module.scope is not None:
                record[tuple(module.scope.path)] = p
            if cast:
                args, kwargs = p.cast_to_compute((args, kwargs))
            return next_fun(*args, **kwargs)

        return intercept

    def _record(self, fn, *args, **kwargs):
        # Records which class (so which policy) owns each module path; casts nothing, so
        # init computes in float32 exactly as flax would.
        from flax import linen as nn

        record: dict[tuple, Policy] = {}
        with nn.intercept_methods(self._interceptor(record, cast=False)):
            out = fn(*args, **kwargs)
        self._paths = record
        return out

    def cast_params(self, params: Any) -> Any:
        """Casts a ``params`` collection: each module's params to its class's param dtype."""
        if self._paths is None:
            raise RuntimeError("call `init` (or `apply` once) before `cast_params`: the "
                               "module classes of the param paths are not known yet.")

        def cast(path, x):
            keys = tuple(getattr(k, "key", k) for k in path)
            for n in range(len(keys) - 1, -1, -1):
                if keys[:n] in self._paths:
                    return cast_floating(x, self._paths[keys[:n]].param_dtype)
            return cast_floating(x, self.policy.param_dtype)

        return jax.tree_util.tree_map_with_path(cast, params)

    def _cast_variables(self, variables):
        variables = dict(variables)
        if "params" in variables:
            variables["params"] = self.cast_params(variables["params"])
        return variables

    def init(self, rngs, *args, **kwargs):
        """``module.init`` with params stored in each class's param dtype."""
        variables = self._record(self.module.init, rngs, *args, **kwargs)
        return self._cast_variables(variables)

    def apply(self, variables, *args, **kwargs):
        """``module.apply`` under the policy; outputs come back in the output dtype.

        ``mutable=[...]`` works as in flax; the returned collections are not cast.
        """
        if self._paths is None:
            jax.eval_shape(lambda v: self._record(self.module.apply, v, *args, **kwargs),
                           variables)
        variables = self._cast_variables(variables)
        from flax import linen as nn

        with nn.intercept_methods(self._interceptor(None)):
            out = self.module.apply(variables, *self.policy.cast_to_compute(args), **kwargs)
        if kwargs.get("mutable"):
            y, state = out
            return self.policy.cast_to_output(y), state
        return self.policy.cast_to_output(out)


def linen_policy(module, policy: str | Policy = "mixed_f16",
                 per_class: Mapping[type, str | Policy] | None = None) -> LinenPolicy:
    """Wraps a Linen module so each module class gets its own precision policy.

    Like haiku's ``set_policy``: ``per_class={nn.LayerNorm: "f32"}`` keeps every
    LayerNorm's params and computation in float32 while the rest follow ``policy``.

    Args:
      module: the Linen module.
      policy: the default policy (a `Policy` or a `get_policy` string).
      per_class: module class -> policy, for the classes that differ.

    Returns:
      A `LinenPolicy` with ``init``, ``apply`` and ``cast_params``.

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, mpfunc
      >>> net = nn.Sequential([nn.Dense(4), nn.LayerNorm()])
      >>> amp = mpfunc.linen_policy(net, "p=f16,c=f16,o=f32", {nn.LayerNorm: "f32"})
      >>> v = amp.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> v["params"]["layers_0"]["kernel"].dtype, v["params"]["layers_1"]["scale"].dtype
      (dtype('float16'), dtype('float32'))
    """
    return LinenPolicy(module, policy, per_class)


def nnx_apply_policy(model, policy: str | Policy = "mixed_f16",
                     per_class: Mapping[type, str | Policy] | None = None):
    """Applies a per-class precision policy to an NNX model, in place, and returns it.

    Each submodule's ``nnx.Param`` values are cast to its class's param dtype, and its
    ``dtype`` (when it has one) is set to the class's compute dtype, with
    ``param_dtype`` updated to match. Batch statistics and RNG state are not touched.

    Args:
      model: an ``nnx.Module``.
      policy: the default policy.
      per_class: module class -> policy, e.g. ``{nnx.LayerNorm: "f32"}``.

    Returns:
      ``model``.

    Examples:
      >>> from flax import nnx
      >>> import mpfunc
      >>> m = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
      >>> m = mpfunc.nnx_apply_policy(m, "p=bf16,c=bf16,o=f32", {nnx.LayerNorm: "f32"})
      >>> m.layers[0].kernel[...].dtype, m.layers[1].scale[...].dtype
      (dtype(bfloat16), dtype('float32'))
    """
    require_extra("mpfunc.nnx_apply_policy", "flax", ("flax",))
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise TypeError(f"`model` must be a flax.nnx.Module, got {type(model).__name__}.")
    base, overrides = _resolve(policy, per_class)
    modules = nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()
    for _path, module in modules:
        p = _policy_for(module, base, overrides)
        for value in list(vars(module).values()):
            if not isinstance(value, nnx.Param):
                continue
            array = value.get_value() if hasattr(value, "get_value") else value.value
            if jnp.issubdtype(array.dtype, jnp.floating) and array.dtype != p.param_dtype:
                if hasattr(value, "set_value"):
                    value.set_value(array.astype(p.param_dtype))
                else:  # older flax
                    value.value = array.astype(p.param_dtype)
        if hasattr(module, "dtype") and module is not model:
            module.dtype = jnp.dtype(p.compute_dtype)
        if hasattr(module, "param_dtype") and module is not model:
            module.param_dtype = jnp.dtype(p.param_dtype)
    return model
