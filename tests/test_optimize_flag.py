"""Both packages import and train under ``python -OO``, where every docstring is None.

Docstrings are literals: a shared rule (`UPDATE_RULE`, `QUANTIZE_RULE`, `LEAF_RULE`,
`CANCEL_RULE`) is written out in each docstring that shows it, and the tests below hold
each copy to the shared text word for word, instead of building the docstring at import
time (which fails under ``-OO`` and hides the text from static tools and IDEs).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One step each: a JAX step through dynamic_scale (its jit, the finite check, the
# update) and a torch step through convert_to_amp (scale, backward, unscale, step).
_PROGRAM = textwrap.dedent("""
    import sys
    assert sys.flags.optimize == 2, sys.flags.optimize
    import jax, jax.numpy as jnp, optax, torch
    import mpfunc, mpfunc_torch
    assert mpfunc.dynamic_scale.__doc__ is None          # -OO really stripped them

    opt = mpfunc.dynamic_scale(optax.sgd(0.1))
    params = {"w": jnp.ones(3)}
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: mpfunc.scale_loss(jnp.sum(p["w"] ** 2), state))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state)
    print("jax", params["w"].tolist(), bool(state.last_finite))

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    model, optimizer, criterion = mpfunc_torch.convert_to_amp(
        net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.MSELoss(), mode="torch")
    before = net.weight.detach().clone()
    loss = criterion(model(torch.ones(4, 3)), torch.zeros(4, 2))
    optimizer.backward(loss)
    optimizer.step()
    m = optimizer.scale_metrics(as_python=True)
    print("torch", bool((net.weight != before).any()), m["last_finite"])
""")


@pytest.mark.slow  # a child importing everything under -OO, about 20 s; the docstring checks of this file stay
def test_imports_and_trains_under_python_OO():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-OO", "-c", _PROGRAM], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines == ["jax [0.800000011920929, 0.800000011920929, 0.800000011920929] True",
                     "torch True True"], out.stdout


def _own_modules():
    for pkg in ("mpfunc", "mpfunc_torch", "_mpfunc_common"):
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_no_docstring_is_built_at_import_time():
    """No module assigns ``X.__doc__`` at its top level (where ``-OO`` makes it None)."""
    found = []
    for path in _own_modules():
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "__doc__" for t in targets):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found


def _normalized(text):
    return [line.strip() for line in text.splitlines() if line.strip()]


def _contains(doc, rule):
    lines, rule = _normalized(doc), _normalized(rule)
    starts = [i for i, line in enumerate(lines) if line == rule[0]]
    return any(lines[i:i + len(rule)] == rule for i in starts)


@pytest.mark.skipif(sys.flags.optimize >= 2, reason="docstrings are stripped under -OO")
@pytest.mark.parametrize("rule", ["UPDATE_RULE", "QUANTIZE_RULE", "LEAF_RULE", "CANCEL_RULE"])
def test_shared_rules_are_written_out_word_for_word(rule):
    import mpfunc
    import mpfunc_torch
    from _mpfunc_common import fp8, precision_report, scale_config

    text = {"UPDATE_RULE": scale_config.UPDATE_RULE, "QUANTIZE_RULE": fp8.QUANTIZE_RULE,
            "LEAF_RULE": precision_report.LEAF_RULE,
            "CANCEL_RULE": precision_report.CANCEL_RULE}[rule]
    docs = {
        "UPDATE_RULE": (mpfunc.dynamic_scale, mpfunc_torch.LossScaler),
        "QUANTIZE_RULE": (mpfunc.quantize_fp8, mpfunc_torch.quantize_fp8),
        "LEAF_RULE": (mpfunc.precision_report, mpfunc_torch.precision_report),
        "CANCEL_RULE": (mpfunc.precision_report, mpfunc_torch.precision_report),
    }[rule]
    for obj in docs:
        assert _contains(obj.__doc__, text), f"{obj.__module__}.{obj.__qualname__}"
