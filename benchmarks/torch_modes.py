"""fp32 vs raw torch.amp vs each mpfunc_torch mode, on one model, in one run.

Step time and throughput are measured in one process with the runs interleaved (every
variant takes its turn each round; medians are reported), so machine noise hits all
alike. Peak memory of three training steps, per variant (``--peak``):

* CUDA (``auto``, ``in-process``): in this process, one variant after another; the timed
  models are freed first, each variant is freed before the next is built, and
  ``torch.cuda.reset_peak_memory_stats`` runs before each; the figure is
  ``max_memory_allocated`` above what was allocated before the model was built (so the
  batch, the CUDA context and cuBLAS's workspace are not counted).
* CPU (``auto``, ``child``): in a fresh child process per variant, as the peak
  resident-set growth during training (Linux ``VmHWM``, reset before the model is
  built), which includes activations. A process's RSS does not fall back when tensors
  are freed, hence one process each.
* ``none``: no peak memory.

    python benchmarks/torch_modes.py [--device cpu|cuda] [--width 512] [--batch 1024]
        [--peak auto|in-process|child|none]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import mpfunc_torch

VARIANTS = {
    "fp32": None,
    "torch.amp (raw)": "raw",
    "mpfunc torch": ("torch", {}),
    "torch.amp bf16 (raw)": "raw_bf16",
    "mpfunc torch bf16": ("torch", {"dtype": "bfloat16"}),
    "mpfunc apex O1": ("apex", {"opt_level": "O1", "verbosity": 0}),
    "mpfunc apex O2": ("apex", {"opt_level": "O2", "verbosity": 0}),
    "mpfunc naive": ("naive", {"initial_scale": 2.0**16}),
    "mpfunc bf16": ("bf16", {}),
}


def make_model(width, depth, device):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers).to(device)


def make_step(name, width, depth, device):
    net = make_model(width, depth, device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4, fused=True)
    crit = torch.nn.CrossEntropyLoss()
    kind = VARIANTS[name]
    dtype_dev = device.type
    if kind is None:
        def step(x, y):
            opt.zero_grad()
            crit(net(x), y).backward()
            opt.step()
    elif kind in ("raw", "raw_bf16"):
        scaler = torch.amp.GradScaler(dtype_dev)
        half = torch.float16 if kind == "raw" else torch.bfloat16

        def step(x, y):
            opt.zero_grad()
            with torch.autocast(dtype_dev, dtype=half):
                loss = crit(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    else:
        mode, cfg = kind
        model, aopt, acrit = mpfunc_torch.convert_to_amp(net, opt, crit, mode=mode, **cfg)

        def step(x, y):
            aopt.zero_grad()
            aopt.backward(acrit(model(x), y))
            aopt.step()
    return step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_child(name, args):
    """Runs in a child process: peak memory of training `name` for a few steps."""
    device = torch.device(args.device)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = _rss("VmRSS")
    step = make_step(name, args.width, args.depth, device)
    for _ in range(3):
        step(x, y)
    sync(device)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss("VmHWM")
    print(json.dumps({"peak_bytes": peak - base}))


def _rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class CudaPeakMeter:
    """Peak allocated bytes on one CUDA device since the last `start`."""

    def __init__(self, device):
        self.device = device

    def start(self):
        """Frees what is unreferenced, resets the peak; returns the bytes allocated now."""
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self):
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def peaks_in_process(args, device, x, y, meter):
    """Peak bytes of 3 training steps of each variant, one after another in this process;
    each variant is built after the `meter` starts and freed before the next starts."""
    peaks = {}
    for name in VARIANTS:
        base = meter.start()
        step = make_step(name, args.width, args.depth, device)
        for _ in range(3):
            step(x, y)
        peaks[name] = meter.peak() - base
        del step
    return peaks


def peaks_in_children(args):
    """Peak bytes of each variant, each in a fresh child process (CPU RSS)."""
    peaks = {}
    for name in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", name, "--device", args.device,
             "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)],
            capture_output=True, text=True, check=True, env=dict(os.environ))
        peaks[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
    return peaks


def peak_method(peak, device_type):
    """What ``--peak`` means on ``device_type``: 'in-process', 'child' or 'none'."""
    if peak == "auto":
        return "in-process" if device_type == "cuda" else "child"
    return peak


def measure(args, meter=None):
    """Times every variant; ``meter`` (default: a `CudaPeakMeter`) measures the in-process
    peaks."""
    device = torch.device(args.device)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    steps = {name: make_step(name, args.width, args.depth, device) for name in VARIANTS}
    for step in steps.values():  # warm up
        step(x, y)
        step(x, y)
    sync(device)
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step(x, y)
            sync(device)
            times[name].append((time.perf_counter() - t0) / args.iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    del steps, step  # the timed models and optimizers go before any peak is measured
    method = peak_method(args.peak, device.type)
    if method == "in-process":
        peaks = peaks_in_process(args, device, x, y, meter or CudaPeakMeter(device))
    elif method == "child":
        peaks = peaks_in_children(args)
    else:
        peaks = {}
    n_params = sum(p.numel() for p in make_model(args.width, args.depth, "cpu").parameters())
    if device.type == "cuda":
        dev = torch.cuda.get_device_name(device)
    else:
        dev = f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return {
        "device": dev, "torch": torch.__version__, "params": n_params, "batch": args.batch,
        "rounds": args.rounds, "iters": args.iters,
        "median_step_ms": {k: v * 1e3 for k, v in med.items()},
        "samples_per_s": {k: args.batch / v for k, v in med.items()},
        "peak_method": method,
        "peak_mib": {k: v / 2**20 for k, v in peaks.items()},
        "speed_vs_fp32": {k: med["fp32"] / v for k, v in med.items()},
        "memory_vs_fp32": {k: peaks[k] / peaks["fp32"] for k in peaks},
        "mpfunc_torch_vs_raw_amp": med["mpfunc torch"] / med["torch.amp (raw)"],
        "mpfunc_torch_bf16_vs_raw_amp_bf16": med["mpfunc torch bf16"] / med["torch.amp bf16 (raw)"],
    }


def to_markdown(r):
    kind = "peak allocated" if "cuda" in r["device"].lower() or "nvidia" in r["device"].lower() \
        else "peak RSS growth"
    lines = [
        f"Device: {r['device']}; torch {r['torch']}; MLP {r['params']:,} params "
        f"(Linear+LayerNorm+GELU blocks), batch {r['batch']}, Adam(fused=True); median of "
        f"{r['rounds']} interleaved rounds x {r['iters']} steps.",
        "",
        f"| variant | step (ms) | samples/s | {kind} (MiB) | speed vs fp32 | memory vs fp32 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k in r["median_step_ms"]:
        mem = (f"{r['peak_mib'][k]:.1f} | {r['speed_vs_fp32'][k]:.2f}x | "
               f"{r['memory_vs_fp32'][k]:.2f}x" if k in r["peak_mib"]
               else f"n/a | {r['speed_vs_fp32'][k]:.2f}x | n/a")
        lines.append(f"| {k} | {r['median_step_ms'][k]:.1f} | {r['samples_per_s'][k]:.0f} | "
                     f"{mem} |")
    lines += ["", f"mpfunc torch mode / raw torch.amp step time: fp16 "
              f"{r['mpfunc_torch_vs_raw_amp']:.3f}, bf16 {r['mpfunc_torch_bf16_vs_raw_amp_bf16']:.3f}"]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--peak", choices=["auto", "in-process", "child", "none"], default="auto",
                    help="how peak memory is measured (auto: in-process on cuda, a child "
                    "process per variant on cpu)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.peak == "in-process" and args.device != "cuda":
        ap.error("--peak in-process needs --device cuda (a CPU peak is a process's RSS: "
                 "use --peak child)")
    for flag in ("width", "batch", "rounds", "iters"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.child:
        return peak_child(args.child, args)
    r = measure(args)
    print(to_markdown(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
