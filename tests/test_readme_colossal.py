"""The Colossal-AI migration table (docs/migration.md) runs: each row's torch and JAX lines give the
plan that its Colossal-AI line asks for (read by tests/colossal_seed.py from the seed
tutorials, not from mpfunc's table)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from colossal_seed import AMP_TYPE, SEED_SIGNATURES, available_booster_names, interpret
from doc_cells import cell_code

import mpfunc
import mpfunc_torch
from _mpfunc_common.amp_config import resolve_amp

PAGE = Path(__file__).resolve().parents[1] / "docs" / "migration.md"
HEADER = "| Colossal-AI | mpfunc_torch | mpfunc (JAX) |"


def table_rows():
    lines = PAGE.read_text().splitlines()
    start = lines.index(HEADER) + 2  # skip the header and the --- line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, line
        codes = []
        for cell in cells:
            code = cell_code(cell)
            assert code, f"each cell is one code span: {cell!r}"
            codes.append(code)
        rows.append(tuple(codes))
    return rows


ROWS = table_rows()


def test_the_table_covers_every_colossal_spelling():
    colossal = "\n".join(r[0] for r in ROWS)
    for name in available_booster_names():
        assert f'Booster(mixed_precision="{name}")' in colossal, name
    for cls in SEED_SIGNATURES:
        assert f"Booster(mixed_precision={cls}(" in colossal, cls
    for member in AMP_TYPE:
        assert f"AMP_TYPE.{member.name}" in colossal, member
    assert "booster.backward(loss, optimizer)" in colossal
    assert "CONFIG = dict(fp16=dict(mode=AMP_TYPE" in colossal


def torch_parts():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return dict(model=model, optimizer=optimizer, criterion=torch.nn.CrossEntropyLoss(),
                dataloader=[(torch.randn(2, 4), torch.tensor([0, 1]))],
                lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))


def apply_fn(params, x):
    return x @ params["w"]


CONVERSIONS = [r for r in ROWS if not r[0].startswith("booster.backward")]


@pytest.mark.parametrize("colossal, torch_line, jax_line", CONVERSIONS, ids=lambda s: s[:60])
def test_each_row_converts_to_the_plan_colossal_asks_for(colossal, torch_line, jax_line, capsys):
    (mode, config), colossal_ns = interpret(colossal)
    expected = resolve_amp(mode, config)
    extra = {"CONFIG": colossal_ns["CONFIG"]} if "CONFIG" in colossal_ns else {}

    parts = torch_parts()
    result = eval(torch_line, {"mpfunc_torch": mpfunc_torch, **parts, **extra})
    optimizer = next(x for x in result if isinstance(x, mpfunc_torch.AmpOptimizer))
    assert optimizer.plan == expected
    assert isinstance(result[0], mpfunc_torch.AmpModel) and result[0].plan == expected
    if "dataloader, lr_scheduler" in torch_line:  # boost: they pass through
        assert result[3] is parts["dataloader"] and result[4] is parts["lr_scheduler"]
    elif len(result) == 5:
        assert result[3:] == (None, None)

    setup = eval(jax_line, {"mpfunc": mpfunc, "apply_fn": apply_fn, "tx": optax.sgd(0.1),
                            **extra})
    assert isinstance(setup, mpfunc.AmpSetup) and setup.plan == expected
    capsys.readouterr()  # apex's default verbosity prints the plan


def test_the_backward_row():
    (row,) = [r for r in ROWS if r[0].startswith("booster.backward")]
    _, torch_line, jax_line = row
    # torch: the loss is scaled, then back-propagated.
    parts = torch_parts()
    model, optimizer, criterion, *_ = mpfunc_torch.boost(
        parts["model"], parts["optimizer"], parts["criterion"],
        mixed_precision=mpfunc_torch.FP16TorchMixedPrecision(init_scale=1024.0))
    x, y = parts["dataloader"][0]
    loss = criterion(model(x), y)
    plain = torch.autograd.grad(loss, list(parts["model"].parameters()), retain_graph=True)
    exec(torch_line, {"mpfunc_torch": mpfunc_torch, "loss": loss, "optimizer": optimizer})
    for p, g in zip(parts["model"].parameters(), plain):
        torch.testing.assert_close(p.grad, 1024.0 * g)
    assert bool(optimizer.step())
    # JAX: the gradient of the scaled loss.
    amp = mpfunc.convert_to_amp(apply_fn, optax.sgd(0.1),
                                mixed_precision=mpfunc.FP16TorchMixedPrecision(init_scale=1024.0))
    params = {"w": jnp.arange(12.0).reshape(4, 3) / 10}
    opt_state = amp.optimizer.init(params)
    xj = jnp.ones((2, 4))

    def loss_fn(p):
        return jnp.mean(amp.apply_fn(p, xj) ** 2)

    grads = eval(jax_line, {"jax": jax, "mpfunc": mpfunc, "loss_fn": loss_fn,
                            "opt_state": opt_state, "params": params})
    np.testing.assert_allclose(grads["w"], 1024.0 * jax.grad(loss_fn)(params)["w"], rtol=1e-6)
