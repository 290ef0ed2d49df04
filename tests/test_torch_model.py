"""Tests for mpfunc_torch._src.model: AmpModel / AmpCriterion precision and keys."""

import torch
from torch_task import batches, make_model

import mpfunc_torch


def test_apex_o2_keeps_norms_fp32_and_o3_does_not():
    for level, norm_dtype in (("O2", torch.float32), ("O3", torch.float16)):
        net = make_model(norm="batch")
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="apex", opt_level=level,
                                                    verbosity=0)
        assert net.fc1.weight.dtype == torch.float16
        assert net.norm.weight.dtype == norm_dtype
        assert net.norm.running_mean.dtype == norm_dtype
        x, _ = batches(1)[0]
        assert model(x).dtype == torch.float32  # apex casts O2/O3 outputs to float32

def test_model_state_dict_keys_are_the_unwrapped_models():
    net = make_model()
    model, _, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                              mode="bf16")
    assert set(model.state_dict()) == set(make_model().state_dict())
