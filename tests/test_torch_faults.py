"""Fault injection over long runs: every torch mode, fused / foreach / plain Adam, AdamW
and SGD with momentum, 2,000 steps each.

Random inf/NaN in the loss or in one gradient element at ~5% of steps, bursts of
overflows that drive the scale to its floor, and fault-free stretches that let it grow
to its ceiling (or, without a ceiling, until the model's own float16 activations
overflow). After every step the test checks, against its own finiteness check of the
gradients, that the step was skipped exactly when a gradient was (or would become, once
unscaled) non-finite, and that the scale stayed inside [floor, ceiling]; periodically
and at the end, that no param, master weight or optimizer-state value is inf/NaN.
"""

import random

import pytest
import torch

import mpfunc_torch

STEPS = 2000
BURSTS = [(200, 260), (1100, 1160)]  # every step overflows: the scale reaches its floor
CLEAN = [(1400, 1750)]  # no injected fault: the scale climbs to its ceiling

MODES = {
    "torch": ("torch", {"growth_interval": 8}),
    "torch-bf16": ("torch", {"dtype": "bfloat16", "growth_interval": 8}),
    "apex-O0": ("apex", {"opt_level": "O0"}),
    # O1 with a floor below 1: overflows created by unscaling are caught too.
    "apex-O1": ("apex", {"opt_level": "O1", "min_loss_scale": 2.0**-8,
                         "max_loss_scale": 2.0**12}),
    "apex-O2": ("apex", {"opt_level": "O2", "max_loss_scale": 2.0**12}),
    "apex-O3": ("apex", {"opt_level": "O3", "loss_scale": "dynamic",
                         "min_loss_scale": 2.0**-4, "max_loss_scale": 2.0**10}),
    "naive": ("naive", {"initial_scale": 2.0**12, "growth_interval": 8, "max_scale": 2.0**14,
                        "min_scale": 0.25}),
    "bf16": ("bf16", {}),
}
OPTIMIZERS = {
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, eps=1e-3, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, eps=1e-3, **kw),
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, **kw),
}
IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "plain": {"foreach": False}}
CASES = [(m, o, i) for m in MODES for o in OPTIMIZERS for i in IMPLS
         # torch's fused CPU SGD cannot step float16 params; convert_to_amp refuses it.
         if not (m == "apex-O3" and o == "sgd" and i == "fused")]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: intra-op threads only add overhead (and spin on a busy CI machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_net():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                               torch.nn.Linear(8, 4))


def _phase(step, windows):
    return any(a <= step < b for a, b in windows)


def _would_skip(params, inv_scale, unscale_in_float32):
    """Our own check, on the device: is a gradient non-finite, or does it become so when
    unscaled (in float32 for master weights, else in the gradient's dtype, as the unscale
    kernel writes)? Returns a 0-dim bool tensor."""
    bad = torch.zeros((), dtype=torch.bool)
    for dtype in {p.grad.dtype for p in params if p.grad is not None}:
        g = torch.cat([p.grad.flatten() for p in params
                       if p.grad is not None and p.grad.dtype == dtype]).float()
        unscaled = g * inv_scale
        if not unscale_in_float32:
            unscaled = unscaled.to(dtype)
        bad = bad | ~(torch.isfinite(g).all() & torch.isfinite(unscaled).all())
    return bad


def _all_finite(model, opt):
    tensors = [p for p in model.parameters()] + [m for _, m in opt._pairs]
    tensors += [v for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize("mode, opt_name, impl", CASES, ids=["-".join(c) for c in CASES])
def test_faults_never_reach_params_masters_or_state(mode, opt_name, impl):
    name, cfg = MODES[mode]
    if name == "apex":
        cfg = {**cfg, "verbosity": 0}
    seed = CASES.index((mode, opt_name, impl))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    net = make_net()
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, OPTIMIZERS[opt_name](net.parameters(), **IMPLS[impl]),
        torch.nn.MSELoss(), mode=name, **cfg)
    plan = opt.plan
    floor, ceiling = ((plan.scale_config.min_scale, plan.scale_config.max_scale)
                      if plan.scale_kind == "dynamic" else (None, None))
    params = list(net.parameters())
    x_all, y_all = torch.randn(64, 4, 8), torch.randn(64, 4, 4)
    faults, expected, stepped, scales = [], [], [], [opt.loss_scale.clone()]
    for step in range(STEPS):
        opt.zero_grad()
        x, y = x_all[step % 64], y_all[step % 64]
        fault = None
        if _phase(step, BURSTS) or (not _phase(step, CLEAN) and rng.random() < 0.05):
            fault = rng.choice(["loss-inf", "loss-nan", "grad-inf", "grad-nan"])
        loss = crit(model(x), y)
        if fault in ("loss-inf", "loss-nan"):
            loss = loss * float(fault[5:])
        opt.backward(loss)
        if fault in ("grad-inf", "grad-nan"):
            with torch.no_grad():
                g = rng.choice([p for p in params if p.grad is not None]).grad
                g.view(-1)[rng.randrange(g.numel())] = float(fault[5:])
        faults.append(fault)
        expected.append(_would_skip(params, torch.reciprocal(opt.loss_scale), bool(opt._pairs)))
        stepped.append(opt.step())
        scales.append(opt.loss_scale.clone())
        if step % 250 == 0:
            assert _all_finite(net, opt), step
    # Compared once at the end (no extra host sync per step in the loop).
    expected = torch.stack(expected).tolist()
    stepped = torch.stack(stepped).tolist()
    scales = torch.stack(scales).tolist()
    for step, (fault, skip, took) in enumerate(zip(faults, expected, stepped)):
        assert skip or fault is None, (step, fault)  # every injected fault is seen
        assert took == (not skip), (step, fault, scales[step])
    injected = sum(f is not None for f in faults)
    genuine = sum(skip and f is None for f, skip in zip(faults, expected))
    if floor is not None:
        assert all(floor <= s <= ceiling for s in scales), (min(scales), max(scales))
    assert _all_finite(net, opt)
    metrics = opt.scale_metrics(as_python=True)
    assert metrics["skipped_steps"] == injected + genuine
    assert injected > 150  # ~5% of 2000 plus two bursts of 60
    if floor is not None:
        assert min(scales) == floor  # the bursts drove it to the floor
        if plan.scale_config.growth_interval > 8:
            # apex has no growth_interval key (its window is 2000 steps): it starts at
            # its ceiling (init is clamped to max_loss_scale) and cannot climb back here.
            assert scales[0] == ceiling
        elif ceiling != float("inf"):
            assert ceiling in scales[1 + 1400:1 + 1750]  # the clean stretch reached it
        else:
            # No ceiling: it climbs through the clean stretch until the model's own
            # float16 activations overflow (bfloat16 ones never do in 350 steps).
            assert genuine > 0 or scales[1 + 1750] >= scales[1 + 1400] * 2.0**40
