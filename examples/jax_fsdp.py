"""FSDP with mpfunc: sharded params, masters and optimizer state; one overflow, all skip.

Part 1, FSDP under plain ``jit``: every parameter is split along its first dimension
over a "data" axis of all devices (8 forced CPU devices by default), and so are the
float32 master weights and Adam's moments (``mpfunc.state_sharding``). Each mode trains
a small character-level language model on Python's stdlib source; per-device memory is
printed, and an inf injected into one device's gradient shard makes every device skip
with no ``axis_name``: GSPMD makes the finite check global.

Part 2, FSDP + tensor parallelism inside ``shard_map`` on a ("data", "model") mesh:
weights are all-gathered over "data" for the forward (ZeRO-3) and split over "model"
Megatron-style. The finite check and ``mpfunc.clip_by_global_norm`` reduce over both
axes, so the clipping factor is the same on every device, which
``optax.clip_by_global_norm`` (local norms) does not give.

    python examples/jax_fsdp.py [--quick] [--device cpu|gpu] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--quick", action="store_true", help="12 steps, part 1 in naive mode only")
    return ap.parse_args(argv)


ARGS = parse(sys.argv[1:] if __name__ == "__main__" else [])
if ARGS.device == "cpu":  # before jax is imported
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from data import VOCAB, load_corpus, split, windows  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpfunc  # noqa: E402

CONTEXT, EMBED, HIDDEN = 16, 32, 256
MiB = 2**20


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    n_in = CONTEXT * EMBED
    return {"embed": jax.random.normal(k1, (VOCAB, EMBED)) * 0.1,
            "ln": {"scale": jnp.ones((n_in,)), "bias": jnp.zeros((n_in,))},
            "w1": jax.random.normal(k2, (n_in, HIDDEN)) / np.sqrt(n_in),
            "b1": jnp.zeros((HIDDEN,)),
            "w2": jax.random.normal(k3, (HIDDEN, VOCAB)) / np.sqrt(HIDDEN),
            "b2": jnp.zeros((VOCAB,))}


def features(p, tokens):
    e = p["embed"][tokens].reshape(tokens.shape[0], -1)
    m = e.mean(-1, keepdims=True)
    v = jnp.square(e - m).mean(-1, keepdims=True)
    return (e - m) * jax.lax.rsqrt(v + 1e-5) * p["ln"]["scale"] + p["ln"]["bias"]


def apply(p, tokens):
    return jax.nn.gelu(features(p, tokens) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def bytes_on(tree, device):
    """Bytes of ``tree``'s shards that live on ``device``."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == device)


def shards_equal(a, b):
    return all(np.array_equal(np.asarray(x.data), np.asarray(y.data))
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
               for x, y in zip(u.addressable_shards, v.addressable_shards))


# --- part 1: FSDP under jit ------------------------------------------------------------

def fsdp_under_jit(mode, cfg, steps, batches, poison_at):
    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    split_rows = NamedSharding(mesh, P("data"))
    amp = mpfunc.convert_to_amp(apply, optax.adam(3e-3), mode=mode, **cfg)
    params = jax.jit(amp.cast_params)(jax.device_put(init_params(jax.random.key(0)), split_rows))
    opt = amp.optimizer
    state = jax.jit(opt.init, out_shardings=mpfunc.state_sharding(opt, params))(params)

    def step(params, state, x, y, poison):
        def loss_fn(p):
            logits = amp.apply_fn(p, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return mpfunc.scale_loss(loss, state), loss

        with jax.numpy_dtype_promotion("standard"):
            grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        grads["w1"] = grads["w1"] + poison.astype(grads["w1"].dtype)  # inf on one device
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    x, y = next(batches)
    zero = jax.device_put(jnp.zeros(params["w1"].shape, jnp.float32), split_rows)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, state, jax.device_put(x, split_rows), jax.device_put(y, split_rows), zero).compile()
    mem = compiled.memory_analysis()
    dev0 = devices[0]
    masters = getattr(state.inner_state, "master_params", None)
    row = {"mode": mode + (f" {cfg['opt_level']}" if "opt_level" in cfg else ""),
           "params": bytes_on(params, dev0), "masters": bytes_on(masters, dev0) if masters else 0,
           "state": bytes_on(state, dev0),
           "args": mem.argument_size_in_bytes if mem else None,
           "temp": mem.temp_size_in_bytes if mem else None}
    bad_device = n - 1
    rows_per_device = params["w1"].shape[0] // n
    for i in range(steps):
        poison = np.zeros(params["w1"].shape, np.float32)
        if i == poison_at:
            poison[bad_device * rows_per_device, 0] = np.inf
        poison = jax.device_put(poison, split_rows)
        before = (params, state.inner_state) if i == poison_at else None
        if i == poison_at:
            before = jax.tree.map(jnp.copy, before)  # the step donates its inputs
        params, state, loss = compiled(params, state, jax.device_put(x, split_rows),
                                       jax.device_put(y, split_rows), poison)
        if i == poison_at:
            skipped_on = sum(not bool(s.data) for s in state.last_finite.addressable_shards)
            row["overflow"] = (f"inf in device {bad_device}'s w1 gradient shard: skipped on "
                               f"{skipped_on}/{n} devices, params and state unchanged: "
                               f"{shards_equal(before, (params, state.inner_state))}")
        x, y = next(batches)
    row["loss"] = float(loss)
    row["skipped"] = int(state.skipped_steps)
    row["scale"] = float(state.loss_scale)
    return row, n


# --- part 2: FSDP + TP inside shard_map -------------------------------------------------

AXES = ("data", "model")
SPECS = {"embed": P(), "ln": P(), "w1": P("data", "model"), "b1": P("model"),
         "w2": P("model", "data"), "b2": P()}


def apply_sharded(p, tokens):
    # ZeRO-3: gather this layer's FSDP shards for the forward; autodiff turns the gather
    # into a reduce-scatter of the gradients, which stay split over "data" and "model".
    w1 = jax.lax.all_gather(p["w1"], "data", axis=0, tiled=True)
    w2 = jax.lax.all_gather(p["w2"], "data", axis=1, tiled=True)
    h = jax.nn.gelu(features(p, tokens) @ w1 + p["b1"])     # column-parallel
    return jax.lax.psum(h @ w2, "model") + p["b2"]            # row-parallel


def fsdp_tp_shard_map(steps, batches, poison_at):
    n = len(jax.devices())
    if n < 2 or n % 2:
        print(f"part 2 needs an even number of devices, found {n}; skipped")
        return
    mesh = jax.make_mesh((n // 2, 2), AXES, axis_types=(AxisType.Auto,) * 2)
    inner = optax.chain(mpfunc.clip_by_global_norm(1.0, axis_name=AXES), optax.adam(3e-3))
    amp = mpfunc.convert_to_amp(apply_sharded, inner, mode="naive", initial_scale=2.0**12,
                                axis_name=AXES)
    params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
              for k, v in amp.cast_params(init_params(jax.random.key(0))).items()}
    state_specs = mpfunc.state_sharding(amp.optimizer, SPECS)
    state = jax.jit(jax.shard_map(amp.optimizer.init, mesh=mesh, in_specs=(SPECS,),
                                  out_specs=state_specs))(params)

    def step(params, state, x, y, poison):
        def loss_fn(p):
            logits = amp.apply_fn(p, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            loss = jax.lax.pmean(loss, "data")
            return mpfunc.scale_loss(loss, state), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        me = jax.lax.axis_index("data") * 2 + jax.lax.axis_index("model")
        grads["w1"] = jnp.where(poison == me, grads["w1"].at[0, 0].set(jnp.inf), grads["w1"])
        unscaled = jax.tree.map(lambda g: g.astype(jnp.float32) / state.loss_scale, grads)
        norms = jnp.stack([optax.tree.norm(unscaled),            # what optax would clip by
                           mpfunc.global_norm(unscaled, AXES)])  # what mpfunc clips by
        updates, state = amp.optimizer.update(grads, state, params)
        stepped = jnp.broadcast_to(state.last_finite, (1, 1))
        return optax.apply_updates(params, updates), state, loss, stepped, norms[None, None]

    sharded = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(SPECS, state_specs, P("data"), P("data"), P()),
        out_specs=(SPECS, state_specs, P(), P(*AXES), P(*AXES))), donate_argnums=(0, 1))
    dev0 = mesh.devices.flat[0]
    total_master = sum(x.size * 4 for x in jax.tree.leaves(params))
    print(f"\nFSDP + TP inside shard_map: mesh {dict(mesh.shape)}; naive mode (float16 params, "
          "float32 masters), clip_by_global_norm(1.0) and the finite check over both axes")
    print(f"  per device: params {bytes_on(params, dev0) / 1024:.1f} KiB, float32 masters "
          f"{bytes_on(state.inner_state.master_params, dev0) / 1024:.1f} KiB "
          f"(of {total_master / 1024:.1f} KiB in all; embed, ln and b2 are replicated), "
          f"optimizer state "
          f"{bytes_on(state, dev0) / 1024:.1f} KiB")
    bad, shown = n - 1, False
    for i in range(steps):
        x, y = next(batches)
        poison = jnp.int32(bad if i == poison_at else -1)
        before = jax.tree.map(jnp.copy, (params, state.inner_state)) if i == poison_at else None
        params, state, loss, stepped, norms = sharded(params, state, x, y, poison)
        stepped, norms = np.asarray(stepped), np.asarray(norms)
        local, glob = norms[..., 0], norms[..., 1]
        line = (f"  step {i:2d}: loss {float(loss):.4f}, scale {float(state.loss_scale):g}, "
                f"devices that stepped {int(stepped.sum())}/{n}")
        if i == poison_at:
            line += (f"  <- inf in device {bad}'s w1 gradient shard; params and state "
                     f"unchanged on every device: {shards_equal(before, (params, state.inner_state))}")
        elif stepped.all() and (not shown or i == steps - 1):
            shown = True
            line += (f"; grad norm {glob.flat[0]:.3f} on all devices (same: "
                     f"{bool((glob == glob.flat[0]).all())}), optax's local norms "
                     f"{local.min():.3f}..{local.max():.3f}")
        print(line)


def main():
    steps = 12 if ARGS.quick else ARGS.steps
    poison_at = 3
    train, _ = split(load_corpus())
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind} "
          f"({jax.default_backend()}); model: char-level MLP LM, context {CONTEXT}")
    # naive from 2**12, a scale this model never overflows at: the poisoned step is the
    # only skip (from the default 2**32 the warm start skips 2 or 3 steps first).
    modes = ([("naive", {"initial_scale": 2.0**12})] if ARGS.quick else
             [("torch", {}), ("apex", {"opt_level": "O2", "verbosity": 0}),
              ("naive", {"initial_scale": 2.0**12}), ("bf16", {})])
    print("\nFSDP under jit: every leaf split along its first dimension over 'data'; the "
          "finite check has no axis_name")
    print("| mode | params/device KiB | masters/device KiB | optimizer state/device KiB | "
          "step arguments/device KiB | step temporaries/device KiB | final loss | skipped | "
          "loss scale |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    overflow_lines = []
    for mode, cfg in modes:
        batches = windows(train, CONTEXT + 1, ARGS.batch, seed=0)
        batches = ((w[:, :CONTEXT], w[:, CONTEXT]) for w, _ in batches)
        r, n = fsdp_under_jit(mode, cfg, steps, batches, poison_at)
        kib = lambda b: "n/a" if b is None else f"{b / 1024:.1f}"  # noqa: E731
        print(f"| {r['mode']} | {kib(r['params'])} | {kib(r['masters'])} | {kib(r['state'])} | "
              f"{kib(r['args'])} | {kib(r['temp'])} | {r['loss']:.4f} | {r['skipped']} | "
              f"{r['scale']:g} |")
        overflow_lines.append(f"  {r['mode']}: step {poison_at}, {r['overflow']}")
    print(f"overflow injected at step {poison_at} (devices: {n}):")
    print("\n".join(overflow_lines))
    batches = windows(train, CONTEXT + 1, ARGS.batch, seed=1)
    batches = ((w[:, :CONTEXT], w[:, CONTEXT]) for w, _ in batches)
    fsdp_tp_shard_map(steps, batches, poison_at)


if __name__ == "__main__":
    main()
