"""How the demo's JAX train step's compile time grows with depth, scanned and unrolled.

For each mode of ``examples/compare_modes.py``, its train step (`jax_train_step`, one
forward and one backward) on its transformer at each depth (default 2 and 12 layers,
width 128, 4 heads, context 64, batch 32: the demo's defaults), with the blocks run
under ``jax.lax.scan`` over stacked params (``scan``) or by a Python loop
(``unrolled``): the seconds of ``jax.jit(step).lower(...)`` and of ``.compile()``, with
jax's caches cleared before each. The variants are interleaved over ``--repeats``
rounds (a busy spell on a shared machine slows one round's compiles alike) and each
figure is the median over rounds; ``ratio`` is the deepest step's lower + compile time
over the shallowest's. The scanned step also reports the ``dot_general`` count of its
StableHLO, which does not grow with depth. Unlike the other JAX benchmarks this one
leaves JAX's persistent compilation cache off: every figure is a cold compile.

    python benchmarks/jax_compile_depth.py [--depths 2 12] [--repeats 3] [--modes fp32,fp8]
        [--width 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpfunc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from compare_modes import MODES, jax_apply, jax_train_step, torch_model, torch_to_jax_params  # noqa: E402,I001

ALL_MODES = ["fp32", "torch", "apex-O1", "apex-O2", "naive", "bf16", "fp8"]


def setup(name, cfg, layers, scan):
    """The lowered-to-be step of mode ``name`` and its arguments."""
    c = types.SimpleNamespace(**{**vars(cfg), "layers": layers, "scan": scan})
    mode, config = MODES[name]
    amp = mpfunc.convert_to_amp(jax_apply(c), optax.adam(1e-3), mode=mode, **config)
    params = amp.cast_params(jax.tree.map(jnp.asarray, torch_to_jax_params(torch_model(c),
                                                                           stacked=scan)))
    x = jnp.asarray(np.random.default_rng(0).integers(0, 90, (cfg.batch, cfg.context)),
                    jnp.int32)
    return jax_train_step(amp)[0], (params, amp.optimizer.init(params), x, x)


def compile_once(step, args):
    """(lower_s, compile_s, number of dot_general ops in the StableHLO)."""
    jax.clear_caches()
    with jax.numpy_dtype_promotion("standard"):
        t0 = time.perf_counter()
        lowered = jax.jit(step).lower(*args)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, lowered.as_text().count("stablehlo.dot_general")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 12])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default=",".join(ALL_MODES))
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(ALL_MODES))
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {ALL_MODES}")
    cfg = types.SimpleNamespace(width=args.width, heads=args.heads, context=args.context,
                                batch=args.batch, seed=0)
    variants = [(m, layout, d) for m in modes for layout in ("scan", "unrolled")
                for d in args.depths]
    inputs = {v: setup(v[0], cfg, v[2], v[1] == "scan") for v in variants}
    times = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            times[v].append(compile_once(*inputs[v]))
            print(f"round {r + 1}/{args.repeats} {v[0]:8} {v[1]:8} {v[2]:3} layers: "
                  f"lower {times[v][-1][0]:.2f} s, compile {times[v][-1][1]:.2f} s",
                  file=sys.stderr, flush=True)
    rows = []
    lo, hi = min(args.depths), max(args.depths)
    for m in modes:
        for layout in ("scan", "unrolled"):
            row = {"mode": m, "layout": layout}
            for d in args.depths:
                t = times[m, layout, d]
                row[str(d)] = {"lower_s": statistics.median(x[0] for x in t),
                               "compile_s": statistics.median(x[1] for x in t),
                               "total_s": statistics.median(x[0] + x[1] for x in t),
                               "dots": t[0][2]}
            row["ratio"] = row[str(hi)]["total_s"] / row[str(lo)]["total_s"]
            rows.append(row)
    result = {"device": f"{jax.devices()[0].platform} ({os.cpu_count()} cores)",
              "jax": jax.__version__, "repeats": args.repeats, "depths": args.depths,
              "config": vars(cfg), "rows": rows}
    print(to_markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps({"jax_compile_depth": result}, indent=1))
    return result


def to_markdown(result) -> str:
    depths = result["depths"]
    lo, hi = min(depths), max(depths)
    head = " | ".join(f"{d} layers: lower + compile (s)" for d in depths)
    lines = [f"| mode | layout | {head} | {hi}/{lo} | dot_general ops |",
             "| --- | --- | " + "--- | " * len(depths) + "--- | --- |"]
    for row in result["rows"]:
        cells = " | ".join(f"{row[str(d)]['lower_s']:.2f} + {row[str(d)]['compile_s']:.2f}"
                           for d in depths)
        dots = " / ".join(str(row[str(d)]["dots"]) for d in depths)
        lines.append(f"| {row['mode']} | {row['layout']} | {cells} | {row['ratio']:.2f}x "
                     f"| {dots} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
