"""fp8 against bf16: training-step throughput in torch (eager and compiled) and JAX (jit).

Models (``--model``, comma-separated, run in that order):

* ``linear`` (default): 4 x ``Linear(d, d, bias=False)`` + GELU, batch ``B``, AdamW, one
  forward + backward + optimizer step through ``convert_to_amp(mode="bf16")`` against
  ``mode="fp8"`` in each recipe (``mpfunc_torch`` and ``mpfunc``). TFLOP/s counts the
  three GEMMs of each layer: 4 layers x 3 GEMMs x 2·B·d² flops.
* ``gpt``: the demo's GPT-style decoder (``examples/compare_modes.py``) at ``--gpt
  WIDTH,LAYERS,CONTEXT`` (default 2048,16,2048; heads of 128), batch ``--gpt-batch``,
  on the demo's corpus; also the loss at the last step against bf16's at that step.
* ``dot``: JAX only, one ``value_and_grad`` of a d³ matmul with bfloat16 inputs, fp8
  against a bf16 baseline whose cotangent is bfloat16 too (``benchmarks/_fp8_models.py``).

Each variant runs ``--warmup`` steps (the first timed on its own, ``first_step_s``:
torch.compile's compile, the fp8 Triton kernels' JIT compile), then ``--steps`` timed
steps, each synchronised; the median is reported. JAX steps are compiled ahead
(``compile_s``). ``speed_vs_bf16`` compares like with like: eager fp8 with eager bf16,
compiled with compiled (``<recipe>_compiled``), jitted JAX with jitted JAX bf16.
``triton_compile`` lists the compiles of mpfunc's fp8 Triton kernels (seconds, and
whether Triton's on-disk cache had them).

    python benchmarks/fp8.py --device cuda [--model linear,gpt] [--sizes 4096,8192]
        [--batch 8192] [--recipes ...] [--gpt-recipes ...] [--steps 20]
        [--time-budget 1500] [--time-limit 1700] [--out fp8.json]
    python benchmarks/fp8.py --quick [--model linear,gpt,dot]   # a tiny CPU smoke run

JSON: ``{"fp8": {framework: {variant: {size: row}}}, "markdown", "skipped", ...}``;
``size`` is ``d`` for ``linear``, ``dot<d>`` and ``gpt<width>x<layers>x<context>``.
No variant starts after ``--time-budget`` s, nor where less time is left than the last
variant of its kind (model, framework, eager or compiled) took; those, and variants
that ran out of memory, are listed in ``skipped``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import signal
import statistics
import sys
import time

# JAX shares the GPU with torch here: without this it takes 75% of the memory at import.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fp8_models as models  # noqa: E402
from fp8_eager import triton_compile_log  # noqa: E402

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
MODELS = ("linear", "gpt", "dot")


def measure(variant, warmup: int, steps: int) -> dict:
    """Median step time of ``variant`` = (step(i), sync, extra), its first step's time,
    and the loss of its last step (if its steps return one)."""
    step, sync, extra = variant
    t0 = time.perf_counter()
    step(0)
    sync()
    first = time.perf_counter() - t0
    for i in range(1, warmup):
        step(i)
    sync()
    times, loss = [], None
    for i in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        loss = step(i)
        sync()
        times.append(time.perf_counter() - t0)
    row = {"step_s": statistics.median(times), "first_step_s": first, **extra}
    if loss is not None:
        row["loss"] = float(loss)
    return row


def _free_torch():
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------- driver
def _is_oom(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "RESOURCE_EXHAUSTED" in text or (
        "out of memory" in text.lower())


def variants(args):
    """(model, size, framework, recipe key, recipe or None, compiled), in run order: the
    torch eager variants of every model first, then the compiled ones, then JAX."""
    runs = [("torch", False), ("torch", True), ("jax", False)]
    for fw, compiled in runs:
        if fw not in args.frameworks or (compiled and args.no_compile) or (
                fw == "torch" and not compiled and args.compiled_only):
            continue
        for model in args.model:
            if model == "dot" and fw != "jax":
                continue
            suffix = "_compiled" if compiled else ""
            recipes = args.gpt_recipes if model == "gpt" else args.recipes
            for size in ([None] if model == "gpt" else args.sizes):
                yield model, size, fw, "bf16" + suffix, None, compiled
                for r in recipes:
                    yield model, size, fw, r + suffix, r, compiled


def _size_key(model, size, gpt):
    if model == "gpt":
        return f"gpt{gpt.width}x{gpt.layers}x{gpt.context}"
    return f"dot{size}" if model == "dot" else str(size)


def run_variant(model, size, fw, recipe, compiled, args) -> dict:
    device = torch.device(args.device)
    if model == "linear" and fw == "torch":
        v = models.torch_linear(size, args.batch, recipe, compiled, device,
                                args.compile_backend)
    elif model == "linear":
        v = models.jax_linear(size, args.batch, recipe, args.device)
    elif model == "gpt" and fw == "torch":
        v = models.torch_gpt(args.gpt, recipe, compiled, device, args.compile_backend)
    elif model == "gpt":
        v = models.jax_gpt(args.gpt, recipe, args.device)
    else:
        v = models.jax_dot(size, recipe, args.device)
    try:
        return measure(v, args.warmup, args.steps)
    finally:
        del v
        _free_torch()
        if fw == "jax":
            import jax

            jax.clear_caches()


def _flops(model, size, args):
    if model == "gpt":
        return models.gpt_flops(args.gpt)
    return 3 * 2.0 * size**3 if model == "dot" else models.linear_flops(size, args.batch)


class TimeLimit(Exception):
    """Raised in the main thread when ``--time-limit`` seconds have passed while a
    variant runs (between variants, the next one just does not start)."""


_CLOCK = {"passed": False, "running": False}


def _on_alarm(signum, frame):
    _CLOCK["passed"] = True
    if _CLOCK["running"]:
        _CLOCK["running"] = False
        raise TimeLimit


def run(args, save=lambda r: None) -> dict:
    results: dict = {}
    skipped: list[dict] = []
    took: dict = {}  # the last duration of each kind of variant
    start = time.perf_counter()
    _CLOCK.update(passed=False, running=False)
    if args.time_limit:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, args.time_limit)
    try:
        for model, size, fw, key, recipe, compiled in variants(args):
            skey = _size_key(model, size, args.gpt)
            name = f"{fw}/{key}/{skey}"
            kind = (model, fw, compiled)
            left = args.time_budget - (time.perf_counter() - start)
            if _CLOCK["passed"] or left <= 0 or left < took.get(kind, 0):
                skipped.append({"variant": name, "reason": "time limit" if _CLOCK["passed"]
                                else "time budget"})
                continue
            t0 = time.perf_counter()
            try:
                _CLOCK["running"] = True
                row = run_variant(model, size, fw, recipe, compiled, args)
            except TimeLimit:
                _free_torch()
                skipped.append({"variant": name, "reason": "time limit (stopped in it)"})
                continue
            except Exception as e:  # noqa: BLE001 - out of memory is a result here
                if not _is_oom(e):
                    raise
                _free_torch()
                skipped.append({"variant": name, "reason": "out of memory"})
                print(f"{name}: out of memory", flush=True)
                continue
            finally:
                _CLOCK["running"] = False
                took[kind] = time.perf_counter() - t0
            step_s = row.pop("step_s")
            row.update(step_ms=step_s * 1e3, tflops=_flops(model, size, args) / step_s / 1e12,
                       baseline="bf16_compiled" if compiled else "bf16")
            results.setdefault(fw, {}).setdefault(key, {})[skey] = row
            print(f"{name}: {row['step_ms']:.2f} ms/step, {row['tflops']:.3g} TFLOP/s"
                  + (f", loss {row['loss']:.4f}" if "loss" in row else ""), flush=True)
            save(_compared(results, skipped))
    finally:
        if args.time_limit:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return _compared(results, skipped)


def _compared(results, skipped) -> dict:
    """Each row's speed (and loss) against its bf16 baseline of the same size."""
    for rows in results.values():
        for by_size in rows.values():
            for skey, row in by_size.items():
                base = rows.get(row["baseline"], {}).get(skey)
                row["speed_vs_bf16"] = (base["step_ms"] / row["step_ms"]) if base else None
                if "loss" in row:
                    row["loss_vs_bf16"] = ((row["loss"] - base["loss"]) / base["loss"]
                                           if base else None)
    return {"fp8": results, "skipped": skipped}


def to_markdown(r: dict) -> str:
    lines = ["| framework | variant | size | step (ms) | TFLOP/s | vs bf16 | first step or "
             "compile (s) | loss (vs bf16) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for fw, rows in r["fp8"].items():
        for key, by_size in rows.items():
            for skey, row in by_size.items():
                ratio = row["speed_vs_bf16"]
                first = row.get("compile_s", row["first_step_s"])
                loss = (f"{row['loss']:.4f} ({row['loss_vs_bf16']:+.2%})"
                        if row.get("loss_vs_bf16") is not None else
                        (f"{row['loss']:.4f}" if "loss" in row else ""))
                lines.append(f"| {fw} | {key} | {skey} | {row['step_ms']:.2f} | "
                             f"{row['tflops']:.3g} | "
                             f"{'n/a' if ratio is None else f'{ratio:.2f}x'} | {first:.2f} | "
                             f"{loss} |")
    for s in r["skipped"]:
        lines.append(f"| skipped | {s['variant']} | | | | {s['reason']} | | |")
    tc = r.get("triton_compile")
    if tc and tc["kernels"]:
        lines.append(f"\nmpfunc's fp8 Triton kernels: {len(tc['kernels'])} compiled in "
                     f"{tc['seconds']:.2f} s ({sum(k['cache_hit'] for k in tc['kernels'])} "
                     "from Triton's cache).")
    return "\n".join(lines)


def _device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def _ints(text, name, ap, n=None):
    try:
        values = [int(s) for s in str(text).split(",") if s]
    except ValueError:
        values = []
    if not values or (n and len(values) != n) or min(values) < 1:
        ap.error(f"{name}: expected {n or 'one or more'} comma-separated positive ints, "
                 f"got {text!r}")
    return values


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="linear", help=f"comma-separated, from {list(MODELS)}")
    ap.add_argument("--sizes", default="4096,8192,16384", help="comma-separated d")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--gpt", default="2048,16,2048", help="WIDTH,LAYERS,CONTEXT")
    ap.add_argument("--gpt-batch", type=int, default=4)
    ap.add_argument("--gpt-recipes", default=None, help="the GPT's recipes (default: --recipes)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (compiles) first")
    ap.add_argument("--time-budget", type=float, default=float("inf"),
                    help="seconds; no variant starts after it, nor where less is left than "
                    "the last of its kind took (listed in `skipped`)")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="seconds; the variant still running then is stopped, and the "
                    "results so far written (0: none)")
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    ap.add_argument("--compiled-only", action="store_true",
                    help="torch: only the compiled variants (JAX's run as asked)")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke run: d=32, batch 16, GPT 32,2,16 batch 2, 2 + 2 steps, "
                         "aot_eager compile")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.device, args.sizes, args.batch = "cpu", "32", 16
        args.gpt, args.gpt_batch = "32,2,16", 2
        args.steps, args.warmup, args.compile_backend = 2, 2, "aot_eager"
    args.sizes = _ints(args.sizes, "--sizes", ap)
    width, layers, context = _ints(args.gpt, "--gpt", ap, 3)
    args.model = [m for m in args.model.split(",") if m]
    args.frameworks = [f for f in args.frameworks.split(",") if f]
    args.recipes = [r for r in args.recipes.split(",") if r]
    args.gpt_recipes = (args.recipes if args.gpt_recipes is None else
                        [r for r in args.gpt_recipes.split(",") if r])
    for name, values, valid in (("--model", args.model, MODELS),
                                ("--frameworks", args.frameworks, ("torch", "jax")),
                                ("--recipes", args.recipes, RECIPES),
                                ("--gpt-recipes", args.gpt_recipes, RECIPES)):
        bad = sorted(set(values) - set(valid))
        if bad:
            ap.error(f"{name}: unknown {bad}; valid: {list(valid)}")
    args.gpt = models.gpt_config(width, layers, context, args.gpt_batch,
                                 args.warmup + args.steps)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible to torch")
    if args.no_compile and args.compiled_only:
        ap.error("--no-compile and --compiled-only leave no torch variant: pick one")
    compiles = triton_compile_log() if args.device == "cuda" else {"seconds": 0.0,
                                                                    "kernels": []}
    meta = dict(device=_device_name(args.device), torch=torch.__version__,
                command=" ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
                batch=args.batch, gpt=vars(args.gpt), steps=args.steps,
                triton_compile=compiles)

    def save(r):  # after every variant too: a run stopped from outside keeps its rows
        r.update(meta)
        if "jax" in args.frameworks and "jax" in sys.modules:
            r["jax"] = sys.modules["jax"].__version__
        r["markdown"] = to_markdown(r)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(r, f, indent=2)
        return r

    r = save(run(args, save))
    print(r["markdown"])
    return r


if __name__ == "__main__":
    main()
