"""torch fp8 in eager mode: the fused quantisation against the same rule as torch ops.

For each recipe, in one process, the fused path (`mpfunc_torch`'s custom ops: Triton
kernels on CUDA) against the torch-op path (what ``torch.compile`` traces, and what
eager mode ran before the custom ops):

* ``ops``: the ops one operand's quantisation dispatches, and one ``Fp8Linear``
  forward + backward (a ``TorchDispatchMode`` count; views and allocations excluded).
* ``quantize_us``: one operand (``--shape`` M,K, bfloat16: an activation) quantised
  as the layer's forward does (with the transposed copy for per-tensor recipes),
  median over ``--rounds`` rounds of ``--iters`` calls, the two paths alternating.
* ``linear_ms``: one ``Fp8Linear(K, K)`` forward + backward on that input (bf16
  autocast), the same way.
* ``first_call_s``, ``first_linear_s`` (fused): the first quantisation and the first
  forward + backward of the recipe, where Triton compiles the kernels they launch
  first (on CUDA); ``triton_compile`` lists those compiles (`triton_compile_log`).
* ``kernels`` (CUDA): the GPU kernels one operand's quantisation launches (profiler).

    python benchmarks/fp8_eager.py [--device cuda] [--shape 8192,8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mpfunc_torch
from mpfunc_torch._src.fp8 import fused as fp8_fused
from mpfunc_torch._src.fp8 import matmul as fp8_mod

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.name().startswith(("aten::empty", "aten::_unsafe_view"))):
            self.n += 1
        return func(*args, **(kwargs or {}))


class torch_ops_path:
    """The rule as torch ops in eager mode (fp8_fused.fusable says no)."""

    def __enter__(self):
        self.real = fp8_fused.fusable
        fp8_fused.fusable = lambda *t: False

    def __exit__(self, *exc):
        fp8_fused.fusable = self.real


def quantize(layer, x):
    """The forward's quantisation of the input operand."""
    if layer.recipe.block("input") is None:
        return fp8_mod._quantize_pair(x, layer, "input", layer.recipe, (), True)
    return fp8_mod._quantize(x, "input", layer.recipe)


def linear_step(layer, x, device):
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()


def timed(fn, sync, iters):
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def bench(recipe, args, device):
    m, k = args.shape
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    layer = mpfunc_torch.Fp8Linear(k, k, bias=False, recipe=recipe, device=device)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    xg = x.detach().requires_grad_()
    row = {}
    t0 = time.perf_counter()
    quantize(layer, x)
    sync()
    row["first_call_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    linear_step(layer, xg, device)
    sync()
    row["first_linear_s"] = time.perf_counter() - t0
    for path in ("fused", "torch_ops"):
        with (torch_ops_path() if path == "torch_ops" else contextlib.nullcontext()):
            with Ops() as q:
                quantize(layer, x)
            with Ops() as lin:
                linear_step(layer, xg, device)
        row[f"ops_per_operand_{path}"], row[f"ops_per_linear_{path}"] = q.n, lin.n
    times = {p: {"q": [], "lin": []} for p in ("fused", "torch_ops")}
    for r in range(args.rounds):
        for path in (("fused", "torch_ops") if r % 2 == 0 else ("torch_ops", "fused")):
            with (torch_ops_path() if path == "torch_ops" else contextlib.nullcontext()):
                times[path]["q"].append(timed(lambda: quantize(layer, x), sync, args.iters))
                times[path]["lin"].append(timed(lambda: linear_step(layer, xg, device), sync,
                                                max(1, args.iters // 4)))
    for path, t in times.items():
        row[f"quantize_us_{path}"] = statistics.median(t["q"]) * 1e6
        row[f"linear_ms_{path}"] = statistics.median(t["lin"]) * 1e3
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            quantize(layer, x)
            sync()
        row["kernels"] = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return row


def triton_compile_log() -> dict:
    """Records the compiles of mpfunc's fp8 Triton kernels (Triton's compilation
    listener; the previous listener, if any, still runs)."""
    log = {"seconds": 0.0, "kernels": []}
    try:
        from triton import knobs
    except ImportError:
        return log
    previous = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        name = str(metadata.get("name", getattr(getattr(src, "fn", None), "__name__", "")))
        if "_kernel" in name and name.lstrip("_").startswith(("cast_per", "quantize_bl",
                                                               "record_amax")):
            log["kernels"].append({"name": name, "seconds": times.total / 1e6,
                                   "cache_hit": bool(cache_hit)})
            log["seconds"] += times.total / 1e6
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                     cache_hit=cache_hit)

    knobs.compilation.listener = listener
    return log


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="8192,8192", help="M,K of the quantised activation")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.shape = tuple(int(s) for s in args.shape.split(","))
    recipes = [r for r in args.recipes.split(",") if r]
    bad = sorted(set(recipes) - set(RECIPES))
    if bad or len(args.shape) != 2:
        ap.error(f"--recipes: unknown {bad}" if bad else "--shape: expected M,K")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible to torch")
    device = torch.device(args.device)
    compiles = triton_compile_log() if device.type == "cuda" else None
    rows = {r: bench(r, args, device) for r in recipes}
    name = torch.cuda.get_device_name() if device.type == "cuda" else (
        platform.processor() or platform.machine())
    lines = [f"device: {name}, torch {torch.__version__}, shape {args.shape}",
             "| recipe | ops/operand fused (torch ops) | ops/Linear fwd+bwd fused (torch ops) "
             "| quantize us fused (torch ops) | Linear ms fused (torch ops) | first call s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r, row in rows.items():
        lines.append(
            f"| {r} | {row['ops_per_operand_fused']} ({row['ops_per_operand_torch_ops']}) | "
            f"{row['ops_per_linear_fused']} ({row['ops_per_linear_torch_ops']}) | "
            f"{row['quantize_us_fused']:.1f} ({row['quantize_us_torch_ops']:.1f}) | "
            f"{row['linear_ms_fused']:.3f} ({row['linear_ms_torch_ops']:.3f}) | "
            f"{row['first_call_s']:.2f} |")
    out = {"fp8_eager": rows, "device": name, "torch": torch.__version__,
           "shape": list(args.shape), "markdown": "\n".join(lines),
           "command": " ".join(["fp8_eager.py", *(argv if argv is not None else sys.argv[1:])]),
           "triton_compile": compiles}
    if compiles and compiles["kernels"]:
        out["markdown"] += (f"\n\nTriton compiled {len(compiles['kernels'])} fp8 kernels in "
                            f"{compiles['seconds']:.2f} s.")
    print(out["markdown"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
