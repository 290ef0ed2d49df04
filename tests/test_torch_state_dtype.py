"""mpfunc_torch._src.state_dtype: any torch.optim optimizer's state stored in bfloat16,
float16 or 8 bits between steps and stepped in float32."""

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
    round_trip,
    same,
    snapshot,
    step_with,
)

import mpfunc_torch
from _mpfunc_common import rounding as R
from mpfunc_torch._src.low_precision import use_low_precision

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_is_stored_small_and_stepped_in_float32(name):
    model = net()
    inner = OPTIMIZERS[name](model.parameters())
    seen = []
    inner.register_step_pre_hook(lambda o, *_: seen.append(
        {v.dtype for st in o.state.values() for v in st.values()
         if isinstance(v, torch.Tensor) and v.dim() > 0}))
    _, opt = convert(model, inner, "remainder", "bfloat16")
    for g in fixed_grads(3):
        assert bool(step_with(opt, list(model.parameters()), g))
        stored = {v.dtype for st in inner.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0}
        assert stored == {torch.bfloat16}
    assert all(s <= {torch.float32} for s in seen)  # the inner step saw float32 only


@pytest.mark.parametrize("name", ["adam", "sgd", "rmsprop"])
def test_nearest_state_is_a_float32_step_then_a_cast(name):
    grads = fixed_grads(20)
    model = net()
    _, opt = convert(model, OPTIMIZERS[name](model.parameters()), None, "bfloat16")
    ref_model = net()
    _, ref = convert(ref_model, OPTIMIZERS[name](ref_model.parameters()))
    for g in grads:
        step_with(opt, list(model.parameters()), g)
        step_with(ref, list(ref_model.parameters()), g)
        with torch.no_grad():  # the reference: float32 state, rounded after each step
            for st in ref.optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        v.copy_(v.bfloat16())
    for a, b in zip(masters(ref), masters(opt)):
        assert torch.equal(bits(a), bits(b))


def test_stochastic_state_uses_streams_by_key_name():
    # SGD (momentum 0.5, exact in float32) with bfloat16 momentum rounded
    # stochastically: its buffer is the shared rule's, stream 1, step by step.
    seed, steps = 99, 8
    grads = fixed_grads(steps)
    model = net()
    inner = torch.optim.SGD(model.parameters(), lr=2.0**-5, momentum=0.5)
    _, opt = convert(model, inner, None, "bfloat16", rounding="stochastic", seed=seed)
    ref = [None] * len(SHAPES)
    for t, g in enumerate(grads):
        step_with(opt, list(model.parameters()), g)
        for i, gi in enumerate(g):
            gi = gi.float().numpy().reshape(-1)
            buf = gi if ref[i] is None else (ref[i] * np.float32(0.5)).astype(np.float32) + gi
            rand = R.random_bits(seed, 1, t, np.arange(buf.size))
            ref[i] = R.bits_f32(R.stochastic_round_bf16(buf, rand).astype(np.uint32) << 16)
    bufs = [st["momentum_buffer"] for st in inner.state.values()]
    for b, r in zip(bufs, ref):
        assert b.dtype == torch.bfloat16
        assert np.array_equal(b.float().numpy().reshape(-1).view(np.uint32), r.view(np.uint32))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_stochastic_8bit_state_is_the_shared_rule_step_by_step(fmt):
    # SGD (momentum 0.5, exact in float32) with 8-bit momentum rounded stochastically:
    # each step dequantises, steps in float32 and quantises with stream 1's bits, and
    # the codes and block scales are the NumPy reference's (blocks of 128, a last
    # partial one) at every step.
    seed, steps = 41, 6
    model = net(widths=(16, 20, 5))  # 320, 20, 100, 5 elements
    shapes = [p.shape for p in model.parameters()]
    inner = torch.optim.SGD(model.parameters(), lr=2.0**-5, momentum=0.5)
    _, opt = convert(model, inner, None, fmt, rounding="stochastic", seed=seed, block=128)
    ref = [None] * len(shapes)
    for t, g in enumerate(fixed_grads(steps, shapes)):
        step_with(opt, list(model.parameters()), g)
        for i, gi in enumerate(g):
            gi = gi.float().numpy()
            buf = gi if ref[i] is None else (R.dequantize_state_8bit(*ref[i]) * np.float32(0.5)
                                             ).astype(np.float32) + gi
            ref[i] = R.quantize_state_8bit(buf, fmt, R.random_bits(seed, 1, t,
                                                                   np.arange(buf.size)))
        for st, (q, scale) in zip(inner.state.values(), ref):
            got = st["momentum_buffer"]
            assert got.dtype == getattr(torch, fmt)
            assert np.array_equal(got.float().numpy().view(np.uint32), q.view(np.uint32))
            assert np.array_equal(st["momentum_buffer:scale"].numpy().view(np.uint32),
                                  scale.view(np.uint32))


def test_eight_bit_state_has_block_scales_and_tracks_float32_state():
    model = net(widths=(16, 300, 5))  # 4800 and 1500 elements: a last, partial block
    _, opt = convert(model, torch.optim.Adam(model.parameters(), lr=1e-3), "stochastic",
                     "float8_e4m3fn", block=256)
    ref_model = net(widths=(16, 300, 5))
    _, ref = convert(ref_model, torch.optim.Adam(ref_model.parameters(), lr=1e-3), "stochastic")
    shapes = [p.shape for p in model.parameters()]
    for g in fixed_grads(1, shapes):
        step_with(opt, list(model.parameters()), g)
        step_with(ref, list(ref_model.parameters()), g)
    for st, rst, p in zip(opt.optimizer.state.values(), ref.optimizer.state.values(),
                          model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].dtype == torch.float8_e4m3fn and st[key].shape == p.shape
            scale = st[key + ":scale"]
            assert scale.dtype == torch.float32 and scale.numel() == -(-p.numel() // 256)
            got = mpfunc_torch.dequantize_fp8(st[key].reshape(-1), scale.reshape(1, -1),
                                              (1, 256))
            want = rst[key].reshape(-1)
            # e4m3 keeps 3 mantissa bits: within 1/16 of each block's largest value
            blocks = torch.nn.functional.pad(want.abs(), (0, -want.numel() % 256))
            top = blocks.reshape(-1, 256).amax(1).repeat_interleave(256)[:want.numel()]
            assert bool(((got - want).abs() <= top / 16).all()), key


@pytest.mark.parametrize("storage, state, rounding", [
    ("kahan", "bfloat16", "nearest"), ("kahan", "float8_e5m2", "nearest"),
    ("kahan", {"exp_avg": "float16", "exp_avg_sq": "bfloat16"}, "nearest"),
    ("stochastic", "float8_e4m3fn", "stochastic"), ("remainder", "float8_e5m2", "stochastic")])
def test_state_checkpoints_resume_bit_for_bit(storage, state, rounding):
    grads = fixed_grads(6)

    def fresh():
        model = net()
        _, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage, state,
                         rounding=rounding, seed=13)
        return model, opt

    model, opt = fresh()
    for g in grads[:3]:
        step_with(opt, list(model.parameters()), g)
    saved = round_trip(opt.state_dict()), round_trip(model.state_dict())
    for g in grads[3:]:
        step_with(opt, list(model.parameters()), g)
    model2, opt2 = fresh()
    opt2.load_state_dict(saved[0])
    model2.load_state_dict(saved[1])
    for g in grads[3:]:
        step_with(opt2, list(model2.parameters()), g)
    same(snapshot(model, opt), snapshot(model2, opt2))


def test_a_float32_state_loads_once_rounded_and_bad_scales_are_refused():
    model = net()
    _, plain = convert(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    step_with(plain, list(model.parameters()), fixed_grads(1)[0])
    model2 = net()
    _, opt = convert(model2, torch.optim.Adam(model2.parameters(), lr=1e-2), None,
                     "float8_e4m3fn")
    opt.load_state_dict(plain.optimizer.state_dict())  # a plain torch state_dict
    st = next(iter(opt.optimizer.state.values()))
    assert st["exp_avg"].dtype == torch.float8_e4m3fn and "exp_avg:scale" in st
    step_with(opt, list(model2.parameters()), fixed_grads(1)[0])
    sd = round_trip(opt.state_dict())
    before = snapshot(model2, opt)
    bad = {**sd, "optimizer": {**sd["optimizer"], "state": {
        k: {**v, "exp_avg:scale": v["exp_avg:scale"][:1]} for k, v in sd["optimizer"]["state"].items()}}}
    with pytest.raises(ValueError, match=r"exp_avg:scale'\]` must hold \d+ scales"):
        opt.load_state_dict(bad)
    same(before, snapshot(model2, opt))


def test_chunked_steps_equal_one_step():
    grads = fixed_grads(5)
    out = []
    for chunks in (1, 3):
        model = net()
        _, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "stochastic",
                         "bfloat16", rounding="stochastic", seed=3, chunks=chunks)
        for g in grads:
            step_with(opt, list(model.parameters()), g)
        out.append(snapshot(model, opt))
    same(*out)


@pytest.mark.parametrize("fused", [False, True])
def test_float32_params_with_bfloat16_state_skip_exactly(fused):
    model = net()
    model_c, opt, _ = mpfunc_torch.convert_to_amp(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused), mode="torch")
    use_low_precision(opt, "float32", "bfloat16")
    params = list(model.parameters())
    x = torch.randn(4, 16)
    for t in range(3):
        opt.zero_grad()
        opt.backward(model_c(x).float().square().mean())
        if t == 1:
            params[0].grad[0, 0] = float("nan")
            before = snapshot(model, opt)
            assert not bool(opt.step())
            same(before, snapshot(model, opt))
        else:
            assert bool(opt.step())
    assert all(v.dtype == torch.bfloat16 for st in opt.optimizer.state.values()
               for k, v in st.items() if k != "step")
    assert opt._lowp.step == 2


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_an_empty_param_gets_empty_8bit_state(rounding):
    # A zero-element param (an empty embedding, a pruned layer) has zero-element state:
    # no codes, no blocks. Nearest rounding failed in the blockwise quantiser's reshape.
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 0))
    _, opt = convert(model, torch.optim.Adam(model.parameters(), lr=1e-3), "remainder",
                     "float8_e4m3fn", rounding)
    params = list(model.parameters())
    grads = [torch.ones(p.shape, dtype=torch.bfloat16) for p in params]
    before = [p.detach().clone() for p in params]
    for _ in range(2):
        assert bool(step_with(opt, params, grads))
    empty = [st for p, st in zip(params, opt.optimizer.state.values()) if p.numel() == 0]
    assert empty and all(st["exp_avg"].numel() == 0 and st["exp_avg:scale"].numel() == 0
                         for st in empty)
    assert all(not torch.equal(p, b) for p, b in zip(params, before) if p.numel())
