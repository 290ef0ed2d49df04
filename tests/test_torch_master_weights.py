"""Tests for mpfunc_torch._src.master_weights: float32 masters of half-precision params."""

import torch
from torch_task import batches, make_model

import mpfunc_torch
from mpfunc_torch import AMP_TYPE


def test_naive_mode_casts_model_and_keeps_float32_masters():
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode=AMP_TYPE.NAIVE)
    assert all(p.dtype == torch.float16 for p in net.parameters())  # norms too, like Megatron
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    x, y = batches(1)[0]
    out = model(x)
    assert out.dtype == torch.float32
    assert opt.scale_metrics(as_python=True)["loss_scale"] == 2.0**32

def test_naive_clip_grad_and_zero_count():
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, opt, torch.nn.CrossEntropyLoss(), mode="naive", clip_grad=0.5,
        log_num_zeros_in_grad=True, initial_scale=2.0**10)
    x, y = batches(1)[0]
    opt.backward(crit(model(x), y))
    seen = {}
    real_step = opt.optimizer.step

    def spy_step(*a, **k):  # look at the master grads the inner optimizer is handed
        grads = [m.grad for _, m in opt._pairs if m.grad is not None]
        seen["zeros"] = sum(int((g == 0).sum()) for g in grads)
        seen["norm"] = float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        return real_step(*a, **k)

    opt.optimizer.step = spy_step
    opt.step()
    # Embedding rows of bytes absent from the batch get exactly-zero gradients.
    assert opt.scale_metrics(as_python=True)["num_zeros_in_grad"] == seen["zeros"] > 0
    assert float(opt.grad_norm) > 0.5  # the norm before clipping
    assert seen["norm"] <= 0.5 * (1 + 1e-5)  # what the optimizer stepped with
    assert all(m.grad is None for _, m in opt._pairs)  # released after the step
