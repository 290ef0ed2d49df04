"""The fp8 dot for JAX, with current or delayed scaling (the rule in `_mpfunc_common.fp8`).

Quantisation itself is in `mpfunc._src.fp8_quantize`. `fp8_dot` is a dense layer's matmul with
inputs and weights in the recipe's forward format and output gradients in its backward
format (a ``custom_vjp``). On CPU the matmul is emulated: dequantise, then multiply in
float32. On a GPU with fp8 support XLA rewrites that same dequantise -> dot pattern
(per-tensor scales) into an fp8 cuBLASLt GEMM; no other code path exists.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from _mpfunc_common.fp8 import Fp8Recipe, resolve_recipe
from mpfunc._src.distributed import _varying_axes
from mpfunc._src.fp8_quantize import (
    AxisName,
    block_amax,
    dequantize_fp8,
    pmax_over,
    quantize_with,
    scale_from_amax,
)

__all__ = ["Fp8Meta", "Fp8DotState", "fp8_dot", "fp8_dot_state"]

_F32 = jnp.float32


class Fp8Meta(NamedTuple):
    """Delayed-scaling state of one tensor: its amax history (newest first) and scale."""

    amax_history: jax.Array
    scale: jax.Array


class Fp8DotState(NamedTuple):
    """Delayed-scaling state of one `fp8_dot`: one `Fp8Meta` per operand.

    It is not a gradient and never goes through an optimizer or a loss scale: the
    updated state comes back as its "gradient" (flax's "overwrite with gradient").
    """

    input: Fp8Meta
    weight: Fp8Meta
    grad_output: Fp8Meta


def fp8_dot_state(recipe: Any = "delayed") -> Fp8DotState:
    """A fresh delayed-scaling state: zero histories, unit scales.

    Examples:
      >>> import mpfunc
      >>> s = mpfunc.fp8_dot_state(mpfunc.Fp8Recipe("delayed", amax_history_len=4))
      >>> s.input.amax_history.shape, s.grad_output.scale.dtype
      ((4,), dtype('float32'))
    """
    recipe = resolve_recipe(recipe)
    if not recipe.delayed:
        raise ValueError(f"`recipe` must use delayed scaling to have state, got scaling="
                         f"{recipe.scaling!r} (its scales are computed each step).")
    # One array per leaf: leaves sharing a buffer cannot all be donated to a step.
    return Fp8DotState(*(Fp8Meta(jnp.zeros((recipe.amax_history_len,), _F32),
                                 jnp.ones((), _F32)) for _ in range(3)))


# ------------------------------------------------------------------ delayed scaling
def _delayed(x, meta: Fp8Meta, name: str, recipe: Fp8Recipe, axis_name):
    """This step's scale, from the history alone, and the updated `Fp8Meta` (see the
    rule). The scale never waits for this step's amax, so XLA can compute the amax and
    the cast in one pass over ``x``."""
    hist = meta.amax_history
    used = jnp.max(hist) if recipe.amax_reduction == "max" else hist[0]
    prev_ok = jnp.isfinite(meta.scale) & (meta.scale > 0)  # not a state JAX zeroed
    fallback = jnp.where(prev_ok, meta.scale, jnp.ones((), _F32))
    scale = scale_from_amax(used, name, recipe.margin, recipe.power_of_2_scales, fallback)
    amax = pmax_over(block_amax(x, None), axis_name)
    rolled = jnp.concatenate([amax[None], hist[:-1]])
    new_hist = jnp.where(jnp.isfinite(amax), rolled, hist)
    return scale, Fp8Meta(new_hist, scale)


def _operand(x2d, role: str, recipe: Fp8Recipe, meta, axis_name):
    """Quantise-dequantise one operand (contraction dim last); returns (dq, new meta)."""
    name = recipe.dtype(role)
    if recipe.delayed:
        scale, new_meta = _delayed(x2d, meta, name, recipe, axis_name)
    else:
        block = recipe.block(role)
        amax = block_amax(x2d, block)
        if block is None:
            amax = pmax_over(amax, axis_name)
        scale, new_meta = scale_from_amax(amax, name, recipe.margin,
                                 recipe.power_of_2_scales, 1.0), None
    q = quantize_with(x2d, scale, recipe.block(role), name)
    return dequantize_fp8(q, scale, recipe.block(role)), new_meta


def _matmul(a, b):
    """a (M, K) @ b (N, K)^T in float32: the emulated fp8 GEMM."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=_F32)


def _fwd_impl(x, w, state, recipe, axis_name, out_dtype):
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    st = state if state is not None else Fp8DotState(None, None, None)
    xq, mx = _operand(x2, "input", recipe, st.input, axis_name)
    wq, mw = _operand(w.T, "weight", recipe, st.weight, axis_name)
    y = _matmul(xq, wq).astype(out_dtype).reshape(*x.shape[:-1], w.shape[1])
    return y, (mx, mw)


def _dot(x, w, state, recipe, axis_name, out_dtype):
    return _fwd_impl(x, w, state, recipe, axis_name, out_dtype)[0]


def _dot_fwd(x, w, state, recipe, axis_name, out_dtype):
    y, metas = _fwd_impl(x, w, state, recipe, axis_name, out_dtype)
    return y, (x, w, state, metas)


def _dot_bwd(recipe, axis_name, out_dtype, res, g):
    del out_dtype
    x, w, state, (mx, mw) = res
    k, n = w.shape
    x2 = x.reshape(-1, k)
    g2 = g.reshape(-1, n)
    if recipe.delayed:
        # One scale per tensor: quantise g once, reuse x's and w's forward scales.
        gq, mg = _operand(g2, "grad_output", recipe, state.grad_output, axis_name)
        xq = dequantize_fp8(quantize_with(x2, mx.scale, None, recipe.dtype("input")), mx.scale)
        wq = dequantize_fp8(quantize_with(w, mw.scale, None, recipe.dtype("weight")), mw.scale)
        dx = _matmul(gq, wq)             # (M, N) . (K, N)^T
        dw = _matmul(xq.T, gq.T)         # (K, M) . (N, M)^T
        new_state = Fp8DotState(mx, mw, mg)
    else:
        # Each operand quantised with its contraction dim last, as its matmul needs it.
        gq, _ = _operand(g2, "grad_output", recipe, None, axis_name)
        wq, _ = _operand(w, "weight", recipe, None, axis_name)
        dx = _matmul(gq, wq)
        xq_t, _ = _operand(x2.T, "input", recipe, None, axis_name)
        gq_t, _ = _operand(g2.T, "grad_output", recipe, None, axis_name)
        dw = _matmul(xq_t, gq_t)
        new_state = None
    return dx.astype(x.dtype).reshape(x.shape), dw.astype(w.dtype), new_state


_dot = jax.custom_vjp(_dot, nondiff_argnums=(3, 4, 5))
_dot.defvjp(_dot_fwd, _dot_bwd)


def fp8_dot(
    x: jax.Array,
    w: jax.Array,
    recipe: Any = "tensorwise",
    state: Fp8DotState | None = None,
    *,
    axis_name: AxisName = None,
    out_dtype: Any = None,
) -> jax.Array:
    """A dense layer's matmul ``x @ w`` with fp8 operands (the recipe's formats).

    Forward: ``x`` and ``w`` quantised to the forward format (e4m3 by default). Backward:
    the output gradient quantised to the backward format (e5m2 by default) for both the
    input-gradient and the weight-gradient matmul; each operand is scaled along its
    contraction dimension as the recipe says. Gradients come back in the dtypes of
    ``x`` and ``w``.

    Delayed scaling needs ``state`` (`fp8_dot_state`). The updated state is returned as
    the *gradient* with respect to ``state`` ("overwrite with gradient", as flax's
    ``fp8_ops``): take ``jax.grad`` with respect to it and use that value as the next
    step's state. It must not go through a loss scale or an optimizer. Use each state
    in one `fp8_dot` per step.

    Args:
      x: ``[..., K]`` activations.
      w: ``[K, N]`` kernel (flax ``Dense`` layout).
      recipe: a preset name or an `Fp8Recipe`.
      state: `Fp8DotState` for delayed scaling, else None.
      axis_name: mesh axes over which per-tensor amaxes are MAX-reduced (inside
        ``shard_map``), so every shard uses the same scales and histories.
      out_dtype: dtype of the output; default ``x.dtype``.

    Returns:
      ``[..., N]`` in ``out_dtype``.

    Examples:
      >>> import jax, jax.numpy as jnp, mpfunc
      >>> x, w = jnp.ones((4, 8)), jnp.full((8, 3), 0.5)
      >>> mpfunc.fp8_dot(x, w).tolist()[0]
      [4.0, 4.0, 4.0]
      >>> s = mpfunc.fp8_dot_state("delayed")
      >>> new_s = jax.grad(lambda s: mpfunc.fp8_dot(x, w, "delayed", s).sum())(s)
      >>> float(new_s.input.amax_history[0]), float(new_s.grad_output.amax_history[0])
      (1.0, 1.0)
    """
    recipe = resolve_recipe(recipe)
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"`x` must be [..., K] and `w` [K, N]; got {x.shape} and {w.shape}.")
    for arg, v in (("x", x), ("w", w)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"`{arg}` must be floating, got {v.dtype}.")
    if recipe.delayed and not isinstance(state, Fp8DotState):
        raise ValueError("delayed scaling needs `state`: pass mpfunc.fp8_dot_state(recipe) "
                         f"(and the gradient of it on later steps), got {type(state).__name__}.")
    if not recipe.delayed and state is not None:
        raise ValueError(f"`state` is only used by delayed scaling; recipe {recipe.scaling!r} "
                         "computes its scales each step. Pass state=None.")
    if recipe.delayed and state.input.amax_history.shape != (recipe.amax_history_len,):
        raise ValueError(f"`state` has an amax history of shape "
                         f"{state.input.amax_history.shape}, the recipe "
                         f"({recipe.amax_history_len},).")
    if axis_name is not None and recipe.scaling in ("rowwise", "blockwise"):
        raise ValueError(f"`axis_name` applies to per-tensor scales (tensorwise, delayed); "
                         f"{recipe.scaling} scales are local to the rows they scale.")
    try:
        out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    except TypeError:
        raise TypeError(f"`out_dtype` must be a dtype (e.g. jnp.bfloat16), got "
                        f"{out_dtype!r}.") from None
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    x, w = _same_varying_axes(x, w, recipe, axis_name)
    return _dot(x, w, state, recipe, axis_name, out_dtype)


def _same_varying_axes(x, w, recipe, axis_name):
    """Under shard_map's varying-axes typing: a replicated kernel meeting sharded
    activations is marked varying before the custom_vjp (as a plain matmul does
    implicitly), so its gradient is summed over the shards on the way out. The state
    stays replicated, so its update must be reduced over every axis the data varies on."""
    vx, vw = _varying_axes(x), _varying_axes(w)
    if not (vx or vw):
        return x, w
    vx, vw = vx or frozenset(), vw or frozenset()
    if vx - vw:
        w = _to_varying(w, tuple(sorted(vx - vw, key=str)))
    if vw - vx:
        x = _to_varying(x, tuple(sorted(vw - vx, key=str)))
    if recipe.delayed:
        named = set(axis_name if isinstance(axis_name, tuple) else
                    () if axis_name is None else (axis_name,))
        missing = (vx | vw) - named
        if missing:
            raise ValueError(
                f"`axis_name` must name every mesh axis the operands vary over "
                f"({sorted(vx | vw, key=str)}) so that all shards record the same amax "
                f"history; got axis_name={axis_name!r}.")
    return x, w


def _to_varying(x, axes):
    if hasattr(jax.lax, "pcast"):  # jax >= 0.8
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # pragma: no cover - older jax
