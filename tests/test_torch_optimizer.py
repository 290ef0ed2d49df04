"""Tests for mpfunc_torch._src.optimizer: AmpOptimizer's skips, scaling, accumulation,
checkpoints and the torch optimizer interface."""

import pytest
import torch
from anchors import torch_gradscaler
from torch_task import ALL_MODES, batches, ids, is_o3, make_model, tiny_batch, tiny_model, train

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


@pytest.mark.parametrize("mode, cfg", [
    ("torch", {}),
    # a floor below 1: the extra check after unscaling stays on the device too
    ("apex", {"opt_level": "O1", "min_loss_scale": 2.0**-8, "verbosity": 0}),
    ("naive", {"initial_scale": 2.0**10, "min_scale": 0.5}),
], ids=["torch", "apex-O1-below-one", "naive-below-one"])
def test_fused_path_never_syncs_with_host(monkeypatch, mode, cfg):
    net = make_model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=mode, **cfg)
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

    def test_a_backward_after_a_sharing_optimizer_unscaled_is_refused(self):
        # Found by a random call-sequence test: o2 unscaled (clip_grad_norm), then a
        # backward through o1 added scaled gradients to o2's unscaled ones; o2's step
        # trusted its earlier check and stepped an overflow (NaN momentum and params).
        torch.manual_seed(0)
        m1, m2 = make_model(1), make_model(2)
        o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
        o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        model, (o1, o2), crit = mpfunc_torch.convert_to_amp(
            torch.nn.ModuleList([m1, m2]), [o1, o2], torch.nn.CrossEntropyLoss(),
            mode="torch", init_scale=2.0**8)
        x, y = batches(1)[0]
        loss = lambda: crit(m1(x) + m2(x), y)  # noqa: E731
        o1.backward(loss())
        o2.clip_grad_norm(1.0)
        grads = [p.grad.clone() for p in m1.parameters()] + [p.grad.clone()
                                                             for p in m2.parameters()]
        with pytest.raises(RuntimeError, match="number 1 in convert_to_amp's list"):
            o1.backward(loss())
        after = [p.grad for p in m1.parameters()] + [p.grad for p in m2.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(grads, after, strict=True))
        assert bool(o1.step()) and bool(o2.step())
        assert all(torch.isfinite(p).all() for p in m2.parameters())

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


# -- GradScaler users' habits ------------------------------------------------------------

@pytest.mark.parametrize("mode, cfg", [("torch", {"init_scale": 2.0**8}),
                                       ("naive", {"initial_scale": 2.0**8}),
                                       ("apex", {"opt_level": "O1", "num_losses": 2,
                                                 "max_loss_scale": 2.0**8, "verbosity": 0})])
def test_scale_loss_then_backward_is_the_same_as_opt_backward(mode, cfg):
    # GradScaler users write scaler.scale(loss).backward(); scaler.step(opt).
    results = []
    for habit in ("backward", "scale_loss"):
        net = tiny_model()
        model, opt, crit = mpfunc_torch.convert_to_amp(
            net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.MSELoss(), mode=mode,
            **cfg)
        n_losses = cfg.get("num_losses", 1)
        for step in range(3):
            opt.zero_grad()
            x, y = tiny_batch(step)
            out = model(x)
            for i in range(n_losses):
                loss = crit(out, y) * (i + 1)
                kw = {"retain_graph": i < n_losses - 1}
                if habit == "backward":
                    opt.backward(loss, loss_id=i, **kw)
                else:
                    opt.scale_loss(loss, loss_id=i).backward(**kw)
            assert bool(opt.step())
        results.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_step_twice_says_what_happened():
    net = tiny_model()
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.MSELoss(), mode="torch")
    opt.backward(crit(model(tiny_batch()[0]), tiny_batch()[1]))
    opt.step()
    with pytest.raises(RuntimeError, match="called again after step\\(\\) with no backward"):
        opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="step\\(\\) called before backward\\(\\)"):
        opt.step()


def test_a_failed_backward_leaves_no_step_behind_it():
    # Before: the stage moved at scale_loss, so a backward that raised left step() free
    # to "take" a step with no gradients (it returned True).
    net = tiny_model()
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.MSELoss(), mode="torch")
    x, y = tiny_batch()
    with pytest.raises(ValueError, match="`loss` must be a scalar .* got shape \\(16, 1\\)"):
        opt.backward(model(x))  # the criterion forgotten
    with pytest.raises(RuntimeError, match="step\\(\\) called before backward\\(\\)"):
        opt.step()
    out = model(x).sum()
    out.backward(retain_graph=False)  # the graph is freed: the next backward through it fails
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        opt.backward(out)
    with pytest.raises(RuntimeError, match="step\\(\\) called before backward\\(\\)"):
        opt.step()
    # In an accumulation, the earlier backward stands: step() takes its gradients.
    opt.backward(crit(model(x), y))
    out = model(x).sum()
    out.backward()
    with pytest.raises(RuntimeError, match="a second time"):
        opt.backward(out)
    before = [p.detach().clone() for p in net.parameters()]
    assert bool(opt.step())
    assert not all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    # A non-scalar loss with its `gradient` is torch's, and fine.
    opt.zero_grad()
    opt.backward(crit(model(x), y).reshape(1, 1).expand(2, 1), gradient=torch.ones(2, 1))
    assert bool(opt.step())


@pytest.mark.parametrize("fused", [False, True])
def test_step_hooks_fire_around_every_step_taken_or_skipped(fused):
    net = tiny_model()
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.Adam(net.parameters(), lr=1e-2, fused=fused), torch.nn.MSELoss(),
        mode="torch")
    seen = []
    h1 = opt.register_step_pre_hook(
        lambda o, a, k: seen.append(("pre", o is opt, o.skipped_steps.item())))
    h2 = opt.register_step_post_hook(
        lambda o, a, k: seen.append(("post", o is opt, o.skipped_steps.item())))
    x, y = tiny_batch()
    for factor in (1.0, float("inf"), 1.0):
        opt.zero_grad()
        opt.backward(crit(model(x), y) * factor)
        opt.step()
    # The post hook sees the step's outcome (skipped_steps already counted).
    assert seen == [("pre", True, 0), ("post", True, 0), ("pre", True, 0), ("post", True, 1),
                    ("pre", True, 1), ("post", True, 1)]
    h1.remove()
    h2.remove()
    opt.zero_grad()
    opt.backward(crit(model(x), y))
    opt.step()
    assert len(seen) == 6


def test_step_pre_hook_can_rewrite_arguments_like_torchs():
    net = tiny_model()
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.MSELoss(), mode="torch")
    opt.register_step_pre_hook(lambda o, a, k: ((o,), {"closure": lambda: 0.0}))
    opt.backward(crit(model(tiny_batch()[0]), tiny_batch()[1]))
    with pytest.raises(ValueError, match="`closure` is not supported"):
        opt.step()


def test_num_losses_rechecks_gradients_changed_after_backward():
    # e.g. a manual all-reduce between backward and step that brings in an inf.
    net = tiny_model()
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.MSELoss(), mode="apex",
        opt_level="O1", num_losses=2, verbosity=0)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = tiny_batch()
    out = model(x)
    opt.backward(crit(out, y), loss_id=0, retain_graph=True)
    opt.backward(crit(out, y), loss_id=1)
    net[0].weight.grad[0, 0] = float("nan")
    assert not bool(opt.step())
    for a, b in zip(before, net.parameters()):
        assert torch.equal(a, b)
    m = opt.scale_metrics(as_python=True)
    assert m["skipped_steps"] == 1 and m["consecutive_skips"] == 1
    assert m["loss_scale"] == 2.0**16  # neither loss overflowed: the scales stay


def test_consecutive_skips_counts_the_current_run_of_skips():
    net = tiny_model()
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.MSELoss(), mode="torch")
    x, y = tiny_batch()
    seen = []
    for factor in (1, "inf", "inf", "nan", 1, "inf"):
        opt.zero_grad()
        opt.backward(crit(model(x), y) * float(factor))
        opt.step()
        seen.append(opt.scale_metrics(as_python=True)["consecutive_skips"])
    assert seen == [0, 1, 2, 3, 0, 1]
    assert opt.state_dict()["scalers"][0]["consecutive_skips"].item() == 1


# -- torch's fused SGD and skipped first steps ------------------------------------------

def _poison_allocator(shape):
    # Freed memory of the same size is handed out again by the allocator: fill it with
    # NaN so that an uninitialised buffer shows.
    junk = torch.full(shape, float("nan"))
    del junk


def test_torch_fused_sgd_keeps_uninitialised_momentum_after_a_skipped_first_step():
    # Pins the upstream behaviour the wrapper works around: if this starts failing,
    # torch no longer creates the buffers on a skipped step and the workaround can go.
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
    p.grad = torch.randn(8, 8)
    opt.grad_scale, opt.found_inf = None, torch.ones(())
    opt.step()
    assert "momentum_buffer" in opt.state[p]  # created although the step was skipped


@pytest.mark.parametrize("mode, cfg", [("naive", {"initial_scale": 2.0**8}), ("torch", {}),
                                       ("apex", {"opt_level": "O2", "verbosity": 0})])
def test_fused_sgd_momentum_after_a_skipped_first_step_is_a_clean_first_step(mode, cfg):
    x, y = tiny_batch(n=16)
    results = []
    for skip_first in (True, False):
        net = tiny_model(n=16)
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=True)
        model, opt, crit = mpfunc_torch.convert_to_amp(net, sgd, torch.nn.MSELoss(),
                                                       mode=mode, **cfg)
        if skip_first:
            _poison_allocator((16, 16))
            opt.backward(crit(model(x), y) * float("inf"))
            assert not bool(opt.step())
            assert all("momentum_buffer" not in s for s in opt.state.values())
            opt.zero_grad()
        for _ in range(2):
            opt.zero_grad()
            opt.backward(crit(model(x), y))
            assert bool(opt.step())
        results.append([p.detach().clone() for p in net.parameters()])
        assert all(torch.isfinite(p).all() for p in net.parameters())
    for a, b in zip(*results):
        assert torch.equal(a, b)


# -- an overflow created by unscaling (scale < 1) ---------------------------------------

class _Huge(torch.nn.Module):
    """loss = 1e40 * sum(w * x): the true gradient (~1e40) overflows float32, but scaled
    by 2**-10 it is finite (~1e37), so only unscaling overflows."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), 1e-12))

    def forward(self, x):
        return ((self.w * x).sum() * 1e20) * 1e20


@pytest.mark.parametrize("opt_kind", ["sgd", "adam", "adam-fused"])
def test_overflow_created_by_unscaling_is_skipped(opt_kind):
    net = _Huge()
    inner = (torch.optim.SGD(net.parameters(), lr=0.1) if opt_kind == "sgd" else
             torch.optim.Adam(net.parameters(), lr=0.1, fused=opt_kind == "adam-fused"))
    model, opt, _ = mpfunc_torch.convert_to_amp(
        net, inner, mode="apex", opt_level="O1", max_loss_scale=2.0**-10,
        min_loss_scale=2.0**-20, verbosity=0)
    assert opt.loss_scale.item() == 2.0**-10
    before = net.w.detach().clone()
    opt.backward(model(torch.ones(4)))
    assert bool(torch.isfinite(net.w.grad).all())  # the scaled gradient is finite
    assert not bool(opt.step())
    assert torch.equal(net.w, before)
    assert all(torch.isfinite(v).all() for s in opt.state.values() for v in s.values())
    assert opt.loss_scale.item() == 2.0**-11


def test_unscaling_overflow_in_float16_grads_is_skipped():
    # apex O3 with a dynamic scale below 1: float16 gradients overflow when unscaled.
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1, bias=False)
    model, opt, _ = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=1e-9), mode="apex", opt_level="O3",
        loss_scale="dynamic", max_loss_scale=2.0**-10, min_loss_scale=2.0**-12, verbosity=0)
    before = net.weight.detach().clone()
    opt.backward(model(torch.full((1, 4), 3e4)).sum() * 4)  # true grad 1.2e5 > fp16 max
    assert bool(torch.isfinite(net.weight.grad).all())
    assert not bool(opt.step())
    assert torch.equal(net.weight, before)


# -- sparse and complex gradients --------------------------------------------------------

class _Bag(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 8, sparse=sparse)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, idx):
        return self.head(self.embed(idx).mean(1))


def _bag_data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (16, 6), generator=g), torch.randn(16, 1, generator=g)


def test_sparse_grads_in_torch_mode_match_gradscaler():
    # Indices repeat in every batch, so the embedding's sparse grad is uncoalesced. Ours
    # is coalesced before unscaling (GradScaler does so for float16 ones only), so the
    # duplicates are summed in another order: equal up to float32 rounding.
    ours = _Bag(sparse=True)
    model, opt, crit = mpfunc_torch.convert_to_amp(
        ours, torch.optim.SGD(ours.parameters(), lr=0.5), torch.nn.MSELoss(), mode="torch")
    ref = _Bag(sparse=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(4):
        idx, y = _bag_data(step)
        opt.zero_grad()
        opt.backward(crit(model(idx), y))
        opt.step()
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(idx)
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
        scaler.step(ref_opt)
        scaler.update()
    torch.testing.assert_close(ours.embed.weight, ref.embed.weight, rtol=1e-6, atol=1e-7)
    assert torch.equal(ours.head.weight, ref.head.weight)
    assert not torch.equal(ours.embed.weight, _Bag(sparse=True).embed.weight)  # it trained


def test_sparse_grads_are_unscaled_in_place():
    net = _Bag(sparse=True)
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.5), torch.nn.MSELoss(), mode="apex",
        opt_level="O1", verbosity=0)
    dense = _Bag(sparse=False)
    idx, y = _bag_data(0)
    opt.backward(crit(model(idx), y))
    opt.unscale_()
    model_fp32 = torch.nn.functional.mse_loss(dense(idx), y)
    model_fp32.backward()
    torch.testing.assert_close(net.embed.weight.grad.to_dense(), dense.embed.weight.grad,
                               rtol=2e-2, atol=1e-5)


def test_complex_params_are_unscaled_and_checked_in_both_parts():
    class Complex(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.z = torch.nn.Parameter(torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64))

        def forward(self, x):
            return (self.z * x).abs().sum()

    net = Complex()
    model, opt, _ = mpfunc_torch.convert_to_amp(
        net, torch.optim.Adam(net.parameters(), lr=0.1), mode="torch", init_scale=2.0**10)
    x = torch.tensor([1.0, 3.0])
    opt.backward(model(x))
    opt.unscale_()
    ref = Complex()
    ref(x).backward()
    assert torch.equal(net.z.grad, ref.z.grad)  # power-of-two scale: exact
    assert bool(opt.step())
    before = net.z.detach().clone()
    opt.zero_grad()
    opt.backward(model(x))
    net.z.grad[1] = complex(0.0, float("inf"))  # only the imaginary part overflows
    assert not bool(opt.step())
    assert torch.equal(net.z, before)


def test_sparse_grads_with_per_loss_scales():
    net = _Bag(sparse=True)
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.5), torch.nn.MSELoss(), mode="apex",
        opt_level="O1", num_losses=2, max_loss_scale=2.0**8, verbosity=0)
    dense = _Bag(sparse=False)
    idx, y = _bag_data(0)
    out = model(idx)
    opt.backward(crit(out, y), loss_id=0, retain_graph=True)
    opt.backward(crit(out, y) * 2, loss_id=1)
    opt.unscale_()
    assert net.embed.weight.grad.is_coalesced()
    (3 * torch.nn.functional.mse_loss(dense(idx), y)).backward()
    torch.testing.assert_close(net.embed.weight.grad.to_dense(), dense.embed.weight.grad,
                               rtol=2e-2, atol=1e-5)
    assert bool(opt.step())


@pytest.mark.parametrize("mode, cfg", [("naive", {"initial_scale": 2.0**8}),
                                       ("naive", {"initial_scale": 2.0**8, "step_chunks": 2}),
                                       ("apex", {"opt_level": "O2", "verbosity": 0})])
def test_unfreezing_later_trains_with_masters_and_add_param_group_says_how(mode, cfg):
    # Progressive unfreezing with master weights: the frozen head is in the optimizer
    # from the start; add_param_group after conversion is refused, naming that way.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    net[1].requires_grad_(False)
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.AdamW(net.parameters(), lr=1e-2), torch.nn.MSELoss(), mode=mode, **cfg)
    g = torch.Generator().manual_seed(0)

    def steps(n):
        for _ in range(n):
            opt.zero_grad()
            opt.backward(crit(model(torch.randn(4, 4, generator=g)), torch.randn(4, 2, generator=g)))
            assert bool(opt.step())

    head = net[1].weight.detach().clone()
    steps(2)
    assert torch.equal(net[1].weight, head)
    with pytest.raises(RuntimeError, match="every param before convert_to_amp.*unfrozen"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    net[1].requires_grad_(True)
    steps(2)
    assert not torch.equal(net[1].weight, head)
    master = {id(p): m for p, m in opt._pairs}[id(net[1].weight)]
    assert torch.equal(master.half(), net[1].weight)  # the master trained, the param follows
