"""Tests for mpfunc_torch._src.precision_report and nonfinite_watch (and the JAX parity)."""

import contextlib
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch_scaleout_models import launch_results

import mpfunc_torch
from _mpfunc_common.precision_report import FORMATS
from mpfunc_torch._src import precision_report as report_module
from mpfunc_torch._src.master_weights import master_of

# The cross-checks with mpfunc (JAX) import it inside the test; a torch-only install
# skips them.
try:
    import mpfunc as _mpfunc
except ModuleNotFoundError:
    _mpfunc = None
needs_jax = pytest.mark.skipif(_mpfunc is None, reason="a cross-check with mpfunc (JAX), "
                               "which is not installed (the `jax` extra)")

MODES = {
    "torch": ("torch", {"init_scale": 1024.0}),
    "apex-O1": ("apex", {"opt_level": "O1", "max_loss_scale": 1024.0, "verbosity": 0}),
    "apex-O2": ("apex", {"opt_level": "O2", "max_loss_scale": 1024.0, "verbosity": 0}),
    "apex-O3": ("apex", {"opt_level": "O3", "verbosity": 0}),
    "naive": ("naive", {"initial_scale": 1024.0}),
    "bf16": ("bf16", {}),
    "fp8": ("fp8", {}),
}


def make_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def convert(mode, fused=False):
    name, cfg = MODES[mode]
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, eps=1e-4, fused=fused)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode=name,
                                                   **cfg)
    return net, model, opt, crit


def backward(model, opt, crit):
    g = torch.Generator().manual_seed(1)
    opt.zero_grad()
    opt.backward(crit(model(torch.randn(4, 8, generator=g)), torch.randn(4, 4, generator=g)))


def plant(t, value=float("inf")):
    with torch.no_grad():
        t.view(-1)[0] = value


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", ["0.weight", "2.bias"])
def test_a_planted_inf_is_named_exactly_in_every_mode(mode, fused, name):
    net, model, opt, crit = convert(mode, fused)
    if fused:  # a fused kernel decides on the device: the record is asked for
        opt.record_skip_leaves()
    param = dict(net.named_parameters())[name]
    backward(model, opt, crit)
    clean = opt.precision_report()
    assert clean.nonfinite_names() == [] and len(clean.rows()) == 6
    plant(param.grad)  # the model's gradient, before unscaling
    assert opt.precision_report().nonfinite_names() == [name]
    assert not opt.step()
    assert opt.scale_metrics(skip_leaves=True)["skip_leaves"] == [name]
    # A clean step keeps the record of the last skip.
    backward(model, opt, crit)
    assert opt.step()
    assert opt.scale_metrics(skip_leaves=True)["skip_leaves"] == [name]


@pytest.mark.parametrize("mode", ["naive", "apex-O2"])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_half_modes_are_read_through_their_float32_master_grads(mode, bad):
    net, model, opt, crit = convert(mode)
    backward(model, opt, crit)
    opt.unscale_()
    assert net[0].weight.grad is None  # the half grad is released once copied
    master = master_of(net[0].weight)
    assert master is not None and master.grad.dtype == torch.float32
    plant(master.grad, bad)
    report = opt.precision_report()
    assert report.nonfinite_names() == ["0.weight"]
    row = report.rows()[0]
    assert row["name"] == "0.weight" and row["nonfinite"]
    # (Planted after unscale_, whose check already ran, it does not skip this step:
    # as with GradScaler, a gradient changed after the check is not re-checked.)


def test_before_and_after_unscaling_give_the_same_rows():
    # The optimizer form reports unscaled gradients at the current scale either way
    # (the scale is a power of two, so unscaling is exact).
    net, model, opt, crit = convert("torch")
    backward(model, opt, crit)
    before = opt.precision_report().rows()
    opt.unscale_()
    assert opt.precision_report().rows() == before
    assert str(opt.precision_report()).startswith(
        "precision report: 6 leaves, dtype float16, loss scale 1024, non-finite: 0")


def test_the_model_form_reads_the_grads_as_they_are():
    net = make_net()
    for p in net.parameters():
        p.grad = torch.full_like(p, 2.0**-30)
    plant(net[1].bias.grad, float("nan"))
    report = mpfunc_torch.precision_report(net, loss_scale=16.0)
    assert report.nonfinite_names() == ["1.bias"]
    rows = {r["name"]: r for r in report.rows()}
    assert rows["0.weight"]["underflow_fraction"] == 1.0  # 2**-26 flushes in float16
    assert mpfunc_torch.precision_report(net, loss_scale=2.0**10).rows()[0][
        "underflow_fraction"] == 0.0
    assert rows["0.weight"]["headroom_bits"] == np.log2(65504.0 / 2.0**-26)
    assert str(report).splitlines()[2].startswith("1.bias ")  # worst first
    net[2].weight.grad = None
    assert [r["name"] for r in mpfunc_torch.precision_report(net).rows()] == [
        "0.weight", "0.bias", "1.weight", "1.bias", "2.bias"]


# --- parity with JAX -----------------------------------------------------------------

elements = st.one_of(
    st.floats(-1e6, 1e6, width=32, allow_subnormal=False),
    st.sampled_from([0.0, -0.0, 1e-30, 2.0**-25, 2.0**-24, 1e-12, 65504.0, 7e4,
                     np.inf, -np.inf, np.nan]),
)


@needs_jax
@given(values=st.lists(elements, min_size=0, max_size=40),
       scale=st.sampled_from([1.0, 3.0, 0.1, 1024.0, 2.0**16, 12345.0]),
       dtype=st.sampled_from(sorted(FORMATS)))
def test_both_frameworks_give_the_same_rows_bit_for_bit(values, scale, dtype):
    import jax.numpy as jnp

    import mpfunc

    g = np.asarray(values, np.float32)
    net = torch.nn.Linear(max(len(values), 1), 1, bias=False)
    grads = [torch.from_numpy(g.reshape(1, -1).copy()) if len(values) else None]
    rows_t = mpfunc_torch.precision_report(net, loss_scale=scale, dtype=dtype,
                                           grads=grads).rows()
    with one_at_a_time():  # the per-tensor path (a small gradient goes the flat one)
        rows_1 = mpfunc_torch.precision_report(net, loss_scale=scale, dtype=dtype,
                                               grads=grads).rows()
    rows_j = mpfunc.precision_report({"weight": jnp.asarray(g)}, loss_scale=scale,
                                     dtype=dtype).rows()
    if not len(values):
        rows_j = []  # torch leaves out a param without a gradient
    for r in rows_t + rows_1 + rows_j:
        r.pop("name")
    # repr: NaN-free, so == would do; bit for bit
    assert repr(rows_t) == repr(rows_1) == repr(rows_j)


@contextlib.contextmanager
def one_at_a_time(flat_max=-1, chunk=None):
    """Sends gradients over ``flat_max`` elements down the per-tensor path (all of them
    by default), and splits the flat passes at ``chunk`` elements."""
    saved = report_module._FLAT_MAX, report_module._FLAT_CHUNK
    report_module._FLAT_MAX = flat_max
    report_module._FLAT_CHUNK = chunk or saved[1]
    try:
        yield
    finally:
        report_module._FLAT_MAX, report_module._FLAT_CHUNK = saved


def many_grads(n, seed=0):
    """``n`` params' gradients of mixed sizes and dtypes, some with an inf, a NaN, a
    subnormal, zeros; one empty and one complex."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    params, grads = [], []
    for i in range(n):
        shape = [(3,), (4, 5), (0, 2), (7, 3), (2,)][i % 5]
        dtype = torch.complex64 if i == 3 else dtypes[i % 3]
        x = torch.randn(shape, generator=g) * 10.0 ** (i % 7 - 3)
        x = x.to(dtype)
        if x.numel() and i % 4 == 1:
            x.view(-1)[0] = [float("inf"), float("nan"), -float("inf")][i % 3]
        if x.numel() > 2 and not x.is_complex():
            x.view(-1)[1] = 0.0
            x.view(-1)[2] = 1e-30 if dtype == torch.float32 else x.view(-1)[2]
        params.append(torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))
        grads.append(x)
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(params)
    return model, grads


@pytest.mark.parametrize("flat_max, chunk", [(10**6, None), (12, None), (10**6, 20),
                                             (10**6, 1)])
def test_the_flat_path_gives_the_per_tensor_paths_rows_bit_for_bit(flat_max, chunk):
    model, grads = many_grads(23)
    with one_at_a_time():
        want = mpfunc_torch.precision_report(model, grads=grads, loss_scale=64.0).rows()
    with one_at_a_time(flat_max, chunk):
        got = mpfunc_torch.precision_report(model, grads=grads, loss_scale=64.0).rows()
    assert repr(got) == repr(want)
    assert [r["nonfinite"] for r in got].count(True) >= 4
    assert any(0 < r["underflow_fraction"] < 1 for r in got)


def test_small_gradients_cost_a_fixed_number_of_ops_whatever_their_number():
    # On a GPU each op that computes is a kernel launch: many small gradients (biases,
    # norm weights) must not cost about eight each. Views (detach, reshape) launch none.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += not func.is_view
            return func(*args, **(kwargs or {}))

    def ops(n, per_tensor):
        model = torch.nn.Module()
        model.params = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(5)) for _ in range(n)])
        grads = [torch.ones(5) for _ in range(n)]
        with contextlib.ExitStack() as stack:
            if per_tensor:
                stack.enter_context(one_at_a_time())
            counter = stack.enter_context(Count())
            counter.n = 0
            mpfunc_torch.precision_report(model, grads=grads)
        return counter.n

    assert ops(40, False) == ops(10, False)
    assert ops(40, True) - ops(10, True) >= 30 * 8


# --- no host sync --------------------------------------------------------------------

@contextlib.contextmanager
def no_device_reads():
    """Makes every way of reading a tensor's value on the host raise."""
    names = ("item", "__bool__", "tolist", "cpu", "numpy", "__float__", "__int__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")

    for n in names:
        setattr(torch.Tensor, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_building_a_report_reads_no_device_value():
    net, model, opt, crit = convert("naive")
    watch = mpfunc_torch.watch_nonfinite(model)
    with no_device_reads():
        backward(model, opt, crit)
        report = opt.precision_report()
        model_report = mpfunc_torch.precision_report(
            net, loss_scale=opt.loss_scale, dtype=torch.float16)
        repr(report)
        with pytest.raises(AssertionError, match="read on the host"):
            report.rows()  # reading is what transfers
    assert report.rows()[0]["name"] == "0.weight" and len(model_report.rows()) == 6
    assert report.first_nonfinite_module is None  # watched, and nothing overflowed
    watch.remove()


def test_a_fused_step_records_which_param_skipped_without_a_host_read():
    net, model, opt, crit = convert("torch", fused=True)
    opt.record_skip_leaves()
    backward(model, opt, crit)
    plant(net[2].weight.grad)
    with no_device_reads():
        stepped = opt.step()
        metrics = opt.scale_metrics()  # device tensors: no read
    assert not stepped and not metrics["last_finite"]
    assert opt.scale_metrics(skip_leaves=True)["skip_leaves"] == ["2.weight"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_report_and_watch_never_sync():
    torch.manual_seed(0)
    net = make_net().cuda()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(),
                                                   mode="torch", init_scale=1024.0)
    watch = mpfunc_torch.watch_nonfinite(model)
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(4, 4, device="cuda")
    backward_step = lambda: opt.backward(crit(model(x), y))  # noqa: E731
    backward_step()
    opt.step()  # warm up outside the guard
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.zero_grad()
            backward_step()
            report = opt.precision_report()
            model_report = mpfunc_torch.precision_report(net, loss_scale=opt.loss_scale)
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert report.nonfinite_names() == [] and len(model_report.rows()) == 6
    watch.remove()


# --- forward attribution -------------------------------------------------------------

def test_watch_names_the_layer_whose_output_overflowed_first():
    net, model, opt, crit = convert("naive")
    with torch.no_grad():
        net[0].weight.fill_(60000.0)  # float16: 60000 * sum(x) overflows
    assert mpfunc_torch.precision_report(net).first_nonfinite_module is None  # off
    watch = mpfunc_torch.watch_nonfinite(model)  # the AmpModel is looked through
    backward(model, opt, crit)
    assert watch.first_nonfinite_module() == "0"
    assert opt.precision_report().first_nonfinite_module == "0"
    assert "first non-finite module in the forward: 0" in str(opt.precision_report())
    watch.remove()
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert mpfunc_torch.precision_report(net).first_nonfinite_module is None


def test_watch_records_one_forward_and_skips_recomputation_in_backward():
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=False))

    net = Net()
    watch = mpfunc_torch.watch_nonfinite(net)
    net(torch.ones(3, 2)).sum().backward()  # the backward recomputes `a`
    names, flags = watch.snapshot(torch.device("cpu"))
    assert names == ["a", "b", "(root)"] and not flags.any()
    net(torch.ones(3, 2))
    assert watch.snapshot(torch.device("cpu"))[0] == ["a", "b", "(root)"]  # a new record


# --- bad input -----------------------------------------------------------------------

def test_bad_input_is_refused_with_the_argument_named():
    net = make_net()
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(TypeError, match="`model`"):
        mpfunc_torch.precision_report([net])
    for dtype, err in [(torch.int32, TypeError), (torch.bool, TypeError),
                       (torch.float64, ValueError), (3, TypeError)]:
        with pytest.raises(err, match="`dtype`"):
            mpfunc_torch.precision_report(net, dtype=dtype)
    for scale, err in [(0.0, ValueError), (-1, ValueError), (float("nan"), ValueError),
                       (float("inf"), ValueError), (True, TypeError), ("2", TypeError),
                       (torch.ones(2), TypeError)]:
        with pytest.raises(err, match="`loss_scale`"):
            mpfunc_torch.precision_report(net, loss_scale=scale)
    with pytest.raises(ValueError, match="`grads` has 2 entries, `model` has 6"):
        mpfunc_torch.precision_report(net, grads=[None, None])
    with pytest.raises(ValueError, match=r"`grads` for '0.weight' must be a tensor of the "
                                         r"param's shape \(16, 8\), got \(8, 16\)"):
        mpfunc_torch.precision_report(net, grads={"0.weight": torch.zeros(8, 16)})
    with pytest.raises(ValueError, match="not params of `model`"):
        mpfunc_torch.precision_report(net, grads={"3.weight": torch.zeros(1)})
    with pytest.raises(TypeError, match="`model`"):
        mpfunc_torch.watch_nonfinite(lambda x: x)


def test_the_optimizer_report_outside_a_step_is_a_clear_error():
    net, model, opt, crit = convert("naive")
    with pytest.raises(RuntimeError, match="after backward"):
        opt.precision_report()
    backward(model, opt, crit)
    opt.step()
    with pytest.raises(RuntimeError, match="after backward"):
        opt.precision_report()


# --- DDP and FSDP2 on gloo -------------------------------------------------------------

WORKER = "torch_report_worker.py"


def launch(scenario, world=2):
    return launch_results(WORKER, scenario, world)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["torch", "naive"])
def test_ddp_an_inf_on_one_rank_is_named_on_every_rank(mode):
    for r in launch(f"ddp-{mode}"):
        assert r["report"] == ["2.weight"], r  # reduced over process_group
        assert r["local"] == (["2.weight"] if r["rank"] == 1 else []), r
        assert r["stepped"] is False
        # The skip record is this rank's: plain process groups are not reduced.
        assert r["skip_leaves"] == r["local"], r
        assert r["sizes"]["2.weight"] == 2 * 4 * 16, r  # each rank's whole param, summed


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["torch", "naive"])
def test_fsdp2_an_inf_in_one_ranks_shard_is_named_on_every_rank(mode):
    for r in launch(f"fsdp-{mode}"):
        assert r["report"] == ["2.weight"], r  # the DTensor mesh reduction
        assert r["stepped"] is False
        assert r["skip_leaves"] == ["2.weight"], r
        assert r["sizes"]["2.weight"] == 4 * 16, r  # summed over the shards


# --- what the skip record costs --------------------------------------------------------

def test_per_gradient_flags_come_from_the_same_check_bit_for_bit():
    from mpfunc_torch._src import fused

    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(4).half(), torch.randn(2, 2)]
    grads[1][2] = float("nan")
    copies = [g.clone() for g in grads]
    found, flags = torch.zeros(()), torch.zeros(3)
    fused.unscale_and_check_(grads, found, torch.tensor(0.25), flags)
    plain_found = torch.zeros(())
    fused.unscale_and_check_(copies, plain_found, torch.tensor(0.25))
    assert flags.tolist() == [0.0, 1.0, 0.0] and found.item() == plain_found.item() == 1.0
    for a, b in zip(grads, copies):
        assert torch.equal(a.view(-1)[:2], b.view(-1)[:2]) and a.dtype == b.dtype


@pytest.mark.parametrize("mode", ["torch", "naive"])
@pytest.mark.parametrize("fused_opt", [False, True])
def test_a_clean_step_reads_each_gradient_once_for_the_check_and_the_record(mode, fused_opt,
                                                                              monkeypatch):
    # The record adds no pass over the gradients on a clean step: the fused path takes
    # its flags from the check itself, the host-decided path only reads them on a skip.
    net, model, opt, crit = convert(mode, fused=fused_opt)
    backward(model, opt, crit)
    backward(model, opt, crit)
    opt.step()  # warm
    elements = []
    kernel = torch._amp_foreach_non_finite_check_and_unscale_

    def counting(tensors, found, inv):
        elements.append(sum(t.numel() for t in tensors))
        return kernel(tensors, found, inv)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counting)
    backward(model, opt, crit)
    assert opt.step()
    assert sum(elements) == sum(p.numel() for p in net.parameters())



@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_watch_sees_every_kind_of_nonfinite_output(bad, dtype):
    class Plant(torch.nn.Module):
        def forward(self, x):
            return x.clone().index_fill_(1, torch.tensor([2]), bad)

    net = torch.nn.Sequential(torch.nn.Identity(), Plant(), torch.nn.Identity()).to(dtype)
    watch = mpfunc_torch.watch_nonfinite(net)
    net(torch.ones(3, 4, dtype=dtype))
    assert watch.first_nonfinite_module() == "1"
    net(torch.ones(3, 4, dtype=dtype) * 2)[0:0]  # a new forward, the same answer
    assert watch.snapshot(torch.device("cpu"))[1].tolist() == [False, True, True, True]


def test_a_fused_step_checks_in_one_launch_unless_the_record_is_asked_for(monkeypatch):
    # The fused path's check stays one multi-tensor launch per step by default; the
    # per-gradient record (one launch per gradient) is opt-in, and asking for its names
    # without it is an error that says how to turn it on.
    calls = []
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def counting(grads, found_inf, inv_scale):
        calls.append(len(grads))
        return real(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counting)
    net, model, opt, crit = convert("torch", fused=True)
    backward(model, opt, crit)
    assert opt.step()
    assert calls == [6]  # one launch over the 6 gradients
    with pytest.raises(ValueError, match="record_skip_leaves"):
        opt.scale_metrics(skip_leaves=True)
    opt.record_skip_leaves()
    calls.clear()
    backward(model, opt, crit)
    plant(net[0].bias.grad)
    assert not opt.step()
    assert calls == [1] * 6  # one launch per gradient while recording
    assert opt.scale_metrics(skip_leaves=True)["skip_leaves"] == ["0.bias"]
    opt.record_skip_leaves(False)
    calls.clear()
    backward(model, opt, crit)
    assert opt.step() and calls == [6]
    with pytest.raises(TypeError, match="`enabled` must be a bool"):
        opt.record_skip_leaves("yes")


def test_a_recorded_fused_skip_names_the_right_param_when_some_have_no_gradient():
    # The check's flags cover only params with a gradient; the record puts each back at
    # its param's place.
    net, model, opt, crit = convert("torch", fused=True)
    opt.record_skip_leaves()
    backward(model, opt, crit)
    net[0].bias.grad = None          # this param has no gradient this step
    plant(net[2].weight.grad)
    assert not opt.step()
    assert opt.scale_metrics(skip_leaves=True)["skip_leaves"] == ["2.weight"]


@needs_jax
@pytest.mark.parametrize("fused", [False, True])
def test_convert_to_amp_records_with_the_same_keyword_as_jax(fused):
    # record_skip_leaves=True in both frameworks' convert_to_amp: the two alike weights
    # both overflow and both are named (JAX's default check reduces them together).
    import jax
    import jax.numpy as jnp
    from lenient import adam

    import mpfunc

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=fused)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode="torch",
                                                   record_skip_leaves=True)
    opt.zero_grad()
    opt.backward(crit(model(torch.ones(2, 4)), torch.zeros(2, 4)))
    for name in ("0.weight", "1.weight"):
        plant(dict(net.named_parameters())[name].grad)
    opt.step()
    assert opt.scale_metrics(skip_leaves=True)["skip_leaves"] == ["0.weight", "1.weight"]

    params = {"0": {"weight": jnp.ones((4, 4)), "bias": jnp.ones(4)},
              "1": {"weight": jnp.ones((4, 4)), "bias": jnp.ones(4)}}
    amp = mpfunc.convert_to_amp(lambda p, x: x, adam(1e-3), mode="torch",
                                record_skip_leaves=True)
    state = amp.optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    for k in ("0", "1"):
        grads[k]["weight"] = grads[k]["weight"].at[0, 0].set(jnp.inf)
    _, state = jax.jit(amp.optimizer.update)(grads, state, params)
    assert mpfunc.scale_metrics(state, skip_leaves=params)["skip_leaves"] == [
        "['0']['weight']", "['1']['weight']"]
    with pytest.raises(TypeError, match="`record_skip_leaves` must be a bool"):
        mpfunc_torch.convert_to_amp(torch.nn.Linear(2, 2), torch.optim.SGD(
            torch.nn.Linear(2, 2).parameters(), lr=0.1), record_skip_leaves="yes")


# --- the update-cancelled column (CANCEL_RULE) ------------------------------------------

def test_an_update_below_half_a_bfloat16_ulp_is_cancelled():
    net = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 4)).to(torch.bfloat16)
    for p in net.parameters():
        torch.nn.init.ones_(p)
        p.grad = torch.ones_like(p)
    mixed = torch.tensor([1e-4] * 3 + [1e-2] * 4 + [0.0]).view(2, 4)  # zeros do not count
    updates = {"0.weight": mixed, "0.bias": torch.full((2,), 1e-4),
               "1.weight": torch.full((4, 2), -1e-2)}
    report = mpfunc_torch.precision_report(net, updates=updates)
    got = {r["name"]: r["update_cancelled"] for r in report.rows()}
    assert got == {"0.weight": 3 / 7, "0.bias": 1.0, "1.weight": 0.0, "1.bias": None}
    lines = str(report).splitlines()
    assert lines[1].split()[-2:] == ["update", "cancelled"]
    assert "42.9%" in str(report) and "100.0%" in str(report) and lines[-1].endswith("-")
    assert "update_cancelled" not in mpfunc_torch.precision_report(net).rows()[0]
    with one_at_a_time():  # the per-tensor path gives the same counts
        assert mpfunc_torch.precision_report(net, updates=updates).rows() == report.rows()


def test_the_cancelled_fraction_is_what_a_bfloat16_sgd_step_leaves_unmoved():
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Linear(64, 32).to(torch.bfloat16)
    for p in net.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * 0.3).to(torch.bfloat16)
        p.grad.view(-1)[:5] = 0.0
    lr = 3e-3
    updates = [p.grad.float() * -lr for p in net.parameters()]  # SGD's float32 update
    rows = mpfunc_torch.precision_report(net, updates=updates).rows()
    before = [p.detach().clone() for p in net.parameters()]
    torch.optim.SGD(net.parameters(), lr=lr, foreach=False).step()
    for row, p, old in zip(rows, net.parameters(), before):
        unmoved = ((p.detach() == old) & (p.grad != 0)).sum().item()
        assert row["update_cancelled"] == unmoved / (p.grad != 0).sum().item()
        assert 0.05 < row["update_cancelled"] < 0.95  # a mix, so the check has teeth


@needs_jax
@given(pairs=st.lists(st.tuples(st.floats(-1e4, 1e4, width=32).filter(
                                    lambda x: x == 0 or abs(x) > 1e-20),
                                st.sampled_from([0.0, -0.0, 1e-4, -1e-4, 2.0**-8, 2.0**-9,
                                                 1e-2, 3e-3, -0.7, 5.0, float("inf")])),
                      min_size=1, max_size=24),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]))
def test_both_frameworks_cancel_the_same_updates(pairs, dtype):
    import jax.numpy as jnp

    import mpfunc

    p = torch.tensor([a for a, _ in pairs]).to(getattr(torch, dtype))
    u = torch.tensor([b for _, b in pairs])
    net = torch.nn.Linear(len(pairs), 1, bias=False).to(p.dtype)
    with torch.no_grad():
        net.weight.copy_(p.view(1, -1))
    rows_t = mpfunc_torch.precision_report(net, grads=[torch.ones(1, len(pairs))],
                                           updates=[u.view(1, -1)]).rows()
    pj = jnp.asarray(p.float().numpy()).astype(dtype)
    rows_j = mpfunc.precision_report({"weight": jnp.ones(len(pairs))}, params={"weight": pj},
                                     updates={"weight": jnp.asarray(u.numpy())}).rows()
    assert rows_t[0]["update_cancelled"] == rows_j[0]["update_cancelled"]
    assert repr([r | {"name": ""} for r in rows_t]) == repr([r | {"name": ""} for r in rows_j])


def test_bad_updates_are_refused_with_the_argument_named():
    net = make_net()
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match=r"`updates` for '0.weight' must be a tensor of the "
                                         r"param's shape \(16, 8\), got \(8, 16\)"):
        mpfunc_torch.precision_report(net, updates={"0.weight": torch.zeros(8, 16)})
    with pytest.raises(ValueError, match="`updates` has 1 entries, `model` has 6"):
        mpfunc_torch.precision_report(net, updates=[None])
    with pytest.raises(ValueError, match=r"`updates` names \['3.bias'\]"):
        mpfunc_torch.precision_report(net, updates={"3.bias": torch.zeros(1)})
    with pytest.raises(TypeError, match="`updates` must be None"):
        mpfunc_torch.precision_report(net, updates=torch.zeros(3))


@pytest.mark.parametrize("mode, cfg", [("bf16", {"master_weights": "remainder"}),
                                       ("naive", {}), ("torch", {})])
def test_the_optimizer_report_reads_updates_against_the_params_as_stored(mode, cfg):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.MSELoss(), mode=mode, **cfg)
    opt.zero_grad()
    opt.backward(crit(model(torch.randn(4, 8)), torch.randn(4, 4)))
    named = dict(net.named_parameters())  # the converted model's names, as it stores them
    g = torch.Generator().manual_seed(1)
    # A mix of steps below and above half an ulp of the stored (half) params.
    updates = {n: torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(
        -6, -1, p.shape, generator=g) for n, p in named.items()}
    rows = opt.precision_report(updates=updates).rows()
    ref = mpfunc_torch.precision_report(model, updates=updates).rows()
    got = {r["name"]: r["update_cancelled"] for r in rows}
    assert got == {r["name"]: r["update_cancelled"] for r in ref} and len(got) == 4
    for n, p in named.items():  # the rule by hand, on the param as the model stores it
        u = updates[n]
        moved = (p.detach().float() + u).to(p.dtype) != p.detach()
        assert got[n] == ((u != 0) & ~moved).sum().item() / (u != 0).sum().item()
    assert (0 < min(got.values()) < 1) if mode != "torch" else max(got.values()) < 1
    assert "update_cancelled" not in opt.precision_report().rows()[0]
    with pytest.raises(ValueError, match="`updates` has 1 entries, the optimizer's model has 4"):
        opt.precision_report(updates=[None])
    with pytest.raises(ValueError, match="not params of the optimizer's model .*did you mean `0.weight`"):
        opt.precision_report(updates={"0.wieght": torch.zeros(16, 8)})
    opt.step()
