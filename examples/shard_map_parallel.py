"""Data and tensor parallelism with shard_map on 8 forced CPU devices, with an overflow
injected into one shard: every shard skips that step together.

A two-layer MLP is split Megatron-style over a ("data", "model") = (4, 2) mesh: the first
layer by columns, the second by rows, the batch over "data". The finite check is
psum-med over both axes (``axis_name=("data", "model")``), so an inf in the gradient
shard of one model column makes all eight devices skip. optax.apply_if_finite, given the
same params, batch and overflow, lets the other column's four devices step.

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
    # Placed as the step returns it, so the second step does not compile again.
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs))

    def gradients(params, x, y, poison, scale_state=None):
        def loss_fn(p):
            c = policy.cast_to_compute(p)
            h = jax.nn.relu(policy.cast_to_compute(x) @ c["w1"])   # column-parallel
            out = jax.lax.psum(h @ c["w2"], "model")                # row-parallel
            loss = jax.lax.pmean(jnp.mean((policy.cast_to_output(out) - y) ** 2), "data")
            return loss if scale_state is None else mpfunc.scale_loss(loss, scale_state)

        grads = jax.grad(loss_fn)(params)  # replicated over "data" (the loss is pmean-ed)
        # Inject an inf into the w1 gradient shard of one model column when asked: that
        # shard lives only on that column's devices, so the others see finite gradients.
        col = jax.lax.axis_index("model")
        grads["w1"] = jnp.where(poison == col, grads["w1"].at[0, 0].set(jnp.inf), grads["w1"])
        return grads

    def step(params, state, x, y, poison):
        grads = gradients(params, x, y, poison, scale_state=state)
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
    poison_at, poisoned_column = 2, 1
    print(f"mesh {dict(mesh.shape)}; at step {poison_at} an inf goes into the w1 gradient "
          f"shard of model column {poisoned_column} (4 of the 8 devices hold it)")
    for i in range(steps):
        poison = jnp.int32(poisoned_column if i == poison_at else -1)
        before = jax.device_get(params)
        if i == poison_at:
            params_at_overflow = params
        params, state, decision = sharded(params, state, x, y, poison)
        d = np.asarray(decision)
        changed = not all(np.array_equal(before[k], np.asarray(params[k])) for k in params)
        print(f"step {i}: shards that stepped {int(d.sum())}/8, params changed: {changed}, "
              f"loss scale {float(state.loss_scale):g}, skipped {int(state.skipped_steps)}")
        if i == poison_at:
            assert not d.any() and not changed, "every shard must skip together"

    # The prior art, with the same params, batch and overflow (the same inf in the same w1
    # shard): optax.apply_if_finite checks only the gradients each device holds.
    baseline = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)

    def baseline_step(params, x, y):
        grads = gradients(params, x, y, jnp.int32(poisoned_column))
        _, s = baseline.update(grads, baseline.init(params), params)
        return jnp.broadcast_to(s.last_finite, (1, 1))

    d = np.asarray(jax.jit(jax.shard_map(
        baseline_step, mesh=mesh, in_specs=(specs, P("data", None), P("data", None)),
        out_specs=P("data", "model")))(params_at_overflow, x, y))
    stepped = [c for c in range(d.shape[1]) if d[:, c].all()]
    assert int(d.sum()) == 4 and stepped == [1 - poisoned_column], d
    print(f"optax.apply_if_finite, same step {poison_at} and same overflow: {int(d.sum())}/8 "
          f"shards would step (model column {stepped[0]} updates its half of the model, column "
          f"{poisoned_column} skips) -> the shards disagree; mpfunc psums the check so all 8 skip")


if __name__ == "__main__":
    main()
