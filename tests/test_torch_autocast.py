"""Tests for mpfunc_torch._src.autocast: apex O1's fp32 list on top of torch.autocast."""

import torch
import torch.nn.functional as F  # noqa: N812

import mpfunc_torch
from mpfunc_torch._src.autocast import Fp32Functions, fp32_callables


class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.seen = {}

    def forward(self, x):
        h = self.lin(x)
        self.seen["linear"] = h.dtype
        s = F.softmax(h, dim=-1)
        self.seen["softmax"] = s.dtype
        e = h.exp()  # a Tensor method
        self.seen["exp"] = e.dtype
        n = self.ln(h)
        self.seen["layer_norm"] = n.dtype
        self.seen["sum"] = torch.sum(h).dtype
        return s + n


def run(mode, **cfg):
    net = Probe()
    model, _, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                              mode=mode, **cfg)
    model(torch.randn(4, 8))
    return net.seen


def test_o1_runs_apex_fp32_list_in_float32_on_cpu():
    seen = run("apex", opt_level="O1", verbosity=0)
    assert seen["linear"] == torch.float16  # matmul-like: half
    for op in ("softmax", "exp", "layer_norm", "sum"):
        assert seen[op] == torch.float32, op


def test_torch_mode_follows_torch_autocast_as_is():
    # CPU fp16 autocast runs these in half; torch mode does not second-guess torch.
    seen = run("torch")
    assert seen["linear"] == torch.float16
    assert seen["softmax"] == torch.float16


def test_callables_cover_functional_torch_and_tensor_methods():
    fns = fp32_callables(["softmax", "exp"])
    assert {F.softmax, torch.softmax, torch.Tensor.softmax, torch.exp, torch.Tensor.exp} <= fns


def test_mode_leaves_other_functions_alone():
    x = torch.randn(3, 3, dtype=torch.float16)
    with Fp32Functions("cpu"):
        assert torch.tanh(x).dtype == torch.float16
        assert torch.exp(x).dtype == torch.float32
