"""XLA:GPU compile time of the demo's step and of an 8192^3 fp8 dot, per compiler option.

On one H200 (2026-11-27) the demo's first JAX compile (12 layers, width 768) had not
returned after 160 s, and one 8192^3 fp8 ``value_and_grad`` took 59.6 s to compile (bf16:
2.6 s). This script compiles, under each set of XLA compiler options passed per compile
(``.compile(compiler_options=...)``; the sets are ``_jax_compiles.XLA_OPTION_SETS``:
XLA's defaults, Triton GEMMs off, the fusion autotuner off, autotuning off):

* the demo's train step (``examples/compare_modes.py``'s ``run_jax``: the same model,
  init, mode and step), at 12 layers, width 768, context 512, batch 8, in every mode,
  scanned (stacked block params under ``jax.lax.scan``) and unrolled;
* ``jax.value_and_grad`` of ``mpfunc.fp8_dot(x, w, "tensorwise")`` (bf16 inputs, 8192
  cubed) and its fair bf16 baseline ``jnp.dot(x, w).astype(f32).sum()`` (the cotangent
  stays bf16, as on the fp8 path); the HLO's fp8 cuBLAS calls and Triton GEMM fusions
  are counted.

Each row records the step's cold compile (lower + XLA compile, the persistent cache
empty), its warm compile (again after ``jax.clear_caches()``, loaded from the cache
folder), the evaluation step's compile (demo rows) and the step time. An option set runs
in child processes of its own, each with a time box and an empty cache folder, so a hang
loses one child's remaining rows, not the run (rows are written as they finish). Within
one child, rows after the first reuse XLA's in-process autotuning results for GEMMs of
the same shapes (as the demo's runs do). An option the installed jaxlib does not know is
reported for its set, not fatal.

The work comes in priority order under ``--time-budget`` (default 235 s on a GPU: it
fits `make gpu`'s 4-minute box): first, per option set, the dots and the scanned fp32,
bf16 and fp8 steps; then the other scanned modes; then the unrolled steps. What does not
fit is a row with status "not run" and the reason. ``--xla-vlog`` sets ``TF_CPP_VMODULE``
for XLA's GPU compiler and autotuners in the children, whose logs go to ``--logs``.

    python benchmarks/jax_gpu_compile.py --device cuda [--json F] [--logs DIR] [--xla-vlog]
    python benchmarks/jax_gpu_compile.py                # CPU, tiny sizes: a pipeline check
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

from _jax_compiles import XLA_OPTION_SETS, compiler_options  # noqa: E402

MODES = ["fp32", "tf32", "torch", "apex-O1", "apex-O2", "naive", "bf16", "fp8"]
FIRST = ["fp32", "bf16", "fp8"]  # the scanned steps that come first
SIZES = {"cuda": {"layers": 12, "width": 768, "heads": 12, "context": 512, "batch": 8,
                  "dot": 8192},
         "cpu": {"layers": 2, "width": 32, "heads": 2, "context": 16, "batch": 2, "dot": 64}}
# Per child: (phase, its largest box in s). Phase 1's default-options child holds the fp8
# dot that took 59.6 s under XLA's defaults on an H200.
BOX_DEFAULT_FIRST, BOX_FIRST, BOX_LATER, MIN_BOX = 110, 40, 60, 20
VMODULE = ("gpu_compiler=1,nvptx_compiler=1,gemm_fusion_autotuner=1,autotuner=1,"
           "autotuner_pass=1,fusion_autotuner=1")


# ------------------------------------------------------------------------------ child
def _emit(out, **row):
    out.write(json.dumps(row, default=float) + "\n")
    out.flush()


_PARAMS = {}  # the demo's init per form, loaded once per child


def _step_row(item, cfg, params_dir):
    """One demo train step, compiled and timed through compare_modes.run_jax."""
    import compare_modes as cm
    import numpy as np
    from _jax_compiles import CompileCounter

    form, mode = item.split("/")
    cfg.scan = form == "scanned"
    if form not in _PARAMS:
        with open(Path(params_dir) / f"{form}.pkl", "rb") as f:
            _PARAMS[form] = pickle.load(f)
    init_params = _PARAMS[form]
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, cm.VOCAB, (cfg.batch, cfg.context)),
                rng.integers(0, cm.VOCAB, (cfg.batch, cfg.context))) for _ in range(3)]
    result, timed = cm.run_jax(mode, cfg, batches[:2], batches[2:], init_params,
                               CompileCounter())
    timed(cfg.window, 0)  # warm-up
    step_s = min(timed(cfg.window, cfg.window * (r + 1)) for r in range(2)) / cfg.window
    rec = result["compile"]
    return {"first": rec["first"], "warm": rec["warm"], "cold_s": rec["cold_s"],
            "warm_s": rec["warm_s"], "eval_compile_s": result["eval_compile_s"],
            "step_ms": step_s * 1e3, "loss": float(result["losses"][-1])}


def _dot_row(item, cfg):
    """value_and_grad of one fp8 (or bf16) dot, 2 x n^3 x 3 FLOP (59.6 s to compile on an
    H200 in fp8)."""
    import jax
    import jax.numpy as jnp
    from _jax_compiles import compile_cold_warm

    import mpfunc

    n, kind = cfg.dot, item.split("/")[1]
    dev = jax.devices("gpu" if cfg.device == "cuda" else "cpu")[0]
    x = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16), dev)
    w = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16), dev)

    def fp8(x, w):
        return mpfunc.fp8_dot(x, w, "tensorwise").astype(jnp.float32).sum()

    def bf16(x, w):  # the cotangent stays bf16, as fp8_dot's does
        return jnp.dot(x, w).astype(jnp.float32).sum()

    fn = jax.value_and_grad(fp8 if kind == "fp8" else bf16, argnums=(0, 1))
    fn.__name__ = f"dot_{kind}"
    compiled, rec = compile_cold_warm(lambda: jax.jit(fn).lower(x, w),
                                      compiler_options=cfg.xla_options)
    hlo = compiled.as_text()
    jax.block_until_ready(compiled(x, w))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(cfg.window):
            res = compiled(x, w)
        jax.block_until_ready(res)
        times.append((time.perf_counter() - t0) / cfg.window)
    step_s = min(times)
    return {"first": rec["first"], "warm": rec["warm"], "cold_s": rec["cold_s"],
            "warm_s": rec["warm_s"], "step_ms": step_s * 1e3,
            "tflops": 6 * n**3 / step_s / 1e12,
            "fp8_gemm_calls": hlo.count("__cublas$lt$matmul$f8"),
            "triton_gemm_fusions": hlo.count('"kind":"__triton_gemm"')}


def child(args):
    """Runs ``args.items`` in order under one option set, one JSON line per event."""
    from _jax_compiles import use_compile_cache

    use_compile_cache(args.cache_dir)  # None: off
    cfg = argparse.Namespace(**json.loads(args.cfg))
    cfg.xla_options = compiler_options(args.options_text)
    with open(args.rows, "a") as out:
        for item in args.items.split(","):
            _emit(out, event="start", item=item, t=time.time())
            try:
                row = (_dot_row(item, cfg) if item.startswith("dot/")
                       else _step_row(item, cfg, args.params))
            except Exception as e:  # noqa: BLE001 - reported per row, as the doc says
                msg = f"{type(e).__name__}: {e}"
                unknown = "No such compile option" in str(e)
                _emit(out, event="error", item=item, error=msg[:2000], unknown_option=unknown)
                if unknown:  # every later row of this set fails the same way
                    return 0
                continue
            _emit(out, event="done", item=item, **row)
    return 0


# ----------------------------------------------------------------------------- parent
def plan(option_sets, modes, forms, cpu):
    """[(phase, option set, [items])] in the order they run."""
    modes = [m for m in modes if not (cpu and m == "tf32")]  # no TF32 on a CPU
    first = [f"dot/{k}" for k in ("bf16",)] + [
        f"scanned/{m}" for m in FIRST if m in modes and "scanned" in forms] + ["dot/fp8"]
    later_scanned = [f"scanned/{m}" for m in modes if m not in FIRST and "scanned" in forms]
    unrolled = [f"unrolled/{m}" for m in modes if "unrolled" in forms]
    jobs = [(1, name, first) for name in option_sets]
    jobs += [(2, name, later_scanned) for name in option_sets if later_scanned]
    jobs += [(3, name, unrolled) for name in option_sets if unrolled]
    return [j for j in jobs if j[2]]


def demo_params(size, seed, forms):
    """The demo's init (torch's, converted) in each form, pickled once for the children."""
    import compare_modes as cm

    cfg = argparse.Namespace(**{k: size[k] for k in ("layers", "width", "heads", "context")},
                             seed=seed)
    model = cm.torch_model(cfg)
    params, not_run = {}, {}
    for form in forms:
        try:
            params[form] = cm.torch_to_jax_params(model, stacked=form == "scanned")
        except TypeError:  # a compare_modes without the stacked (scanned) form
            if form == "scanned":
                not_run[form] = "examples/compare_modes.py has no scanned model"
            else:
                params[form] = cm.torch_to_jax_params(model)
    return params, not_run


def run_child(job, args, files, box, env):
    phase, options, items = job
    rows_file = files["dir"] / f"rows-{phase}-{options}.jsonl"
    log = files["logs"] / f"jax_gpu_compile-{phase}-{options}.log"
    cache = None if args.no_compile_cache else str(files["dir"] / f"cache-{phase}-{options}")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--options", options,
           "--options-text", args.option_texts[options], "--items", ",".join(items),
           "--rows", str(rows_file), "--params", str(files["params"]),
           "--cfg", json.dumps(files["cfg"])] + (["--cache-dir", cache] if cache else [])
    t0 = time.perf_counter()
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=box)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timeout"
    wall = time.perf_counter() - t0
    events = [json.loads(ln) for ln in rows_file.read_text().splitlines()] \
        if rows_file.exists() else []
    rows = {}
    for ev in events:
        rows[ev["item"]] = ev
    out = []
    for item in items:
        ev = rows.get(item)
        base = {"options": options, "item": item, "phase": phase}
        if ev is None:
            why = (f"time box ({box:.0f} s) ran out first" if rc == "timeout" else
                   f"the child exited {rc} before it (log: {log.name})")
            out.append({**base, "status": "not run", "reason": why})
        elif ev["event"] == "start":
            why = (f"still compiling or running at the child's {box:.0f} s time box"
                   if rc == "timeout" else f"the child exited {rc} in it (log: {log.name})")
            out.append({**base, "status": "timeout" if rc == "timeout" else "failed",
                        "reason": why})
        elif ev["event"] == "error":
            out.append({**base, "status": "unknown option" if ev["unknown_option"]
                        else "failed", "reason": ev["error"]})
        else:
            out.append({**base, "status": "ok",
                        **{k: v for k, v in ev.items() if k not in ("event", "item")}})
    if any(r["status"] == "unknown option" for r in out):
        for r in out:
            if r["status"] == "not run":
                r.update(status="unknown option", reason="the set's options are unknown "
                         "to this jaxlib (see its first row)")
    return out, {"options": options, "phase": phase, "box_s": box, "wall_s": round(wall, 2),
                 "exit": rc, "log": log.name}


def measure(args):
    started = time.perf_counter()
    size = dict(SIZES[args.device])
    size.update({k: getattr(args, k) for k in size if getattr(args, k) is not None})
    forms = args.forms.split(",")
    work = Path(tempfile.mkdtemp(prefix="mpfunc-jax-gpu-compile-"))
    logs = Path(args.logs) if args.logs else work
    logs.mkdir(parents=True, exist_ok=True)
    try:
        params, not_run_forms = demo_params(size, 0, forms)
        for form, tree in params.items():
            with open(work / f"{form}.pkl", "wb") as f:
                pickle.dump(tree, f)
        del params
        cfg = {**size, "lr": 3e-3, "seed": 0, "device": args.device, "steps": 2,
               "quiet": True, "window": args.window}
        files = {"dir": work, "logs": logs, "params": work, "cfg": cfg}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        if args.device == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
        if args.xla_vlog:
            env.update(TF_CPP_VMODULE=VMODULE, TF_CPP_MIN_LOG_LEVEL="0")
        jobs = plan(list(args.option_texts), args.modes.split(","),
                    [f for f in forms if f not in not_run_forms], args.device == "cpu")
        rows, children = [], []
        for form, why in not_run_forms.items():
            rows += [{"options": o, "item": f"{form}/{m}", "status": "not run", "reason": why}
                     for o in args.option_texts for m in args.modes.split(",")]
        unknown = set()  # option sets this jaxlib rejected: their later children are skipped
        for i, job in enumerate(jobs):
            if job[1] in unknown:
                rows += [{"options": job[1], "item": it, "phase": job[0],
                          "status": "unknown option", "reason": "the set's options are "
                          "unknown to this jaxlib (see its first row)"} for it in job[2]]
                continue
            left = args.time_budget - (time.perf_counter() - started)
            later_first = sum(1 for j in jobs[i + 1:] if j[0] == 1)
            cap = (BOX_DEFAULT_FIRST if job[1] == "default" else BOX_FIRST) if job[0] == 1 \
                else BOX_LATER
            box = min(cap, left - MIN_BOX * later_first) if args.time_budget else cap * 10
            if box < MIN_BOX:
                rows += [{"options": job[1], "item": it, "phase": job[0], "status": "not run",
                          "reason": f"time budget ({args.time_budget:.0f} s) spent"}
                         for it in job[2]]
                continue
            out, info = run_child(job, args, files, box, env)
            rows += out
            children.append(info)
            if any(r["status"] == "unknown option" for r in out):
                unknown.add(job[1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"device": device_name(args.device), "versions": versions(), "size": size,
            "option_sets": {k: compiler_options(v) for k, v in args.option_texts.items()},
            "time_budget_s": args.time_budget, "wall_s": round(time.perf_counter() - started, 1),
            "compile_cache": not args.no_compile_cache, "children": children, "rows": rows,
            "choice": choose(rows)}


def choose(rows, max_slowdown=1.03):
    """Among option sets with every measured row, the one with the least total cold
    compile whose steps are each at most ``max_slowdown`` x XLA's defaults' (the rule for
    the demo's default: a faster compile may cost at most 3% of step time); None without
    data."""
    ok = {}
    for r in rows:
        if r["status"] == "ok" and r.get("cold_s"):
            ok.setdefault(r["options"], {})[r["item"]] = r
    base = ok.get("default")
    if not base:
        return None
    scored = {}
    for name, got in ok.items():
        common = [i for i in base if i in got]
        if not common:
            continue
        slowdown = max(got[i]["step_ms"] / base[i]["step_ms"] for i in common)
        scored[name] = {"items": len(common), "cold_s": sum(got[i]["cold_s"] for i in common),
                        "default_cold_s": sum(base[i]["cold_s"] for i in common),
                        "max_step_ratio": slowdown, "within": slowdown <= max_slowdown}
    fits = [n for n, s in scored.items() if s["within"]]
    best = min(fits, key=lambda n: scored[n]["cold_s"]) if fits else "default"
    return {"rule": f"least cold compile with every step <= {max_slowdown}x default's",
            "best": best, "scores": scored}


def device_name(device):
    import jax

    d = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    return f"{d.device_kind} ({d.platform}), {platform.machine()} {os.cpu_count()} cores"


def versions():
    import jax
    import jaxlib

    return {"python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__}


def to_markdown(r):
    sets = list(r["option_sets"])
    s = r["size"]
    lines = [f"Device: {r['device']}; jax {r['versions']['jax']}. Demo step: {s['layers']} "
             f"layers, width {s['width']}, context {s['context']}, batch {s['batch']}; dots: "
             f"{s['dot']}^3 bf16 inputs. Cells: cold / warm compile (s), step (ms); "
             f"{r['wall_s']} s" + (f" of a {r['time_budget_s']:.0f} s budget."
                                   if r["time_budget_s"] else " (no time budget)."), "",
             "| row | " + " | ".join(f"{n} `{r['option_sets'][n] or '{}'}`" for n in sets) + " |",
             "| --- |" + " --- |" * len(sets)]
    cells = {(x["item"], x["options"]): x for x in r["rows"]}
    for item in dict.fromkeys(x["item"] for x in r["rows"]):
        row = []
        for n in sets:
            x = cells.get((item, n))
            if x is None:
                row.append("-")
            elif x["status"] != "ok":
                row.append(x["status"])
            else:
                warm = f"{x['warm_s']:.1f}" if x.get("warm_s") is not None else "-"
                cold = f"{x['cold_s']:.1f}" if x.get("cold_s") is not None else "hit"
                extra = (f", fp8 GEMMs {x['fp8_gemm_calls']}" if "fp8_gemm_calls" in x
                         and item == "dot/fp8" else "")
                row.append(f"{cold} / {warm} s, {x['step_ms']:.2f} ms{extra}")
        lines.append(f"| {item} | " + " | ".join(row) + " |")
    reasons = {}
    for x in r["rows"]:
        if x["status"] != "ok":
            reasons.setdefault(f"{x['status']}: {x.get('reason', '')}"[:300], []).append(
                f"{x['options']} {x['item']}")
    for why, where in reasons.items():
        lines.append(f"\n- {why} ({len(where)}: {', '.join(where[:6])}"
                     f"{', ...' if len(where) > 6 else ''})")
    if r.get("choice"):
        c = r["choice"]
        lines.append(f"\nComputed choice ({c['rule']}): **{c['best']}**")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: tiny sizes, a check of the pipeline, not a measurement")
    ap.add_argument("--options", default=",".join(XLA_OPTION_SETS),
                    help=f"option sets from {list(XLA_OPTION_SETS)}, comma-separated")
    ap.add_argument("--extra-options", action="append", default=[], metavar="NAME:k=v;k=v",
                    help="one more option set (xla_name=value pairs separated by ';')")
    ap.add_argument("--modes", default=",".join(MODES), help=f"from {MODES}")
    ap.add_argument("--forms", default="scanned,unrolled")
    for k in ("layers", "width", "heads", "context", "batch", "dot"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--window", type=int, default=5, help="steps per timing round")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole run (default: 235 on a GPU, 0 = no limit "
                    "on CPU)")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="no persistent cache in the children (no warm figure)")
    ap.add_argument("--xla-vlog", action="store_true", help="XLA GPU compiler logs")
    ap.add_argument("--logs", default=None, help="folder for the children's logs")
    ap.add_argument("--json", default=None, help="also write the result here")
    for hidden in ("--options-text", "--items", "--rows", "--params", "--cfg", "--cache-dir"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    texts = {}
    for name in filter(None, args.options.split(",")):
        if name not in XLA_OPTION_SETS:
            ap.error(f"--options: unknown set {name!r}; choose from {list(XLA_OPTION_SETS)}")
        texts[name] = name
    for spec in args.extra_options:
        name, _, pairs = spec.partition(":")
        try:
            compiler_options(pairs.replace(";", ","))
        except ValueError as e:
            ap.error(f"--extra-options {spec!r}: {e}")
        texts[name] = pairs.replace(";", ",")
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad or not set(args.forms.split(",")) <= {"scanned", "unrolled"}:
        ap.error(f"--modes from {MODES} and --forms from scanned,unrolled; got {bad or args.forms}")
    args.option_texts = texts
    if args.time_budget is None:
        args.time_budget = 235.0 if args.device == "cuda" else 0.0
    r = measure(args)
    r["markdown"] = to_markdown(r)
    print(r["markdown"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=1, default=float))
    return r


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
