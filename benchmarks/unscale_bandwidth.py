"""Achieved bandwidth of the fused unscale-and-check pass vs a plain copy.

torch: ``torch._amp_foreach_non_finite_check_and_unscale_`` (through mpfunc_torch's
wrapper) over a list of gradient tensors, against ``torch._foreach_copy_`` of the same
bytes; both read and write every element once. JAX: the jitted unscale + all_finite of
``mpfunc.dynamic_scale`` (multiply to float32 and reduce), against a jitted copy
(``x * 1``) of the same tree. Reports GB/s and the ratio to the copy.

Both are also set against the device's own copy bandwidth: one device-to-device copy of
a single buffer of the same bytes (torch ``Tensor.copy_``; JAX a jitted ``jnp.copy``,
whose compiled HLO is checked to hold a real copy: with the input donated XLA would alias
it and copy nothing). ``fraction_of_device_copy`` is that copy's time over unscale's.

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
    flat_src = torch.randn(sum(sizes), device=dev)
    flat_dst = torch.empty_like(flat_src)
    found = torch.zeros((), device=dev)
    inv = torch.ones((), device=dev)
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    t_unscale = bench(lambda: fused.unscale_and_check_(grads, found, inv), sync, reps)
    t_copy = bench(lambda: torch._foreach_copy_(dst, grads), sync, reps)
    t_dev = bench(lambda: flat_dst.copy_(flat_src), sync, reps)
    nbytes = 2 * sum(g.numel() * 4 for g in grads)  # read + write
    assert nbytes == 2 * flat_src.numel() * 4
    return {"unscale_GBps": nbytes / t_unscale / 1e9, "copy_GBps": nbytes / t_copy / 1e9,
            "fraction_of_copy": t_copy / t_unscale,
            "device_copy": "torch.Tensor.copy_ of one buffer",
            "device_copy_GBps": nbytes / t_dev / 1e9, "fraction_of_device_copy": t_dev / t_unscale}


def jax_part(mib, device, reps):
    import jax
    import jax.numpy as jnp

    from mpfunc import all_finite
    from mpfunc._src.scale_state import _unscale

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    n = mib * 2**20 // 4
    tree = [jax.device_put(jnp.ones((n // 64,), jnp.float32), dev) for _ in range(64)]
    inv = jnp.float32(0.5)

    @jax.jit
    def unscale_check(t):
        g = _unscale(t, inv)
        return g, all_finite(g)

    copy = jax.jit(lambda t: [x * 1.0 for x in t])
    flat = jax.device_put(jnp.ones((n // 64 * 64,), jnp.float32), dev)
    # Not donated: a donated input is aliased to the output and XLA copies nothing.
    dev_copy = jax.jit(jnp.copy).lower(flat).compile()
    real_copy = " copy(" in dev_copy.as_text()
    unscale_check = unscale_check.lower(tree).compile()
    copy = copy.lower(tree).compile()
    t_u = bench(lambda: jax.block_until_ready(unscale_check(tree)), lambda: None, reps)
    t_c = bench(lambda: jax.block_until_ready(copy(tree)), lambda: None, reps)
    t_d = bench(lambda: jax.block_until_ready(dev_copy(flat)), lambda: None, reps)
    nbytes = 2 * sum(x.nbytes for x in tree)
    assert nbytes == 2 * flat.nbytes
    return {"unscale_GBps": nbytes / t_u / 1e9, "copy_GBps": nbytes / t_c / 1e9,
            "fraction_of_copy": t_c / t_u,
            "device_copy": "jitted jnp.copy of one buffer", "device_copy_is_real_copy": real_copy,
            "device_copy_GBps": nbytes / t_d / 1e9, "fraction_of_device_copy": t_d / t_u}


def to_markdown(r):
    lines = [f"{r['MiB']} MiB of float32 gradients in 64 tensors on {r['device']}; median of "
             f"{r.get('reps', '?')}. Copy: the same 64 tensors (torch `_foreach_copy_`, JAX a "
             "jitted `x * 1`); device copy: one buffer of the same bytes (torch `copy_`, "
             "JAX a jitted `jnp.copy`).", "",
             "| framework | unscale+check GB/s | copy GB/s | fraction of copy | device copy GB/s "
             "| fraction of device copy |", "| --- | --- | --- | --- | --- | --- |"]
    for fw in ("torch", "jax"):
        x = r[fw]
        dev = (f"{x['device_copy_GBps']:.1f} | {x['fraction_of_device_copy']:.2f}"
               if "device_copy_GBps" in x else "n/a | n/a")
        lines.append(f"| {fw} | {x['unscale_GBps']:.1f} | {x['copy_GBps']:.1f} | "
                     f"{x['fraction_of_copy']:.2f} | {dev} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.mib < 1:
        ap.error(f"--mib must be >= 1, got {args.mib}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    r = {"MiB": args.mib, "device": args.device, "reps": args.reps,
         "torch": torch_part(args.mib, args.device, args.reps),
         "jax": jax_part(args.mib, args.device, args.reps)}
    print(to_markdown(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
