"""mpfunc_torch._src.storage_kernels: Adam/AdamW(fused=True) stepping bfloat16 params
stored without float32 masters through torch's fused kernel, a chunk at a time, bit for
bit as the generic path (whole float32 masters and state built, stepped, written back)."""

import pytest
import torch
from lowp_task import same, snapshot

import mpfunc_torch
from mpfunc_torch._src import storage_kernels
from mpfunc_torch._src.low_precision import low_precision_of

# storage, state dtype, state rounding: every storage with each kind of state.
CASES = [(storage, state, rounding)
         for storage in ["remainder", "kahan", "stochastic", "float32"]
         for state, rounding in [(None, "nearest"), ("bfloat16", "nearest"),
                                 ("bfloat16", "stochastic")]
         if not (storage == "float32" and state is None)]
# The inner optimizer's options, one per case in turn: each option runs with each
# storage at least once without the whole product.
OPTIONS = [{"cls": torch.optim.AdamW, "weight_decay": 0.1},
           {"cls": torch.optim.Adam, "amsgrad": True},
           {"cls": torch.optim.AdamW, "maximize": True, "amsgrad": True},
           {"cls": torch.optim.Adam, "weight_decay": 0.05, "lr": torch.tensor(3e-3)}]


@pytest.fixture
def small_chunks(monkeypatch):
    # Chunks of 2**16 elements: the 300 x 700 weight is 3.2 chunks, its tail in the last.
    monkeypatch.setattr(storage_kernels, "chunk_elements", lambda device: storage_kernels.ALIGN)


def build(storage, state, rounding, options, kernels=True, seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.Tanh(),
                              torch.nn.Linear(700, 3))
    options = dict(options)
    cls, lr = options.pop("cls"), options.pop("lr", 1e-2)
    opt = cls(net.parameters(), lr=lr, fused=True, **options)
    keys = {"master_weights": storage}
    if state is not None:
        keys.update(state_dtype=state, state_rounding=rounding, seed=3 * (rounding == "stochastic"))
    if storage == "stochastic":
        keys["seed"] = 3
    model, aopt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode="bf16",
                                                    **keys)
    if not kernels:
        low_precision_of(aopt).kernels = None
    return net, model, aopt, crit


def train(net, model, opt, crit, steps, data_seed=1):
    g = torch.Generator().manual_seed(data_seed)
    paths = []
    for _ in range(steps):
        x, y = torch.randn(8, 300, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        opt.backward(crit(model(x), y))
        assert bool(opt.step())
        paths.append(low_precision_of(opt).kernel_path)
    return paths


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_fused_path_equals_the_generic_path_bit_for_bit(small_chunks, case):
    storage, state, rounding = CASES[case]
    options = OPTIONS[case % len(OPTIONS)]
    runs = []
    for kernels in (False, True):
        net, model, opt, crit = build(storage, state, rounding, options, kernels)
        paths = train(net, model, opt, crit, 5)
        runs.append((snapshot(net, opt), paths, opt.state_dict()))
    (generic, generic_paths, _), (fast, fast_paths, sd) = runs
    assert generic_paths == [False] * 5
    assert fast_paths == [False] + [True] * 4  # the first step makes the state: generic
    same(generic, fast)  # params, remainders/compensation, state, step counts, seed/step
    assert sd["low_precision"]["step"] == 5


@pytest.mark.parametrize("storage", ["remainder", "stochastic"])
def test_float32_stand_ins_for_16bit_state_where_torch_refuses_it(small_chunks, monkeypatch,
                                                                  storage):
    # torch 2.11's Adam.step refuses a bfloat16 moment beside a float32 param before the
    # kernel; there the stored state is a float32 stand-in during the step (as on this
    # torch when the probe says so), with the same result, and it is put back after.
    from mpfunc_torch._src import fused

    runs = []
    for kernels in (False, True):
        net, model, opt, crit = build(storage, "bfloat16", "stochastic", OPTIONS[1], kernels)
        if kernels:
            monkeypatch.setattr(fused, "fused_adam_takes_state_of_another_dtype", lambda: False)
        paths = train(net, model, opt, crit, 4)
        runs.append(snapshot(net, opt))
        states = [v for st in opt.optimizer.state.values() for k, v in st.items() if k != "step"]
        assert {t.dtype for t in states} == {torch.bfloat16}  # the stored tensors, back
        assert all(t.stride() != (0,) * t.dim() for t in states)
    assert paths == [False, True, True, True]
    same(*runs)


def _paths(options, steps=2, state="bfloat16", hook=None, **keys):
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    options = dict(options)
    cls = options.pop("cls", torch.optim.AdamW)
    opt = cls(net.parameters(), lr=1e-3, **options)
    model, aopt, crit = mpfunc_torch.convert_to_amp(
        net, opt, torch.nn.MSELoss(), mode="bf16", master_weights="remainder",
        state_dtype=state, **keys)
    if hook is not None:
        hook(opt)
    out = []
    for _ in range(steps):
        aopt.zero_grad()
        aopt.backward(crit(model(torch.ones(2, 8)), torch.zeros(2, 4)))
        aopt.step()
        out.append(low_precision_of(aopt).kernel_path)
    return out


class _Adam(torch.optim.Adam):
    pass


def test_the_fused_path_is_taken_only_where_it_applies():
    assert _paths({"fused": True}) == [False, True]
    assert _paths({"cls": torch.optim.Adam, "fused": True}) == [False, True]
    assert _paths({"fused": True}, state=None) == [False, True]
    # Not torch's fused Adam kernel, or it could not be taken over safely: generic.
    assert _paths({"foreach": True}) == [False, False]
    assert _paths({"cls": torch.optim.SGD, "momentum": 0.9, "fused": True}) == [False, False]
    assert _paths({"cls": _Adam, "fused": True}) == [False, False]  # a subclass may differ
    assert _paths({"fused": True}, state="float8_e4m3fn") == [False, False]
    # A step hook may read the params, which have no float32 value on the fused path.
    seen = []
    assert _paths({"fused": True}, hook=lambda o: o.register_step_pre_hook(
        lambda *a: seen.append(1))) == [False, False]
    assert seen == [1, 1]
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda *a: None)
    try:
        assert _paths({"fused": True}) == [False, False]
    finally:
        handle.remove()
    # An LR scheduler's wrapper of step is the step's own: the path stays, with no
    # call-order warning (warnings are errors here).
    assert _paths({"fused": True}, hook=lambda o: torch.optim.lr_scheduler.StepLR(
        o, step_size=1)) == [False, True]


def test_no_other_op_may_touch_a_param_the_kernel_steps():
    w = torch.nn.Parameter(torch.zeros(3))
    mode = storage_kernels._TakeOver(None, {id(w)}, 0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(RuntimeError, match="fused Adam kernel only"), mode:
        torch.add(w, 1)
    with mode:  # anything else runs as usual
        assert torch.add(torch.ones(2), 1).tolist() == [2.0, 2.0]


def test_the_step_holds_a_few_chunks_of_float32_temporaries(small_chunks):
    # Counted at torch's CPU allocator inside one step (after the first, which makes the
    # state): both make the float32 master grads (4 bytes/param); the generic path builds
    # every float32 master and moment beside them (12 more), the fused path a chunk of
    # each (3 x 2**16 elements: 0.75 bytes/param here, less in a larger model).
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    def peak_per_param(kernels):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(4)])
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
        model, aopt, crit = mpfunc_torch.convert_to_amp(
            net, opt, torch.nn.MSELoss(), mode="bf16", master_weights="remainder",
            state_dtype="bfloat16")
        if not kernels:
            low_precision_of(aopt).kernels = None
        x = torch.randn(4, 512)

        aopt.zero_grad()
        aopt.backward(crit(model(x), x))
        aopt.step()  # makes the state
        aopt.zero_grad()
        aopt.backward(crit(model(x), x))
        # acc_events: torch 2.11 warns, at a second profile in one process, that it keeps
        # only the current cycle's events (which is all this reads).
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                     acc_events=True) as prof:
            aopt.step()
        events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.typed[0] == _EventType.Allocation:
                events.append((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size))
        live, total, peak = {}, 0, 0
        for _, ptr, size in sorted(events):
            if size > 0:
                live[ptr] = size
                total += size
            elif ptr in live:
                total -= live.pop(ptr)
            peak = max(peak, total)
        return peak / sum(p.numel() for p in net.parameters())

    generic, fast = peak_per_param(False), peak_per_param(True)
    assert generic >= 16
    assert fast <= 4 + 1.5
