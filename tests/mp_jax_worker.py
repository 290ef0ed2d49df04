"""One process of the two-process JAX test (run by tests/test_loss_scale.py).

Usage: python mp_jax_worker.py PROCESS_ID PORT. Each process owns one shard of the
parameters (tensor-parallel style), so an overflow on one process is invisible to the
other unless the finite check is reduced across processes. Prints one JSON line.
"""

import json
import sys

import jax

process_id, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
    initialization_timeout=60,
)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpfunc  # noqa: E402

mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,))
opt = mpfunc.dynamic_scale(optax.adam(1e-2), growth_interval=2, axis_name="model")


def global_array(local):
    return jax.make_array_from_single_device_arrays(
        (2, 4), NamedSharding(mesh, P("model")), [jax.device_put(local, jax.local_devices()[0])]
    )


def spec_of(x):
    return P("model") if x.ndim >= 2 else P()


params = {"w": global_array(np.ones((1, 4), np.float32))}
state = jax.jit(opt.init)(params)
param_specs = jax.tree.map(spec_of, params)
state_specs = jax.tree.map(spec_of, state)


def step(grads, params, state):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state


sharded_step = jax.jit(
    jax.shard_map(
        step, mesh=mesh, in_specs=(param_specs, param_specs, state_specs),
        out_specs=(param_specs, state_specs),
    )
)


def local(x):
    return np.asarray(x.addressable_data(0))


report = []
for i in range(4):
    g = np.full((1, 4), 0.5, np.float32) * float(2**16)
    if i == 1 and process_id == 1:
        g[0, 2] = np.inf  # an overflow on this process only
    before = local(params["w"]).copy()
    params, state = sharded_step({"w": global_array(g)}, params, state)
    report.append({
        "step": i,
        "finite": bool(local(state.last_finite)),
        "scale": float(local(state.loss_scale)),
        "skipped": int(local(state.skipped_steps)),
        "params_unchanged": bool(np.array_equal(before, local(params["w"]))),
    })
print("RESULT " + json.dumps({"process": process_id, "report": report}), flush=True)
jax.distributed.shutdown()
