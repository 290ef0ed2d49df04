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


# --- output containers (torch.utils._pytree) --------------------------------------------

import collections  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
from typing import NamedTuple  # noqa: E402

import pytest  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

from mpfunc_torch._src.model import cast_floats  # noqa: E402


class Pair(NamedTuple):
    logits: torch.Tensor
    extra: object


@dataclasses.dataclass(frozen=True)
class Frozen:
    logits: torch.Tensor
    steps: int = 0


class Registered(dict):
    """A dict subclass registered with torch's pytree, as HF registers ModelOutput."""


pytree.register_pytree_node(
    Registered, lambda d: (list(d.values()), list(d.keys())),
    lambda values, keys: Registered(zip(keys, values)))


def test_cast_floats_keeps_every_container_type():
    h = torch.ones(2, dtype=torch.float16)
    ids_ = torch.arange(3)
    tree = {
        "pair": Pair(h, "tag"),
        "od": collections.OrderedDict(b=h, a=[h, (ids_, None)]),
        "frozen": Frozen(h, 3),
        "registered": Registered(logits=h, n=ids_),
    }
    out = cast_floats(tree, torch.float32)
    assert type(out["pair"]) is Pair and out["pair"].extra == "tag"
    assert out["pair"].logits.dtype == torch.float32
    assert type(out["od"]) is collections.OrderedDict and list(out["od"]) == ["b", "a"]
    assert out["od"]["a"][1][0] is ids_ and out["od"]["a"][1][1] is None  # ints untouched
    assert type(out["frozen"]) is Frozen and out["frozen"].steps == 3
    assert out["frozen"].logits.dtype == torch.float32 and tree["frozen"].logits is h
    assert type(out["registered"]) is Registered
    assert out["registered"]["logits"].dtype == torch.float32
    assert out["registered"]["n"] is ids_


class TupleNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = 2.0

    def forward(self, x):
        h = self.lin(x)
        return Pair(h, "ok"), collections.OrderedDict(h=h)

    def twice(self, x):  # a method of the user's model that calls its forward
        return self(x)[0].logits * self.scale


@pytest.mark.parametrize("mode, cfg", [("naive", {}), ("apex", {"opt_level": "O2",
                                                                "verbosity": 0})])
def test_half_models_return_the_users_containers(mode, cfg):
    net = TupleNet()
    model, _, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                              mode=mode, **cfg)
    pair, od = model(torch.randn(2, 4))
    assert type(pair) is Pair and pair.extra == "ok" and pair.logits.dtype == torch.float32
    assert type(od) is collections.OrderedDict and od["h"].dtype == torch.float32


# --- the wrapped module: attributes, its own methods, copies ------------------------------

def test_attributes_and_methods_reach_the_wrapped_module():
    net = TupleNet()
    model, _, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                              mode="naive")
    assert model.scale == 2.0 and model.lin is net.lin
    model.scale = 3.0  # the wrapped module has it: set there
    assert net.scale == 3.0 and "scale" not in vars(model)
    model.note = "mine"  # neither has it: the wrapper's own
    assert model.note == "mine" and not hasattr(net, "note")
    assert "twice" in dir(model) and "plan" in dir(model)
    # The module's own methods run its converted forward: half params, cast inputs,
    # float32 outputs.
    assert model.twice(torch.randn(2, 4)).dtype == torch.float32
    assert net(torch.randn(2, 4))[0].logits.dtype == torch.float32
    with pytest.raises(AttributeError, match="nope"):
        model.nope  # noqa: B018


def test_a_deep_copy_of_a_converted_module_is_independent():
    net = TupleNet()
    mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1), mode="naive")
    twin = copy.deepcopy(net)
    with torch.no_grad():
        twin.lin.weight.zero_()
        twin.lin.bias.zero_()
    x = torch.randn(2, 4)
    assert torch.count_nonzero(twin(x)[0].logits) == 0  # runs with its own params
    assert torch.count_nonzero(net(x)[0].logits) > 0
    assert twin(x)[0].logits.dtype == torch.float32  # and is still converted


@pytest.mark.parametrize("mode, cfg", [
    ("apex", {"opt_level": "O3", "verbosity": 0}),
    ("torch", {}),
    ("naive", {}),
    ("fp8", {"recipe": "delayed"}),  # Fp8Linear with its history buffers
])
def test_a_converted_model_pickles_whole(mode, cfg, tmp_path):
    net = TupleNet()
    model, _, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                              mode=mode, **cfg)
    torch.save(model, tmp_path / "model.pt")
    again = torch.load(tmp_path / "model.pt", weights_only=False)
    x = torch.randn(2, 4)
    assert again.lin.weight.dtype == net.lin.weight.dtype
    out, ref = again(x)[0].logits, model(x)[0].logits
    assert out.dtype == ref.dtype and torch.equal(out, ref)  # still converted
    again.load_state_dict(model.state_dict())  # its load hooks (naive: masters) still work
    # (a second call: delayed fp8 now scales from the history both have recorded)
    assert torch.equal(again(x)[0].logits, model(x)[0].logits)


def test_converting_twice_is_an_error():
    net = make_model()
    model, _, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for again in (net, model):
        with pytest.raises(ValueError, match="already converted by convert_to_amp"):
            mpfunc_torch.convert_to_amp(again, torch.optim.SGD(net.parameters(), lr=0.1))


# --- which layers are norms ----------------------------------------------------------------

class LlamaRMSNorm(torch.nn.Module):  # as HuggingFace writes it: not an nn.RMSNorm
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.seen = None

    def forward(self, x):
        self.seen = x.dtype
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class AdaLayerNorm(torch.nn.Module):  # a norm with a layer inside: all of it stays fp32
    def __init__(self, n):
        super().__init__()
        self.proj = torch.nn.Linear(n, n)
        self.ln = torch.nn.LayerNorm(n, elementwise_affine=False)

    def forward(self, x):
        return self.ln(x) * self.proj(x)


class Normalizer(torch.nn.Module):  # not a norm by name ("Normalize...")
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.weight


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.rms = LlamaRMSNorm(8)
        self.ada = AdaLayerNorm(8)
        self.other = Normalizer(8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.other(self.ada(self.rms(self.fc(x)))))


def test_default_norm_test_reads_class_names():
    is_norm = mpfunc_torch.is_norm_module
    for m in (torch.nn.LayerNorm(2), torch.nn.BatchNorm2d(2), torch.nn.GroupNorm(1, 2),
              torch.nn.InstanceNorm1d(2), torch.nn.RMSNorm(2), LlamaRMSNorm(2),
              AdaLayerNorm(2)):
        assert is_norm("x", m), type(m).__name__
    named = {n: type(n, (torch.nn.Module,), {})() for n in (
        "T5LayerNorm", "LayerNorm2d", "FrozenBatchNorm2d", "GroupNorm32", "MambaRMSNormGated",
        "Normalizer", "Normal", "NormFormer", "Linear", "Normalize")}
    got = {n: is_norm("x", m) for n, m in named.items()}
    assert got == {"T5LayerNorm": True, "LayerNorm2d": True, "FrozenBatchNorm2d": True,
                   "GroupNorm32": True, "MambaRMSNormGated": True, "Normalizer": False,
                   "Normal": False, "NormFormer": False, "Linear": False, "Normalize": False}
    sub = type("Custom", (LlamaRMSNorm,), {})(2)  # a subclass of a norm by name
    assert is_norm("x", sub)


def test_o2_keeps_custom_norms_fp32_and_computes_them_in_fp32():
    net = Block()
    model, _, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                              mode="apex", opt_level="O2", verbosity=0)
    dtypes = {n: p.dtype for n, p in net.named_parameters()}
    assert dtypes == {"fc.weight": torch.float16, "fc.bias": torch.float16,
                      "rms.weight": torch.float32, "ada.proj.weight": torch.float32,
                      "ada.proj.bias": torch.float32, "other.weight": torch.float16,
                      "head.weight": torch.float16, "head.bias": torch.float16}
    out = model(torch.randn(3, 8))
    assert net.rms.seen == torch.float32 and out.dtype == torch.float32


def test_is_norm_predicate_replaces_the_default():
    net = Block()
    is_norm = lambda name, m: name == "other"  # noqa: E731
    mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1), mode="apex",
                                opt_level="O3", keep_batchnorm_fp32=True, verbosity=0,
                                is_norm=is_norm)
    assert net.other.weight.dtype == torch.float32
    assert net.rms.weight.dtype == torch.float16 and net.ada.proj.weight.dtype == torch.float16


def test_is_norm_errors():
    net = Block()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="`is_norm` chooses the layers that stay float32"):
        mpfunc_torch.convert_to_amp(net, opt, mode="naive", is_norm=lambda n, m: False)
    with pytest.raises(TypeError, match="`is_norm` must be a callable"):
        mpfunc_torch.convert_to_amp(net, opt, mode="apex", opt_level="O2", verbosity=0,
                                    is_norm="LayerNorm")
    assert net.fc.weight.dtype == torch.float32  # refused before anything was cast


def test_a_converted_forward_keeps_its_signature():
    # Code that reads the forward's arguments (HuggingFace's Trainer keeps only the batch
    # columns it names) sees the same ones after conversion, for a class's forward and
    # for an instance-level one.
    import inspect

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, input_ids, labels=None, **kwargs):
            return self.fc(input_ids)

    net = Net()
    expected = inspect.signature(net.forward)
    mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1), mode="naive")
    assert type(net.forward).__name__ == "_AmpForward"
    assert inspect.signature(net.forward) == expected
    plain = torch.nn.Linear(4, 2)
    plain.forward = lambda x, scale=2.0: x * scale
    mpfunc_torch.convert_to_amp(plain, torch.optim.SGD(plain.parameters(), lr=0.1), mode="torch")
    assert list(inspect.signature(plain.forward).parameters) == ["x", "scale"]
