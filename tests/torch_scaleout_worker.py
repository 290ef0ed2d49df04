"""One rank of the scale-out tests (FSDP2, DTensor TP, hand-split TP, pipelining, DCP).

Usage: python torch_scaleout_worker.py {two,four} RANK WORLD_SIZE PORT OUTDIR
Writes OUTDIR/SCENARIO-RANK.pt: {section: {run name: {"report": [(stepped, scale,
norm)], "losses": [...], "params": {name: float32 tensor} (full values; per stage for
pipelines), ...}}} and prints "RESULT ok".
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import torch_scaleout_models as tm  # noqa: E402

import mpfunc_torch  # noqa: E402
from mpfunc_torch._src.sharding import is_dtensor, local, local_bytes  # noqa: E402

scenario, rank, world, port, outdir = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                       sys.argv[4], Path(sys.argv[5]))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
torch.set_num_threads(1)
results = {}
STEPS = 3


def fsdp_mod():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    return fully_shard, MixedPrecisionPolicy


def mesh_1d(n=None):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (n or world,))


def policy_for(label):
    """The MixedPrecisionPolicy a user would pair with each mode."""
    _, MP = fsdp_mod()
    if label in ("torch", "O1"):
        return MP(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if label == "bf16":
        return MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MP(reduce_dtype=torch.float32)  # float16 params already: reduce in float32


def shard(net, mesh, label, policy=None):
    """fully_shard each block (and, for O2, each float32 norm in a unit of its own)."""
    fully_shard, MP = fsdp_mod()
    kw = {"mp_policy": policy} if policy is not None else {}
    norm_kw = {"mp_policy": MP(reduce_dtype=torch.float32)} if policy is not None else {}
    for b in net.blocks:
        if label == "O2":
            fully_shard(b.ln1, mesh=mesh, **norm_kw)
            fully_shard(b.ln2, mesh=mesh, **norm_kw)
        fully_shard(b, mesh=mesh, **kw)
    if label == "O2":
        fully_shard(net.ln, mesh=mesh, **norm_kw)
    fully_shard(net, mesh=mesh, **kw)
    return net


def convert(net, label, fused=False, **kw):
    mode, cfg = tm.MODE[label]
    opt = tm.make_optimizer(net.parameters(), label, fused)
    return mpfunc_torch.convert_to_amp(net, opt, tm.loss_fn, mode=mode, **cfg, **kw)


def inject(params):
    """An inf in this rank's shard of the first param that has a gradient here."""
    for p in params:
        if p.grad is not None and local(p.grad).numel():
            local(p.grad).view(-1)[0] = float("inf")
            return
    raise AssertionError("no gradient to inject into")


def snapshot(opt):
    """This rank's shards of the model params, masters and optimizer state."""
    tensors = [t for p, m in opt._pairs for t in (p, m)] + list(opt._owned)
    tensors += [v for st in opt.optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]
    return [local(t).detach().clone() for t in tensors]


def unchanged(before, opt):
    return all(torch.equal(a, b) for a, b in zip(before, snapshot(opt)))


def train(model, opt, crit, rows, *, clip=None, steps=range(STEPS), inject_rank=None,
          inject_params=None, skips=None):
    """Steps of training; at INJECT_STEP an inf goes into rank ``inject_rank``'s shard of
    ``inject_params``, and ``skips`` (a list) records whether this rank's params, masters
    and optimizer state came out of that step bit for bit unchanged."""
    report, losses = [], []
    for i in steps:
        x, y = tm.batch(i)
        x, y = x[rows], y[rows]
        opt.zero_grad()
        loss = crit(model(x), y)
        opt.backward(loss)
        before = snapshot(opt) if i == tm.INJECT_STEP else None
        if i == tm.INJECT_STEP and rank == inject_rank:
            inject(inject_params)
        norm = float(opt.clip_grad_norm(clip)) if clip is not None else None
        report.append((bool(opt.step()), float(opt.loss_scale), norm))
        losses.append(float(loss.detach()))
        if before is not None and skips is not None:
            skips.append(unchanged(before, opt))
    return report, losses


def full_state(net, opt):
    return tm.full_params(net, opt)  # full_tensor() is a collective: every rank calls it


def masters_bytes(opt):
    masters = [m for _, m in opt._pairs]
    return {"masters_local": local_bytes(masters),
            "params_local": local_bytes([p for p, _ in opt._pairs]),
            "masters_full": sum(m.numel() * m.element_size() for m in masters)}


# -- FSDP2 -------------------------------------------------------------------------------

def fsdp_runs(labels):
    mesh = mesh_1d()
    rows = slice(rank * tm.BATCH // world, (rank + 1) * tm.BATCH // world)
    for label in labels:
        for with_policy in (False, True):
            net = shard(tm.make_model(), mesh, label, policy_for(label) if with_policy else None)
            # Without a policy: non-fused optimizer and global clipping. With one: the
            # fused optimizer (its kernel skips), no clipping.
            fused = with_policy and label != "O3"
            model, opt, crit = convert(net, label, fused=fused)
            skips = []
            report, losses = train(model, opt, crit, rows, inject_rank=world - 1,
                                   clip=None if with_policy else tm.CLIP, skips=skips,
                                   inject_params=list(net.blocks[0].fc1.parameters()))
            key = f"{label}{'+policy' if with_policy else ''}"
            results[key] = {"report": report, "losses": losses, "skip_exact": skips,
                            "params": full_state(net, opt),
                            "dtypes": sorted({str(p.dtype) for p in net.parameters()}),
                            "local_dtypes": sorted({str(local(p).dtype)
                                                    for p in net.parameters()}),
                            "all_dtensor": all(is_dtensor(p) for p in net.parameters())}
            if opt._pairs:
                results[key].update(masters_bytes(opt))


def chunk_runs():
    """naive, O2, naive with its clip_grad key, and with clip_grad and
    log_num_zeros_in_grad, under FSDP2, with ``step_chunks`` 1 and 3, an inf in the last
    rank's shard at the inject step: the chunked step must decide and take every step as
    the unchunked one, bit for bit (the clipping norm and the zero count too)."""
    mesh = mesh_1d()
    rows = slice(rank * tm.BATCH // world, (rank + 1) * tm.BATCH // world)
    for label, kw in (("naive", {}), ("O2", {}), ("naive-clip", {"clip_grad": tm.CLIP}),
                      ("naive-zeros", {"clip_grad": tm.CLIP, "log_num_zeros_in_grad": True})):
        for k in (1, 3):
            net = shard(tm.make_model(), mesh, label.split("-")[0])
            model, opt, crit = convert(net, label.split("-")[0], step_chunks=k, **kw)
            calls = []
            real = opt.optimizer.step
            opt.optimizer.step = lambda *a, _r=real, _c=calls, **kw: (_c.append(1), _r(*a, **kw))[1]
            skips = []
            report, losses = train(model, opt, crit, rows, inject_rank=world - 1, skips=skips,
                                   inject_params=list(net.blocks[0].fc1.parameters()))
            results[f"{label}-chunks{k}"] = {
                "report": report, "losses": losses, "skip_exact": skips, "calls": len(calls),
                "grad_norm": opt.grad_norm,
                "zeros": None if opt.num_zeros_in_grad is None else int(opt.num_zeros_in_grad),
                "params": full_state(net, opt),
                # in param order: a chunked step creates the state in chunk order
                "snapshot": [local(t).detach().clone() for q in opt._owned
                             for t in [q, *opt.optimizer.state[q].values()]
                             if isinstance(t, torch.Tensor)]}


def o2_unit_error():
    """apex O2 keeps norms float32; a norm inside a float16 fully_shard unit is refused."""
    net = tm.make_model()
    for b in net.blocks:
        fsdp_mod()[0](b, mesh=mesh_1d())
    try:
        convert(net, "O2")
        results["o2_unit_error"] = None
    except ValueError as e:
        results["o2_unit_error"] = str(e)


def fsdp_orders():
    """issue 14's order question for FSDP2: fully_shard then convert_to_amp is the order
    fsdp_runs trains with; convert_to_amp then fully_shard leaves the optimizer over the
    replaced params, and the first forward must refuse it naming the right order."""
    mesh = mesh_1d()
    out = {}
    for label in ("torch", "O2", "naive"):
        net = tm.make_model()
        model, opt, crit = convert(net, label)
        before = [p for p in net.parameters()]
        shard(net, mesh, "torch")  # one unit per block, whatever the dtypes
        x, y = tm.batch(0)
        try:
            opt.backward(crit(model(x), y))
            out[label] = {"error": None}
        except ValueError as e:
            out[label] = {"error": str(e)}
        out[label]["untouched"] = all(not is_dtensor(p) for p in before)
    results["orders"] = out


DCP_MODES = ("naive", "torch", "O2", "bf16")  # masters or not, scaled or not


def dcp_run(ckpt, label="naive", fused=False):
    """``label`` under FSDP2: train, save with DCP, train on; then fresh objects load the
    checkpoint and must train on identically. naive's result is also the checkpoint the
    4-rank run reshards. ``fused``: fused AdamW, whose state mixes DTensors (moments)
    and plain tensors (the step count)."""
    import torch.distributed.checkpoint as dcp

    mesh = mesh_1d()
    rows = slice(rank * tm.BATCH // world, (rank + 1) * tm.BATCH // world)
    kw = {"growth_interval": 2} if label in ("naive", "torch") else {}

    def build():
        net = shard(tm.make_model(), mesh, label)
        model, opt, crit = convert(net, label, fused=fused, **kw)
        return net, model, opt, crit

    net, model, opt, crit = build()
    train(model, opt, crit, rows, inject_rank=world - 1,
          inject_params=list(net.blocks[0].fc1.parameters()))
    msd, osd = mpfunc_torch.get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt))
    saved = full_state(net, opt)
    saved_scale = opt.scale_metrics(as_python=True)
    after = train(model, opt, crit, rows, steps=range(STEPS, STEPS + 2))
    after_params = full_state(net, opt)

    net2, model2, opt2, crit2 = build()
    fresh = full_state(net2, opt2)
    model_params = lambda: {n: (p.full_tensor() if hasattr(p, "full_tensor") else p)  # noqa: E731
                            .detach().clone() for n, p in net2.named_parameters()}
    fresh_model = model_params()  # the model's own (half) params, not the masters
    msd2, osd2 = mpfunc_torch.get_state_dict(net2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(ckpt))
    untouched = full_state(net2, opt2)  # dcp.load filled a snapshot, nothing else
    untouched_model = model_params()
    mpfunc_torch.set_state_dict(net2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    loaded = full_state(net2, opt2)
    loaded_scale = opt2.scale_metrics(as_python=True)
    again = train(model2, opt2, crit2, rows, steps=range(STEPS, STEPS + 2))
    key = f"dcp-{label}-adamw" if fused else "dcp" if label == "naive" else f"dcp-{label}"
    results[key] = {
        "saved": saved, "saved_scale": saved_scale, "after": after, "after_params": after_params,
        "loaded": loaded, "loaded_scale": loaded_scale, "again": again,
        "again_params": full_state(net2, opt2),
        "untouched_equal_fresh": all(torch.equal(fresh[k], untouched[k]) for k in fresh),
        "untouched_model_equal_fresh": all(torch.equal(fresh_model[k], untouched_model[k])
                                           for k in fresh_model)}


def zeros_run():
    """naive's num_zeros_in_grad under FSDP2: every rank's shard counted once, the same
    total on every rank (Megatron reduces it over the model-parallel group)."""
    mesh = mesh_1d()
    rows = slice(rank * tm.BATCH // world, (rank + 1) * tm.BATCH // world)
    net = shard(tm.make_model(), mesh, "naive")
    model, opt, crit = convert(net, "naive", log_num_zeros_in_grad=True)
    x, y = tm.batch(0)
    opt.zero_grad()
    opt.backward(crit(model(x[rows]), y[rows]))
    opt.unscale_()
    for i, q in enumerate(opt._owned[:3]):  # known zeros, a different number per rank
        local(q.grad).view(-1)[: 5 * (rank + 1) + i] = 0
    grads = [q.grad for q in opt._owned if q.grad is not None]
    mine = sum(int((local(g) == 0).sum()) for g in grads)
    expected = sum(int((g.full_tensor() == 0).sum()) for g in grads)  # collectives
    opt.step()
    results["zeros"] = {"reported": int(opt.num_zeros_in_grad), "expected": expected,
                        "local": mine}


def reshard_run(ckpt):
    """Load the 2-rank checkpoint on this world (4 ranks) and train on."""
    import torch.distributed.checkpoint as dcp

    mesh = mesh_1d()
    rows = slice(rank * tm.BATCH // world, (rank + 1) * tm.BATCH // world)
    net = shard(tm.make_model(), mesh, "naive")
    model, opt, crit = convert(net, "naive", growth_interval=2)
    msd, osd = mpfunc_torch.get_state_dict(net, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(ckpt))
    mpfunc_torch.set_state_dict(net, opt, model_state_dict=msd, optim_state_dict=osd)
    loaded = full_state(net, opt)
    scale = opt.scale_metrics(as_python=True)
    after = train(model, opt, crit, rows, steps=range(STEPS, STEPS + 2))
    results["reshard"] = {"loaded": loaded, "loaded_scale": scale, "after": after,
                          "after_params": full_state(net, opt), **masters_bytes(opt)}


def single_rank_bytes():
    """N = 1 for the memory comparison: FSDP2 over a mesh of this rank alone."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates each group
    mesh = DeviceMesh.from_group(groups[rank], "cpu")
    net = shard(tm.make_model(), mesh, "naive")
    _, opt, _ = convert(net, "naive")
    results["naive-n1"] = masters_bytes(opt)


# -- tensor parallelism ------------------------------------------------------------------

def tp_runs(two_d):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    if two_d:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        rows = slice(dp_rank * tm.BATCH // 2, (dp_rank + 1) * tm.BATCH // 2)
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        rows = slice(None)
    for label, _, _ in tm.MODES:
        net = tm.make_model()
        for b in net.blocks:
            parallelize_module(b, mesh["tp"], tm.tp_plan())
        if two_d:
            shard(net, mesh["dp"], label)
        model, opt, crit = convert(net, label)
        skips = []
        report, losses = train(model, opt, crit, rows, clip=tm.CLIP, inject_rank=world - 1,
                               inject_params=[net.blocks[0].fc1.weight], skips=skips)
        results[label] = {"report": report, "losses": losses, "params": full_state(net, opt),
                          "skip_exact": skips,
                          "groups": len(opt._groups)}


def dtensor_handler_control():
    """What the explicit reduction is for: given DTensor gradients, torch's own handler
    for the fused check all-reduces found_inf only along the mesh dims where the *first*
    gradient is not replicated. On a (dp, tp) mesh with a tp-replicated bias first, an inf
    in one tp rank's shard of a tp-split weight stays on its dp column."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from mpfunc_torch._src import fused
    from mpfunc_torch._src.sharding import mesh_groups

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    net = tm.make_model()
    for b in net.blocks:
        parallelize_module(b, mesh["tp"], tm.tp_plan())
    shard(net, mesh["dp"], "torch")
    x, y = tm.batch(0)
    tm.loss_fn(net(x), y).backward()
    grads = [net.blocks[0].o.bias.grad, net.blocks[0].fc1.weight.grad]
    if rank == world - 1:
        local(grads[1]).view(-1)[0] = float("inf")
    theirs = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(grads, theirs, torch.ones(()))
    ours = torch.zeros(())
    fused.unscale_and_check_(grads, ours, torch.ones(()))
    for g in mesh_groups(net.parameters()):
        dist.all_reduce(ours, op=dist.ReduceOp.MAX, group=g)
    results["handler"] = {"torch_found_inf": float(theirs), "ours_found_inf": float(ours),
                          "first_placements": str(grads[0].placements)}


# -- hand-split (Megatron) tensor parallelism ----------------------------------------------

def megatron_runs(groups_for):
    """``groups_for`` -> (tp group, tp rank, tp size, process_group for convert_to_amp)."""
    tp, tp_rank, tp_size, pg = groups_for()
    for label, _, _ in tm.MODES:
        net = tm.megatron_split(tm.make_model(), tp_rank, tp_size, tp)
        model, opt, crit = convert(net, label, process_group=pg)
        skips = []
        report, losses = train(model, opt, crit, slice(None), clip=tm.CLIP,
                               inject_rank=world - 1, skips=skips,
                               inject_params=[net.blocks[0].fc1.weight])
        master_of = {id(p): m for p, m in opt._pairs}
        values = {n: master_of.get(id(p), p) for n, p in net.named_parameters()}
        results[label] = {"report": report, "losses": losses, "skip_exact": skips,
                          "params": gather_named(values, tp, tp_size)}
    # The control: torch's per-rank clip_grad_norm_ on the same split, in float32.
    net = tm.megatron_split(tm.make_model(), tp_rank, tp_size, tp)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for i in range(STEPS):
        x, y = tm.batch(i)
        opt.zero_grad()
        tm.loss_fn(net(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), tm.CLIP)))
        opt.step()
    results["torch_clip_per_rank"] = {"norms": norms,
                                      "params": gather_named(dict(net.named_parameters()),
                                                             tp, tp_size)}


def gather_named(values, group, size):
    """name -> the unsplit float32 value of a hand-split param (collective over group)."""
    out = {}
    for name, t in values.items():
        t = t.detach().float().contiguous()
        dim = _split_dim(name)
        if dim is None:
            out[name] = t.clone()
            continue
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
        out[name] = torch.cat(parts, dim)
    return out


def _split_dim(name):
    if any(f".{m}." in name for m in ("q", "k", "v", "fc1")):
        return 0
    if name.endswith(("o.weight", "fc2.weight")):
        return 1
    return None


# -- pipelining --------------------------------------------------------------------------

def pipeline_runs(tp_size):
    """2 stages (GPipe, 2 microbatches); with tp_size 2 each stage is also split by hand
    over a tensor-parallel pair: ranks (stage, tp) = (r // tp_size, r % tp_size)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage, tp_rank = rank // tp_size, rank % tp_size
    tp_groups = [dist.new_group([s * tp_size + t for t in range(tp_size)]) for s in range(2)]
    pp_groups = [dist.new_group([t, tp_size + t]) for t in range(tp_size)]
    tp, pp = tp_groups[stage], pp_groups[tp_rank]
    labels = ([lab for lab, _, _ in tm.MODES] + ["fp8"] if tp_size == 1
              else ["torch", "O2", "naive"])
    for label in labels:
        full = tm.make_model()
        if tp_size > 1:
            full = tm.megatron_split(full, tp_rank, tp_size, tp)
        part = tm.FirstStage(full) if stage == 0 else tm.LastStage(full)
        groups = [pp] if tp_size == 1 else [tp, pp]
        if label == "fp8":  # the stages hold different layers: no amax reduction
            other = tm.LastStage(tm.make_model())
            try:
                mpfunc_torch.convert_to_amp(other, tm.make_optimizer(other.parameters(), label),
                                            mode="fp8", recipe="delayed", process_group=groups)
                results["fp8_pipeline_error"] = None
            except ValueError as e:
                results["fp8_pipeline_error"] = str(e)
            model, opt, crit = mpfunc_torch.convert_to_amp(
                part, tm.make_optimizer(part.parameters(), label), tm.loss_fn, mode="fp8",
                recipe="delayed", process_group=groups, fp8_amax_group=())
        else:
            model, opt, crit = convert(part, label, process_group=groups)
        pipe = PipelineStage(model, stage, 2, torch.device("cpu"), group=pp)
        sched = ScheduleGPipe(pipe, n_microbatches=2,
                              loss_fn=lambda out, y, opt=opt, crit=crit:
                              opt.scale_loss(crit(out, y)))
        report, losses, skips = [], [], []
        for i in range(STEPS):
            x, y = tm.batch(i)
            opt.zero_grad()
            mb_losses = []
            if stage == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=mb_losses)
            opt.backward_done()  # the schedule ran the scaled backward
            before = snapshot(opt) if i == tm.INJECT_STEP else None
            if i == tm.INJECT_STEP and rank == world - 1:
                inject([part.block.fc1.weight])  # split, not replicated, over tp
            norm = float(opt.clip_grad_norm(tm.CLIP))
            used = float(opt.loss_scale)  # the scale this step's losses were scaled by
            report.append((bool(opt.step()), float(opt.loss_scale), norm))
            if before is not None:
                skips.append(unchanged(before, opt))
            if mb_losses:  # the microbatches' scaled losses: their mean, unscaled
                losses.append(float(sum(mb_losses) / len(mb_losses)) / used)
        master_of = {id(p): m for p, m in opt._pairs}
        values = {tm.stage_names(stage, n): master_of.get(id(p), p)
                  for n, p in part.named_parameters()}
        params = (gather_named(values, tp, tp_size) if tp_size > 1
                  else {n: t.detach().float().clone() for n, t in values.items()})
        results[label] = {"report": report, "losses": losses, "params": params,
                          "skip_exact": skips}


ALL = [label for label, _, _ in tm.MODES]
SECTIONS = {
    # 2 ranks: every mode under FSDP2, DCP save / reload and the N = 1 bytes; DTensor TP;
    # the Megatron split; 2 pipeline stages.
    "two": [("fsdp", lambda: (fsdp_runs(ALL), o2_unit_error(), fsdp_orders(),
                              [dcp_run(outdir / ("ckpt" if m == "naive" else f"ckpt-{m}"), m)
                               for m in DCP_MODES],
                              [dcp_run(outdir / f"ckpt-{m}-adamw", m, fused=True)
                               for m in ("naive", "torch")], single_rank_bytes(), zeros_run(),
                              chunk_runs())),
            ("tp", lambda: tp_runs(two_d=False)),
            ("megatron", lambda: megatron_runs(
                lambda: (dist.group.WORLD, rank, world, dist.group.WORLD))),
            ("pipeline", lambda: pipeline_runs(tp_size=1))],
    # 4 ranks: FSDP2 in two modes and the 2-rank checkpoint resharded; FSDP2 + TP on a
    # 2 x 2 mesh; 2 pipeline stages of 2 hand-split tensor-parallel ranks.
    "four": [("fsdp", lambda: (fsdp_runs(["naive", "torch"]), reshard_run(outdir / "ckpt"))),
             ("fsdp_tp", lambda: (tp_runs(two_d=True), dtensor_handler_control())),
             ("pipeline", lambda: pipeline_runs(tp_size=2))],
}
# One launch runs several sections: starting the processes (importing torch) costs more
# than the runs themselves.
everything = {}
only = os.environ.get("SCALEOUT_SECTIONS")  # for debugging: a comma-separated subset
for section, run in SECTIONS[scenario]:
    if only and section not in only.split(","):
        continue
    results = everything[section] = {}
    run()
results = everything
torch.save(results, outdir / f"{scenario}-{rank}.pt")
print("RESULT ok", flush=True)
dist.barrier()
dist.destroy_process_group()
