"""Train the same small transformer in float32 and every AMP mode, in JAX and PyTorch.

A character-level language model on Python's standard-library source (no download),
written once per framework with the same architecture and the same initial weights (the
torch init is converted to JAX). Prints a table (memory, speed, losses, skipped steps,
final loss scale, ratios against each framework's float32 run), a cross-framework
parity report (same loss-scale trajectory? skips at the same steps? loss curves apart by
how much?), and saves a PNG of the loss curves and loss-scale trajectories.

Speed is measured after training, in rounds that time a few more steps of every run back
to back (round-robin), so a busy spell on a shared machine slows all runs of a round
alike: the table shows the median over rounds and the min-max of the per-round ratios.

    python examples/compare_modes.py --quick            # < 2 minutes on 2 CPU cores
    python examples/compare_modes.py --device cuda --steps 2000 --batch 64 --width 256
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import VOCAB, load_corpus, split, windows  # noqa: E402

# mode name -> (mode, config); the same names on both sides.
MODES = {
    "fp32": ("torch", {"enabled": False}),
    "torch": ("torch", {}),
    "apex-O1": ("apex", {"opt_level": "O1", "verbosity": 0}),
    "apex-O2": ("apex", {"opt_level": "O2", "verbosity": 0}),
    "naive": ("naive", {}),
    "bf16": ("bf16", {}),
    "fp8": ("fp8", {}),
}
DEFAULT_MODES = ["torch", "apex-O1", "apex-O2", "naive", "bf16", "fp8"]


# ------------------------------------------------------------------------- torch model
def torch_model(cfg):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x, mask):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg.width
            self.tok = nn.Embedding(VOCAB, d)
            self.pos = nn.Parameter(torch.randn(cfg.context, d) * 0.02)
            self.blocks = nn.ModuleList([Block(d, cfg.heads) for _ in range(cfg.layers)])
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)
            self.register_buffer("mask", torch.ones(cfg.context, cfg.context).triu(1).bool(),
                                 persistent=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            for blk in self.blocks:
                x = blk(x, self.mask[: idx.shape[1], : idx.shape[1]])
            return self.head(self.ln_f(x))

    torch.manual_seed(cfg.seed)
    return GPT()


def torch_to_jax_params(model):
    """The torch init as a JAX params tree (Linear weights transposed)."""
    sd = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}

    def lin(name):
        return {"w": sd[f"{name}.weight"].T.copy(), "b": sd[f"{name}.bias"].copy()}

    def ln(name):
        return {"scale": sd[f"{name}.weight"].copy(), "bias": sd[f"{name}.bias"].copy()}

    blocks = []
    i = 0
    while f"blocks.{i}.qkv.weight" in sd:
        p = f"blocks.{i}"
        blocks.append({"ln1": ln(f"{p}.ln1"), "ln2": ln(f"{p}.ln2"), "qkv": lin(f"{p}.qkv"),
                       "proj": lin(f"{p}.proj"), "fc": lin(f"{p}.fc"), "out": lin(f"{p}.out")})
        i += 1
    return {"tok": sd["tok.weight"], "pos": sd["pos"], "blocks": blocks,
            "ln_f": ln("ln_f"), "head": lin("head")}


# --------------------------------------------------------------------------- JAX model
def jax_apply(cfg):
    import jax
    import jax.numpy as jnp

    def layer_norm(x, p):
        m = x.mean(-1, keepdims=True)
        v = jnp.square(x - m).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * p["scale"] + p["bias"]

    def dense(x, p):
        return x @ p["w"] + p["b"]

    def apply(params, idx):
        b, t = idx.shape
        d, h = cfg.width, cfg.heads
        x = params["tok"][idx] + params["pos"][:t]
        mask = jnp.triu(jnp.ones((t, t), bool), 1)
        for blk in params["blocks"]:
            q, k, v = jnp.split(dense(layer_norm(x, blk["ln1"]), blk["qkv"]), 3, axis=-1)
            q, k, v = (z.reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for z in (q, k, v))
            att = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(d // h)
            att = jax.nn.softmax(jnp.where(mask, -jnp.inf, att), axis=-1)
            x = x + dense((att @ v).transpose(0, 2, 1, 3).reshape(b, t, d), blk["proj"])
            hidden = jax.nn.gelu(dense(layer_norm(x, blk["ln2"]), blk["fc"]), approximate=True)
            x = x + dense(hidden, blk["out"])
        return dense(layer_norm(x, params["ln_f"]), params["head"])

    return apply


# ------------------------------------------------------------------------------- runs
def bar(total, desc, quiet):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=quiet, ncols=80)


def run_torch(name, cfg, data, evals):
    """Trains one mode; returns its result and a `timed(n)` that runs n more steps."""
    import torch

    import mpfunc_torch

    mode, config = MODES[name]
    dev = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    # Earlier runs stay alive for the timing rounds: count only what this run adds.
    base_mem = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    net = torch_model(cfg).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, fused=True)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=mode, **config)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step(x, y):
        x = torch.from_numpy(x).long().to(dev)
        y = torch.from_numpy(y).long().to(dev)
        opt.zero_grad()
        loss = crit(model(x).flatten(0, 1), y.flatten())
        opt.backward(loss)
        opt.step()
        return loss

    losses, scales = [], []
    with bar(cfg.steps, f"torch {name}", cfg.quiet) as pb:
        for x, y in data:
            losses.append(step(x, y).detach())
            scales.append(opt.loss_scale.detach().clone())
            pb.update()
    with torch.no_grad():
        ev = [crit(model(torch.from_numpy(x).long().to(dev)).flatten(0, 1),
                   torch.from_numpy(y).long().to(dev).flatten()).item() for x, y in evals]
    if dev.type == "cuda":
        mem, mem_kind = torch.cuda.max_memory_allocated() - base_mem, "peak"
    else:
        tensors = [p for p in net.parameters()] + [p.grad for p in net.parameters()]
        tensors += [m for _, m in opt._pairs] + [m.grad for _, m in opt._pairs]
        tensors += [v for st in opt.optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
        mem = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        mem_kind = "state"
    metrics = opt.scale_metrics(as_python=True)

    def timed(n, start):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(start, start + n):
            step(*data[i % len(data)])
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return {
        "framework": "torch", "mode": name, "mem": mem, "mem_kind": mem_kind,
        "losses": torch.stack(losses).float().cpu().numpy(),
        "scales": torch.stack(scales).cpu().numpy(),
        "eval": float(np.mean(ev)), "skipped": metrics["skipped_steps"],
        "scale": metrics["loss_scale"],
    }, timed


def run_jax(name, cfg, data, evals, init_params):
    import jax
    import jax.numpy as jnp
    import optax

    import mpfunc

    mode, config = MODES[name]
    amp = mpfunc.convert_to_amp(jax_apply(cfg), optax.adam(cfg.lr), mode=mode, **config)
    device = jax.devices("gpu")[0] if cfg.device == "cuda" else jax.devices("cpu")[0]
    params = jax.device_put(amp.cast_params(jax.tree.map(jnp.asarray, init_params)), device)
    state = amp.optimizer.init(params)

    def loss_fn(p, x, y):
        logits = amp.apply_fn(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, state, x, y):
        grads, loss = jax.grad(lambda p: (mpfunc.scale_loss(loss_fn(p, x, y), state),
                                          loss_fn(p, x, y)), has_aux=True)(params)
        updates, state = amp.optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, mpfunc.loss_scale(state)

    losses, scales = [], []
    with jax.numpy_dtype_promotion("standard"), bar(cfg.steps, f"jax   {name}", cfg.quiet) as pb:
        for x, y in data:
            params, state, loss, scale = step(params, state, x, y)
            losses.append(loss)
            scales.append(scale)
            pb.update()
        jax.block_until_ready(params)
        ev = [float(jax.jit(loss_fn)(params, x, y)) for x, y in evals]
    if cfg.device == "cuda":
        # XLA's peak for one compiled step (arguments, temporaries, outputs): the device's
        # own peak_bytes_in_use only ever grows over the process, so it would carry the
        # largest earlier run into every later one.
        with jax.numpy_dtype_promotion("standard"):
            compiled = step.lower(params, state, *data[0]).compile()
        mem, mem_kind = compiled.memory_analysis().peak_memory_in_bytes, "peak"
    else:
        mem = sum(x.nbytes for x in jax.tree.leaves((params, state)) if hasattr(x, "nbytes"))
        mem += sum(x.nbytes for x in jax.tree.leaves(params) if hasattr(x, "nbytes"))  # grads
        mem_kind = "state"
    m = mpfunc.scale_metrics(state)
    result = {
        "framework": "jax", "mode": name, "mem": mem, "mem_kind": mem_kind,
        "losses": np.asarray(jax.device_get(losses), np.float32),
        "scales": np.asarray(jax.device_get(scales), np.float32),
        "eval": float(np.mean(ev)), "skipped": int(m["skipped_steps"]),
        "scale": float(m["loss_scale"]),
    }
    live = [params, state]

    def timed(n, start):
        with jax.numpy_dtype_promotion("standard"):
            jax.block_until_ready(live)
            t0 = time.perf_counter()
            for i in range(start, start + n):
                live[0], live[1], _, _ = step(live[0], live[1], *data[i % len(data)])
            jax.block_until_ready(live)
            return time.perf_counter() - t0

    return result, timed


def time_interleaved(timers, cfg):
    """Steps/s of every run, timed round-robin so a busy spell slows all runs alike.

    Each round times `cfg.window` further training steps of every run back to back (the
    starting run rotates), so the runs of one round share the machine's load. Returns,
    per run, one steps/s figure per round.
    """
    keys = list(timers)
    rates = {k: [] for k in keys}
    start = 0
    with bar(cfg.rounds * len(keys), "timing", cfg.quiet) as pb:
        for r in range(cfg.rounds):
            for k in keys[r % len(keys):] + keys[: r % len(keys)]:
                rates[k].append(cfg.window / timers[k](cfg.window, start))
                pb.update()
            start += cfg.window
    return rates


# ---------------------------------------------------------------------------- reports
def table(results, cfg):
    """The main table. Speeds are medians over the interleaved timing rounds; the speed
    ratio is the median of the per-round ratios (both runs timed in the same round), with
    its min-max over the rounds in brackets."""
    base = {r["framework"]: r for r in results if r["mode"] == "fp32"}
    kind = results[0]["mem_kind"]
    head = (f"| framework | mode | {'peak' if kind == 'peak' else 'state after a step'} MiB "
            "| steps/s | samples/s | train loss | eval loss | skipped | loss scale "
            "| speed vs fp32 (min-max) | memory vs fp32 |")
    lines = [head, "|" + " --- |" * 11]
    for r in results:
        b = base.get(r["framework"])
        steps_s = float(np.median(r["rates"]))
        if b:
            ratios = np.asarray(r["rates"]) / np.asarray(b["rates"])
            speed = f"{np.median(ratios):.2f}x ({ratios.min():.2f}-{ratios.max():.2f})"
        else:
            speed = "-"
        memr = f"{r['mem'] / b['mem']:.2f}x" if b else "-"
        lines.append(
            f"| {r['framework']} | {r['mode']} | {r['mem'] / 2**20:.1f} | {steps_s:.1f} "
            f"| {steps_s * cfg.batch:.0f} | {np.mean(r['losses'][-10:]):.4f} "
            f"| {r['eval']:.4f} | {r['skipped']} | {r['scale']:g} | {speed} | {memr} |")
    return "\n".join(lines)


def parity(results):
    by = {(r["framework"], r["mode"]): r for r in results}
    lines = ["| mode | same loss-scale trajectory | same skipped steps | max rel. loss diff |",
             "| --- | --- | --- | --- |"]
    for mode in dict.fromkeys(r["mode"] for r in results):
        j, t = by.get(("jax", mode)), by.get(("torch", mode))
        if not (j and t):
            continue
        same_scale = bool(np.array_equal(j["scales"].view(np.uint32), t["scales"].view(np.uint32)))
        skip_j = np.flatnonzero(np.diff(np.concatenate([[0], j["scales"]])) < 0)
        skip_t = np.flatnonzero(np.diff(np.concatenate([[0], t["scales"]])) < 0)
        rel = np.max(np.abs(j["losses"] - t["losses"]) / np.abs(t["losses"]))
        lines.append(f"| {mode} | {'yes' if same_scale else 'NO'} | "
                     f"{'yes' if np.array_equal(skip_j, skip_t) else 'NO'} | {rel:.2e} |")
    return "\n".join(lines)


def plot(results, path):
    """Loss curves and loss-scale trajectories: one colour per mode (the same in both
    panels and frameworks), solid lines for JAX and dashed for torch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in results))
    colour = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(modes)}
    style = {"jax": "-", "torch": "--"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in results:
        kw = dict(color=colour[r["mode"]], linestyle=style[r["framework"]],
                  label=f"{r['framework']} {r['mode']}")
        a.plot(r["losses"], lw=1, **kw)
        if r["mode"] != "fp32":
            b.plot(r["scales"], lw=1.2, **kw)
    a.set(title="training loss (modes that agree draw over each other)", xlabel="step",
          ylabel="cross-entropy (nats)")
    b.set(title="loss scale (skipped steps back it off)", xlabel="step",
          ylabel="loss scale (log scale)", yscale="log")
    a.legend(fontsize=7, ncol=2)
    b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cuda_problems(frameworks):
    """Why ``--device cuda`` cannot run here, per framework (empty when it can)."""
    problems = []
    if "torch" in frameworks:
        import torch

        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} is a CPU-only build")
        elif not torch.cuda.is_available():
            problems.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
                            "CUDA device")
    if "jax" in frameworks:
        import jax

        try:
            jax.devices("gpu")
        except RuntimeError as e:
            reason = str(e).splitlines()[0]
            if os.environ.get("JAX_PLATFORMS"):
                reason += f"; JAX_PLATFORMS={os.environ['JAX_PLATFORMS']!r} is set"
            problems.append(f"jax {jax.__version__} has no GPU backend ({reason})")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run: < 2 min on 2 CPU cores")
    ap.add_argument("--framework", choices=["both", "jax", "torch"], default="both")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated, from {list(MODES)} (fp32 always runs)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=7,
                    help="interleaved timing rounds after training (speed = their median)")
    ap.add_argument("--window", type=int, default=20, help="steps per run per timing round")
    ap.add_argument("--device", choices=["cpu", "cuda", "gpu"], default="cpu")
    ap.add_argument("--out", default="out", help="folder for the PNG")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    cfg = ap.parse_args(argv)
    if cfg.device == "gpu":
        cfg.device = "cuda"
    if cfg.quick:
        cfg.steps, cfg.batch, cfg.context, cfg.width = 60, 16, 32, 64
        cfg.rounds, cfg.window = 5, 5
    modes = ["fp32"] + [m for m in cfg.modes.split(",") if m and m != "fp32"]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    if cfg.rounds < 1 or cfg.window < 1:
        ap.error(f"--rounds and --window must be >= 1, got {cfg.rounds} and {cfg.window}")
    frameworks = ["jax", "torch"] if cfg.framework == "both" else [cfg.framework]
    if cfg.device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    elif problems := cuda_problems(frameworks):
        ap.exit(2, "compare_modes.py: --device cuda needs a CUDA GPU, but\n  - "
                + "\n  - ".join(problems) + "\nRun on a GPU machine with torch's CUDA build "
                "and pip install 'mpfunc[cuda13]' (or cuda12), or use --device cpu.\n")

    train, held_out = split(load_corpus())
    it = windows(train, cfg.context + 1, cfg.batch, seed=cfg.seed)
    data = [(s[:, :-1], s[:, 1:]) for s, _ in (next(it) for _ in range(cfg.steps))]
    ev_it = windows(held_out, cfg.context + 1, cfg.batch, seed=cfg.seed + 1)
    evals = [(s[:, :-1], s[:, 1:]) for s, _ in (next(ev_it) for _ in range(4))]
    print(f"data: {len(train):,} training / {len(held_out):,} held-out characters of Python "
          f"stdlib source; model: {cfg.layers}-layer transformer, width {cfg.width}, "
          f"context {cfg.context}; {cfg.steps} steps of batch {cfg.batch} on {cfg.device}")

    results, timers = [], {}
    init_params = torch_to_jax_params(torch_model(cfg))  # the JAX runs start from torch's init
    for name in modes:
        for fw in frameworks:
            if fw == "jax":
                result, timed = run_jax(name, cfg, data, evals, init_params)
            else:
                result, timed = run_torch(name, cfg, data, evals)
            results.append(result)
            timers[fw, name] = timed
    rates = time_interleaved(timers, cfg)
    for r in results:
        r["rates"] = rates[r["framework"], r["mode"]]
    results.sort(key=lambda r: (r["framework"], modes.index(r["mode"])))
    print()
    print(table(results, cfg))
    print(f"\nsteps/s: median of {cfg.rounds} timing rounds of {cfg.window} steps per run after "
          "training, the runs interleaved round-robin; speed vs fp32: median (min-max) of "
          "the per-round ratios")
    if cfg.framework == "both":
        print("\nCross-framework parity (same config, same data, same initial weights):")
        print(parity(results))
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    png = Path(cfg.out) / "compare_modes.png"
    plot(results, png)
    print(f"\nloss curves and loss-scale trajectories: {png}")
    return results


if __name__ == "__main__":
    main()
