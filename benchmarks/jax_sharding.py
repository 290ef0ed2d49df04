"""Bytes per device of float32 master weights (and the rest of the state) under FSDP.

naive mode (float16 params, float32 masters, Adam) on an MLP whose every leaf is split
along its first dimension over a "data" mesh axis of N devices, N = 1, 2, 4, 8, state
placed with ``mpfunc.state_sharding``. Counts the bytes of each device's shards (exact,
from the arrays) and reports XLA's own per-device figures for the compiled train step
(``compiled.memory_analysis()``: arguments and temporaries).

On CPU the N devices are XLA's forced host devices
(``--xla_force_host_platform_device_count=8``): 8 logical devices sharing one host's
memory and cores. Sharding, collectives and per-device buffers are real; speed is not.

Params, state and the batch are placed with their shardings first, and each N's step is
compiled once, ahead of time; that executable runs the step and gives
``memory_analysis()`` (each row's ``step_compiles`` counts its compiles: 1). Each row's
``compile`` has the step's cold and warm compile seconds (JAX's persistent compilation
cache, on by default: see ``benchmarks/_jax_compiles.py``).

    python benchmarks/jax_sharding.py [--device cpu|gpu] [--hidden 2048] [--json]
        [--compile-cache DIR | --no-compile-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse(argv):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _jax_compiles import add_cache_args  # jax-free: jax is not imported yet

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON line instead")
    add_cache_args(ap)
    return ap.parse_args(argv)


def measure(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from _jax_compiles import CompileCounter, cache_from_args, compile_cold_warm, named
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import mpfunc

    cache_dir = cache_from_args(args)
    counter = CompileCounter()
    h, layers = args.hidden, args.layers
    rng = np.random.default_rng(0)
    params0 = {f"l{i}": {"w": (rng.normal(size=(h, h)) / np.sqrt(h)).astype(np.float32),
                         "b": np.zeros(h, np.float32)} for i in range(layers)}
    n_params = sum(x.size for x in jax.tree.leaves(params0))

    def apply(p, x):
        for i in range(layers):
            x = jnp.tanh(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return x

    amp = mpfunc.convert_to_amp(apply, optax.adam(1e-3), mode="naive", initial_scale=2.0**12)

    def step(params, state, x):
        def loss_fn(p):
            loss = jnp.mean(jnp.square(amp.apply_fn(p, x)))
            return mpfunc.scale_loss(loss, state)

        g = jax.grad(loss_fn)(params)
        u, state = amp.optimizer.update(g, state, params)
        return optax.apply_updates(params, u), state

    rows = []
    sizes = [n for n in (1, 2, 4, 8) if n <= len(jax.devices())]
    for n in sizes:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:n])
        split_rows = NamedSharding(mesh, P("data"))
        params = jax.jit(amp.cast_params)(jax.device_put(params0, split_rows))
        state = jax.jit(amp.optimizer.init,
                        out_shardings=mpfunc.state_sharding(amp.optimizer, params))(params)
        x = jax.device_put(jnp.ones((64, h), jnp.float32), split_rows)
        name = f"bench_step_fsdp{n}"
        jitted = jax.jit(named(step, name), donate_argnums=(0, 1))
        compiled, compile_rec = compile_cold_warm(
            lambda jitted=jitted, params=params, state=state, x=x: jitted.lower(
                params, state, x), counter)
        params, state = compiled(params, state, x)  # one real step; shardings as compiled
        dev0 = mesh.devices.flat[0]

        def on_dev0(tree, dev0=dev0):
            return int(sum(s.data.nbytes for a in jax.tree.leaves(tree)
                           for s in a.addressable_shards if s.device == dev0))

        mem = compiled.memory_analysis()
        rows.append({
            "devices": n,
            "master_bytes_per_device": on_dev0(state.inner_state.master_params),
            "param_bytes_per_device": on_dev0(params),
            "opt_state_bytes_per_device": on_dev0(state),
            "step_argument_bytes_per_device": None if mem is None else int(mem.argument_size_in_bytes),
            "step_temp_bytes_per_device": None if mem is None else int(mem.temp_size_in_bytes),
            "step_compiles": counter.of(name),
            "compile": compile_rec,
        })
    d = jax.devices()[0]
    return {"device": f"{d.platform}: {d.device_kind}", "jax": jax.__version__,
            "params": int(n_params), "layers": layers, "hidden": h, "rows": rows,
            "finite_step": bool(state.last_finite), "compile_cache": cache_dir}


def to_markdown(r):
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    base = r["rows"][0]["master_bytes_per_device"]
    lines = [f"Device: {r['device']}; jax {r['jax']}; naive mode (float16 params, float32 "
             f"masters, Adam); MLP {r['layers']} x {r['hidden']}x{r['hidden']} + bias, "
             f"{r['params']:,} params, every leaf split over N devices.", "",
             "| N devices | float32 masters / device MiB | vs N=1 | float16 params / device MiB "
             "| optimizer state / device MiB (masters + Adam) | compiled step arguments / device MiB "
             "| compiled step temporaries / device MiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        lines.append(
            f"| {row['devices']} | {mib(row['master_bytes_per_device'])} | "
            f"{row['master_bytes_per_device'] / base:.3f} | {mib(row['param_bytes_per_device'])} | "
            f"{mib(row['opt_state_bytes_per_device'])} | "
            f"{mib(row['step_argument_bytes_per_device'])} | {mib(row['step_temp_bytes_per_device'])} |")
    if all("compile" in row for row in r["rows"]):
        from _jax_compiles import compile_summary

        lines += ["", compile_summary({f"N={row['devices']}": row["compile"] for row in r["rows"]},
                                      r.get("compile_cache"))]
    return "\n".join(lines)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.device == "cpu":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules and args.device == "cpu":
        raise SystemExit("run this as its own process: jax was imported before the 8 CPU "
                         "devices could be forced")
    r = measure(args)
    print(json.dumps(r) if args.json else to_markdown(r))
    return r


if __name__ == "__main__":
    main()
