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
@pytest.mark.parametrize("fused", [False, True])
def test_one_rank_fsdp_equals_unsharded(gloo_world, storage, fused):
    # fused: the FSDP2 run takes torch's fused AdamW kernel a chunk at a time on each
    # shard (mpfunc_torch._src.storage_kernels), the unsharded one the generic path.
    from lowp_task import sharded_run

    assert sharded_run(storage, 0, 1, fused=fused) == []


@pytest.mark.parametrize("storage", STORAGES)
def test_one_rank_fsdp_dcp_checkpoint_resumes_bit_for_bit(gloo_world, storage, tmp_path):
    # torch.distributed.checkpoint of FSDP2 shards (2 ranks in the slow suite below).
    from lowp_task import fsdp_dcp_resume

    fsdp_dcp_resume(storage, tmp_path)


def test_one_rank_fsdp_8bit_state_skips_exactly_and_trains(gloo_world):
    from lowp_task import fsdp_8bit_run

    assert fsdp_8bit_run() == []


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_round_their_shards_like_the_whole_param(tmp_path):
    # Each storage trained sharded equals unsharded; each saved with DCP by both ranks
    # resumes bit for bit; 8-bit stochastic state keeps per-shard blocks and skips exactly.
    port = str(_free_port())
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{root / 'tests'}", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), port, str(tmp_path)], env=env,
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
        assert r["fused"] == {s: [] for s in STORAGES}
        assert r["dcp"] == STORAGES and r["eight_bit"] == []
        assert r["column_bits"]  # a shard along dim 1 indexes the whole tensor's positions


def _worker(rank: int, port: str, tmp: str) -> None:  # pragma: no cover - subprocess
    import torch
    import torch.distributed as dist
    from lowp_task import fsdp_8bit_run, fsdp_dcp_resume, sharded_run
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from _mpfunc_common import rounding as R
    from mpfunc_torch._src.rounding import bits_for

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    result = {"rank": rank, "problems": {s: sharded_run(s, rank, 2) for s in STORAGES},
              "fused": {s: sharded_run(s, rank, 2, fused=True) for s in STORAGES}}
    result["dcp"] = []
    for s in STORAGES:  # both ranks write their shards into one checkpoint, then load it
        fsdp_dcp_resume(s, Path(tmp) / s)
        result["dcp"].append(s)
    result["eight_bit"] = fsdp_8bit_run()
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
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
