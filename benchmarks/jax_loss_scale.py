"""Overhead of loss scaling on a jitted JAX train step.

Times one jitted train step of an MLP (about 1M params by default) four ways, with the
same model, data and compute dtype:

1. ``plain``: optax Adam, no scaling;
2. ``mpfunc``: ``mpfunc.dynamic_scale(adam)`` (the shipped default: a select fused where
   Adam writes its state);
3. ``mpfunc_select``: a select on the outputs of the update (the implementation before);
   ``mpfunc_cond``: a ``lax.cond`` skip (both kept for this comparison);
4. ``manual``: the jmp-style loop: scale the loss, unscale, ``all_finite``, then
   select between new and old params and optimizer state with ``jnp.where``.

Runs are interleaved (A B C D A B C D ...) and the median of the per-round step times is
reported, with ratios against ``plain``. Params, state and inputs are put on the device
first (committed) and each step is compiled once, ahead of time; the JSON's ``compiles``
counts every variant's step compiles (1 each). ``compile`` holds each step's cold and
warm compile seconds: with JAX's persistent compilation cache on (the default; see
``benchmarks/_jax_compiles.py``), the step is compiled again after ``jax.clear_caches()``
and loaded from the cache folder (that second compile is not counted in ``compiles``).

    python benchmarks/jax_loss_scale.py [--batch 512] [--width 1024] [--rounds 15] [--json F]
        [--compile-cache DIR | --no-compile-cache]
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
from _jax_compiles import (
    CompileCounter,
    add_cache_args,
    cache_from_args,
    check_once,
    compile_cold_warm,
    compile_summary,
    named,
    step_name,
)

import mpfunc
from _mpfunc_common.scale_config import resolve_scale_config
from mpfunc._src.scale_transform import _scale_transform


def init_mlp(key, sizes):
    params = []
    for k, (a, b) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append({"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": jnp.zeros((b,))})
    return params


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def make_steps(policy, lr=1e-3):
    def loss_fn(params, x, y):
        logits = policy.cast_to_output(mlp(policy.cast_to_compute(params), policy.cast_to_compute(x)))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    adam = optax.adam(lr)

    def plain(params, state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def scaled_step(opt):
        def step(params, state, x, y):
            grads = jax.grad(lambda p: mpfunc.scale_loss(loss_fn(p, x, y), state))(params)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return step

    cfg = resolve_scale_config("torch")
    ds = mpfunc.dynamic_scale(adam)
    ds_cond = _scale_transform(adam, cfg=cfg, static_value=None, axis_name=None, skip_with="cond")
    ds_select = _scale_transform(adam, cfg=cfg, static_value=None, axis_name=None,
                                 skip_with="select")

    def manual(params, state, x, y):
        opt_state, scale, tracker = state
        grads = jax.grad(lambda p: loss_fn(p, x, y) * scale)(params)
        grads = jax.tree.map(lambda g: g / scale, grads)
        finite = mpfunc.all_finite(grads)
        updates, new_opt_state = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_params, params)
        opt_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_opt_state, opt_state)
        tracker = jnp.where(finite, tracker + 1, 0)
        grow = tracker == cfg.growth_interval
        scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
        tracker = jnp.where(grow, 0, tracker)
        return params, (opt_state, scale, tracker)

    inits = {
        "plain": adam.init,
        "mpfunc": ds.init,
        "mpfunc_select": ds_select.init,
        "mpfunc_cond": ds_cond.init,
        "manual": lambda p: (adam.init(p), jnp.float32(2.0**16), jnp.int32(0)),
    }
    steps = {"plain": plain, "mpfunc": scaled_step(ds), "mpfunc_select": scaled_step(ds_select),
             "mpfunc_cond": scaled_step(ds_cond), "manual": manual}
    return steps, inits


def run(batch, width, depth, rounds, iters, compute, cache_dir=None):
    counter = CompileCounter()
    dev = jax.devices()[0]
    policy = mpfunc.get_policy(f"p=f32,c={compute},o=f32")
    sizes = [512] + [width] * depth + [10]
    # Everything on the device first (committed), so that the step's outputs come back
    # with the placement it was compiled for.
    params = jax.device_put(init_mlp(jax.random.key(0), sizes), dev)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (batch, 512)), dev)
    y = jax.device_put(jax.random.randint(jax.random.key(2), (batch,), 0, 10), dev)
    fns, inits = make_steps(policy)
    steps, states, names, compile_times = {}, {}, {}, {}
    for i, name in enumerate(fns):
        names[name] = step_name(name, i)
        p, s = params, jax.device_put(inits[name](params), dev)
        step = jax.jit(named(fns[name], names[name]))
        steps[name], compile_times[name] = compile_cold_warm(
            lambda step=step, p=p, s=s: step.lower(p, s, x, y), counter)
        p, s = steps[name](p, s, x, y)  # warm up
        jax.block_until_ready((p, s))
        states[name] = (p, s)
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            p, s = states[name]
            t0 = time.perf_counter()
            for _ in range(iters):
                p, s = step(p, s, x, y)
            jax.block_until_ready((p, s))
            times[name].append((time.perf_counter() - t0) / iters)
            states[name] = (p, s)
    med = {name: statistics.median(t) for name, t in times.items()}
    fastest = {name: min(t) for name, t in times.items()}
    compiles = {name: counter.of(names[name]) for name in steps}
    return {
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()}), "
                  f"{platform.processor() or platform.machine()}",
        "versions": {"jax": jax.__version__, "optax": optax.__version__},
        "params": int(n_params),
        "batch": batch,
        "compute_dtype": compute,
        "rounds": rounds,
        "iters_per_round": iters,
        "median_step_ms": {k: v * 1e3 for k, v in med.items()},
        "ratio_vs_plain": {k: v / med["plain"] for k, v in med.items()},
        "min_step_ms": {k: v * 1e3 for k, v in fastest.items()},
        "min_ratio_vs_plain": {k: v / fastest["plain"] for k, v in fastest.items()},
        "ratio_mpfunc_vs_manual": med["mpfunc"] / med["manual"],
        "compiles": compiles,  # XLA compiles of each variant's step: 1 each
        "compile_problems": check_once(compiles),
        "compile_cache": cache_dir,  # None: off
        "compile": compile_times,  # per variant: cold and warm compile seconds
    }


def to_markdown(r):
    lines = [
        f"Device: {r['device']}; jax {r['versions']['jax']}, optax {r['versions']['optax']}; "
        f"MLP {r['params']:,} params, batch {r['batch']}, compute {r['compute_dtype']}; "
        f"median of {r['rounds']} interleaved rounds x {r['iters_per_round']} steps.",
        "",
        "| variant | median step (ms) | vs plain Adam | fastest round (ms) | vs plain Adam |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k, v in r["median_step_ms"].items():
        lines.append(f"| {k} | {v:.3f} | {r['ratio_vs_plain'][k]:.3f}x | "
                     f"{r['min_step_ms'][k]:.3f} | {r['min_ratio_vs_plain'][k]:.3f}x |")
    lines.append("")
    lines.append(f"mpfunc / manual jmp-style loop: {r['ratio_mpfunc_vs_manual']:.3f}x")
    if "compiles" in r:
        lines.append("XLA compiles per step: " + (", ".join(r["compile_problems"]) or "1 each"))
    if "compile" in r:
        lines.append(compile_summary(r["compile"], r.get("compile_cache")))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--compute", default="f32")
    ap.add_argument("--json", default=None, help="also write the result here")
    add_cache_args(ap)
    args = ap.parse_args(argv)
    cache_dir = cache_from_args(args)
    r = run(args.batch, args.width, args.depth, args.rounds, args.iters, args.compute,
            cache_dir)
    print(to_markdown(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
