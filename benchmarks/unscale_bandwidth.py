"""Achieved bandwidth of the fused unscale-and-check pass vs a plain copy.

torch: ``torch._amp_foreach_non_finite_check_and_unscale_`` (through mpfunc_torch's
wrapper) over a list of gradient tensors, against ``torch._foreach_copy_`` of the same
bytes; both read and write every element once. JAX: the jitted unscale + all_finite of
``mpfunc.dynamic_scale`` (multiply to float32 and reduce), against a jitted copy
(``x * 1``) of the same tree. Reports GB/s and the ratio to the copy.

    python benchmarks/unscale_bandwidth.py [--mib 256] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def bench(fn, sync, reps):
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_part(mib, device, reps):
    import torch

    from mpfunc_torch._src import fused

    dev = torch.device(device)
    n = mib * 2**20 // 4
    sizes = [n // 64] * 64  # 64 gradient tensors
    grads = [torch.randn(s, device=dev) for s in sizes]
    dst = [torch.empty_like(g) for g in grads]
    found = torch.zeros((), device=dev)
    inv = torch.ones((), device=dev)
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    t_unscale = bench(lambda: fused.unscale_and_check_(grads, found, inv), sync, reps)
    t_copy = bench(lambda: torch._foreach_copy_(dst, grads), sync, reps)
    nbytes = 2 * sum(g.numel() * 4 for g in grads)  # read + write
    return {"unscale_GBps": nbytes / t_unscale / 1e9, "copy_GBps": nbytes / t_copy / 1e9,
            "fraction_of_copy": t_copy / t_unscale}


def jax_part(mib, device, reps):
    import jax
    import jax.numpy as jnp

    from mpfunc._src.loss_scale import _unscale, all_finite

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    n = mib * 2**20 // 4
    tree = [jax.device_put(jnp.ones((n // 64,), jnp.float32), dev) for _ in range(64)]
    inv = jnp.float32(0.5)

    @jax.jit
    def unscale_check(t):
        g = _unscale(t, inv)
        return g, all_finite(g)

    copy = jax.jit(lambda t: [x * 1.0 for x in t])
    t_u = bench(lambda: jax.block_until_ready(unscale_check(tree)), lambda: None, reps)
    t_c = bench(lambda: jax.block_until_ready(copy(tree)), lambda: None, reps)
    nbytes = 2 * sum(x.nbytes for x in tree)
    return {"unscale_GBps": nbytes / t_u / 1e9, "copy_GBps": nbytes / t_c / 1e9,
            "fraction_of_copy": t_c / t_u}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    r = {"MiB": args.mib, "device": args.device,
         "torch": torch_part(args.mib, args.device, args.reps),
         "jax": jax_part(args.mib, args.device, args.reps)}
    lines = [f"{args.mib} MiB of float32 gradients in 64 tensors on {args.device}; median of "
             f"{args.reps}.", "", "| framework | unscale+check GB/s | copy GB/s | fraction of copy |",
             "| --- | --- | --- | --- |"]
    for fw in ("torch", "jax"):
        x = r[fw]
        lines.append(f"| {fw} | {x['unscale_GBps']:.1f} | {x['copy_GBps']:.1f} | "
                     f"{x['fraction_of_copy']:.2f} |")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
