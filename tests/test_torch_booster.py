"""Tests for mpfunc_torch's Booster vocabulary: `boost`, `backward` and `mixed_precision=`
(a Booster name or a config object) on `convert_to_amp`."""

import dataclasses

import pytest
import torch
from misspellings import MISSPELT

import mpfunc_torch
from mpfunc_torch import (
    AMP_TYPE,
    BF16MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Linear(16, 3))


def data(n_batches=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n_batches)]


def train(model, opt, crit, batches):
    for x, y in batches:
        opt.zero_grad()
        loss = crit(model(x), y)
        mpfunc_torch.backward(loss, opt)
        opt.step()
    return opt.scale_metrics(as_python=True)


def convert(**how):
    net = make_model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    mode = how.pop("mode", None)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode, **how)
    return net, model, opt, crit


# Each row: the same mode spelled three (or four) ways.
SPELLINGS = [
    [dict(mixed_precision="fp16"), dict(mixed_precision=FP16TorchMixedPrecision()),
     dict(mode="torch"), dict(mode=AMP_TYPE.TORCH)],
    [dict(mixed_precision="fp16_naive"), dict(mixed_precision=FP16NaiveMixedPrecision()),
     dict(mode="naive"), dict(mode=AMP_TYPE.NAIVE)],
    [dict(mixed_precision="fp16_apex"), dict(mixed_precision=FP16ApexMixedPrecision()),
     dict(mode="apex"), dict(mode=AMP_TYPE.APEX)],
    [dict(mixed_precision="bf16"), dict(mixed_precision=BF16MixedPrecision()),
     dict(mode="bf16"), dict(mode=AMP_TYPE.BF16)],
    # non-default keys
    [dict(mixed_precision="fp16_naive", initial_scale=1024.0, hysteresis=3),
     dict(mixed_precision=FP16NaiveMixedPrecision(initial_scale=1024.0, hysteresis=3)),
     dict(mode=FP16NaiveMixedPrecision(initial_scale=1024, hysteresis=3)),
     dict(mode="naive", initial_scale=1024.0, hysteresis=3)],
    [dict(mixed_precision="fp16_apex", opt_level="O2", verbosity=0),
     dict(mixed_precision=FP16ApexMixedPrecision("O2", verbosity=0)),
     dict(mode=AMP_TYPE.APEX, opt_level="O2", verbosity=0),
     dict(mode="apex-O2", verbosity=0)],  # the demo table's name for it
    [dict(mixed_precision="fp16", init_scale=256.0, growth_interval=2),
     dict(mixed_precision=FP16TorchMixedPrecision(256.0, growth_interval=2)),
     dict(mode="torch", init_scale=256.0, growth_interval=2)],
]


@pytest.mark.parametrize("spellings", SPELLINGS, ids=lambda s: str(s[0]))
def test_every_spelling_gives_the_same_conversion(spellings, capsys):
    results = []
    for how in spellings:
        net, model, opt, crit = convert(**dict(how))
        dtypes = [p.dtype for p in net.parameters()]
        metrics = train(model, opt, crit, data())
        params = [p.detach().clone() for p in net.parameters()]
        results.append((opt.plan, model.plan, dtypes, metrics, params))
    ref = results[0]
    for how, got in zip(spellings[1:], results[1:]):
        assert got[0] == ref[0] and got[1] == ref[1], how   # the plan
        assert got[2] == ref[2], how                       # param dtypes after conversion
        assert got[3] == ref[3], how                       # loss scale, skips
        for a, b in zip(got[4], ref[4]):
            assert torch.equal(a, b), how                  # bit-identical training
    capsys.readouterr()  # apex's default verbosity prints the plan


def test_the_booster_names_are_the_modes():
    assert convert()[2].plan.mode == "torch"  # no mode, no mixed_precision: the default
    for name, mode in [("fp16", "torch"), ("fp16_apex", "apex"), ("fp16_naive", "naive"),
                       ("bf16", "bf16")]:
        _, _, opt, _ = convert(mixed_precision=name)
        assert opt.plan.mode == mode


def test_spelling_errors():
    with pytest.raises(ValueError, match="both given"):
        convert(mode="naive", mixed_precision="fp16_naive")
    with pytest.raises(ValueError, match=r"set them on the object.*hysteresis"):
        convert(mixed_precision=FP16NaiveMixedPrecision(), hysteresis=3)
    with pytest.raises(ValueError, match=r"`mixed_precision` must be one of "
                                         r"\['fp16', 'fp16_apex', 'fp16_naive', 'bf16'"):
        convert(mixed_precision="fp32")
    with pytest.raises(ValueError, match=r"`mode` must be one of \[.torch.*a Booster name \[.fp16."):
        convert(mode="float16")
    with pytest.raises(ValueError, match="unknown config key"):  # a name keeps its mode's keys
        convert(mixed_precision="fp16", opt_level="O2")


@pytest.mark.parametrize("how, message", MISSPELT)
def test_misspelt_modes_and_keys_name_the_closest_valid_one(how, message):
    with pytest.raises(ValueError, match=message):
        convert(**how)


def loop_parts(lr=0.1):
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 + epoch)
    loader = torch.utils.data.DataLoader(list(zip(*[torch.cat(t) for t in zip(*data(4))])),
                                         batch_size=8)
    return net, opt, torch.nn.CrossEntropyLoss(), loader, sched


def test_boost_passes_the_loader_and_scheduler_through():
    net, opt, crit, loader, sched = loop_parts()
    model, aopt, acrit, loader2, sched2 = mpfunc_torch.boost(
        net, opt, crit, loader, sched, mixed_precision="fp16_naive")
    assert loader2 is loader and sched2 is sched
    assert isinstance(aopt, mpfunc_torch.AmpOptimizer) and aopt.optimizer is opt
    assert isinstance(model, mpfunc_torch.AmpModel) and isinstance(acrit, mpfunc_torch.AmpCriterion)
    assert net[0].weight.dtype == torch.float16
    # Optional parts stay optional.
    net2 = make_model()
    out = mpfunc_torch.boost(net2, torch.optim.SGD(net2.parameters(), lr=0.1),
                             mixed_precision=BF16MixedPrecision())
    assert out[2:] == (None, None, None)


def test_boost_errors():
    net, opt, crit, loader, sched = loop_parts()
    with pytest.raises(ValueError, match="`mixed_precision` is None"):
        mpfunc_torch.boost(net, opt, crit, mixed_precision=None)
    with pytest.raises(TypeError, match="mixed_precision"):
        mpfunc_torch.boost(net, opt, crit)  # required, as Booster's argument is the point
    other = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="`lr_scheduler`.*not the `optimizer` given"):
        mpfunc_torch.boost(net, other, crit, loader, sched, mixed_precision="fp16")
    with pytest.raises(ValueError, match="must be one of .* or a config object"):
        mpfunc_torch.boost(net, opt, crit, mixed_precision="fp4")


@pytest.mark.parametrize("mixed_precision", [
    FP16TorchMixedPrecision(init_scale=1024.0),
    FP16NaiveMixedPrecision(initial_scale=1024.0),
    FP16ApexMixedPrecision("O2", verbosity=0, loss_scale=1024.0),
])
@pytest.mark.parametrize("built", ["before", "after"])
def test_the_scheduler_sets_the_lr_each_step_uses(mixed_precision, built):
    """Each taken SGD step moves the stepped params (float32 masters where the mode
    has them) by exactly -lr * grad, with the lr the scheduler set for that epoch; this
    holds for a scheduler built on the plain optimizer (the tutorial's order) and for one
    built on the boosted optimizer."""
    net, opt, crit, loader, sched = loop_parts()
    if built == "after":
        sched = None
    model, opt, crit, loader, sched = mpfunc_torch.boost(
        net, opt, crit, loader, sched, mixed_precision=mixed_precision)
    if built == "after":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 + epoch)
    lrs = []
    for _epoch in range(3):
        for x, y in loader:
            opt.zero_grad()
            mpfunc_torch.backward(crit(model(x), y), opt)
            opt.unscale_()
            stepped = [q for g in opt.param_groups for q in g["params"]]
            grads = [q.grad.clone() for q in stepped]
            before = [q.detach().clone() for q in stepped]
            assert bool(opt.step())
            lr = opt.param_groups[0]["lr"]
            lrs.append(lr)
            for q, b, g in zip(stepped, before, grads):
                torch.testing.assert_close(q.detach(), b - lr * g)
        sched.step()
    assert lrs == [0.1] * 4 + [0.2] * 4 + [pytest.approx(0.3)] * 4


def test_a_skipped_first_step_still_counts_as_the_optimizer_step():
    """naive starts at 2**32 and skips its first steps; the scheduler's call-order check
    (a UserWarning, an error here) must not fire for a loop in the right order."""
    net, opt, crit, loader, sched = loop_parts()
    model, opt, crit, loader, sched = mpfunc_torch.boost(
        net, opt, crit, loader, sched, mixed_precision="fp16_naive")
    x, y = next(iter(loader))
    mpfunc_torch.backward(crit(model(x), y), opt)
    assert not bool(opt.step())  # skipped: the loss times 2**32 overflows float16
    sched.step()                 # no "lr_scheduler.step() before optimizer.step()" warning
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)


def test_scheduler_before_any_step_still_warns():
    net, opt, crit, loader, sched = loop_parts()
    model, opt, crit, loader, sched = mpfunc_torch.boost(
        net, opt, crit, loader, sched, mixed_precision="fp16_naive")
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        sched.step()


def test_backward_is_the_optimizer_backward():
    grads = []
    for use_free_function in (True, False):
        net, opt, crit, loader, sched = loop_parts()
        model, opt, crit, *_ = mpfunc_torch.boost(
            net, opt, crit, mixed_precision=FP16NaiveMixedPrecision(initial_scale=1024.0))
        x, y = next(iter(loader))
        loss = crit(model(x), y)
        if use_free_function:
            mpfunc_torch.backward(loss, opt)
        else:
            opt.backward(loss)
        grads.append([p.grad.clone() for p in net.parameters()])
    for a, b in zip(*grads):
        assert bool(a.isfinite().all()) and bool(a.abs().sum() > 0)
        assert torch.equal(a, b)
    net, opt, crit, loader, sched = loop_parts()
    with pytest.raises(TypeError, match="returned by mpfunc_torch.boost"):
        mpfunc_torch.backward(crit(net(torch.randn(2, 6)), torch.zeros(2, dtype=torch.long)), opt)


def test_config_object_is_accepted_positionally_and_replace_works():
    cfg = dataclasses.replace(FP16NaiveMixedPrecision(), hysteresis=5)
    _, _, opt, _ = convert(mode=cfg)
    assert opt.plan.scale_config.hysteresis == 5
    _, _, opt, _ = convert(mode=FP16TorchMixedPrecision(dtype=torch.bfloat16))
    assert opt.plan.autocast_dtype == "bfloat16"
