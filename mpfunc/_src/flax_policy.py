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
  module. A ``dtype=`` set on a layer still wins inside that layer, with a
  `DeclaredDtypeWarning` naming it, unless ``override_declared=True``.
* NNX (`nnx_policy`) has no method interceptor and no param getter: each module's
  ``dtype`` (flax's layers cast their params and inputs to it) and ``param_dtype`` are
  set, stored params are cast to the param dtype, and a policied module's ``__call__``
  casts its inputs and output (its class is swapped for a subclass that does, cached per
  class and policy). A custom module that reads a ``Param`` itself should give itself a
  ``dtype`` attribute and cast to it, as flax's layers do.

Only params are cast: batch statistics, RNG state and fp8 metadata keep their dtypes.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import jax
import numpy as np

from _mpfunc_common.extras import require_extra
from mpfunc._src.policy import Policy, cast_floating, get_policy

__all__ = ["DeclaredDtypeWarning", "LinenPolicy", "linen_policy", "norm_classes"]


class DeclaredDtypeWarning(UserWarning):
    """`linen_policy`: Linen layers declare a ``dtype`` other than their policy's compute
    dtype, and flax computes them in the declared one (the message names them).

    Pass ``override_declared=True`` to compute them in the policy's dtype, or build them
    with ``dtype=None``.

    Examples:
      >>> import mpfunc
      >>> issubclass(mpfunc.DeclaredDtypeWarning, UserWarning)
      True
    """


def _flax(part: str, feature: str) -> ModuleType:
    """``flax.linen`` or ``flax.nnx``; without flax, an error naming the `flax` extra.

    Typed as a plain module: flax is optional, and the callers use either one.
    """
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

    def __init__(self, module, policy, per_class, override_declared=False):
        nn = _flax("linen", "mpfunc.linen_policy")
        if not isinstance(module, nn.Module):
            raise TypeError(f"`module` must be a flax.linen.Module, got {type(module).__name__}.")
        if not isinstance(override_declared, bool):
            raise TypeError("`override_declared` must be True or False, got "
                            f"{type(override_declared).__name__}: {override_declared!r}.")
        self.module = module
        self.policy, self.per_class = _resolve(policy, per_class)
        self.root_policy = _own_policy(module, self.per_class) or self.policy
        self.override_declared = override_declared
        self._owners: dict[tuple, Policy] = {}  # module path -> policy in effect there
        self._recorded: set = set()  # the `method`s whose module paths are recorded
        self._declared: dict[tuple, str] = {}  # module path -> "Class: declared -> policy"
        self._warned = False

    def _interceptor(self, cast: bool):
        stack = [self.root_policy]
        owners, overrides = self._owners, self.per_class

        def intercept(next_fun, args, kwargs, context):
            module = context.module
            own = _own_policy(module, overrides)
            policy = own or stack[-1]
            declared = _declared_dtype(module)
            differs = declared is not None and declared != np.dtype(policy.compute_dtype)
            if module.scope is not None:
                path = tuple(module.scope.path)
                owners[path] = policy
                if differs and declared is not None:
                    self._declared[path] = (f"{type(module).__name__}: {declared.name}, "
                                            f"policy {np.dtype(policy.compute_dtype).name}")
            override = cast and differs and self.override_declared
            if override:  # the layer reads `self.dtype` when called: the policy's, now
                object.__setattr__(module, "dtype", np.dtype(policy.compute_dtype))
            if own is not None:
                stack.append(own)
            try:
                if own is None or not cast:
                    return next_fun(*args, **kwargs)
                args, kwargs = own.cast_to_compute((args, kwargs))
                return own.cast_to_output(next_fun(*args, **kwargs))
            finally:
                if own is not None:
                    stack.pop()
                if override:
                    object.__setattr__(module, "dtype", declared)

        return intercept

    def _warn_declared(self):
        if self._declared and not self.override_declared and not self._warned:
            self._warned = True
            names = "; ".join(f"{'/'.join(p) or '<root>'} ({d})"
                              for p, d in sorted(self._declared.items()))
            warnings.warn(DeclaredDtypeWarning(
                f"linen_policy: {len(self._declared)} layer(s) declare a `dtype` other than "
                f"their policy's compute dtype, and flax computes them in the declared one: "
                f"{names}. Pass `override_declared=True` to `mpfunc.linen_policy` to "
                "compute them in the policy's dtype, or build them with `dtype=None`."),
                stacklevel=3)

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
        self._warn_declared()
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
            self._warn_declared()
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


def _declared_dtype(module) -> np.dtype | None:
    """The ``dtype`` a layer was built with (flax's layers: None unless declared)."""
    declared = getattr(module, "dtype", None)
    if declared is None:
        return None
    try:
        return np.dtype(declared)
    except TypeError:  # a `dtype` attribute that is not a dtype
        return None


def _method_key(method):
    try:
        hash(method)
        return method
    except TypeError:
        return id(method)


def linen_policy(module, policy: Any = "mixed_f16",
                 per_class: Mapping[type, Any] | None = None, *,
                 override_declared: bool = False) -> LinenPolicy:
    """Wraps a Linen module so it and chosen module classes run under precision policies.

    haiku's ``set_policy`` semantics (see the module docstring): ``policy`` is the root
    module's; ``per_class={nn.LayerNorm: "p=f32,c=f32,o=f16"}`` keeps every LayerNorm's
    params and computation in float32 and hands float16 on to the next layer, while the
    rest follows ``policy``. Classes are matched exactly first, then through their bases.

    A layer built with a ``dtype`` (flax's examples declare ``dtype=jnp.float32`` on every
    layer) computes in that dtype whatever its policy says: flax casts its inputs and
    params to it. The first ``init`` or ``apply`` warns once (`DeclaredDtypeWarning`),
    naming every layer whose declared ``dtype`` differs from its policy's compute dtype;
    ``override_declared=True`` computes those layers in the policy's dtype instead.

    Args:
      module: the Linen module.
      policy: the root policy (a `Policy`, a `get_policy` string or a ``jmp.Policy``).
      per_class: module class -> policy, for the classes that differ.
      override_declared: compute layers that declare a ``dtype`` in their policy's
        compute dtype (default False: the declared dtype wins, with a warning).

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
    return LinenPolicy(module, policy, per_class, override_declared)
