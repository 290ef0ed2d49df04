"""fp8 quantisation and the fp8 dot for JAX (the rule in `_mpfunc_common.fp8`).

`quantize_fp8` / `dequantize_fp8` follow ``_mpfunc_common.fp8.QUANTIZE_RULE`` exactly, so they
give the same bits as ``mpfunc_torch``'s. `fp8_dot` is a dense layer's matmul with
inputs and weights in the recipe's forward format and output gradients in its backward
format (a ``custom_vjp``). On CPU the matmul is emulated: dequantise, then multiply in
float32. On a GPU with fp8 support XLA rewrites that same dequantise -> dot pattern
(per-tensor scales) into an fp8 cuBLASLt GEMM; no other code path exists.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from _mpfunc_common.fp8 import (
    FLOAT32_MIN_NORMAL,
    FP8_MAX,
    QUANTIZE_RULE,
    Fp8Recipe,
    resolve_recipe,
    scale_shape,
)
from mpfunc._src.loss_scale import _varying_axes

__all__ = ["Fp8Meta", "Fp8DotState", "quantize_fp8", "dequantize_fp8", "fp8_dot", "fp8_dot_state"]

_DTYPES = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}
_F32 = jnp.float32
# Scales stay in [2**-126, 2**126], so they and their reciprocals are normal floats.
_MIN_SCALE, _MAX_SCALE = 2.0**-126, 2.0**126
AxisName = Hashable | Sequence[Hashable] | None


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
    meta = Fp8Meta(jnp.zeros((recipe.amax_history_len,), _F32), jnp.ones((), _F32))
    return Fp8DotState(meta, meta, meta)


# ------------------------------------------------------------------------- the rule
def _fp8_dtype(dtype: Any):
    if isinstance(dtype, str):
        name = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}.get(dtype, dtype)
    else:
        try:
            name = jnp.dtype(dtype).name
        except TypeError:
            name = None
    if name not in _DTYPES:
        raise ValueError(f"`dtype` must be float8_e4m3fn or float8_e5m2, got {dtype!r}.")
    return name


def _pmax(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """MAX over ``axis_name``, over the axes ``x`` varies on (all of them without vma)."""
    if axis_name is None:
        return x
    axes = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    varying = _varying_axes(x)
    if varying:
        axes = tuple(a for a in axes if a in varying)
        return jax.lax.pmax(x, axes) if axes else x
    try:
        return jax.lax.pmax(x, axes)
    except ValueError:  # typed invariant over every axis: the same on all shards already
        return x


def _tiled(x2d: jax.Array, block) -> tuple[jax.Array, tuple[int, int, int, int]]:
    """(R, C) -> (nR, br, nC, bc), zero-padded; zeros never change an amax."""
    r, c = x2d.shape
    br = r if block[0] is None else block[0]
    bc = c if block[1] is None else block[1]
    nr, nc = -(-r // br), -(-c // bc)
    if (nr * br, nc * bc) != (r, c):
        x2d = jnp.pad(x2d, ((0, nr * br - r), (0, nc * bc - c)))
    return x2d.reshape(nr, br, nc, bc), (r, c, br, bc)


def _untiled(t: jax.Array, info) -> jax.Array:
    r, c, _, _ = info
    nr, br, nc, bc = t.shape
    return t.reshape(nr * br, nc * bc)[:r, :c]


def _as_2d(x: jax.Array) -> jax.Array:
    return x.reshape(1, -1) if x.ndim < 2 else x.reshape(-1, x.shape[-1])


def _amax(x: jax.Array, block) -> jax.Array:
    """max |x| per block (float32), a NaN counting as +inf.

    NaN is mapped to inf first because XLA's CPU reduction (the YNNPACK fusion) does not
    propagate NaN through ``max``.
    """
    a = jnp.abs(_flush(x.astype(_F32)))
    a = jnp.where(jnp.isnan(a), jnp.asarray(jnp.inf, _F32), a)
    if block is None:
        return jnp.max(a)
    t, _ = _tiled(_as_2d(a), block)
    return jnp.max(t, axis=(1, 3))


def _scale(amax: jax.Array, fp8_max: float, margin: int, power_of_2: bool, fallback):
    s = jnp.asarray(fp8_max, _F32) / amax
    if margin:
        s = s / jnp.asarray(2.0**margin, _F32)
    s = jnp.clip(s, jnp.asarray(_MIN_SCALE, _F32), jnp.asarray(_MAX_SCALE, _F32))
    if power_of_2:  # clear the mantissa: 2**floor(log2(s)), exactly (s is normal)
        bits = jax.lax.bitcast_convert_type(s, jnp.uint32) & jnp.uint32(0xFF800000)
        s = jax.lax.bitcast_convert_type(bits, _F32)
    ok = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(ok, s, jnp.asarray(fallback, _F32))


def _cast(y: jax.Array, name: str) -> jax.Array:
    m = jnp.asarray(FP8_MAX[name], _F32)
    nan = jnp.asarray(jnp.nan, _F32)  # any NaN -> the positive quiet NaN
    y = jnp.where(jnp.isfinite(y), jnp.clip(y, -m, m), jnp.where(jnp.isnan(y), nan, y))
    return y.astype(_DTYPES[name])


def _flush(x: jax.Array) -> jax.Array:
    """float32 subnormals -> 0, explicitly (XLA on CPU flushes them, on GPU it may not)."""
    return jnp.where(jnp.abs(x) < jnp.asarray(FLOAT32_MIN_NORMAL, _F32), jnp.zeros((), _F32), x)


def _quantize_with(x: jax.Array, scale: jax.Array, block, name: str) -> jax.Array:
    x = _flush(x.astype(_F32))
    if block is None:
        return _cast(x * scale, name)
    t, info = _tiled(_as_2d(x), block)
    q = _cast(t * scale[:, None, :, None], name)
    return _untiled(q, info).reshape(x.shape)


def quantize_fp8(
    x: jax.Array,
    dtype: Any = "float8_e4m3fn",
    block: tuple[int | None, int | None] | None = None,
    *,
    margin: int = 0,
    power_of_2_scales: bool = False,
    axis_name: AxisName = None,
    scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Quantises ``x`` to fp8 with current scaling; bit-identical to ``mpfunc_torch``.

    The rule (shared with torch, word for word):

    {rule}

    Args:
      x: a floating array; with a ``block`` its leading dims are flattened (the last dim
        is the contraction dim).
      dtype: ``"float8_e4m3fn"`` (``"e4m3"``) or ``"float8_e5m2"`` (``"e5m2"``), or the
        jnp dtype.
      block: None (one scale for the whole tensor) or ``(rows, cols)`` tiles, None
        meaning the whole dimension (``(1, None)``: one scale per row).
      margin: scales are divided by ``2**margin``.
      power_of_2_scales: round scales down to powers of two.
      axis_name: mesh axes to MAX-reduce the amax over (per-tensor scales only).
      scale: use these float32 scales (e.g. delayed scaling's) instead of computing
        them; values beyond the range then saturate.

    Returns:
      ``(q, scale)``: the fp8 array (shape of ``x``) and the float32 scales, shape ``()``
      or ``(row tiles, col tiles)``; ``x ~= q * (1 / scale)``.

    Examples:
      >>> import jax.numpy as jnp, mpfunc
      >>> q, s = mpfunc.quantize_fp8(jnp.array([1.0, -2.0, 4.0]), "e4m3")
      >>> q.dtype, float(s), mpfunc.dequantize_fp8(q, s).tolist()
      (dtype(float8_e4m3fn), 112.0, [1.0, -2.0, 4.0])
    """
    name = _fp8_dtype(dtype)
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"`x` must be a floating array, got {jnp.result_type(x)}.")
    if block is not None and axis_name is not None:
        raise ValueError("`axis_name` applies to per-tensor scales only (`block=None`); "
                         "row and tile scales are local to the rows they scale.")
    if scale is None:
        amax = _pmax(_amax(x, block), axis_name)
        scale = _scale(amax, FP8_MAX[name], margin, power_of_2_scales, 1.0)
    else:
        scale = jnp.asarray(scale, _F32)
        want = scale_shape(x.shape, block)
        if scale.shape != want:
            raise ValueError(f"`scale` must have shape {want} for this block, got {scale.shape}.")
    return _quantize_with(x, scale, block, name), scale


quantize_fp8.__doc__ = quantize_fp8.__doc__.replace("{rule}", QUANTIZE_RULE.strip())


def dequantize_fp8(q: jax.Array, scale: jax.Array, block=None, dtype: Any = _F32) -> jax.Array:
    """``float32(q) * (1 / scale)`` per block (the reciprocal rounded to float32), cast to
    ``dtype``; the inverse of `quantize_fp8` up to fp8 rounding."""
    inv = jnp.asarray(1, _F32) / scale
    v = q.astype(_F32)
    if block is None:
        out = v * inv
    else:
        t, info = _tiled(_as_2d(v), block)
        out = _untiled(t * inv[:, None, :, None], info).reshape(q.shape)
    return _flush(out).astype(dtype)


# ------------------------------------------------------------------ delayed scaling
def _delayed(x, meta: Fp8Meta, name: str, recipe: Fp8Recipe, axis_name):
    """This step's scale from the history, and the updated `Fp8Meta` (see the rule)."""
    amax = _pmax(_amax(x, None), axis_name)
    hist = meta.amax_history
    used = jnp.max(hist) if recipe.amax_reduction == "max" else hist[0]
    used = jnp.where(jnp.isfinite(used) & (used > 0), used, amax)  # no history yet
    scale = _scale(used, FP8_MAX[name], recipe.margin, recipe.power_of_2_scales, meta.scale)
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
        amax = _amax(x2d, block)
        if block is None:
            amax = _pmax(amax, axis_name)
        scale, new_meta = _scale(amax, FP8_MAX[name], recipe.margin,
                                 recipe.power_of_2_scales, 1.0), None
    q = _quantize_with(x2d, scale, recipe.block(role), name)
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
        xq = dequantize_fp8(_quantize_with(x2, mx.scale, None, recipe.dtype("input")), mx.scale)
        wq = dequantize_fp8(_quantize_with(w, mw.scale, None, recipe.dtype("weight")), mw.scale)
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
    out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
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
