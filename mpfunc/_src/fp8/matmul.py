"""The fp8 dot for JAX, with current or delayed scaling (the rule in `_mpfunc_common.fp8`).

Quantisation itself is in `mpfunc._src.fp8.quantize`. `fp8_dot` is a dense layer's matmul with
inputs and weights in the recipe's forward format and output gradients in its backward
format (a ``custom_vjp``). Its three GEMMs are ``dot_general`` on the fp8 operands with a
float32 result, scaled afterwards (`_gemm`): XLA:CPU runs them by upcasting the fp8
values (their products are exact in float32), and on a GPU with fp8 support XLA's GEMM
rewriter makes each per-tensor one a cuBLASLt fp8 GEMM. Blockwise GEMMs stay emulated:
dequantise, then multiply in float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from _mpfunc_common.fp8 import Fp8Recipe, resolve_recipe
from mpfunc._src.distributed import _varying_axes
from mpfunc._src.fp8.quantize import (
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


def _quantize(x2d, role: str, recipe: Fp8Recipe, meta, axis_name):
    """One operand (contraction dim last) quantised: ``(q, scale, new meta)``."""
    name = recipe.dtype(role)
    block = recipe.block(role)
    if recipe.delayed:
        scale, new_meta = _delayed(x2d, meta, name, recipe, axis_name)
    else:
        amax = block_amax(x2d, block)
        if block is None:
            amax = pmax_over(amax, axis_name)
        scale = scale_from_amax(amax, name, recipe.margin, recipe.power_of_2_scales, 1.0)
        new_meta = None
    return quantize_with(x2d, scale, block, name), scale, new_meta


_NT = (((1,), (1,)), ((), ()))  # a (M, K) . b (N, K)^T -> (M, N)


def _inv(scale):
    return jnp.asarray(1, _F32) / scale


def _gemm(qa, sa, qb, sb, block_a, block_b, dims=_NT):
    """The GEMM of two quantised operands, in float32.

    Per-tensor scales: ``dot_general`` on the fp8 operands, then one multiply of the
    output by ``(1/scale_a) * (1/scale_b)`` (flax's ``Fp8DirectDotGeneralOp`` form,
    which XLA's GEMM rewriter turns into one cuBLASLt fp8 GEMM on Ada/Hopper). Rowwise
    (``dims`` must be ``_NT``): the same fp8 ``dot_general``, its output scaled per row
    and per column. Blockwise: emulated, dequantised operands multiplied in float32.
    """
    if block_a is None or block_a == (1, None):
        out = jax.lax.dot_general(qa, qb, dims, preferred_element_type=_F32)
        if block_a is None:
            return out * (_inv(sa) * _inv(sb))
        return out * _inv(sa) * _inv(sb).reshape(1, -1)
    return jax.lax.dot_general(dequantize_fp8(qa, sa, block_a), dequantize_fp8(qb, sb, block_b),
                               dims, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=_F32)


def _fwd_impl(x, w, state, recipe, axis_name, out_dtype):
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    meta_x, meta_w = (state.input, state.weight) if state is not None else (None, None)
    bx, bw = recipe.block("input"), recipe.block("weight")
    qx, sx, mx = _quantize(x2, "input", recipe, meta_x, axis_name)
    if bx is None:  # one scale per tensor: w quantised as it is, contracted on dim 0
        qw, sw, mw = _quantize(w, "weight", recipe, meta_w, axis_name)
        y = _gemm(qx, sx, qw, sw, None, None, (((1,), (0,)), ((), ())))
    else:           # row / tile scales along the contraction dim: w.T (N, K)
        qw, sw, mw = _quantize(w.T, "weight", recipe, None, axis_name)
        y = _gemm(qx, sx, qw, sw, bx, bw)
    y = y.astype(out_dtype).reshape(*x.shape[:-1], w.shape[1])
    return y, (qx, sx, qw, sw, mx, mw)


def _dot(x, w, state, recipe, axis_name, out_dtype, grad_dtypes):
    del grad_dtypes
    return _fwd_impl(x, w, state, recipe, axis_name, out_dtype)[0]


def _dot_fwd(x, w, state, recipe, axis_name, out_dtype, grad_dtypes):
    del grad_dtypes
    y, (qx, sx, qw, sw, mx, mw) = _fwd_impl(x, w, state, recipe, axis_name, out_dtype)
    if recipe.block("input") is None:
        # Per tensor: the backward GEMMs reuse the forward's fp8 operands as they are
        # (the same bits as re-quantising x and w), so the residuals are fp8.
        saved = (qx, sx, qw, sw)
    else:
        saved = (x, w)
    return y, (saved, state, (mx, mw))


def _dot_bwd(recipe, axis_name, out_dtype, grad_dtypes, res, g):
    """The input and weight gradients (in ``grad_dtypes``, those of x and w)."""
    del out_dtype
    saved, state, (mx, mw) = res
    n = g.shape[-1]
    g2 = g.reshape(-1, n)
    if recipe.block("input") is None:
        qx, sx, qw, sw = saved
        meta = state.grad_output if recipe.delayed else None
        qg, sg, mg = _quantize(g2, "grad_output", recipe, meta, axis_name)
        dx = _gemm(qg, sg, qw, sw, None, None)                                 # (M, N) . (K, N)^T
        dw = _gemm(qx, sx, qg, sg, None, None, (((0,), (0,)), ((), ())))      # (M, K)^T . (M, N)
        new_state = Fp8DotState(mx, mw, mg) if recipe.delayed and mg is not None else None
        x_shape = (*g.shape[:-1], qx.shape[1])
    else:
        # Each operand quantised with its contraction dim last, as its GEMM needs it.
        x, w = saved
        x2 = x.reshape(-1, x.shape[-1])
        bg, bw, bx = (recipe.block(r) for r in ("grad_output", "weight", "input"))
        qg, sg, _ = _quantize(g2, "grad_output", recipe, None, axis_name)
        qw, sw, _ = _quantize(w, "weight", recipe, None, axis_name)
        dx = _gemm(qg, sg, qw, sw, bg, bw)
        qxt, sxt, _ = _quantize(x2.T, "input", recipe, None, axis_name)
        qgt, sgt, _ = _quantize(g2.T, "grad_output", recipe, None, axis_name)
        dw = _gemm(qxt, sxt, qgt, sgt, bx, bg)
        new_state = None
        x_shape = x.shape
    return dx.astype(grad_dtypes[0]).reshape(x_shape), dw.astype(grad_dtypes[1]), new_state


_dot = jax.custom_vjp(_dot, nondiff_argnums=(3, 4, 5, 6))
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
      >>> y = mpfunc.fp8_dot(x, w)   # 1s and 0.5s are exact in fp8; the output scaling
      >>> y.shape, bool(jnp.allclose(y, x @ w, rtol=1e-6))   # rounds once in float32
      ((4, 3), True)
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
    if (recipe.delayed and isinstance(state, Fp8DotState)
            and state.input.amax_history.shape != (recipe.amax_history_len,)):
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
    return _dot(x, w, state, recipe, axis_name, out_dtype, (np.dtype(x.dtype), np.dtype(w.dtype)))


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
    return jax.lax.pcast(x, axes, to="varying")
