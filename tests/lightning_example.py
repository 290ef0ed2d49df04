"""Lightning's examples/pytorch/basics/transformer.py as a `LanguageModel` on the demo
``Transformer`` (tests/test_lightning_plugin.py trains it in one process), and, run as a
script, that model under Lightning's own DDP strategies with `AmpPrecision` on 2 CPU
processes over gloo.

Usage: python lightning_example.py OUTDIR STRATEGY MODE [MODE ...]

MODE is a key of `MODES`. STRATEGY is ``ddp`` (Lightning starts rank 1 by running this
script again; each rank builds its model with its own seed) or ``ddp_spawn`` (Lightning
spawns both ranks from one model). The model trains 2 epochs of 3 batches per rank
(Lightning's ``DistributedSampler``, which shuffles with a fixed seed); rank 1 alone plants an inf in its
loss at step 2. Each rank saves ``OUTDIR/MODE-RANK.pt``: its losses, scale metrics, final
params and float32 masters, and everything the optimizer owns before and after step 2.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import warnings
from pathlib import Path

import pytorch_lightning as L  # noqa: N812
import torch
import torch.nn.functional as F  # noqa: N812
from pytorch_lightning.demos import Transformer

from mpfunc_torch.lightning import AmpPrecision

PLANT_STEP, PLANT_RANK, VOCAB = 2, 1, 50
MODES = {"naive": ("naive", {"initial_scale": 2.0**8}),
         "O1": ("apex", {"opt_level": "O1", "verbosity": 0, "loss_scale": 2.0**8}),
         "O2": ("apex", {"opt_level": "O2", "verbosity": 0, "max_loss_scale": 2.0**8}),
         "O3": ("apex", {"opt_level": "O3", "verbosity": 0}),
         "torch": ("torch", {"init_scale": 2.0**8}),
         "bf16-remainder": ("bf16", {"master_weights": "remainder"})}


class LanguageModel(L.LightningModule):
    """Lightning's examples/pytorch/basics/transformer.py, on the demo Transformer
    (small, no dropout), with Adam; it records each step's loss dtype in ``dtypes``, and
    with ``plant=(rank, step)`` that rank plants an inf in its loss at that step."""

    def __init__(self, seed: int = 0, plant: tuple[int, int] | None = None):
        super().__init__()
        torch.manual_seed(seed)
        self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1,
                                 dropout=0.0)
        self.plant, self.losses, self.dtypes = plant, [], {}

    def loss(self, batch, step: str):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.dtypes[step] = loss.dtype
        return loss

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch, "train")
        if (self.global_rank, self.global_step) == self.plant:
            loss = loss * float("inf")
        self.losses.append(loss.detach().float())
        return loss

    def validation_step(self, batch, batch_idx):
        return self.loss(batch, "validation")

    def test_step(self, batch, batch_idx):
        return self.loss(batch, "test")

    def predict_step(self, batch, batch_idx):
        return self.loss(batch, "predict")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2, eps=1e-4)


def loader(world: int = 2, batch: int = 4) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (3 * world * batch, 11), generator=g)
    dataset = torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=False)


class Record(L.Callback):
    """Everything the optimizer owns around the planted step, and the result at the end,
    saved by each rank."""

    def __init__(self, path: Path | None):
        self.path, self.around, self.result = path, {}, {}

    def snapshot(self, trainer):
        opt = trainer.strategy.precision_plugin.optimizers[0]
        return {"model": copy.deepcopy(trainer.lightning_module.state_dict()),
                "owned": [p.detach().clone() for g in opt.param_groups for p in g["params"]],
                "state": copy.deepcopy(opt.optimizer.state_dict()["state"])}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == PLANT_STEP:
            self.around["before"] = self.snapshot(trainer)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == PLANT_STEP + 1:
            self.around["after"] = self.snapshot(trainer)

    def on_train_end(self, trainer, module):
        plugin = trainer.strategy.precision_plugin
        opt = plugin.optimizers[0]
        self.result = {
            "rank": trainer.global_rank, "world": trainer.world_size,
            "wrapped": type(trainer.strategy.model).__name__,
            "losses": [float(v) for v in module.losses],
            "metrics": plugin.scale_metrics(as_python=True),
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "owned": [p.detach().clone() for g in opt.param_groups for p in g["params"]],
            "around": self.around}
        if self.path is not None:
            torch.save(self.result, self.path.with_name(
                f"{self.path.name}-{trainer.global_rank}.pt"))


def run(mode: str, strategy: str = "ddp", devices: int = 2, out: Path | None = None,
        plant: tuple[int, int] | None = (PLANT_RANK, PLANT_STEP), **trainer_kw) -> dict:
    """Fits the model for 2 epochs with ``strategy`` on ``devices`` CPU processes;
    returns this rank's result (also saved under ``out``)."""
    name, cfg = MODES[mode]
    record = Record(None if out is None else out / mode)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                        max_epochs=2, plugins=[AmpPrecision(name, **cfg)],
                        callbacks=[record], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=1, num_sanity_val_steps=0, **trainer_kw)
    # With "ddp" each rank builds its own model: rank 1's differs (DDP broadcasts rank
    # 0's params, and the plugin rank 0's float32 values for the masters).
    seed = int(os.environ.get("LOCAL_RANK", 0)) if strategy == "ddp" else 0
    trainer.fit(LanguageModel(seed, plant), loader(world=devices), loader(world=devices))
    return record.result


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # Lightning's tips about workers and logging
    for package in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(package).setLevel(logging.ERROR)
    out_dir, strategy_name, *modes = sys.argv[1:]
    for m in modes:
        run(m, strategy_name, out=Path(out_dir))
