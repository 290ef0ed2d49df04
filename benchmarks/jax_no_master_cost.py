"""Cost of training without float32 masters in JAX: the optimizer update alone, and bytes.

Times one jitted optimizer update of bfloat16 params (gradients given; params and state
donated; ``optax.apply_updates`` included) for each way of keeping the params' exact
values, against ``optax.adam`` on bfloat16 params (its moments then bfloat16, rounded to
nearest; no exact values kept):

* ``adam_bf16``: the baseline;
* ``float32_masters``: ``mpfunc.master_weights(adam)`` (float32 masters and moments);
* ``remainder`` / ``kahan`` / ``stochastic``: ``mpfunc.master_weights(
  mpfunc.state_dtype(adam, "bfloat16"), storage=...)`` (bfloat16 moments, rounded
  stochastically);
* ``stochastic_8bit``: the same with ``state_dtype="float8_e4m3fn"`` (per-block scales);
* ``remainder_amp``: ``mpfunc.convert_to_amp(mode="bf16", master_weights="remainder",
  state_dtype="bfloat16")``'s optimizer, whose finite check skips a non-finite step.

Runs are interleaved (A B C ... A B C ...); each round times ``--iters`` updates of every
variant. Reported: the median per-update time over rounds, its ratio to the baseline's
median, and the median of the per-round (paired) ratios. Bytes per parameter are
measured from the buffers after ``init`` (params + every state leaf: moments, masters,
remainders, compensation, block scales, seeds, counts), divided by the param count.

    python benchmarks/jax_no_master_cost.py [--width 1024] [--layers 4] [--rounds 15]
        [--iters 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import mpfunc

LR = 1e-3


def variants(lr=LR):
    adam = optax.adam(lr)
    amp = mpfunc.convert_to_amp(lambda p, x: x, adam, mode="bf16",
                                master_weights="remainder", state_dtype="bfloat16")

    def mw(storage, state):
        return mpfunc.master_weights(mpfunc.state_dtype(adam, state), storage=storage)

    return {
        "adam_bf16": adam,
        "float32_masters": mpfunc.master_weights(adam),
        "remainder": mw("remainder", "bfloat16"),
        "kahan": mw("kahan", "bfloat16"),
        "stochastic": mw("stochastic", "bfloat16"),
        "stochastic_8bit": mw("stochastic", "float8_e4m3fn"),
        "remainder_amp": amp.optimizer,
    }


def bytes_per_param(params, state) -> float:
    leaves = jax.tree.leaves((params, state))
    n = sum(x.size for x in jax.tree.leaves(params))
    return sum(x.size * x.dtype.itemsize for x in leaves) / n


def run(width, layers, rounds, iters, only=None):
    key = jax.random.key(0)
    keys = jax.random.split(key, 2 * layers)
    params = {f"l{i}": {"w": (jax.random.normal(keys[2 * i], (width, width)) / width**0.5
                              ).astype(jnp.bfloat16),
                        "b": jnp.zeros((width,), jnp.bfloat16)} for i in range(layers)}
    grads = jax.tree.map(lambda p, k: jax.random.normal(k, p.shape).astype(p.dtype), params,
                         dict(zip(params, [{"w": keys[2 * i + 1], "b": keys[2 * i + 1]}
                                           for i in range(layers)])))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    opts = variants()
    if only:
        opts = {k: v for k, v in opts.items() if k in only or k == "adam_bf16"}
    steps, states, sizes = {}, {}, {}
    for name, opt in opts.items():
        def step(p, s, g, opt=opt):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        p = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        s = jax.jit(opt.init)(p)
        sizes[name] = bytes_per_param(p, s)
        steps[name] = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, grads).compile()
        p, s = steps[name](p, s, grads)  # warm up
        jax.block_until_ready((p, s))
        states[name] = (p, s)
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            p, s = states[name]
            t0 = time.perf_counter()
            for _ in range(iters):
                p, s = step(p, s, grads)
            jax.block_until_ready((p, s))
            times[name].append((time.perf_counter() - t0) / iters)
            states[name] = (p, s)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = times["adam_bf16"]
    paired = {k: statistics.median(a / b for a, b in zip(v, base)) for k, v in times.items()}
    return {
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()}), "
                  f"{platform.processor() or platform.machine()}",
        "versions": {"jax": jax.__version__, "optax": optax.__version__},
        "params": int(n_params),
        "rounds": rounds,
        "iters_per_round": iters,
        "median_update_ms": {k: v * 1e3 for k, v in med.items()},
        "ratio_vs_adam_bf16": {k: v / med["adam_bf16"] for k, v in med.items()},
        "paired_ratio_vs_adam_bf16": paired,
        "bytes_per_param": sizes,
    }


def to_markdown(r):
    lines = [
        f"Device: {r['device']}; jax {r['versions']['jax']}, optax {r['versions']['optax']}; "
        f"{r['params']:,} bfloat16 params; median of {r['rounds']} interleaved rounds x "
        f"{r['iters_per_round']} updates.",
        "",
        "| variant | bytes/param | median update (ms) | vs adam_bf16 | paired ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k, v in r["median_update_ms"].items():
        lines.append(f"| {k} | {r['bytes_per_param'][k]:.3f} | {v:.3f} | "
                     f"{r['ratio_vs_adam_bf16'][k]:.3f}x | "
                     f"{r['paired_ratio_vs_adam_bf16'][k]:.3f}x |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--only", default=None,
                    help="comma-separated variants to time (adam_bf16 always runs)")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        ap.error(f"--rounds and --iters must be >= 1, got {args.rounds} and {args.iters}")
    only = args.only.split(",") if args.only else None
    known = set(variants())
    if only and (bad := sorted(set(only) - known)):
        ap.error(f"unknown variant(s) {bad}; choose from {sorted(known)}")
    r = run(args.width, args.layers, args.rounds, args.iters, only)
    print(to_markdown(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
