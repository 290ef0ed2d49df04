"""Flax Linen and NNX training with a per-module-class policy (norms in float32).

Both models train a small classifier on digits of Python source bytes (is the next
byte a letter, a digit, whitespace or other?) with float16 (Linen, plus float32 master
weights and dynamic loss scaling) or bfloat16 (NNX) compute, while every LayerNorm keeps
float32 params and computation and hands half precision on to the next layer (haiku's
recipe for norms). Prints the dtypes each part ended up in, the operand dtypes of every
matmul in the traced program, and the losses.

    python examples/flax_policies.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import VOCAB, load_corpus, windows  # noqa: E402

import mpfunc  # noqa: E402

CONTEXT = 12


def byte_class(b):
    c = np.zeros_like(b)
    c[(b >= ord("a")) & (b <= ord("z")) | (b >= ord("A")) & (b <= ord("Z"))] = 1
    c[(b >= ord("0")) & (b <= ord("9"))] = 2
    c[(b == ord(" ")) | (b == ord("\n"))] = 3
    return c


def batches(steps, batch=128):
    it = windows(load_corpus(200_000), CONTEXT + 1, batch, seed=0)
    for _ in range(steps):
        seq, _ = next(it)
        x = np.eye(VOCAB, dtype=np.float32)[seq[:, :CONTEXT]].reshape(batch, -1)
        yield x, byte_class(seq[:, CONTEXT])


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(128)(x))
        return nn.Dense(4)(nn.gelu(x))


def matmul_dtypes(fn, *args):
    """The operand dtypes of each dot_general in ``fn``'s jaxpr, e.g. ['f16 x f16']."""
    eqns = jax.make_jaxpr(fn)(*args).eqns
    return [" x ".join(str(v.aval.dtype).replace("float", "f")
                       for v in e.invars) for e in eqns if e.primitive.name == "dot_general"]


def linen_demo(steps):
    amp = mpfunc.linen_policy(LinenNet(), "params=float16,compute=float16,output=float32",
                              {nn.LayerNorm: "params=float32,compute=float32,output=float16"})
    data = list(batches(steps))
    variables = amp.init(jax.random.key(0), data[0][0])
    params = variables["params"]
    opt = mpfunc.dynamic_scale(mpfunc.master_weights(optax.adam(3e-3)), preset="naive",
                               init_scale=2.0**16)
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):
        def loss_fn(p):
            logits = amp.apply({"params": p}, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return mpfunc.scale_loss(loss, state), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for x, y in data:
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    print("Linen: matmuls", matmul_dtypes(lambda p: amp.apply({"params": p}, data[0][0]), params))
    print("Linen: Dense kernel", params["Dense_0"]["kernel"].dtype, "| LayerNorm scale",
          params["LayerNorm_0"]["scale"].dtype, "| master",
          state.inner_state.master_params["Dense_0"]["kernel"].dtype)
    print(f"Linen: loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}; "
          f"skipped {int(state.skipped_steps)}, loss scale {float(state.loss_scale):g}")
    return losses


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(CONTEXT * VOCAB, 128, rngs=rngs)
        self.norm = nnx.LayerNorm(128, rngs=rngs)
        self.out = nnx.Linear(128, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.gelu(self.norm(self.fc(x))))


def nnx_demo(steps):
    model = mpfunc.nnx_apply_policy(NnxNet(nnx.Rngs(0)), "p=f32,c=bf16,o=f32",
                                    {nnx.LayerNorm: "p=f32,c=f32,o=bf16"})
    optimizer = nnx.Optimizer(model, mpfunc.no_scale(optax.adam(3e-3)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    data = list(batches(steps))
    graphdef, state = nnx.split(model)
    print("NNX: matmuls", matmul_dtypes(lambda s: nnx.merge(graphdef, s)(data[0][0]), state),
          "| output", model(data[0][0]).dtype)
    losses = [float(step(model, optimizer, x, y)) for x, y in data]
    print("NNX: Linear computes in", model.fc.dtype, "| LayerNorm computes in", model.norm.dtype,
          "| LayerNorm scale", model.norm.scale[...].dtype)
    print(f"NNX: loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}")
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    steps = 40 if args.quick else args.steps
    a = linen_demo(steps)
    b = nnx_demo(steps)
    return a, b


if __name__ == "__main__":
    main()
