"""Fault injection into checkpoints (mpfunc_torch._src.checkpoint.optimizer_state): random corruptions of
an `AmpOptimizer`'s state dict are refused whole or load and train finite; a state
saved by one implementation of an optimizer (foreach, fused) resumes in another; and a
converted model's `load_state_dict` refuses, before copying anything, what torch would
refuse after copying the rest."""

import copy
import random
import re

import pytest
import torch
from test_torch_checkpoint import _fresh, _same, _train
from torch_task import tiny_batch, tiny_model

import mpfunc_torch

_OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}
_MODES = [("torch", {}), ("naive", {"initial_scale": 2.0**8}),
          ("apex", {"opt_level": "O2", "verbosity": 0, "loss_scale": 256.0}),
          ("bf16", {})]


def _corrupt(ck, rng):
    """One random corruption of a checkpoint; some are harmless and must load."""
    inner = ck["optimizer"]
    states = [(pid, k) for pid, st in inner["state"].items() for k in st]
    kind = rng.choice(["tensor", "step", "group", "drop_state", "groups", "scaler", "master"])
    if kind == "tensor" and states:
        pid, k = states[rng.randrange(len(states))]
        t = inner["state"][pid][k]
        inner["state"][pid][k] = rng.choice([
            lambda: t.reshape(-1), lambda: t[None],
            lambda: t[..., :1] if t.dim() else t, lambda: t * float("nan"),
            lambda: t.double(), lambda: t.tolist(), lambda: t.reshape(1, -1),
            lambda: torch.full_like(t, float("-inf"))])()
    elif kind == "step" and any(k == "step" for _, k in states):
        pid = next(pid for pid, k in states if k == "step")
        inner["state"][pid]["step"] = rng.choice([
            torch.tensor(-1.0), torch.tensor(0.5), torch.tensor(4), torch.tensor(1e6),
            torch.tensor(float("inf")), 7, torch.tensor([3.0]), torch.tensor(2.0)])
    elif kind == "group":
        g = inner["param_groups"][0]
        key = rng.choice(sorted(k for k in g if k != "params"))
        if rng.random() < 0.3:
            del g[key]
        else:
            g[key] = rng.choice([float("nan"), "0.1", None, (0.9,), -float("inf"), 1])
    elif kind == "drop_state" and inner["state"]:
        del inner["state"][rng.choice(sorted(inner["state"]))]  # a param without state
    elif kind == "groups":
        inner["param_groups"] = rng.choice([[], inner["param_groups"] * 2,
                                            [{**inner["param_groups"][0], "params": [0, 1]}]])
    elif kind == "scaler":
        sc = ck["scalers"][0]
        key = rng.choice(sorted(k for k in sc if isinstance(sc[k], torch.Tensor)))
        sc[key] = rng.choice([torch.tensor(float("nan")), torch.tensor(-3), sc[key] * 2])
    elif kind == "master" and ck["master_weights"]:
        i = rng.randrange(len(ck["master_weights"]))
        m = ck["master_weights"][i]
        ck["master_weights"][i] = rng.choice([m.half(), m.reshape(-1), m * float("inf"), m + 1])
    return kind


def test_random_corruptions_are_refused_whole_or_load_and_train_finite():
    """Fault injection into checkpoints, the "nothing is lost" rule for loading: a
    corrupt checkpoint is a ValueError that leaves optimizer, masters and model as they
    were; whatever loads trains on with finite params, masters and state. Over modes,
    optimizers (fused, foreach, factored) and targets with and without state. Not drawn,
    since they load as in torch: deleting one key of a param's state (exp_avg; the step
    raises KeyError), and finite values that break an optimizer's own invariant (centered
    RMSprop's square_avg below grad_avg**2 makes its update NaN)."""
    def leaves(opt, net):
        sd = opt.state_dict()
        return [t for t in torch.utils._pytree.tree_leaves(sd) if isinstance(t, torch.Tensor)
                ] + [p.detach() for p in net.parameters()]

    loaded = refused = 0
    for seed in range(64):
        rng = random.Random(seed)
        name = rng.choice(sorted(_OPTIMIZERS))
        mode, cfg = _MODES[seed % len(_MODES)]
        src_net, src = _fresh(_OPTIMIZERS[name], mode=mode, seed=seed, **cfg)
        _train(src_net, src, 3, seed=seed)
        ck = copy.deepcopy(src.state_dict())
        kind = _corrupt(ck, rng)
        net, opt = _fresh(_OPTIMIZERS[name], mode=mode, seed=seed + 1, **cfg)
        _train(net, opt, rng.choice([0, 2]), seed=seed + 1)
        before = [t.clone() for t in leaves(opt, net)]
        try:
            opt.load_state_dict(ck)
        except ValueError:
            refused += 1
            after = leaves(opt, net)
            assert len(after) == len(before), (seed, name, mode, kind)
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, after)
                       ), (seed, name, mode, kind)
            continue
        loaded += 1
        _train(net, opt, 3, seed=seed + 2)
        bad = [t for t in leaves(opt, net) if t.is_floating_point()
               and not bool(torch.isfinite(t).all())]
        assert not bad, (seed, name, mode, kind)
    assert loaded >= 10 and refused >= 20, (loaded, refused)  # both outcomes drawn


@pytest.mark.parametrize("saved_as, resumed_as", [({"foreach": True}, {"fused": True}),
                                                  ({"fused": True}, {"foreach": True})])
@pytest.mark.parametrize("mode, cfg", [("torch", {}), ("naive", {"initial_scale": 2.0**8})])
def test_the_implementation_flags_stay_the_resuming_optimizers(saved_as, resumed_as, mode, cfg):
    # A run moved to fused=True resumes from its foreach checkpoint. torch's own load takes
    # foreach/fused from the checkpoint (pinned below), and then the fused path's
    # grad_scale / found_inf made every step raise; a state from another implementation
    # loads into this one's flags.
    net, src = _fresh(lambda ps: torch.optim.AdamW(ps, lr=1e-2, **saved_as), mode=mode, **cfg)
    _train(net, src, 3)
    ck = src.state_dict()
    net2, opt = _fresh(lambda ps: torch.optim.AdamW(ps, lr=1e-2, **resumed_as), mode=mode,
                       seed=1, **cfg)
    flags = {k: opt.optimizer.param_groups[0][k] for k in ("foreach", "fused")}
    opt.load_state_dict(ck)
    assert {k: opt.optimizer.param_groups[0][k] for k in flags} == flags
    # the control: the same state with this optimizer's flags written into the checkpoint
    net3, ref = _fresh(lambda ps: torch.optim.AdamW(ps, lr=1e-2, **resumed_as), mode=mode,
                       seed=1, **cfg)
    edited = copy.deepcopy(ck)
    edited["optimizer"]["param_groups"][0].update(flags)
    ref.load_state_dict(edited)
    net3.load_state_dict(net2.state_dict())
    for n, o in ((net2, opt), (net3, ref)):
        before = copy.deepcopy(o.state_dict())
        o.zero_grad()
        o.backward(n(tiny_batch()[0].to(next(n.parameters()).dtype)).float().sum()
                   * float("inf"))
        assert not bool(o.step())  # skipped, exactly
        after = o.state_dict()
        assert _same(before["optimizer"], after["optimizer"])
        assert _same(before["master_weights"], after["master_weights"])
    _train(net2, opt, 2, seed=3)
    _train(net3, ref, 2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(net2.parameters(), net3.parameters()))
    assert _same(opt.state_dict(), ref.state_dict())


def test_torch_takes_the_implementation_flags_from_the_checkpoint():
    # Why the test above exists: GradScaler with fused AdamW, resumed from a foreach run.
    net = tiny_model()
    foreach = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)
    net(tiny_batch()[0]).sum().backward()
    foreach.step()
    fused = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    fused.load_state_dict(foreach.state_dict())
    assert fused.param_groups[0]["fused"] is None and fused.param_groups[0]["foreach"]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(net(tiny_batch()[0]).sum()).backward()
    with pytest.raises(AssertionError, match="grad_scale and found_inf"):
        scaler.step(fused)


# -- the converted model's load_state_dict: all or nothing -------------------------------

class _LoadsItself(torch.nn.Module):
    """Custom loading (renames an old key), which the check leaves to torch."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if prefix + "old_w" in state_dict:
            state_dict[prefix + "w"] = state_dict.pop(prefix + "old_w")
        super()._load_from_state_dict(state_dict, prefix, *args)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.shared = torch.nn.Linear(6, 6)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(self.shared, torch.nn.GELU()),
                                           torch.nn.Sequential(torch.nn.Linear(6, 6, bias=False),
                                                               torch.nn.BatchNorm1d(6))])
        self.norm = torch.nn.LayerNorm(6)
        self.frozen = torch.nn.Parameter(torch.randn(6), requires_grad=False)
        self.custom = _LoadsItself()
        self.head = torch.nn.Linear(6, 2)
        self.register_buffer("mask", torch.tensor([0.0, float("-inf")]))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h) * self.frozen) + self.custom.w.sum()


def _model_corruptions(sd, rng):
    keys = sorted(sd)
    key = rng.choice(keys)
    kind = rng.choice(["delete", "extra", "shape", "type", "nan", "inf_buffer", "double",
                       "scalar_1d", "rename_custom", "none"])
    if kind == "delete":
        del sd[key]
    elif kind == "extra":
        sd[rng.choice(["", "blocks.1.", "blocks.0.0.", "custom.", "nothing."]) + "extra"] = (
            torch.zeros(1))
    elif kind == "shape":
        sd[key] = sd[key].reshape(-1)[:-1] if sd[key].numel() > 1 else sd[key][None, None]
    elif kind == "type":
        sd[key] = sd[key].tolist()
    elif kind == "nan" and sd[key].is_floating_point():
        sd[key] = sd[key].clone().index_fill_(0, torch.tensor([0]), float("nan")) \
            if sd[key].dim() else torch.tensor(float("nan"))
    elif kind == "inf_buffer":
        sd["mask"] = torch.tensor([float("-inf"), 0.0])
    elif kind == "double" and sd[key].is_floating_point():
        sd[key] = sd[key].double()
    elif kind == "scalar_1d":
        sd["blocks.1.1.num_batches_tracked"] = torch.tensor([7])
    elif kind == "rename_custom":
        sd["custom.old_w"] = sd.pop("custom.w")
    return kind


def _convert(mode, cfg, seed):
    torch.manual_seed(seed)
    net = _Net()
    model, opt, _ = mpfunc_torch.convert_to_amp(net, torch.optim.AdamW(net.parameters()),
                                                mode=mode, **cfg)
    return net, opt, model


@pytest.mark.parametrize("mode, cfg", [("torch", {}), ("naive", {}),
                                       ("apex", {"opt_level": "O2", "verbosity": 0}),
                                       ("bf16", {})])
def test_model_loads_are_all_or_nothing_and_otherwise_torchs(mode, cfg):
    """Differential: the same corrupt checkpoint into two converted twins, one with the
    check's hooks removed (torch's own load, which copies what fits and raises after).
    Where torch raises, the check raises first and nothing changed: params, buffers
    and masters. Where torch loads, the check loads the same bits, except that it
    refuses inf/NaN in a trainable param (torch would load it). The one exception: keys
    under a module with its own `_load_from_state_dict` (here `custom`, which renames an
    old key) are torch's to judge, after it has copied the rest."""
    src, _, _ = _convert(mode, cfg, 0)
    saved = {k: v.float() if v.is_floating_point() else v for k, v in src.state_dict().items()}
    outcomes = set()
    for seed in range(40):
        rng = random.Random(seed)
        sd = copy.deepcopy(saved)
        kind = _model_corruptions(sd, rng)
        strict, assign = rng.random() < 0.7, rng.random() < 0.2
        net, opt, _ = _convert(mode, cfg, 1)
        twin, twin_opt, twin_model = _convert(mode, cfg, 1)
        for h in twin_model._load_guards:
            h.remove()
        before = _model_leaves(net, opt)
        torch_error = ours = None
        try:
            twin.load_state_dict(copy.deepcopy(sd), strict=strict, assign=assign)
        except RuntimeError as e:
            torch_error = e
        try:
            net.load_state_dict(copy.deepcopy(sd), strict=strict, assign=assign)
        except RuntimeError as e:  # the check's error is a ValueError and a RuntimeError
            ours = e
        where = (seed, kind, strict, assign, str(ours)[:200], str(torch_error)[:200])
        if isinstance(ours, ValueError):
            assert all(map(_identical, before, _model_leaves(net, opt))), where
            assert torch_error is not None or "inf/NaN" in str(ours), where
            outcomes.add("refused")
        elif torch_error is not None:  # only where a module loads itself: torch's to check
            assert str(ours) == str(torch_error), where
            keys = [k for k in re.findall(r"\b[a-z_]\w*(?:\.\w+)+", str(torch_error))
                    if not k.startswith("torch.")]  # the keys it names
            assert keys and all(k.startswith("custom.") for k in keys), where
            outcomes.add("torch's")
        else:
            assert all(map(_identical, _model_leaves(twin, twin_opt), _model_leaves(net, opt))
                       ), where
            outcomes.add("loaded")
    assert outcomes == {"refused", "loaded", "torch's"}


def _model_leaves(net, opt):
    return ([t.detach().clone() for t in net.state_dict().values()]
            + [m.detach().clone() for _, m in opt._pairs])


def _identical(a, b):  # bit for bit, NaN included
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
        b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8))


@pytest.mark.parametrize("mode, cfg", [("torch", {}), ("naive", {"initial_scale": 2.0**8})])
def test_a_parent_round_trips_and_checks_the_converted_part(mode, cfg):
    # DDP(model) or any module holding the AmpModel: its state_dict has the wrapped
    # module's keys under "module." (AmpModel.state_dict), and its load used to look
    # for "module.module.*" (missing keys: no round trip). A child named "module" too.
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 2)

    def parent(seed):
        torch.manual_seed(seed)
        net = Net()
        model, opt, _ = mpfunc_torch.convert_to_amp(net, torch.optim.AdamW(net.parameters()),
                                                    mode=mode, **cfg)
        holder = torch.nn.Module()
        holder.module = model
        return holder, net, opt

    src, src_net, _ = parent(0)
    saved = copy.deepcopy(src.state_dict())
    assert sorted(saved) == ["module.head.bias", "module.head.weight", "module.module.bias",
                             "module.module.weight"]
    dst, net, opt = parent(1)
    bad = {**saved, "module.head.weight": saved["module.head.weight"][:1]}
    before = _model_leaves(net, opt)
    with pytest.raises(ValueError, match="nothing was loaded.*size mismatch for head.weight"):
        dst.load_state_dict(bad)
    assert all(map(_identical, before, _model_leaves(net, opt)))
    dst.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(src_net.state_dict().values(),
                                                 net.state_dict().values()))
    compiled = torch.compile(dst.module, backend="eager")  # another parent: _orig_mod.*
    assert compiled.load_state_dict(compiled.state_dict()).missing_keys == []


def test_numpy_and_tensor_hyperparameters_load_and_a_numpy_nan_is_refused():
    # A schedule that writes np.float32 / tensor values into the groups: torch loads
    # them and steps, so the check must take them as numbers and booleans.
    np = pytest.importorskip("numpy")
    net, src = _fresh(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    _train(net, src, 2)
    ck = src.state_dict()
    ck["optimizer"]["param_groups"][0].update(lr=np.float32(5e-3), amsgrad=np.bool_(False),
                                              weight_decay=torch.tensor(0.01))
    net2, opt = _fresh(lambda ps: torch.optim.AdamW(ps, lr=1e-2), seed=1)
    opt.load_state_dict(copy.deepcopy(ck))
    _train(net2, opt, 1)
    assert opt.param_groups[0]["lr"] == np.float32(5e-3)
    ck["optimizer"]["param_groups"][0]["lr"] = np.float32("nan")
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="\\['lr'\\]` is np.float32\\(nan\\)"):
        opt.load_state_dict(ck)
    assert _same(before, opt.state_dict())


def test_a_ddp_wrapped_model_round_trips_and_is_seen_through(gloo_world):
    # The README's order: convert, then DistributedDataParallel(model) (1 gloo rank).
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model, opt, _ = mpfunc_torch.convert_to_amp(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                                mode="apex", opt_level="O1", verbosity=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    saved = copy.deepcopy(ddp.state_dict())
    assert sorted(saved) == ["module.0.bias", "module.0.weight", "module.1.bias",
                             "module.1.weight"]
    with torch.no_grad():
        net[0].weight.add_(1.0)
    with pytest.raises(ValueError, match="nothing was loaded.*size mismatch for 1.weight"):
        ddp.load_state_dict({**saved, "module.1.weight": saved["module.1.weight"][:1]})
    assert not torch.equal(net[0].weight, saved["module.0.weight"])  # nothing copied
    ddp.load_state_dict(saved)
    assert torch.equal(net[0].weight, saved["module.0.weight"])
    _, recompute = mpfunc_torch.checkpoint_context_fn(ddp)()
    assert type(recompute).__name__ == "Fp32Functions"  # O1's list, through DDP
