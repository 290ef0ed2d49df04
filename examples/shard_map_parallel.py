"""Data and tensor parallelism with shard_map on 8 forced CPU devices, with an overflow
injected into one shard: every shard skips that step together.

A two-layer MLP is split Megatron-style over a ("data", "model") = (4, 2) mesh: the first
layer by columns, the second by rows, the batch over "data". The finite check is
psum-med over both axes (``axis_name=("data", "model")``), so an inf in the gradient
shard of one model column makes all eight devices skip; the optax.apply_if_finite
comparison shows shards disagreeing.

    python examples/shard_map_parallel.py [--quick]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpfunc  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    steps = 6 if args.quick else args.steps
    if len(jax.devices()) < 8:
        raise SystemExit("needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8")

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(16, 32)).astype(np.float32) / 4,
              "w2": rng.normal(size=(32, 1)).astype(np.float32) / 6}
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    policy = mpfunc.get_policy("mixed_bf16")
    opt = mpfunc.dynamic_scale(optax.adam(1e-2), init_scale=2.0**10, growth_interval=4,
                               axis_name=("data", "model"))
    state = jax.jit(opt.init)(params)
    state_specs = jax.tree.map(lambda x: specs["w1"] if x.shape == (16, 32) else
                               specs["w2"] if x.shape == (32, 1) else P(), state)

    def step(params, state, x, y, poison):
        def loss_fn(p):
            c = policy.cast_to_compute(p)
            h = jax.nn.relu(policy.cast_to_compute(x) @ c["w1"])   # column-parallel
            out = jax.lax.psum(h @ c["w2"], "model")                # row-parallel
            loss = jnp.mean((policy.cast_to_output(out) - y) ** 2)
            return mpfunc.scale_loss(jax.lax.pmean(loss, "data"), state)

        grads = jax.grad(loss_fn)(params)  # replicated over "data" (the loss is pmean-ed)
        # Inject an inf into the w1 gradient shard of one model column when asked: that
        # shard lives only on that column's devices, so the others see finite gradients.
        col = jax.lax.axis_index("model")
        grads["w1"] = jnp.where(poison == col, grads["w1"].at[0, 0].set(jnp.inf), grads["w1"])
        updates, state = opt.update(grads, state, params)
        decision = jnp.broadcast_to(state.last_finite, (1, 1))
        return optax.apply_updates(params, updates), state, decision

    sharded = jax.jit(jax.shard_map(
        step, mesh=mesh,
        in_specs=(specs, state_specs, P("data", None), P("data", None), P()),
        out_specs=(specs, state_specs, P("data", "model")),
    ))
    x = rng.normal(size=(32, 16)).astype(np.float32)
    y = (x[:, :1] * 2 - x[:, 1:2]).astype(np.float32)
    poison_at = 2
    print(f"mesh {dict(mesh.shape)}; at step {poison_at} an inf goes into the w1 gradient "
          "shard of model column 1 (4 of the 8 devices hold it)")
    for i in range(steps):
        poison = jnp.int32(1 if i == poison_at else -1)
        before = jax.device_get(params)
        params, state, decision = sharded(params, state, x, y, poison)
        d = np.asarray(decision)
        changed = not all(np.array_equal(before[k], np.asarray(params[k])) for k in params)
        print(f"step {i}: shards that stepped {int(d.sum())}/8, params changed: {changed}, "
              f"loss scale {float(state.loss_scale):g}, skipped {int(state.skipped_steps)}")
        if i == poison_at:
            assert not d.any() and not changed, "every shard must skip together"

    # The prior art for comparison: optax.apply_if_finite decides per shard.
    naive = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3)

    def per_shard(g):
        s = naive.init(g)
        _, s = naive.update(g, s, g)
        return jnp.broadcast_to(s.last_finite, (1, 1))

    g = jnp.ones((8, 4)).at[5, 0].set(jnp.inf)
    d = np.asarray(jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data", "model"),
                                         out_specs=P("data", "model")))(g))
    print(f"optax.apply_if_finite with the same kind of overflow: {int(d.sum())}/8 shards "
          "would step -> replicas diverge; mpfunc psums the check so all agree")


if __name__ == "__main__":
    main()
