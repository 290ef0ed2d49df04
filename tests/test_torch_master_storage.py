"""mpfunc_torch._src.master_storage and low_precision: bfloat16 params without float32
masters (remainders, Kahan, stochastic rounding) inside AmpOptimizer."""

import numpy as np
import pytest
import torch
from lowp_task import (
    SHAPES,
    bits,
    convert,
    fixed_grads,
    masters,
    net,
    rebuilt,
    round_trip,
    same,
    snapshot,
    step_with,
)

import mpfunc_torch
from _mpfunc_common import rounding as R
from mpfunc_torch._src.low_precision import persistent_bytes, use_low_precision
from mpfunc_torch._src.state_dtype import StateDtype

OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, foreach=False),
}


def train_fixed(storage, make, steps, chunks=1, seed=0, grads=None):
    model = net()
    model_c, opt = convert(model, make(model.parameters()), storage, chunks=chunks, seed=seed)
    for g in grads or fixed_grads(steps):
        assert bool(step_with(opt, list(model.parameters()), g))
    return model, opt


def check_remainder_trajectory(make, steps, chunks):
    grads = fixed_grads(steps)
    ref_model, ref = train_fixed(None, make, steps, chunks, grads=grads)
    model, opt = train_fixed("remainder", make, steps, chunks, grads=grads)
    for want, got in zip(masters(ref), masters(opt), strict=True):
        assert torch.equal(bits(want), bits(got))  # the float32 masters, bit for bit
    for want, p in zip(masters(ref), model.parameters()):
        # The param is the master rounded to nearest; ties go away from zero (torch's
        # cast: to even): the two differ exactly where the master is a tie.
        hi, _ = R.split_remainder(want.numpy())
        assert (bits(p).numpy().view(np.uint16) == hi.reshape(p.shape)).all()
        tie = (want.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(p.detach()[~tie], want.bfloat16()[~tie])
    storage = opt._lowp.storage
    for (p, _), rem, want in zip(storage.pairs, storage.extra, masters(ref)):
        assert rem.dtype == torch.int16 and torch.equal(bits(rebuilt(p, rem)), bits(want))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("chunks", [1, 3])
def test_remainders_follow_float32_masters_bit_for_bit(name, chunks):
    check_remainder_trajectory(OPTIMIZERS[name], 50, chunks)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw-foreach", "sgd-momentum"])
def test_remainders_follow_float32_masters_over_1000_steps(name):
    check_remainder_trajectory(OPTIMIZERS[name], 1000, 2)


def test_ties_round_away_from_zero_and_keep_the_master_exact():
    model = net()
    with torch.no_grad():  # float32 values exactly halfway between two bfloat16 values
        w = model[0].weight
        w[0, :4] = torch.tensor([1.0 + 2**-8, -(1.0 + 2**-8), 1.0 + 3 * 2**-8, 0.5])
    want = model[0].weight.detach().clone()
    model_c, opt = convert(model, torch.optim.SGD(model.parameters(), lr=0.1), "remainder")
    got = model[0].weight.detach()[0, :4].float().tolist()
    assert got == [1.0 + 2**-7, -(1.0 + 2**-7), 1.0 + 2 * 2**-7, 0.5]  # ties away from 0
    assert torch.equal(bits(masters(opt)[0]), bits(want))


def test_stochastic_params_equal_the_reference_bits():
    # SGD at a power-of-two learning rate: its float32 update is exact, so the params
    # are what the shared rule gives (and what JAX gives) for this seed, step by step.
    lr, seed, steps = 2.0**-6, 1234, 100
    grads = fixed_grads(steps)
    model, opt = train_fixed("stochastic", lambda ps: torch.optim.SGD(ps, lr=lr), steps,
                             seed=seed, grads=grads)
    ref = [p.detach().float().numpy() for p in net().parameters()]  # the same start
    ref = [R.bits_f32(R.round_nearest_bf16(r).astype(np.uint32) << 16) for r in ref]
    for t, g in enumerate(grads):
        for i, (r, gi) in enumerate(zip(ref, g)):
            new = (r - np.float32(lr) * gi.float().numpy()).astype(np.float32)
            rand = R.random_bits(seed, 0, t, np.arange(new.size))
            ref[i] = R.bits_f32(R.stochastic_round_bf16(new.reshape(-1), rand)
                                .astype(np.uint32) << 16).reshape(r.shape)
    for p, r in zip(model.parameters(), ref):
        assert np.array_equal(p.detach().float().numpy().view(np.uint32), r.view(np.uint32))
    assert opt._lowp.step == steps


def _regression(storage, steps=300, plain=False):
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = torch.tanh(x @ torch.randn(16, 5)) + 0.05 * torch.randn(256, 5)
    model = net(seed=3)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    if plain:  # bfloat16 params stepped in bfloat16: no masters, no compensation
        model.bfloat16()
        inner = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
        for _ in range(steps):
            inner.zero_grad()
            torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
            inner.step()
    else:
        model_c, opt = convert(model, inner, storage)
        for _ in range(steps):
            opt.zero_grad()
            opt.backward(torch.nn.functional.mse_loss(model_c(x).float(), y))
            opt.step()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y))


def test_kahan_tracks_float32_masters_where_plain_bfloat16_stalls():
    ref = _regression(None)
    kahan = _regression("kahan")
    plain = _regression(None, plain=True)
    assert abs(kahan - ref) < 0.25 * abs(plain - ref), (ref, kahan, plain)
    assert abs(kahan - ref) / ref < 0.01


SKIP_CASES = [(s, st, "foreach", 1, float("inf"), "nearest")
              for s in ("remainder", "kahan", "stochastic")
              for st in (None, "bfloat16", "float8_e4m3fn")] + [
    (s, "bfloat16", "fused", 2, float("nan"), "nearest")
    for s in ("remainder", "kahan", "stochastic")] + [
    ("stochastic", "float8_e4m3fn", "foreach", 1, float("inf"), "stochastic"),
    ("stochastic", "float8_e5m2", "fused", 2, float("nan"), "stochastic")]


@pytest.mark.parametrize("storage, state, impl, chunks, bad_value, rounding", SKIP_CASES)
def test_a_skipped_step_changes_nothing_and_the_next_one_continues(storage, state, impl,
                                                                   chunks, bad_value,
                                                                   rounding):
    # The snapshot holds the params, remainders / compensation, every state tensor
    # (8-bit codes and their block scales) and the (seed, step) counter, bit for bit.
    def run(skip):
        model = net()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, **{impl: True})
        model_c, opt = convert(model, inner, storage, state, rounding=rounding, seed=7,
                               chunks=chunks)
        params = list(model.parameters())
        for t, g in enumerate(fixed_grads(4)):
            if t == 2 and skip:
                bad = [x.clone() for x in g]
                bad[1][3] = bad_value
                before = snapshot(model, opt)
                assert not bool(step_with(opt, params, bad))
                same(before, snapshot(model, opt))
            assert bool(step_with(opt, params, g))
        return snapshot(model, opt)

    same(run(False), run(True))


@pytest.mark.parametrize("storage", ["remainder", "kahan", "stochastic"])
@pytest.mark.parametrize("model_first", [True, False])
@pytest.mark.parametrize("fused", [False, True])  # True: through torch's fused kernel
def test_a_resumed_run_continues_bit_for_bit(storage, model_first, fused):
    grads = fixed_grads(6)

    def fresh(seed):
        model = net()
        model_c, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                        fused=fused),
                               storage, "bfloat16", rounding="stochastic", seed=seed)
        return model, opt

    model, opt = fresh(5)
    for g in grads[:3]:
        step_with(opt, list(model.parameters()), g)
    saved_model, saved_opt = round_trip(model.state_dict()), round_trip(opt.state_dict())
    for g in grads[3:]:
        step_with(opt, list(model.parameters()), g)
    model2, opt2 = fresh(6)  # the checkpoint's seed (5) is the run's
    if model_first:
        model2.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
    else:  # the optimizer's checkpoint rebuilds the masters; the model's then keeps them
        opt2.load_state_dict(saved_opt)
        model2.load_state_dict(saved_model)
    for g in grads[3:]:
        step_with(opt2, list(model2.parameters()), g)
    same(snapshot(model, opt), snapshot(model2, opt2))
    assert opt2._lowp.kernel_path == fused  # the loaded state took the fused path at once


def _corrupt_cases(sd):
    low = sd["low_precision"]
    yield "storage", {**low, "storage": "kahan"}, "stores its masters as 'remainder'"
    yield "step", {**low, "step": -1}, r"\['step'\]"
    yield "seed", {**low, "seed": 2**32}, r"\['seed'\]"
    yield "extra", {**low, "extra": [e.float() for e in low["extra"]]}, r"\['extra'\]\[0\]"
    yield "params", {**low, "params": low["params"][:-1]}, r"\['params'\]"
    nan = [p.clone() for p in low["params"]]
    nan[2][0, 0] = float("nan")
    yield "nan", {**low, "params": nan}, "inf/NaN"
    yield "missing", None, r"low_precision'\]` must be a dict"


@pytest.mark.parametrize("case", range(7))
def test_a_bad_checkpoint_is_refused_and_changes_nothing(case):
    model = net()
    model_c, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "remainder",
                           "bfloat16")
    for g in fixed_grads(2):
        step_with(opt, list(model.parameters()), g)
    sd = round_trip(opt.state_dict())
    step_with(opt, list(model.parameters()), fixed_grads(1, seed=9)[0])
    before = snapshot(model, opt)
    _, low, match = list(_corrupt_cases(sd))[case]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict({**sd, "low_precision": low})
    same(before, snapshot(model, opt))


def test_float32_master_checkpoints_and_stored_ones_do_not_mix():
    model = net()
    _, plain = convert(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model2 = net()
    _, stored = convert(model2, torch.optim.SGD(model2.parameters(), lr=0.1), "kahan")
    with pytest.raises(ValueError, match="low_precision"):
        stored.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="Convert the checkpoint"):
        plain.load_state_dict(stored.state_dict())


def test_model_writes_and_loads_move_the_stored_masters():
    model = net()
    model_c, opt = convert(model, torch.optim.SGD(model.parameters(), lr=0.1), "remainder")
    rem = opt._lowp.storage.extra
    for g in fixed_grads(2):
        step_with(opt, list(model.parameters()), g)
    assert any(bool(r.ne(0).any()) for r in rem)
    # A float32 checkpoint (e.g. pretrained weights) becomes the masters exactly.
    full = {k: torch.randn(v.shape) for k, v in model.state_dict().items()}
    model.load_state_dict(full)
    for want, got in zip(full.values(), masters(opt)):
        assert torch.equal(bits(want), bits(got))
    # A bfloat16 checkpoint equal to the params keeps the remainders ...
    kept = [r.clone() for r in rem]
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(a, b) for a, b in zip(kept, rem))
    # ... and a write from outside (a broadcast, an init) makes the param the master.
    with torch.no_grad():
        model[0].weight.mul_(2)
    step_with(opt, list(model.parameters()), [torch.zeros(s).bfloat16() for s in SHAPES])
    assert not bool(rem[0].ne(0).any())
    assert torch.equal(bits(masters(opt)[0]), bits(model[0].weight.float()))


@pytest.mark.parametrize("storage, state, rounding, target", [
    ("remainder", "bfloat16", "nearest", 8.1), ("kahan", "bfloat16", "nearest", 8.1),
    ("stochastic", "bfloat16", "stochastic", 6.1),
    ("stochastic", "float8_e4m3fn", "nearest", 4.1),
    ("stochastic", "float8_e4m3fn", "stochastic", 4.1), ("float32", None, "nearest", 14.1)])
def test_bytes_per_param_measured_from_the_buffers(storage, state, rounding, target):
    model = net(widths=(256, 512, 256))
    model_c, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           storage if storage != "float32" else None, state, rounding=rounding)
    n = sum(p.numel() for p in model.parameters())
    shapes = [p.shape for p in model.parameters()]
    step_with(opt, list(model.parameters()), fixed_grads(1, shapes)[0])
    per_param = persistent_bytes(opt, model) / n
    assert target - 0.15 < per_param <= target, per_param


def test_bad_arguments_are_clear_errors():
    model = net()
    _, opt = convert(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="`master_weights` must be one of .*'kahan'"):
        use_low_precision(opt, "kahn")
    with pytest.raises(ValueError, match="`seed`"):
        use_low_precision(opt, "kahan", seed=-1)
    with pytest.raises(ValueError, match="stochastic.*not float16.*'float16'"):
        use_low_precision(opt, "kahan", {"exp_avg": "float16"}, "stochastic")
    with pytest.raises(ValueError, match="float16 state for 'exp_avg_sq'"):
        use_low_precision(opt, "kahan", {"exp_avg": "float16", "exp_avg_sq": "float16"})
    adam = torch.optim.AdamW(net().parameters())
    with pytest.raises(ValueError, match="float16 state for 'exp_avg_sq'"):
        StateDtype(adam, "float16")  # refused before any step, not at the first
    StateDtype(torch.optim.SGD(net().parameters(), lr=0.1, momentum=0.9), "float16")
    assert not hasattr(opt, "_lowp") and opt._pairs[0][1].dtype == torch.float32  # untouched
    use_low_precision(opt, "kahan")
    with pytest.raises(ValueError, match="already"):
        use_low_precision(opt, "kahan")
    half = net()
    _, fp16, _ = mpfunc_torch.convert_to_amp(half, torch.optim.SGD(half.parameters(), lr=0.1),
                                             mode="naive")
    with pytest.raises(ValueError, match="keeps bfloat16 params; param 0 is torch.float16"):
        use_low_precision(fp16, "remainder")
    f32 = net()
    _, torch_mode, _ = mpfunc_torch.convert_to_amp(
        f32, torch.optim.SGD(f32.parameters(), lr=0.1), mode="torch")
    with pytest.raises(ValueError, match="no half params with masters"):
        use_low_precision(torch_mode, "stochastic")
    stepped = net()
    _, opt = convert(stepped, torch.optim.SGD(stepped.parameters(), lr=0.1, momentum=0.9))
    step_with(opt, list(stepped.parameters()), fixed_grads(1)[0])
    with pytest.raises(ValueError, match="already stepped"):
        use_low_precision(opt, "kahan")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("storage, state", [("remainder", None), ("kahan", "bfloat16"),
                                            ("stochastic", "bfloat16")])
def test_distributed_checkpoint_save_and_load_resume_bit_for_bit(storage, state, tmp_path):
    # torch.distributed.checkpoint in one process: the bf16 params in the model part, the
    # remainders or compensations in each param's state, the stored moments as stored,
    # the seed and step under "mpfunc"; a fresh run loads it and goes on exactly.
    import torch.distributed.checkpoint as dcp

    grads = fixed_grads(5)

    def run(seed):
        model = net(seed)
        _, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage, state,
                         "stochastic" if state else "nearest", seed=3)
        return model, opt

    model, opt = run(0)
    for g in grads[:3]:
        step_with(opt, list(model.parameters()), g)
    msd, osd = mpfunc_torch.get_state_dict(model, opt)
    assert osd["mpfunc"]["low_precision"] == {"storage": storage, "seed": 3, "step": 3}
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    model2, opt2 = run(1)  # other values everywhere, a fresh optimizer (no state yet)
    params, extra, _, counter = snapshot(model2, opt2)
    msd2, osd2 = mpfunc_torch.get_state_dict(model2, opt2)  # makes the state: lr 0
    same((params, extra, {}, counter), snapshot(model2, opt2)[:2] + ({}, counter))
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(tmp_path))
    mpfunc_torch.set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    same(snapshot(model2, opt2), snapshot(model, opt))
    for g in grads[3:]:
        step_with(opt, list(model.parameters()), g)
        step_with(opt2, list(model2.parameters()), g)
    same(snapshot(model2, opt2), snapshot(model, opt))


def test_distributed_checkpoint_functions_refuse_8bit_state_clearly():
    model = net()
    _, opt = convert(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                     "remainder", "float8_e4m3fn")
    with pytest.raises(ValueError, match="store their state in 8 bits.*cannot reshard"):
        mpfunc_torch.get_state_dict(model, opt)


@pytest.mark.parametrize("storage", ["remainder", "kahan", "stochastic"])
def test_clipping_reports_schedulers_and_chunks_work_on_stored_masters(storage):
    model = net()
    model_c, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage,
                           "bfloat16", chunks=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.zero_grad()
    opt.backward(model_c(torch.randn(8, 16)).float().square().mean())
    report = opt.precision_report()
    assert report.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert report.nonfinite_names() == []
    norm = opt.clip_grad_norm(1e-3)
    assert float(norm) > 1e-3
    before = [p.detach().clone() for p in model.parameters()]
    assert bool(opt.step())
    sched.step()
    assert opt.param_groups[0]["lr"] == 5e-3
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    print(opt.param_groups)  # a placeholder between steps prints (as NaN), safely
