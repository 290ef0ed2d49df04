"""mpfunc_torch._src.cast_ahead: the half modes' cast done before a DDP wrap (Lightning's
``convert_module``), then `convert_to_amp` over optimizers built on the cast params: the
same training, bit for bit, as one `convert_to_amp` call on the float32 model."""

import pytest
import torch
from torch_task import batches, make_model, same

import mpfunc_torch
from _mpfunc_common.amp_config import resolve_amp
from mpfunc_torch._src.cast_ahead import cast_ahead, cast_ahead_of

MODES = [("naive", {"initial_scale": 2.0**8}),
         ("apex", {"opt_level": "O2", "verbosity": 0}),
         ("apex", {"opt_level": "O3", "verbosity": 0})]
OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4),
    # Adagrad makes its state at construction: from the cast params here
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=1e-4),
    # fused SGD is refused where it would step float16 on CPU, not where masters step
    "fused sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
}


def train(mode, cfg, optimizer, ahead, steps=3):
    net = make_model()
    if ahead:
        assert cast_ahead(net, resolve_amp(mode, cfg))
        assert net.fc1.weight.dtype == torch.float16
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, OPTIMIZERS[optimizer](net.parameters()), torch.nn.CrossEntropyLoss(),
        mode=mode, **cfg)
    for x, y in batches(steps, batch=32):
        opt.zero_grad()
        opt.backward(crit(model(x), y))
        opt.step()
    return net, opt


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("mode, cfg", MODES, ids=["naive", "O2", "O3"])
def test_casting_ahead_trains_bit_for_bit_as_one_conversion(mode, cfg, optimizer):
    if cfg.get("opt_level") == "O3" and optimizer == "fused sgd":
        pytest.skip("refused either way: O3 steps float16 params (tested in test_torch_modes)")
    net, opt = train(mode, cfg, optimizer, ahead=True)
    ref_net, ref_opt = train(mode, cfg, optimizer, ahead=False)
    assert same(net.state_dict(), ref_net.state_dict())
    assert same(opt.state_dict(), ref_opt.state_dict())  # masters, inner state, scale
    assert cast_ahead_of(net, opt.plan) is None  # released: its float32 values freed
    if opt.plan.master_weights:
        assert {m.dtype for _, m in opt._pairs} == {torch.float32}


def test_masters_start_from_the_float32_values_not_the_half_params():
    net = make_model()
    exact = net.fc1.weight.detach().clone()
    cast_ahead(net, resolve_amp("naive", {}))
    _, opt, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                            mode="naive")
    master = dict((id(p), m) for p, m in opt._pairs)[id(net.fc1.weight)]
    assert torch.equal(master, exact) and not torch.equal(master, exact.half().float())


def test_a_param_written_after_the_cast_gets_a_master_from_its_own_value():
    net = make_model()
    cast_ahead(net, resolve_amp("naive", {}))
    with torch.no_grad():  # as DDP's broadcast of another rank's params would
        net.fc1.weight.mul_(0.5)
    _, opt, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                            mode="naive")
    master = dict((id(p), m) for p, m in opt._pairs)[id(net.fc1.weight)]
    assert torch.equal(master, net.fc1.weight.float())


def test_the_cast_is_the_conversions_own_and_nothing_to_do_is_no_cast():
    net = make_model()
    assert not cast_ahead(net, resolve_amp("torch", {}))  # float32 params: nothing
    assert net.fc1.weight.dtype == torch.float32
    assert cast_ahead(net, resolve_amp("apex", {"opt_level": "O2"}))
    assert net.norm.weight.dtype == torch.float32  # O2 keeps its norm
    assert not cast_ahead(net, resolve_amp("apex", {"opt_level": "O2"}))  # once
    with pytest.raises(ValueError, match=r"was cast to torch.float16 \(norms kept in "
                                         r"float32: True\) ahead of the conversion"):
        mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                    mode="naive")
    half = make_model().half()
    with pytest.raises(ValueError, match="already half precision"):
        cast_ahead(half, resolve_amp("naive", {}))
