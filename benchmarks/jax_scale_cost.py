"""What an exact skip costs: peak memory, compile time and step time of a donated step.

Every loss-scaling form (and each ``convert_to_amp`` mode) against the same step without
it, at three depths of an MLP (width 256, two leaves per layer), all compiled as
``jax.jit(step, donate_argnums=(0, 1))``, as large models train:

* peak memory: XLA's ``memory_analysis()`` of the compiled step, arguments + outputs +
  temporaries - aliased (donated) bytes. Deterministic.
* compile time: ``lower`` + ``compile``, each the minimum over ``--compile-repeats``,
  interleaved over the variants; each compile runs in a fresh process (after a warm-up
  compile of an unrelated function), as a training run's first step does.
  ``--compile-in-process`` times them all in this process instead. These compiles
  bypass JAX's persistent compilation cache (cold, whatever its folder holds); with the
  cache on (the default, ``benchmarks/_jax_compiles.py``), each row also has the step's
  warm compile (``warm_compile_s``: loaded from the cache folder, in this process).
* step time: the fastest of interleaved rounds (A B C ... A B C ...), which on a shared
  machine is the round no other process interrupted. The JSON also has the median, and
  the median over rounds of each round's ratio to its baseline's time in that round
  (``step_ratio_paired_median``, the steadiest figure on a noisy machine).

    python benchmarks/jax_scale_cost.py [--depths 8 24 96] [--batch 32] [--json F]
        [--model transformer] [--compile-cache DIR | --no-compile-cache]

``--model transformer`` swaps the MLP for a pre-LayerNorm transformer (width 256, 4
heads, sequence 64, MLP 1024; ten leaves per layer), so the optimizer is a smaller share
of the step than in the MLP.

Params, state and inputs are put on the device first (committed), and the one executable
compiled in this process for each variant (the last compile-time repeat with
``--compile-in-process``, else a single compile) serves ``memory_analysis()``, the
warm-up and the timing; each row's ``compiles`` counts that step's XLA compiles in this
process (1, or ``--compile-repeats`` in process). The jmp row is skipped, with a note in
the JSON, where jmp is not installed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import gpu_report
import jax
import jax.numpy as jnp
import optax
from _jax_compiles import (
    CompileCounter,
    add_cache_args,
    cache_from_args,
    cache_paused,
    named,
    step_name,
    use_compile_cache,
    warm_compile,
)

import mpfunc
from _mpfunc_common.scale_config import resolve_scale_config
from mpfunc._src.scale_transform import _scale_transform

WIDTH = 256
LR = 1e-3
JMP_VARIANT = "jmp DynamicLossScale + select_tree"


def init_mlp(depth, width=WIDTH):
    keys = jax.random.split(jax.random.key(0), depth)
    layers = {f"dense_{i}": {"w": jax.random.normal(k, (width, width)) / jnp.sqrt(width),
                             "b": jnp.zeros((width,))} for i, k in enumerate(keys)}
    layers["LayerNorm_0"] = {"scale": jnp.ones((width,)), "bias": jnp.zeros((width,))}
    return layers


def apply_mlp(params, x):
    depth = len(params) - 1
    for i in range(depth):
        layer = params[f"dense_{i}"]
        x = jnp.tanh(x @ layer["w"] + layer["b"].astype(x.dtype))
    ln = params["LayerNorm_0"]
    x = x.astype(jnp.float32)
    x = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)
    return x * ln["scale"].astype(jnp.float32) + ln["bias"].astype(jnp.float32)


F16 = mpfunc.get_policy("params=float32,compute=float16,output=float32")


SEQ, HEADS = 64, 4


def _layer_norm(x, p):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def init_transformer(depth, width=WIDTH):
    def dense(k, n_in, n_out):
        return jax.random.normal(k, (n_in, n_out)) / jnp.sqrt(n_in)

    def norm():
        return {"scale": jnp.ones((width,)), "bias": jnp.zeros((width,))}

    params = {}
    for i, k in enumerate(jax.random.split(jax.random.key(0), depth)):
        k1, k2, k3, k4 = jax.random.split(k, 4)
        params[f"layer_{i}"] = {
            "ln1": norm(), "wqkv": dense(k1, width, 3 * width), "wo": dense(k2, width, width),
            "ln2": norm(), "w1": dense(k3, width, 4 * width), "b1": jnp.zeros((4 * width,)),
            "w2": dense(k4, 4 * width, width), "b2": jnp.zeros((width,))}
    params["LayerNorm_0"] = norm()
    return params


def apply_transformer(params, x):
    """A causal pre-LayerNorm transformer over ``x`` of shape (batch, SEQ, WIDTH)."""
    b, s, d = x.shape
    mask = jnp.tril(jnp.ones((s, s), bool))
    for i in range(len(params) - 1):
        p = params[f"layer_{i}"]
        q, k, v = jnp.split(_layer_norm(x, p["ln1"]) @ p["wqkv"], 3, axis=-1)
        q, k, v = (t.reshape(b, s, HEADS, d // HEADS) for t in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS).astype(x.dtype)
        att = jax.nn.softmax(jnp.where(mask, logits.astype(jnp.float32), -1e9), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att.astype(x.dtype), v).reshape(b, s, d)
        x = x + o @ p["wo"]
        h = jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["w1"] + p["b1"])
        x = x + h @ p["w2"] + p["b2"]
    return _layer_norm(x.astype(jnp.float32),
                       jax.tree.map(lambda a: a.astype(jnp.float32), params["LayerNorm_0"]))


MODELS = {"mlp": (init_mlp, apply_mlp, lambda batch: (batch, WIDTH)),
          "transformer": (init_transformer, apply_transformer,
                          lambda batch: (batch, SEQ, WIDTH))}
_model = "mlp"  # set by --model


def init_model(depth):
    return MODELS[_model][0](depth)


def apply_model(params, x):
    return MODELS[_model][1](params, x)


def apply_model_f16(params, x):
    """The model computing in float16 from float32 params (where loss scaling is needed)."""
    return F16.cast_to_output(apply_model(F16.cast_to_compute(params), F16.cast_to_compute(x)))


def mse(out):
    return jnp.mean(out.astype(jnp.float32) ** 2)


def optax_step(tx, scaled=False, apply_fn=apply_model):
    """A step through one optax transformation (with `scale_loss` when ``scaled``)."""

    def step(params, state, x):
        def loss_fn(p):
            loss = mse(apply_fn(p, x))
            return mpfunc.scale_loss(loss, state) if scaled else loss

        grads = jax.grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return tx.init, step


def flax_step(tx):
    """flax's documented pattern: DynamicScale.value_and_grad, then where over the state."""
    from flax.training.dynamic_scale import DynamicScale

    def init(params):
        return tx.init(params), DynamicScale()

    def step(params, state, x):
        opt_state, ds = state
        ds, finite, _, grads = ds.value_and_grad(lambda p: mse(apply_model(p, x)))(params)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda a, b: jax.tree.map(lambda u, v: jnp.where(finite, u, v), a, b)  # noqa: E731
        return keep(new_params, params), (keep(new_opt, opt_state), ds)

    return init, step


def jmp_step(tx):
    """jmp's documented pattern: scale, unscale, all_finite, select_tree, adjust (jmp is
    imported when the step is traced: `run` leaves the variant out where it is missing)."""

    # jmp's DynamicLossScale cannot be a `lower()` argument under jax 0.10 (its
    # unflatten validates leaves), so its two arrays travel and it is rebuilt inside.
    def init(params):
        return tx.init(params), (jnp.float32(2.0**15), jnp.int32(0))

    def step(params, state, x):
        import jmp

        opt_state, (scale, counter) = state
        ls = jmp.DynamicLossScale(scale, counter)
        grads = jax.grad(lambda p: ls.scale(mse(apply_model(p, x))))(params)
        grads = ls.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params = jmp.select_tree(finite, new_params, params)
        opt_state = jmp.select_tree(finite, new_opt, opt_state)
        ls = ls.adjust(finite)
        return params, (opt_state, (ls.loss_scale, ls.counter))

    return init, step


def helper_step(tx):
    """mpfunc.value_and_grad (flax-style) feeding the wrapper form."""

    def step(params, state, x):
        out = mpfunc.value_and_grad(lambda p: mse(apply_model(p, x)))(state, params)
        updates, state = tx.update(out, state, params)
        return optax.apply_updates(params, updates), state

    return tx.init, step


def scaling_variants():
    """name -> (baseline name, init, step, cast_params)."""
    adam = optax.adam(LR)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), adam)
    cfg = resolve_scale_config("torch")
    internal = lambda how: _scale_transform(adam, cfg=cfg, static_value=None,  # noqa: E731
                                            axis_name=None, skip_with=how)
    ident = lambda p: p  # noqa: E731
    v = {
        "plain optax.adam": (None, *optax_step(adam), ident),
        "optax.apply_if_finite(adam)": ("plain optax.adam",
                                        *optax_step(optax.apply_if_finite(adam, 10)), ident),
        "flax DynamicScale + where": ("plain optax.adam", *flax_step(adam), ident),
        JMP_VARIANT: ("plain optax.adam", *jmp_step(adam), ident),
        "mpfunc.dynamic_scale(adam)": ("plain optax.adam",
                                       *optax_step(mpfunc.dynamic_scale(adam), True), ident),
        # The opt-in skip record (scale_metrics(skip_leaves=...)): one reduction per leaf.
        "mpfunc.dynamic_scale(adam, record_skip_leaves=True)": (
            "plain optax.adam",
            *optax_step(mpfunc.dynamic_scale(adam, record_skip_leaves=True), True), ident),
        "mpfunc.value_and_grad + dynamic_scale(adam)": (
            "plain optax.adam", *helper_step(mpfunc.dynamic_scale(adam)), ident),
        "mpfunc.static_scale(2**10, adam)": (
            "plain optax.adam", *optax_step(mpfunc.static_scale(2.0**10, adam), True), ident),
        "optax.chain(mpfunc.dynamic_scale(), adam)": (
            "plain optax.adam", *optax_step(optax.chain(mpfunc.dynamic_scale(), adam), True),
            ident),
        # Where a loss scale is used: float32 params, float16 compute.
        "plain optax.adam, float16 compute": (None, *optax_step(adam, False, apply_model_f16),
                                              ident),
        "mpfunc.dynamic_scale(adam), float16 compute": (
            "plain optax.adam, float16 compute",
            *optax_step(mpfunc.dynamic_scale(adam), True, apply_model_f16), ident),
        # Global-norm clipping, as most large-model recipes use: it too must see every
        # gradient before it updates any parameter.
        "optax.chain(clip_by_global_norm(1.0), adam)": (None, *optax_step(clipped), ident),
        "mpfunc.dynamic_scale(chain(clip_by_global_norm(1.0), adam))": (
            "optax.chain(clip_by_global_norm(1.0), adam)",
            *optax_step(mpfunc.dynamic_scale(clipped), True), ident),
        "select on the outputs (before)": ("plain optax.adam",
                                           *optax_step(internal("select"), True), ident),
        "lax.cond": ("plain optax.adam", *optax_step(internal("cond"), True), ident),
        "optax.MultiSteps(adam, 4)": (None, *optax_step(
            optax.MultiSteps(adam, 4).gradient_transformation()), ident),
        "mpfunc.dynamic_scale(MultiSteps(adam, 4))": (
            "optax.MultiSteps(adam, 4)",
            *optax_step(mpfunc.dynamic_scale(optax.MultiSteps(adam, 4)), True), ident),
        # optax's own skip inside MultiSteps (a lax.cond), for comparison.
        "MultiSteps(adam, 4, should_skip_update_fn=skip_not_finite)": (
            "optax.MultiSteps(adam, 4)", *optax_step(optax.MultiSteps(
                adam, 4, should_skip_update_fn=optax.skip_not_finite).gradient_transformation()),
            ident),
    }
    for name, mode, config in (("torch", "torch", {}),
                               ("apex O1", "apex", {"opt_level": "O1", "verbosity": 0}),
                               ("apex O2", "apex", {"opt_level": "O2", "verbosity": 0}),
                               ("naive", "naive", {}), ("bf16", "bf16", {})):
        amp = mpfunc.convert_to_amp(apply_model, adam, mode=mode, **config)
        # The same mode without loss scaling: same precision, same master weights.
        bare = mpfunc.master_weights(adam) if amp.plan.master_weights else adam
        base = f"mode {name}, no loss scaling"
        v[base] = (None, *optax_step(bare, False, amp.apply_fn), amp.cast_params)
        v[f"mode {name}"] = (base, *optax_step(amp.optimizer, True, amp.apply_fn),
                             amp.cast_params)
    return v


def compile_time(step, params, state, x, name="step"):
    """(lower_s, xla_compile_s) of ``jax.jit(step, donate_argnums=(0, 1))``, and the
    compiled step, with jax's caches cleared first; ``name`` is the jitted function's
    name (what the compile counter sees)."""
    jax.clear_caches()  # or a repeat would hit jax's compilation cache
    t0 = time.perf_counter()
    lowered = jax.jit(named(step, name), donate_argnums=(0, 1)).lower(params, state, x)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return t1 - t0, time.perf_counter() - t1, compiled


def compile_one(name, depth, batch):
    """One compile of variant ``name`` in this (fresh) process, after a warm-up compile of
    an unrelated function, so that one-time costs of the process are not counted."""
    _, init, step, cast = scaling_variants()[name]
    params = cast(init_model(depth))
    x = jax.random.normal(jax.random.key(1), MODELS[_model][2](batch))
    jax.jit(lambda a: jnp.tanh(a @ a.T).sum()).lower(jnp.ones((8, 8))).compile()
    lower_s, xla_s, _ = compile_time(step, params, init(params), x)
    return {"lower_s": lower_s, "xla_compile_s": xla_s}


def _compile_in_subprocess(name, depth, batch):
    cmd = [sys.executable, os.path.abspath(__file__), "--compile-one", name, "--depths",
           str(depth), "--batch", str(batch), "--model", _model]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"compiling {name!r} in a subprocess failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(variants, depth, batch, compile_repeats, rounds, iters, isolated=True,
            counter=None):
    # Everything on the device first (committed): the donated step's outputs then come
    # back with the placement it was compiled for, and the one executable serves all.
    dev = jax.devices()[0]
    params32 = jax.device_put(init_model(depth), dev)
    x = jax.device_put(jax.random.normal(jax.random.key(1), MODELS[_model][2](batch)), dev)
    rows, runs, inputs, best, names = {}, {}, {}, {}, {}
    for i, (name, (_, init, _, cast)) in enumerate(variants.items()):
        # Fresh buffers: donation deletes them, and a state may alias the params.
        fresh = lambda t: jax.tree.map(  # noqa: E731
            lambda a: jax.device_put(jnp.array(a, copy=True), dev)
            if isinstance(a, jax.Array) else a, t)
        params = fresh(cast(params32))
        inputs[name] = (params, fresh(init(params)))
        best[name] = [float("inf"), float("inf")]
        names[name] = step_name(f"{depth}_{name}", i)
    # Compile repeats interleaved over the variants (A B C ... A B C ...), so that a slow
    # spell of the machine does not land on one variant's repeats only. Isolated (the
    # default), each compile runs in a fresh process, as a training run's first step
    # does: in one long process a compile right after a very large one (jmp's or flax's
    # rows, 11-36 s at 96 layers) ran up to 1.5x slower (BENCHMARKS.md section 6).
    compiled = {}
    with cache_paused():  # cold compiles (the children run with the cache off)
        for _ in range(compile_repeats):
            for name, (_, _, step, _) in variants.items():
                if isolated:
                    t = _compile_in_subprocess(name, depth, batch)
                    lower_s, xla_s = t["lower_s"], t["xla_compile_s"]
                else:
                    lower_s, xla_s, compiled[name] = compile_time(step, *inputs[name], x,
                                                                  names[name])
                best[name] = [min(best[name][0], lower_s), min(best[name][1], xla_s)]
    for name, (_, _, step, _) in variants.items():
        if name not in compiled:
            compiled[name] = compile_time(step, *inputs[name], x, names[name])[2]
    for name, (base, _, step, _) in variants.items():
        m = compiled[name].memory_analysis()
        peak = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)
        jitted = jax.jit(named(step, names[name]), donate_argnums=(0, 1))
        warm = warm_compile(lambda jitted=jitted, name=name: jitted.lower(*inputs[name], x),
                            counter)
        rows[name] = {"baseline": base, "peak_bytes": int(peak),
                      "temp_bytes": int(m.temp_size_in_bytes),
                      "lower_s": best[name][0], "xla_compile_s": best[name][1],
                      "compile_s": sum(best[name]),
                      "warm_compile_s": warm["total_s"] if warm else None,
                      "warm_cache": warm["cache"] if warm else None}
        p, s = compiled[name](*inputs[name], x)  # warm up
        jax.block_until_ready((p, s))
        runs[name] = [compiled[name], p, s, []]
    for _ in range(rounds):
        for run in runs.values():
            compiled, p, s, t = run
            t0 = time.perf_counter()
            for _ in range(iters):
                p, s = compiled(p, s, x)
            jax.block_until_ready((p, s))
            t.append((time.perf_counter() - t0) / iters)
            run[1], run[2] = p, s
    for name, row in rows.items():
        # The minimum over rounds: on a shared machine, the rounds that other processes
        # did not interrupt. The median is kept too.
        row["step_ms"] = min(runs[name][3]) * 1e3 if rounds else float("nan")
        row["step_ms_median"] = statistics.median(runs[name][3]) * 1e3 if rounds else None
    for name, row in rows.items():
        if row["baseline"] is not None:
            b = rows[row["baseline"]]
            row["peak_ratio"] = row["peak_bytes"] / b["peak_bytes"]
            row["compile_ratio"] = row["compile_s"] / b["compile_s"]
            row["step_ratio"] = row["step_ms"] / b["step_ms"]
            if rounds:  # each round against its baseline's time in the same round
                row["step_ratio_paired_median"] = statistics.median(
                    t / tb for t, tb in zip(runs[name][3], runs[row["baseline"]][3]))
    if counter is not None:  # after the timing: a recompile there would count too
        for name, row in rows.items():
            row["compiles"] = counter.of(names[name])
    n_leaves = len(jax.tree_util.tree_leaves(params32))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params32))
    return {"depth": depth, "leaves": n_leaves, "params": int(n_params), "rows": rows}


def cpu_name():
    """The CPU's model name and core count (platform.processor() is often empty)."""
    return f"{gpu_report.cpu_name()}, {os.cpu_count()} cores"


def _importable(module):
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def run(depths, batch, compile_repeats, rounds, iters, only=None, isolated=True,
        cache_dir=None):
    variants = scaling_variants()
    skipped = {}
    if not _importable("jmp"):
        skipped[JMP_VARIANT] = "jmp is not installed"
        del variants[JMP_VARIANT]
    if only:
        unknown = [n for n in only if n not in variants and n not in skipped]
        if unknown:
            raise ValueError(f"`only` names unknown variants {unknown}; choose from "
                             f"{sorted(variants) + sorted(skipped)}")
        keep = {n for n in only if n in variants}
        keep |= {variants[n][0] for n in keep if variants[n][0]}
        variants = {k: v for k, v in variants.items() if k in keep}
    counter = CompileCounter()
    depth_rows = [measure(variants, d, batch, compile_repeats, rounds, iters, isolated,
                          counter) for d in depths]
    expected = 1 if isolated else compile_repeats
    problems = [f"{d['depth']} layers, {name}: {row['compiles']} compiles (expected "
                f"{expected})" for d in depth_rows for name, row in d["rows"].items()
                if row["compiles"] != expected]
    return {
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()}), "
                  f"{cpu_name()}",
        "versions": {"jax": jax.__version__, "optax": optax.__version__},
        "model": _model, "batch": batch, "width": WIDTH, "compile_repeats": compile_repeats,
        "rounds": rounds, "iters": iters, "compile_isolated": isolated,
        "expected_compiles_per_step": expected, "compile_problems": problems,
        "compile_cache": cache_dir, "skipped": skipped, "depths": depth_rows,
    }


def to_markdown(r):
    depths = r["depths"]
    head = " | ".join(f"{d['depth']} layers ({d['leaves']} leaves)" for d in depths)
    out = [
        f"Device: {r['device']}; jax {r['versions']['jax']}, optax {r['versions']['optax']}; "
        f"{r.get('model', 'mlp')} width {r['width']}, batch {r['batch']}; donated step. "
        "Each cell: peak memory "
        "/ compile time" + (" / step time" if r["rounds"] else "") + ", as ratios to the "
        "row's baseline (plain Adam, or the same mode without loss scaling).",
        "",
        f"| step | baseline | {head} |",
        "| --- | --- | " + " | ".join("---" for _ in depths) + " |",
    ]
    for name, row0 in depths[0]["rows"].items():
        cells = []
        for d in depths:
            row = d["rows"][name]
            timed = r["rounds"] > 0
            if row["baseline"] is None:
                cells.append(f"{row['peak_bytes'] / 2**20:.1f} MiB / {row['compile_s']:.2f} s"
                             + (f" / {row['step_ms']:.2f} ms" if timed else ""))
            else:
                cells.append(f"{row['peak_ratio']:.3f}x / {row['compile_ratio']:.2f}x"
                             + (f" / {row['step_ratio']:.2f}x" if timed else ""))
        out.append(f"| {name} | {row0['baseline'] or '-'} | " + " | ".join(cells) + " |")
    for name, why in r.get("skipped", {}).items():
        out.append(f"\nNot measured: {name} ({why}).")
    warm = [f"{name} {d['rows'][name]['warm_compile_s']:.2f} s" for d in depths
            for name in d["rows"] if d["rows"][name].get("warm_compile_s") is not None]
    if warm:
        out.append(f"\nWarm compile (from the persistent cache in {r['compile_cache']}): "
                   + "; ".join(warm))
    if "compile_problems" in r:
        out.append("\nXLA compiles per step in this process: "
                   + ("; ".join(r["compile_problems"])
                      or f"{r['expected_compiles_per_step']} each, as expected"))
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 24, 96])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--compile-repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15, help="0: no step timing")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=None, help="variant names (and baselines)")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--model", choices=sorted(MODELS), default="mlp")
    ap.add_argument("--compile-in-process", action="store_true",
                    help="time every compile in this one process, not each in a fresh one")
    ap.add_argument("--compile-one", default=None, help=argparse.SUPPRESS)
    add_cache_args(ap)
    args = ap.parse_args(argv)
    global _model
    _model = args.model
    if args.compile_one:  # the subprocess behind an isolated compile time: cold
        use_compile_cache(None)
        print(json.dumps(compile_one(args.compile_one, args.depths[0], args.batch)))
        return None
    cache_dir = cache_from_args(args)
    try:
        r = run(args.depths, args.batch, args.compile_repeats, args.rounds, args.iters,
                args.only, isolated=not args.compile_in_process, cache_dir=cache_dir)
    except ValueError as e:
        ap.error(str(e))
    print(to_markdown(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
