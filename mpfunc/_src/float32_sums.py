"""Gradients that sum in float32 for a half-precision model (naive, apex O2/O3).

Differentiating a half broadcast gives a half ``reduce_sum``, a half gather a half
scatter-add. `summing_in_float32` keeps the forward and pulls the cotangent back in
float32, as torch's half kernels accumulate a bias's, a norm scale's and an embedding's
gradient. Used by the half-model rules in `autocast`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["BROADCASTING_OPS", "broadcast", "summing_in_float32"]

# Elementwise ops whose operands may be broadcast (size-1 or missing leading dimensions).
BROADCASTING_OPS = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "atan2",
                              "rem", "nextafter", "select_n", "clamp"})


def broadcast(x, shape, broadcast_dimensions):
    """``lax.broadcast_in_dim`` of a half ``x`` whose gradient sums in float32 (or ``x``
    itself when there is nothing to broadcast)."""
    shape, dims = tuple(shape), tuple(broadcast_dimensions)
    if tuple(x.shape) == shape:
        return x
    return summing_in_float32(lambda y: jax.lax.broadcast_in_dim(y, shape, dims), x)


def summing_in_float32(linear, x, *rest):
    """``linear(x, *rest)``, linear in a half ``x``, with a backward that pulls the
    cotangent back in float32 and rounds it to ``x``'s dtype once.

    For a broadcast that pullback is a sum over the broadcast dimensions (a bias's or a
    norm scale's gradient, over a batch and a sequence), for a gather a scatter-add (an
    embedding's, where a frequent token sums thousands of rows): torch's half kernels
    accumulate both in float32, plain JAX in the half dtype. ``rest`` (gather indices)
    gets no gradient.
    """

    @jax.custom_vjp
    def op(x, *rest):
        return linear(x, *rest)

    def fwd(x, *rest):
        return op(x, *rest), (x, rest)

    def bwd(res, ct):
        x, rest = res
        # Only x's type is read (under shard_map the axes it varies over too): the
        # float32 copy is dead code that XLA drops.
        _, pullback = jax.vjp(lambda y: linear(y, *rest), x.astype(jnp.float32))
        (g,) = pullback(ct.astype(jnp.float32))
        return (g.astype(x.dtype), *(None for _ in rest))

    op.defvjp(fwd, bwd)
    return op(x, *rest)
