"""The fp8 mode trains the compare_modes transformer as well as bf16, in both frameworks.

Same architecture, initial weights and batches on both sides (examples/compare_modes.py).
The fp8 mode's final train loss (mean of the last 10 steps) must be within 2% of the
bf16 mode's over the same steps (measured: about 0.1%, see the README). A poisoned
step (loss times inf) is skipped at the same step in both frameworks and leaves the
params as they were. A delayed-scaling run saved mid-way and resumed continues bit for
bit, amax histories included.
"""

import functools
import io
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import mpfunc
import mpfunc_torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from compare_modes import jax_apply, torch_model, torch_to_jax_params  # noqa: E402
from data import load_corpus, split, windows  # noqa: E402

pytestmark = pytest.mark.slow

@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The suite runs one pytest worker per core: more torch threads only oversubscribe
    # (13x slower measured on a busy 2-core machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CFG = types.SimpleNamespace(width=64, heads=4, layers=2, context=32, batch=16, seed=0,
                            lr=3e-3)
STEPS, POISON = 40, 25
TOLERANCE = 0.02


def batches(n=STEPS):
    it = windows(split(load_corpus())[0], CFG.context + 1, CFG.batch, seed=CFG.seed)
    return [(s[:, :-1].astype(np.int32), s[:, 1:].astype(np.int32))
            for s, _ in (next(it) for _ in range(n))]


def final(losses):
    return float(np.mean(losses[-10:]))


# --------------------------------------------------------------------------- JAX
@functools.cache
def jax_step(mode, recipe=None, layers=CFG.layers):
    """The mode's amp setup and jitted train step (built once per config: compiling
    the fp8 transformer step is the slow part of these tests)."""
    cfg = types.SimpleNamespace(**{**vars(CFG), "layers": layers})
    config = {"recipe": recipe} if recipe else {}
    amp = mpfunc.convert_to_amp(jax_apply(cfg), optax.adam(CFG.lr), mode=mode, **config)
    delayed = recipe is not None and recipe.delayed

    def loss_fn(p, s, x, y, poison):
        kw = {"fp8_state": s} if delayed else {}
        logits = amp.apply_fn(p, x, **kw)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * poison

    @jax.jit
    def step(state, x, y, poison):
        params, opt_state, fp8 = state
        with jax.numpy_dtype_promotion("standard"):
            loss, (g, new_fp8) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
                params, fp8, x, y, poison)
            updates, opt_state = amp.optimizer.update(g, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state, new_fp8), loss

    def init(x):
        torch.manual_seed(CFG.seed)
        params = jax.tree.map(jnp.asarray, torch_to_jax_params(torch_model(cfg)))
        fp8 = amp.apply_fn.init(params, x) if delayed else None
        return params, amp.optimizer.init(params), fp8

    return step, init


def jax_train(mode, data, poison_at=None, recipe=None, state=None, layers=CFG.layers):
    step, init = jax_step(mode, recipe, layers)
    state = init(data[0][0]) if state is None else state
    losses, params_before = [], []
    for i, (x, y) in enumerate(data):
        params_before.append(state[0])
        state, loss = step(state, x, y, jnp.float32(jnp.inf if i == poison_at else 1.0))
        losses.append(float(loss))
    return losses, state, params_before + [state[0]]


def test_jax_fp8_trains_like_bf16_and_skips_the_same_step():
    data = batches()
    bf16, s_bf16, _ = jax_train("bf16", data, poison_at=POISON)
    fp8, s_fp8, before = jax_train("fp8", data, poison_at=POISON)
    assert abs(final(fp8) - final(bf16)) / final(bf16) < TOLERANCE, (final(fp8), final(bf16))
    assert final(fp8) < fp8[0] - 1.0  # it learns (from ~4.9)
    for s in (s_bf16, s_fp8):
        assert int(mpfunc.scale_metrics(s[1])["skipped_steps"]) == 1
    # The poisoned step left the params exactly as they were (and only that one).
    same = [all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before[i]),
                                                     jax.tree.leaves(before[i + 1])))
            for i in range(STEPS)]
    assert [i for i, s in enumerate(same) if s] == [POISON]


def test_jax_delayed_resume_continues_exactly(tmp_path):
    recipe = mpfunc.Fp8Recipe("delayed", amax_history_len=4)
    data = batches(10)
    full, state_full, _ = jax_train("fp8", data, recipe=recipe, layers=1)
    half, state_half, _ = jax_train("fp8", data[:6], recipe=recipe, layers=1)
    leaves, treedef = jax.tree.flatten(state_half)
    np.savez(tmp_path / "ckpt.npz", *[np.asarray(x) for x in leaves])
    with np.load(tmp_path / "ckpt.npz") as f:
        restored = jax.tree.unflatten(treedef, [jnp.asarray(f[k]) for k in f.files])
    rest, state_rest, _ = jax_train("fp8", data[6:], recipe=recipe, state=restored, layers=1)
    assert half + rest == full
    for a, b in zip(jax.tree.leaves(state_rest), jax.tree.leaves(state_full)):
        np.testing.assert_array_equal(a, b)
    hist = state_full[2]["blocks/qkv/w"].input.amax_history  # one per (scanned) layer
    assert hist.shape == (1, 4) and (np.asarray(hist) > 0).all()  # a full, rolled window


# ------------------------------------------------------------------------- torch
def torch_setup(mode, **config):
    torch.manual_seed(CFG.seed)
    net = torch_model(CFG)
    opt = torch.optim.Adam(net.parameters(), lr=CFG.lr)
    return mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(), mode=mode,
                                       **config)


def torch_train(model, opt, crit, data, poison_at=None):
    losses, snapshots = [], {}
    for i, (x, y) in enumerate(data):
        snapshots[i] = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        loss = crit(model(torch.from_numpy(x).long()).flatten(0, 1),
                    torch.from_numpy(y).long().flatten())
        if i == poison_at:
            loss = loss * float("inf")
        opt.backward(loss)
        stepped = bool(opt.step())
        assert stepped == (i != poison_at)
        losses.append(float(loss.detach()))
    return losses, snapshots


def test_torch_fp8_trains_like_bf16_and_skips_the_same_step():
    data = batches()
    bf16, _ = torch_train(*torch_setup("bf16"), data, poison_at=POISON)
    model, opt, crit = torch_setup("fp8")
    assert sum(isinstance(m, mpfunc_torch.Fp8Linear) for m in model.modules()) == 9
    fp8, snaps = torch_train(model, opt, crit, data, poison_at=POISON)
    assert abs(final(fp8) - final(bf16)) / final(bf16) < TOLERANCE, (final(fp8), final(bf16))
    assert final(fp8) < fp8[0] - 1.0
    assert opt.scale_metrics(as_python=True)["skipped_steps"] == 1
    for a, b in zip(snaps[POISON], snaps[POISON + 1]):
        assert torch.equal(a, b)


def test_torch_delayed_resume_continues_exactly():
    recipe = mpfunc_torch.Fp8Recipe("delayed", amax_history_len=4)
    data = batches(10)
    model, opt, crit = torch_setup("fp8", recipe=recipe)
    torch_train(model, opt, crit, data[:6])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    full, _ = torch_train(model, opt, crit, data[6:])
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert (ckpt["model"]["blocks.0.qkv.fp8_amax_history_input"] > 0).all()
    model2, opt2, crit2 = torch_setup("fp8", recipe=recipe)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    rest, _ = torch_train(model2, opt2, crit2, data[6:])
    assert rest == full
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), k
