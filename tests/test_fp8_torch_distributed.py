"""fp8 amaxes MAX-reduced over 2 real gloo ranks (each rank runs this file as a script)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(grouped):
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), port, str(grouped)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stderr[-3000:]
            line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
            out.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sorted(out, key=lambda d: d["rank"])


def test_every_rank_records_the_same_amax_history():
    r0, r1 = launch(grouped=True)
    assert r0["delayed"] == r1["delayed"]  # histories and scales, bit for bit
    # ... and they are the max over the ranks' own amaxes (rank 1's inputs are 4x).
    hist = r0["delayed"]["fp8_amax_history_input"]
    assert hist[:3] == [max(a, b) for a, b in zip(r0["local_amax"][::-1], r1["local_amax"][::-1])]
    assert r0["tensorwise_scale"] == r1["tensorwise_scale"] == 448.0 / 4.0


def test_without_a_group_the_ranks_diverge():
    r0, r1 = launch(grouped=False)
    assert r0["delayed"]["fp8_amax_history_input"] != r1["delayed"]["fp8_amax_history_input"]
    assert r0["tensorwise_scale"] == 448.0 and r1["tensorwise_scale"] == 448.0 / 4.0


def test_ddp_amax_group_keeps_the_clipping_norm_right():
    # The amax group (data parallel) is its own argument: every rank gets the same fp8
    # histories, and clip_grad_norm still sees DDP's averaged gradients once. Naming the
    # data-parallel group in `process_group` instead counts them once per rank (sqrt 2).
    r0, r1 = launch("ddp")
    for r in (r0, r1):
        assert r["amax_group"]["norm"] == pytest.approx(r["amax_group"]["local_norm"], rel=1e-6)
        assert r["process_group"]["norm"] == pytest.approx(
            r["process_group"]["local_norm"] * 2**0.5, rel=1e-6)
    assert r0["amax_group"]["histories"] == r1["amax_group"]["histories"]
    assert r0["amax_group"]["norm"] == r1["amax_group"]["norm"]
    hist = r0["amax_group"]["histories"]["0.fp8_amax_history_input"]
    assert hist[0] == max(r0["local_amax"], r1["local_amax"]) > min(r0["local_amax"],
                                                                    r1["local_amax"])


def assert_ranks_agree_and_follow_one_process(r0, r1):
    """Both ranks hold the same fp8 state and (gathered) params, and those follow the
    one-process fp8 run up to summation order in the mode's bf16 autocast (the 1e-2 the
    FSDP2 suite allows bf16)."""
    assert r0["histories"] == r1["histories"]
    assert r0["params"] == r1["params"]
    for name, got in r0["params"].items():
        ref = r0["reference"][name]
        err = max(abs(a - b) for a, b in zip(got, ref))
        assert err <= 1e-2 * max(1.0, max(abs(b) for b in ref)), (name, err)
    assert r0["params"] != r0["initial"]  # it trained


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fsdp2_over_two_ranks_trains_like_one_process(recipe):
    # fully_shard over 2 gloo ranks, then the fp8 mode with the amaxes reduced over the
    # data-parallel group: every rank keeps the same fp8 state, and the params follow a
    # one-process fp8 run on the whole batch (measured 1.04e-3 off, on a LayerNorm).
    assert_ranks_agree_and_follow_one_process(*launch(f"fsdp-{recipe}"))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_tensor_parallel_over_two_ranks_trains_like_one_process(recipe):
    # parallelize_module (Colwise then Rowwise) over 2 gloo ranks, then the fp8 mode:
    # the amaxes of the DTensor weights are global (DTensor reduces them), so the ranks
    # agree and follow a one-process run.
    assert_ranks_agree_and_follow_one_process(*launch(f"tp-{recipe}"))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_hand_split_tensor_parallel_over_two_ranks_trains_like_one_process(recipe):
    # Megatron style, plain tensors: a column-parallel then a row-parallel Linear, the
    # output all-reduced by hand; fp8_amax_group=tp MAX-reduces the amaxes of the split
    # weights, inputs and gradients, so every rank quantises with the whole tensor's
    # scale, as one process does.
    assert_ranks_agree_and_follow_one_process(*launch(f"megatron-{recipe}"))


def _train_side_by_side(net, ref, recipe, shard=lambda t: t, clip=False,
                        **kwargs):  # pragma: no cover - subprocess
    """Three fp8 SGD steps of the distributed ``net`` (``convert_to_amp(**kwargs)``, its
    rank's ``shard`` of each batch) and of the one-process ``ref`` (the whole batch)."""
    import torch

    import mpfunc_torch

    sides = [mpfunc_torch.convert_to_amp(
        m, torch.optim.SGD(m.parameters(), lr=0.5), torch.nn.MSELoss(), mode="fp8",
        recipe=recipe, **kw) for m, kw in ((net, kwargs), (ref, {}))]
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        for (model, opt, crit), xs, ys in ((sides[0], shard(x), shard(y)), (sides[1], x, y)):
            opt.zero_grad()
            opt.backward(crit(model(xs), ys))
            if clip:
                opt.clip_grad_norm(1e9)
            opt.step()


def _megatron_worker(rank: int, recipe: str) -> dict:  # pragma: no cover - subprocess
    import torch
    import torch.distributed as dist

    import mpfunc_torch

    class AllReduce(torch.autograd.Function):  # Megatron's row-parallel output
        @staticmethod
        def forward(ctx, y):
            y = y.clone()
            dist.all_reduce(y)
            return y

        @staticmethod
        def backward(ctx, g):
            return g

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    initial = {k: v.flatten().tolist() for k, v in ref.state_dict().items()}
    rows = slice(8 * rank, 8 * rank + 8)

    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(32, 8)
            self.fc2 = torch.nn.Linear(8, 4, bias=False)
            self.b2 = torch.nn.Parameter(ref[2].bias.detach().clone())
            with torch.no_grad():
                self.fc1.weight.copy_(ref[0].weight[rows])
                self.fc1.bias.copy_(ref[0].bias[rows])
                self.fc2.weight.copy_(ref[2].weight[:, rows])

        def forward(self, x):
            return AllReduce.apply(self.fc2(torch.relu(self.fc1(x)))) + self.b2

    net = Split()
    tp = dist.group.WORLD
    mpfunc_torch.mark_replicated(net.b2, tp)
    # clip: the global norm over the split params (a collective).
    _train_side_by_side(net, ref, recipe, clip=True, process_group=tp, fp8_amax_group=tp)

    def gathered(t, dim):
        parts = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(parts, t.detach().contiguous())
        return torch.cat(parts, dim)

    full = {"0.weight": gathered(net.fc1.weight, 0), "0.bias": gathered(net.fc1.bias, 0),
            "2.weight": gathered(net.fc2.weight, 1), "2.bias": net.b2.detach()}
    return {"rank": rank, "initial": initial,
            "params": {k: v.flatten().tolist() for k, v in full.items()},
            "reference": {k: v.flatten().tolist() for k, v in ref.state_dict().items()
                          if k in full},
            "histories": {k: v.tolist() for k, v in net.state_dict().items() if "fp8_" in k}}


def _fsdp_worker(rank: int, recipe: str, tp: bool = False) -> dict:  # pragma: no cover
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard


    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.LayerNorm(16),
                                   torch.nn.Linear(16, 4))

    net, ref = build(), build()
    initial = {k: v.flatten().tolist() for k, v in ref.state_dict().items()
               if not k.endswith("bias")}
    if tp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        net = torch.nn.Sequential(net[0], torch.nn.ReLU(), net[2])  # no norm between
        ref = torch.nn.Sequential(ref[0], torch.nn.ReLU(), ref[2])
        parallelize_module(net, init_device_mesh("cpu", (2,)),
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
        group = {}  # both ranks see the whole batch; DTensor makes the amaxes global
    else:
        for m in net:
            fully_shard(m)
        fully_shard(net)
        group = {"fp8_amax_group": dist.group.WORLD}
    mine = slice(None) if tp else slice(4 * rank, 4 * rank + 4)
    _train_side_by_side(net, ref, recipe, shard=lambda t: t[mine], **group)
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).flatten().tolist()
              for k, v in net.state_dict().items() if k in initial}
    return {"rank": rank, "initial": initial, "params": params,
            "reference": {k: v.flatten().tolist() for k, v in ref.state_dict().items()
                          if k in initial},
            "histories": {k: v.tolist() for k, v in net.state_dict().items() if "fp8_" in k}}


def _ddp_worker(rank: int) -> dict:  # pragma: no cover - subprocess
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import mpfunc_torch

    out = {"rank": rank}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1 + rank)) * (1 + 3 * rank)
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(9 + rank))
    out["local_amax"] = float(x.abs().max())
    for how in ("amax_group", "process_group"):
        torch.manual_seed(0)  # the same weights on both ranks
        net = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(),
                                  torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        group = ({"fp8_amax_group": dist.group.WORLD} if how == "amax_group" else
                 {"process_group": dist.group.WORLD, "fp8_amax_group": dist.group.WORLD})
        model, opt, crit = mpfunc_torch.convert_to_amp(
            net, opt, torch.nn.MSELoss(), mode="fp8", recipe="delayed", **group)
        # broadcast_buffers=False: the histories agree through the amax reduction alone
        ddp = DDP(model, broadcast_buffers=False)
        opt.backward(crit(ddp(x), y))
        norm = opt.clip_grad_norm(1e9)
        local = torch.stack([p.grad.float().square().sum() for p in net.parameters()])
        out[how] = {"norm": float(norm), "local_norm": float(local.sum().sqrt()),
                    "histories": {k: v.tolist() for k, v in net.state_dict().items()
                                  if "fp8_" in k}}
        opt.step()
    return out


def _worker(rank: int, port: str, grouped: str) -> None:  # pragma: no cover - subprocess
    import torch
    import torch.distributed as dist

    import mpfunc_torch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    if grouped.startswith("megatron-"):
        print("RESULT " + json.dumps(_megatron_worker(rank, grouped[len("megatron-"):])),
              flush=True)
        dist.destroy_process_group()
        return
    if grouped.startswith(("fsdp-", "tp-")):
        kind, recipe = grouped.split("-", 1)
        print("RESULT " + json.dumps(_fsdp_worker(rank, recipe, tp=kind == "tp")), flush=True)
        dist.destroy_process_group()
        return
    if grouped == "ddp":
        print("RESULT " + json.dumps(_ddp_worker(rank)), flush=True)
        dist.destroy_process_group()
        return
    group = dist.group.WORLD if grouped == "True" else None
    recipe = mpfunc_torch.Fp8Recipe("delayed", amax_history_len=4)
    torch.manual_seed(0)  # the same weights on both ranks (data parallel)
    layer = mpfunc_torch.Fp8Linear(32, 16, recipe=recipe, process_group=group, gemm="emulate")
    gen = torch.Generator().manual_seed(1 + rank)
    local = []
    for _ in range(3):
        x = torch.randn(8, 32, generator=gen) * (1 + 3 * rank)
        local.append(float(x.abs().max()))
        layer(x).square().sum().backward()
    # Current scaling: the per-tensor amax is reduced too (rank 1 holds 4.0).
    _, scale = mpfunc_torch.quantize_fp8(torch.full((4, 4), 1.0 + 3 * rank),
                                         process_group=group)
    result = {"rank": rank, "local_amax": local, "tensorwise_scale": float(scale),
              "delayed": {k: v.tolist() for k, v in layer.state_dict().items()
                          if k.startswith("fp8_")}}
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
