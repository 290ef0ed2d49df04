"""Optimizer state stored in bfloat16 or 8-bit blocks and computed in float32 (optax)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _mpfunc_common.storage import (
    BLOCK_STATE_DTYPES,
    check_seed,
    check_state_dtype,
    check_state_rounding,
)
from mpfunc._src.eager_jit import jit_when_eager
from mpfunc._src.rounding import (
    bf16_from_pattern,
    dequantize_state_8bit,
    quantize_state_8bit,
    random_bits,
    rne_bf16_pattern,
    sr_bf16_pattern,
)
from mpfunc._src.scale_rule import as_transformation

__all__ = ["StateDtypeState", "decode_state", "encode_state", "state_dtype"]

_F32 = jnp.float32


class StateDtypeState(NamedTuple):
    """State of `state_dtype`.

    Attributes:
      inner_state: the wrapped transformation's state, each floating leaf of at least one
        dimension stored in the chosen dtype (fp8 codes, in the leaf's shape, for the
        8-bit formats); other leaves (counts, scalar hyperparameters) as it keeps them.
      scales: for the 8-bit formats, ``inner_state``'s tree with each stored leaf's
        float32 block scales (one per 128 elements of the flattened leaf) and None
        elsewhere; None for the other dtypes.
      seed: uint32, the seed of the stochastic rounding's random bits.
      step: uint32, the applied (not skipped) steps, wrapping modulo 2**32.
    """

    inner_state: Any
    scales: Any
    seed: jax.Array
    step: jax.Array


def _is_float(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _stored(x: Any) -> bool:
    return _is_float(x) and np.ndim(x) >= 1


def _to_f32(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x.astype(_F32) if _is_float(x) else x, tree)


def encode_state(tree: Any, name: str, seed: jax.Array, step: jax.Array,
                 stochastic: bool) -> tuple[Any, Any]:
    """A float32 optimizer state -> (``tree`` stored in state dtype ``name``, the block
    scales' tree or None), as `state_dtype` stores it: each floating leaf of at least one
    dimension rounded to nearest, or stochastically with the bits of (``seed``, stream
    ``1 + k`` for the ``k``-th stored leaf, ``step``). The stored leaves go through one
    jitted function (eagerly: one compile for the whole state, not one per op and leaf)."""
    block = name in BLOCK_STATE_DTYPES
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    at = [i for i, x in enumerate(leaves) if _stored(x)]
    coded, coded_scales = _encode_leaves(tuple(jnp.asarray(leaves[i]) for i in at), name,
                                         jnp.asarray(seed), jnp.asarray(step), stochastic)
    out, scales = list(leaves), [None] * len(leaves)
    for i, x, sc in zip(at, coded, coded_scales):
        out[i], scales[i] = x, sc
    return treedef.unflatten(out), treedef.unflatten(scales) if block else None


@functools.partial(jit_when_eager, static_argnums=(1, 4))
def _encode_leaves(xs: tuple, name: str, seed: jax.Array, step: jax.Array,
                   stochastic: bool) -> tuple[tuple, tuple]:
    out, scales = [], []
    for k, x in enumerate(xs):
        x = x.astype(_F32)
        rand = random_bits(seed, 1 + k, step, x.shape) if stochastic else None
        scale = None
        if name in BLOCK_STATE_DTYPES:
            x, scale = quantize_state_8bit(x, name, rand)
        elif name == "bfloat16":
            x = bf16_from_pattern(rne_bf16_pattern(x) if rand is None
                                  else sr_bf16_pattern(x, rand))
        out.append(x)
        scales.append(scale)
    return tuple(out), tuple(scales)


def decode_state(tree: Any, scales: Any) -> Any:
    """A stored state (`encode_state`'s pair) -> float32, exactly for 16-bit state,
    dequantised for 8-bit codes (``scales`` not None); the stored leaves through one
    jitted function, as `encode_state`'s."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    per_leaf = ([None] * len(leaves) if scales is None else treedef.flatten_up_to(scales))
    at = [i for i, x in enumerate(leaves) if _stored(x)]
    wide = _decode_leaves(tuple(jnp.asarray(leaves[i]) for i in at),
                          tuple(per_leaf[i] for i in at))
    out = list(leaves)
    for i, x in zip(at, wide):
        out[i] = x
    return treedef.unflatten(out)


@jit_when_eager
def _decode_leaves(xs: tuple, scales: tuple) -> tuple:
    return tuple(x.astype(_F32) if s is None else dequantize_state_8bit(x, s)
                 for x, s in zip(xs, scales))


def state_dtype(
    inner: optax.GradientTransformation,
    dtype: Any,
    rounding: str = "stochastic",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s floating state in ``dtype`` and runs each step in float32.

    Every floating leaf of ``inner``'s state that has at least one dimension (Adam's and
    Lion's moments, momentum, ``optax.MultiSteps``' accumulated gradients) is kept in
    ``dtype``; counts and scalar leaves stay as they are. Each ``update`` reads the state
    to float32, runs ``inner.update`` with float32 gradients and params, and stores the
    new state back, rounded. Updates come back in the params' dtype (the gradients' when
    no params are given), so ``state_dtype(optax.adam(lr), "bfloat16")`` on bfloat16
    params is Adam with bfloat16 moments and plain bfloat16 params; wrap it in
    `mpfunc.master_weights` to keep the params' exact values too.

    * ``"bfloat16"``: 2 bytes per element, float32's range.
    * ``"float8_e4m3fn"`` / ``"float8_e5m2"``: 1 byte per element plus one float32 scale
      per block of 128 elements of the flattened leaf (the blockwise fp8 rule of
      `mpfunc.quantize_fp8`, `_mpfunc_common.rounding.quantize_state_8bit`). Within a
      block, e4m3fn holds values down to about 2**-18 of the block's largest (smaller
      ones round to 0; a zero second moment makes Adam's step ``mu / eps``); e5m2 down to
      2**-31, with one mantissa bit less.
    * ``"float32"``: unchanged (for switching by config).
    * ``"float16"`` is refused: Adam's second moment leaves its range.

    ``rounding="stochastic"`` (default) rounds with the shared counter-based random bits
    (stream ``1 + k`` for the ``k``-th stored leaf, this state's seed and step), so the
    stored state is unbiased. Rounded to nearest, Adam's bfloat16 second moment freezes:
    ``b2 * nu`` moves ``nu`` by 1e-3 of itself, below half of bfloat16's spacing, and
    rounds back. ``init`` rounds to nearest.

    Args:
      inner: any optax transformation (or ``optax.MultiSteps``).
      dtype: ``"bfloat16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``, ``"float32"``, an
        alias (``"bf16"``, ``"e4m3"``, ``"e5m2"``) or a jnp dtype.
      rounding: ``"stochastic"`` or ``"nearest"``.
      seed: an int in [0, 2**32 - 1]; nonzero only where something is rounded
        stochastically (else it would have no effect, an error).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a `StateDtypeState`.

    Raises:
      ValueError: an unknown or refused ``dtype`` or ``rounding`` (with the closest
        name), a seed out of range or without effect.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> opt = mpfunc.state_dtype(optax.adam(1e-3), "bfloat16")
      >>> state = opt.init({"w": jnp.ones(4)})
      >>> state.inner_state[0].mu["w"].dtype, state.inner_state[0].count.dtype
      (dtype(bfloat16), dtype('int32'))
      >>> opt = mpfunc.state_dtype(optax.adam(1e-3), "float8_e4m3fn")
      >>> state = opt.init({"w": jnp.ones((2, 200))})
      >>> state.inner_state[0].nu["w"].dtype, state.scales[0].nu["w"].shape
      (dtype(float8_e4m3fn), (4,))
    """
    name = check_state_dtype(dtype, "dtype", allow_none=False)
    rounding = check_state_rounding(rounding, "rounding")
    seed = check_seed(seed)
    if seed and (name == "float32" or rounding == "nearest"):
        raise ValueError(f"`seed={seed}` has no effect: state_dtype({name!r}, "
                         f"rounding={rounding!r}) rounds nothing stochastically.")
    inner = as_transformation(inner)

    def init_fn(params):
        seed_arr, step = jnp.asarray(seed, jnp.uint32), jnp.zeros((), jnp.uint32)
        # A barrier: under jit XLA would constant-fold the encoding of the (constant)
        # initial state, slowly (seconds for an 8-bit leaf of 4M elements).
        first = jax.lax.optimization_barrier(inner.init(_to_f32(params)))
        stored, scales = encode_state(first, name, seed_arr, step, False)
        return StateDtypeState(stored, scales, seed_arr, step)

    def update_fn(updates, state, params=None, **extra_args):
        inner_updates, new = inner.update(
            _to_f32(updates), decode_state(state.inner_state, state.scales),
            None if params is None else _to_f32(params), **extra_args)
        stored, scales = encode_state(new, name, state.seed, state.step,
                                      rounding == "stochastic")
        like = updates if params is None else params
        out = jax.tree_util.tree_map(
            lambda u, x: u.astype(x.dtype) if _is_float(u) and _is_float(x) else u,
            inner_updates, like)
        return out, StateDtypeState(stored, scales, state.seed, state.step + jnp.uint32(1))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
