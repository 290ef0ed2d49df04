"""Tests for mpfunc_torch._src.optimizer: AmpOptimizer's skips, scaling, accumulation,
checkpoints and the torch optimizer interface."""

import pytest
import torch
from anchors import torch_gradscaler
from torch_task import ALL_MODES, batches, ids, is_o3, make_model, train

import mpfunc_torch
from mpfunc_torch import AMP_TYPE


def snapshot(model, opt):
    return {
        "params": [p.detach().clone() for p in model.module.parameters()],
        "masters": [m.detach().clone() for _, m in opt._pairs],
        "state": {k: {n: v.clone() for n, v in st.items()} for k, st in
                  enumerate(opt.optimizer.state.values())},
        "scale": opt.loss_scale.item(),
    }


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode, cfg", ALL_MODES, ids=ids)
def test_injected_inf_is_skipped_without_losing_anything(mode, cfg, fused):
    data = batches(4)
    kind = "adam" if (fused or not is_o3(cfg)) else "sgd"  # O3 + non-fused Adam: see above
    model, opt, _ = train(mode, cfg, data=data[:3], fused=fused, kind=kind)
    before = snapshot(model, opt)
    x, y = data[3]
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x).float(), y) * float("inf")
    opt.backward(loss)
    stepped = opt.step()
    assert not bool(stepped)
    after = snapshot(model, opt)
    for a, b in zip(before["params"], after["params"]):
        assert torch.equal(a, b)
    for a, b in zip(before["masters"], after["masters"]):
        assert torch.equal(a, b)
    assert before["state"].keys() == after["state"].keys()
    for k in before["state"]:
        for n in before["state"][k]:
            assert torch.equal(before["state"][k][n], after["state"][k][n]), n
    plan = opt.plan
    if plan.scale_kind == "dynamic" and plan.scale_config.hysteresis == 1:
        assert after["scale"] == before["scale"] / 2
    else:
        assert after["scale"] == before["scale"]  # static/none, or absorbed by hysteresis
    assert opt.scale_metrics(as_python=True)["last_finite"] is False


@pytest.mark.parametrize("fused", [False, True])
def test_torch_mode_trajectory_matches_gradscaler_end_to_end(fused):
    seq = [True, True, False, True, True, True, False, False, True, True, True, True]
    net = make_model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=fused)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=AMP_TYPE.TORCH, growth_interval=3)
    scales = []
    for (x, y), finite in zip(batches(len(seq)), seq):
        opt.zero_grad()
        loss = crit(model(x), y) * (1.0 if finite else float("inf"))
        opt.backward(loss)
        opt.step()
        scales.append(opt.loss_scale.item())
    assert scales == [float(s) for s in torch_gradscaler(seq, interval=3)]


def test_fused_path_never_syncs_with_host(monkeypatch):
    net = make_model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode="torch")
    x, y = batches(1)[0]
    opt.backward(crit(model(x), y))

    def boom(*a, **k):
        raise AssertionError("host sync in the fused step")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", boom)
        m.setattr(torch.Tensor, "__bool__", boom)
        m.setattr(torch.Tensor, "tolist", boom)
        stepped = opt.step()
    assert bool(stepped)

class TestSeedPatterns:
    def test_clipping_with_unscale(self):
        net = make_model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                       mode="torch", init_scale=2.0**10)
        x, y = batches(1)[0]
        opt.backward(crit(model(x), y))
        norm = opt.clip_grad_norm(0.1)
        # The norm is of the unscaled gradients: compare with a float32 reference.
        ref = make_model()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        assert float(norm) == pytest.approx(float(ref_norm), rel=0.02)
        clipped = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in net.parameters()]))
        assert float(clipped) == pytest.approx(0.1, rel=1e-4)
        assert bool(opt.step())

    def test_gradient_accumulation(self):
        data = batches(4)
        results = []
        for accumulate in (True, False):
            net = make_model()
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            model, opt, crit = mpfunc_torch.convert_to_amp(
                net, opt, torch.nn.CrossEntropyLoss(), mode="apex", opt_level="O0",
                verbosity=0)
            if accumulate:
                for x, y in data:
                    opt.backward(crit(model(x), y) / len(data))
            else:
                x = torch.cat([b[0] for b in data])
                y = torch.cat([b[1] for b in data])
                opt.backward(crit(model(x), y))
            opt.step()
            results.append([p.detach().clone() for p in net.parameters()])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def test_accumulation_with_scaling_unscales_once(self):
        net = make_model()
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        model, opt, crit = mpfunc_torch.convert_to_amp(
            net, opt, torch.nn.CrossEntropyLoss(), mode="torch", init_scale=2.0**8)
        x, y = batches(1)[0]
        for _ in range(3):
            opt.backward(crit(model(x), y))
        opt.unscale_()
        ref = make_model()
        for _ in range(3):
            torch.nn.functional.cross_entropy(ref(x), y).backward()
        for p, r in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, rtol=2e-2, atol=1e-4)

    def test_gradient_penalty(self):
        net = make_model()
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                       mode="torch", init_scale=2.0**10)
        x, y = batches(1)[0]
        loss = crit(model(x), y)
        scaled_grads = torch.autograd.grad(opt.scale_loss(loss), list(net.parameters()),
                                           create_graph=True)
        inv = 1.0 / opt.loss_scale
        grads = [g * inv for g in scaled_grads]
        penalty = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        # The same penalty without scaling, in float32:
        ref = make_model()
        ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
        ref_grads = torch.autograd.grad(ref_loss, list(ref.parameters()), create_graph=True)
        ref_penalty = torch.sqrt(sum(g.pow(2).sum() for g in ref_grads))
        assert penalty.item() == pytest.approx(ref_penalty.item(), rel=0.02)
        opt.backward(loss + penalty)
        assert bool(opt.step())

    def test_two_losses_two_optimizers_share_one_scale(self):
        torch.manual_seed(0)
        m1, m2 = make_model(1), make_model(2)
        both = torch.nn.ModuleList([m1, m2])
        o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
        o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
        model, (o1, o2), crit = mpfunc_torch.convert_to_amp(
            both, [o1, o2], torch.nn.CrossEntropyLoss(), mode="torch", growth_interval=1,
            init_scale=2.0**8)
        assert o1._scalers is o2._scalers
        x, y = batches(1)[0]
        for _ in range(2):
            o1.zero_grad()
            o2.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out1, out2 = m1(x), m2(x)
            loss1 = crit(2 * out1 + 3 * out2, y)
            loss2 = crit(3 * out1 - 5 * out2, y)
            o1.backward(loss1, retain_graph=True)
            o1.backward(loss2)
            o1.unscale_()
            assert bool(o1.step()) and bool(o2.step())
        # interval 1: the shared scale grew once per iteration, not once per optimizer
        assert o1.loss_scale.item() == 2.0**10

    def test_num_losses_gives_each_loss_its_scale(self):
        net = make_model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model, opt, crit = mpfunc_torch.convert_to_amp(
            net, opt, torch.nn.CrossEntropyLoss(), mode="apex", opt_level="O1", num_losses=2,
            verbosity=0)
        x, y = batches(1)[0]
        out = model(x)
        opt.backward(crit(out, y), loss_id=0, retain_graph=True)
        opt.backward(crit(out, y) * float("inf"), loss_id=1)
        assert not bool(opt.step())
        m0 = opt.scale_metrics(as_python=True, loss_id=0)
        m1 = opt.scale_metrics(as_python=True, loss_id=1)
        assert m0["loss_scale"] == 2.0**16 and m1["loss_scale"] == 2.0**15
        assert m0["skipped_steps"] == m1["skipped_steps"] == 1
        # A clean step with both losses: gradients equal the float32 sum of both.
        opt.zero_grad()
        out = model(x)
        opt.backward(crit(out, y), loss_id=0, retain_graph=True)
        opt.backward(crit(out, y), loss_id=1)
        with pytest.raises(ValueError, match="`loss_id` must be an int in \\[0, 2\\)"):
            opt.backward(crit(model(x), y), loss_id=2)
        opt.unscale_()
        ref = make_model()
        (2 * torch.nn.functional.cross_entropy(ref(x), y)).backward()
        for p, r in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, rtol=2e-2, atol=2e-4)

def test_lr_scheduler_works_without_warnings():
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode="naive")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in batches(2):
        opt.zero_grad()
        opt.backward(crit(model(x), y))
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


@pytest.mark.parametrize("mode, cfg", [("naive", {"growth_interval": 3, "initial_scale": 2.0**14}),
                                       ("torch", {"growth_interval": 3}),
                                       ("apex", {"opt_level": "O2", "verbosity": 0})])
def test_state_dict_resume_is_exact(mode, cfg, tmp_path):
    data = batches(10)
    inject = {2, 6}

    def run(model, opt, crit, chunk, offset):
        for i, (x, y) in enumerate(chunk, offset):
            opt.zero_grad()
            loss = crit(model(x), y) * (float("inf") if i in inject else 1.0)
            opt.backward(loss)
            opt.step()

    def fresh():
        net = make_model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        return mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(), mode=mode,
                                           **cfg)

    model, opt, crit = fresh()
    run(model, opt, crit, data[:5], 0)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ck.pt")
    run(model, opt, crit, data[5:], 5)

    model2, opt2, crit2 = fresh()
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    run(model2, opt2, crit2, data[5:], 5)
    for a, b in zip(model.module.parameters(), model2.module.parameters()):
        assert torch.equal(a, b)
    for (_, a), (_, b) in zip(opt._pairs, opt2._pairs):
        assert torch.equal(a, b)
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    for s1, s2 in zip(sd1["scalers"], sd2["scalers"]):
        for k in ("loss_scale", "growth_tracker", "hysteresis_left", "skipped_steps"):
            assert torch.equal(s1[k], s2[k]), k
    assert int(sd1["scalers"][0]["skipped_steps"]) == 2


def test_load_state_dict_rejects_other_modes():
    net = make_model()
    _, opt, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                            mode="torch")
    net2 = make_model()
    _, opt2, _ = mpfunc_torch.convert_to_amp(net2, torch.optim.SGD(net2.parameters(), lr=0.1),
                                             mode="naive")
    with pytest.raises(ValueError, match="from mode 'torch'"):
        opt2.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="missing keys"):
        opt.load_state_dict({"optimizer": {}})
