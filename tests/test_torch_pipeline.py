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


def test_fp8_stages_skip_together_without_an_amax_reduction_between_them(pipe2):
    # process_group=pp was also the fp8 amax group: each stage started an all-reduce in
    # its forward while the other waited on point-to-point, and the pipeline hung. Now
    # fp8 with process_group needs fp8_amax_group (here (): stages hold other layers).
    assert "name the groups to MAX-reduce the fp8 amaxes" in pipe2[0]["fp8_pipeline_error"]
    reports = [r["fp8"]["report"] for r in pipe2]
    assert [s[0] for s in reports[0]] == [True, False, True]  # the injected step skipped
    assert reports[0] == reports[1]  # one decision, one scale, one clipping norm
    assert all(r["fp8"]["skip_exact"] == [True] for r in pipe2)
