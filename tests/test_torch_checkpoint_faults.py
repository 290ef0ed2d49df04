"""Fault injection into `AmpOptimizer` checkpoints (mpfunc_torch._src.checkpoint): random
corruptions are refused whole or load and train finite, and a state saved by one
implementation of an optimizer (foreach, fused) resumes in another."""

import copy
import random

import pytest
import torch
from test_torch_checkpoint import _fresh, _same, _train
from torch_task import tiny_batch, tiny_model

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

