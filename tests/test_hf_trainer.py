"""`mpfunc_torch.transformers.AmpTrainer` in real ``Trainer.train`` runs of a tiny GPT-2
(random init, CPU), in every mode: the loss falls, a planted inf skips one step with
nothing changed and the LR schedule waits, clipping and accumulation on unscaled
gradients, the scale in the log history, exact resumption from a checkpoint, a loss
computed outside the model in the mode's precision."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch_task import TRAINER_MODES, same

transformers = pytest.importorskip("transformers")
from mpfunc_torch.transformers import AmpTrainer  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)

MODES = [m for m in TRAINER_MODES if m[1].get("dtype") != "bfloat16"]
DEFAULT = {"torch", "naive"}  # the other modes run in the slow suite (~5 s each)
PARAMS = [pytest.param(m, c, id="-".join([m, *([c["opt_level"]] if "opt_level" in c else [])]),
                       marks=() if m in DEFAULT else pytest.mark.slow) for m, c in MODES]


def gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                  n_positions=32, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    """The same 8 sequences over and over: a tiny GPT-2 learns them within a few steps."""

    def __init__(self, n=48):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(1, 100, (8, 16), generator=g).repeat(n // 8, 1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def args(out, **kw):
    base = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=8,
                learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                disable_tqdm=True, use_cpu=True, adam_epsilon=1e-4, seed=0,
                dataloader_num_workers=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


class Watch(transformers.TrainerCallback):
    """Plants an inf in one gradient at step ``plant_at`` (a hook on the embedding), and
    records what the optimizer owns around every step."""

    def __init__(self, plant_at=None):
        self.plant_at, self.hook = plant_at, None
        self.before, self.after = {}, {}

    @staticmethod
    def snapshot(model, optimizer):
        inner = optimizer.optimizer  # accelerate's wrapper -> the AmpOptimizer
        return {"model": copy.deepcopy(model.state_dict()),
                "owned": [p.detach().clone() for g in inner.param_groups for p in g["params"]],
                "state": copy.deepcopy(inner.optimizer.state_dict()["state"])}

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.before[state.global_step] = self.snapshot(model, optimizer)
        if state.global_step == self.plant_at:
            self.hook = model.transformer.wte.weight.register_hook(lambda g: g * float("inf"))

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
        self.after[state.global_step - 1] = self.snapshot(model, optimizer)
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


def history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "loss" in h]


@pytest.mark.parametrize("mode, cfg", PARAMS)
def test_every_mode_trains_skips_a_planted_inf_and_resumes_exactly(mode, cfg, tmp_path):
    watch = Watch(plant_at=2)
    trainer = AmpTrainer(model=gpt2(), args=args(tmp_path, save_strategy="steps", save_steps=3),
                         train_dataset=Tokens(), callbacks=[watch], amp_mode=mode,
                         amp_config=cfg)
    trainer.train()
    losses = history(trainer, "loss")
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.2, losses  # it learns
    # Step 2 (the planted inf) is skipped: model, masters and optimizer state unchanged.
    assert same(watch.before[2], watch.after[2])
    assert history(trainer, "skipped_steps") == [0, 0, 1, 1, 1, 1]
    for step in (1, 3):  # the steps around it do train
        assert not same(watch.before[step]["model"], watch.after[step]["model"])
    # ... and the LR schedule waits a step, as with the Trainer's own fp16 GradScaler.
    lrs = history(trainer, "learning_rate")
    assert lrs[3] == lrs[2] and lrs[2] < lrs[1] and lrs[4] < lrs[3]
    assert trainer.lr_scheduler.last_epoch == 5
    # Resume from the checkpoint taken right after the skip: same params, scale, counts.
    resumed = AmpTrainer(model=gpt2(seed=1), args=args(tmp_path), train_dataset=Tokens(),
                         amp_mode=mode, amp_config=cfg)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert same(resumed.model.state_dict(), trainer.model.state_dict())
    owned = [[p for g in t.amp_optimizer.param_groups for p in g["params"]]
             for t in (trainer, resumed)]
    assert same(*owned)
    assert same(resumed.amp_optimizer.state_dict()["scalers"],
                trainer.amp_optimizer.state_dict()["scalers"])
    # The resumed log history continues the checkpoint's, with the very same numbers.
    assert history(resumed, "loss") == losses
    assert history(resumed, "skipped_steps") == [0, 0, 1, 1, 1, 1]
    assert history(resumed, "loss_scale") == history(trainer, "loss_scale")
    scaler = torch.load(tmp_path / "checkpoint-3" / "scaler.pt", weights_only=True)
    assert int(scaler["scalers"][0]["skipped_steps"]) == 1


def test_bf16_without_float32_masters_trains_bf16_params_and_resumes_exactly(tmp_path):
    cfg = {"master_weights": "remainder", "state_dtype": "bfloat16", "seed": 3}
    trainer = AmpTrainer(model=gpt2(), args=args(tmp_path, max_steps=4, save_strategy="steps",
                                                  save_steps=2),
                         train_dataset=Tokens(), callbacks=[Watch(plant_at=3)],
                         amp_mode="bf16", amp_config=cfg)
    trainer.train()
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert history(trainer, "skipped_steps") == [0, 0, 0, 1]  # the planted inf
    saved = trainer.amp_optimizer.state_dict()
    assert saved["low_precision"]["storage"] == "remainder" and saved["low_precision"]["step"] == 3
    resumed = AmpTrainer(model=gpt2(seed=1), args=args(tmp_path, max_steps=4),
                         train_dataset=Tokens(), callbacks=[Watch(plant_at=3)],
                         amp_mode="bf16", amp_config=cfg)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert same(resumed.model.state_dict(), trainer.model.state_dict())
    assert same(resumed.amp_optimizer.state_dict(), saved)  # remainders, state, counters


def one_step(tmp_path, mode, cfg, **kw):
    """One SGD(lr=1) step: the change of what the optimizer owns (minus the clipped,
    unscaled gradient), and the grad_norm the Trainer logged."""
    kw = {"max_steps": 1, "optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant",
          **kw}
    trainer = AmpTrainer(model=gpt2(), args=args(tmp_path, **kw), train_dataset=Tokens(),
                         amp_mode=mode, amp_config=cfg)
    trainer.create_optimizer()  # what train() does first; the optimizer is kept
    before = [p.detach().clone() for g in trainer.amp_optimizer.param_groups
              for p in g["params"]]
    trainer.train()
    after = [p.detach() for g in trainer.amp_optimizer.param_groups for p in g["params"]]
    return [a - b for a, b in zip(before, after)], history(trainer, "grad_norm")[0]


@pytest.mark.parametrize("mode, cfg", [("torch", {"init_scale": 2.0**10}),
                                       ("naive", {"initial_scale": 2.0**10})])
def test_max_grad_norm_clips_the_unscaled_gradients_by_their_global_norm(mode, cfg, tmp_path):
    delta, logged = one_step(tmp_path, mode, cfg, max_grad_norm=0.25)
    assert 1.0 < logged < 100  # the unscaled norm (times 1024 if it were scaled)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in delta]))
    assert float(total) == pytest.approx(0.25, rel=1e-3)  # clipped to max_grad_norm
    unclipped, logged_0 = one_step(tmp_path, mode, cfg, max_grad_norm=0.0)
    assert logged_0 == pytest.approx(logged, rel=1e-5)  # the norm is logged unclipped too
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d)
                                                 for d in unclipped]))
    assert float(norm) == pytest.approx(logged, rel=1e-3)
    for d, u in zip(delta, unclipped):  # one factor for every gradient: a global norm
        assert torch.allclose(d, u * (0.25 / logged), rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("mode, cfg", [("torch", {"init_scale": 2.0**10}),
                                       ("naive", {"initial_scale": 2.0**10})])
def test_gradient_accumulation_scales_each_micro_batch_and_unscales_once(mode, cfg, tmp_path):
    # Two micro-batches of 4 are one batch of 8 (the Trainer divides each loss by 2).
    accumulated, n_acc = one_step(tmp_path, mode, cfg, per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2, max_grad_norm=0.0)
    whole, n_whole = one_step(tmp_path, mode, cfg, max_grad_norm=0.0)
    assert n_acc == pytest.approx(n_whole, rel=1e-2)
    for a, w in zip(accumulated, whole):
        assert torch.allclose(a, w, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("mode, cfg, logits", [
    ("torch", {"init_scale": 2.0**8}, torch.float16),
    ("apex", {"opt_level": "O1", "verbosity": 0, "loss_scale": 2.0**8}, torch.float16),
    ("naive", {"initial_scale": 2.0**8}, torch.float32)])
def test_a_loss_computed_outside_the_model_runs_in_the_modes_precision(mode, cfg, logits,
                                                                       tmp_path):
    # `compute_loss_func` gets the model's outputs (float16 logits under autocast) and
    # runs inside the Trainer's compute_loss_context_manager, which carries the mode's
    # autocast and function mode: a float32 loss. Before, torch's and O1's was float16.
    seen = []

    def loss_fn(outputs, labels, num_items_in_batch=None):
        out = outputs.logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                 labels[:, 1:].reshape(-1))
        seen.append((out.dtype, loss.dtype))
        return loss

    trainer = AmpTrainer(model=gpt2(), args=args(tmp_path, max_steps=2),
                         train_dataset=Tokens(), amp_mode=mode, amp_config=cfg,
                         compute_loss_func=loss_fn)
    trainer.train()
    assert set(seen) == {(logits, torch.float32)}


def test_scale_metrics_and_the_optimizer_after_train(tmp_path):
    trainer = AmpTrainer(model=gpt2(), args=args(tmp_path, max_steps=2),
                         train_dataset=Tokens(), callbacks=[Watch(plant_at=0)],
                         amp_mode="naive", amp_config={"initial_scale": 2.0**8,
                                                       "hysteresis": 1,
                                                       # the plain rule: one halving
                                                       "warm_start": False})
    with pytest.raises(RuntimeError, match="AmpTrainer.scale_metrics: nothing is converted"):
        trainer.scale_metrics()
    trainer.train()
    assert isinstance(trainer.scale_metrics()["loss_scale"], torch.Tensor)
    assert trainer.scale_metrics(as_python=True) == {
        "loss_scale": 128.0, "skipped_steps": 1, "consecutive_skips": 0, "last_finite": True}
    assert trainer.model.transformer.wte.weight.dtype == torch.float16
    opt = trainer.amp_optimizer
    trainer.train()  # a second train() keeps the converted model and optimizer
    assert trainer.amp_optimizer is opt


@pytest.mark.parametrize("option", ["fp16", "fp16_full_eval", "bf16"])
def test_the_trainers_own_precision_options_are_refused(option, tmp_path):
    with pytest.raises(ValueError, match=rf"`{option}=True` \(TrainingArguments\) and "
                                         rf"`amp_mode='naive'` both set the precision: .*"
                                         rf"Drop `{option}=True`"):
        AmpTrainer(model=gpt2(), args=args(tmp_path, **{option: True}), amp_mode="naive")


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['initial_scale'\] for "
                                         "mode 'torch'"):
        AmpTrainer(model=gpt2(), args=args(tmp_path), amp_mode="torch",
                   amp_config={"initial_scale": 8.0})
    with pytest.raises(TypeError, match="the mode's keys must be a dict, got list"):
        AmpTrainer(model=gpt2(), args=args(tmp_path), amp_mode="torch", amp_config=[1])
    with pytest.raises(ValueError, match="`amp_mode` is None; name the mode"):
        AmpTrainer(model=gpt2(), args=args(tmp_path), amp_mode=None)
    with pytest.raises(TypeError, match="amp_mode"):
        AmpTrainer(model=gpt2(), args=args(tmp_path))  # the mode is required
    trainer = AmpTrainer(model=gpt2(), args=args(tmp_path), amp_mode="naive")
    with pytest.raises(ValueError, match="AmpTrainer converts `self.model`; the Trainer asked"):
        trainer.create_optimizer(model=torch.nn.Linear(2, 2))
    trainer.create_optimizer()
    with pytest.raises(ValueError, match="`scaler.pt` holds"):
        trainer.accelerator.scaler.load_state_dict({"format": "mpfunc_torch.AmpTrainer",
                                                    "scalers": []})
