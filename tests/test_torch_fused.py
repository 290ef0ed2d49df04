"""Tests for mpfunc_torch._src.fused: the one wrapper of torch's private AMP kernels."""

import pytest
import torch

from mpfunc_torch._src import fused


def test_unscale_and_check_groups_by_dtype_and_accumulates():
    grads = [torch.full((3,), 4.0), torch.full((2,), 8.0, dtype=torch.float16),
             torch.full((5,), 2.0, dtype=torch.bfloat16)]
    found = torch.zeros(())
    fused.unscale_and_check_(grads, found, torch.tensor(0.25))
    assert [g.float().tolist() for g in grads] == [[1.0] * 3, [2.0] * 2, [0.5] * 5]
    assert found.item() == 0.0
    bad = [torch.tensor([1.0, float("nan")], dtype=torch.float16)]
    fused.unscale_and_check_(bad, found, torch.tensor(1.0))
    assert found.item() == 1.0
    fused.unscale_and_check_([torch.ones(2)], found, torch.tensor(1.0))
    assert found.item() == 1.0  # raised, never cleared


def test_check_only_with_unit_inv_scale_leaves_values():
    g = [torch.tensor([3.0, -2.0])]
    found = torch.zeros(())
    fused.unscale_and_check_(g, found, torch.ones(()))
    assert g[0].tolist() == [3.0, -2.0] and found.item() == 0.0


def test_none_grads_are_ignored_and_bad_found_inf_rejected():
    fused.unscale_and_check_([None, torch.ones(1)], torch.zeros(()), torch.ones(()))
    with pytest.raises(ValueError, match="`found_inf` must be a 0-dim float32 tensor"):
        fused.unscale_and_check_([torch.ones(1)], torch.zeros(1), torch.ones(()))


def test_count_zeros_is_exact_beyond_float16_range():
    grads = [torch.zeros(70_000, dtype=torch.float16),  # more zeros than float16 can count
             torch.tensor([0.0, 1.0, -0.0, 2.0]), None]
    assert fused.count_zeros(grads).item() == 70_002
    assert fused.count_zeros([]).item() == 0


def test_update_scale_is_torchs_rule():
    scale, tracker = torch.tensor(8.0), torch.zeros((), dtype=torch.int32)
    fused.update_scale_(scale, tracker, torch.tensor(0.0), 2.0, 0.5, 2)
    fused.update_scale_(scale, tracker, torch.tensor(0.0), 2.0, 0.5, 2)
    assert scale.item() == 16.0 and tracker.item() == 0
    fused.update_scale_(scale, tracker, torch.tensor(1.0), 2.0, 0.5, 2)
    assert scale.item() == 8.0
