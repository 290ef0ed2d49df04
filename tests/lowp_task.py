"""Shared helpers of the tests of storage without float32 masters (master_storage,
state_dtype, low_precision): a small net converted to bfloat16 params with float32
masters, switched to a storage, and trained on fixed gradients or fixed data."""

import io

import torch

import mpfunc_torch
from mpfunc_torch._src.fused import fused_adam_takes_state_of_another_dtype
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


def sharded_run(storage, rank, world, steps=4, bad_at=2, fused=False):
    """FSDP2 (``fully_shard``) training of `net` on fixed gradients, next to the same
    training unsharded in this process; an inf in the last rank's shard at ``bad_at``.
    Returns what differs (empty: the gathered params, remainders/compensation and
    state equal the unsharded ones bit for bit, and the overflow changed nothing).
    ``fused``: AdamW(fused=True), the sharded run through torch's fused kernel a chunk at
    a time (`mpfunc_torch._src.storage_kernels`), the unsharded one on the generic path."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = net()
    fully_shard(model)
    _, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused),
                     storage, "bfloat16", rounding="stochastic", seed=5)
    ref_model = net()
    _, ref = convert(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=fused),
                     storage, "bfloat16", rounding="stochastic", seed=5)
    ref._lowp.kernels = None
    problems = []
    for t, g in enumerate(fixed_grads(steps)):
        if t == bad_at:
            before = snapshot(model, opt)
            for p, gi in zip(model.parameters(), g):
                p.grad = distribute_tensor(gi, p.device_mesh, p.placements)
            if rank == world - 1:
                local(model[2].weight.grad)[-1, 0] = float("inf")
            opt.backward_done()
            if bool(opt.step()):
                problems.append("the overflow step was taken")
            try:
                same(before, snapshot(model, opt))
            except AssertionError as e:
                problems.append(f"the skipped step changed something: {e!r}")
        for p, gi in zip(model.parameters(), g):
            p.grad = distribute_tensor(gi, p.device_mesh, p.placements)
        opt.backward_done()
        opt.step()
        # (a DTensor's bfloat16 state takes the whole-tensor step where torch refuses it
        # beside float32 params, as 2.11 does)
        if (fused and t > 0 and fused_adam_takes_state_of_another_dtype()
                and not opt._lowp.kernel_path):
            problems.append(f"step {t} did not take the fused kernel path")
        step_with(ref, list(ref_model.parameters()), g)

    def full(t):  # gathered as float32 (exact for bfloat16 and int16: gloo has neither)
        t = t.detach().float()
        return bits(t.full_tensor()) if hasattr(t, "full_tensor") else bits(t)

    for name, a, b in [("params", model.parameters(), ref_model.parameters()),
                       ("extra", opt._lowp.storage.extra, ref._lowp.storage.extra)]:
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x is not None and not torch.equal(full(x), full(y)):
                problems.append(f"{name}[{i}] differs")
    for i, (st, rst) in enumerate(zip(opt.optimizer.state.values(), ref.optimizer.state.values())):
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(full(st[key]), full(rst[key])):
                problems.append(f"state[{i}][{key!r}] differs")
    return problems


def _fsdp_step(model, opt, g, bad=False):
    """One FSDP2 step on gradients ``g`` (whole tensors, sharded here); ``bad``: an inf in
    the last rank's shard of the last weight. Returns whether it stepped."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    for p, gi in zip(model.parameters(), g):
        p.grad = distribute_tensor(gi, p.device_mesh, p.placements)
    if bad and dist.get_rank() == dist.get_world_size() - 1:
        local(list(model.parameters())[-2].grad)[-1, 0] = float("inf")
    opt.backward_done()
    return bool(opt.step())


def fsdp_dcp_resume(storage, ckpt, state="bfloat16"):
    """FSDP2 training saved with torch.distributed.checkpoint after 3 steps, loaded into a
    differently initialised run, then 2 more steps of both: the loaded run equals the saved
    one bit for bit after the load and after the steps (raises AssertionError if not).
    Remainders and compensations are DTensors sharded like their params; the bfloat16
    state is saved as stored."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    def run(seed):
        model = net(seed)
        fully_shard(model)
        _, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage,
                         state, rounding="stochastic", seed=5)
        return model, opt

    grads = fixed_grads(5)
    model, opt = run(0)
    for g in grads[:3]:
        assert _fsdp_step(model, opt, g)
    msd, osd = mpfunc_torch.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt))
    model2, opt2 = run(1)
    msd2, osd2 = mpfunc_torch.get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(ckpt))
    mpfunc_torch.set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    same(snapshot(model2, opt2), snapshot(model, opt))
    for g in grads[3:]:
        assert _fsdp_step(model, opt, g) and _fsdp_step(model2, opt2, g)
    same(snapshot(model2, opt2), snapshot(model, opt))


def fsdp_8bit_run(steps=4, bad_at=2):
    """Stochastic params with 8-bit (e4m3, stochastically rounded) moments under FSDP2:
    each rank's codes and block scales are those of its own shard; an inf in the last
    rank's shard is skipped by every rank with everything bit for bit, and the params
    move and stay finite. Returns what went wrong (empty: nothing)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from _mpfunc_common.storage import STATE_BLOCK
    from mpfunc_torch._src.state_dtype import SCALE_SUFFIX

    model = net()
    fully_shard(model)
    _, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "stochastic",
                     "float8_e4m3fn", rounding="stochastic", seed=5)
    start = [p.detach().full_tensor().float().clone() for p in model.parameters()]
    problems = []
    for t, g in enumerate(fixed_grads(steps)):
        if t == bad_at:
            before = snapshot(model, opt)
            if _fsdp_step(model, opt, g, bad=True):
                problems.append("the overflow step was taken")
            try:
                same(before, snapshot(model, opt))
            except AssertionError as e:
                problems.append(f"the skipped step changed something: {e!r}")
        if not _fsdp_step(model, opt, g):
            problems.append(f"step {t} was skipped")
    for i, (p, p0) in enumerate(zip(model.parameters(), start)):
        full = p.detach().full_tensor().float()
        if not torch.isfinite(full).all() or torch.equal(full, p0):
            problems.append(f"param {i} is not finite or did not move")
    for q, st in opt.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            codes, scale = st[key], st[key + SCALE_SUFFIX]
            n = local(codes).numel()
            if local(codes).dtype != torch.float8_e4m3fn or local(scale).numel() != -(-n // STATE_BLOCK):
                problems.append(f"{key} of a {tuple(q.shape)} param on rank "
                                f"{dist.get_rank()}: {local(codes).dtype}, "
                                f"{local(scale).numel()} scales for {n} local elements")
    return problems
