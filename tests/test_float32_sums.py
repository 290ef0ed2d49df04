"""mpfunc/_src/float32_sums.py: a half broadcast's or gather's gradient sums in float32
(used by the half-model modes; their end-to-end tests are in test_modes and
test_flax_norms)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxpr_walk import all_eqns

from mpfunc._src.float32_sums import broadcast, summing_in_float32

F16 = jnp.float16


def accumulations(fn, *args):
    return [(e.primitive.name, str(e.invars[0].aval.dtype)) for e in all_eqns(fn, *args)
            if e.primitive.name in ("reduce_sum", "scatter-add")]


def test_a_broadcast_sums_its_gradient_in_float32_and_rounds_once():
    # 4096 cotangents of 1 + 2**-11 (exact in float16): a float16 running sum stalls at
    # 2048 (its spacing there is 2), a float32 one reaches 4096.5, rounded once to 4096.
    b = jnp.ones(3, F16)
    ct = jnp.full((4096, 3), 1 + 2.0**-11, F16)

    def f(b):
        return (broadcast(b, (4096, 3), (1,)) * ct).astype(jnp.float32).sum()

    g = jax.jit(jax.grad(f))(b)
    assert g.dtype == F16
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.float32(np.float16(4096.5)))
    assert accumulations(jax.grad(f), b) == [("reduce_sum", "float32")] * 2  # f's sum too
    plain = jax.grad(lambda b: (jax.lax.broadcast_in_dim(b, (4096, 3), (1,)) * ct)
                     .astype(jnp.float32).sum())
    assert ("reduce_sum", "float16") in accumulations(plain, b)  # what plain JAX does
    # the forward is the broadcast itself, and nothing to broadcast returns x
    np.testing.assert_array_equal(broadcast(b, (2, 3), (1,)), jnp.ones((2, 3), F16))
    assert broadcast(b, (3,), (0,)) is b


def test_a_gather_scatter_adds_its_gradient_in_float32():
    table = jnp.arange(12, dtype=F16).reshape(4, 3)
    idx = jnp.zeros((4096, 1), jnp.int32)  # one row, looked up 4096 times
    dnums = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                           start_index_map=(0,))
    take = functools.partial(jax.lax.gather, dimension_numbers=dnums, slice_sizes=(1, 3))

    def f(t):
        rows = summing_in_float32(lambda y, i: take(y, i), t, idx)
        return (rows * jnp.asarray(1 + 2.0**-11, F16)).astype(jnp.float32).sum()

    g = jax.jit(jax.grad(f))(table)
    np.testing.assert_array_equal(np.asarray(g[0], np.float32), np.float16(4096.5))
    np.testing.assert_array_equal(np.asarray(g[1:]), 0)
    assert ("scatter-add", "float32") in accumulations(jax.grad(f), table)
    np.testing.assert_array_equal(take(table, idx[:2]), summing_in_float32(take, table, idx[:2]))


def test_under_shard_map_the_gradient_keeps_its_varying_axes():
    # The failure this guards against: a pullback typed without the axes its input
    # varies over raised "cotangent type does not match function output" under
    # shard_map (each device's b here is its own block: varying over "data").
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    shard = NamedSharding(mesh, P("data"))

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data")),
                       out_specs=P("data"))
    def grad(b, x):
        def loss(b):
            y = broadcast(b, x.shape, (1,)) * x
            return jax.lax.psum(y.astype(jnp.float32).sum(), "data")
        return jax.grad(loss)(b)

    d = jax.device_count()
    b = jax.device_put(jnp.ones(3 * d, F16), shard)
    x = jax.device_put(jnp.ones((8 * d, 3), F16), shard)
    g = jax.jit(grad)(b, x)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.full(3 * d, 8, np.float32))
