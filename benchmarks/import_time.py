"""Seconds to import torch, mpfunc_torch, jax and mpfunc, each in a fresh process.

Each round imports every module once, each in its own new interpreter, in an order that
rotates from round to round (interleaved, so a busy spell of a shared machine slows all
modules of a round alike). A child times only its ``import`` statement (not the
interpreter's start), in wall seconds and in the process's CPU seconds (steady on a
shared, loaded machine, where the wall time mostly measures the others), and says which
heavy torch subpackages that import loaded. The report gives, per module, the median and
min-max over rounds, and the ratio of ``import mpfunc_torch`` to ``import torch`` (which
it includes), and of ``import mpfunc`` to ``import jax``: the median of the per-round
ratios, wall and CPU. ``benchmarks/gpu.sh`` runs it first, as its ``import_time`` part.

    python benchmarks/import_time.py [--rounds 7] [--modules torch,mpfunc_torch] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["torch", "mpfunc_torch", "jax", "mpfunc"]
# Loaded only when used (torch.compile, export): `import mpfunc_torch` must not load them.
LAZY = ["torch._dynamo", "torch.onnx", "torch._inductor"]

CHILD = """
import sys, time
t0, c0 = time.perf_counter(), time.process_time()
import {module}
dt, dc = time.perf_counter() - t0, time.process_time() - c0
import json
print(json.dumps({{"seconds": dt, "cpu_seconds": dc,
                  "loaded": [m for m in {lazy!r} if m in sys.modules]}}))
"""


def import_once(module: str, env: dict[str, str]) -> dict:
    """One fresh interpreter that imports ``module``: its seconds and what it loaded."""
    proc = subprocess.run([sys.executable, "-c", CHILD.format(module=module, lazy=LAZY)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"`import {module}` failed in a fresh process:\n"
                           f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(modules: list[str], rounds: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    times = {k: {m: [] for m in modules} for k in ("seconds", "cpu_seconds")}
    loaded: dict[str, list[str]] = {}
    for r in range(rounds):
        for m in modules[r % len(modules):] + modules[: r % len(modules)]:
            out = import_once(m, env)
            for k in times:
                times[k][m].append(out[k])
            loaded[m] = out["loaded"]
    result = {"python": platform.python_version(),
              "cpu": f"{platform.machine()}, {os.cpu_count()} cores", "rounds": rounds,
              "loaded": loaded}
    for k, by_module in times.items():
        result[k] = {m: {"median": statistics.median(t), "min": min(t), "max": max(t),
                         "all": t} for m, t in by_module.items()}
    for name, base in (("mpfunc_torch", "torch"), ("mpfunc", "jax")):
        if name in modules and base in modules:
            result[f"{name}_vs_{base}"] = {k: _ratio(times[k][name], times[k][base])
                                           for k in times}
    return result


def _ratio(a: list[float], b: list[float]) -> dict:
    per_round = [x / y for x, y in zip(a, b, strict=True)]
    return {"median": statistics.median(per_round), "min": min(per_round),
            "max": max(per_round)}


def to_markdown(r: dict) -> str:
    lines = [f"Python {r['python']}, {r['cpu']}; {r['rounds']} interleaved rounds, each "
             "import in a fresh process.", "",
             "| import | wall s, median (min-max) | CPU s, median (min-max) | loads |",
             "| --- | --- | --- | --- |"]
    for m, s in r["seconds"].items():
        c = r["cpu_seconds"][m]
        lines.append(f"| `{m}` | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | "
                     f"{c['median']:.2f} ({c['min']:.2f}-{c['max']:.2f}) | "
                     f"{', '.join(r['loaded'].get(m, [])) or '-'} |")
    for key in ("mpfunc_torch_vs_torch", "mpfunc_vs_jax"):
        if key in r:
            a, b = key.split("_vs_")
            w, c = r[key]["seconds"], r[key]["cpu_seconds"]
            lines.append(f"\n`import {a}` / `import {b}`: {w['median']:.2f}x wall (rounds "
                         f"{w['min']:.2f}-{w['max']:.2f}), {c['median']:.2f}x CPU (rounds "
                         f"{c['min']:.2f}-{c['max']:.2f})")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--modules", default=",".join(MODULES),
                    help=f"comma-separated, from {MODULES}")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    modules = [m for m in args.modules.split(",") if m]
    unknown = [m for m in modules if m not in MODULES]
    if unknown or not modules:
        ap.error(f"--modules: unknown {unknown}; choose from {MODULES}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    r = measure(modules, args.rounds)
    print(to_markdown(r))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main()
