"""mpfunc_torch.convert_to_amp mode "bf16" with master_weights / state_dtype: bfloat16
params without float32 masters, through the public entry point (the storage itself is
tested in test_torch_master_storage.py and test_torch_state_dtype.py)."""

import pytest
import torch
from lowp_task import bits, fixed_grads, masters, net, round_trip, same, snapshot, step_with

import mpfunc_torch
from _mpfunc_common.amp_config import resolve_amp
from mpfunc_torch._src.autocast import function_mode
from mpfunc_torch._src.low_precision import low_precision_of, persistent_bytes

STORAGES = ["float32", "remainder", "kahan", "stochastic"]


def converted(storage, make=None, seed=None, **keys):
    model = net()
    opt = (make or (lambda ps: torch.optim.AdamW(ps, lr=1e-2)))(model.parameters())
    if seed is None:
        seed = 3 if storage == "stochastic" else 0
    _, amp_opt, _ = mpfunc_torch.convert_to_amp(model, opt, mode="bf16",
                                                master_weights=storage, seed=seed, **keys)
    return model, amp_opt


@pytest.mark.parametrize("storage", STORAGES)
def test_params_are_bfloat16_and_train(storage):
    model, opt = converted(storage)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    low = low_precision_of(opt)
    assert (low is None) == (storage == "float32")
    assert storage == "float32" or low.kind == storage
    before = [p.detach().clone() for p in model.parameters()]
    for g in fixed_grads(3):
        assert bool(step_with(opt, list(model.parameters()), g))
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    plan = resolve_amp("bf16", {"master_weights": storage})
    assert function_mode(plan) == "half"  # losses, softmax, norms in float32, as naive
    assert function_mode(resolve_amp("bf16", {})) is None  # autocast, as before


def test_forward_outputs_and_losses_are_float32():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 3))
    amp_model, opt, crit = mpfunc_torch.convert_to_amp(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(),
        mode="bf16", master_weights="remainder")
    assert model[1].weight.dtype == torch.bfloat16  # all params, norms included (as JAX)
    out = amp_model(torch.randn(4, 8))
    loss = crit(out, torch.arange(4) % 3)
    assert out.dtype == torch.float32 and loss.dtype == torch.float32
    opt.backward(loss)
    assert bool(opt.step())


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
], ids=["adamw", "sgd-momentum"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_remainder_follows_float32_masters_bit_for_bit(make, chunks):
    grads = fixed_grads(30)
    ref_model, ref = converted("float32", make)
    model, opt = converted("remainder", make, step_chunks=chunks)
    for g in grads:
        step_with(ref, list(ref_model.parameters()), g)
        step_with(opt, list(model.parameters()), g)
    for want, got in zip(masters(ref), masters(opt), strict=True):
        assert torch.equal(bits(want), bits(got))


@pytest.mark.parametrize("storage,state", [
    ("remainder", None), ("kahan", "bfloat16"), ("stochastic", "bfloat16"),
    ("float32", "bfloat16"), ("stochastic", "float8_e4m3fn"), ("stochastic", "float8_e5m2")])
def test_a_skipped_step_changes_nothing(storage, state):
    keys = {} if state is None else {"state_dtype": state}
    if state == "float8_e4m3fn":
        keys["state_rounding"] = "nearest"  # e5m2: the default, stochastic
    model, opt = converted(storage, seed=3 if storage == "stochastic" or state == "bfloat16"
                           else 0, **keys)
    for g in fixed_grads(2):
        step_with(opt, list(model.parameters()), g)
    before = snapshot(model, opt)
    bad = fixed_grads(1, seed=7)[0]
    bad[0][0, 0] = float("inf")
    assert not bool(step_with(opt, list(model.parameters()), bad))
    same(before, snapshot(model, opt))
    assert bool(step_with(opt, list(model.parameters()), fixed_grads(1, seed=8)[0]))


@pytest.mark.parametrize("storage", ["remainder", "kahan", "stochastic"])
def test_a_checkpoint_resumes_bit_for_bit(storage):
    grads = fixed_grads(6)
    keys = {"state_dtype": "bfloat16", "seed": 5}
    model, opt = converted(storage, **keys)
    for g in grads[:3]:
        step_with(opt, list(model.parameters()), g)
    saved_model, saved_opt = round_trip(model.state_dict()), round_trip(opt.state_dict())
    assert saved_opt["low_precision"]["storage"] == storage
    for g in grads[3:]:
        step_with(opt, list(model.parameters()), g)
    model2, opt2 = converted(storage, **keys)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    for g in grads[3:]:
        step_with(opt2, list(model2.parameters()), g)
    same(snapshot(model, opt), snapshot(model2, opt2))


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_stochastic_params_with_8bit_state_hold_about_4_bytes_per_param(rounding):
    model = torch.nn.Linear(512, 256, bias=False)
    keys = {} if rounding == "stochastic" else {"state_rounding": rounding}  # the default
    _, opt, _ = mpfunc_torch.convert_to_amp(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), mode="bf16",
        master_weights="stochastic", state_dtype="float8_e4m3fn", **keys)
    assert low_precision_of(opt).state.rounding == rounding
    opt.backward(model(torch.randn(4, 512, dtype=torch.bfloat16)).float().square().mean())
    assert bool(opt.step())
    per_param = persistent_bytes(opt, model) / model.weight.numel()
    assert 4.0 < per_param <= 4.1, per_param  # 2 (param) + 1 + 1 (moments) + scales


def test_stochastic_params_with_stochastic_8bit_state_train():
    # The 4-byte setting with its defaults (8-bit moments rounded stochastically) fits a
    # small regression: the loss falls well below its start, and the moments stay 8-bit
    # codes with block scales.
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = torch.tanh(x @ torch.randn(16, 5))
    model = net(seed=3)
    amp_model, opt, _ = mpfunc_torch.convert_to_amp(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), mode="bf16",
        master_weights="stochastic", state_dtype="float8_e4m3fn", seed=9)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(amp_model(x).float(), y)
        opt.backward(loss)
        assert bool(opt.step())
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0], (losses[0], losses[-1])
    assert low_precision_of(opt).step == 60
    for st in opt.optimizer.state.values():
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float8_e4m3fn
        assert st["exp_avg:scale"].dtype == torch.float32


def test_bf16_autocast_with_bfloat16_state_keeps_float32_params():
    model, opt = net(), None
    _, opt, _ = mpfunc_torch.convert_to_amp(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), mode="bf16",
        state_dtype="bfloat16", state_rounding="nearest")
    step_with(opt, list(model.parameters()), [g.float() for g in fixed_grads(1)[0]])
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    st = opt.optimizer.state[next(iter(model.parameters()))]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16


def test_booster_spelling_is_the_same_mode():
    a, b = net(), net()
    _, oa, _ = mpfunc_torch.convert_to_amp(
        a, torch.optim.SGD(a.parameters(), lr=0.1),
        mixed_precision=mpfunc_torch.BF16MixedPrecision(master_weights="remainder"))
    _, ob, _ = mpfunc_torch.convert_to_amp(b, torch.optim.SGD(b.parameters(), lr=0.1),
                                           mode="bf16", master_weights="remainder")
    for g in fixed_grads(3):
        step_with(oa, list(a.parameters()), g)
        step_with(ob, list(b.parameters()), g)
    assert low_precision_of(oa).kind == "remainder"
    same(snapshot(a, oa), snapshot(b, ob))


def test_what_is_not_wired_is_refused_before_anything_changes():
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="kahan"):
        mpfunc_torch.convert_to_amp(model, opt, mode="bf16", master_weights="kahn")
    with pytest.raises(ValueError, match="has no effect"):
        mpfunc_torch.convert_to_amp(model, opt, mode="bf16", master_weights="remainder",
                                    seed=4)
    with pytest.raises(TypeError, match=r"`master_weights` must be a bool with mode 'apex', "
                       r"got 'remainder'.*use mode=\"bf16\", master_weights='remainder'\."):
        mpfunc_torch.convert_to_amp(model, opt, mode="apex", opt_level="O2",
                                    master_weights="remainder")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
