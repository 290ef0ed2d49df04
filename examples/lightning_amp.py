"""Lightning: every mode of mpfunc_torch in a real `Trainer.fit`, with `AmpPrecision`.

A small character model (next byte of stdlib source) trains in each mode with
gradient clipping; one step gets an inf planted in its loss. The table shows the loss
falling, the planted step skipped (params unchanged), the loss scale, and the memory
the params and float32 masters take. Then a fit stops after the skip, and a new
Trainer resumes from its checkpoint: the same params, scale and skip count as the run
that went through.

    python examples/lightning_amp.py [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import VOCAB, load_corpus, windows  # noqa: E402

try:
    import pytorch_lightning as pl
except ModuleNotFoundError:  # the `lightning` package has the same Trainer
    import lightning.pytorch as pl

from mpfunc_torch.lightning import AmpPrecision  # noqa: E402

CONTEXT, PLANT = 8, 3
# naive starts at 2**16, a scale this model never overflows at, so that the planted inf
# is the only skipped step (from the default 2**32 the warm start skips 2 or 3 more).
MODES = [("torch", {}), ("apex", {"opt_level": "O1", "verbosity": 0}),
         ("apex", {"opt_level": "O2", "verbosity": 0}), ("naive", {"initial_scale": 2.0**16}),
         ("bf16", {}), ("fp8", {})]
for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
    logging.getLogger(name).setLevel(logging.ERROR)
# Not ours: pytorch_lightning 2.6's data loader wrapper uses a deprecated torch API.
warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)`", FutureWarning)


class CharModel(pl.LightningModule):
    def __init__(self, plant_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(VOCAB, 16), torch.nn.Flatten(),
            torch.nn.Linear(CONTEXT * 16, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
            torch.nn.Linear(128, VOCAB))
        self.plant_at, self.losses = plant_at, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x).float(), y)
        if self.global_step == self.plant_at:
            loss = loss * float("inf")  # the planted overflow
        self.losses.append(loss.detach())  # read after the fit: no host read per step
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def loader(batches, batch=64):
    """An epoch of ``batches`` batches, in the same order every epoch."""
    it = windows(load_corpus(100_000), CONTEXT + 1, batch, seed=0)
    seqs = torch.cat([torch.from_numpy(next(it)[0]) for _ in range(batches)])
    data = torch.utils.data.TensorDataset(seqs[:, :CONTEXT].long(), seqs[:, CONTEXT].long())
    return torch.utils.data.DataLoader(data, batch_size=batch)


def trainer(plugin, steps, device, **kw):
    return pl.Trainer(plugins=[plugin], max_steps=steps, accelerator=device, devices=1,
                      gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kw)


class Watch(pl.Callback):
    """The params before and after the planted step."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == PLANT:
            self.before = [p.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == PLANT + 1:
            self.unchanged = all(torch.equal(a, b)
                                 for a, b in zip(self.before, module.parameters()))


def kib(tensors):
    return sum(t.numel() * t.element_size() for t in tensors) / 1024


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args(argv)
    steps = 12 if args.quick else 60
    data = loader(PLANT + 1)  # the epoch ends right after the planted step
    print(f"| mode | first loss | last loss | step {PLANT} (inf planted) | skipped | "
          "loss scale | params KiB | float32 masters KiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, cfg in MODES:
        plugin, model, watch = AmpPrecision(mode, **cfg), CharModel(PLANT), Watch()
        trainer(plugin, steps, args.device, callbacks=[watch],
                enable_checkpointing=False).fit(model, data)
        m = plugin.scale_metrics(as_python=True)
        owned = [p for g in plugin.optimizers[0].param_groups for p in g["params"]]
        masters = [p for p in owned if all(p is not q for q in model.parameters())]
        name = mode + (f" {cfg['opt_level']}" if "opt_level" in cfg else "")
        step = "skipped, params unchanged" if watch.unchanged else "params CHANGED"
        print(f"| {name} | {float(model.losses[0]):.3f} | {float(model.losses[-1]):.3f} | "
              f"{step} | "
              f"{m['skipped_steps']} | {m['loss_scale']:g} | {kib(model.parameters()):.1f} | "
              f"{kib(masters):.1f} |")

    # Resume: a run checkpoints every epoch (the first ends right after the skip); a new
    # Trainer resumes from that first checkpoint and runs to the same step count.
    with tempfile.TemporaryDirectory() as folder:
        cfg = {"initial_scale": 2.0**16}

        def each_epoch():
            # Saved at the epoch's last batch (a save at on_train_epoch_end resumes into
            # a repeat of the epoch's first batch in Lightning 2.6).
            return pl.callbacks.ModelCheckpoint(dirpath=folder, save_top_k=-1,
                                                every_n_train_steps=PLANT + 1)

        full_plugin, full = AmpPrecision("naive", **cfg), CharModel(PLANT)
        trainer(full_plugin, steps, args.device, callbacks=[each_epoch()]).fit(full, data)
        plugin, resumed = AmpPrecision("naive", **cfg), CharModel(PLANT)
        with warnings.catch_warnings():  # the folder holds the checkpoints: as meant
            warnings.filterwarnings("ignore", "Checkpoint directory .* exists")
            trainer(plugin, steps, args.device, callbacks=[each_epoch()]).fit(
                resumed, data, ckpt_path=f"{folder}/epoch=0-step={PLANT + 1}.ckpt")
        same = all(torch.equal(a, b) for a, b in zip(resumed.parameters(), full.parameters()))
        print(f"\nresumed after the skip (naive): params as the uninterrupted run: {same}; "
              f"scale {plugin.scale_metrics(as_python=True)['loss_scale']:g} vs "
              f"{full_plugin.scale_metrics(as_python=True)['loss_scale']:g}; skipped "
              f"{plugin.scale_metrics(as_python=True)['skipped_steps']} vs "
              f"{full_plugin.scale_metrics(as_python=True)['skipped_steps']}")


if __name__ == "__main__":
    main()
