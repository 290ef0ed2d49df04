"""Tests for mpfunc_torch._src.exact_skip: the two ways a torch step is taken or skipped."""

import copy
import warnings

import pytest
import torch

from mpfunc_torch._src import exact_skip


def _net_and_grads(seed=0, bad=None):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    if bad is not None:
        net[2].weight.grad[0, 1] = bad
    return net


def _snapshot(net, opt):
    return ([p.detach().clone() for p in net.parameters()],
            copy.deepcopy(opt.state_dict()["state"]))


def _assert_same(a, b):
    params_a, state_a = a
    params_b, state_b = b
    for x, y in zip(params_a, params_b, strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    assert state_a.keys() == state_b.keys()
    for k in state_a:
        for name, v in state_a[k].items():
            assert torch.equal(v, state_b[k][name]), (k, name)


def _adam(net, fused):
    return torch.optim.Adam(net.parameters(), lr=0.1, fused=fused)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_take_or_drop_skips_bit_for_bit_and_counts_the_call(fused, bad):
    net = _net_and_grads()
    opt = _adam(net, fused)
    opt.step()  # a first, clean step, so that there is state to keep
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    net[2].weight.grad[0, 1] = bad
    before = _snapshot(net, opt)
    exact_skip.take_or_drop_(opt, torch.ones(()), [], in_kernel=fused)
    _assert_same(before, _snapshot(net, opt))
    with warnings.catch_warnings():  # a skipped step still counts as the step: no
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        sched.step()


@pytest.mark.parametrize("fused", [False, True])
def test_take_or_drop_takes_the_plain_step(fused):
    net, ref = _net_and_grads(), _net_and_grads()
    opt, ref_opt = _adam(net, fused), _adam(ref, fused)
    exact_skip.take_or_drop_(opt, torch.zeros(()), [], in_kernel=fused)
    ref_opt.step()
    _assert_same(_snapshot(ref, ref_opt), _snapshot(net, opt))


def test_take_or_drop_with_a_host_skip_decides_on_the_host():
    net = _net_and_grads(bad=float("inf"))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=True)
    before = _snapshot(net, opt)
    exact_skip.take_or_drop_(opt, torch.ones(()), [], in_kernel=True, host_skip=True)
    _assert_same(before, _snapshot(net, opt))
    assert opt.state_dict()["state"] == {}  # no momentum buffer was made


def test_take_or_drop_copies_masters_into_the_model_only_when_taken():
    model_p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    master = torch.nn.Parameter(torch.ones(3))
    master.grad = torch.full((3,), 2.0)
    opt = torch.optim.SGD([master], lr=0.25)
    exact_skip.take_or_drop_(opt, torch.ones(()), [(model_p, master)], in_kernel=False)
    assert master.tolist() == [1.0] * 3 and model_p.tolist() == [1.0] * 3
    exact_skip.take_or_drop_(opt, torch.zeros(()), [(model_p, master)], in_kernel=False)
    assert master.tolist() == [0.5] * 3 and model_p.tolist() == [0.5] * 3


@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_step_in_kernel_unscales_in_the_kernel_and_skips_there(bad):
    scale = torch.tensor(1024.0)
    net, ref = _net_and_grads(bad=bad), _net_and_grads(bad=bad)
    opt, ref_opt = _adam(net, True), _adam(ref, False)
    for p in net.parameters():
        p.grad.mul_(scale)  # scaled grads; the kernel divides them back exactly
    before = _snapshot(net, opt)
    found = torch.zeros(())
    exact_skip.step_in_kernel_(opt, list(net.parameters()), scale, found, ())
    assert found.item() == (0.0 if bad is None else 1.0)
    if bad is None:
        ref_opt.step()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert all(int(s["step"]) == 1 for s in opt.state.values())
    else:
        params, state = _snapshot(net, opt)
        _assert_same((before[0], {}), (params, {}))
        assert all(int(s["step"]) == 0 for s in state.values())  # the count undone


def test_a_skipped_first_step_in_the_kernel_leaves_a_fresh_state():
    # A fused optimizer makes its state (zeros, step 0) before its kernel sees found_inf,
    # so a skipped first step leaves that state behind, as with torch's GradScaler. It
    # is the state of an optimizer that never stepped: the next step equals a fresh
    # optimizer's first step, bit for bit.
    net, ref = _net_and_grads(bad=float("inf")), _net_and_grads()
    opt, ref_opt = _adam(net, True), _adam(ref, True)
    before = [p.detach().clone() for p in net.parameters()]
    exact_skip.step_in_kernel_(opt, list(net.parameters()), None, torch.zeros(()), ())
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    for s in opt.state.values():
        assert int(s["step"]) == 0
        assert not s["exp_avg"].any() and not s["exp_avg_sq"].any()
    for p, q in zip(net.parameters(), ref.parameters()):
        p.grad = q.grad.clone()
    exact_skip.step_in_kernel_(opt, list(net.parameters()), None, torch.zeros(()), ())
    ref_opt.step()
    _assert_same(_snapshot(ref, ref_opt), _snapshot(net, opt))
