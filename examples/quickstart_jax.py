"""JAX quick start: a precision policy, dynamic loss scaling and a jitted train step.

Trains a small character-level MLP language model on Python's standard-library source
with float16 compute (params float32) and `mpfunc.dynamic_scale(optax.adam(...))`, and
prints the loss, the loss scale and the skipped steps as it goes.

    python examples/quickstart_jax.py [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from data import VOCAB, load_corpus, split, windows

import mpfunc

CONTEXT, EMBED, HIDDEN = 16, 32, 256


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k1, (VOCAB, EMBED)) * 0.1,
        "w1": jax.random.normal(k2, (CONTEXT * EMBED, HIDDEN)) / np.sqrt(CONTEXT * EMBED),
        "b1": jnp.zeros((HIDDEN,)),
        "w2": jax.random.normal(k3, (HIDDEN, VOCAB)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros((VOCAB,)),
    }


def apply(params, tokens):
    """Predicts the character after each window of CONTEXT characters."""
    h = params["embed"][tokens].reshape(tokens.shape[0], -1)
    h = jax.nn.gelu(h @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="a short run (100 steps)")
    args = parser.parse_args(argv)
    steps = 100 if args.quick else args.steps

    policy = mpfunc.get_policy("params=float32,compute=float16,output=float32")
    # A deliberately high initial scale: the first steps overflow in float16 and are
    # skipped while the scale backs off, which is what dynamic scaling is for.
    optimizer = mpfunc.dynamic_scale(optax.adam(3e-3), init_scale=2.0**24, growth_interval=50)

    params = init_params(jax.random.key(0))
    opt_state = optimizer.init(params)

    def loss_fn(params, x, y):
        logits = apply(policy.cast_to_compute(params), x)
        logits = policy.cast_to_output(logits)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, opt_state, x, y):
        def scaled(p):
            loss = loss_fn(p, x, y)
            return mpfunc.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, mpfunc.scale_metrics(opt_state)

    train, held_out = split(load_corpus())
    batches = windows(train, CONTEXT + 1, args.batch, seed=0)
    print(f"policy {policy}: params float32, compute float16, outputs float32")
    print(f"data: {len(train):,} training characters of Python stdlib source")
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        seq, _ = next(batches)
        x, y = jnp.asarray(seq[:, :CONTEXT]), jnp.asarray(seq[:, CONTEXT])
        params, opt_state, loss, metrics = train_step(params, opt_state, x, y)
        if step == 1 or step % max(1, steps // 8) == 0 or step == steps:
            print(
                f"step {step:4d}  loss {float(loss):.3f}  "
                f"loss_scale {float(metrics['loss_scale']):>12,.0f}  "
                f"skipped {int(metrics['skipped_steps'])}"
            )
    elapsed = time.perf_counter() - t0
    seq, _ = next(windows(held_out, CONTEXT + 1, 2048, seed=1))
    eval_loss = float(loss_fn(params, jnp.asarray(seq[:, :CONTEXT]), jnp.asarray(seq[:, CONTEXT])))
    print(f"held-out loss {eval_loss:.3f} (uniform guess: {np.log(VOCAB):.3f})")
    print(f"{steps} steps in {elapsed:.1f}s; {int(opt_state.skipped_steps)} overflow steps "
          f"skipped; final loss scale {float(opt_state.loss_scale):,.0f}")


if __name__ == "__main__":
    main()
