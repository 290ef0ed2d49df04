"""mpfunc_torch.clip_grad_norm_ and mark_replicated in one process (the multi-rank
behaviour is tested in test_torch_tensor_parallel.py, test_torch_fsdp.py and
test_torch_pipeline.py)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mpfunc_torch


@given(st.lists(st.integers(1, 40), min_size=1, max_size=5),
       st.sampled_from([1.0, 2.0, 3.0, math.inf]), st.floats(0.01, 10.0),
       st.integers(0, 2**16))
def test_clip_grad_norm_equals_torch_on_one_rank(sizes, norm_type, max_norm, seed):
    g = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    theirs = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    total = mpfunc_torch.clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert torch.equal(total, expected)  # one rank: torch's computation, bit for bit
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)


def test_clip_grad_norm_counts_half_grads_in_float32():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.full((4,), 60000.0, dtype=torch.float16)  # its norm overflows float16
    assert float(mpfunc_torch.clip_grad_norm_([p], 1e9)) == pytest.approx(120000.0)


def test_clip_grad_norm_bad_input():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="`max_norm`"):
        mpfunc_torch.clip_grad_norm_([p], 0.0)
    with pytest.raises(ValueError, match="`norm_type`"):
        mpfunc_torch.clip_grad_norm_([p], 1.0, norm_type=-1.0)
    with pytest.raises(TypeError, match="`norm_type`"):
        mpfunc_torch.clip_grad_norm_([p], 1.0, norm_type="2")


def test_mark_replicated_bad_input():
    with pytest.raises(ValueError, match="`process_group`"):
        mpfunc_torch.mark_replicated(torch.zeros(2), None)
    with pytest.raises(TypeError, match="`process_group`"):
        mpfunc_torch.mark_replicated(torch.zeros(2), "tp")


def test_clip_matches_torch_bit_for_bit_and_handles_sparse_values():
    torch.manual_seed(0)
    dense = [torch.randn(5, 3), torch.randn(4)]
    ref = [t.clone().requires_grad_() for t in dense]
    for r in ref:
        r.grad = r.detach().clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    ours = [torch.nn.Parameter(t.clone()) for t in dense]
    for p in ours:
        p.grad = p.detach().clone()
    assert torch.equal(mpfunc_torch.clip_grad_norm_(ours, 0.5), ref_norm)
    for a, r in zip(ours, ref):
        assert torch.equal(a.grad, r.grad)
    p = torch.nn.Parameter(torch.zeros(5, 1))
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.tensor([[3.0], [4.0]]),
                                     (5, 1), check_invariants=True).coalesce()
    assert mpfunc_torch.clip_grad_norm_([p], 1.0).item() == pytest.approx(5.0)
    torch.testing.assert_close(p.grad.to_dense().flatten(), torch.tensor([0, 0.6, 0, 0.8, 0]),
                               rtol=1e-5, atol=1e-6)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([[3.0], [4.0]]),
                                     (5, 1), check_invariants=True)
    with pytest.raises(ValueError, match="coalesce"):  # its values are a temporary copy
        mpfunc_torch.clip_grad_norm_([p], 1.0)


@pytest.mark.parametrize("mode, cfg", [("naive", {"initial_scale": 2.0**8}),
                                       ("apex", {"opt_level": "O2", "verbosity": 0})])
def test_clip_grad_norm_follows_a_converted_models_params_to_their_masters(mode, cfg):
    # GradScaler's habit, unscale_() then clip model.parameters(): with master weights the
    # gradients have moved into the float32 masters there, and torch's own clip sees none
    # (it returns 0 and clips nothing; README). Ours follows the params to the masters
    # and clips exactly as optimizer.clip_grad_norm does.
    from torch_task import tiny_batch, tiny_model

    def run(clip):
        net = tiny_model(0)
        model, opt, crit = mpfunc_torch.convert_to_amp(
            net, torch.optim.SGD(net.parameters(), lr=1.0), torch.nn.MSELoss(), mode=mode,
            **cfg)
        x, y = tiny_batch(0)
        opt.scale_loss(crit(model(x), y)).backward()
        if clip == "torch":
            opt.unscale_()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        elif clip == "ours":
            opt.unscale_()
            norm = mpfunc_torch.clip_grad_norm_(model.parameters(), 0.01)
        else:
            norm = opt.clip_grad_norm(0.01)
        assert bool(opt.step())
        return float(norm), [p.detach().clone() for p in net.parameters()]

    norm, params = run("optimizer")
    ours_norm, ours = run("ours")
    assert norm > 0.01 and ours_norm == norm
    assert all(torch.equal(a, b) for a, b in zip(params, ours))
    torch_norm, unclipped = run("torch")  # the pitfall, pinned
    assert torch_norm == 0.0 and not all(torch.equal(a, b) for a, b in zip(params, unclipped))
    net = tiny_model(0)
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=1.0), torch.nn.MSELoss(), mode=mode, **cfg)
    opt.scale_loss(crit(model(tiny_batch(0)[0]), tiny_batch(0)[1])).backward()
    with pytest.raises(RuntimeError, match="before optimizer.unscale_\\(\\)"):
        mpfunc_torch.clip_grad_norm_(model.parameters(), 0.01)
