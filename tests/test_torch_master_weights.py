"""Tests for mpfunc_torch._src.master_weights: float32 masters of half-precision params."""

import copy

import pytest
import torch
from torch_task import batches, make_model, tiny_batch, tiny_model

import mpfunc_torch
from mpfunc_torch import AMP_TYPE


def test_naive_mode_casts_model_and_keeps_float32_masters():
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=AMP_TYPE.NAIVE)
    assert all(p.dtype == torch.float16 for p in net.parameters())  # norms too, like Megatron
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    x, y = batches(1)[0]
    out = model(x)
    assert out.dtype == torch.float32
    assert opt.scale_metrics(as_python=True)["loss_scale"] == 2.0**32

def test_naive_clip_grad_and_zero_count():
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, opt, torch.nn.CrossEntropyLoss(), mode="naive", clip_grad=0.5,
        log_num_zeros_in_grad=True, initial_scale=2.0**10)
    x, y = batches(1)[0]
    opt.backward(crit(model(x), y))
    seen = {}
    real_step = opt.optimizer.step

    def spy_step(*a, **k):  # look at the master grads the inner optimizer is handed
        grads = [m.grad for _, m in opt._pairs if m.grad is not None]
        seen["zeros"] = sum(int((g == 0).sum()) for g in grads)
        seen["norm"] = float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        return real_step(*a, **k)

    opt.optimizer.step = spy_step
    opt.step()
    # Embedding rows of bytes absent from the batch get exactly-zero gradients.
    assert opt.scale_metrics(as_python=True)["num_zeros_in_grad"] == seen["zeros"] > 0
    assert float(opt.grad_norm) > 0.5  # the norm before clipping
    assert seen["norm"] <= 0.5 * (1 + 1e-5)  # what the optimizer stepped with
    assert all(m.grad is None for _, m in opt._pairs)  # released after the step


MASTER_MODES = [("naive", {"initial_scale": 2.0**10}),
                ("apex", {"opt_level": "O2", "verbosity": 0})]
master_ids = ["naive", "apex-O2"]


def _convert(net, mode, cfg, lr=0.1, opt_cls=torch.optim.SGD, **opt_kw):
    return mpfunc_torch.convert_to_amp(net, opt_cls(net.parameters(), lr=lr, **opt_kw),
                                       torch.nn.MSELoss(), mode=mode, **cfg)


def _steps(model, opt, crit, n=2, seed=0):
    for i in range(n):
        opt.zero_grad()
        x, y = tiny_batch(seed + i)
        opt.backward(crit(model(x), y))
        assert bool(opt.step())


@pytest.mark.parametrize("mode, cfg", MASTER_MODES, ids=master_ids)
def test_loading_pretrained_weights_after_conversion_moves_the_masters(mode, cfg):
    pretrained = tiny_model(seed=1).state_dict()  # float32
    net = tiny_model(seed=0)
    model, opt, crit = _convert(net, mode, cfg)
    model.load_state_dict(pretrained)
    for (_, m), v in zip(opt._pairs, pretrained.values()):
        assert torch.equal(m, v)  # exactly, not the float16 rounding
    _steps(model, opt, crit)
    ref = tiny_model(seed=1)  # the same weights converted directly
    ref_model, ref_opt, ref_crit = _convert(ref, mode, cfg)
    _steps(ref_model, ref_opt, ref_crit)
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    for (_, a), (_, b) in zip(opt._pairs, ref_opt._pairs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode, cfg", MASTER_MODES, ids=master_ids)
def test_in_place_writes_to_params_after_conversion_reach_the_masters(mode, cfg):
    # What DDP's broadcast of rank 0's weights does when DDP wraps the converted model,
    # and what a user's `with torch.no_grad(): p.copy_(...)` does.
    new = tiny_model(seed=1)
    net = tiny_model(seed=0)
    model, opt, crit = _convert(net, mode, cfg)
    with torch.no_grad():
        for p, q in zip(net.parameters(), new.parameters()):
            p.copy_(q)
    assert opt.state_dict()["master_weights"][0].equal(
        next(new.parameters()).detach().half().float())  # a checkpoint sees the write
    _steps(model, opt, crit)
    ref = tiny_model(seed=1)  # the written (half) values, converted directly
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.half().float())
    ref_model, ref_opt, ref_crit = _convert(ref, mode, cfg)
    _steps(ref_model, ref_opt, ref_crit)
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    for (_, a), (_, b) in zip(opt._pairs, ref_opt._pairs):
        assert torch.equal(a, b)
    # The optimizer's own steps are not outside writes: the masters keep their bits.
    assert any(not torch.equal(m, p.float()) for p, m in opt._pairs)


def test_a_written_param_is_the_truth_but_loads_keep_master_bits():
    # A write in place (as DDP's broadcast on its source rank, same values) makes the
    # master exactly the half value, so every rank's masters agree; a float32 load
    # after it keeps the loaded bits (the load hook marks the write as followed).
    net = tiny_model(seed=0)
    model, opt, crit = _convert(net, "naive", {"initial_scale": 2.0**10})
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.clone())
    opt.state_dict()  # syncs before saving
    assert all(torch.equal(m, p.float()) for p, m in opt._pairs)
    pretrained = tiny_model(seed=1).state_dict()
    model.load_state_dict(pretrained)
    opt.state_dict()
    for (_, m), v in zip(opt._pairs, pretrained.values()):
        assert torch.equal(m, v)  # float32 bits, not float16 roundings


def test_submodule_load_and_assign_true_also_move_the_masters():
    pretrained = tiny_model(seed=1)
    net = tiny_model(seed=0)
    model, opt, crit = _convert(net, "naive", {"initial_scale": 2.0**10})
    params = list(net.parameters())
    net[2].load_state_dict(pretrained[2].state_dict())  # a submodule only
    net[0].load_state_dict(pretrained[0].state_dict(), assign=True)
    assert all(a is b for a, b in zip(params, net.parameters()))  # still what opt steps
    assert all(p.dtype == torch.float16 for p in net.parameters())
    for (_, m), v in zip(opt._pairs, pretrained.parameters()):
        assert torch.equal(m, v.detach())
    _steps(model, opt, crit)
    assert all(torch.equal(p, m.half()) for p, m in opt._pairs)


@pytest.mark.parametrize("order", ["model-then-optimizer", "optimizer-then-model"])
def test_resume_from_a_converted_checkpoint_keeps_master_bits_in_either_order(order):
    cfg = {"initial_scale": 2.0**10}
    net = tiny_model()
    model, opt, crit = _convert(net, "naive", cfg, opt_cls=torch.optim.AdamW, lr=1e-2)
    _steps(model, opt, crit, n=3)
    # float16 model weights; deep-copied as torch.save would (state dicts hold references)
    ck = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    net2 = tiny_model(seed=5)
    model2, opt2, crit2 = _convert(net2, "naive", cfg, opt_cls=torch.optim.AdamW, lr=1e-2)
    loads = [lambda: model2.load_state_dict(ck["model"]), lambda: opt2.load_state_dict(ck["opt"])]
    for load in loads if order == "model-then-optimizer" else loads[::-1]:
        load()
    for (_, a), (_, b) in zip(opt._pairs, opt2._pairs):
        assert torch.equal(a, b)  # the float32 masters, not float16 roundings
    _steps(model, opt, crit, seed=10)
    _steps(model2, opt2, crit2, seed=10)
    for a, b in zip(net.parameters(), net2.parameters()):
        assert torch.equal(a, b)


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Linear(6, 6)  # no gradient ever

    def forward(self, idx):
        return self.head(torch.tanh(self.frozen(self.mid(self.embed(idx)))))


@pytest.mark.parametrize("mode, cfg", MASTER_MODES, ids=master_ids)
def test_tied_frozen_and_gradless_params(mode, cfg):
    net = _Tied()
    frozen_before = [p.detach().clone().half() for p in net.frozen.parameters()]
    unused_before = [p.detach().clone().half() for p in net.unused.parameters()]
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)  # holds the frozen params too
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=mode, **cfg)
    n_unique = len({id(p) for p in net.parameters()})
    assert len(opt._pairs) == n_unique == len(list(net.parameters()))  # one master per tie
    embed_before = net.embed.weight.detach().clone()
    for i in range(3):
        opt.zero_grad()
        idx = torch.randint(0, 10, (8, 4), generator=torch.Generator().manual_seed(i))
        opt.backward(crit(model(idx).flatten(0, 1), idx.flatten()))
        assert bool(opt.step())
    assert net.head.weight is net.embed.weight  # still tied
    assert not torch.equal(net.embed.weight, embed_before)  # and trained
    master_of = {id(p): m for p, m in opt._pairs}
    assert torch.equal(net.embed.weight, master_of[id(net.embed.weight)].half())
    for a, b in zip(frozen_before, net.frozen.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(unused_before, net.unused.parameters()):
        assert torch.equal(a, b)
    assert all(master_of[id(p)].grad is None for p in net.frozen.parameters())


@pytest.mark.parametrize("mode, cfg", MASTER_MODES, ids=master_ids)
def test_sparse_gradients_step_float32_masters(mode, cfg):
    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(30, 8, sparse=True)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, idx):
            return self.head(self.embed(idx).mean(1))

    net, ref = Bag(), Bag()
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.5), torch.nn.MSELoss(), mode=mode, **cfg)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        idx, y = torch.randint(0, 30, (16, 5), generator=g), torch.randn(16, 1, generator=g)
        opt.zero_grad()
        opt.backward(crit(model(idx), y))
        assert bool(opt.step())
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(idx), y).backward()
        ref_opt.step()
    master = opt._pairs[0][1]
    torch.testing.assert_close(master, ref.embed.weight.detach(), rtol=5e-3, atol=5e-4)
    assert torch.equal(net.embed.weight, master.half())
    assert not torch.equal(master, Bag().embed.weight.detach())


def test_naive_clip_and_zero_count_with_sparse_gradients():
    net = torch.nn.EmbeddingBag(20, 4, mode="sum", sparse=True)
    model, opt, _ = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.1), mode="naive", clip_grad=0.5,
        log_num_zeros_in_grad=True, initial_scale=2.0**10)
    idx = torch.tensor([[1, 1, 2], [3, 3, 3]])
    opt.backward(model(idx).sum() * 10)
    assert bool(opt.step())
    # rows 1, 2, 3 get gradients 20, 10, 30 in each of 4 columns: clipped to norm 0.5
    assert float(opt.grad_norm) == pytest.approx((4 * (20**2 + 10**2 + 30**2)) ** 0.5)
    assert opt.scale_metrics(as_python=True)["num_zeros_in_grad"] == 20 * 4 - 3 * 4


# -- memory: the grads-to-masters copy ---------------------------------------------------
def _deep_mlp(width=64, depth=16):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))


def _step_peak_bytes(mode, cfg, step_chunks=1):
    """Live bytes at torch's CPU allocator at the peak of the second ``opt.step()``
    (the first creates Adam's state). The profiler records every allocation and free
    with its address; it starts before the model is built, so everything is counted.
    Deterministic: byte counts, not timings."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    box = {}

    def run():
        net = _deep_mlp()
        box["n"] = sum(p.numel() for p in net.parameters())
        box["largest"] = max(p.numel() for p in net.parameters())
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)
        x, y = torch.randn(8, 64), torch.randn(8, 4)
        if mode is None:  # plain float32
            for _ in range(2):
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
                with record_function("mpfunc_test::step"):
                    opt.step()
            return
        model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(),
                                                       mode=mode, step_chunks=step_chunks,
                                                       **cfg)
        for _ in range(2):
            opt.zero_grad()
            opt.backward(crit(model(x), y))
            with record_function("mpfunc_test::step"):
                assert bool(opt.step())

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events, window, stack = [], None, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
            events.append((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size))
        elif e.name == "mpfunc_test::step" and (window is None or e.start_time_ns > window[0]):
            window = (e.start_time_ns, e.end_time_ns)
    live, total, peak = {}, 0, 0
    for t, ptr, size in sorted(events):
        if size > 0:
            live[ptr] = size
            total += size
        elif ptr in live:
            total -= live.pop(ptr)
        if t < window[0]:
            peak = total  # what is live when the step starts
        elif t <= window[1]:
            peak = max(peak, total)
    return peak, box["n"], box["largest"]


@pytest.mark.parametrize("mode, cfg", [(None, {})] + MASTER_MODES, ids=["fp32"] + master_ids)
def test_step_peak_is_18_bytes_per_param_plus_one_tensor(mode, cfg):
    # fp32 Adam: 4 param + 4 grad + 8 state = 16 bytes/param. With master weights:
    # 2 half param + 4 master + 4 master grad + 8 state = 18 (Megatron's accounting),
    # plus the half grad of one tensor alive with its float32 copy. Copying every half
    # grad at once held them all beside the float32 grads: 20.
    peak, n, largest = _step_peak_bytes(mode, cfg)
    small = 64 * 1024  # the batch, scalars, step counters: a few KiB
    if mode is None:
        assert 16 * n <= peak <= 16 * n + small
    else:
        assert 18 * n <= peak <= 18 * n + 2 * largest + small
        fp32, _, _ = _step_peak_bytes(None, {})
        assert peak / fp32 <= (18 + 2 * largest / n) / 16 + small / fp32 < 20 / 16


@pytest.mark.parametrize("k", [4, 8])
@pytest.mark.parametrize("mode, cfg", MASTER_MODES + [("naive", dict(MASTER_MODES[0][1], clip_grad=1e-3))],
                         ids=master_ids + ["naive-clip"])
def test_chunked_step_peak_is_16_plus_4_over_k_bytes_per_param(mode, cfg, k):
    # With clip_grad the norms pass makes and frees the chunks' float32 grads too.
    # step_chunks=k: 2 half param + 2 half grad (those not copied yet) + 4 master + 8 Adam
    # + 4 x one chunk's float32 grads (at most n / k elements, or the largest tensor).
    peak, n, largest = _step_peak_bytes(mode, cfg, step_chunks=k)
    small = 64 * 1024
    chunk = max(-(-n // k), largest)
    assert 16 * n <= peak <= 16 * n + 4 * chunk + small
    assert peak < 18 * n  # below Megatron's accounting, which holds every float32 grad


def test_chunked_copy_is_exact_and_frees_each_half_grad():
    from mpfunc_torch._src.master_weights import copy_grads_to_masters_, largest_first

    g = torch.Generator().manual_seed(0)
    shapes = [(300,), (64, 64), (7,), (64, 64), (1,), (128, 3), (5, 5), (64, 64)]
    params = [torch.zeros(s, dtype=torch.float16, requires_grad=True) for s in shapes]
    masters = [torch.zeros(s, requires_grad=True) for s in shapes]
    for i, p in enumerate(params):
        if i != 2:  # one param without a gradient
            p.grad = (torch.randn(p.shape, generator=g) * 1e4).half()
    params[3].grad[0, 0] = float("inf")  # copied as it is: the check comes after
    held = params[1].grad  # someone else holds this one: it stays valid
    expected = [None if p.grad is None else p.grad.float() for p in params]
    masters[2].grad = torch.ones(7)  # a stale master grad is cleared
    masters[4].grad = torch.full((1,), 5.0)  # an existing dense master grad is reused
    reused = masters[4].grad
    copy_grads_to_masters_(largest_first(list(zip(params, masters))))
    assert all(p.grad is None for p in params)
    for m, e in zip(masters, expected):
        assert (m.grad is None) if e is None else torch.equal(m.grad, e)
    assert masters[4].grad is reused
    assert torch.equal(held.float(), expected[1])


@pytest.mark.parametrize("mode, cfg", MASTER_MODES, ids=master_ids)
def test_accumulated_half_grads_reach_the_masters_unscaled(mode, cfg):
    net = _deep_mlp(width=16, depth=3)
    model, opt, crit = _convert(net, mode, cfg)
    params = list(net.parameters())
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g))
            for _ in range(3)]
    for x, y in data:  # three backward calls, one step: autograd sums the half grads
        opt.backward(crit(model(x), y) * 1e-3)
    expected = [p.grad.float() * (1 / float(opt.loss_scale)) for p in params]
    seen = {}
    real_step = opt.optimizer.step

    def spy(*a, **k):  # O2 keeps LayerNorm float32: its params are their own owners
        seen.update({id(q): q.grad.clone() for g in opt.param_groups for q in g["params"]})
        return real_step(*a, **k)

    opt.optimizer.step = spy
    assert bool(opt.step())
    master_of = {id(p): m for p, m in opt._pairs}
    assert len(opt._pairs) >= 4  # the Linear weights and biases have masters
    for p, e in zip(params, expected):
        assert torch.equal(seen[id(master_of.get(id(p), p))], e)


@pytest.mark.parametrize("mode, cfg", MASTER_MODES, ids=master_ids)
def test_adagrad_state_made_at_construction_moves_to_the_masters(mode, cfg):
    # torch's Adagrad makes its accumulators (step 0) in __init__: that is not a stepped
    # optimizer, and the state must follow the params to their float32 masters.
    net, ref = _deep_mlp(width=16, depth=2), _deep_mlp(width=16, depth=2)
    opt = torch.optim.Adagrad(net.parameters(), lr=0.05, initial_accumulator_value=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode=mode,
                                                   **cfg)
    owned = [q for g in opt.param_groups for q in g["params"]]
    assert set(opt.optimizer.state) == set(owned)
    assert all(s["sum"].dtype == torch.float32 and bool((s["sum"] == 0.1).all())
               for s in opt.optimizer.state.values())
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.05, initial_accumulator_value=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        opt.backward(crit(model(x), y))
        assert bool(opt.step())
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    master_of = {id(p): m for p, m in opt._pairs}
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(master_of.get(id(p), p).float(), q.detach(), rtol=2e-2,
                                   atol=2e-3)
    assert all(float(s["step"]) == 4 for s in opt.optimizer.state.values())
    # once it has stepped, an Adagrad is refused like any other optimizer
    stepped = torch.optim.Adagrad(ref.parameters(), lr=0.05)
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    stepped.step()
    with pytest.raises(ValueError, match="already has state"):
        mpfunc_torch.convert_to_amp(ref, stepped, mode=mode, **cfg)
