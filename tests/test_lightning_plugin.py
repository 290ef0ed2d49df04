"""`mpfunc_torch.lightning.AmpPrecision` inside real Lightning ``Trainer.fit`` runs (tiny
model, CPU), in every mode: the loss falls, a planted inf skips one step with nothing
changed, clipping sees unscaled gradients, accumulation, logging, exact resumption; with
both Lightning packages (``pytorch_lightning`` and ``lightning``). Lightning's own
transformer example (its demo ``Transformer``, tests/lightning_example.py) in every mode:
a float32 loss in its steps, exact resumption where Lightning's float32 resumes exactly,
and Lightning's DDP strategies (2 gloo processes in the slow suite, 1 rank here)."""

from __future__ import annotations

import copy
import functools
import importlib
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning_example import LanguageModel, run
from lightning_example import loader as example_loader
from torch_task import TRAINER_MODES, same

from mpfunc_torch.lightning import AmpPrecision

PACKAGES = ["pytorch_lightning", "lightning.pytorch"]
for _name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric"):
    logging.getLogger(_name).setLevel(logging.ERROR)  # "GPU available: False", tips

MODES = TRAINER_MODES


def mode_id(m):
    return "-".join([m[0], *(str(v) for k, v in m[1].items() if k in ("opt_level", "dtype"))])


PARAMS = [pytest.param(m, c, id=mode_id((m, c))) for m, c in MODES]  # ~1 s each


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


def test_bf16_without_float32_masters_trains_bf16_params_and_resumes_exactly(tmp_path):
    Net, _ = classes("pytorch_lightning")
    L = package("pytorch_lightning")
    cfg = {"master_weights": "remainder", "state_dtype": "bfloat16", "seed": 3}

    def fit(ckpt_path=None):
        plugin, net = AmpPrecision("bf16", **cfg), Net(plant_at=4)
        with warnings.catch_warnings():  # the folder holds the checkpoint resumed from
            warnings.filterwarnings("ignore", "Checkpoint directory .* exists", UserWarning)
            trainer(max_steps=6, plugins=[plugin], enable_checkpointing=True,
                    callbacks=[L.callbacks.ModelCheckpoint(
                        dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)],
                    ).fit(net, loader(), ckpt_path=ckpt_path)
        return plugin, net

    plugin, net = fit()
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16}
    assert plugin.scale_metrics(as_python=True)["skipped_steps"] == 1  # the planted inf
    saved = plugin.optimizers[0].state_dict()
    assert saved["low_precision"]["storage"] == "remainder" and saved["low_precision"]["step"] == 5
    resumed_plugin, resumed = fit(next(tmp_path.glob("*step=3.ckpt")))  # end of epoch 0
    assert same(resumed.state_dict(), net.state_dict())
    assert same(resumed_plugin.optimizers[0].state_dict(), saved)  # remainders, state


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


def step_change(mode, cfg, batch=8, **trainer_kw):
    """One SGD(lr=1) step: the change of what the optimizer owns, which is minus the
    (clipped) unscaled gradient; and that gradient as the hooks saw it."""
    Net, _ = classes("pytorch_lightning")
    L = package("pytorch_lightning")
    seen = {}

    class Grads(L.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            seen["grads"] = [p.grad.clone() for g in optimizer.param_groups
                             for p in g["params"]]

    plugin = AmpPrecision(mode, **cfg)
    net = Net(lr=1.0, optim="sgd")
    owned = None

    class Before(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            nonlocal owned
            owned = [p.detach().clone() for p in plugin.main_params(plugin.optimizers[0])]

    trainer(max_steps=1, plugins=[plugin], callbacks=[Grads(), Before()],
            **trainer_kw).fit(net, loader(batch=batch))
    after = [p.detach() for p in plugin.main_params(plugin.optimizers[0])]
    return [b - a for a, b in zip(after, owned)], seen["grads"]


@pytest.mark.parametrize("mode, cfg", [("torch", {"init_scale": 2.0**10}),
                                       ("naive", {"initial_scale": 2.0**10})])
def test_gradient_clip_val_clips_the_unscaled_gradients_by_their_global_norm(mode, cfg):
    delta, grads = step_change(mode, cfg, gradient_clip_val=0.5)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm > 5  # the hooks saw the unscaled gradients (times 1024 they would be huge)
    assert norm < 1e3
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in delta]))
    assert float(total) == pytest.approx(0.5, rel=1e-3)  # one global norm, after unscaling
    for d, g in zip(delta, grads):  # every gradient scaled by the same factor
        assert torch.allclose(d, g * (0.5 / norm), rtol=1e-3, atol=1e-6)
    by_value, _ = step_change(mode, cfg, gradient_clip_val=0.01,
                              gradient_clip_algorithm="value")
    assert max(float(d.abs().max()) for d in by_value) == pytest.approx(0.01, rel=1e-3)


@pytest.mark.parametrize("mode, cfg", [("torch", {"init_scale": 2.0**10}),
                                       ("naive", {"initial_scale": 2.0**10})])
def test_accumulate_grad_batches_scales_each_micro_batch_and_unscales_once(mode, cfg):
    # Two micro-batches of 8 are one batch of 16: Lightning divides each loss by 2.
    accumulated, _ = step_change(mode, cfg, accumulate_grad_batches=2)
    whole, _ = step_change(mode, cfg, batch=16)
    for a, w in zip(accumulated, whole):
        assert torch.allclose(a, w, rtol=1e-2, atol=1e-4)
        assert float(a.abs().max()) > 1e-3


def test_the_step_reads_nothing_from_the_device_and_the_scale_is_logged(tmp_path):
    # With a fused optimizer the step decides skips on the device: with no logger and no
    # progress bar, no training step reads a value from the device (.item(), bool(),
    # ...); Lightning reads a few when it sets up the data, outside the steps.
    from torch.utils._python_dispatch import TorchDispatchMode

    L = package("pytorch_lightning")
    reads = []

    class Reads(TorchDispatchMode):
        in_step = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default,
                        torch.ops.aten.nonzero.default):
                reads.append(Reads.in_step)
            return func(*args, **(kwargs or {}))

    class Window(L.Callback):
        def on_train_batch_start(self, *args):
            Reads.in_step = True

        def on_train_batch_end(self, *args):
            Reads.in_step = False

    Net, _ = classes("pytorch_lightning")
    plugin = AmpPrecision("torch", init_scale=2.0**8)
    t = trainer(max_steps=4, plugins=[plugin], callbacks=[Window()])
    with Reads():
        t.fit(Net(optim="fused", plant_at=1), loader())
    assert reads and not any(reads)  # reads outside the steps only
    assert plugin.scale_metrics(as_python=True)["skipped_steps"] == 1
    assert isinstance(t.callback_metrics["loss_scale"], torch.Tensor)
    # A logger reads them at its logging steps: one row per step, the planted skip in it.
    L = package("pytorch_lightning")
    plugin = AmpPrecision("naive", initial_scale=2.0**8)
    logger = L.loggers.CSVLogger(tmp_path, name="run", version=0)
    trainer(max_steps=5, plugins=[plugin], logger=logger, log_every_n_steps=1).fit(
        Net(plant_at=2), loader())
    rows = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().split()
    header, *rows = [r.split(",") for r in rows]
    got = [(int(r[header.index("step")]), float(r[header.index("loss_scale")]),
            float(r[header.index("skipped_steps")])) for r in rows]
    assert got == [(0, 256.0, 0.0), (1, 256.0, 0.0), (2, 256.0, 1.0), (3, 256.0, 1.0),
                   (4, 256.0, 1.0)]


def test_scale_metrics_on_the_plugin():
    plugin = AmpPrecision("naive", initial_scale=2.0**8, hysteresis=1)
    with pytest.raises(RuntimeError, match="AmpPrecision.scale_metrics: nothing is "
                                           "converted yet"):
        plugin.scale_metrics()
    Net, _ = classes("pytorch_lightning")
    trainer(max_steps=3, plugins=[plugin]).fit(Net(plant_at=1), loader())
    metrics = plugin.scale_metrics()
    assert isinstance(metrics["loss_scale"], torch.Tensor)
    assert plugin.scale_metrics(as_python=True) == {
        "loss_scale": 128.0, "skipped_steps": 1, "consecutive_skips": 0, "last_finite": True}


def test_manual_optimization_and_validation_after_the_fit():
    Net, Watch = classes("pytorch_lightning")

    class WithVal(Net):
        def validation_step(self, batch, batch_idx):
            self.val_dtypes = (self(batch[0]).dtype, batch[0].dtype)

    plugin = AmpPrecision("naive", initial_scale=2.0**8)
    net, watch = WithVal(plant_at=1, manual=True), Watch()
    t = trainer(max_steps=3, plugins=[plugin], callbacks=[watch], limit_val_batches=1)
    t.fit(net, loader(), loader())
    assert same(watch.before[1], watch.after[1]) and watch.skipped[2] == 1
    assert not same(watch.before[2]["model"], watch.after[2]["model"])
    opt = plugin.optimizers[0]
    t.validate(net, loader(), verbose=False)
    assert plugin.optimizers[0] is opt  # nothing converted again
    # The batch arrives in float16; naive mode's model returns float32 outputs.
    assert net.val_dtypes == (torch.float32, torch.float16)
    assert net.net[0].weight.dtype == torch.float16


def test_precision_flag_with_the_plugin_is_refused_by_lightning():
    with pytest.raises(ValueError, match=r"Received both `precision=16-mixed` and "
                                         r"`plugins=AmpPrecision\('naive'\)`. Choose one."):
        trainer(precision="16-mixed", plugins=[AmpPrecision("naive")])


def test_bad_arguments_are_clear_errors(gloo_world):
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['init_scale'\] for mode "
                                         "'naive'"):
        AmpPrecision("naive", init_scale=2.0)  # torch's spelling, not naive's
    with pytest.raises(ValueError, match=r"`mode` must be one of"):
        AmpPrecision("fp16-mixed")
    with pytest.raises(TypeError, match="`log_metrics` must be a bool"):
        AmpPrecision("torch", log_metrics=1)
    with pytest.raises(ValueError, match="`mode` is None; name the mode"):
        AmpPrecision(None)
    plugin = AmpPrecision("naive", initial_scale=2.0**8)
    Net, _ = classes("pytorch_lightning")
    net = Net()
    t = trainer(max_steps=1, plugins=[plugin])
    t.fit(net, loader())
    with pytest.raises(TypeError, match=r"`optimizer` \(SGD\) is not one AmpPrecision "
                                        "converted"):
        plugin.clip_gradients(torch.optim.SGD(torch.nn.Linear(2, 2).parameters()), 1.0)
    with pytest.raises(ValueError, match="`gradient_clip_algorithm` must be 'norm' or 'value'"):
        plugin.clip_gradients(plugin.optimizers[0], 1.0, "max")
    with pytest.raises(ValueError, match="already converted this model in an earlier fit"):
        trainer(max_steps=2, plugins=[plugin]).fit(net, loader())
    with pytest.raises(ValueError, match=r"trained with AmpPrecision mode 'naive', and this "
                                         r"plugin's mode is 'apex' O2"):
        AmpPrecision("apex", opt_level="O2").load_state_dict(plugin.state_dict())
    # A wrapper that holds hooks on the float32 params (DDP) with a mode that casts them.
    fresh = Net()
    ddp = torch.nn.parallel.DistributedDataParallel(fresh)
    with pytest.raises(ValueError, match=r"casts the params to float16, but the strategy "
                                         r"wrapped the model in DistributedDataParallel"):
        AmpPrecision("naive").connect(ddp, [torch.optim.SGD(fresh.parameters(), lr=0.1)], [])
    assert fresh.net[0].weight.dtype == torch.float32  # nothing was changed


# ---------------------------------------------------------------------------------------
# Lightning's transformer example (tests/lightning_example.py): the demo Transformer makes
# float32 tensors in its forward, and the loss is computed in training_step.

def example_fit(plugin, ckpt_path=None, callbacks=(), plant=None, **kw):
    """Fits the example for 2 epochs of 3 batches (no shuffling, no dropout); returns the
    model, the trainer, and everything that must resume: params and the optimizer's
    state (with `AmpPrecision`: masters, inner state, loss scale and counters)."""
    L = package("pytorch_lightning")
    net = LanguageModel(plant=plant)
    kw.setdefault("max_epochs", 2)
    saves = any(isinstance(c, L.callbacks.ModelCheckpoint) for c in callbacks)
    t = trainer(plugins=None if plugin is None else [plugin], callbacks=list(callbacks),
                enable_checkpointing=saves, limit_val_batches=1, **kw)
    t.fit(net, example_loader(world=1), example_loader(world=1), ckpt_path=ckpt_path)
    return net, t, {"model": net.state_dict(), "optimizer": t.optimizers[0].state_dict()}


def every_epoch(folder):
    L = package("pytorch_lightning")
    return L.callbacks.ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)


@pytest.mark.parametrize("mode, cfg", PARAMS)
def test_the_lightning_example_trains_with_a_float32_loss_and_resumes_exactly(mode, cfg,
                                                                             tmp_path):
    # naive, apex O2 and O3 failed in Lightning's sanity validation step before ("expected
    # m1 and m2 to have the same dtype"), and naive's loss in training_step was float16.
    net, t, state = example_fit(AmpPrecision(mode, **cfg), plant=(0, 4),
                                callbacks=[every_epoch(tmp_path)])
    # apex O3 is pure float16 (no float32 function list); every other mode's loss in
    # training_step and validation_step is float32
    loss_dtype = torch.float16 if cfg.get("opt_level") == "O3" else torch.float32
    assert net.dtypes == {"train": loss_dtype, "validation": loss_dtype}
    losses = [float(v) for v in net.losses]
    assert losses[4] == float("inf")  # planted at step 4 (epoch 1), skipped
    assert (losses[3] + losses[5]) / 2 < sum(losses[:3]) / 3 - 0.2, losses  # it learns
    assert t.strategy.precision_plugin.scale_metrics(as_python=True)["skipped_steps"] == 1
    # Resumed from the end of epoch 0, bit for bit: params, masters, optimizer state,
    # loss scale and counters (the planted skip happens after the resume).
    with warnings.catch_warnings():  # the folder holds the checkpoint resumed from
        warnings.filterwarnings("ignore", "Checkpoint directory .* exists", UserWarning)
        again, t2, resumed = example_fit(AmpPrecision(mode, **cfg), plant=(0, 4),
                                         ckpt_path=next(tmp_path.glob("epoch=0-*.ckpt")),
                                         callbacks=[every_epoch(tmp_path)])
    assert same(resumed, state)
    t2.test(again, example_loader(world=1), verbose=False)
    t2.predict(again, example_loader(world=1))
    assert again.dtypes["test"] == again.dtypes["predict"] == loss_dtype


@pytest.mark.slow  # 6 fits, ~10 s: it checks Lightning itself, which the docs describe
def test_lightning_itself_resumes_float32_exactly_only_from_an_epoch_boundary(tmp_path):
    L = package("pytorch_lightning")

    class Seen(L.Callback):
        def __init__(self):
            self.seen = []  # (global step, the batch's first token)

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.seen.append((trainer.global_step, int(batch[0][0, 0])))

    def fit(ckpt_path=None, callbacks=(), **kw):
        seen = Seen()
        with warnings.catch_warnings():  # the resumed fits have no checkpoint callbacks
            warnings.filterwarnings("ignore", "Be aware that when using `ckpt_path`")
            _, t, state = example_fit(None, ckpt_path, [seen, *callbacks], **kw)
        return state, seen.seen, t

    mid = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "mid", every_n_train_steps=4,
                                      save_top_k=-1)
    ref, seen, _ = fit(callbacks=[every_epoch(tmp_path / "epoch"), mid])
    epoch_end = next((tmp_path / "epoch").glob("epoch=0-*.ckpt"))
    assert same(fit(epoch_end)[0], ref)
    _, _, t = fit(max_epochs=1)  # a fit that ended at an epoch boundary: exact too
    t.save_checkpoint(tmp_path / "epoch_end.ckpt")
    assert same(fit(tmp_path / "epoch_end.ckpt")[0], ref)
    # Mid-epoch (after step 4, the 2nd batch of epoch 1): the plain DataLoader restarts
    # the epoch's data, and the epoch ends after the batches it had left. Lightning warns.
    not_resumable = "ended before the epoch ended and your dataloader is not resumable"
    with pytest.warns(UserWarning, match=not_resumable):
        state, resumed, _ = fit(next((tmp_path / "mid").glob("*step=4.ckpt")))
    assert not same(state, ref)
    assert resumed == [(4, seen[3][1]), (5, seen[4][1])] + seen[6:]
    # trainer.save_checkpoint after a fit that max_steps stopped mid-epoch: the resumed
    # fit counts the stopped epoch as done and goes on with the next one (here there is
    # none: the 2 steps left of epoch 1 never run); no warning.
    _, _, t = fit(max_steps=4)
    t.save_checkpoint(tmp_path / "stopped.ckpt")
    state, resumed, _ = fit(tmp_path / "stopped.ckpt")
    assert not same(state, ref)
    assert resumed == []


# The variables Lightning's launcher sets in the process that runs a "ddp" fit.
_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED")


@pytest.fixture
def launcher_env():
    """The environment as it was, after a "ddp" fit in this process (Lightning's launcher
    sets LOCAL_RANK, MASTER_PORT, ..., which later trainers, HF's too, would read)."""
    saved = dict(os.environ)
    for var in _LAUNCH_ENV:
        os.environ.pop(var, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("mode", ["naive", "O2"])
def test_ddp_casts_before_the_wrap_on_one_gloo_rank(mode, gloo_world, launcher_env):
    # The code path of Lightning's DDP on 1 rank: the plugin casts the params in
    # convert_module, DDP wraps the float16 model, the masters start from the float32
    # values kept for them. One rank averages nothing: bit for bit the single-device run.
    # (No DistributedSampler: Lightning's shuffles the training data under DDP.)
    ddp = run(mode, "ddp", devices=1, plant=(0, 2), use_distributed_sampler=False)
    single = run(mode, "auto", devices=1, plant=(0, 2))
    assert (ddp["wrapped"], single["wrapped"]) == ("DistributedDataParallel", "LanguageModel")
    assert ddp["params"]["model.decoder.weight"].dtype == torch.float16
    assert ddp["owned"][0].dtype == torch.float32
    assert same(ddp["params"], single["params"]) and same(ddp["owned"], single["owned"])
    assert ddp["metrics"]["skipped_steps"] == 1
    assert same(ddp["around"]["before"], ddp["around"]["after"])


def test_ddp_casts_bf16_params_without_float32_masters_ahead(gloo_world, launcher_env):
    # As above, with bf16's remainders: the cast before DDP's wrap keeps the float32
    # values, from which the remainders start, so the run is the single-device one's.
    ddp = run("bf16-remainder", "ddp", devices=1, plant=(0, 2), use_distributed_sampler=False)
    single = run("bf16-remainder", "auto", devices=1, plant=(0, 2))
    assert ddp["wrapped"] == "DistributedDataParallel"
    assert ddp["params"]["model.decoder.weight"].dtype == torch.bfloat16
    assert same(ddp["params"], single["params"]) and ddp["losses"] == single["losses"]
    assert ddp["metrics"]["skipped_steps"] == 1
    before, after = ddp["around"]["before"], ddp["around"]["after"]
    assert same(before["model"], after["model"]) and same(before["state"], after["state"])


def launch_example(out: Path, strategy: str, modes: list[str]) -> dict:
    """Runs tests/lightning_example.py with ``strategy`` on 2 CPU processes; returns each
    mode's two ranks' results."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMP_NUM_THREADS="1")
    for var in _LAUNCH_ENV:
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("lightning_example.py")),
                           str(out), strategy, *modes], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {m: [torch.load(out / f"{m}-{r}.pt", weights_only=False) for r in (0, 1)]
            for m in modes}


@pytest.mark.slow  # 2 processes, ~20 s a mode on a loaded 2-core CPU
@pytest.mark.parametrize("strategy, modes", [("ddp", ["naive", "O2", "O3", "O1", "torch"]),
                                             ("ddp_spawn", ["naive"])])
def test_lightning_ddp_on_two_gloo_processes(strategy, modes, tmp_path):
    # Under "ddp" the ranks build different models (their own seeds): DDP broadcasts rank
    # 0's params when it wraps the model, and the plugin rank 0's float32 values for the
    # masters (without that, naive's ranks' params differed after the first step).
    for mode, (r0, r1) in launch_example(tmp_path, strategy, modes).items():
        assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
        assert r0["wrapped"] == "DistributedDataParallel"
        half = mode in ("naive", "O2", "O3")
        assert (r0["params"]["model.decoder.weight"].dtype == torch.float16) == half
        assert same(r0["params"], r1["params"]) and same(r0["owned"], r1["owned"]), mode
        # rank 1 alone planted an inf at step 2: both ranks skipped it, nothing changed
        assert r1["losses"][2] == float("inf") and r0["losses"][2] != float("inf")
        for r in (r0, r1):
            assert r["metrics"]["skipped_steps"] == 1, mode
            assert same(r["around"]["before"], r["around"]["after"]), mode
        # it learns: each rank's loss falls by 0.40-0.48 in most modes. Apex O3 (Adam's
        # state in float16) learns slowly, and one rank's 3-batch mean is noise at that
        # pace (0.13 and 0.02 on one machine, 0.18 and -0.01 on another), so for O3 the
        # mean over the ranks, the loss DDP minimises, must fall.
        fell = [sum(r["losses"][:2]) / 2 - sum(r["losses"][3:]) / 3 for r in (r0, r1)]
        if mode == "O3":
            assert sum(fell) / 2 > 0, (mode, fell)
        else:
            assert min(fell) > 0.3, (mode, fell)
