"""Op-level autocast for JAX: the traced program is rewritten op by op."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpfunc._src.float32_sums import BROADCASTING_OPS, broadcast, summing_in_float32
from mpfunc._src.model_state import map_leaves
from mpfunc._src.policy import _to_dtype
from mpfunc._src.rewrite import (
    Literal,
    Rewriter,
    cast,
    is_float,
    strip_dot_algorithm,
    widest,
)

__all__ = ["autocast", "AutocastLists", "HALF_OPS", "FLOAT32_OPS", "without_dot_algorithms"]

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


class _Rules(Rewriter):
    """autocast's rules: half ops in the compute dtype, float32 ops in float32, the rest
    following their inputs."""

    def __init__(self, compute_dtype, lists: AutocastLists):
        self.compute = np.dtype(compute_dtype)
        self.lists = lists

    def rule(self, eqn, invals, tags):
        del tags
        prim, params = eqn.primitive, dict(eqn.params)
        name = prim.name
        # Scalar literals (weakly typed, or constants baked in at trace time) adapt to the
        # data: they do not take part in choosing the dtype.
        floats = [x for x, v in zip(invals, eqn.invars)
                  if is_float(jnp.result_type(x)) and not isinstance(v, Literal)
                  and not getattr(v.aval, "weak_type", False)]
        if not floats and not any(is_float(jnp.result_type(x)) for x in invals):
            return prim.bind(*invals, **params)
        if name in self.lists.half_ops:
            return self.half_op(prim, params, invals)
        if name in self.lists.float32_ops:
            return prim.bind(*[cast(x, jnp.float32) for x in invals], **params)
        if name == "convert_element_type":
            return prim.bind(*invals, **params)  # an explicit cast in user code is kept
        if not floats:  # only weak (scalar-literal) floats: nothing to decide
            return prim.bind(*invals, **params)
        return follow_inputs(prim, params, invals, floats)

    def half_op(self, prim, params, invals):
        """A half op on ``invals`` cast to the compute dtype.

        A dot algorithm preset (``F16_F16_F32``, which ``jax.nn.dot_product_attention``
        asks for with float16 inputs) is dropped: float32 accumulation is expressed by
        ``preferred_element_type`` instead (see `_accumulate_in_float32` for bfloat16 on
        CPU).
        """
        invals = [cast(x, self.compute) for x in invals]
        params = strip_dot_algorithm(params)
        if "preferred_element_type" in params and len(invals) == 2:
            return self._half_op(prim, params)(*invals)
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
            return cast(_accumulate_in_float32(prim, a, b, acc), compute)

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


def _accumulate_in_float32(prim, a, b, params):
    """``prim(a, b)`` with a float32 result (``params`` asks for it).

    XLA:CPU runs a dot that its fast paths do not take (e.g. a batched one contracting a
    non-minor dimension, as attention's backward has) with a kernel that cannot take
    bfloat16 inputs with a float32 result ("Unsupported element type for
    DotThunk::Execute: BF16 x BF16 = F32", jax 0.10.2). There the bfloat16 operands are
    widened to float32 first: every bfloat16 value is exact in float32, so the products
    and their float32 sum are the same; other platforms keep the mixed dot.
    """
    if prim.name != "dot_general" or a.dtype != jnp.bfloat16 or b.dtype != jnp.bfloat16:
        return prim.bind(a, b, **params)
    f32 = jnp.float32
    return jax.lax.platform_dependent(
        a, b,
        cpu=lambda a, b: prim.bind(a.astype(f32), b.astype(f32), **params),
        default=lambda a, b: prim.bind(a, b, **params))


def follow_inputs(prim, params, invals, floats):
    """Binds ``prim`` with its floating inputs promoted to the widest among ``floats``."""
    target = widest(jnp.result_type(x) for x in floats)
    invals = [cast(x, target) for x in invals]
    pet = params.get("preferred_element_type")
    if pet is not None and is_float(pet):
        params = dict(params, preferred_element_type=target)
    return prim.bind(*invals, **params)


class _StripDotAlgorithms(Rewriter):
    """Drops dot algorithm presets and nothing else: every dtype stays as traced."""

    inline_custom_jvp = False

    def rule(self, eqn, invals, tags):
        del tags
        params = dict(eqn.params)
        if eqn.primitive.name == "dot_general":
            params = strip_dot_algorithm(params)
        return eqn.primitive.bind(*invals, **params)


class _HalfModelRules(_Rules):
    """A half-precision model (naive, apex O2/O3) with float32 statistics.

    Matmuls run in the compute dtype (float32 accumulation), whatever upcast reached
    them, and the precision-sensitive ops (``FLOAT32_OPS``: the sums behind means,
    variances, norms and softmax, exp/log, powers and roots) run in float32, as torch's
    half kernels accumulate them. A value is *kept* in float32 when it is a float32 leaf
    of the inputs (apex O2's norm params, mutable state such as ``batch_stats``) or a
    float32 constant, a float32 op's result, or computed from kept values only. An op
    where a kept value meets any other value (an activation, also one that a dtype
    promotion in ``fn`` cast to float32) runs in float32 and returns the compute dtype,
    so a norm's output goes back to it as on the torch side. A half value that an op
    broadcasts (a bias, a norm's scale) or gathers (an embedding) gets its gradient summed
    in float32. Everything else follows its inputs.
    """

    def tags(self, jaxpr, in_tags):
        kept = {v: True for v in jaxpr.constvars
                if getattr(v.aval, "dtype", None) == np.dtype(jnp.float32)}
        kept.update({v: True for v, t in zip(jaxpr.invars, in_tags) if t})

        def tag(v):
            return None if isinstance(v, Literal) else kept.get(v)

        for eqn in jaxpr.eqns:
            name, params = eqn.primitive.name, eqn.params
            ins = [v for v in eqn.invars if not isinstance(v, Literal)
                   and (dt := getattr(v.aval, "dtype", None)) is not None and is_float(dt)]
            inline = self.inlined(eqn)
            if inline is not None:
                cj, skip = inline
                _, out = self.tags(cj.jaxpr, [tag(v) for v in eqn.invars[skip:]])
                kept.update({v: True for v, t in zip(eqn.outvars, out) if t})
            elif self._has_subjaxpr(params) or not ins:
                continue
            elif name in self.lists.float32_ops:
                kept.update({v: True for v in eqn.outvars})  # a float32 statistic
            elif name == "convert_element_type":
                if kept.get(ins[0]) and params["new_dtype"] == np.dtype(jnp.float32):
                    kept.update({v: True for v in eqn.outvars})
            elif all(v in kept for v in ins):
                kept.update({v: True for v in eqn.outvars})  # computed from kept values
        return kept, [tag(v) for v in jaxpr.outvars]

    def edge_dtypes(self, eqn, invals, tags):
        # Norm params enter a scan (as consts or scanned inputs), a cond or a checkpoint
        # in float32 (traced as the compute dtype: see `half_model`).
        out: list[np.dtype | None] = [None] * len(invals)
        for i in self.changeable_inputs(eqn):
            if tags[i] and is_float(jnp.result_type(invals[i])):
                out[i] = jnp.result_type(invals[i])
        return out

    def rule(self, eqn, invals, tags):
        name = eqn.primitive.name
        floats = [(x, t) for x, t, v in zip(invals, tags, eqn.invars)
                  if is_float(jnp.result_type(x)) and not isinstance(v, Literal)]
        if (name not in self.lists.half_ops and name not in self.lists.float32_ops
                and name != "convert_element_type" and any(t for _, t in floats)
                and not all(t for _, t in floats)):
            # A kept float32 value meets an activation: float32 in, the compute dtype out.
            params = dict(eqn.params)
            if is_float(params.get("preferred_element_type") or np.int32):
                params["preferred_element_type"] = np.dtype(jnp.float32)
            out = eqn.primitive.bind(*[cast(x, jnp.float32) for x in invals], **params)
            if eqn.primitive.multiple_results:
                return [cast(o, self.compute) for o in out]
            return cast(out, self.compute)
        if name == "gather" and self._is_half(invals[0]):
            params = dict(eqn.params)
            return summing_in_float32(lambda y, i: eqn.primitive.bind(y, i, **params),
                                       *invals)
        if name == "broadcast_in_dim" and self._is_half(invals[0]):
            return broadcast(invals[0], eqn.params["shape"], eqn.params["broadcast_dimensions"])
        if name in BROADCASTING_OPS:
            # A half operand that the op broadcasts (a bias, a norm's scale): its
            # gradient sums the cotangent over the broadcast dimensions, in float32.
            shape = eqn.outvars[0].aval.shape
            invals = [broadcast(x, shape, range(len(shape) - x.ndim, len(shape)))
                      if self._is_half(x) and not isinstance(v, Literal) else x
                      for x, v in zip(invals, eqn.invars)]
        return super().rule(eqn, invals, tags)

    def _is_half(self, x):
        return jnp.result_type(x) == self.compute


def half_model(fn: Callable, compute_dtype: Any):
    """``fn(*args, **kwargs)`` under `_HalfModelRules`: its float32 input leaves (apex
    O2's norm params, mutable state) are the values kept in float32.

    ``fn`` is traced with its float32 params (not its state) seen in the compute dtype,
    the model as ``model.half()`` has it, then evaluated on the float32 ones: a ``scan``
    over layers with float32 norm params would otherwise carry float32 activations out
    of a body that takes half ones, which JAX refuses. They enter scan, cond and
    checkpoint bodies in float32 (`_HalfModelRules.edge_dtypes`). Mutable state is
    traced as it is, so its updates stay float32 (`model_state`)."""
    rules = _HalfModelRules(compute_dtype, AutocastLists())
    f32, half = np.dtype(jnp.float32), np.dtype(compute_dtype)

    def in_tag(path, leaf):
        del path
        return jnp.result_type(leaf) == f32

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        params = set()
        map_leaves((args, kwargs), lambda path, x, state: None if state else
                   params.add(jax.tree_util.keystr(path)))

        def trace_dtype(path, leaf):
            return half if in_tag(path, leaf) and jax.tree_util.keystr(path) in params else None

        return rules.wrap(fn, in_tag, trace_dtype)(*args, **kwargs)

    return wrapped


def without_dot_algorithms(fn: Callable) -> Callable:
    """``fn`` with its dot algorithm presets dropped (see `rewrite.strip_dot_algorithm`).

    Used to run float16 attention on CPU, where XLA refuses ``F16_F16_F32`` under jit.
    """
    return _StripDotAlgorithms().wrap(fn)


def autocast(
    fn: Callable | None = None,
    *,
    compute_dtype: Any = jnp.float16,
    lists: AutocastLists | None = None,
) -> Callable:
    """Rewrites ``fn``'s traced program op by op, as ``torch.autocast`` and apex O1 do.

    * Matmul-like ops (``HALF_OPS``: ``dot_general``, ``conv_general_dilated``, batched or
      not) run in ``compute_dtype``, accumulating in float32 (``preferred_element_type``)
      and returning ``compute_dtype``. A dot algorithm preset in ``fn`` (e.g. the
      ``F16_F16_F32`` that ``jax.nn.dot_product_attention`` asks for, which XLA:CPU
      refuses under ``jit``) is replaced by that float32 accumulation.
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
    # The policy strings' names too ("f16", "bf16", "half"); numpy reads "f16" as a
    # 16-byte float.
    compute = _to_dtype(compute_dtype, "compute_dtype")
    if compute not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        raise ValueError("`compute_dtype` must be float16 or bfloat16 (or 'f16', 'bf16', "
                         f"'half'), got {compute_dtype!r}.")
    if lists is None:
        lists = AutocastLists()
    elif not isinstance(lists, AutocastLists):
        raise TypeError(f"`lists` must be an AutocastLists, got {type(lists).__name__}.")
    return _Rules(compute, lists).wrap(fn)
