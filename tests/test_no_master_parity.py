"""Training without float32 masters gives the same bfloat16 bits in JAX and torch: the
same float32 values, seed and step round the same way (`_mpfunc_common.rounding`).

Both sides train one linear layer's params with SGD at a power-of-two learning rate on
the same bfloat16-valued gradients, so every float32 update is exact and equal in both;
the rounding rule is all that could differ (stochastic: 100 steps; remainder and Kahan: the
remainders and compensations too). Each side numbers steps from 0 (taken steps
only) and draws every param's bits from stream 0 at its row-major element index."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from lowp_task import step_with

import mpfunc
import mpfunc_torch
from mpfunc_torch._src.low_precision import low_precision_of

LR = 2.0**-6
STEPS = 100
SHAPES = {"weight": (16, 24), "bias": (16,)}


def _grads(steps):
    rng = np.random.default_rng(4)
    out = []
    for _ in range(steps):  # bfloat16 values (as float32): a bf16 param's grad holds them
        g = {k: torch.from_numpy(rng.standard_normal(s).astype(np.float32)).bfloat16()
             for k, s in SHAPES.items()}
        out.append(g)
    return out


def _torch_run(storage, seed, grads):
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 16)
    with torch.no_grad():  # bfloat16 values: JAX's params start as bfloat16, exactly
        for p in layer.parameters():
            p.copy_(p.bfloat16())
    start = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    _, opt, _ = mpfunc_torch.convert_to_amp(
        layer, torch.optim.SGD(layer.parameters(), lr=LR), mode="bf16",
        master_weights=storage, seed=seed)
    params = [layer.weight, layer.bias]
    for g in grads:
        assert bool(step_with(opt, params, [g["weight"], g["bias"]]))
    return start, {"weight": layer.weight.detach(), "bias": layer.bias.detach()}, opt


def _jax_run(storage, seed, start, grads):
    opt = mpfunc.master_weights(optax.sgd(LR), storage=storage, seed=seed)
    params = {k: jnp.asarray(v.numpy()).astype(jnp.bfloat16) for k, v in start.items()}
    state = opt.init(params)

    @jax.jit
    def step(p, s, g):
        with jax.numpy_dtype_promotion("standard"):  # float32 updates land exactly
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

    for g in grads:
        params, state = step(params, state, {k: jnp.asarray(v.float().numpy())
                                             for k, v in g.items()})
    return params, state


def _bits(x):
    return np.asarray(x).view(np.uint16)


@pytest.mark.parametrize("storage", ["stochastic", "remainder", "kahan"])
def test_jax_and_torch_train_to_the_same_bfloat16_bits(storage):
    seed = 1234 if storage == "stochastic" else 0
    grads = _grads(STEPS)
    start, got, opt = _torch_run(storage, seed, grads)
    low = low_precision_of(opt)
    params, state = _jax_run(storage, seed, start, grads)
    for i, k in enumerate(["weight", "bias"]):
        want = params[k]
        t = got[k].view(torch.int16).numpy().view(np.uint16)
        moved = (_bits(want) != _bits(jnp.asarray(start[k].numpy()).astype(jnp.bfloat16)))
        assert moved.mean() > 0.5  # the params really trained
        np.testing.assert_array_equal(t, _bits(want), err_msg=k)
        if storage == "remainder":  # the 16 bits below each param agree too
            np.testing.assert_array_equal(low.storage.extra[i].numpy(),
                                          np.asarray(state.remainders[k]))
        if storage == "kahan":  # and the compensations
            np.testing.assert_array_equal(_bits(low.storage.extra[i].view(torch.int16)),
                                          _bits(state.compensation[k]))
    if storage == "stochastic":
        assert int(state.step) == low.step == STEPS and low.seed == int(state.seed) == seed
