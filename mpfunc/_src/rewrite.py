"""Re-evaluates a traced program equation by equation under dtype rules.

The engine behind `mpfunc.autocast`, the apex O2 model rules in `mpfunc.convert_to_amp`
and the CPU float16 attention route of the flax policies. A `Rewriter` evaluates a
jaxpr; subclasses decide, per equation, which dtypes it runs in (`Rewriter.rule`).
Nested ``jit`` is inlined (the rules reach through it with no boundary casts); control
flow, ``checkpoint`` and ``custom_vjp`` are rewritten inside, with their original dtypes
at their edges, so carries, branches and custom backward rules still match exactly.

Each variable may carry a *tag* (any value; ``None`` means untagged) that subclasses
compute with `Rewriter.tags`; tags of a call's inputs are passed on to its sub-programs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

__all__ = ["Rewriter", "cast", "eval_eqns", "is_float", "widest", "strip_dot_algorithm"]

INLINE = frozenset({"jit", "pjit", "closed_call", "core_call"})
INLINE_CALL = frozenset({"custom_jvp_call"})


def bind_with_subprograms(prim, invals, params):
    """Binds a primitive from jaxpr params, as ``jax.core.eval_jaxpr`` does.

    ``get_bind_params`` turns jaxpr-valued params back into what ``bind`` takes (e.g. a
    custom_vjp's functions). It returns the params alone in newer jax and a
    ``(subfuns, params)`` pair in older jax; both are handled here, in one place.
    """
    out = prim.get_bind_params(params)
    if isinstance(out, tuple):
        subfuns, bind_params = out
        return prim.bind(*subfuns, *invals, **bind_params)
    return prim.bind(*invals, **out)


def eval_eqns(jaxpr: Jaxpr, consts, args, apply: Callable[[Any, list], list]) -> list:
    """Evaluates ``jaxpr`` on ``args``, each equation by ``apply(eqn, invals) -> outs``.

    The one interpreter loop behind `Rewriter.eval_jaxpr` and the exact skip's rewrite:
    ``apply`` returns a list of output values (one per ``eqn.outvars``).
    """
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        for v, o in zip(eqn.outvars, apply(eqn, [read(v) for v in eqn.invars])):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def cast(x, dtype):
    """``x`` in ``dtype`` if it is floating (and not already), else ``x``."""
    if is_float(jnp.result_type(x)) and jnp.result_type(x) != dtype:
        return jax.lax.convert_element_type(x, dtype)
    return x


def widest(dtypes):
    """The widest floating dtype; float32 joins two different ones of equal width."""
    best = None
    for d in dtypes:
        d = np.dtype(d)
        if best is None or d.itemsize > best.itemsize:
            best = d
        elif d.itemsize == best.itemsize and d != best:
            best = np.dtype(jnp.float32)
    return best


def strip_dot_algorithm(params: dict) -> dict:
    """``params`` without a dot algorithm preset (e.g. ``F16_F16_F32``).

    The accumulation type stays expressed by ``preferred_element_type``, which every
    backend honours, while a preset is refused by backends that lack it (XLA:CPU refuses
    ``F16_F16_F32`` inside ``jit``; it is what ``jax.nn.dot_product_attention`` asks for
    with float16 inputs). For bfloat16 on XLA:CPU autocast also widens the operands
    (`autocast._accumulate_in_float32`).
    """
    precision = params.get("precision")
    algorithm_types = tuple(t for t in (getattr(jax.lax, "DotAlgorithmPreset", None),
                                        getattr(jax.lax, "DotAlgorithm", None)) if t)
    if isinstance(precision, algorithm_types):
        return dict(params, precision=None)
    return params


class Rewriter:
    """Evaluates jaxprs, equation by equation, under `rule` (plain ``bind`` here)."""

    #: inline ``custom_jvp`` functions (their primal is rewritten and differentiated
    #: directly) instead of rewriting them inside and keeping their custom rule.
    inline_custom_jvp = True

    # -- hooks ---------------------------------------------------------------------------
    def tags(self, jaxpr: Jaxpr, in_tags: Sequence[Any]) -> tuple[dict, list]:
        """(tag of each variable, tags of the outputs); nothing is tagged here."""
        del jaxpr, in_tags
        return {}, []

    def rule(self, eqn, invals: list, tags: list) -> Any:
        """Runs one primitive equation (no sub-programs) on ``invals``."""
        del tags
        return eqn.primitive.bind(*invals, **eqn.params)

    # -- evaluation ----------------------------------------------------------------------
    def eval_jaxpr(self, jaxpr: Jaxpr, consts, args, in_tags: Sequence[Any] | None = None):
        var_tags, _ = self.tags(jaxpr, list(in_tags or [None] * len(jaxpr.invars)))

        def apply(eqn, invals):
            tags = [None if isinstance(v, Literal) else var_tags.get(v) for v in eqn.invars]
            outs = self.apply(eqn, invals, tags)
            return outs if eqn.primitive.multiple_results else [outs]

        return eval_eqns(jaxpr, consts, args, apply)

    def inlined(self, eqn) -> tuple[ClosedJaxpr, int] | None:
        """``(program, skip)`` when ``eqn`` is a call evaluated inline (nested ``jit``;
        ``custom_jvp`` with `inline_custom_jvp`): its body runs on the equation's inputs
        from ``skip`` on. None for any other equation."""
        params = eqn.params
        name = eqn.primitive.name
        if name in INLINE and isinstance(params.get("jaxpr"), ClosedJaxpr):
            return params["jaxpr"], 0
        if (self.inline_custom_jvp and name in INLINE_CALL
                and isinstance(params.get("call_jaxpr"), ClosedJaxpr)):
            cj = params["call_jaxpr"]
            n = params.get("num_consts", 0)
            skip = n if not cj.jaxpr.constvars and len(cj.jaxpr.invars) < len(eqn.invars) else 0
            return cj, skip
        return None

    def apply(self, eqn, invals, tags):
        prim, params = eqn.primitive, dict(eqn.params)
        inline = self.inlined(eqn)
        if inline is not None:
            cj, skip = inline
            outs = self.eval_jaxpr(cj.jaxpr, cj.consts, invals[skip:], tags[skip:])
            return outs if prim.multiple_results else outs[0]
        if self._has_subjaxpr(params):
            # A control-flow or custom-derivative boundary: rewrite the sub-programs with
            # the rules inside and the original dtypes at their edges, so the primitive's
            # signature (carries, branches, custom rules) is unchanged (except for the
            # inputs `edge_dtypes` lets in as they are).
            edge = self.edge_dtypes(eqn, invals, tags)
            params = {k: self._rewrite_param(v, tags, edge) for k, v in params.items()}
            invals = [cast(x, d or v.aval.dtype) if hasattr(v.aval, "dtype") else x
                      for x, v, d in zip(invals, eqn.invars, edge)]
            return bind_with_subprograms(prim, invals, params)
        return self.rule(eqn, invals, tags)

    # -- sub-programs --------------------------------------------------------------------
    def edge_dtypes(self, eqn, invals: list, tags: list) -> list:
        """Per input of a sub-program equation: the dtype it enters in, or None for its
        traced one (always, here). Only a ``scan``'s consts and scanned inputs, a
        ``cond``'s operands and a checkpoint's inputs may differ: their sub-programs
        are traced again with them (`changeable_inputs`)."""
        del invals, tags
        return [None] * len(eqn.invars)

    @staticmethod
    def changeable_inputs(eqn) -> list[int]:
        """The inputs of ``eqn`` whose dtype its sub-programs can be retraced with."""
        name, params, n = eqn.primitive.name, eqn.params, len(eqn.invars)
        if name == "scan":  # not the carries
            first, last = params["num_consts"], params["num_consts"] + params["num_carry"]
            return [*range(first), *range(last, n)]
        if name == "cond":
            return list(range(1, n))
        if name in ("checkpoint", "remat", "remat2"):
            return list(range(n))
        return []

    @staticmethod
    def _has_subjaxpr(params) -> bool:
        for v in params.values():
            if isinstance(v, ClosedJaxpr | Jaxpr):
                return True
            if isinstance(v, tuple) and v and all(isinstance(b, ClosedJaxpr) for b in v):
                return True
        return False

    @staticmethod
    def _sub_tags(n_in: int, tags: list) -> list:
        # Sub-programs whose inputs are the equation's (scan, checkpoint, custom_vjp) or
        # all but the first (cond's index) inherit their tags; others start untagged.
        if n_in == len(tags):
            return list(tags)
        if n_in == len(tags) - 1:
            return list(tags[1:])
        return [None] * n_in

    def _rewrite_param(self, v, tags, dtypes):
        if isinstance(v, ClosedJaxpr):
            n = len(v.jaxpr.invars)
            return self._rewrite_closed(v, self._sub_tags(n, tags), _sub_dtypes(n, dtypes))
        if isinstance(v, Jaxpr):
            n = len(v.invars)
            new = self._rewrite_closed(ClosedJaxpr(v, ()), self._sub_tags(n, tags),
                                       _sub_dtypes(n, dtypes))
            if new.consts:
                raise NotImplementedError(
                    "mpfunc: rewriting this sub-program introduced constants; please "
                    "report it with the function that triggered it."
                )
            return new.jaxpr
        if isinstance(v, tuple) and v and all(isinstance(b, ClosedJaxpr) for b in v):
            return tuple(self._rewrite_closed(b, self._sub_tags(len(b.jaxpr.invars), tags),
                                              _sub_dtypes(len(b.jaxpr.invars), dtypes))
                         for b in v)
        return v

    def _rewrite_closed(self, cj: ClosedJaxpr, in_tags, in_dtypes=None) -> ClosedJaxpr:
        in_avals = [v.aval for v in cj.jaxpr.invars]
        out_dtypes = [getattr(v.aval, "dtype", None) for v in cj.jaxpr.outvars]

        def body(*args):
            outs = self.eval_jaxpr(cj.jaxpr, cj.consts, args, in_tags)
            return [o if d is None else cast(o, d) for o, d in zip(outs, out_dtypes)]

        specs = [jax.ShapeDtypeStruct(a.shape, d or a.dtype, weak_type=a.weak_type and not d)
                 for a, d in zip(in_avals, in_dtypes or [None] * len(in_avals))]
        return jax.make_jaxpr(body)(*specs)

    # -- entry point ---------------------------------------------------------------------
    def wrap(self, fn: Callable, in_tag: Callable[[tuple, Any], Any] | None = None,
             trace_dtype: Callable[[tuple, Any], Any] | None = None) -> Callable:
        """``fn`` re-evaluated under these rules.

        Array arguments are traced; any other argument (Python numbers, strings,
        modules) is passed through as static. ``in_tag(path, leaf)`` gives the tag of
        each traced argument, from its key path in ``(args, kwargs)``.
        ``trace_dtype(path, leaf)``, if given, is the dtype to trace that argument in
        (None: its own); the program is then evaluated on the argument as it is.
        """

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            flat, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
            leaves = [x for _, x in flat]
            dynamic_idx = [i for i, x in enumerate(leaves) if _is_traceable(x)]
            dynamic = [leaves[i] for i in dynamic_idx]

            def flat_fn(*dyn):
                full = list(leaves)
                for i, x in zip(dynamic_idx, dyn):
                    full[i] = x
                a, k = jax.tree_util.tree_unflatten(treedef, full)
                return fn(*a, **k)

            tags = [in_tag(flat[i][0], flat[i][1]) for i in dynamic_idx] if in_tag else None
            traced = list(dynamic)
            if trace_dtype is not None:
                for n, i in enumerate(dynamic_idx):
                    if (dtype := trace_dtype(*flat[i])) is not None:
                        traced[n] = jax.ShapeDtypeStruct(jnp.shape(dynamic[n]), dtype)
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*traced)
            outs = self.eval_jaxpr(closed.jaxpr, closed.consts, dynamic, tags)
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

        return wrapped


def _sub_dtypes(n_in: int, dtypes: list) -> list:
    """``edge_dtypes`` for a sub-program with ``n_in`` inputs, matched as tags are."""
    return Rewriter._sub_tags(n_in, dtypes)  # the base rule, whatever a subclass's is


def _is_traceable(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)
