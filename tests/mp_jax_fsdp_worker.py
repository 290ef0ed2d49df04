"""One process of the two-process FSDP test (run by tests/test_sharding.py).

Usage: python mp_jax_fsdp_worker.py PROCESS_ID PORT, with 2 CPU devices per process
(XLA_FLAGS=--xla_force_host_platform_device_count=2): 4 global devices in one "data"
mesh axis. Every parameter, its float32 master and its Adam moments are split over the
4 devices (FSDP/ZeRO under plain jit, naive mode), so each process holds half. At step
POISON_AT an inf goes into the w1 gradient rows owned by a device of process 1 only; the
finite check has no axis_name, and both processes must skip. Prints one JSON line.

Importable without side effects: the test reuses `build`, `initial_params` and
`batches` for its one-process reference run.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

D, H, OUT, B = 16, 32, 8, 16
W1_SHAPE = (D, H)
STEPS, POISON_AT = 4, 1
POISON_ROW = 13  # rows 12..15 live on global device 3, a device of process 1


def initial_params():
    rng = np.random.default_rng(0)
    return {"w1": (rng.normal(size=(D, H)) / np.sqrt(D)).astype(np.float32),
            "b1": np.zeros(H, np.float32),
            "w2": (rng.normal(size=(H, OUT)) / np.sqrt(H)).astype(np.float32)}


def batches():
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        x = rng.normal(size=(B, D)).astype(np.float32)
        yield x, np.tanh(x[:, :OUT] - x[:, OUT:2 * OUT]).astype(np.float32)


def apply(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def build():
    """The naive-mode setup and the (unjitted) train step, shared with the test."""
    from lenient import adam

    import mpfunc

    amp = mpfunc.convert_to_amp(apply, adam(1e-2), mode="naive", initial_scale=2.0**16)

    def step(params, state, x, y, poison):
        def loss_fn(p):
            loss = jnp.mean(jnp.square(amp.apply_fn(p, x) - y))
            return mpfunc.scale_loss(loss, state), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        grads = {**grads, "w1": grads["w1"] + poison.astype(grads["w1"].dtype)}
        updates, state = amp.optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return amp, step


def main(process_id, port):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import mpfunc

    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))

    def global_array(host):  # every process knows the full value; each supplies its half
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def local(x):
        return [np.asarray(s.data) for s in x.addressable_shards]

    amp, step = build()
    params = jax.jit(amp.cast_params)(jax.tree.map(global_array, initial_params()))
    shardings = mpfunc.state_sharding(amp.optimizer, params)
    state = jax.jit(amp.optimizer.init, out_shardings=shardings)(params)
    step = jax.jit(step, donate_argnums=(0, 1))
    masters = jax.tree.leaves(state.inner_state.master_params)
    report = {
        "process": process_id, "global_devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "local_master_bytes": int(sum(s.data.nbytes for m in masters for s in m.addressable_shards)),
        "total_master_bytes": int(sum(m.nbytes for m in masters)),
        "finite": [], "scales": [], "skipped_changed_nothing": None, "poison_owner": None,
    }
    for i, (x, y) in enumerate(batches()):
        poison = np.zeros(W1_SHAPE, np.float32)
        if i == POISON_AT:
            poison[POISON_ROW, 0] = np.inf
        poison = global_array(poison)
        if i == POISON_AT:
            report["poison_owner"] = any(bool(np.isinf(s).any()) for s in local(poison))
            before = jax.tree.map(local, (params, state.inner_state))
        params, state, _ = step(params, state, global_array(x), global_array(y), poison)
        report["finite"].append(all(bool(v) for v in local(state.last_finite)))
        report["scales"].append(float(local(state.loss_scale)[0]))
        if i == POISON_AT:
            after = jax.tree.map(local, (params, state.inner_state))
            report["skipped_changed_nothing"] = all(
                np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
    full = multihost_utils.process_allgather(params, tiled=True)
    report["params"] = {k: np.asarray(v, np.float32).tolist() for k, v in full.items()}
    print("RESULT " + json.dumps(report), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
