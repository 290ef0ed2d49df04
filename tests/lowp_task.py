"""Shared helpers of the tests of storage without float32 masters (master_storage,
state_dtype, low_precision): a small net converted to bfloat16 params with float32
masters, switched to a storage, and trained on fixed gradients or fixed data."""

import io

import torch

import mpfunc_torch
from mpfunc_torch._src.low_precision import use_low_precision
from mpfunc_torch._src.rounding import join_remainder_
from mpfunc_torch._src.sharding import local

SHAPES = [(24, 16), (24,), (5, 24), (5,)]


def net(seed=0, widths=(16, 24, 5)):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def convert(model, opt, storage=None, state=None, rounding="nearest", seed=0, chunks=1,
            **low):
    """bfloat16 params with float32 masters (apex O2 with bfloat16, no loss scaling),
    then `use_low_precision` unless ``storage`` is None (float32 masters, as today)."""
    model, opt, _ = mpfunc_torch.convert_to_amp(
        model, opt, mode="apex", opt_level="O2", cast_model_type=torch.bfloat16,
        keep_batchnorm_fp32=False, loss_scale=1.0, verbosity=0, step_chunks=chunks)
    if storage is not None or state is not None:
        use_low_precision(opt, storage or "float32", state, rounding, seed=seed, **low)
    return model, opt


def fixed_grads(n, shapes=SHAPES, seed=1):
    """``n`` steps of bfloat16 gradients (so a param gets exactly them)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).bfloat16() for s in shapes] for _ in range(n)]


def step_with(opt, params, grads):
    """One step whose gradients are exactly ``grads`` (a backward of sum(p * g))."""
    opt.zero_grad()
    opt.backward(sum((p.float() * g.float().to(p.device)).sum() for p, g in zip(params, grads)))
    return opt.step()


def masters(opt):
    """The float32 masters (this rank's shards): stored ones rebuilt, float32 ones read."""
    lowp = getattr(opt, "_lowp", None)
    if lowp is None or lowp.storage is None:
        return [local(m).detach().clone() for _, m in opt._pairs]
    return [lowp.storage.master_value(i) for i in range(len(lowp.storage.pairs))]


def rebuilt(p, rem):
    out = torch.empty(p.shape)
    join_remainder_(out, p.detach(), rem)
    return out


def bits(t):
    t = local(t).detach()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]).clone()


def snapshot(model, opt):
    """Every value a step could change: params, remainders/compensation, optimizer
    state and the step counter, bit for bit."""
    lowp = getattr(opt, "_lowp", None)
    state = {id(q): {k: (bits(v) if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
             for q, st in opt.optimizer.state.items()}
    extra = [] if lowp is None or lowp.storage is None else [
        None if e is None else bits(e) for e in lowp.storage.extra]
    return ([bits(p) for p in model.parameters()], extra, state,
            None if lowp is None else (lowp.seed, lowp.step))


def same(a, b):
    pa, ea, sa, ca = a
    pb, eb, sb, cb = b
    assert ca == cb
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(ea, eb, strict=True))
    assert len(sa) == len(sb)
    for st_a, st_b in zip(sa.values(), sb.values(), strict=True):
        assert st_a.keys() == st_b.keys()
        for k in st_a:
            x, y = st_a[k], st_b[k]
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), k


def round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)
