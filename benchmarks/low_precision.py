"""Training without float32 master weights (torch): bytes per param, update cost, loss.

Four measurements of `mpfunc_torch._src.low_precision.use_low_precision` (masters stored
as ``remainder``, ``kahan`` or ``stochastic`` bfloat16 params; optimizer state in
bfloat16 or 8 bits):

* ``bytes``: the persistent state per parameter after a step of AdamW (params, masters or
  placeholders, remainders/compensation, every optimizer-state tensor with its step
  counts and block scales, seed and step), counted from the buffers themselves
  (`persistent_bytes`), for a model of ``--params`` parameters.
* ``peak``: what one optimizer step allocates at its peak, per parameter (torch's CPU
  allocator, `torch_memory.allocation_peaks`): the float32 master grads, and the float32
  masters and state that the generic path builds whole and the fused-AdamW path
  (`mpfunc_torch._src.storage_kernels`) a chunk at a time.
* ``overhead``: the optimizer update alone (gradients given: unscale/copy into float32,
  the inner AdamW, rounding or compensation, state casts), against
  ``torch.optim.AdamW(foreach=True)`` stepping bfloat16 params (and bfloat16 state, as
  torch makes it) directly; ``AdamW(fused=True)`` on bfloat16 params is shown beside it,
  as are the fused-AdamW variants on the generic path. Rounds alternate the variants; each round times
  ``--steps-per-round`` steps of each, and the report gives each variant's median time
  and the median over rounds of its per-round ratio to the baseline (paired, so a busy
  spell on a shared machine slows a round's runs alike).
* ``loss``: the demo transformer (examples/compare_modes.py, on Python's own source)
  trained ``--steps`` steps with AdamW from the same init in each storage, and with plain
  bfloat16 params (no masters); the eval loss and its gap to float32 masters. The row
  "float32 masters, 1 ulp off" is the noise floor: the float32-master run with one
  weight moved by one bfloat16 ulp before training (what one remainder tie does), so
  the gap that chaotic divergence alone opens in ``--steps`` steps.

    python benchmarks/low_precision.py                       # all four, CPU sizes
    python benchmarks/low_precision.py --part loss --steps 1000 --json out/lp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

# name -> (storage, state dtype, state rounding, inner optimizer options)
VARIANTS = {
    "float32 masters": (None, None, "nearest", {}),
    "remainder": ("remainder", None, "nearest", {}),
    "remainder + bf16 state": ("remainder", "bfloat16", "nearest", {}),
    "kahan + bf16 state": ("kahan", "bfloat16", "nearest", {}),
    "stochastic + bf16 state": ("stochastic", "bfloat16", "nearest", {}),
    "stochastic + bf16 state (stochastic)": ("stochastic", "bfloat16", "stochastic", {}),
    "stochastic + 8-bit state": ("stochastic", "float8_e4m3fn", "nearest", {}),
    "stochastic + 8-bit state (stochastic)": ("stochastic", "float8_e4m3fn", "stochastic", {}),
    "remainder + bf16 state, fused AdamW": ("remainder", "bfloat16", "nearest",
                                            {"fused": True}),
    "stochastic + bf16 state, fused AdamW": ("stochastic", "bfloat16", "nearest",
                                             {"fused": True}),
    # The same step without the fused-kernel path (mpfunc_torch._src.storage_kernels):
    # whole float32 masters and state built, stepped and written back.
    "remainder + bf16 state, fused AdamW, generic path": ("remainder", "bfloat16", "nearest",
                                                          {"fused": True, "generic": True}),
    "float32 masters, fused AdamW": (None, None, "nearest", {"fused": True}),
}
BYTES_VARIANTS = ["float32 masters", "remainder", "remainder + bf16 state",
                  "kahan + bf16 state", "stochastic + bf16 state", "stochastic + 8-bit state",
                  "stochastic + 8-bit state (stochastic)"]
OVERHEAD_VARIANTS = ["float32 masters", "remainder + bf16 state", "kahan + bf16 state",
                     "stochastic + bf16 state", "stochastic + bf16 state (stochastic)",
                     "float32 masters, fused AdamW", "remainder + bf16 state, fused AdamW",
                     "remainder + bf16 state, fused AdamW, generic path",
                     "stochastic + bf16 state, fused AdamW"]
PEAK_VARIANTS = ["float32 masters, fused AdamW", "remainder + bf16 state, fused AdamW",
                 "remainder + bf16 state, fused AdamW, generic path",
                 "stochastic + bf16 state, fused AdamW"]


def inner_options(name):
    """The inner AdamW's keyword arguments of variant ``name`` (foreach unless fused)."""
    return {k: v for k, v in VARIANTS[name][3].items() if k != "generic"} or {"foreach": True}
LOSS_VARIANTS = ["float32 masters", "remainder", "remainder + bf16 state",
                 "kahan + bf16 state", "stochastic + bf16 state",
                 "stochastic + bf16 state (stochastic)", "stochastic + 8-bit state",
                 "stochastic + 8-bit state (stochastic)"]


def convert(model, inner, name, seed=0):
    import torch

    import mpfunc_torch
    from mpfunc_torch._src.low_precision import use_low_precision

    storage, state, rounding, _ = VARIANTS[name]
    model_c, opt, _ = mpfunc_torch.convert_to_amp(
        model, inner, mode="apex", opt_level="O2", cast_model_type=torch.bfloat16,
        keep_batchnorm_fp32=False, loss_scale=1.0, verbosity=0)
    if storage is not None or state is not None:
        lowp = use_low_precision(opt, storage or "float32", state, rounding, seed=seed)
        if VARIANTS[name][3].get("generic"):
            lowp.kernels = None
    return model_c, opt


def flat_model(n_params):
    """``n_params`` parameters as 1024-wide matrices (the last one shorter)."""
    import torch

    module = torch.nn.Module()
    rows, i = -(-n_params // 1024), 0
    while rows > 0:
        r = min(rows, 1024)
        module.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(r, 1024) * 0.02))
        rows, i = rows - r, i + 1
    return module


def bytes_part(n_params):
    import torch

    from mpfunc_torch._src.low_precision import persistent_bytes

    out = {}
    for name in BYTES_VARIANTS:
        torch.manual_seed(0)
        model = flat_model(n_params)
        _, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-4), name)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.backward_done()
        opt.step()
        n = sum(p.numel() for p in model.parameters())
        out[name] = persistent_bytes(opt, model) / n
    return {"params": n_params, "bytes_per_param": out}


def overhead_part(n_params, rounds, per_round):
    import torch

    torch.manual_seed(0)
    runs = {}
    base = flat_model(n_params).bfloat16()
    base_opt = torch.optim.AdamW(base.parameters(), lr=1e-4, foreach=True)
    grads = [torch.randn_like(p) for p in base.parameters()]  # bfloat16, reused each step

    def base_step():
        for p, g in zip(base.parameters(), grads):
            p.grad = g
        base_opt.step()

    runs["AdamW(foreach) on bf16 params"] = base_step
    fused_base = flat_model(n_params).bfloat16()
    fused_opt = torch.optim.AdamW(fused_base.parameters(), lr=1e-4, fused=True)

    def fused_base_step():
        for p, g in zip(fused_base.parameters(), grads):
            p.grad = g
        fused_opt.step()

    runs["AdamW(fused) on bf16 params"] = fused_base_step
    for name in OVERHEAD_VARIANTS:
        torch.manual_seed(0)
        model = flat_model(n_params)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4, **inner_options(name))
        _, opt = convert(model, inner, name)

        def step(model=model, opt=opt):
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.backward_done()
            opt.step()

        runs[name] = step
    for fn in runs.values():  # state made, first-step costs out of the way
        fn()
        fn()
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn()
            times[k].append((time.perf_counter() - t0) / per_round)
    base_t = times["AdamW(foreach) on bf16 params"]
    out = {}
    for k, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base_t)]
        out[k] = {"median_ms": 1e3 * statistics.median(ts),
                  "paired_median_ratio": statistics.median(ratios),
                  "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return {"params": n_params, "rounds": rounds, "steps_per_round": per_round, "runs": out}


def peak_part(n_params):
    """Bytes per param allocated inside one optimizer step at its peak (a step after the
    first two, which make the state), counted at torch's CPU allocator
    (``torch_memory.allocation_peaks``): the float32 master grads and each path's float32
    temporaries, nothing of what persists."""
    import torch
    from torch.profiler import record_function
    from torch_memory import STEP, allocation_peaks

    out = {}
    for name in PEAK_VARIANTS:
        torch.manual_seed(0)
        model = flat_model(n_params)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4, **inner_options(name))
        _, opt = convert(model, inner, name)
        grads = [torch.randn_like(p) for p in model.parameters()]

        def step(model=model, opt=opt, grads=grads):
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.backward_done()
            with record_function(STEP):
                opt.step()

        step()
        step()
        out[name] = allocation_peaks(step)["step_peaks"][-1] / n_params
    return {"params": n_params, "step_peak_bytes_per_param": out}


def loss_part(steps, cfg, seeds):
    """Each variant trained from ``seeds`` initialisations and data orders; the gap is
    taken per seed against that seed's float32-master run, then averaged."""
    import numpy as np
    import torch
    from compare_modes import torch_model
    from data import load_corpus, split, windows

    train, held = split(load_corpus(200_000))
    evals = list(zip(range(8), windows(held, cfg.context, cfg.batch, seed=2)))

    def eval_loss(model):
        with torch.no_grad():
            losses = [float(torch.nn.functional.cross_entropy(
                model(torch.from_numpy(x).long()).float().flatten(0, 1),
                torch.from_numpy(y).long().flatten())) for _, (x, y) in evals]
        return float(np.mean(losses))

    def train_loss(model, batch):
        x, y = batch
        logits = model(torch.from_numpy(x).long())
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 torch.from_numpy(y).long().flatten())

    def one(name, seed, data):
        model = torch_model(SimpleNamespace(**{**vars(cfg), "seed": seed}))
        inner = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
        t0 = time.perf_counter()
        if name == "plain bf16 params":  # no masters: AdamW steps bfloat16 params itself
            model.bfloat16()
            inner = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
            for batch in data:
                inner.zero_grad()
                train_loss(model, batch).backward()
                inner.step()
        else:
            model_c, opt = convert(model, inner, name.removesuffix(", 1 ulp off"), seed=seed)
            if name.endswith("1 ulp off"):  # a write: the master follows the param
                with torch.no_grad():
                    w = model.blocks[0].fc.weight.view(torch.int16)
                    w[0, 0] += 1  # one bfloat16 ulp away from zero
            for batch in data:
                opt.zero_grad()
                opt.backward(train_loss(model_c, batch))
                opt.step()
        return eval_loss(model), time.perf_counter() - t0

    names = LOSS_VARIANTS + ["float32 masters, 1 ulp off", "plain bf16 params"]
    per_seed: dict[str, list] = {n: [] for n in names}
    for seed in range(seeds):
        batches = windows(train, cfg.context, cfg.batch, seed=1 + seed)
        data = [next(batches) for _ in range(steps)]
        for name in names:
            per_seed[name].append(one(name, seed, data))
    out = {}
    for name, runs in per_seed.items():
        losses = [loss for loss, _ in runs]
        gaps = [(loss - ref) / ref for loss, (ref, _) in zip(losses, per_seed["float32 masters"])]
        out[name] = {"eval_loss": float(np.mean(losses)), "eval_losses": losses,
                     "gap_vs_float32_masters": float(np.mean(gaps)),
                     "gap_std": float(np.std(gaps, ddof=1)) if len(gaps) > 1 else 0.0,
                     "gaps": gaps, "train_s": float(np.mean([t for _, t in runs]))}
    return {"steps": steps, "seeds": seeds, "model": vars(cfg), "runs": out}


def keep_freed_memory():
    """glibc's ``mallopt``: a fixed (1 GiB) mmap threshold and no trimming. By default a
    freed multi-MiB buffer goes back to the kernel, and the next step's buffer of that
    size is page-faulted in again, which on CPU costs about as much as the arithmetic
    on it; with this, freed buffers are reused as a caching allocator reuses them."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_mmap_threshold, 2**30) and libc.mallopt(m_trim_threshold, 2**31 - 1)):
        raise RuntimeError("mallopt failed: not glibc?")


def to_markdown(r):
    lines = []
    if "bytes" in r:
        b = r["bytes"]
        lines += [f"Persistent bytes per parameter, AdamW, {b['params']:,} params (measured "
                  "from the buffers after one step):", "", "| variant | bytes/param |",
                  "| --- | --- |"]
        lines += [f"| {k} | {v:.3f} |" for k, v in b["bytes_per_param"].items()] + [""]
    if "peak" in r:
        lines += [f"Allocated inside one optimizer step at its peak, {r['peak']['params']:,} "
                  "params (torch's CPU allocator; the float32 master grads and temporaries):",
                  "", "| variant | bytes/param |", "| --- | --- |"]
        lines += [f"| {k} | {v:.3f} |" for k, v in r["peak"]["step_peak_bytes_per_param"].items()]
        lines += [""]
    if "overhead" in r:
        o = r["overhead"]
        heap = ("freed memory kept in the heap (--keep-freed-memory)" if r["keep_freed_memory"]
                else "glibc's default allocator settings")
        lines += [f"Optimizer update alone, {o['params']:,} params, {r['threads']} thread(s), "
                  f"{heap}, {o['rounds']} rounds of "
                  f"{o['steps_per_round']} steps (paired ratio: median over rounds of the "
                  "round's time / AdamW(foreach) on bf16 params):", "",
                  "| variant | median ms | paired ratio (min-max) |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['median_ms']:.1f} | {v['paired_median_ratio']:.2f} "
                  f"({v['ratio_min']:.2f}-{v['ratio_max']:.2f}) |"
                  for k, v in o["runs"].items()] + [""]
    if "loss" in r:
        x = r["loss"]
        m = x["model"]
        lines += [f"Eval loss after {x['steps']} AdamW steps, transformer {m['layers']}x"
                  f"{m['width']} (context {m['context']}, batch {m['batch']}, lr {m['lr']}), "
                  f"mean over {x['seeds']} seed(s) (init and data order); the gap is taken "
                  "per seed against its float32-master run (+- the std over seeds):", "",
                  "| variant | eval loss | gap vs float32 masters |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['eval_loss']:.4f} | {100 * v['gap_vs_float32_masters']:+.3f}% "
                  f"+- {100 * v['gap_std']:.3f}% |" for k, v in x["runs"].items()]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="bytes,peak,overhead,loss",
                    help="comma-separated: bytes, peak, overhead, loss")
    ap.add_argument("--params", type=int, default=2**22)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=1, help="loss: seeds to average over")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="glibc: fixed mmap and trim thresholds (mallopt), so freed buffers "
                         "stay in the heap and are not page-faulted in again next step, as "
                         "a caching allocator (CUDA's, jemalloc) keeps them")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    parts = [p for p in args.part.split(",") if p]
    unknown = sorted(set(parts) - {"bytes", "peak", "overhead", "loss"})
    if unknown:
        ap.error(f"--part: unknown {unknown}; choose from bytes, peak, overhead, loss")
    for name in ("params", "rounds", "steps_per_round", "steps", "seeds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.keep_freed_memory:
        keep_freed_memory()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    r = {"device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
         "keep_freed_memory": args.keep_freed_memory}
    if "bytes" in parts:
        r["bytes"] = bytes_part(args.params)
    if "peak" in parts:
        r["peak"] = peak_part(args.params)
    if "overhead" in parts:
        r["overhead"] = overhead_part(args.params, args.rounds, args.steps_per_round)
    if "loss" in parts:
        cfg = SimpleNamespace(layers=args.layers, width=args.width, heads=args.heads,
                              context=args.context, batch=args.batch, lr=args.lr, seed=0)
        r["loss"] = loss_part(args.steps, cfg, args.seeds)
    print(to_markdown(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
