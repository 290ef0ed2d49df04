"""One entry point for every benchmark; writes out/benchmarks.md and out/benchmarks.json.

Runs, in order: the JAX loss-scale overhead (plain Adam / mpfunc / lax.cond variant /
manual jmp-style loop), what an exact skip costs in peak memory, compile time and step
time (every scaling form and mode, three depths), the demo's JAX step compile time at 2
and 12 layers (scanned and unrolled, every mode), the torch modes (fp32 / raw
torch.amp / every mpfunc_torch mode), the precision report's cost per step, the torch
master-weight step peak memory (bytes/param at the allocator), the unscale-and-check
bandwidth, the JAX FSDP bytes per device and the torch FSDP2 bytes per rank, and (with
``--device cuda`` only) fp8 against bf16 step throughput, as
``fp8.<framework>.<recipe>.<d>.speed_vs_bf16``. Each section records its device,
software versions, the command and the date.

    python benchmarks/run.py [--device cpu|cuda] [--out out]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fp8  # noqa: E402
import jax_compile_depth  # noqa: E402
import jax_loss_scale  # noqa: E402
import jax_scale_cost  # noqa: E402
import jax_sharding  # noqa: E402
import precision_report  # noqa: E402
import torch_memory  # noqa: E402
import torch_modes  # noqa: E402
import torch_sharding  # noqa: E402
import unscale_bandwidth  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    header = f"{date}; {platform.platform()}; Python {platform.python_version()}"
    sections, results = [], {"date": date, "platform": platform.platform()}

    r = jax_loss_scale.main([])
    results["jax_loss_scale"] = r
    sections.append("## JAX loss-scale overhead\n\nCommand: `python benchmarks/jax_loss_scale.py`"
                    f"\n\n{jax_loss_scale.to_markdown(r)}")

    r = jax_scale_cost.main([])
    results["jax_scale_cost"] = r
    sections.append("## JAX: what an exact skip costs (peak memory, compile, step)\n\n"
                    "Command: `python benchmarks/jax_scale_cost.py`\n\n"
                    f"{jax_scale_cost.to_markdown(r)}")

    r = jax_compile_depth.main([])
    results["jax_compile_depth"] = r
    sections.append("## JAX: compile time against depth, scanned and unrolled\n\n"
                    "Command: `python benchmarks/jax_compile_depth.py`\n\n"
                    f"{jax_compile_depth.to_markdown(r)}")

    r = torch_modes.main(["--device", args.device])
    results["torch_modes"] = r
    sections.append("## torch modes\n\nCommand: `python benchmarks/torch_modes.py "
                    f"--device {args.device}`\n\n{torch_modes.to_markdown(r)}")

    r = precision_report.main(["--device", args.device])
    results["precision_report"] = r
    sections.append("## Precision report every step (its cost in step time)\n\nCommand: `python "
                    f"benchmarks/precision_report.py --device {args.device}`\n\n"
                    f"{precision_report.to_markdown(r)}")

    r = torch_memory.main(["--rounds", "3"])  # CPU: the allocator is profiled on the host
    results["torch_memory"] = r
    sections.append("## torch step peak memory (master weights)\n\nCommand: `python "
                    f"benchmarks/torch_memory.py --rounds 3`\n\n{torch_memory.to_markdown(r)}")

    r = unscale_bandwidth.main(["--device", args.device])
    results["unscale_bandwidth"] = r
    sections.append("## Unscale-and-check bandwidth\n\nCommand: `python "
                    f"benchmarks/unscale_bandwidth.py --device {args.device}`\n\n"
                    + "\n".join(f"- {fw}: {v['unscale_GBps']:.1f} GB/s, {v['fraction_of_copy']:.2f} of copy "
                                f"({v['copy_GBps']:.1f} GB/s)" for fw, v in
                                ((k, r[k]) for k in ("torch", "jax"))))
    # Its own process: it needs 8 forced CPU devices, set before jax is imported.
    dev = "gpu" if args.device == "cuda" else "cpu"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("jax_sharding.py")),
                           "--device", dev, "--json"], capture_output=True, text=True, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    results["jax_sharding"] = r
    sections.append("## JAX FSDP: master-weight bytes per device\n\nCommand: `python "
                    f"benchmarks/jax_sharding.py --device {dev}`\n\n{jax_sharding.to_markdown(r)}")
    # Its own processes: N gloo ranks (or one per GPU) for N = 1, 2, 4.
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("torch_sharding.py")),
                           "--device", args.device, "--json"], capture_output=True, text=True,
                          check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    results["torch_sharding"] = r
    sections.append("## torch FSDP2: master-weight bytes per rank\n\nCommand: `python "
                    f"benchmarks/torch_sharding.py --device {args.device}`\n\n"
                    f"{torch_sharding.to_markdown(r)}")
    if args.device == "cuda":  # at these sizes a CPU would take hours: GPU only
        r = fp8.main(["--device", "cuda", "--time-budget", "1200"])
        results["fp8"] = r["fp8"]
        results["fp8_meta"] = {k: v for k, v in r.items() if k not in ("fp8", "markdown")}
        sections.append("## fp8 vs bf16 step throughput\n\nCommand: `python benchmarks/fp8.py "
                        f"--device cuda --time-budget 1200` ({r['device']})\n\n{r['markdown']}")
    md = f"# Benchmarks ({header})\n\n" + "\n\n".join(sections) + "\n"
    (out / "benchmarks.md").write_text(md)
    (out / "benchmarks.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out / 'benchmarks.md'} and {out / 'benchmarks.json'}")


if __name__ == "__main__":
    main()
