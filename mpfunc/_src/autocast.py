"""Op-level autocast for JAX: the traced program is rewritten op by op."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:  # jax >= 0.4.30 exposes these publicly here
    from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
except ImportError:  # pragma: no cover
    from jax.core import ClosedJaxpr, Jaxpr, Literal  # type: ignore

__all__ = ["autocast", "AutocastLists", "HALF_OPS", "FLOAT32_OPS"]

# Run in the compute dtype, accumulating in float32 where the backend allows it.
HALF_OPS: frozenset[str] = frozenset({"dot_general", "conv_general_dilated"})

# Precision-sensitive ops: always float32.
FLOAT32_OPS: frozenset[str] = frozenset({
    # exponentials and logarithms (softmax / logsumexp internals, losses)
    "exp", "exp2", "log", "log1p", "expm1", "logistic",
    # powers and roots
    "pow", "integer_pow", "square", "sqrt", "rsqrt", "cbrt",
    # special functions
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "tan", "acos", "asin", "cosh", "sinh",
    # reductions used for norms, means, variances and losses
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_precision",
})

# Nested jit is inlined, so the rules reach through it with no boundary casts; so are
# custom_jvp functions (jax.nn.relu, jax.nn.softmax, ...): their primal program is
# autocast and differentiated directly, instead of upcasting at their edges.
_INLINE = frozenset({"jit", "pjit", "closed_call", "core_call"})
_INLINE_CALL = frozenset({"custom_jvp_call"})


@dataclasses.dataclass(frozen=True)
class AutocastLists:
    """Which primitives run in half precision and which in float32 (plain data).

    Everything else follows its inputs, promoting to the widest floating type among them.
    Override per call: ``autocast(f, lists=AutocastLists(half_ops=..., float32_ops=...))``.
    """

    half_ops: frozenset[str] = HALF_OPS
    float32_ops: frozenset[str] = FLOAT32_OPS

    def __post_init__(self):
        for name in ("half_ops", "float32_ops"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise TypeError(f"`{name}` must be a set of primitive names, got {value!r}.")
            object.__setattr__(self, name, frozenset(value))
        both = self.half_ops & self.float32_ops
        if both:
            raise ValueError(f"primitives {sorted(both)} are in both `half_ops` and "
                             "`float32_ops`.")


def _bind_with_subprograms(prim, invals, params):
    """Binds a primitive from jaxpr params, as ``jax.core.eval_jaxpr`` does.

    ``get_bind_params`` turns jaxpr-valued params back into what ``bind`` takes (e.g. a
    custom_vjp's functions). It returns the params alone in newer jax and a
    ``(subfuns, params)`` pair in older jax; both are handled here, in one place.
    """
    out = prim.get_bind_params(params)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        subfuns, bind_params = out
        return prim.bind(*subfuns, *invals, **bind_params)
    return prim.bind(*invals, **out)


def _is_float_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _cast(x, dtype):
    if _is_float_dtype(jnp.result_type(x)) and jnp.result_type(x) != dtype:
        return jax.lax.convert_element_type(x, dtype)
    return x


def _widest(dtypes):
    # Among floating dtypes of equal width (f16 vs bf16), float32 is the safe join.
    best = None
    for d in dtypes:
        d = np.dtype(d)
        if best is None or d.itemsize > best.itemsize:
            best = d
        elif d.itemsize == best.itemsize and d != best:
            best = np.dtype(jnp.float32)
    return best


class _Rules:
    def __init__(self, compute_dtype, lists: AutocastLists):
        self.compute = np.dtype(compute_dtype)
        self.lists = lists

    # -- evaluation of a jaxpr under the rules ------------------------------------------
    def eval_jaxpr(self, jaxpr: Jaxpr, consts, args):
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if isinstance(v, Literal) else env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            outs = self.apply(eqn, invals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def apply(self, eqn, invals):
        prim, params = eqn.primitive, dict(eqn.params)
        name = prim.name
        if name in _INLINE and isinstance(params.get("jaxpr"), ClosedJaxpr):
            cj = params["jaxpr"]
            outs = self.eval_jaxpr(cj.jaxpr, cj.consts, invals)
            return outs if prim.multiple_results else outs[0]
        if name in _INLINE_CALL and isinstance(params.get("call_jaxpr"), ClosedJaxpr):
            cj = params["call_jaxpr"]
            outs = self.eval_jaxpr(cj.jaxpr, cj.consts, invals[params.get("num_consts", 0):]
                                   if not cj.jaxpr.constvars and len(cj.jaxpr.invars) < len(invals)
                                   else invals)
            return outs if prim.multiple_results else outs[0]
        if self._has_subjaxpr(params):
            # A control-flow or custom-derivative boundary: rewrite the sub-programs with
            # the rules inside and the original dtypes at their edges, so the primitive's
            # signature (carries, branches, custom rules) is unchanged.
            params = {k: self._rewrite_param(v) for k, v in params.items()}
            invals = [_cast(x, v.aval.dtype) if hasattr(v.aval, "dtype") else x
                      for x, v in zip(invals, eqn.invars)]
            return _bind_with_subprograms(prim, invals, params)
        # Scalar literals (weakly typed, or constants baked in at trace time) adapt to the
        # data: they do not take part in choosing the dtype.
        floats = [x for x, v in zip(invals, eqn.invars)
                  if _is_float_dtype(jnp.result_type(x)) and not isinstance(v, Literal)
                  and not getattr(v.aval, "weak_type", False)]
        if not floats and not any(_is_float_dtype(jnp.result_type(x)) for x in invals):
            return prim.bind(*invals, **params)
        if name in self.lists.half_ops:
            invals = [_cast(x, self.compute) for x in invals]
            if "preferred_element_type" in params and len(invals) == 2:
                return self._half_op(prim, params)(*invals)
            return prim.bind(*invals, **params)
        if name in self.lists.float32_ops:
            return prim.bind(*[_cast(x, jnp.float32) for x in invals], **params)
        if name == "convert_element_type":
            return prim.bind(*invals, **params)  # an explicit cast in user code is kept
        if not floats:  # only weak (scalar-literal) floats: nothing to decide
            return prim.bind(*invals, **params)
        target = _widest(jnp.result_type(x) for x in floats)
        invals = [_cast(x, target) for x in invals]
        pet = params.get("preferred_element_type")
        if pet is not None and _is_float_dtype(pet):
            params["preferred_element_type"] = target
        return prim.bind(*invals, **params)

    def _half_op(self, prim, params):
        """``prim`` on half inputs, accumulating in float32, returning half precision.

        Its backward runs under the same rules (half inputs, float32 accumulation), as
        torch's autocast backward does, instead of a float32 x half mixed product.
        """
        compute = self.compute
        acc = dict(params, preferred_element_type=np.dtype(jnp.float32))
        plain = dict(params, preferred_element_type=compute)

        @jax.custom_vjp
        def op(a, b):
            return _cast(prim.bind(a, b, **acc), compute)

        def fwd(a, b):
            return op(a, b), (a, b)

        def bwd(res, ct):
            a, b = res
            pullback = jax.make_jaxpr(
                lambda a, b, ct: jax.vjp(lambda a, b: prim.bind(a, b, **plain), a, b)[1](ct)
            )(a, b, ct)
            ga, gb = self.eval_jaxpr(pullback.jaxpr, pullback.consts, [a, b, ct])
            return ga, gb

        op.defvjp(fwd, bwd)
        return op

    # -- sub-programs -------------------------------------------------------------------
    @staticmethod
    def _has_subjaxpr(params) -> bool:
        for v in params.values():
            if isinstance(v, ClosedJaxpr | Jaxpr):
                return True
            if isinstance(v, tuple) and v and all(isinstance(b, ClosedJaxpr) for b in v):
                return True
        return False

    def _rewrite_param(self, v):
        if isinstance(v, ClosedJaxpr):
            return self._rewrite_closed(v)
        if isinstance(v, Jaxpr):
            new = self._rewrite_closed(ClosedJaxpr(v, ()))
            if new.consts:
                raise NotImplementedError(
                    "mpfunc.autocast: rewriting this sub-program introduced constants; "
                    "please report it with the function that triggered it."
                )
            return new.jaxpr
        if isinstance(v, tuple) and v and all(isinstance(b, ClosedJaxpr) for b in v):
            return tuple(self._rewrite_closed(b) for b in v)
        return v

    def _rewrite_closed(self, cj: ClosedJaxpr) -> ClosedJaxpr:
        in_avals = [v.aval for v in cj.jaxpr.invars]
        out_dtypes = [getattr(v.aval, "dtype", None) for v in cj.jaxpr.outvars]

        def body(*args):
            outs = self.eval_jaxpr(cj.jaxpr, cj.consts, args)
            return [o if d is None else _cast(o, d) for o, d in zip(outs, out_dtypes)]

        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
                 for a in in_avals]
        return jax.make_jaxpr(body)(*specs)


def _is_traceable(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def autocast(
    fn: Callable | None = None,
    *,
    compute_dtype: Any = jnp.float16,
    lists: AutocastLists | None = None,
) -> Callable:
    """Rewrites ``fn``'s traced program op by op, as ``torch.autocast`` and apex O1 do.

    * Matmul-like ops (``HALF_OPS``: ``dot_general``, ``conv_general_dilated``, batched or
      not) run in ``compute_dtype``, accumulating in float32 (``preferred_element_type``)
      and returning ``compute_dtype``.
    * Precision-sensitive ops (``FLOAT32_OPS``: exp/log/log1p/expm1, powers and roots,
      erf/erfc/logistic, and the sums behind means, variances, norms, softmax and
      logsumexp) run in float32.
    * Everything else follows its inputs, promoting to the widest floating type among
      them; nothing upcasts a whole model. Explicit casts in ``fn`` are kept.

    The lists are plain data (`AutocastLists`) and can be overridden. Nested ``jit`` and
    ``custom_jvp`` functions (``jax.nn.relu``, ``jax.nn.softmax``) are inlined: the rules
    apply inside, and a ``custom_jvp`` primal is differentiated directly (the same
    derivative as the custom rule away from ties). ``scan``/``while_loop``/``cond``,
    ``checkpoint``/``remat`` and ``custom_vjp`` functions are rewritten inside, with their
    original dtypes at their edges, so carries, branches and a custom backward still
    match exactly.
    Gradients flow in the dtypes autocast chose. Array arguments are traced; any other
    argument (Python numbers, strings, modules) is passed through as static.

    Composes with ``jit``, ``grad``, ``value_and_grad``, ``vmap`` and ``shard_map`` (apply
    autocast to the per-shard function). Under ``jit`` the rewrite happens at trace time:
    the compiled program is what a hand-cast one would be, with no run-time cost.

    Args:
      fn: the function; omit it to use ``autocast(...)`` as a decorator factory.
      compute_dtype: the half dtype, float16 (default) or bfloat16.
      lists: the op lists; default `AutocastLists()`.

    Returns:
      The autocast function.

    Examples:
      >>> import jax, jax.numpy as jnp, mpfunc
      >>> @mpfunc.autocast
      ... def f(x, w):
      ...     return jax.nn.softmax(x @ w)
      >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
      >>> (x @ w).dtype, f(x, w).dtype, jax.jit(f)(x, w).dtype
      (dtype('float32'), dtype('float32'), dtype('float32'))
      >>> mpfunc.autocast(lambda x, w: x @ w)(x, w).dtype
      dtype('float16')
    """
    if fn is None:
        return functools.partial(autocast, compute_dtype=compute_dtype, lists=lists)
    if not callable(fn):
        raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
    compute = np.dtype(compute_dtype)
    if compute not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        raise ValueError(f"`compute_dtype` must be float16 or bfloat16, got {compute.name}.")
    if lists is None:
        lists = AutocastLists()
    elif not isinstance(lists, AutocastLists):
        raise TypeError(f"`lists` must be an AutocastLists, got {type(lists).__name__}.")
    rules = _Rules(compute, lists)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic_idx = [i for i, x in enumerate(leaves) if _is_traceable(x)]
        dynamic = [leaves[i] for i in dynamic_idx]

        def flat_fn(*dyn):
            full = list(leaves)
            for i, x in zip(dynamic_idx, dyn):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            return fn(*a, **k)

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dynamic)
        outs = rules.eval_jaxpr(closed.jaxpr, closed.consts, dynamic)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped
