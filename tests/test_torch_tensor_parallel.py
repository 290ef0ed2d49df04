"""Tensor parallelism: DTensor (``parallelize_module``) alone on 2 ranks and with FSDP2 on
a 2 x 2 mesh, and a hand split (Megatron style, plain tensors and a process group) on 2
ranks. Every mode, global gradient clipping, an inf in one rank's shard.
"""

import pytest
import torch
import torch_scaleout_models as tm
from test_torch_fsdp import TOL, check_run, reference

LABELS = [label for label, _, _ in tm.MODES]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return tm.launched(tmp_path_factory, "two", 2, "tp")


@pytest.fixture(scope="module")
def fsdp_tp4(tmp_path_factory):
    return tm.launched(tmp_path_factory, "four", 4, "fsdp_tp")


@pytest.fixture(scope="module")
def megatron2(tmp_path_factory):
    return tm.launched(tmp_path_factory, "two", 2, "megatron")


@pytest.mark.slow
@pytest.mark.parametrize("label", LABELS)
def test_dtensor_tensor_parallel(tp2, label):
    check_run(tp2, label, reference(label, tm.CLIP, False), TOL.get(label, 2e-3))


@pytest.mark.slow
@pytest.mark.parametrize("label", LABELS)
def test_fsdp_and_tensor_parallel_on_a_2d_mesh(fsdp_tp4, label):
    check_run(fsdp_tp4, label, reference(label, tm.CLIP, False), TOL.get(label, 2e-3))
    # The finite check is reduced over both mesh dimensions (dp and tp).
    assert fsdp_tp4[0][label]["groups"] == 2


@pytest.mark.slow
def test_dtensor_own_found_inf_handler_misses_an_inf_across_tp(fsdp_tp4):
    # The world as it is: torch's DTensor handler for the fused check reduces found_inf
    # along the mesh dims where the first gradient is sharded; with a tp-replicated bias
    # first, the inf on rank 3 reaches rank 1 (same tp column) but not ranks 0 and 2.
    handler = [r["handler"] for r in fsdp_tp4]
    assert handler[0]["first_placements"] == "(Shard(dim=0), Replicate())"
    assert [h["torch_found_inf"] for h in handler] == [0.0, 1.0, 0.0, 1.0]
    # mpfunc checks local shards and reduces over every mesh dimension: all agree.
    assert [h["ours_found_inf"] for h in handler] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("label", LABELS)
def test_megatron_hand_split(megatron2, label):
    check_run(megatron2, label, reference(label, tm.CLIP, False), TOL.get(label, 2e-3))


@pytest.mark.slow
def test_per_rank_clipping_breaks_a_hand_split_model(megatron2):
    # The control: torch.nn.utils.clip_grad_norm_ on each rank of the same split.
    # Each rank clips by its own norm, none of them the global one, ...
    norms = [r["torch_clip_per_rank"]["norms"] for r in megatron2]
    ref = reference("torch", tm.CLIP, False)  # float32 params: the norm is the same
    assert norms[0][0] != pytest.approx(norms[1][0], rel=1e-3)
    assert all(n != pytest.approx(ref["report"][0][2], rel=1e-2) for n in (norms[0][0], norms[1][0]))
    # ...so the replicated params (norms, embeddings, the head) drift apart across ranks.
    p0, p1 = (r["torch_clip_per_rank"]["params"] for r in megatron2)
    assert not torch.equal(p0["ln.weight"], p1["ln.weight"])
