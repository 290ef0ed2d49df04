"""Per-module-class precision policies for flax Linen and NNX, with haiku's semantics.

haiku's ``set_policy`` rule, in both Linen and NNX: a module with a policy (the root
module, with ``policy``, and every module of a class in ``per_class``) gets its inputs
cast to the policy's compute dtype and its return value cast to the policy's output
dtype. Inside it, parameters are stored in the param dtype and *seen in the compute
dtype where they are used*, so a ``Dense`` computes half x half when params are float32.
A module without a policy of its own inherits the policy of the nearest enclosing module
that has one (for its params), and its inputs and outputs are not cast.

* Linen: params are cast by path to the compute dtype of the module that owns them
  before ``module.apply`` (so ``self.variables`` sees them in it too), and
  ``nn.intercept_methods`` casts the inputs and outputs of every method of a policied
  module. A ``dtype=`` set on a layer still wins inside that layer.
* NNX has no method interceptor and no param getter: each module's ``dtype`` (flax's
  layers cast their params and inputs to it) and ``param_dtype`` are set, stored params
  are cast to the param dtype, and a policied module's ``__call__`` casts its inputs and
  output (its class is swapped for a subclass that does, cached per class and policy).
  A custom module that reads a ``Param`` itself should give itself a ``dtype`` attribute
  and cast to it, as flax's layers do.

Only params are cast: batch statistics, RNG state and fp8 metadata keep their dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from _mpfunc_common.extras import require_extra
from mpfunc._src.policy import Policy, cast_floating, get_policy

__all__ = ["LinenPolicy", "linen_policy", "nnx_apply_policy", "norm_classes"]


def _flax(part: str, feature: str):
    """``flax.linen`` or ``flax.nnx``; without flax, an error naming the `flax` extra."""
    require_extra(feature, "flax", ("flax",))
    if part == "linen":
        from flax import linen as mod
    else:
        from flax import nnx as mod
    return mod


def norm_classes(framework: str = "linen") -> tuple[type, ...]:
    """flax's normalisation layer classes (``"linen"`` or ``"nnx"``), for ``per_class``."""
    if framework not in ("linen", "nnx"):
        raise ValueError(f"`framework` must be 'linen' or 'nnx', got {framework!r}.")
    mod = _flax(framework, "mpfunc.norm_classes")
    names = ("LayerNorm", "BatchNorm", "RMSNorm", "GroupNorm", "InstanceNorm")
    return tuple(getattr(mod, n) for n in names if hasattr(mod, n))


def _resolve(policy, per_class) -> tuple[Policy, dict[type, Policy]]:
    base = get_policy(policy)
    if per_class is not None and not isinstance(per_class, Mapping):
        raise TypeError("`per_class` must be a mapping {module class: policy}, got "
                        f"{type(per_class).__name__}.")
    overrides = {}
    for cls, p in (per_class or {}).items():
        if not isinstance(cls, type):
            raise TypeError(f"`per_class` keys must be module classes, got {cls!r}.")
        try:
            overrides[cls] = get_policy(p)
        except (TypeError, ValueError) as e:
            raise type(e)(f"`per_class[{cls.__name__}]`: {e}") from None
    return base, overrides


def _own_policy(module, overrides: dict[type, Policy]) -> Policy | None:
    """The policy of ``module``'s class: its exact class first, then its bases (MRO)."""
    for cls in type(module).__mro__:
        cls = getattr(cls, "_mpfunc_base", cls)
        if cls in overrides:
            return overrides[cls]
    return None


def _owner(keys: tuple, owners: Mapping[tuple, Policy], default: Policy) -> Policy:
    # The policy of the innermost module whose path is a prefix of ``keys``.
    for n in range(len(keys), -1, -1):
        if keys[:n] in owners:
            return owners[keys[:n]]
    return default


def _keys(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


# -- Linen ----------------------------------------------------------------------------


class LinenPolicy:
    """A Linen module with per-class precision policies. Made by `linen_policy`."""

    def __init__(self, module, policy, per_class):
        nn = _flax("linen", "mpfunc.linen_policy")
        if not isinstance(module, nn.Module):
            raise TypeError(f"`module` must be a flax.linen.Module, got {type(module).__name__}.")
        self.module = module
        self.policy, self.per_class = _resolve(policy, per_class)
        self.root_policy = _own_policy(module, self.per_class) or self.policy
        self._owners: dict[tuple, Policy] = {}  # module path -> policy in effect there
        self._recorded: set = set()  # the `method`s whose module paths are recorded

    def _interceptor(self, cast: bool):
        stack = [self.root_policy]
        owners, overrides = self._owners, self.per_class

        def intercept(next_fun, args, kwargs, context):
            own = _own_policy(context.module, overrides)
            scope = context.module.scope
            if scope is not None:
                owners[tuple(scope.path)] = own or stack[-1]
            if own is None:
                return next_fun(*args, **kwargs)
            stack.append(own)
            try:
                if not cast:
                    return next_fun(*args, **kwargs)
                args, kwargs = own.cast_to_compute((args, kwargs))
                return own.cast_to_output(next_fun(*args, **kwargs))
            finally:
                stack.pop()

        return intercept

    def _cast_by_owner(self, params: Any, field: str) -> Any:
        def cast(path, x):
            policy = _owner(_keys(path), self._owners, self.root_policy)
            return cast_floating(x, getattr(policy, field))

        return jax.tree_util.tree_map_with_path(cast, params)

    def cast_params(self, params: Any) -> Any:
        """Casts a ``params`` collection: each param to its owner's param dtype."""
        if not self._owners:
            raise RuntimeError("call `init` (or `apply` once) before `cast_params`: the "
                               "module classes of the param paths are not known yet.")
        return self._cast_by_owner(params, "param_dtype")

    def init(self, rngs, *args, **kwargs):
        """``module.init``, then params cast to their owners' param dtypes.

        The init pass itself computes as flax would (nothing cast): it creates the params
        and records which policy owns each module path.
        """
        nn = _flax("linen", "mpfunc.linen_policy")
        with nn.intercept_methods(self._interceptor(cast=False)):
            variables = self.module.init(rngs, *args, **kwargs)
        self._recorded.add(_method_key(kwargs.get("method")))
        variables = dict(variables)
        if "params" in variables:
            variables["params"] = self.cast_params(variables["params"])
        return variables

    def apply(self, variables, *args, **kwargs):
        """``module.apply`` under the policies.

        The root policy's compute dtype applies to the inputs and its output dtype to the
        result. ``mutable=[...]`` works as in flax; the returned collections are not cast.
        """
        nn = _flax("linen", "mpfunc.linen_policy")
        key = _method_key(kwargs.get("method"))
        if key not in self._recorded:  # learn the module paths once, abstractly
            def record(v):
                with nn.intercept_methods(self._interceptor(cast=False)):
                    return self.module.apply(v, *args, **kwargs)

            jax.eval_shape(record, variables)
            self._recorded.add(key)
        variables = dict(variables)
        if "params" in variables:
            variables["params"] = self._cast_by_owner(variables["params"], "compute_dtype")
        root = self.root_policy
        args, kwargs = root.cast_to_compute((args, kwargs))
        with nn.intercept_methods(self._interceptor(cast=True)):
            out = self.module.apply(variables, *args, **kwargs)
        if kwargs.get("mutable"):
            y, state = out
            return root.cast_to_output(y), state
        return root.cast_to_output(out)


def _method_key(method):
    try:
        hash(method)
        return method
    except TypeError:
        return id(method)


def linen_policy(module, policy: Any = "mixed_f16",
                 per_class: Mapping[type, Any] | None = None) -> LinenPolicy:
    """Wraps a Linen module so it and chosen module classes run under precision policies.

    haiku's ``set_policy`` semantics (see the module docstring): ``policy`` is the root
    module's; ``per_class={nn.LayerNorm: "p=f32,c=f32,o=f16"}`` keeps every LayerNorm's
    params and computation in float32 and hands float16 on to the next layer, while the
    rest follows ``policy``. Classes are matched exactly first, then through their bases.

    Args:
      module: the Linen module.
      policy: the root policy (a `Policy`, a `get_policy` string or a ``jmp.Policy``).
      per_class: module class -> policy, for the classes that differ.

    Returns:
      A `LinenPolicy` with ``init``, ``apply`` and ``cast_params``.

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, mpfunc
      >>> net = nn.Sequential([nn.Dense(4), nn.LayerNorm()])
      >>> amp = mpfunc.linen_policy(net, "p=f32,c=f16,o=f32", {nn.LayerNorm: "f32"})
      >>> v = amp.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> v["params"]["layers_0"]["kernel"].dtype, amp.apply(v, jnp.ones((1, 3))).dtype
      (dtype('float32'), dtype('float32'))
      >>> jaxpr = jax.make_jaxpr(amp.apply)(v, jnp.ones((1, 3)))
      >>> [str(x.aval.dtype) for e in jaxpr.eqns if e.primitive.name == "dot_general"
      ...  for x in e.invars]
      ['float16', 'float16']
    """
    return LinenPolicy(module, policy, per_class)


# -- NNX ------------------------------------------------------------------------------

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

    The same semantics as `linen_policy` (see the module docstring): ``model(x)`` gets
    ``x`` in the root policy's compute dtype and returns its output dtype; each module
    computes in its policy's compute dtype (its ``dtype``) with params stored in the
    param dtype. On CPU, float16 ``nnx.MultiHeadAttention`` with flax's default
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
