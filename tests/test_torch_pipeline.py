"""Pipeline parallelism with ``torch.distributed.pipelining`` (GPipe, 2 microbatches):
2 stages on 2 ranks in every mode, and 2 stages of 2 hand-split tensor-parallel ranks
each on 4 ranks. The inf check and the clipping norm are reduced over the pipeline group
(and the tensor-parallel one), so every stage skips together and clips by one norm.
"""

import pytest
import torch_scaleout_models as tm
from test_torch_fsdp import TOL, check_run, reference

pytestmark = pytest.mark.slow

LABELS = [label for label, _, _ in tm.MODES]


@pytest.fixture(scope="module")
def pipe2(tmp_path_factory):
    return tm.launched(tmp_path_factory, "two", 2, "pipeline")


@pytest.fixture(scope="module")
def pipe4(tmp_path_factory):
    return tm.launched(tmp_path_factory, "four", 4, "pipeline")


@pytest.mark.parametrize("label", LABELS)
def test_two_stages(pipe2, label):
    check_run(pipe2, label, reference(label, tm.CLIP, False), TOL.get(label, 2e-3))


@pytest.mark.parametrize("label", ["torch", "O2", "naive"])
def test_two_stages_of_tensor_parallel_pairs(pipe4, label):
    check_run(pipe4, label, reference(label, tm.CLIP, False), TOL.get(label, 2e-3))


def test_losses_match_one_process(pipe2):
    # The last stage's losses (microbatch means, unscaled) are the full-batch losses.
    ref = reference("naive", tm.CLIP, False)["losses"]
    got = pipe2[1]["naive"]["losses"]
    assert got == pytest.approx(ref, rel=1e-3)
