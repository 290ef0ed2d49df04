"""Peak memory at the optimizer step, in bytes per parameter, and step time: fp32, a
hand-written fp16 + float32-master loop, and mpfunc_torch's master-weight modes, with one
optimizer step and with ``step_chunks`` (``--step-chunks``, default 4).

Memory is counted at the allocator, exactly. Each variant runs under
``torch.profiler.profile(profile_memory=True)``, which reports every allocation and
free of torch's CPU allocator (``c10::ProfiledCPUMemoryReporter``) with its size and
address, in time order. The profiler starts *before* the model is built, so params,
gradients, master weights, optimizer state, activations and every temporary (foreach
outputs, scalars) are counted; only the frees of blocks allocated during this session
are subtracted, so what other code allocated earlier is left out. The "step" window is
a ``record_function`` range around what comes after ``backward``: mpfunc's
``optimizer.step()``, and the hand-written loop's grads-to-masters copy, unscale,
check, step and masters-to-model copy. Its peak is the highest running total of live
bytes inside that window (the total at its start included). Buffers that a library
allocates behind torch's allocator (oneDNN/MKL scratch inside matmuls) are not seen;
none of them runs in the step window. The numbers are deterministic: the same command
gives the same bytes.

Time: one process, every variant takes its turn each round (interleaved), medians of
the whole iteration (ratios to the hand-written loop) and of the step window alone.

    python benchmarks/torch_memory.py [--width 1024] [--depth 10] [--batch 64] [--step-chunks 4]
    python benchmarks/torch_memory.py --model gpt2 --batch 2 --seq 64   # GPT-2 small
    python benchmarks/torch_memory.py --copy-ab   # the copy alone, old vs chunked
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import platform
import statistics
import time

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

import mpfunc_torch

STEP = "mpfunc_bench::step"
MODES = {"mpfunc naive": ("naive", {"initial_scale": 2.0**16}),
         "mpfunc apex O2": ("apex", {"opt_level": "O2", "verbosity": 0})}


def variants(step_chunks: int) -> tuple[str, ...]:
    chunked = tuple(f"{m}, step_chunks={step_chunks}" for m in MODES) if step_chunks > 1 else ()
    return ("fp32", "hand-written fp16 + fp32 masters", *MODES, *chunked)


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


class _LMLogits(torch.nn.Module):
    """A HuggingFace causal LM returning flat logits, so a plain criterion takes them."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        logits = self.lm(input_ids=ids).logits
        return logits.reshape(-1, logits.shape[-1])


def make_gpt2() -> torch.nn.Module:
    """GPT-2 small's shapes (124M params, tied embedding) from HuggingFace's default
    ``GPT2Config``, randomly initialised (nothing is downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    cfg._attn_implementation = "eager"
    return _LMLogits(GPT2LMHeadModel(cfg))


def make_problem(args) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model (float32, as built) and one batch for ``args.model``."""
    if args.model == "gpt2":
        net = make_gpt2()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, net.lm.config.vocab_size, (args.batch, args.seq + 1),
                            generator=g)
        return net, ids[:, :-1], ids[:, 1:].reshape(-1)
    net = make_model(args.width, args.depth)
    return net, torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))


def whole_tensor_term(net: torch.nn.Module) -> int:
    """Bytes above 18 per param that the chunked grads -> masters copy holds at its
    worst moment, from the params' sizes alone: for each chunk (in
    ``copy_grads_to_masters_``'s order), 2 bytes per element by which its half grads
    outnumber the half grads of everything copied after it."""
    from mpfunc_torch._src.master_weights import _chunks, largest_first

    pairs = largest_first([(p, p) for p in net.parameters()])
    sizes = [sum(m.numel() for _, m in c) for c in _chunks(pairs)]
    return max(2 * (n - sum(sizes[i + 1:])) for i, n in enumerate(sizes))


def predicted_step_peak(name: str, net: torch.nn.Module, step_chunks: int) -> float:
    """The step peak in bytes/param that the accounting predicts from the sizes alone,
    with fused Adam (no temporaries). fp32: 4 param + 4 grad + 8 state; hand-written:
    2 + 2 + 4 master + 4 master grad + 8; mpfunc: 18 + the whole-tensor term; with
    ``step_chunks``: 2 half param + 4 master + 8 state, plus, at the worst chunk k,
    2 per half grad not yet copied (chunk k's included) + 4 per element of chunk k."""
    from mpfunc_torch._src.chunked_step import chunks_of_size
    from mpfunc_torch._src.master_weights import largest_first

    n = sum(p.numel() for p in net.parameters())
    if name == "fp32":
        return 16.0
    if name.startswith("hand-written"):
        return 20.0
    if "step_chunks" not in name:
        return 18 + whole_tensor_term(net) / n
    pairs = largest_first([(p, p) for p in net.parameters()])
    sizes = [sum(m.numel() for _, m in c) for c in chunks_of_size(pairs, step_chunks)]
    return 14 + max(2 * sum(sizes[i:]) + 4 * c for i, c in enumerate(sizes)) / n


def make_adam(params, kind: str) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.Adam(params, lr=1e-4, fused=True)
    return torch.optim.Adam(params, lr=1e-4, foreach=kind == "foreach")


def make_step(name: str, net: torch.nn.Module, adam: str, step_chunks: int = 1):
    """One training iteration of variant ``name`` on ``net`` (float32, as built); the
    part after ``backward`` runs inside ``record_function(STEP)``."""
    crit = torch.nn.CrossEntropyLoss()
    if name == "fp32":
        opt = make_adam(net.parameters(), adam)

        def step(x, y):
            opt.zero_grad()
            crit(net(x), y).backward()
            t0 = time.perf_counter()
            with record_function(STEP):
                opt.step()
            return time.perf_counter() - t0
        return step
    if name.startswith("hand-written"):
        return _hand_written(net, crit, adam)
    mode, cfg = MODES[name.split(", step_chunks")[0]]
    model, opt, acrit = mpfunc_torch.convert_to_amp(
        net, make_adam(net.parameters(), adam), crit, mode=mode,
        step_chunks=step_chunks if "step_chunks" in name else 1, **cfg)

    def step(x, y):
        opt.zero_grad()
        opt.backward(acrit(model(x), y))
        t0 = time.perf_counter()
        with record_function(STEP):
            opt.step()
        return time.perf_counter() - t0
    return step


def _hand_written(net, crit, adam):
    """The loop one writes by hand (as in NVIDIA's mixed-precision training guide):
    float16 model, float32 masters stepped by the optimizer, a dynamic scale updated by
    torch's GradScaler kernel; grads are cleared at the start of the next iteration."""
    masters = [p.detach().clone() for p in net.parameters()]
    for m in masters:
        m.requires_grad_(True)
    net.half()
    params = list(net.parameters())
    opt = make_adam(masters, adam)
    scale = torch.tensor(2.0**16)
    growth = torch.zeros((), dtype=torch.int32)
    found = torch.zeros(())

    def step(x, y):
        net.zero_grad()
        opt.zero_grad()
        loss = crit(net(x.half() if x.is_floating_point() else x).float(), y)
        (loss * scale).backward()
        t0 = time.perf_counter()
        with record_function(STEP), torch.no_grad():
            for m in masters:
                m.grad = torch.empty_like(m)
            grads = [m.grad for m in masters]
            torch._foreach_copy_(grads, [p.grad for p in params])
            found.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale.reciprocal())
            if not found.item():
                opt.step()
                torch._foreach_copy_(params, masters)
            torch._amp_update_scale_(scale, growth, found, 2.0, 0.5, 2000)
        return time.perf_counter() - t0
    return step


def allocation_peaks(run) -> dict[str, int]:
    """Runs ``run()`` under the memory profiler; returns, in bytes, the peak of live
    allocations (made during the run) over each ``STEP`` window and over the whole run."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
        gc.collect()
    allocs, windows, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation:
            f = e.typed[1]
            if f.device.type == "cpu":
                allocs.append((e.start_time_ns, f.ptr, f.alloc_size))
        elif e.name == STEP:
            windows.append((e.start_time_ns, e.end_time_ns))
    allocs.sort(key=lambda a: a[0])
    live: dict[int, int] = {}
    times, totals, total = [], [], 0
    for t, ptr, size in allocs:
        if size > 0:
            live[ptr] = size
            total += size
        elif ptr in live:  # only the frees of blocks allocated during this run
            total -= live.pop(ptr)
        times.append(t)
        totals.append(total)
    step_peaks, after = [], 0
    for start, end in sorted(windows):
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        at_start = totals[lo - 1] if lo else 0  # what is live when the window opens
        step_peaks.append(max([at_start, *totals[lo:hi]]))
        after = totals[hi - 1] if hi else 0  # what is live when the window closes
    return {"step_peaks": step_peaks, "peak": max(totals, default=0), "live_after": after}


def memory_of(name: str, args, steps: int = 3) -> dict:
    """Bytes per param of variant ``name``: the step peak of the last of ``steps``
    iterations (the first ones create the optimizer state), the whole-run peak (with
    activations) and what is live when the last step ends."""
    box = {}

    def run():
        net, x, y = make_problem(args)
        box["n"] = sum(p.numel() for p in net.parameters())
        box["whole_tensor_term"] = whole_tensor_term(net)
        box["predicted"] = predicted_step_peak(name, net, args.step_chunks)
        step = make_step(name, net, args.adam, args.step_chunks)
        for _ in range(steps):
            step(x, y)

    r = allocation_peaks(run)
    n = box["n"]
    return {"params": n, "step_peak_bytes": r["step_peaks"][-1],
            "step_peaks_bytes": r["step_peaks"],
            "step_peak_per_param": r["step_peaks"][-1] / n,
            "run_peak_per_param": r["peak"] / n, "live_after_per_param": r["live_after"] / n,
            "whole_tensor_term_per_param": box["whole_tensor_term"] / n,
            "predicted_step_peak_per_param": box["predicted"]}


def time_steps(args) -> dict[str, float]:
    rounds, iters = args.rounds, args.iters
    steps = {}
    for name in variants(args.step_chunks):
        net, x, y = make_problem(args)
        steps[name] = make_step(name, net, args.adam, args.step_chunks)
    for step in steps.values():  # warm up
        step(x, y)
        step(x, y)
    times: dict[str, list[float]] = {name: [] for name in steps}
    step_times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0, in_step = time.perf_counter(), 0.0
            for _ in range(iters):
                in_step += step(x, y)
            times[name].append((time.perf_counter() - t0) / iters)
            step_times[name].append(in_step / iters)
    return ({k: statistics.median(v) for k, v in times.items()},
            {k: statistics.median(v) for k, v in step_times.items()})


def copy_ab(width: int, depth: int, rounds: int = 30) -> dict[str, float]:
    """Times the grads -> masters copy alone, interleaved in one process: one foreach
    copy of everything (the hand-written loop, and mpfunc's own earlier copy) against mpfunc's
    chunked copy, on the same half grads. Returns medians in ms."""
    from mpfunc_torch._src.master_weights import copy_grads_to_masters_, largest_first

    net = make_model(width, depth)
    masters = [p.detach().clone() for p in net.parameters()]
    net.half()
    params = list(net.parameters())
    pairs = list(zip(params, masters))
    grads = [torch.randn(p.shape).half() for p in params]

    def one_copy(pairs):
        for _, m in pairs:
            m.grad = torch.empty_like(m)
        torch._foreach_copy_([m.grad for _, m in pairs], [p.grad for p, _ in pairs])
        for p, _ in pairs:
            p.grad = None

    def timed(fn, arg):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        t0 = time.perf_counter()
        fn(arg)
        t = time.perf_counter() - t0
        for m in masters:
            m.grad = None
        return t

    ts: dict[str, list[float]] = {"one foreach copy": [], "chunked": []}
    for _ in range(rounds):
        ts["one foreach copy"].append(timed(one_copy, pairs))
        ts["chunked"].append(timed(copy_grads_to_masters_, largest_first(pairs)))
    return {k: statistics.median(v) * 1e3 for k, v in ts.items()}


def measure(args) -> dict:
    names = variants(args.step_chunks)
    mem = {name: memory_of(name, args) for name in names}
    med, med_step = (
        time_steps(args)
        if args.rounds else (dict.fromkeys(names, float("nan")),) * 2)
    ref = "hand-written fp16 + fp32 masters"
    return {
        "device": f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__, "params": mem["fp32"]["params"], "model": args.model,
        "seq": args.seq, "width": args.width,
        "depth": args.depth, "batch": args.batch, "adam": args.adam,
        "step_chunks": args.step_chunks,
        "rounds": args.rounds, "iters": args.iters, "memory": mem,
        "median_step_ms": {k: v * 1e3 for k, v in med.items()},
        "time_vs_hand_written": {k: v / med[ref] for k, v in med.items()},
        "median_opt_step_ms": {k: v * 1e3 for k, v in med_step.items()},
    }


def to_markdown(r: dict) -> str:
    adam = {"fused": "Adam(fused=True)", "foreach": "Adam(foreach=True)",
            "single": "Adam(foreach=False)"}[r["adam"]]
    model = (f"GPT-2 small (HuggingFace GPT2Config(), random init), sequence {r['seq']}"
             if r.get("model") == "gpt2" else
             f"MLP of {r['depth']} Linear({r['width']})+LayerNorm+GELU blocks")
    lines = [
        f"Device: {r['device']}; torch {r['torch']}; {model}, {r['params']:,} params, batch "
        f"{r['batch']}, {adam}. Bytes counted at torch's CPU allocator (profiler memory "
        f"events); time: median of {r['rounds']} interleaved rounds x {r['iters']} steps. "
        "Predicted: the step peak the accounting gives from the param sizes alone "
        "(`predicted_step_peak`).",
        "",
        "| variant | step peak (bytes/param) | predicted (bytes/param) | run peak "
        "(bytes/param) | live after step (bytes/param) | iteration (ms) | iteration vs "
        "hand-written | optimizer step (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, m in r["memory"].items():
        lines.append(f"| {k} | {m['step_peak_per_param']:.3f} | "
                     f"{m['predicted_step_peak_per_param']:.3f} | "
                     f"{m['run_peak_per_param']:.2f} | "
                     f"{m['live_after_per_param']:.2f} | {r['median_step_ms'][k]:.1f} | "
                     f"{r['time_vs_hand_written'][k]:.3f}x | "
                     f"{r['median_opt_step_ms'][k]:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", choices=["mlp", "gpt2"],
                    help="mlp: --depth blocks of --width; gpt2: GPT-2 small's shapes")
    ap.add_argument("--seq", type=int, default=64, help="gpt2: tokens per sequence")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adam", default="fused", choices=["fused", "foreach", "single"])
    ap.add_argument("--step-chunks", type=int, default=4,
                    help="step_chunks of the chunked mpfunc variants (1: leave them out)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--copy-ab", action="store_true",
                    help="only time the grads->masters copy, one-copy vs chunked")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.copy_ab:
        r = copy_ab(args.width, args.depth)
        print(", ".join(f"{k}: {v:.1f} ms" for k, v in r.items())
              + f"; chunked / one copy: {r['chunked'] / r['one foreach copy']:.3f}")
        return r
    if args.memory_only:
        args.rounds = 0
    r = measure(args)
    print(to_markdown(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
