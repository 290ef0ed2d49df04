"""convert_checkpoint gives the same bits in JAX and torch: the same float32 masters (some
exactly halfway between two bfloat16s) and Adam moments, converted to each storage
without float32 masters (and its state dtype) and back, give the same bfloat16 params,
remainders, compensations, stored moments, seed and step count on both sides."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from lowp_task import masters, round_trip
from test_torch_convert_storage import masters_with_ties, u16, u32

import mpfunc
import mpfunc_torch
from mpfunc_torch._src.low_precision import low_precision_of

KEYS = ["weight", "bias"]
OPT = optax.adam(1e-3)


def moments(seed=3):
    rng = np.random.default_rng(seed)
    shapes = {"weight": (8, 12), "bias": (8,)}
    mu = {k: rng.standard_normal(s).astype(np.float32) * 0.1 for k, s in shapes.items()}
    nu = {k: (rng.standard_normal(s) ** 2).astype(np.float32) * 0.01 for k, s in shapes.items()}
    return mu, nu


def jax_side(keys):
    """The JAX run (float32 masters, Adam after 3 steps) converted to ``keys`` and back."""
    f = lambda p, x: x @ p["weight"].T + p["bias"]  # noqa: E731
    src = mpfunc.convert_to_amp(f, OPT, mode="bf16", master_weights="float32")
    dst = mpfunc.convert_to_amp(f, OPT, mode="bf16", **keys)
    m = {k: jnp.asarray(v) for k, v in masters_with_ties().items()}
    mu, nu = moments()
    params = src.cast_params(m)
    state = src.optimizer.init(params)
    adam = state.inner_state.inner_state[0]._replace(
        count=jnp.int32(3), mu={k: jnp.asarray(v) for k, v in mu.items()},
        nu={k: jnp.asarray(v) for k, v in nu.items()})
    state = state._replace(inner_state=state.inner_state._replace(
        master_params=m, inner_state=(adam, *state.inner_state.inner_state[1:])))
    p2, s2 = mpfunc.convert_checkpoint(params, state, src, dst)
    _, s3 = mpfunc.convert_checkpoint(p2, s2, dst, src)
    return p2, s2, s3


def torch_side(keys):
    """The same in torch: a Linear(12, 8) with float32 masters and Adam's state, saved,
    converted to ``keys``, loaded, and converted back."""
    def run(**k):
        torch.manual_seed(0)
        net = torch.nn.Linear(12, 8)
        _, opt, _ = mpfunc_torch.convert_to_amp(
            net, torch.optim.Adam(net.parameters(), lr=1e-3), mode="bf16", **k)
        return net, opt

    net, opt = run(master_weights="float32")
    net.load_state_dict({k: torch.from_numpy(v) for k, v in masters_with_ties().items()})
    osd = opt.state_dict()
    mu, nu = moments()
    osd["optimizer"]["state"] = {
        i: {"step": torch.tensor(3.0), "exp_avg": torch.from_numpy(mu[k]),
            "exp_avg_sq": torch.from_numpy(nu[k])} for i, k in enumerate(KEYS)}
    ck = round_trip({"model": net.state_dict(), "optimizer": osd})
    msd, osd = mpfunc_torch.convert_checkpoint(ck["model"], ck["optimizer"], "bf16", **keys)
    net2, opt2 = run(**keys)
    net2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    ck = round_trip({"model": net2.state_dict(), "optimizer": opt2.state_dict()})
    msd, osd = mpfunc_torch.convert_checkpoint(ck["model"], ck["optimizer"], "bf16",
                                               master_weights="float32")
    net3, opt3 = run(master_weights="float32")
    opt3.load_state_dict(osd)
    net3.load_state_dict(msd)
    return net2, opt2, opt3


CASES = {
    "remainder": dict(master_weights="remainder"),
    "kahan": dict(master_weights="kahan"),
    "stochastic": dict(master_weights="stochastic", seed=7),
    "remainder-bf16-state": dict(master_weights="remainder", state_dtype="bfloat16",
                                 state_rounding="nearest"),
    "stochastic-8bit-state": dict(master_weights="stochastic", seed=7,
                                  state_dtype="float8_e4m3fn", state_rounding="nearest"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_jax_and_torch_convert_to_the_same_bits_and_back(case):
    keys = CASES[case]
    storage = keys["master_weights"]
    p2, s2, s3 = jax_side(keys)
    net2, opt2, opt3 = torch_side(keys)
    low = low_precision_of(opt2)
    mine = s2.inner_state  # the storage state
    for i, k in enumerate(KEYS):
        np.testing.assert_array_equal(u16(getattr(net2, k)), np.asarray(p2[k]).view(np.uint16),
                                      err_msg=k)
        if storage == "remainder":
            np.testing.assert_array_equal(low.storage.extra[i].numpy(),
                                          np.asarray(mine.remainders[k]))
        if storage == "kahan":
            np.testing.assert_array_equal(u16(low.storage.extra[i]),
                                          np.asarray(mine.compensation[k]).view(np.uint16))
        # back to float32 masters: the same float32 bits
        np.testing.assert_array_equal(
            u32(masters(opt3)[i]), np.asarray(s3.inner_state.master_params[k]).view(np.uint32))
    if storage == "stochastic":
        assert (low.seed, low.step) == (7, 3) == (int(mine.seed), int(mine.step))
    if "state_dtype" in keys:
        stored = mine.inner_state
        for i, k in enumerate(KEYS):
            st = opt2.optimizer.state[opt2._pairs[i][1]]
            for jax_name, torch_name in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
                want = np.asarray(getattr(stored.inner_state[0], jax_name)[k], np.float32)
                np.testing.assert_array_equal(st[torch_name].float().numpy(), want)
                if stored.scales is not None:
                    np.testing.assert_array_equal(
                        st[torch_name + ":scale"].numpy(),
                        np.asarray(getattr(stored.scales[0], jax_name)[k]))
        assert int(stored.step) == 3
