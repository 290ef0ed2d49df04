"""What the precision report costs when it is built every step.

JAX: the MLP of ``jax_loss_scale.py`` (512-768-768-10 by default, batch 512) as a flax
Linen module, float16 compute (``mpfunc.get_policy("c=f16")``), jitted steps:

1. ``plain``: optax Adam, no scaling;
2. ``mpfunc``: ``mpfunc.dynamic_scale(adam)``;
   ``+ skip record``: ``dynamic_scale(adam, record_skip_leaves=True)`` (one reduction
   per leaf instead of one per group of alike leaves);
3. ``+ report``: the same step also builds ``mpfunc.precision_report`` of the unscaled
   gradients and returns it (never read);
4. ``+ report + watch``: and the forward runs under ``mpfunc.watch_nonfinite``.

torch: the 10M-param MLP of ``torch_memory.py`` (10 Linear(1024)+LayerNorm+GELU blocks
and a head, batch 64) with ``Adam(fused=True)``, in torch mode (float16 autocast) and
bf16 mode:

1. ``mpfunc``: ``optimizer.backward``, ``step`` (the default step);
2. ``+ skip record``: after ``optimizer.record_skip_leaves()`` (with a fused optimizer
   the check then runs per gradient, to record which params were non-finite);
3. ``+ report``: ``optimizer.precision_report()`` between backward and step (never read);
4. ``+ report + watch``: and the model under ``mpfunc_torch.watch_nonfinite``.

Variants run interleaved (A B C D A B C D ...); medians of the per-round step times.

    python benchmarks/precision_report.py [--framework both|jax|torch] [--device cpu|cuda]
        [--rounds 15] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from gpu_report import cpu_name


def _cpu() -> str:
    return f"CPU {cpu_name()}, {os.cpu_count()} cores"


def _interleaved(steps: dict, rounds: int, iters: int, sync=lambda: None) -> dict:
    for step in steps.values():  # warm up (and compile)
        step()
        step()
    sync()
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            sync()
            times[name].append((time.perf_counter() - t0) / iters)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def run_jax(args) -> dict:
    import flax.linen as nn
    import jax
    import optax

    import mpfunc

    sizes = [512, args.width, args.width, 10]
    policy = mpfunc.get_policy("c=f16")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i, width in enumerate(sizes[1:]):
                x = nn.Dense(width, name=f"dense_{i}")(x)
                x = nn.relu(x) if i < len(sizes) - 2 else x
            return x

    model = MLP()
    x = jax.random.normal(jax.random.key(1), (args.batch, sizes[0]))
    y = jax.random.randint(jax.random.key(2), (args.batch,), 0, 10)
    params = model.init(jax.random.key(0), x[:1])["params"]

    def loss_fn(p, watch):
        def forward():
            logits = model.apply({"params": policy.cast_to_compute(p)},
                                 policy.cast_to_compute(x))
            return policy.cast_to_output(logits)

        if watch:
            with mpfunc.watch_nonfinite() as w:
                logits = forward()
            flags = w.flags
        else:
            logits, flags = forward(), None
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), flags

    adam = optax.adam(1e-3)
    scaled = mpfunc.dynamic_scale(adam)

    @jax.jit
    def plain(p, s):
        grads = jax.grad(lambda q: loss_fn(q, False)[0])(p)
        u, s = adam.update(grads, s, p)
        return optax.apply_updates(p, u), s

    recording = mpfunc.dynamic_scale(adam, record_skip_leaves=True)

    def make(report, watch, tx=scaled):
        @jax.jit
        def step(p, s):
            out = mpfunc.value_and_grad(lambda q: loss_fn(q, watch), has_aux=True)(s, p)
            r = (mpfunc.precision_report(out.grads, loss_scale=s, forward=out.value[1])
                 if report else None)
            u, s = tx.update(out, s, p)
            return optax.apply_updates(p, u), s, r
        return step

    states = {"plain": [params, adam.init(params)]}
    fns = {"plain": plain, "mpfunc": make(False, False),
           "+ skip record": make(False, False, recording), "+ report": make(True, False),
           "+ report + watch": make(True, True)}
    for k in fns:
        if k != "plain":
            tx = recording if k == "+ skip record" else scaled
            states[k] = [params, tx.init(params)]

    def runner(k):
        def run():
            out = fns[k](*states[k])
            states[k] = list(out[:2])
            jax.block_until_ready(out)
        return run

    with jax.numpy_dtype_promotion("standard"):
        med = _interleaved({k: runner(k) for k in fns}, args.rounds, args.iters)
    n = sum(v.size for v in jax.tree.leaves(params))
    return {"device": _cpu(), "jax": jax.__version__, "params": n, "batch": args.batch,
            "rounds": args.rounds, "iters": args.iters, "median_step_ms": med,
            "vs_mpfunc": {k: v / med["mpfunc"] for k, v in med.items()}}


def run_torch(args) -> dict:
    import torch

    import mpfunc_torch

    def make_model():
        torch.manual_seed(0)
        layers = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.torch_width, args.torch_width),
                       torch.nn.LayerNorm(args.torch_width), torch.nn.GELU()]
        layers.append(torch.nn.Linear(args.torch_width, 10))
        return torch.nn.Sequential(*layers)

    device = torch.device(args.device)
    x = torch.randn(args.torch_batch, args.torch_width, device=device)
    y = torch.randint(0, 10, (args.torch_batch,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    for mode in ("torch", "bf16"):
        def make(report, watch, record=False, mode=mode):
            net = make_model().to(device)
            opt = torch.optim.Adam(net.parameters(), lr=1e-4, fused=True)
            model, opt, crit = mpfunc_torch.convert_to_amp(
                net, opt, torch.nn.CrossEntropyLoss(), mode=mode)
            if watch:
                mpfunc_torch.watch_nonfinite(model)
            if record:
                opt.record_skip_leaves()

            def step():
                opt.zero_grad()
                opt.backward(crit(model(x), y))
                if report:
                    opt.precision_report()
                opt.step()
            return step

        steps = {"mpfunc": make(False, False), "+ skip record": make(False, False, True),
                 "+ report": make(True, False), "+ report + watch": make(True, True)}
        med = _interleaved(steps, args.rounds, args.torch_iters, sync)
        out[mode] = {"median_step_ms": med,
                     "vs_mpfunc": {k: v / med["mpfunc"] for k, v in med.items()}}
    n = sum(p.numel() for p in make_model().parameters())
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu()
    return {"device": dev, "torch": torch.__version__, "params": n,
            "batch": args.torch_batch, "rounds": args.rounds, "iters": args.torch_iters,
            "modes": out}


def to_markdown(r: dict) -> str:
    lines = []
    if "jax" in r:
        j = r["jax"]
        lines += [f"JAX: {j['device']}; jax {j['jax']}; Linen MLP {j['params']:,} params, "
                  f"batch {j['batch']}, float16 compute; median of {j['rounds']} interleaved "
                  f"rounds x {j['iters']} steps.", "",
                  "| variant | step (ms) | vs mpfunc |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v:.2f} | {j['vs_mpfunc'][k]:.3f}x |"
                  for k, v in j["median_step_ms"].items()]
        lines.append("")
    if "torch" in r:
        t = r["torch"]
        lines += [f"torch: {t['device']}; torch {t['torch']}; MLP {t['params']:,} params, "
                  f"batch {t['batch']}, Adam(fused=True); median of {t['rounds']} "
                  f"interleaved rounds x {t['iters']} steps.", "",
                  "| mode | variant | step (ms) | vs mpfunc |", "| --- | --- | --- | --- |"]
        for mode, m in t["modes"].items():
            lines += [f"| {mode} | {k} | {v:.1f} | {m['vs_mpfunc'][k]:.3f}x |"
                      for k, v in m["median_step_ms"].items()]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["both", "jax", "torch"], default="both")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="torch's")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--depth", type=int, default=10)
    ap.add_argument("--torch-width", type=int, default=1024)
    ap.add_argument("--torch-batch", type=int, default=64)
    ap.add_argument("--torch-iters", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    r = {}
    if args.framework in ("both", "jax"):
        r["jax"] = run_jax(args)
    if args.framework in ("both", "torch"):
        r["torch"] = run_torch(args)
    print(to_markdown(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    main()
