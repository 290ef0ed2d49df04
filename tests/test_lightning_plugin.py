"""`mpfunc_torch.lightning.AmpPrecision` inside real Lightning ``Trainer.fit`` runs (tiny
model, CPU), in every mode: the loss falls, a planted inf skips one step with nothing
changed, clipping sees unscaled gradients, accumulation, logging, exact resumption; with
both Lightning packages (``pytorch_lightning`` and ``lightning``)."""

from __future__ import annotations

import copy
import functools
import importlib
import logging
import warnings

import pytest
import torch

from mpfunc_torch.lightning import AmpPrecision

PACKAGES = ["pytorch_lightning", "lightning.pytorch"]
for _name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric"):
    logging.getLogger(_name).setLevel(logging.ERROR)  # "GPU available: False", tips

MODES = [  # (mode, config): small initial scales, so that only the planted inf skips
    ("torch", {"init_scale": 2.0**8}),
    ("torch", {"init_scale": 2.0**8, "dtype": "bfloat16"}),
    ("apex", {"opt_level": "O1", "verbosity": 0, "loss_scale": 2.0**8}),
    ("apex", {"opt_level": "O2", "verbosity": 0, "max_loss_scale": 2.0**8}),
    ("apex", {"opt_level": "O3", "verbosity": 0}),
    ("naive", {"initial_scale": 2.0**8}),
    ("bf16", {}),
    ("fp8", {}),
]
DEFAULT = {"torch", "naive"}  # every other mode runs in the slow suite


def mode_id(m):
    return "-".join([m[0], *(str(v) for k, v in m[1].items() if k in ("opt_level", "dtype"))])


PARAMS = [pytest.param(m, c, id=mode_id((m, c)),
                       marks=() if (m in DEFAULT and "dtype" not in c) else pytest.mark.slow)
          for m, c in MODES]


@functools.cache
def package(name):
    return importlib.import_module(name)


@functools.cache
def classes(name):
    """The test module and callbacks, for one Lightning package."""
    L = package(name)

    class Net(L.LightningModule):
        def __init__(self, plant_at=None, lr=1e-2, optim="adamw", manual=False):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32),
                                           torch.nn.ReLU(), torch.nn.Linear(32, 1))
            self.plant_at, self.lr, self.optim = plant_at, lr, optim
            self.automatic_optimization = not manual
            self.losses = []

        def forward(self, x):
            return self.net(x)

        def loss(self, batch):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x).float(), y.float())
            if self.plant_at is not None and self.global_step == self.plant_at:
                loss = loss * float("inf")
            self.losses.append(loss.detach())
            return loss

        def training_step(self, batch, batch_idx):
            if self.automatic_optimization:
                return self.loss(batch)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.loss(batch))
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()

        def configure_optimizers(self):
            if self.optim == "sgd":
                return torch.optim.SGD(self.parameters(), lr=self.lr)
            fused = self.optim == "fused"
            return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-4, fused=fused)

    class Watch(L.Callback):
        """Everything the optimizer owns, before and after each step."""

        def __init__(self):
            self.before, self.after, self.skipped = {}, {}, {}

        def snapshot(self, trainer):
            opt = trainer.strategy.precision_plugin.optimizers[0]
            return {
                "model": copy.deepcopy(trainer.lightning_module.state_dict()),
                "owned": [p.detach().clone() for g in opt.param_groups for p in g["params"]],
                "state": copy.deepcopy(opt.optimizer.state_dict()["state"]),
            }

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            step = trainer.global_step
            self.before[step] = self.snapshot(trainer)
            self.skipped[step] = int(trainer.strategy.precision_plugin.scale_metrics()[
                "skipped_steps"])

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.after[trainer.global_step - 1] = self.snapshot(trainer)

    return Net, Watch


def loader(batch=8, n=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def trainer(name="pytorch_lightning", **kw):
    L = package(name)
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=1, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kw)


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("mode, cfg", PARAMS)
def test_every_mode_trains_skips_a_planted_inf_and_resumes_exactly(mode, cfg, tmp_path):
    Net, Watch = classes("pytorch_lightning")
    L = package("pytorch_lightning")

    def every_3_steps(folder):
        return L.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=3,
                                           save_top_k=-1)

    watch = Watch()
    plugin = AmpPrecision(mode, **cfg)
    net = Net(plant_at=2)  # 3 batches an epoch: the checkpoint after step 2 ends epoch 0
    trainer(max_steps=6, plugins=[plugin], callbacks=[watch, every_3_steps(tmp_path)],
            enable_checkpointing=True).fit(net, loader())
    losses = [float(v) for v in net.losses]
    assert losses[2] == float("inf")
    assert sum(losses[4:]) / 2 < sum(losses[:2]) / 2 - 0.5, losses  # it learns
    # Step 2 (the planted inf) is skipped: model, masters and optimizer state unchanged.
    assert same(watch.before[2], watch.after[2])
    assert watch.skipped[3] == watch.skipped[2] + 1
    for step in (1, 3):  # the steps around it do train
        assert not same(watch.before[step]["model"], watch.after[step]["model"])
    assert plugin.optimizers[0].optimizer.state_dict()["state"]  # it has state
    # Resume from the checkpoint taken right after the skip: same params, scale, counts.
    path = next(tmp_path.glob("*step=3.ckpt"))
    resumed_plugin = AmpPrecision(mode, **cfg)
    resumed = Net(plant_at=2)
    with warnings.catch_warnings():  # the folder holds the checkpoint resumed from
        warnings.filterwarnings("ignore", "Checkpoint directory .* exists", UserWarning)
        trainer(max_steps=6, plugins=[resumed_plugin], enable_checkpointing=True,
                callbacks=[every_3_steps(tmp_path)]).fit(resumed, loader(), ckpt_path=path)
    assert same(resumed.state_dict(), net.state_dict())
    assert same([p for g in resumed_plugin.optimizers[0].param_groups for p in g["params"]],
                [p for g in plugin.optimizers[0].param_groups for p in g["params"]])
    assert same(resumed_plugin.optimizers[0].state_dict()["scalers"],
                plugin.optimizers[0].state_dict()["scalers"])
    assert resumed_plugin.scale_metrics(as_python=True)["skipped_steps"] == 1


def test_the_lightning_package_takes_the_same_class(tmp_path):
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("the `lightning` package is not installed")
    L = package("lightning.pytorch")
    plugin = AmpPrecision("naive", initial_scale=2.0**8)
    assert isinstance(plugin, L.plugins.precision.Precision)
    assert isinstance(plugin, package("pytorch_lightning").plugins.precision.Precision)
    Net, Watch = classes("lightning.pytorch")
    net, watch = Net(plant_at=1), Watch()
    trainer("lightning.pytorch", max_steps=4, plugins=[plugin], callbacks=[watch],
            gradient_clip_val=0.5).fit(net, loader())
    assert type(trainer("lightning.pytorch").strategy).__module__.startswith("lightning.")
    assert same(watch.before[1], watch.after[1]) and watch.skipped[2] == 1
    assert not same(watch.before[2]["model"], watch.after[2]["model"])
    assert net.net[0].weight.dtype == torch.float16
    ckpt = tmp_path / "l.ckpt"
    t = trainer("lightning.pytorch", max_steps=5, plugins=[AmpPrecision("naive",
                                                                       initial_scale=2.0**8)])
    again = Net(plant_at=1)
    t.fit(again, loader())
    t.save_checkpoint(ckpt)
    loaded = torch.load(ckpt, weights_only=True)
    assert loaded["AmpPrecision"] == {"mode": "naive", "opt_level": None}
    (state,) = loaded["optimizer_states"]
    assert state["mode"] == "naive" and state["master_weights"][0].dtype == torch.float32
