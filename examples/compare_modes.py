"""Train the same small transformer in float32 and every AMP mode, in JAX and PyTorch.

A character-level language model on Python's standard-library source (no download),
written once per framework with the same architecture and the same initial weights (the
torch init is converted to JAX). Prints a table (memory, speed, losses, skipped steps,
final loss scale, ratios against each framework's float32 run), a cross-framework
parity report (same loss-scale trajectory? skips at the same steps? loss curves apart by
how much?), and saves a PNG of the loss curves and loss-scale trajectories.

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
    import torch

    import mpfunc_torch

    mode, config = MODES[name]
    dev = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    net = torch_model(cfg).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, fused=True)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=mode, **config)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, scales = [], []
    t0 = None
    with bar(cfg.steps, f"torch {name}", cfg.quiet) as pb:
        for i, (x, y) in enumerate(data):
            if i == cfg.warmup:
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            x = torch.from_numpy(x).long().to(dev)
            y = torch.from_numpy(y).long().to(dev)
            opt.zero_grad()
            loss = crit(model(x).flatten(0, 1), y.flatten())
            opt.backward(loss)
            opt.step()
            losses.append(loss.detach())
            scales.append(opt.loss_scale.detach().clone())
            pb.update()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    with torch.no_grad():
        ev = [crit(model(torch.from_numpy(x).long().to(dev)).flatten(0, 1),
                   torch.from_numpy(y).long().to(dev).flatten()).item() for x, y in evals]
    if dev.type == "cuda":
        mem, mem_kind = torch.cuda.max_memory_allocated(), "peak"
    else:
        tensors = [p for p in net.parameters()] + [p.grad for p in net.parameters()]
        tensors += [m for _, m in opt._pairs] + [m.grad for _, m in opt._pairs]
        tensors += [v for st in opt.optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
        mem = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        mem_kind = "state"
    metrics = opt.scale_metrics(as_python=True)
    return {
        "framework": "torch", "mode": name, "mem": mem, "mem_kind": mem_kind,
        "steps_s": (cfg.steps - cfg.warmup) / elapsed,
        "losses": torch.stack(losses).float().cpu().numpy(),
        "scales": torch.stack(scales).cpu().numpy(),
        "eval": float(np.mean(ev)), "skipped": metrics["skipped_steps"],
        "scale": metrics["loss_scale"],
    }


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
    t0 = None
    with jax.numpy_dtype_promotion("standard"), bar(cfg.steps, f"jax   {name}", cfg.quiet) as pb:
        for i, (x, y) in enumerate(data):
            if i == cfg.warmup:
                jax.block_until_ready(params)
                t0 = time.perf_counter()
            params, state, loss, scale = step(params, state, x, y)
            losses.append(loss)
            scales.append(scale)
            pb.update()
        jax.block_until_ready(params)
        elapsed = time.perf_counter() - t0
        ev = [float(jax.jit(loss_fn)(params, x, y)) for x, y in evals]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
        mem, mem_kind = stats["peak_bytes_in_use"], "peak"
    else:
        mem = sum(x.nbytes for x in jax.tree.leaves((params, state)) if hasattr(x, "nbytes"))
        mem += sum(x.nbytes for x in jax.tree.leaves(params) if hasattr(x, "nbytes"))  # grads
        mem_kind = "state"
    m = mpfunc.scale_metrics(state)
    return {
        "framework": "jax", "mode": name, "mem": mem, "mem_kind": mem_kind,
        "steps_s": (cfg.steps - cfg.warmup) / elapsed,
        "losses": np.asarray(jax.device_get(losses), np.float32),
        "scales": np.asarray(jax.device_get(scales), np.float32),
        "eval": float(np.mean(ev)), "skipped": int(m["skipped_steps"]),
        "scale": float(m["loss_scale"]),
    }


# ---------------------------------------------------------------------------- reports
def table(results, cfg):
    base = {r["framework"]: r for r in results if r["mode"] == "fp32"}
    kind = results[0]["mem_kind"]
    head = (f"| framework | mode | {'peak' if kind == 'peak' else 'state after a step'} MiB "
            "| steps/s | samples/s | train loss | eval loss | skipped | loss scale "
            "| speed vs fp32 | memory vs fp32 |")
    lines = [head, "|" + " --- |" * 11]
    for r in results:
        b = base.get(r["framework"])
        speed = f"{r['steps_s'] / b['steps_s']:.2f}x" if b else "-"
        memr = f"{r['mem'] / b['mem']:.2f}x" if b else "-"
        lines.append(
            f"| {r['framework']} | {r['mode']} | {r['mem'] / 2**20:.1f} | {r['steps_s']:.1f} "
            f"| {r['steps_s'] * cfg.batch:.0f} | {np.mean(r['losses'][-10:]):.4f} "
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in results:
        style = "-" if r["framework"] == "jax" else "--"
        a.plot(r["losses"], style, lw=1, label=f"{r['framework']} {r['mode']}")
        if r["mode"] != "fp32":
            b.plot(r["scales"], style, lw=1.2, label=f"{r['framework']} {r['mode']}")
    a.set(title="training loss", xlabel="step", ylabel="cross-entropy")
    b.set(title="loss scale", xlabel="step", yscale="log")
    a.legend(fontsize=7, ncol=2)
    b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    ap.add_argument("--device", choices=["cpu", "cuda", "gpu"], default="cpu")
    ap.add_argument("--out", default="out", help="folder for the PNG")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    cfg = ap.parse_args(argv)
    if cfg.device == "gpu":
        cfg.device = "cuda"
    if cfg.quick:
        cfg.steps, cfg.batch, cfg.context, cfg.width = 60, 16, 32, 64
    cfg.warmup = min(5, cfg.steps // 4)
    modes = ["fp32"] + [m for m in cfg.modes.split(",") if m and m != "fp32"]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    if cfg.device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    train, held_out = split(load_corpus())
    it = windows(train, cfg.context + 1, cfg.batch, seed=cfg.seed)
    data = [(s[:, :-1], s[:, 1:]) for s, _ in (next(it) for _ in range(cfg.steps))]
    ev_it = windows(held_out, cfg.context + 1, cfg.batch, seed=cfg.seed + 1)
    evals = [(s[:, :-1], s[:, 1:]) for s, _ in (next(ev_it) for _ in range(4))]
    print(f"data: {len(train):,} training / {len(held_out):,} held-out characters of Python "
          f"stdlib source; model: {cfg.layers}-layer transformer, width {cfg.width}, "
          f"context {cfg.context}; {cfg.steps} steps of batch {cfg.batch} on {cfg.device}")

    results = []
    init_params = torch_to_jax_params(torch_model(cfg))  # the JAX runs start from torch's init
    for name in modes:
        if cfg.framework in ("both", "jax"):
            results.append(run_jax(name, cfg, data, evals, init_params))
        if cfg.framework in ("both", "torch"):
            results.append(run_torch(name, cfg, data, evals))
    results.sort(key=lambda r: (r["framework"], modes.index(r["mode"])))
    print()
    print(table(results, cfg))
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
