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

The JAX model runs its blocks under ``jax.lax.scan`` over params stacked along a layer
axis, so its step compiles in about the same time at 12 layers as at 2 (BENCHMARKS.md);
``--no-scan`` unrolls them in a Python loop instead.

Each JAX run's train step is compiled once, ahead of time, with its params, state and
batches already on the device; that one executable trains, is timed and gives the
memory figure (evaluation compiles once more). The table's last lines say how often each
compiled and how long it took: cold, then warm. JAX's persistent compilation cache is on
(``$MPFUNC_JAX_CACHE``, else ``~/.cache/mpfunc/jax``; ``--no-compile-cache`` turns it
off): the warm figure is a second compile of the step after ``jax.clear_caches()``,
loaded from that folder, as a second run of the demo loads it. ``--compiler-options``
passes XLA options to every JAX compile (a preset of ``benchmarks/_jax_compiles.py``'s
``XLA_OPTION_SETS``, or ``xla_name=value`` pairs; default: XLA's own). On a GPU, float32 is strict float32 in both frameworks (JAX
``default_matmul_precision="highest"``, torch TF32 off) and a ``tf32`` run of each adds
a second ratio column against TF32.

    python examples/compare_modes.py --quick            # 2 CPU cores: 1.5 min, 2.5 cold
    python examples/compare_modes.py --device cuda --layers 12 --width 768 --heads 12 \
        --context 512 --batch 8 --steps 200 --json out/compare_modes.json
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import sys
import threading
import time
from pathlib import Path

# Before jax starts: by default it takes 75% of a GPU's memory at its first use, leaving
# torch (in this same process) too little, and every torch run's peak memory figure
# would be measured beside that reservation. Allocate on demand instead.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The benchmarks' compile helpers (they import jax only when used).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _jax_compiles import (  # noqa: E402
    XLA_OPTION_SETS,
    CompileCounter,
    add_cache_args,
    cache_from_args,
    compile_cold_warm,
    compiler_options,
)
from compare_report import compile_summary, parity, plot, table, to_json  # noqa: E402
from data import VOCAB, load_corpus, split, windows  # noqa: E402

# mode name -> (mode, config); the same names on both sides.
MODES = {
    "fp32": ("torch", {"enabled": False}),
    "tf32": ("torch", {"enabled": False}),  # float32 with TF32 matmuls (GPU only)
    "torch": ("torch", {}),
    "apex-O1": ("apex", {"opt_level": "O1", "verbosity": 0}),
    "apex-O2": ("apex", {"opt_level": "O2", "verbosity": 0}),
    "naive": ("naive", {}),
    "bf16": ("bf16", {}),
    # bfloat16 params without float32 masters (bfloat16 Adam moments): the exact
    # remainder (8 bytes a param) and stochastic rounding (6 bytes a param).
    "bf16-remainder": ("bf16", {"master_weights": "remainder", "state_dtype": "bfloat16"}),
    "bf16-stochastic": ("bf16", {"master_weights": "stochastic", "state_dtype": "bfloat16"}),
    "fp8": ("fp8", {}),
}
DEFAULT_MODES = ["torch", "apex-O1", "apex-O2", "naive", "bf16", "bf16-remainder",
                 "bf16-stochastic", "fp8"]


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


def torch_to_jax_params(model, stacked=True):
    """The torch init as a JAX params tree (Linear weights transposed).

    ``params["blocks"]`` is the blocks' params stacked along a leading layer axis (each
    leaf ``[layers, ...]``, what `jax_apply`'s scanned model takes), or with
    ``stacked=False`` a list of per-layer dicts (the unrolled model's)."""
    import jax

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
    if stacked:
        blocks = jax.tree.map(lambda *layers: np.stack(layers), *blocks)
    return {"tok": sd["tok.weight"], "pos": sd["pos"], "blocks": blocks,
            "ln_f": ln("ln_f"), "head": lin("head")}


# --------------------------------------------------------------------------- JAX model
def jax_apply(cfg):
    """``apply(params, idx)``, the JAX model: ``cfg.scan`` (default True) runs the blocks
    under ``jax.lax.scan`` over stacked block params (`torch_to_jax_params`'s
    ``stacked=True``); False unrolls a Python loop over a list of per-layer dicts."""
    import jax
    import jax.numpy as jnp

    def layer_norm(x, p):
        m = x.mean(-1, keepdims=True)
        v = jnp.square(x - m).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * p["scale"] + p["bias"]

    def dense(x, p):
        return x @ p["w"] + p["b"]

    def block(x, blk, mask):
        b, t, d = x.shape
        h = cfg.heads
        q, k, v = jnp.split(dense(layer_norm(x, blk["ln1"]), blk["qkv"]), 3, axis=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for z in (q, k, v))
        att = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(d // h)
        att = jax.nn.softmax(jnp.where(mask, -jnp.inf, att), axis=-1)
        x = x + dense((att @ v).transpose(0, 2, 1, 3).reshape(b, t, d), blk["proj"])
        hidden = jax.nn.gelu(dense(layer_norm(x, blk["ln2"]), blk["fc"]), approximate=True)
        return x + dense(hidden, blk["out"])

    def apply(params, idx):
        t = idx.shape[1]
        x = params["tok"][idx] + params["pos"][:t]
        mask = jnp.triu(jnp.ones((t, t), bool), 1)
        if getattr(cfg, "scan", True):
            # One block, compiled once: its params are stacked along a leading layer
            # axis, and the scan slices one layer per iteration. The unrolled loop's
            # compile time grows with depth (the 12-layer step took 4.4-4.75x the
            # 2-layer one's on CPU); the scanned one's barely does (BENCHMARKS.md).
            x, _ = jax.lax.scan(lambda x, blk: (block(x, blk, mask), None), x,
                                params["blocks"])
        else:
            for blk in params["blocks"]:
                x = block(x, blk, mask)
        return dense(layer_norm(x, params["ln_f"]), params["head"])

    return apply


def jax_train_step(amp):
    """``(step, loss_fn)`` of the JAX runs, for the `mpfunc.convert_to_amp` setup ``amp``:
    ``step(params, state, x, y) -> (params, state, loss, loss_scale)``, one forward and
    one backward, and ``loss_fn(params, x, y)`` (the mean cross-entropy)."""
    import jax
    import optax

    import mpfunc

    def loss_fn(p, x, y):
        logits = amp.apply_fn(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, state, x, y):
        def scaled_loss(p):  # one forward: the unscaled loss comes back as the aux
            loss = loss_fn(p, x, y)
            return mpfunc.scale_loss(loss, state), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        updates, state = amp.optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, mpfunc.loss_scale(state)

    return step, loss_fn


# ------------------------------------------------------------------------------- runs
def bar(total, desc, quiet):
    """A progress bar on a terminal. Elsewhere (a log file, a pipe) a bar is escape
    sequences, not progress: one line per finished run instead. Nothing with --quiet."""
    if not quiet and not sys.stderr.isatty():
        return DoneLine(total, desc)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, ncols=80, disable=quiet)


class DoneLine:
    """`bar` off a terminal: counts like a bar, and prints one line to stderr when done."""

    def __init__(self, total, desc):
        self.total, self.desc, self.n = total, " ".join(desc.split()), 0

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def update(self, n=1):
        self.n += n

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            print(f"compare_modes.py: {self.desc} done, {self.n}/{self.total} in "
                  f"{time.perf_counter() - self.t0:.1f} s", file=sys.stderr, flush=True)


class Watchdog:
    """Says where a run stopped making progress: if no `beat` comes for ``timeout``
    seconds, it prints what the last beat said and every thread's Python stack (through
    ``faulthandler``, which works while C++ holds the GIL). 0 turns it off."""

    def __init__(self, timeout: float):
        self.timeout, self.where, self._timer = timeout, "start", None

    def beat(self, where: str) -> None:
        if not self.timeout:
            return
        self.where = where
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(self.timeout, self._report)
        self._timer.daemon = True
        self._timer.start()
        faulthandler.dump_traceback_later(self.timeout + 1, exit=False)

    def _report(self) -> None:
        print(f"\ncompare_modes.py: no progress for {self.timeout:g} s, in {self.where}; "
              "the Python stacks follow.", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.timeout:
            faulthandler.cancel_dump_traceback_later()


WATCHDOG = Watchdog(0)


def set_tf32(on: bool) -> None:
    """torch's float32 matmul and convolution precision (no-op without CUDA)."""
    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


def run_torch(name, cfg, data, evals):
    """Trains one mode; returns its result and a `timed(n)` that runs n more steps."""
    import torch

    import mpfunc_torch

    mode, config = MODES[name]
    dev = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    tf32 = name == "tf32"
    set_tf32(tf32)
    # Earlier runs stay alive for the timing rounds: count only what this run adds.
    base_mem = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    data = [(torch.from_numpy(x).long().to(dev), torch.from_numpy(y).long().to(dev))
            for x, y in data]
    net = torch_model(cfg).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, fused=True)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=mode, **config)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step(x, y):
        opt.zero_grad()
        loss = crit(model(x).flatten(0, 1), y.flatten())
        opt.backward(loss)
        opt.step()
        return loss

    losses, scales = [], []
    with bar(cfg.steps, f"torch {name}", cfg.quiet) as pb:
        for i, (x, y) in enumerate(data):
            WATCHDOG.beat(f"torch {name}, training step {i}")
            losses.append(step(x, y).detach())
            scales.append(opt.loss_scale.detach().clone())
            pb.update()
    WATCHDOG.beat(f"torch {name}, evaluation")
    with torch.no_grad():
        ev = [crit(model(torch.from_numpy(x).long().to(dev)).flatten(0, 1),
                   torch.from_numpy(y).long().to(dev).flatten()).item() for x, y in evals]
    if dev.type == "cuda":
        mem, mem_kind = torch.cuda.max_memory_allocated() - base_mem, "peak"
    else:
        # Params, masters (or what stands in for them: remainders, compensation), the
        # optimizer state, each buffer counted once, from the buffers; plus the grads.
        from mpfunc_torch._src.low_precision import persistent_bytes

        grads = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                 for g in [p.grad for p in net.parameters()] + [m.grad for _, m in opt._pairs]
                 if g is not None}
        mem, mem_kind = persistent_bytes(opt, net) + sum(grads.values()), "state"
    metrics = opt.scale_metrics(as_python=True)

    def timed(n, start):
        set_tf32(tf32)  # the runs are interleaved: each sets its own precision
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


def run_jax(name, cfg, data, evals, init_params, compiles):
    import jax
    import jax.numpy as jnp
    import optax

    import mpfunc

    mode, config = MODES[name]
    amp = mpfunc.convert_to_amp(jax_apply(cfg), optax.adam(cfg.lr), mode=mode, **config)
    device = jax.devices("gpu")[0] if cfg.device == "cuda" else jax.devices("cpu")[0]
    # Everything the step takes is on the device (committed) before it is compiled, so
    # the step that trains and the one that is timed are the one compiled here.
    params = jax.device_put(amp.cast_params(jax.tree.map(jnp.asarray, init_params)), device)
    state = jax.device_put(amp.optimizer.init(params), device)
    data = jax.device_put(data, device)

    step, loss_fn = jax_train_step(amp)
    step_name, eval_name = f"train_step_{name}", f"eval_loss_{name}"
    step.__name__ = step.__qualname__ = step_name
    loss_fn.__name__ = loss_fn.__qualname__ = eval_name
    # fp32 is strict float32 (as torch's default, TF32 off); tf32 is JAX's GPU default
    # made explicit. The half modes' matmuls are half whatever this says. On CPU both
    # float32 runs are plain float32.
    precision = {"fp32": "highest", "tf32": "tensorfloat32"}.get(name)
    WATCHDOG.beat(f"jax {name}, compiling the train step (then again, from the cache)")
    with jax.numpy_dtype_promotion("standard"), jax.default_matmul_precision(precision):
        step_c, compile_rec = compile_cold_warm(
            lambda: jax.jit(step).lower(params, state, *data[0]), compiles, cfg.xla_options)
        WATCHDOG.beat(f"jax {name}, compiling the evaluation")
        t0 = time.perf_counter()
        eval_c = jax.jit(loss_fn).lower(params, *jax.device_put(evals[0], device)).compile(
            compiler_options=cfg.xla_options)
        eval_compile_s = time.perf_counter() - t0

    losses, scales = [], []
    with bar(cfg.steps, f"jax   {name}", cfg.quiet) as pb:
        for i, (x, y) in enumerate(data):
            WATCHDOG.beat(f"jax {name}, training step {i}")
            params, state, loss, scale = step_c(params, state, x, y)
            losses.append(loss)
            scales.append(scale)
            pb.update()
        WATCHDOG.beat(f"jax {name}, waiting for the last training step")
        jax.block_until_ready(params)
    WATCHDOG.beat(f"jax {name}, evaluation")
    ev = [float(eval_c(params, *jax.device_put(b, device))) for b in evals]
    if cfg.device == "cuda":
        # XLA's peak for the compiled step (arguments, temporaries, outputs): the device's
        # own peak_bytes_in_use only ever grows over the process, so it would carry the
        # largest earlier run into every later one.
        mem, mem_kind = step_c.memory_analysis().peak_memory_in_bytes, "peak"
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
        "scale": float(m["loss_scale"]), "compile": compile_rec,
        "compile_s": compile_rec["first"]["total_s"], "eval_compile_s": eval_compile_s,
        # Filled in at the end, after the timing rounds have run this step again.
        "compiles": lambda: {"step": compiles.of(step_name), "eval": compiles.of(eval_name)},
    }
    live = [params, state]

    def timed(n, start):
        jax.block_until_ready(live)
        t0 = time.perf_counter()
        for i in range(start, start + n):
            live[0], live[1], _, _ = step_c(live[0], live[1], *data[i % len(data)])
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
                    help=f"comma-separated, from {list(MODES)} (fp32 always runs, and tf32 "
                    "too on a GPU)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True,
                    help="JAX: run the blocks under jax.lax.scan over stacked params "
                    "(compile time nearly flat in depth); --no-scan unrolls a Python loop")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=7,
                    help="interleaved timing rounds after training (speed = their median)")
    ap.add_argument("--window", type=int, default=20, help="steps per run per timing round")
    ap.add_argument("--device", choices=["cpu", "cuda", "gpu"], default="cpu")
    ap.add_argument("--out", default="out", help="folder for the PNG")
    ap.add_argument("--json", default=None, help="also write every figure here")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress (bars on a terminal, else a line per finished run)")
    ap.add_argument("--stall-timeout", type=float, default=None,
                    help="seconds without progress before the stacks are printed "
                    "(default 300 on a GPU, off on CPU; 0 turns it off)")
    ap.add_argument("--compiler-options", default="default", metavar="PRESET|NAME=VALUE,...",
                    help="XLA compiler options for every JAX compile: a preset from "
                    f"{list(XLA_OPTION_SETS)} or xla_name=value pairs (default: XLA's own)")
    add_cache_args(ap)
    cfg = ap.parse_args(argv)
    if cfg.quick:  # smaller defaults; what is given explicitly still wins
        ap.set_defaults(steps=60, batch=16, context=32, width=64, rounds=5, window=5)
        cfg = ap.parse_args(argv)
    if cfg.device == "gpu":
        cfg.device = "cuda"
    modes = ["fp32"] + ["tf32"] * (cfg.device == "cuda") + [
        m for m in cfg.modes.split(",") if m and m not in ("fp32", "tf32")]
    unknown = [m for m in cfg.modes.split(",") if m and m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    if cfg.device == "cpu" and "tf32" in cfg.modes.split(","):
        ap.error("mode 'tf32' needs --device cuda (a CPU has no TF32 matmuls)")
    if cfg.rounds < 1 or cfg.window < 1:
        ap.error(f"--rounds and --window must be >= 1, got {cfg.rounds} and {cfg.window}")
    if cfg.stall_timeout is None:
        cfg.stall_timeout = 300.0 if cfg.device == "cuda" else 0.0
    if cfg.stall_timeout < 0:
        ap.error(f"--stall-timeout must be >= 0, got {cfg.stall_timeout}")
    try:
        cfg.xla_options = compiler_options(cfg.compiler_options)
    except ValueError as e:
        ap.error(f"--compiler-options: {e}")
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
          f"context {cfg.context}; {cfg.steps} steps of batch {cfg.batch} on {cfg.device}",
          flush=True)

    global WATCHDOG
    WATCHDOG = Watchdog(cfg.stall_timeout)
    if "jax" in frameworks:
        # XLA's compile events per jitted function name: the benchmarks' counter.
        compiles = CompileCounter()
        cfg.compile_cache = cache_from_args(cfg)
        print(f"JAX compilation cache: {cfg.compile_cache or 'off'}", flush=True)
    else:
        compiles = None
    results, timers = [], {}
    started = time.perf_counter()
    # The JAX runs start from torch's init.
    init_params = torch_to_jax_params(torch_model(cfg), stacked=cfg.scan)
    try:
        for name in modes:
            for fw in frameworks:
                if fw == "jax":
                    result, timed = run_jax(name, cfg, data, evals, init_params, compiles)
                else:
                    result, timed = run_torch(name, cfg, data, evals)
                results.append(result)
                timers[fw, name] = timed
                if cfg.json:  # so far, in case a later run hangs or runs out of time
                    write_json(cfg.json, {"partial": True, "device": cfg.device, "runs": [
                        {k: r[k] for k in ("framework", "mode", "eval", "skipped", "scale")}
                        | ({k: r[k] for k in ("compile_s", "compile", "eval_compile_s")}
                           if "compile" in r else {})
                        for r in results]})
        WATCHDOG.beat("the interleaved timing rounds")
        rates = time_interleaved(timers, cfg)
    finally:
        WATCHDOG.stop()
    for r in results:
        r["rates"] = rates[r["framework"], r["mode"]]
        if r["framework"] == "jax":
            r["compiles"] = r["compiles"]()
    results.sort(key=lambda r: (r["framework"], modes.index(r["mode"])))
    print()
    print(table(results, cfg))
    print(f"\nsteps/s: median of {cfg.rounds} timing rounds of {cfg.window} steps per run after "
          "training, the runs interleaved round-robin; speed vs fp32: median (min-max) of "
          "the per-round ratios, \"unreliable\" where they spread wider than half the median")
    if compiles is not None:
        print("\nJAX compilations (each step compiled ahead of time, once; seconds: cold / "
              f"warm from the cache, {cfg.compile_cache or 'off'}):")
        print(compile_summary(results))
    if cfg.framework == "both":
        print("\nCross-framework parity (same config, same data, same initial weights):")
        print(parity(results))
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    png = Path(cfg.out) / "compare_modes.png"
    plot(results, png)
    print(f"\nloss curves and loss-scale trajectories: {png}")
    if cfg.json:
        markdown = table(results, cfg)
        if cfg.framework == "both":
            markdown += "\n\n" + parity(results)
        if compiles is not None:
            markdown += "\n\nJAX compilations:\n" + compile_summary(results)
        extra = {"device": cfg.device, "wall_s": time.perf_counter() - started,
                 "markdown": markdown}
        write_json(cfg.json, to_json(results, cfg, extra))
        print(f"figures: {cfg.json}")
    return results


def write_json(path, section):
    import json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"compare_modes": section}, indent=1, default=str))


if __name__ == "__main__":
    main()
