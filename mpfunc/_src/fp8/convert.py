"""`convert_to_fp8`: run the dense-layer matmuls of a JAX function in fp8.

The JAX mirror of ``mpfunc_torch.convert_to_fp8``. A function is traced and its program
re-evaluated op by op (as `mpfunc.autocast` does); every ``dot_general`` that multiplies
an activation by a *parameter* (a leaf of the first argument, possibly transposed,
reshaped or cast on the way, or one layer of a stacked leaf: ``w[i]``, or a ``scan``'s
slice, see `stacked`) with one contraction dimension and no batch dimensions
becomes an `mpfunc.fp8_dot`. Attention's activation-by-activation products, norms,
softmax and everything else run as written (or under autocast's rules in the fp8 AMP
mode).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from _mpfunc_common.fp8 import resolve_recipe
from mpfunc._src.autocast import AutocastLists, _Rules
from mpfunc._src.distributed import check_axis_name
from mpfunc._src.fp8.matmul import Fp8DotState, fp8_dot, fp8_dot_state
from mpfunc._src.fp8.quantize import AxisName
from mpfunc._src.fp8.stacked import (
    Level,
    Sites,
    TopLevel,
    View,
    follow,
    index_state,
    rewrite_scan,
    stacked_state,
)
from mpfunc._src.rewrite import INLINE, Jaxpr, Literal, Rewriter

__all__ = ["Fp8Function", "convert_to_fp8", "fp8_mode_apply"]

# jax.checkpoint's primitive (its name moved between jax versions).
_REMAT = frozenset({"remat2", "checkpoint", "remat"})


class _Fp8Rewriter(_Rules):
    """Evaluates a jaxpr (the `rewrite.Rewriter` engine), turning dense dots into fp8
    dots. A variable's tag is the `View` of the parameter it shows (`stacked`).
    Every other op runs under autocast's rules (the AMP mode, ``compute_dtype`` given)
    or as written.
    """

    def __init__(self, recipe, axis_name, state, compute_dtype):
        super().__init__(compute_dtype if compute_dtype is not None else np.float32,
                         AutocastLists())
        self.autocast = compute_dtype is not None
        self.recipe, self.axis_name = recipe, axis_name
        self.table = Sites()
        self.level = (Level(None) if state is None else
                      TopLevel(state, self.table, recipe.amax_history_len))

    @property
    def sites(self) -> list[str]:
        return list(self.table.seen)

    def tags(self, jaxpr, in_tags):
        view = {v: t for v, t in zip(jaxpr.invars, in_tags) if t is not None}
        for eqn in jaxpr.eqns:
            name, params = eqn.primitive.name, eqn.params
            ins = [None if isinstance(v, Literal) else view.get(v) for v in eqn.invars]
            if name in INLINE and hasattr(params.get("jaxpr"), "jaxpr"):
                _, out = self.tags(params["jaxpr"].jaxpr, ins)
                view.update({v: t for v, t in zip(eqn.outvars, out) if t is not None})
            elif ins and (out := follow(eqn, ins[0])) is not None:
                view[eqn.outvars[0]] = out
        return view, [None if isinstance(v, Literal) else view.get(v) for v in jaxpr.outvars]

    @staticmethod
    def _sub_tags(n_in, tags):
        # `while` and `cond` bodies and custom-derivative rules see no parameters: their
        # matmuls stay as the rules have them. (`scan` bodies do: `rewrite_scan`.)
        return [None] * n_in

    def apply(self, eqn, invals, tags):
        params = eqn.params
        if eqn.primitive.name == "scan" and any(t is not None for t in tags):
            return rewrite_scan(self, eqn, invals, tags)
        if eqn.primitive.name in _REMAT and isinstance(params.get("jaxpr"), Jaxpr):
            return self._remat(eqn, invals, tags)
        return super().apply(eqn, invals, tags)

    def _remat(self, eqn, invals, tags):
        """A ``jax.checkpoint`` / ``nn.remat`` region, rewritten inside and checkpointed
        again: its params keep their tags, and the delayed state it uses goes in as
        explicit inputs, so that its "gradient" (the new state) flows out."""
        jaxpr, outer = eqn.params["jaxpr"], self.level
        states = outer.states or {}
        keys = list(states)
        leaves, tree = jax.tree_util.tree_flatten([states[k] for k in keys])
        n = len(invals)

        def body(*args):
            inner = jax.tree_util.tree_unflatten(tree, args[n:])
            self.level = outer.child(dict(zip(keys, inner)) if outer.states is not None
                                     else None)
            try:
                return self.eval_jaxpr(jaxpr, (), args[:n], tags)
            finally:
                self.level = outer

        run = jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True),
                             policy=eqn.params.get("policy"))
        return run(*invals, *leaves)

    def rule(self, eqn, invals, tags):
        if eqn.primitive.name == "dot_general":
            out = self._dense(eqn, invals, tags)
            if out is not None:
                return out
        if self.autocast:
            return super().rule(eqn, invals, tags)
        return Rewriter.rule(self, eqn, invals, tags)

    def _dense(self, eqn, invals, tags):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if lb or rb or len(lc) != 1 or len(rc) != 1:
            return None
        is_param = [t is not None for t in tags]
        if is_param.count(True) != 1:
            return None
        w_idx = is_param.index(True)
        w, x = invals[w_idx], invals[1 - w_idx]
        if w.ndim != 2 or not all(jnp.issubdtype(v.dtype, jnp.floating) for v in invals):
            return None
        cw, cx = (lc, rc)[w_idx][0], (lc, rc)[1 - w_idx][0]
        view = tags[w_idx]
        if view.pending is not None:  # w[i:i + 1] of a 2-D kernel: a row, not a layer
            return None
        key = self.table.key(view.path, *view.site())
        state = None
        if self.recipe.delayed:
            level_state = self.level.get(key, view.origin)
            state = (fp8_dot_state(self.recipe) if level_state is None  # discovery (init)
                     else index_state(level_state, view))
        out_dtype = self.compute if self.autocast else eqn.outvars[0].aval.dtype
        w_kn = w if cw == 0 else w.T
        y = fp8_dot(jnp.moveaxis(x, cx, -1), w_kn, self.recipe, state,
                    axis_name=self.axis_name, out_dtype=out_dtype)
        return jnp.moveaxis(y, -1, 0) if w_idx == 0 else y


class Fp8Function:
    """What `convert_to_fp8` returns: call it like the original function.

    ``fn(params, *args, fp8_state=None, **kwargs)``. With delayed scaling pass
    ``fp8_state`` (from `init`) and use the gradient with respect to it as the next
    step's state. `sites` lists the converted matmuls by parameter path.
    """

    def __init__(self, fn, recipe, axis_name, compute_dtype=None, output_cast=None):
        self.fn, self.recipe, self.axis_name = fn, recipe, axis_name
        self.compute_dtype, self.output_cast = compute_dtype, output_cast
        functools.update_wrapper(self, fn)

    def _run(self, params, args, kwargs, state, axis_name=None):
        rewriter = _Fp8Rewriter(self.recipe, axis_name, state, self.compute_dtype)

        def in_tag(path, leaf):  # ((params, *args), kwargs): a leaf of params, by its path
            del leaf
            if len(path) >= 2 and path[0].idx == 0 and path[1].idx == 0:
                return View(jax.tree_util.keystr(path[2:], simple=True, separator="/"))
            return None

        out = rewriter.wrap(self.fn, in_tag)(params, *args, **kwargs)
        return out, rewriter

    def __call__(self, params, *args, fp8_state: dict[str, Fp8DotState] | None = None,
                 **kwargs):
        if self.recipe.delayed and fp8_state is None:
            raise ValueError("delayed scaling needs `fp8_state=`: make it with "
                             "`.init(params, *args)` and carry the gradient with respect "
                             "to it from step to step.")
        if not self.recipe.delayed and fp8_state is not None:
            raise ValueError(f"`fp8_state` is only used by delayed scaling; recipe "
                             f"{self.recipe.scaling!r} keeps no state.")
        if fp8_state is not None and not isinstance(fp8_state, dict):
            raise TypeError(f"`fp8_state` must be the dict `.init` returns, got "
                            f"{type(fp8_state).__name__}.")
        out = self._run(params, args, kwargs, fp8_state, self.axis_name)[0]
        return out if self.output_cast is None else self.output_cast(out)

    def sites(self, params, *args, **kwargs) -> list[str]:
        """The converted matmuls, named by the path of their parameter (traced only).

        Arguments that are not arrays (flax's ``train=False``) stay static, as in a call;
        no amax is reduced, so it runs outside ``shard_map`` too. A kernel sliced from
        stacked layer params (``w[i]``, or a ``scan`` over them) is one site for all its
        layers."""
        return list(self._stacks(params, args, kwargs))

    def _stacks(self, params, args, kwargs) -> dict[str, tuple]:
        """Each site's key and the stack shape of its state (``()``: one matmul)."""
        box = []
        flat, treedef = jax.tree_util.tree_flatten((params, args, kwargs))
        dynamic = [i for i, x in enumerate(flat) if isinstance(x, jax.Array | np.ndarray)]

        def probe(*dyn):
            full = list(flat)
            for i, x in zip(dynamic, dyn):
                full[i] = x
            p, a, k = jax.tree_util.tree_unflatten(treedef, full)
            out, interp = self._run(p, a, k, None)
            box.append(dict(interp.table.seen))
            return out

        jax.eval_shape(probe, *[flat[i] for i in dynamic])
        return box[0]

    def init(self, params, *args, **kwargs) -> dict[str, Fp8DotState]:
        """Delayed scaling's fresh state: one `Fp8DotState` per converted matmul, its
        leaves stacked ``[L, ...]`` for a kernel sliced from stacked layer params (one
        per layer) and ``[n, ...]`` for a loop-invariant kernel in a scan of length
        ``n`` (one per iteration)."""
        if not self.recipe.delayed:
            raise ValueError(f"recipe {self.recipe.scaling!r} keeps no state; only delayed "
                             "scaling has an `init`.")
        return {key: stacked_state(fp8_dot_state(self.recipe), stack)
                for key, stack in self._stacks(params, args, kwargs).items()}


def convert_to_fp8(
    fn: Callable,
    recipe: Any = "tensorwise",
    *,
    axis_name: AxisName = None,
    compute_dtype: Any = None,
) -> Fp8Function:
    """Runs the dense-layer matmuls of ``fn(params, *args)`` in fp8 (`mpfunc.fp8_dot`).

    A matmul is converted when it is a ``dot_general`` with one contraction dimension,
    no batch dimensions, and exactly one operand that is a 2-D view of a leaf of
    ``params`` (the first argument): the leaf, possibly transposed, reshaped or cast on
    the way (``x @ w``, ``jnp.einsum("btk,nk->btn", x, w)``, ``w @ x``), or one layer of
    a leaf stacked along leading layer axes: ``w[i]`` in an unrolled loop, or the slice
    a ``jax.lax.scan`` over it gives its body (flax ``nn.scan`` / ``nnx.scan`` too).
    Each layer gets its own scales; delayed scaling's state for such a kernel is stacked
    like it (one history per layer). A kernel used at every iteration of a scan gets one
    state per iteration. Products of two activations (attention) are left alone, and
    so are matmuls inside ``while_loop`` / ``cond`` bodies.

    Args:
      fn: ``fn(params, *args, **kwargs)``.
      recipe: a preset name or an `Fp8Recipe`.
      axis_name: mesh axes for the per-tensor amax reduction (inside ``shard_map``).
      compute_dtype: None: every other op runs as written and each fp8 matmul returns
        its original dtype. ``jnp.bfloat16`` / ``jnp.float16``: the rest runs under
        `mpfunc.autocast` with that dtype, and fp8 matmuls return it (the fp8 mode).

    Returns:
      An `Fp8Function`.

    Examples:
      >>> import jax.numpy as jnp, mpfunc
      >>> f = mpfunc.convert_to_fp8(lambda p, x: jnp.tanh(x @ p["w"]) @ p["v"])
      >>> params = {"w": jnp.ones((4, 3)), "v": jnp.ones((3, 2))}
      >>> f.sites(params, jnp.ones((5, 4)))
      ['w', 'v']
      >>> f(params, jnp.ones((5, 4))).shape
      (5, 2)
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
    recipe = resolve_recipe(recipe)
    if compute_dtype is not None:
        compute_dtype = np.dtype(compute_dtype)
        if compute_dtype not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
            raise ValueError(f"`compute_dtype` must be None, bfloat16 or float16, got "
                             f"{compute_dtype.name}.")
    axis_name = check_axis_name(axis_name)
    if axis_name is not None and recipe.scaling in ("rowwise", "blockwise"):
        raise ValueError(f"`axis_name` applies to per-tensor scales (tensorwise, delayed); "
                         f"{recipe.scaling} scales are local to the rows they scale.")
    return Fp8Function(fn, recipe, axis_name, compute_dtype)


def fp8_mode_apply(fn: Callable, recipe, compute_dtype, output_cast: Callable,
                   axis_name: AxisName) -> Fp8Function:
    """The fp8 AMP mode's ``apply_fn``: dense matmuls in fp8, the rest under autocast,
    outputs cast by ``output_cast``; ``axis_name`` reduces per-tensor amaxes only."""
    per_tensor = recipe.block("input") is None
    return Fp8Function(fn, recipe, axis_name if per_tensor else None, np.dtype(compute_dtype),
                       output_cast)
