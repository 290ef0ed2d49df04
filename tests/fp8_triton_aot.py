"""Compiles mpfunc_torch's fp8 Triton kernels for a GPU without one (ahead of time).

Triton builds PTX and a cubin for any target from the CPU; ``compile_all(cc)`` builds
each kernel as the training step launches it (bfloat16 activations and gradients,
float32 weights) into a fresh cache and returns ``(label, seconds, ptx, cubin)`` per
kernel. Run as a script it prints the compile times (BENCHMARKS.md):

    python tests/fp8_triton_aot.py [--cc 90]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def _source(kernel, pointers: dict, constexprs: dict):
    from triton.compiler import ASTSource

    floats = {"FMAX", "MARGIN", "MAX_SCALE"}
    signature = {n: "constexpr" if n in constexprs else
                 pointers.get(n, "fp32" if n in floats else "i32") for n in kernel.arg_names}
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs)


def compile_all(cc: int = 90):
    import triton
    from triton.backends.compiler import GPUTarget

    from mpfunc_torch._src.fp8 import triton_kernels as ft

    f32 = {n: "*fp32" for n in ("src_ptr", "prev_ptr", "scale_ptr", "part_ptr", "s_ptr",
                                "hist_ptr")}
    u8 = {"q_ptr": "*u8", "qt_ptr": "*u8"}
    tile = dict(BM=64, BN=64)
    cases = [
        ("cast bf16", ft._cast_per_tensor_kernel, {**f32, **u8, "x_ptr": "*bf16"}, tile),
        ("cast fp32", ft._cast_per_tensor_kernel, {**f32, **u8, "x_ptr": "*fp32"}, tile),
        ("blocks rows bf16", ft._quantize_blocks_kernel, {**f32, **u8, "x_ptr": "*bf16"},
         dict(TILE_ROWS=False, RB=8, CHUNK=256)),
        ("blocks tiles fp32", ft._quantize_blocks_kernel, {**f32, **u8, "x_ptr": "*fp32"},
         dict(TILE_ROWS=True, RB=32, CHUNK=128)),
        ("record", ft._record_amax_kernel, f32, dict(BLOCK=1024)),
    ]
    out = []
    old = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # a cold cache: the real compile time
        try:
            for label, kernel, pointers, constexprs in cases:
                t0 = time.perf_counter()
                c = triton.compile(_source(kernel, pointers, constexprs),
                                   target=GPUTarget("cuda", cc, 32), options=ft._OPTIONS)
                out.append((label, time.perf_counter() - t0, c.asm["ptx"], c.asm["cubin"]))
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", type=int, default=90, help="compute capability, e.g. 89, 90")
    args = ap.parse_args()
    import triton

    rows = compile_all(args.cc)
    for label, seconds, _, cubin in rows:
        print(f"{label}: {seconds:.2f} s, cubin {len(cubin)} bytes")
    print(f"total {sum(r[1] for r in rows):.2f} s (triton {triton.__version__}, sm_{args.cc})")
