"""Tests for mpfunc_torch._src.checkpoint.optimizer_state: AmpOptimizer state dicts, resume, and an
all-or-nothing load that rejects corrupt values."""


import copy
import math

import pytest
import torch
from torch_task import batches, make_model, tiny_batch, tiny_model

import mpfunc_torch


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


def _trained(mode="naive", seed=0, steps=3, inject=(), **cfg):
    net = tiny_model(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode=mode,
                                                   **cfg)
    for i in range(steps):
        opt.zero_grad()
        x, y = tiny_batch(seed * 100 + i)
        opt.backward(crit(model(x), y) * (float("inf") if i in inject else 1.0))
        opt.step()
    return net, opt


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _set(sd, path, value):
    d = sd
    for k in path[:-1]:
        d = d[k]
    if value is _DELETE:
        del d[path[-1]]
    else:
        d[path[-1]] = value(d[path[-1]]) if callable(value) else value


_DELETE = object()
_S = ("scalers", 0)
CORRUPTIONS = [
    (_S + ("loss_scale",), torch.tensor(float("nan")), "\\['scalers'\\]\\[0\\]\\['loss_scale'\\]"),
    (_S + ("loss_scale",), torch.tensor(0.0), "\\['loss_scale'\\]"),
    (_S + ("loss_scale",), torch.tensor(-8.0), "\\['loss_scale'\\]"),
    (_S + ("loss_scale",), torch.tensor(float("inf")), "\\['loss_scale'\\]"),
    (_S + ("loss_scale",), torch.tensor(1e-40), "\\['loss_scale'\\]"),  # subnormal
    (_S + ("growth_tracker",), torch.tensor(-5, dtype=torch.int32), "\\['growth_tracker'\\]"),
    (_S + ("hysteresis_left",), torch.tensor(99, dtype=torch.int32), "\\['hysteresis_left'\\]"),
    (_S + ("skipped_steps",), torch.tensor(-1, dtype=torch.int32), "\\['skipped_steps'\\]"),
    (_S + ("consecutive_skips",), torch.tensor(7, dtype=torch.int32), "\\['consecutive_skips'\\]"),
    (_S + ("last_finite",), torch.tensor(False), "\\['last_finite'\\]"),
    (_S + ("warm_phase",), torch.tensor(7, dtype=torch.int32), "\\['warm_phase'\\]"),
    (_S + ("config", "warm_start"), "yes", "\\['warm_start'\\]"),
    (_S + ("growth_tracker",), _DELETE, "missing keys \\['growth_tracker'\\]"),
    (_S + ("config",), {"init_scale": 1.0}, "\\['config'\\]"),
    (("scalers",), [], "\\['scalers'\\]"),
    (("master_weights", 0), lambda m: m.half(), "\\['master_weights'\\]\\[0\\]"),
    (("master_weights", 0), lambda m: m[:1], "\\['master_weights'\\]\\[0\\]"),
    (("master_weights", 0), lambda m: torch.full_like(m, float("nan")),
     "\\['master_weights'\\]\\[0\\]` holds inf/NaN"),
    (("master_weights",), None, "0 master weights"),
    (("optimizer", "state", 0, "exp_avg"), lambda t: t * float("inf"),
     "\\['optimizer'\\]\\['state'\\]\\[0\\]\\['exp_avg'\\]"),
    (("optimizer", "param_groups"), lambda g: g[:0], "param groups"),
    # torch's own load accepts these, and the step then fails (or, in a fused CPU
    # kernel, a wrong shape reads and writes out of bounds): refused at load instead
    (("optimizer", "state", 0, "exp_avg"), lambda t: t.reshape(-1),
     "\\['state'\\]\\[0\\]\\['exp_avg'\\]` must have shape \\(6, 6\\)"),
    (("optimizer", "state", 0, "exp_avg"), lambda t: t.tolist(), "must be a tensor"),
    (("optimizer", "state", 0, "step"), _DELETE, "does not load into AdamW \\(KeyError"),
    (("optimizer", "state", 0, "step"), torch.tensor(-1.0), "\\['step'\\]` must be a step"),
    (("optimizer", "state", 0, "step"), torch.tensor(2.5), "\\['step'\\]` must be a step"),
    (("optimizer", "state", 0, "step"), torch.tensor(3), "\\['step'\\]` must be a step"),
    (("optimizer", "param_groups", 0, "lr"), float("nan"), "\\[0\\]\\['lr'\\]` is nan"),
    (("optimizer", "param_groups", 0, "betas"), (0.9, float("inf")), "\\['betas'\\]` is"),
    (("optimizer", "param_groups", 0, "betas"), (0.9,), "\\['betas'\\]` must be a sequence"),
    (("optimizer", "param_groups", 0, "lr"), "1e-3", "\\['lr'\\]` must be a number"),
    (("optimizer", "param_groups", 0, "lr"), _DELETE, "has no 'lr'"),
    (("optimizer", "param_groups", 0, "params"), lambda ps: ps[:1], "must hold 4 params"),
    (("mode",), "torch", "from mode 'torch'"),
    (("format",), 2, "\\['format'\\]"),
]


@pytest.mark.parametrize("path, value, match", CORRUPTIONS,
                         ids=[f"{'.'.join(map(str, c[0]))}-{i}" for i, c in enumerate(CORRUPTIONS)])
def test_a_failed_load_rejects_the_value_and_changes_nothing(path, value, match):
    net, opt = _trained("naive", seed=0, initial_scale=2.0**10)
    _, other = _trained("naive", seed=1, steps=5, inject=(1,), initial_scale=2.0**10)
    ck = copy.deepcopy(other.state_dict())
    _set(ck, path, value)
    before = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(ck)
    assert _same(before, opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(params, net.parameters()))


def test_the_uncorrupted_checkpoint_loads():  # the control of the test above
    # The models stay referenced: a state_dict names the masters through a weak
    # reference to its model, so a collected model (the garbage collector's timing
    # depends on the tests before) would leave `master_names` None on one side.
    net, opt = _trained("naive", seed=0, initial_scale=2.0**10)
    other_net, other = _trained("naive", seed=1, steps=5, inject=(1,), initial_scale=2.0**10)
    opt.load_state_dict(copy.deepcopy(other.state_dict()))
    assert _same(opt.state_dict(), other.state_dict())


def test_loading_with_other_scale_hyperparameters_keeps_them_and_loads_the_state():
    # A resumed run may change init_scale or growth_interval, as GradScaler allows.
    _, old = _trained("torch", steps=5, inject=(0,), init_scale=2.0**10, growth_interval=3)
    saved = old.state_dict()
    assert saved["scalers"][0]["growth_tracker"].item() == 1  # 4 clean steps, grew once
    _, new = _trained("torch", steps=0, init_scale=2.0**16, growth_interval=5)
    new.load_state_dict(saved)
    m = new.scale_metrics(as_python=True)
    assert m["loss_scale"] == 2.0**10 and m["skipped_steps"] == 1  # 2**10 / 2 * 2
    assert new._scalers[0].config.growth_interval == 5
    assert new.state_dict()["scalers"][0]["config"]["growth_interval"] == 5
    x, y = tiny_batch()
    scales = []
    for _ in range(5):  # the tracker goes on from 1 with the new interval: grows at 5
        new.zero_grad()
        new.backward(torch.nn.functional.mse_loss(new.param_groups[0]["params"][0].sum()
                                                  * x[:, :1], y))
        new.step()
        scales.append(new.loss_scale.item())
    assert scales == [2.0**10] * 3 + [2.0**11] * 2


def test_saved_state_outside_the_new_config_is_brought_inside():
    _, old = _trained("naive", steps=5, initial_scale=2.0**10, growth_interval=6)
    saved = old.state_dict()["scalers"][0]
    assert saved["growth_tracker"].item() == 5 and saved["loss_scale"].item() == 2.0**10
    assert saved["hysteresis_left"].item() == 2
    s = mpfunc_torch.LossScaler("dynamic", _naive(growth_interval=3, max_scale=2.0**8,
                                                  hysteresis=1))
    s.load_state_dict(saved)
    st = s.state_dict()
    assert st["loss_scale"].item() == 2.0**8  # clamped to the new ceiling
    assert st["growth_tracker"].item() == 2  # the next clean step reaches the interval
    assert st["hysteresis_left"].item() == 1


def _naive(**kw):
    from _mpfunc_common.scale_config import resolve_scale_config

    return resolve_scale_config("naive", init_scale=1.0, **kw)


def test_state_dict_and_load_state_dict_hooks_fire():
    _, opt = _trained("torch")
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd-pre"))

    def post(o, sd):
        calls.append("sd-post")
        sd["extra"] = 1
        return sd

    opt.register_state_dict_post_hook(post)

    def load_pre(o, sd):
        calls.append("load-pre")
        sd = dict(sd)
        sd.pop("extra")
        return sd

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert calls == ["sd-pre", "sd-post", "load-pre", "load-post"]


@pytest.mark.parametrize("mode, cfg", [("torch", {}), ("naive", {"initial_scale": 2.0**8})])
def test_sparse_optimizer_state_loads_and_resumes_exactly(mode, cfg):
    # SGD's momentum for nn.Embedding(sparse=True) is a sparse tensor. The finite check
    # of load_state_dict once called isfinite on it (not implemented for sparse
    # tensors): such a checkpoint could be saved but not loaded.
    def build():
        torch.manual_seed(0)
        net = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4, sparse=True),
                                   "head": torch.nn.Linear(4, 2)})
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        _, opt, _ = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode=mode,
                                                **cfg)
        return net, opt

    def train(net, opt, steps):
        for step in steps:
            idx = torch.tensor([step % 10, (3 * step) % 10, 7])
            out = net["head"](net["emb"](idx))
            opt.zero_grad()
            opt.backward(out.float().square().mean())
            opt.step()
        return [p.detach().clone() for p in net.parameters()]

    net, opt = build()
    train(net, opt, range(3))
    assert any(v.is_sparse for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
    ckpt = copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict()})
    expected = train(net, opt, range(3, 6))
    net2, opt2 = build()
    net2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    got = train(net2, opt2, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # and a non-finite value in a sparse state is still refused, changing nothing
    bad = copy.deepcopy(ckpt["opt"])
    for st in bad["optimizer"]["state"].values():
        buf = st.get("momentum_buffer")
        if buf is not None and buf.is_sparse:
            buf._values()[0, 0] = float("nan")
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(ValueError, match="momentum_buffer.*holds inf/NaN"):
        opt2.load_state_dict(bad)
    after = opt2.state_dict()["optimizer"]["state"]
    for pid, st in before["optimizer"]["state"].items():
        for k, v in st.items():
            w = after[pid][k]
            assert torch.equal(v.to_dense() if v.is_sparse else v,
                               w.to_dense() if w.is_sparse else w)


def _fresh(optimizer, mode="torch", seed=0, **cfg):
    net = tiny_model(seed)
    _, opt, _ = mpfunc_torch.convert_to_amp(net, optimizer(net.parameters()), torch.nn.MSELoss(),
                                            mode=mode, **cfg)
    return net, opt


def _train(net, opt, steps, seed=0):
    for i in range(steps):
        x, y = tiny_batch(seed * 100 + i)
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(net(x.to(next(net.parameters()).dtype)
                                                      ).float(), y))
        opt.step()


@pytest.mark.parametrize("fused", [False, True])
def test_a_state_of_the_wrong_shape_is_refused_by_a_fresh_optimizer(fused):
    # A fresh optimizer has no state to compare with: torch's optimizers keep each
    # param's state in the param's shape. Before, fused AdamW stepped a (3, 3) exp_avg
    # for a (6, 6) param on CPU, reading and writing past its end.
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=fused)  # noqa: E731
    net, opt = _fresh(adamw)
    _train(net, opt, 2)
    ck = copy.deepcopy(opt.state_dict())
    ck["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3, 3)
    net2, opt2 = _fresh(adamw, seed=1)
    params = [p.detach().clone() for p in net2.parameters()]
    with pytest.raises(ValueError, match="\\['exp_avg'\\]` must have shape \\(6, 6\\) \\(AdamW's\\), "
                                         "got \\(3, 3\\)"):
        opt2.load_state_dict(ck)
    assert not opt2.optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(params, net2.parameters()))


def test_another_optimizers_checkpoint_is_refused_naming_what_it_lacks():
    net, sgd = _fresh(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    _train(net, sgd, 2)
    _, adam = _fresh(lambda ps: torch.optim.Adam(ps, lr=1e-3), seed=1)
    _train(*_fresh(lambda ps: torch.optim.Adam(ps, lr=1e-3), seed=1), 0)
    ck = adam.state_dict()
    ck["optimizer"] = sgd.state_dict()["optimizer"]
    before = copy.deepcopy(adam.state_dict())
    with pytest.raises(ValueError, match="does not load into Adam .*lack \\['amsgrad', 'betas'"):
        adam.load_state_dict(ck)
    assert _same(before, adam.state_dict())


def test_a_schedulers_group_key_may_be_missing_from_the_checkpoint():
    # Only the optimizer's own hyperparameters (its defaults) must be in each group: a
    # scheduler made before the load adds initial_lr, which a run without one never saved.
    net, src = _fresh(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    _train(net, src, 2)
    net2, opt = _fresh(lambda ps: torch.optim.AdamW(ps, lr=1e-2), seed=1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    assert "initial_lr" not in src.state_dict()["optimizer"]["param_groups"][0]
    opt.load_state_dict(src.state_dict())
    _train(net2, opt, 1)
    sched.step()
    assert opt.param_groups[0]["lr"] == 5e-3


def test_factored_state_loads_and_a_wrong_factor_is_refused():
    # Adafactor's state is not param-shaped (rows and columns): a fresh optimizer takes
    # it as torch does; one with state compares each tensor with its own.
    adafactor = lambda ps: torch.optim.Adafactor(ps, lr=1e-2)  # noqa: E731
    net, opt = _fresh(adafactor)
    _train(net, opt, 3)
    ck = copy.deepcopy(opt.state_dict())
    assert ck["optimizer"]["state"][0]["row_var"].shape == (6, 1)
    net2, opt2 = _fresh(adafactor, seed=1)
    opt2.load_state_dict(copy.deepcopy(ck))
    net2.load_state_dict(net.state_dict())
    _train(net, opt, 2, seed=5)
    _train(net2, opt2, 2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))
    ck["optimizer"]["state"][0]["row_var"] = torch.ones(1, 6)
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(ValueError, match="\\['row_var'\\]` must have shape \\(6, 1\\) \\(this "
                                         "optimizer's state\\)"):
        opt2.load_state_dict(ck)
    assert _same(before, opt2.state_dict())


def test_dcp_set_state_dict_refuses_a_bad_optimizer_part_changing_nothing():
    # torch.distributed.checkpoint's layout (param names), in one process: the optimizer
    # part is checked, torch's load on a scratch copy included, before the model is written.
    net, opt = _fresh(lambda ps: torch.optim.AdamW(ps, lr=1e-2), mode="naive",
                      initial_scale=2.0**8)
    _train(net, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    msd, osd = mpfunc_torch.get_state_dict(net, opt)
    # it once added "master_weight" to the optimizer's own per-param state
    assert _same(saved, opt.state_dict())
    net2, opt2 = _fresh(lambda ps: torch.optim.AdamW(ps, lr=1e-2), mode="naive", seed=1,
                        initial_scale=2.0**8)
    before = copy.deepcopy(opt2.state_dict())
    params = [p.detach().clone() for p in net2.parameters()]
    for corrupt, match in [(lambda o: o["state"]["2.weight"].pop("step"), "KeyError: 'step'"),
                           (lambda o: o["param_groups"][0].update(lr=float("nan")), "'lr'"),
                           (lambda o: o["state"]["0.bias"].update(step=torch.tensor(-2.0)),
                            "\\[1\\]\\['step'\\]` must be a step count")]:
        bad = copy.deepcopy(osd)
        corrupt(bad)
        with pytest.raises(ValueError, match="`optim_state_dict`, checked as .*" + match):
            mpfunc_torch.set_state_dict(net2, opt2, model_state_dict=copy.deepcopy(msd),
                                        optim_state_dict=bad)
        assert _same(before, opt2.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(params, net2.parameters()))
    mpfunc_torch.set_state_dict(net2, opt2, model_state_dict=msd, optim_state_dict=osd)
    assert _same(opt.state_dict(), opt2.state_dict())


@pytest.mark.parametrize("mode, cfg", [("torch", {}), ("naive", {"initial_scale": 2.0**8}),
                                       ("apex", {"opt_level": "O2", "verbosity": 0})])
def test_a_plain_torch_run_resumes_in_a_mode(mode, cfg):
    # A float32 run with a plain AdamW moves to mpfunc_torch: the model's checkpoint
    # sets the masters exactly, the optimizer's state_dict loads into the inner one.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6),
                              torch.nn.Linear(6, 1))
    plain = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for i in range(3):
        x, y = tiny_batch(i)
        plain.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        plain.step()
    ck = copy.deepcopy({"model": net.state_dict(), "optimizer": plain.state_dict()})
    net2 = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6),
                               torch.nn.Linear(6, 1))
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net2, torch.optim.AdamW(net2.parameters(), lr=1e-2), torch.nn.MSELoss(), mode=mode,
        **cfg)
    bad = copy.deepcopy(ck["optimizer"])
    bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"][:1]
    with pytest.raises(ValueError, match="\\['state'\\]\\[0\\]\\['exp_avg'\\]` must have shape"):
        opt.load_state_dict(bad)
    assert not opt.optimizer.state
    net2.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    inner = opt.optimizer.state_dict()["state"]
    for pid, st in ck["optimizer"]["state"].items():
        assert all(torch.equal(st[k], inner[pid][k]) for k in st)
    name_of = {id(p): n for n, p in net2.named_parameters()}
    for p, m in opt._pairs:  # the masters are the float32 weights exactly
        assert torch.equal(m, ck["model"][name_of[id(p)]])
    taken = 0
    for i in range(20):  # until the fresh scale (2**16 for torch and O2) fits
        x, y = tiny_batch(5 + i)
        opt.zero_grad()
        opt.backward(crit(model(x), y))
        taken += bool(opt.step())
    assert taken > 0 and int(opt.optimizer.state_dict()["state"][0]["step"]) == 3 + taken
    assert all(torch.isfinite(p).all() for p in net2.parameters())


def _gradscaler_steps(net, opt, scaler, steps, bad):
    scales = []
    for i in steps:
        x, y = tiny_batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
        loss = torch.nn.functional.mse_loss(out.float(), y) * (math.inf if i in bad else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_a_gradscaler_run_resumes_in_torch_mode_bit_for_bit():
    # A torch.amp run (autocast + GradScaler) moves to torch mode mid-run: the model,
    # the optimizer and the GradScaler state_dicts load, and the run continues as the
    # GradScaler run does, loss scale, growth tracker and skips included.
    bad = {1, 2, 9}
    net = tiny_model(0)
    plain = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    _gradscaler_steps(net, plain, scaler, range(5), bad)
    assert scaler.state_dict()["_growth_tracker"] == 2 and scaler.get_scale() == 2.0**14
    ck = copy.deepcopy({"model": net.state_dict(), "optimizer": plain.state_dict(),
                        "scaler": scaler.state_dict()})
    ref_scales = _gradscaler_steps(net, plain, scaler, range(5, 13), bad)

    net2 = tiny_model(1)
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net2, torch.optim.AdamW(net2.parameters(), lr=1e-2), torch.nn.MSELoss(), mode="torch",
        growth_interval=3)
    net2.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    opt.load_state_dict(ck["scaler"])
    assert opt.scale_metrics(as_python=True)["loss_scale"] == 2.0**14
    scales = []
    for i in range(5, 13):
        x, y = tiny_batch(i)
        opt.zero_grad()
        opt.backward(crit(model(x), y) * (math.inf if i in bad else 1.0))
        opt.step()
        scales.append(opt.scale_metrics(as_python=True)["loss_scale"])
    assert scales == ref_scales and 2.0**15 in scales  # it grew on schedule, and backed off
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))
    assert _same(plain.state_dict()["state"], opt.optimizer.state_dict()["state"])
    assert opt.scale_metrics(as_python=True)["skipped_steps"] == 1  # the one after the move


@pytest.mark.parametrize("corrupt, match", [
    (lambda s: s.update(scale=float("nan")), "\\['scale'\\]` must be a finite scale"),
    (lambda s: s.update(scale=0.0), "\\['scale'\\]` must be a finite scale"),
    (lambda s: s.update(_growth_tracker=7), "\\['_growth_tracker'\\]` must be an int in \\[0, 2\\]"),
    (lambda s: s.update(_growth_tracker=-1), "\\['_growth_tracker'\\]` must be an int"),
    (lambda s: s.update(growth_interval=0), "\\['growth_interval'\\]` must be an int >= 1"),
    (lambda s: s.update(backoff_factor="half"), "\\['backoff_factor'\\]` must be a real number"),
    (lambda s: s.pop("growth_factor"), "missing keys \\['growth_factor'\\]"),
])
def test_a_corrupt_gradscaler_state_changes_nothing(corrupt, match):
    net, opt = _fresh(lambda ps: torch.optim.SGD(ps, lr=0.1), mode="naive")
    _train(net, opt, 3)
    before = copy.deepcopy(opt.state_dict())
    sd = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3).state_dict()
    corrupt(sd)
    with pytest.raises(ValueError, match="`state_dict.*" + match):
        opt.load_state_dict(sd)
    assert _same(before, opt.state_dict())


def test_gradscaler_state_is_brought_into_this_config():
    # naive mode: floor 1, hysteresis 2, growth_interval 1000. GradScaler has no floor
    # and no hysteresis: its scale is clamped up to the floor, the hysteresis is full.
    net, opt = _fresh(lambda ps: torch.optim.SGD(ps, lr=0.1), mode="naive")
    sd = {"scale": 0.25, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5000,
          "_growth_tracker": 4321}
    opt.load_state_dict(sd)
    state = opt.state_dict()["scalers"][0]
    assert (state["loss_scale"].item(), state["growth_tracker"].item(),
            state["hysteresis_left"].item()) == (1.0, 999, 2)
    # A static scale has no GradScaler state to take.
    net, opt = _fresh(lambda ps: torch.optim.SGD(ps, lr=0.1), mode="apex", opt_level="O2",
                      loss_scale=128.0, verbosity=0)
    with pytest.raises(ValueError, match="loads into a dynamic loss scale.*static"):
        opt.load_state_dict(sd)
    assert opt.scale_metrics(as_python=True)["loss_scale"] == 128.0
