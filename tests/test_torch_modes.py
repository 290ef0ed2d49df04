"""Tests for mpfunc_torch._src.modes: convert_to_amp's modes, their config and errors."""

import sys

import numpy as np
import pytest
import torch
from torch_task import ALL_MODES, batches, fp32_losses, ids, is_o3, make_model, train

import mpfunc_torch
from mpfunc_torch._src import fused_sgd


@pytest.mark.parametrize("mode, cfg", ALL_MODES, ids=ids)
def test_every_mode_trains_close_to_fp32(mode, cfg):
    _, opt, losses = train(mode, cfg)
    fp32 = fp32_losses("sgd" if is_o3(cfg) else "adam")
    # Tolerance: the mean of the last 10 losses within 5% of float32's. Half-precision
    # rounding moves individual losses by ~1%, and early skipped steps (scale backoff)
    # delay training by a few steps out of 60; 5% catches a mode that fails to train
    # (the loss then stays near log(128) = 4.85, 70% above where float32 ends).
    ours, ref = np.mean(losses[-10:]), np.mean(fp32[-10:])
    assert abs(ours - ref) / ref < 0.05, (ours, ref)
    assert losses[-1] < 0.8 * losses[0]

def test_apex_overrides_and_loss_scale_kinds():
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    _, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="apex", opt_level="O2",
                                            loss_scale=64.0, master_weights=False, verbosity=0)
    assert opt.plan.scale_kind == "static" and opt.loss_scale.item() == 64.0
    assert not opt._pairs
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    _, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="apex", opt_level="O1",
                                            min_loss_scale=2.0**10, max_loss_scale=2.0**12,
                                            verbosity=0)
    assert opt.loss_scale.item() == 2.0**12  # init clamps to max, as apex does
    assert opt.plan.scale_config.min_scale == 2.0**10


def test_apex_verbosity_logs_the_plan_and_prints_nothing(capsys, caplog):
    net = make_model()
    with caplog.at_level("INFO", logger="mpfunc_torch"):
        mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                    mode="apex", opt_level="O2")
    (record,) = caplog.records
    assert record.name.startswith("mpfunc_torch.") and record.levelname == "INFO"
    assert "mode=apex O2" in record.getMessage() and "master_weights=True" in record.getMessage()
    assert capsys.readouterr().out == ""
    caplog.clear()
    with caplog.at_level("INFO", logger="mpfunc_torch"):
        net = make_model()
        mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                    mode="apex", opt_level="O2", verbosity=0)
    assert caplog.records == []

def _fused_sgd_moves_half_params(dtype):
    p = torch.nn.Parameter(torch.ones(1000, dtype=dtype))
    opt = torch.optim.SGD([p], lr=0.5, fused=True)
    p.grad = torch.full_like(p, 0.1)
    opt.step()
    return bool(torch.all(p.detach() < 1))


def _torch_version():
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="about the CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o3_refuses_cpu_fused_sgd_exactly_where_torch_does_not_update_half_params(dtype):
    # The world, on the installed torch: 2.11-2.13's fused CPU SGD moves only the last
    # elements of a half param; 2.14 fixed it.
    fixed = _torch_version() >= (2, 14)
    assert _fused_sgd_moves_half_params(dtype) == fixed
    assert fused_sgd.fused_cpu_sgd_updates_half(dtype) == fixed
    kwargs = {"mode": "apex", "opt_level": "O3", "cast_model_type": dtype, "verbosity": 0}
    net = make_model()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, fused=True)
    if not fixed:
        with pytest.raises(ValueError, match=f"SGD\\(fused=True\\) stepping {dtype} params "
                                             "on CPU.*fixed in torch 2.14"):
            mpfunc_torch.convert_to_amp(net, sgd, **kwargs)
        assert all(p.dtype == torch.float32 for p in net.parameters())  # refused before the cast
    else:  # a working setup is not refused, and it steps as the for-loop SGD does
        stepped = []
        for opt_kw in ({"fused": True}, {"foreach": False}):
            net = make_model()
            model, opt, _ = mpfunc_torch.convert_to_amp(
                net, torch.optim.SGD(net.parameters(), lr=0.1, **opt_kw), **kwargs)
            # every element's gradient is 1: each param moves by lr, rounded
            opt.backward(sum(p.float().sum() for p in model.parameters()))
            assert bool(opt.step())
            stepped.append([p.detach().clone() for p in net.parameters()])
        start = [p.detach().to(dtype) for p in make_model().parameters()]
        for fused_p, loop_p, p0 in zip(*stepped, start):
            assert fused_p.dtype == dtype and bool((fused_p != p0).all())
            # within the roundings of p - 0.1 * 1 (the fused kernel computes in float32)
            diff = (fused_p.float() - loop_p.float()).abs()
            assert bool((diff <= torch.finfo(dtype).eps * (p0.float().abs() + 0.1)).all())
    net = make_model()  # with master weights the fused SGD steps float32 masters: fine
    mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1, fused=True),
                                mode="naive")


def _bag():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(),
                               torch.nn.Linear(8, 2))


def test_o3_refuses_an_eps_that_is_zero_in_float16():
    # O3 steps float16 params in float16: AdamW's eps=1e-8 is 0 there, and an embedding
    # row not in the batch became 0/0 = NaN in the first step, reported as taken.
    ids, y = torch.tensor([[1, 2], [3, 1]]), torch.tensor([0, 1])
    for opt_cls, kw in ((torch.optim.AdamW, {}), (torch.optim.Adagrad, {}),
                        (torch.optim.RMSprop, {"eps": 1e-9})):
        net = _bag()
        with pytest.raises(ValueError, match=f"`optimizer` {opt_cls.__name__} \\(param group 0\\) "
                                             "has eps=.*which is 0 in float16"):
            mpfunc_torch.convert_to_amp(net, opt_cls(net.parameters(), lr=1e-3, **kw),
                                        torch.nn.CrossEntropyLoss(), mode="apex",
                                        opt_level="O3", verbosity=0)
        assert all(p.dtype == torch.float32 for p in net.parameters())  # nothing cast
    net = _bag()  # float16's usual eps: the rows not in the batch stay as they were
    rows = net[0].weight.detach().half().clone()
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.AdamW(net.parameters(), lr=1e-3, eps=1e-4),
        torch.nn.CrossEntropyLoss(), mode="apex", opt_level="O3", verbosity=0)
    opt.backward(crit(model(ids), y))
    assert bool(opt.step())
    assert all(torch.isfinite(p).all() for p in net.parameters())
    untouched = [0, 4, 5, 6, 7, 8, 9]
    assert torch.equal(net[0].weight[untouched], rows[untouched] * (1 - 1e-3 * 0.01))  # decay only
    for mode, cfg in (("naive", {}), ("apex", {"opt_level": "O2", "verbosity": 0})):
        net = _bag()  # float32 masters: AdamW's own eps is fine
        mpfunc_torch.convert_to_amp(net, torch.optim.AdamW(net.parameters(), lr=1e-3),
                                    mode=mode, **cfg)


def test_enabled_false_is_plain_training():
    data = batches(3)
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode="torch", enabled=False)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        opt.backward(crit(model(x), y))
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


class TestErrors:
    def convert(self, mode="torch", model=None, **cfg):
        net = model if model is not None else make_model()
        return mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                           torch.nn.CrossEntropyLoss(), mode=mode, **cfg)

    def test_step_before_backward(self):
        _, opt, _ = self.convert()
        with pytest.raises(RuntimeError, match="step\\(\\) called before backward\\(\\)"):
            opt.step()

    def test_unscale_twice(self):
        model, opt, crit = self.convert()
        x, y = batches(1)[0]
        opt.backward(crit(model(x), y))
        opt.unscale_()
        with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
            opt.unscale_()
        with pytest.raises(RuntimeError, match="after unscale_\\(\\)"):
            opt.backward(crit(model(x), y))

    def test_unscale_before_backward(self):
        _, opt, _ = self.convert()
        with pytest.raises(RuntimeError, match="unscale_\\(\\) called before backward"):
            opt.unscale_()

    @pytest.mark.parametrize("mode, cfg", [("torch", {}), ("bf16", {}),
                                           ("apex", {"opt_level": "O1"})])
    def test_half_model_in_a_float32_mode(self, mode, cfg):
        with pytest.raises(ValueError, match="needs float32 params.*use mode='naive'"):
            self.convert(mode, model=make_model().half(), **cfg)

    def test_half_model_in_naive_mode(self):
        with pytest.raises(ValueError, match="already half precision"):
            self.convert("naive", model=make_model().half())

    @pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
    def test_cuda_request_on_cpu(self):
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            self.convert(device="cuda")

    def test_device_mismatch_and_bad_device(self):
        with pytest.raises(ValueError, match="`device` must be 'cpu', 'cuda'"):
            self.convert(device="tpu")

    @pytest.mark.parametrize("mode", ["Torch2", "", 3])  # None means the default, "torch"
    def test_unknown_mode(self, mode):
        with pytest.raises(ValueError, match="`mode` must be one of \\['torch', 'apex', 'naive', 'bf16', 'fp8'\\]"):
            self.convert(mode)

    def test_unknown_opt_level(self):
        with pytest.raises(ValueError, match="`opt_level` must be one of \\['O0', 'O1', 'O2', 'O3'\\]"):
            self.convert("apex", opt_level="O4")

    def test_typo_lists_valid_keys(self):
        with pytest.raises(ValueError, match="unknown config key\\(s\\) \\['growth_intervall'\\] for mode 'torch' \\(did you mean `growth_interval`\\?\\); valid keys for this mode: \\['backoff_factor'"):
            self.convert("torch", growth_intervall=10)

    def test_key_of_another_mode_is_an_error(self):
        with pytest.raises(ValueError, match="\\['hysteresis'\\] for mode 'torch'"):
            self.convert("torch", hysteresis=2)
        with pytest.raises(ValueError, match="for mode 'bf16'; valid keys for this mode: "
                                             "\\['master_weights', 'seed', 'state_dtype'"):
            self.convert("bf16", init_scale=2.0)

    def test_bf16_storage_keys_are_validated(self):
        # Validated in the shared table, every key as JAX takes it (8-bit state rounded
        # stochastically included).
        model, _, _ = self.convert("bf16", master_weights="remainder")
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        _, opt, _ = self.convert("bf16", state_dtype="float8_e5m2")
        assert opt._lowp.state.rounding == "stochastic"
        with pytest.raises(ValueError, match="did you mean `kahan`"):
            self.convert("bf16", master_weights="kahn")

    def test_inconsistent_scale_config(self):
        with pytest.raises(ValueError, match="`min_scale` \\(8.0\\) must be <= `max_scale` \\(4.0\\)"):
            self.convert("naive", min_scale=8.0, max_scale=4.0, initial_scale=4.0)
        with pytest.raises(ValueError, match="`backoff_factor` must be in \\(0, 1\\)"):
            self.convert("torch", backoff_factor=2.0)

    def test_inconsistent_apex_properties(self):
        with pytest.raises(ValueError, match="`master_weights=True` needs a half-precision model"):
            self.convert("apex", opt_level="O1", master_weights=True)
        with pytest.raises(ValueError, match="`loss_scale` must be 'dynamic' or a"):
            self.convert("apex", opt_level="O1", loss_scale="static")

    def test_closure_rejected(self):
        model, opt, crit = self.convert()
        x, y = batches(1)[0]
        opt.backward(crit(model(x), y))
        with pytest.raises(ValueError, match="`closure` is not supported"):
            opt.step(lambda: 0.0)

    @pytest.mark.parametrize("mode", ["torch", "bf16"])
    def test_an_optimizer_that_needs_a_closure_is_refused(self, mode):
        net = make_model()
        with pytest.raises(ValueError, match="`optimizer` LBFGS needs a closure on every"):
            mpfunc_torch.convert_to_amp(net, torch.optim.LBFGS(net.parameters()), mode=mode)

    def test_optimizer_with_state_in_master_mode(self):
        net = make_model()
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        torch.nn.functional.cross_entropy(net(batches(1)[0][0]), batches(1)[0][1]).backward()
        sgd.step()
        with pytest.raises(ValueError, match="already has state"):
            mpfunc_torch.convert_to_amp(net, sgd, mode="naive")

    def test_wrong_types(self):
        with pytest.raises(TypeError, match="`model` must be a torch.nn.Module"):
            mpfunc_torch.convert_to_amp(lambda x: x, None)
        net = make_model()
        with pytest.raises(TypeError, match="`optimizer` must be a torch.optim.Optimizer"):
            mpfunc_torch.convert_to_amp(net, object())

    @pytest.mark.parametrize("mode, cfg, exc, match", [
        ("apex", {"min_loss_scale": -1}, ValueError, "`min_loss_scale` must be"),
        ("apex", {"max_loss_scale": 0.0}, ValueError, "`max_loss_scale` must be"),
        ("naive", {"initial_scale": 0}, ValueError, "`initial_scale` must be"),
        ("torch", {"init_scale": 1e39}, ValueError, "`init_scale` must be .* got 1e\\+39"),
        ("torch", {"init_scale": 1e-50}, ValueError, "`init_scale` must be"),
        ("torch", {"growth_factor": 1 + 1e-9}, ValueError, "`growth_factor` must be > 1"),
        ("torch", {"init_scale": "2"}, TypeError, "`init_scale` must be a real number"),
        ("apex", {"opt_level": "O0", "loss_scale": 1e39}, ValueError, "`loss_scale` must be"),
        ("apex", {"opt_level": "O3", "loss_scale": 1e-45}, ValueError, "`loss_scale` must be"),
        ("torch", {"dtype": None}, ValueError, "`dtype` must be 'float16' or 'bfloat16'"),
        ("torch", {"process_group": "foo"}, TypeError, "`process_group` must be a torch"),
        ("torch", {"device": torch.device("meta")}, ValueError, "`device` must be 'cpu'"),
        ("torch", {"device": "gpu"}, ValueError, "`device` must be 'cpu'"),
    ])
    def test_bad_values_name_the_key_the_user_passed(self, mode, cfg, exc, match):
        cfg = dict(cfg)
        if mode == "apex":
            cfg.setdefault("verbosity", 0)
        with pytest.raises(exc, match=match):
            self.convert(mode, **cfg)

    def test_device_may_be_a_torch_device(self):
        _, opt, _ = self.convert(device=torch.device("cpu"))
        assert opt._device == torch.device("cpu")
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="CUDA is not available"):
                self.convert(device="cuda:0")

    def test_optimizer_over_another_models_params(self):
        net, other = make_model(), make_model(1)
        for mode in ("naive", "torch"):
            with pytest.raises(ValueError, match="`optimizer` holds none of `model`'s"):
                mpfunc_torch.convert_to_amp(net, torch.optim.SGD(other.parameters(), lr=0.1),
                                            mode=mode)
        # Extra params beside the model's (e.g. a learnable loss weight) are fine.
        extra = torch.nn.Parameter(torch.ones(()))
        _, opt, _ = mpfunc_torch.convert_to_amp(
            net, torch.optim.SGD([*net.parameters(), extra], lr=0.1), mode="naive")
        assert extra.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# torch >= 2.11 warns that the sync debug mode is a prototype; that warning, and only it, is
# not an error here.
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
@pytest.mark.parametrize("mode, cfg", ALL_MODES, ids=ids)
def test_every_mode_on_cuda(mode, cfg):
    net = make_model().cuda()
    # O3 steps float16 params with Adam itself: an eps that is not 0 in float16, as
    # torch_task.train uses (convert_to_amp refuses the default 1e-8 there).
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, fused=True,
                           eps=1e-4 if is_o3(cfg) else 1e-8)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=mode, device="cuda", **cfg)
    losses = []
    ctx = (torch.cuda.set_sync_debug_mode if hasattr(torch.cuda, "set_sync_debug_mode")
           else None)
    for i, (x, y) in enumerate(batches(40)):
        x, y = x.cuda(), y.cuda()
        # The whole step, forward and backward too (fp8 computes its scales there).
        if ctx is not None and i > 2:
            ctx("error")
        try:
            opt.zero_grad()
            loss = crit(model(x), y)
            opt.backward(loss)
            opt.step()
        finally:
            if ctx is not None:
                ctx("default")
        losses.append(loss.detach())
    assert float(torch.stack(losses[-5:]).mean()) < float(torch.stack(losses[:5]).mean())


STEP_VARIANTS = [*ALL_MODES, ("fp8", {"recipe": "delayed"}), ("fp8", {"recipe": "rowwise"}),
                 ("fp8", {"recipe": "blockwise"})]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode, cfg", STEP_VARIANTS,
                         ids=[f"{m}-{'-'.join(map(str, c.values()))}" for m, c in STEP_VARIANTS])
def test_a_step_builds_no_tensor_from_host_data_but_through_host_values(mode, cfg, fused):
    # On CUDA, torch.tensor(values, device=...) copies from pageable memory and syncs
    # the stream (the CUDA test above catches it; this CPU one finds the call): every
    # tensor built from Python data in a step, with the precision report, the forward
    # watch and the fused skip record on, must come from `host_values`. With a fused
    # optimizer nothing in the step reads a value from the device either.
    from own_code import is_library_module
    from torch.utils._python_dispatch import TorchDispatchMode

    def wrapper(module):  # torch's compile wrappers around its own optimizer code
        return module in ("torch._compile", "torch._dynamo") or module.startswith("torch._dynamo.")

    class FromHost(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.found, self.reads = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default,
                        torch.ops.aten.nonzero.default):
                self.reads += 1  # .item(), bool(), a boolean mask: a host read
            if func is torch.ops.aten.lift_fresh.default:
                # Where the tensor was built: the innermost frame outside torch's
                # wrappers (torch's own Adam builds its CPU step count this way). Ours
                # by its module's name, not its path: a clone named `mpfunc` holds
                # torch itself in `mpfunc/.venv/...`.
                caller = sys._getframe(1)
                while wrapper(caller.f_globals.get("__name__", "")):
                    caller = caller.f_back
                code = caller.f_code
                if (is_library_module(caller.f_globals.get("__name__", ""))
                        and code.co_name != "host_values"):
                    self.found.append(f"{code.co_filename}:{caller.f_lineno}")
            return func(*args, **(kwargs or {}))

    net = make_model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=fused,
                           eps=1e-4 if is_o3(cfg) else 1e-8)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=mode, **cfg)
    mpfunc_torch.watch_nonfinite(model)
    opt.record_skip_leaves()
    found, reads = [], 0
    for i, (x, y) in enumerate(batches(3)):
        with FromHost() as watch:
            opt.zero_grad()
            opt.backward(crit(model(x), y))
            if i == 2:
                next(iter(net.parameters())).grad = None  # a param without a gradient
            opt.precision_report()
            opt.step()
        found, reads = found + watch.found, reads + watch.reads
    assert found == []
    if fused:  # the skip is decided in the kernel: nothing in the step reads the device
        assert reads == 0


def test_host_values_gives_the_values_on_the_device():
    from mpfunc_torch._src.distributed import host_values

    t = host_values([3, 1, 2], torch.int64, torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [3, 1, 2]
    assert host_values([True, False], torch.bool, "cpu").tolist() == [True, False]
    assert host_values([], torch.int64, "cpu").shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
def test_host_values_on_cuda_does_not_sync():
    # Pinned memory and a non-blocking copy; torch.tensor(..., device="cuda") would raise.
    from mpfunc_torch._src.distributed import host_values

    torch.cuda.set_sync_debug_mode("error")
    try:
        t = host_values([5, 6], torch.int64, torch.device("cuda"))
        with pytest.raises(RuntimeError):
            torch.tensor([5, 6], device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert t.device.type == "cuda" and t.tolist() == [5, 6]
