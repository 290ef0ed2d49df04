"""A 2-stage pipeline under shard_map with mixed precision; one stage overflows, all skip.

The model is a character-level language model on Python's stdlib source: an embedding,
two residual MLP blocks, a head. Block s lives on pipeline stage s of a
("data", "stage") = (4, 2) mesh of 8 devices (8 forced CPU devices by default); the
embedding and head are replicated. Each data shard pushes 4 micro-batches through a
GPipe schedule (``ppermute`` between stages) in float16 compute, and autodiff runs the
backward pass. The finite check (``dynamic_scale(axis_name=...)``) and the clipping norm
(``mpfunc.clip_by_global_norm(axis_name=...)``) both reduce over "stage", so when an inf
is injected into stage 1's gradients only, stage 0 skips too.

    python examples/jax_pipeline.py [--quick] [--device cpu|gpu] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--quick", action="store_true", help="10 steps")
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

STAGES, MICRO = 2, 4
CONTEXT, EMBED = 8, 32
WIDTH = CONTEXT * EMBED
AXES = ("data", "stage")
SPECS = {"embed": P(), "blocks": P("stage"), "head": P()}


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"embed": jax.random.normal(k1, (VOCAB, EMBED)) * 0.1,
            "blocks": {"w": jax.random.normal(k2, (STAGES, WIDTH, WIDTH)) / np.sqrt(WIDTH),
                       "b": jnp.zeros((STAGES, WIDTH))},
            "head": jax.random.normal(k3, (WIDTH, VOCAB)) / np.sqrt(WIDTH)}


def block(w, b, h):
    return h + jax.nn.gelu(h @ w + b)


def main():
    steps = 10 if ARGS.quick else ARGS.steps
    n = len(jax.devices())
    if n % STAGES:
        raise SystemExit(f"needs a multiple of {STAGES} devices, found {n}")
    data_shards = n // STAGES
    mesh = jax.make_mesh((data_shards, STAGES), AXES, axis_types=(AxisType.Auto,) * 2)
    policy = mpfunc.get_policy("params=float32,compute=float16,output=float32")
    opt = mpfunc.dynamic_scale(
        optax.chain(mpfunc.clip_by_global_norm(1.0, axis_name=AXES), optax.adam(3e-3)),
        init_scale=2.0**12, growth_interval=4, axis_name=AXES)
    params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k]))
              for k, v in init_params(jax.random.key(0)).items()}
    state_specs = mpfunc.state_sharding(opt, SPECS)
    state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=(SPECS,),
                                  out_specs=state_specs))(params)

    def step(params, state, x, y, poison):
        stage = jax.lax.axis_index("stage")
        xs = x.reshape(MICRO, -1, CONTEXT)
        ys = y.reshape(MICRO, -1)

        def loss_fn(p):
            c = policy.cast_to_compute(p)
            w, b = c["blocks"]["w"][0], c["blocks"]["b"][0]
            carry = jnp.zeros((xs.shape[1], WIDTH), policy.compute_dtype)
            logits = []
            for t in range(MICRO + STAGES - 1):  # stage s works on micro-batch t - s
                emb = c["embed"][xs[min(t, MICRO - 1)]].reshape(-1, WIDTH)
                out = block(w, b, jnp.where(stage == 0, emb, carry))
                if t >= STAGES - 1:  # the last stage finishes micro-batch t - (STAGES - 1)
                    logits.append(policy.cast_to_output(out @ c["head"]))
                carry = jax.lax.ppermute(out, "stage", [(i, i + 1) for i in range(STAGES - 1)])
            ce = optax.softmax_cross_entropy_with_integer_labels(jnp.stack(logits), ys).mean()
            loss = jax.lax.psum(jnp.where(stage == STAGES - 1, ce, 0.0), "stage")
            loss = jax.lax.pmean(loss, "data")
            return mpfunc.scale_loss(loss, state), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        w = grads["blocks"]["w"]
        grads["blocks"]["w"] = jnp.where(poison & (stage == STAGES - 1), w.at[0, 0, 0].set(jnp.inf), w)
        updates, state = opt.update(grads, state, params)
        stepped = jnp.broadcast_to(state.last_finite, (1, 1))
        return optax.apply_updates(params, updates), state, loss, stepped

    sharded = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(SPECS, state_specs, P("data"), P("data"), P()),
        out_specs=(SPECS, state_specs, P(), P(*AXES))))

    dev = mesh.devices  # [data, stage]
    block_bytes = [sum(s.data.nbytes for x in jax.tree.leaves(params["blocks"])
                       for s in x.addressable_shards if s.device == dev[0, s_]) for s_ in range(STAGES)]
    print(f"mesh {dict(mesh.shape)} of {dev[0, 0].device_kind}; policy {policy}; "
          f"{MICRO} micro-batches per data shard")
    print(f"block params per device: stage 0 {block_bytes[0] / 1024:.0f} KiB, stage 1 "
          f"{block_bytes[1] / 1024:.0f} KiB (the two blocks: "
          f"{sum(x.nbytes for x in jax.tree.leaves(params['blocks'])) / 1024:.0f} KiB)")
    train, _ = split(load_corpus())
    batches = windows(train, CONTEXT + 1, 16 * data_shards, seed=0)
    poison_at = 3
    for i in range(steps):
        win, _ = next(batches)
        before = jax.device_get((params, state.inner_state))
        params, state, loss, stepped = sharded(params, state, win[:, :CONTEXT], win[:, CONTEXT],
                                               jnp.bool_(i == poison_at))
        stepped = np.asarray(stepped)  # [data, stage]
        line = (f"step {i:2d}: loss {float(loss):.4f}, scale {float(state.loss_scale):g}, "
                f"stepped per stage {[int(stepped[:, s].sum()) for s in range(STAGES)]} of "
                f"{data_shards}")
        if i == poison_at:
            after = jax.device_get((params, state.inner_state))
            same = all(np.array_equal(a, b) for a, b in
                       zip(jax.tree.leaves(after), jax.tree.leaves(before)))
            line += (f"  <- inf in stage {STAGES - 1}'s gradients only; every stage skipped: "
                     f"{not stepped.any()}, params and optimizer state unchanged: {same}")
        print(line)


if __name__ == "__main__":
    main()
