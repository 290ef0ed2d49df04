"""Storage without float32 masters under FSDP2: each rank rounds its own shard with the
random bits of the elements' positions in the whole param, so sharded training equals
unsharded training bit for bit (1 rank in process; 2 gloo ranks in the slow suite, each
running this file as a script)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

STORAGES = ["remainder", "kahan", "stochastic"]


@pytest.mark.parametrize("storage", STORAGES)
def test_one_rank_fsdp_equals_unsharded(gloo_world, storage):
    from lowp_task import sharded_run

    assert sharded_run(storage, 0, 1) == []


@pytest.mark.parametrize("storage", STORAGES)
def test_one_rank_fsdp_dcp_checkpoint_resumes_bit_for_bit(gloo_world, storage, tmp_path):
    # torch.distributed.checkpoint of FSDP2 shards: remainders and compensations are
    # DTensors sharded like their params, the bfloat16 state as stored.
    import torch
    import torch.distributed.checkpoint as dcp
    from lowp_task import convert, fixed_grads, net, same, snapshot
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    import mpfunc_torch

    def run(seed):
        model = net(seed)
        fully_shard(model)
        _, opt = convert(model, torch.optim.AdamW(model.parameters(), lr=1e-2), storage,
                         "bfloat16", rounding="stochastic", seed=5)
        return model, opt

    def step(model, opt, g):
        for p, gi in zip(model.parameters(), g):
            p.grad = distribute_tensor(gi, p.device_mesh, p.placements)
        opt.backward_done()
        assert bool(opt.step())

    grads = fixed_grads(5)
    model, opt = run(0)
    for g in grads[:3]:
        step(model, opt, g)
    msd, osd = mpfunc_torch.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    model2, opt2 = run(1)
    msd2, osd2 = mpfunc_torch.get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(tmp_path))
    mpfunc_torch.set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    same(snapshot(model2, opt2), snapshot(model, opt))
    for g in grads[3:]:
        step(model, opt, g)
        step(model2, opt2, g)
    same(snapshot(model2, opt2), snapshot(model, opt))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_round_their_shards_like_the_whole_param():
    port = str(_free_port())
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{root / 'tests'}", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-3000:]
            line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
            out.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r in out:
        assert r["problems"] == {s: [] for s in STORAGES}
        assert r["column_bits"]  # a shard along dim 1 indexes the whole tensor's positions


def _worker(rank: int, port: str) -> None:  # pragma: no cover - subprocess
    import torch
    import torch.distributed as dist
    from lowp_task import sharded_run
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from _mpfunc_common import rounding as R
    from mpfunc_torch._src.rounding import bits_for

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    result = {"rank": rank, "problems": {s: sharded_run(s, rank, 2) for s in STORAGES}}
    # Sharded along its columns (tensor parallelism): the shard is no run of the whole.
    mesh = init_device_mesh("cpu", (2,))
    dt = distribute_tensor(torch.zeros(3, 7), mesh, [Shard(1)])
    got = bits_for(dt, 5, 2, 9).numpy().view(np.uint32)
    cols = np.arange(7)[:4] if rank == 0 else np.arange(7)[4:]
    want = R.random_bits(5, 2, 9, (np.arange(3)[:, None] * 7 + cols[None, :]).reshape(-1))
    result["column_bits"] = bool((got == want).all())
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    _worker(int(sys.argv[1]), sys.argv[2])
