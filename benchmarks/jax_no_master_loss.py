"""Eval-loss gaps of training without float32 masters, on the demo's transformer (JAX).

Trains the demo's character-level transformer (``examples/compare_modes.py``'s
``jax_apply``, its data) from one initialisation, on the same batches, with bfloat16
params (mode ``"bf16"`` with ``master_weights``: a half model, bfloat16 compute) and Adam,
keeping the params' exact values in each way, with float32, bfloat16 and 8-bit
(``float8_e4m3fn`` blocks) Adam moments:

* ``float32``: float32 masters (the reference, with float32 moments);
* ``remainder``, ``kahan``, ``stochastic``: `mpfunc.master_weights` storages;
* ``plain``: bfloat16 params without any compensation (Adam in float32 on the params,
  each update rounded into the param once: ``p = bf16(p + u)``);
* ``float32-1ulp``: the noise floor: float32 masters again, with one weight (the first
  element of the largest matrix) moved up one bfloat16 ulp before training, what one
  remainder tie does to a forward; its gap is what chaotic divergence alone opens (the
  torch benchmark's row "float32 masters, 1 ulp off").

Reported per run: the final eval loss (mean over held-out batches), its gap to the
reference, ``(loss - ref) / ref``, and the bytes per parameter of persistent state
measured from the buffers (params + optimizer state). The remainder's masters are the
reference's bit for bit given the same gradients (tests/test_param_storage.py), but
here each run computes its own: where a master lies exactly halfway between two
bfloat16 values its param rounds away from zero, the reference's to even, and from that
step on the forwards differ by one ulp of that element, and so, slightly, every
gradient after it.

    python benchmarks/jax_no_master_loss.py [--steps 500] [--width 128] [--layers 2]
        [--lr 1e-3] [--schedule constant|cosine] [--methods float32,remainder,...]
        [--states float32,bfloat16,float8_e4m3fn] [--runs remainder/bfloat16,...] [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpfunc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from compare_modes import jax_apply  # noqa: E402
from data import VOCAB, load_corpus, split, windows  # noqa: E402

METHODS = ("float32", "remainder", "kahan", "stochastic", "plain", "float32-1ulp")
DEFAULT_METHODS = METHODS[:-1]  # the noise floor runs when asked for (--runs, --methods)
STATES = ("float32", "bfloat16", "float8_e4m3fn")


def init_params(cfg):
    """GPT-style init (normal(0.02) weights, zero biases, unit norms), blocks stacked."""
    rng = np.random.default_rng(cfg.seed)
    d, n = cfg.width, cfg.layers

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def lin(*shape):
        return {"w": normal(*shape), "b": np.zeros((*shape[:-2], shape[-1]), np.float32)}

    def ln(*lead):
        return {"scale": np.ones((*lead, d), np.float32), "bias": np.zeros((*lead, d), np.float32)}

    blocks = {"ln1": ln(n), "ln2": ln(n), "qkv": lin(n, d, 3 * d), "proj": lin(n, d, d),
              "fc": lin(n, d, 4 * d), "out": lin(n, 4 * d, d)}
    return {"tok": normal(VOCAB, d), "pos": normal(cfg.context, d), "blocks": blocks,
            "ln_f": ln(), "head": lin(d, VOCAB)}


def plain(inner):
    """bfloat16 params, no compensation: ``inner`` in float32 on the params, float32
    updates that ``optax.apply_updates`` rounds into each param once."""
    inner = optax.with_extra_args_support(inner)
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
    return optax.GradientTransformationExtraArgs(
        lambda p: inner.init(f32(p)),
        lambda g, s, p=None, **kw: inner.update(f32(g), s, f32(p), **kw))


def one_ulp_off(params):
    """``params`` (float32 values of bfloat16 params) with the first element of the
    largest leaf (a weight matrix: random, so a normal number in use) moved to the next
    bfloat16 value up. A zero bias would not do: its next value is subnormal, which
    XLA:CPU flushes to zero."""
    leaves, treedef = jax.tree.flatten(params)
    i = max(range(len(leaves)), key=lambda k: leaves[k].size)
    flat = np.array(leaves[i], np.float32).reshape(-1)
    if not abs(flat[0]) >= np.finfo(np.float32).tiny:
        raise ValueError(f"the largest leaf starts with {flat[0]}: not a normal number")
    b = flat[:1].astype(jnp.bfloat16)
    flat[0] = np.float32(jnp.nextafter(b, jnp.asarray(np.inf, jnp.bfloat16))[0])
    leaves[i] = jnp.asarray(flat.reshape(leaves[i].shape))
    return jax.tree.unflatten(treedef, leaves)


def run(cfg, method, state, data, evals, params0):
    if method == "float32-1ulp":
        method, params0 = "float32", one_ulp_off(params0)
    apply = jax_apply(cfg)
    lr = (optax.cosine_decay_schedule(cfg.lr, cfg.steps) if cfg.schedule == "cosine"
          else cfg.lr)
    amp = mpfunc.convert_to_amp(apply, optax.adam(lr), mode="bf16",
                                master_weights="float32" if method == "plain" else method,
                                state_dtype=None if state == "float32" else state)
    if method == "plain":  # the same finite check as the mode's, around plain bf16 Adam
        adam = optax.adam(lr)
        tx = mpfunc.no_scale(plain(adam if state == "float32" else mpfunc.state_dtype(adam, state)))
    else:
        tx = amp.optimizer
    params = amp.cast_params(params0)
    opt_state = tx.init(params)
    leaves = jax.tree.leaves((params, opt_state))
    n = sum(x.size for x in jax.tree.leaves(params))
    size = sum(x.size * x.dtype.itemsize for x in leaves) / n

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(amp.apply_fn(p, x), y).mean()

    @jax.jit
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    ev = jax.jit(loss_fn)
    t0 = time.perf_counter()
    losses = []
    for x, y in data:
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(loss)
    eval_loss = float(np.mean([ev(params, x, y) for x, y in evals]))
    return {"eval_loss": eval_loss, "train_loss_last10": float(np.mean(losses[-10:])),
            "bytes_per_param": size, "seconds": time.perf_counter() - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                    help="cosine: the learning rate decays to 0 over the run, so late "
                    "steps are small against the params (where plain bfloat16 stalls)")
    ap.add_argument("--runs", default=None,
                    help="comma-separated method/state pairs to run instead of every "
                    "method x state (the float32/float32 reference always runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    ap.add_argument("--states", default=",".join(STATES))
    ap.add_argument("--json", default=None, help="also write the result here")
    cfg = ap.parse_args(argv)
    methods = [m for m in cfg.methods.split(",") if m]
    states = [s for s in cfg.states.split(",") if s]
    pairs = ([tuple(r.split("/")) for r in cfg.runs.split(",") if r] if cfg.runs
             else [(m, s) for m in methods for s in states])
    methods, states = [m for m, _ in pairs], [s for p in pairs for s in p[1:2]]
    if any(len(p) != 2 for p in pairs) or (
            bad := sorted(set(methods) - set(METHODS)) + sorted(set(states) - set(STATES))):
        ap.error(f"unknown run(s) {cfg.runs or bad}; methods {list(METHODS)}, states "
                 f"{list(STATES)}, runs as method/state")
    if cfg.steps < 1 or cfg.eval_batches < 1:
        ap.error("--steps and --eval-batches must be >= 1")
    cfg.scan = True
    train, held_out = split(load_corpus())
    it = windows(train, cfg.context + 1, cfg.batch, seed=cfg.seed)
    data = [(s[:, :-1], s[:, 1:]) for s, _ in (next(it) for _ in range(cfg.steps))]
    ev_it = windows(held_out, cfg.context + 1, cfg.batch, seed=cfg.seed + 1)
    evals = [(s[:, :-1], s[:, 1:]) for s, _ in (next(ev_it) for _ in range(cfg.eval_batches))]
    params0 = init_params(cfg)
    runs = {}
    ref = run(cfg, "float32", "float32", data, evals, params0)
    runs["float32/float32"] = ref
    for method, state in pairs:
        name = f"{method}/{state}"
        if name not in runs:
            runs[name] = run(cfg, method, state, data, evals, params0)
            print(f"{name}: eval loss {runs[name]['eval_loss']:.5f}", flush=True)
    out = {
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()}), "
                  f"{platform.processor() or platform.machine()}",
        "versions": {"jax": jax.__version__, "optax": optax.__version__},
        "config": {k: getattr(cfg, k) for k in ("steps", "batch", "context", "width",
                                                "layers", "heads", "lr", "schedule",
                                                "seed")},
        "params": int(sum(np.size(x) for x in jax.tree.leaves(params0))),
        "runs": {},
    }
    r_loss = ref["eval_loss"]
    for name, r in runs.items():
        row = {k: r[k] for k in ("eval_loss", "train_loss_last10", "bytes_per_param", "seconds")}
        row["gap_vs_float32_masters"] = (r["eval_loss"] - r_loss) / r_loss
        out["runs"][name] = row
    print(f"Device: {out['device']}; {out['params']:,} params; {cfg.steps} steps of batch "
          f"{cfg.batch}, context {cfg.context}; Adam lr {cfg.lr} ({cfg.schedule}); eval on "
          f"{cfg.eval_batches} held-out batches.\n")
    print("| method / moments | bytes/param | eval loss | gap vs float32 masters | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in out["runs"].items():
        print(f"| {name} | {row['bytes_per_param']:.3f} | {row['eval_loss']:.5f} | "
              f"{100 * row['gap_vs_float32_masters']:+.4f}% | {row['seconds']:.1f} |")
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
