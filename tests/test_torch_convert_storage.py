"""Tests for mpfunc_torch.convert_checkpoint to and from mode "bf16"'s storages without
float32 masters (remainder, kahan, stochastic; state_dtype), checked bit for bit against
the NumPy reference of `_mpfunc_common.rounding` (the JAX twin is
tests/test_checkpoint_convert_storage.py)."""

import numpy as np
import pytest
import torch
from lowp_task import masters, round_trip, step_with

import mpfunc_torch
from _mpfunc_common import rounding as R
from mpfunc_torch._src.low_precision import low_precision_of

LR = 2.0**-10  # steps far below the params (>= 0.25), as on the JAX side


def run(init=0, **keys):
    """A Linear(12, 8) (initialised from seed ``init``) with Adam in mode bf16 with
    ``keys``."""
    torch.manual_seed(init)
    net = torch.nn.Linear(12, 8)
    _, opt, _ = mpfunc_torch.convert_to_amp(
        net, torch.optim.Adam(net.parameters(), lr=LR), mode="bf16", **keys)
    return net, opt


def masters_with_ties(seed=0):
    """Float32 values of magnitude >= 0.25, the first 8 of the weight exactly halfway
    between two bfloat16s."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, s in {"weight": (8, 12), "bias": (8,)}.items():
        x = rng.standard_normal(s)
        out[k] = (np.sign(x) * (0.25 + np.abs(x))).astype(np.float32)
    w = out["weight"].reshape(-1).view(np.uint32)
    w[:8] = (w[:8] & 0xFFFF0000) | 0x8000
    return out


def start(values=None, **keys):
    net, opt = run(master_weights="float32", **keys)
    values = masters_with_ties() if values is None else values
    net.load_state_dict({k: torch.from_numpy(v) for k, v in values.items()})  # the masters
    return net, opt


def grads(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn((8, 12), generator=g).bfloat16(),
             torch.randn((8,), generator=g).bfloat16()] for _ in range(n)]


def train(net, opt, gs):
    for g in gs:
        assert bool(step_with(opt, [net.weight, net.bias], g))


def convert(net, opt, first="model", **keys):
    """The checkpoint of (net, opt), saved, converted to mode bf16 with ``keys`` and
    loaded into a fresh run (the model part first, or the optimizer part)."""
    ck = round_trip({"model": net.state_dict(), "optimizer": opt.state_dict()})
    msd, osd = mpfunc_torch.convert_checkpoint(ck["model"], ck["optimizer"], "bf16", **keys)
    net2, opt2 = run(init=9, **keys)  # other initial values: all must come from the load
    if first == "model":
        net2.load_state_dict(msd)
        opt2.load_state_dict(osd)
    else:
        opt2.load_state_dict(osd)
        net2.load_state_dict(msd)
    return net2, opt2


def u16(t):
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


def u32(t):
    t = torch.as_tensor(t)
    return t.detach().contiguous().view(torch.int32).numpy().view(np.uint32)


def extra(opt, i):
    return low_precision_of(opt).storage.extra[i]


@pytest.mark.parametrize("first", ["model", "optimizer"])
def test_remainder_is_the_master_split_exactly_and_comes_back_bit_for_bit(first):
    values = masters_with_ties()
    net, opt = start(values)
    net2, opt2 = convert(net, opt, first, master_weights="remainder")
    for i, (k, p) in enumerate([("weight", net2.weight), ("bias", net2.bias)]):
        hi, lo = R.split_remainder(values[k])
        np.testing.assert_array_equal(u16(p), hi, err_msg=k)
        np.testing.assert_array_equal(extra(opt2, i).numpy(), lo)
    ties = u16(net2.weight).reshape(-1)[:8]  # ties away from zero, not to even
    even = R.round_nearest_bf16(values["weight"].reshape(-1)[:8])
    assert (ties != even).any() and (ties == even).any()
    net3, opt3 = convert(net2, opt2, master_weights="float32")  # back: the masters
    for m, k in zip(masters(opt3), ["weight", "bias"]):
        np.testing.assert_array_equal(u32(m), u32(values[k]))
    msd, osd = mpfunc_torch.convert_checkpoint(net2.state_dict(), opt2.state_dict(), "fp32")
    np.testing.assert_array_equal(u32(msd["weight"]), u32(values["weight"]))
    assert set(osd) == {"state", "param_groups"}


def test_a_converted_remainder_run_goes_on_the_float32_masters_trajectory():
    gs = grads(6)
    net, opt = start()
    train(net, opt, gs[:3])
    net2, opt2 = convert(net, opt, master_weights="remainder")
    for g in gs[3:]:  # step by step, bit for bit
        train(net, opt, [g])
        train(net2, opt2, [g])
        for a, b in zip(masters(opt2), masters(opt)):
            np.testing.assert_array_equal(u32(a), u32(b))
        for q, q2 in zip(opt.optimizer.param_groups[0]["params"],
                         opt2.optimizer.param_groups[0]["params"]):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.optimizer.state[q][key], opt2.optimizer.state[q2][key])
    assert (u32(masters(opt)[0]) != u32(masters_with_ties()["weight"])).mean() > 0.9


def test_kahan_compensation_is_the_masters_residual_never_zeroed():
    net, opt = start()
    train(net, opt, grads(2))
    m = [x.clone() for x in masters(opt)]
    net2, opt2 = convert(net, opt, "optimizer", master_weights="kahan")
    for i, p in enumerate([net2.weight, net2.bias]):
        want_p, want_c = R.kahan_from_master(m[i].numpy())
        np.testing.assert_array_equal(u16(p), want_p)
        np.testing.assert_array_equal(u16(extra(opt2, i)), want_c)
        assert (extra(opt2, i) != 0).float().mean() > 0.9  # the residual, not zeros
    net3, opt3 = convert(net2, opt2, master_weights="float32")  # back: param + compensation
    for i, (p, got) in enumerate(zip([net2.weight, net2.bias], masters(opt3))):
        want = R.kahan_master(u16(p), u16(extra(opt2, i)))
        np.testing.assert_array_equal(u32(got), u32(want))
    train(net2, opt2, grads(2, seed=5))  # resumed, it follows the float32 masters
    train(net, opt, grads(2, seed=5))
    for got, want in zip(masters(opt2), masters(opt)):
        torch.testing.assert_close(got, want, rtol=2.0**-14, atol=0)


def test_stochastic_params_are_rounded_to_nearest_and_the_step_count_goes_on():
    net, opt = start()
    train(net, opt, grads(3))
    m = [x.clone() for x in masters(opt)]
    net2, opt2 = convert(net, opt, master_weights="stochastic", seed=7)
    for p, mi in zip([net2.weight, net2.bias], m):
        np.testing.assert_array_equal(u16(p), R.round_nearest_bf16(mi.numpy()))
    low = low_precision_of(opt2)
    assert (low.seed, low.step) == (7, 3)  # the target's seed; Adam's 3 steps
    train(net2, opt2, grads(2, seed=5))
    assert low.step == 5
    net3, opt3 = convert(net2, opt2, master_weights="float32")  # back: the params' values
    for got, p in zip(masters(opt3), [net2.weight, net2.bias]):
        assert torch.equal(got, p.detach().float())


def test_state_dtype_is_rounded_to_nearest_once_and_widened_back():
    net, opt = start()
    train(net, opt, grads(2))
    state = {k: v.clone() for k, v in opt.optimizer.state[opt._pairs[0][1]].items()}
    keys = dict(master_weights="remainder", state_dtype="bfloat16", state_rounding="nearest")
    net2, opt2 = convert(net, opt, "optimizer", **keys)
    got = opt2.optimizer.state[opt2._pairs[0][1]]
    for key in ("exp_avg", "exp_avg_sq"):
        assert got[key].dtype == torch.bfloat16
        np.testing.assert_array_equal(u16(got[key]), R.round_nearest_bf16(state[key].numpy()))
    net3, opt3 = convert(net2, opt2, master_weights="float32")
    back = opt3.optimizer.state[opt3._pairs[0][1]]
    assert torch.equal(back["exp_avg_sq"], got["exp_avg_sq"].float())
    np.testing.assert_array_equal(u32(masters(opt3)[0]), u32(masters(opt)[0]))
    train(net2, opt2, grads(1))  # resumes
    keys8 = dict(master_weights="kahan", state_dtype="float8_e4m3fn", state_rounding="nearest")
    net4, opt4 = convert(net, opt, **keys8)
    st = opt4.optimizer.state[opt4._pairs[0][1]]
    want, scale = R.quantize_state_8bit(state["exp_avg_sq"].numpy(), "float8_e4m3fn")
    np.testing.assert_array_equal(st["exp_avg_sq"].float().numpy(), want)
    np.testing.assert_array_equal(st["exp_avg_sq:scale"].numpy(), scale)
    # 8-bit state rounded stochastically (the default): quantised to nearest once at the
    # load, then each step stochastically.
    net5, opt5 = convert(net, opt, master_weights="stochastic", state_dtype="float8_e4m3fn",
                         seed=3)
    st = opt5.optimizer.state[opt5._pairs[0][1]]
    np.testing.assert_array_equal(st["exp_avg_sq"].float().numpy(), want)
    assert low_precision_of(opt5).state.rounding == "stochastic"
    train(net5, opt5, grads(1))
    _, osd = mpfunc_torch.convert_checkpoint(net4.state_dict(), opt4.state_dict(), "bf16",
                                             **keys8)  # the same 8-bit format: codes kept
    assert osd["optimizer"]["state"][0]["exp_avg_sq"].dtype == torch.float8_e4m3fn
    _, osd = mpfunc_torch.convert_checkpoint(net4.state_dict(), opt4.state_dict(), "fp32")
    assert "exp_avg_sq:scale" not in osd["state"][0]
    np.testing.assert_array_equal(osd["state"][0]["exp_avg_sq"].numpy(),
                                  R.dequantize_state_8bit(want, scale))


def test_bad_combinations_are_clear_errors():
    net, opt = start()
    net2, opt2 = convert(net, opt, master_weights="remainder")
    msd, osd = net2.state_dict(), opt2.state_dict()
    bad = {**osd, "low_precision": {**osd["low_precision"], "extra": [None, None]}}
    with pytest.raises(ValueError, match=r"entry 0 must be a bfloat16 param with a "
                                         r"torch.int16 of its shape beside it"):
        mpfunc_torch.convert_checkpoint(msd, bad, "bf16", master_weights="float32")
    bad = {**osd, "low_precision": {"storage": "remainder"}}
    with pytest.raises(ValueError, match=r"must be a dict with keys \['storage', 'seed'"):
        mpfunc_torch.convert_checkpoint(msd, bad, "fp32")
    with pytest.raises(ValueError, match="did you mean `kahan`"):
        mpfunc_torch.convert_checkpoint(msd, osd, "bf16", master_weights="kahn")
    bad = {**osd, "master_names": None}
    with pytest.raises(ValueError, match="not the names of their params"):
        mpfunc_torch.convert_checkpoint(msd, bad, "bf16", master_weights="float32")
    # a converted optimizer part loads into the storage it was converted for only
    _, osd3 = mpfunc_torch.convert_checkpoint(msd, osd, "bf16", master_weights="kahan")
    before = [p.detach().clone() for p in net2.parameters()]
    with pytest.raises(ValueError, match="stores its masters as 'remainder'"):
        opt2.load_state_dict(osd3)
    assert all(torch.equal(a, b) for a, b in zip(before, net2.parameters()))


def test_a_plain_float32_torch_run_moves_to_a_storage_and_back():
    torch.manual_seed(0)
    net = torch.nn.Linear(12, 8)
    with torch.no_grad():
        for p, v in zip(net.parameters(), masters_with_ties().values()):
            p.copy_(torch.from_numpy(v))
    plain = torch.optim.Adam(net.parameters(), lr=LR)
    for g in grads(2):
        plain.zero_grad()
        sum((p * gi.float()).sum() for p, gi in zip(net.parameters(), g)).backward()
        plain.step()
    ck = round_trip({"model": net.state_dict(), "optimizer": plain.state_dict()})
    msd, osd = mpfunc_torch.convert_checkpoint(ck["model"], ck["optimizer"], "bf16",
                                               master_weights="stochastic", seed=1)
    net2, opt2 = run(init=5, master_weights="stochastic", seed=1)
    net2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    assert low_precision_of(opt2).step == 2  # Adam's steps: the bits go on from step 2
    np.testing.assert_array_equal(u16(net2.weight), R.round_nearest_bf16(
        net.weight.detach().numpy()))
    msd, osd = mpfunc_torch.convert_checkpoint(ck["model"], ck["optimizer"], "bf16",
                                               master_weights="remainder")
    net3, opt3 = run(init=5, master_weights="remainder")
    opt3.load_state_dict(osd)
    net3.load_state_dict(msd)
    msd, osd = mpfunc_torch.convert_checkpoint(net3.state_dict(), opt3.state_dict(), "fp32")
    for k, p in net.state_dict().items():  # back to plain float32: the same bits
        np.testing.assert_array_equal(u32(msd[k]), u32(p))
    assert torch.equal(osd["state"][0]["exp_avg_sq"], plain.state_dict()["state"][0]["exp_avg_sq"])
