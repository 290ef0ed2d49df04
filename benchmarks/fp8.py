"""fp8 against bf16: training-step throughput in torch (eager and compiled) and JAX (jit).

The model: 4 x ``Linear(d, d, bias=False)`` + GELU, batch ``B``, AdamW, one
forward + backward + optimizer step through ``convert_to_amp(mode="bf16")`` against
``mode="fp8"`` in each recipe (``mpfunc_torch`` and ``mpfunc``). TFLOP/s counts the three
GEMMs of each layer: 4 layers x 3 GEMMs x 2·B·d² flops. Each variant runs its warm-up
steps (compiling), then ``--steps`` timed steps, each synchronised; the median is
reported. ``speed_vs_bf16`` compares like with like: eager fp8 with eager bf16, compiled
with compiled (``<recipe>_compiled``), jitted JAX with jitted JAX bf16.

    python benchmarks/fp8.py --device cuda [--sizes 4096,8192,16384] [--batch 8192]
        [--steps 20] [--time-budget 1500] [--out fp8.json]
    python benchmarks/fp8.py --quick          # a tiny CPU run (seconds): a smoke test

JSON: ``{"fp8": {framework: {recipe: {d: {"speed_vs_bf16", "tflops", "step_ms", ...}}}},
"markdown": table, "skipped": [...], ...}``. Variants not started because the time
budget ran out, or that ran out of memory, are listed in ``skipped``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

# JAX shares the GPU with torch here: without this it takes 75% of the memory at import.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import mpfunc_torch  # noqa: E402

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
LAYERS = 4


def flops_per_step(d: int, batch: int) -> float:
    return LAYERS * 3 * 2.0 * batch * d * d


def _median_step_s(step, sync, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------- torch
def torch_variant(d, batch, recipe, compiled, device, backend, threads=None):
    """A step function of the model in ``mode="bf16"`` (recipe None) or ``"fp8"``."""
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(d, d, bias=False), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=device.type == "cuda")
    mode, cfg = ("bf16", {}) if recipe is None else ("fp8", {"recipe": recipe})
    model, aopt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode=mode,
                                                    **cfg)
    if compiled:
        model = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(batch, d, device=device)
    target = torch.zeros(batch, d, device=device)

    def step():
        aopt.zero_grad()
        aopt.backward(crit(model(x), target))
        aopt.step()

    return step


def run_torch(d, batch, recipe, compiled, args):
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step = torch_variant(d, batch, recipe, compiled, device, args.compile_backend)
    try:
        return _median_step_s(step, sync, args.warmup, args.steps)
    finally:
        del step
        _free_torch()


def _free_torch():
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- JAX
def jax_variant(d, batch, recipe, device):
    """A jitted step of the same model through ``mpfunc.convert_to_amp``."""
    import jax
    import jax.numpy as jnp
    import optax

    import mpfunc

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    keys = jax.random.split(jax.random.key(0), LAYERS + 1)
    params = {f"w{i}": jax.random.normal(keys[i], (d, d), jnp.float32) / d**0.5
              for i in range(LAYERS)}

    def apply(p, x):
        for i in range(LAYERS):
            x = jax.nn.gelu(x @ p[f"w{i}"])
        return x

    mode, cfg = ("bf16", {}) if recipe is None else ("fp8", {"recipe": recipe})
    amp = mpfunc.convert_to_amp(apply, optax.adamw(1e-4), mode=mode, **cfg)
    x = jax.device_put(jax.random.normal(keys[-1], (batch, d), jnp.float32), dev)
    params = jax.device_put(amp.cast_params(params), dev)
    delayed = recipe == "delayed"
    # Committed to the device like the step's outputs, so the second step does not
    # compile again.
    carry = jax.device_put([params, amp.optimizer.init(params),
                            amp.apply_fn.init(params, x) if delayed else None], dev)

    def loss_fn(p, s, x):
        out = amp.apply_fn(p, x, fp8_state=s) if delayed else amp.apply_fn(p, x)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    def train(p, o, s, x):
        if delayed:
            g, s = jax.grad(loss_fn, argnums=(0, 1))(p, s, x)
        else:
            g = jax.grad(loss_fn)(p, s, x)
        updates, o = amp.optimizer.update(g, o, p)
        return optax.apply_updates(p, updates), o, s

    jitted = jax.jit(train, donate_argnums=(0, 1, 2))

    def step():
        carry[:] = jitted(*carry, x)

    def sync():
        jax.block_until_ready(carry)

    return step, sync


def run_jax(d, batch, recipe, compiled, args):
    del compiled  # always jitted
    import jax

    step, sync = jax_variant(d, batch, recipe, args.device)
    try:
        return _median_step_s(step, sync, args.warmup, args.steps)
    finally:
        del step, sync
        gc.collect()
        jax.clear_caches()


# ------------------------------------------------------------------------- driver
def _is_oom(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "RESOURCE_EXHAUSTED" in text or (
        "out of memory" in text.lower())


def variants(args):
    """(framework, recipe key, recipe or None, compiled) in the order they run."""
    for fw in args.frameworks:
        compiled_too = fw == "torch" and not args.no_compile
        for compiled in ((False, True) if compiled_too else (False,)):
            suffix = "_compiled" if compiled else ""
            yield fw, "bf16" + suffix, None, compiled
            for r in args.recipes:
                yield fw, r + suffix, r, compiled


def run(args) -> dict:
    results: dict = {}
    skipped: list[dict] = []
    start = time.perf_counter()
    runners = {"torch": run_torch, "jax": run_jax}
    for d in args.sizes:
        for fw, key, recipe, compiled in variants(args):
            name = f"{fw}/{key}/{d}"
            if time.perf_counter() - start > args.time_budget:
                skipped.append({"variant": name, "reason": "time budget"})
                continue
            try:
                step_s = runners[fw](d, args.batch, recipe, compiled, args)
            except Exception as e:  # noqa: BLE001 - out of memory is a result here
                if not _is_oom(e):
                    raise
                _free_torch()
                skipped.append({"variant": name, "reason": "out of memory"})
                print(f"{name}: out of memory", flush=True)
                continue
            row = {"step_ms": step_s * 1e3,
                   "tflops": flops_per_step(d, args.batch) / step_s / 1e12,
                   "baseline": "bf16_compiled" if compiled else "bf16"}
            results.setdefault(fw, {}).setdefault(key, {})[str(d)] = row
            print(f"{name}: {row['step_ms']:.2f} ms/step, {row['tflops']:.3g} TFLOP/s",
                  flush=True)
    for rows in results.values():
        for by_d in rows.values():
            for d, row in by_d.items():
                base = rows.get(row["baseline"], {}).get(d)
                row["speed_vs_bf16"] = (base["step_ms"] / row["step_ms"]) if base else None
    return {"fp8": results, "skipped": skipped}


def to_markdown(r: dict) -> str:
    lines = ["| framework | variant | d | step (ms) | TFLOP/s | vs bf16 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for fw, rows in r["fp8"].items():
        for key, by_d in rows.items():
            for d, row in by_d.items():
                ratio = row["speed_vs_bf16"]
                lines.append(f"| {fw} | {key} | {d} | {row['step_ms']:.2f} | "
                             f"{row['tflops']:.3g} | "
                             f"{'n/a' if ratio is None else f'{ratio:.2f}x'} |")
    for s in r["skipped"]:
        lines.append(f"| skipped | {s['variant']} | | | | {s['reason']} |")
    return "\n".join(lines)


def _device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--sizes", default="4096,8192,16384", help="comma-separated d")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (compiles) first")
    ap.add_argument("--time-budget", type=float, default=float("inf"),
                    help="seconds; no variant starts after it (listed in `skipped`)")
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke run: d=32, batch 16, 2 + 2 steps, aot_eager compile")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.device, args.sizes, args.batch = "cpu", "32", 16
        args.steps, args.warmup, args.compile_backend = 2, 2, "aot_eager"
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s]
    args.frameworks = [f for f in args.frameworks.split(",") if f]
    args.recipes = [r for r in args.recipes.split(",") if r]
    for name, values, valid in (("--frameworks", args.frameworks, ("torch", "jax")),
                                ("--recipes", args.recipes, RECIPES)):
        bad = sorted(set(values) - set(valid))
        if bad:
            ap.error(f"{name}: unknown {bad}; valid: {list(valid)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible to torch")
    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    r = run(args)
    r.update(device=_device_name(args.device), torch=torch.__version__,
             command=" ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
             batch=args.batch, steps=args.steps)
    if "jax" in args.frameworks:
        import jax
        r["jax"] = jax.__version__
    r["markdown"] = to_markdown(r)
    print(r["markdown"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
