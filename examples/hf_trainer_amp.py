"""HuggingFace: a tiny GPT-2 trained by `AmpTrainer` in every mode of mpfunc_torch.

`AmpTrainer` is the `transformers.Trainer` with `amp_mode` and `amp_config`. Each mode
trains the same model (random init, nothing downloaded) on repeated sequences, with
`max_grad_norm` clipping; a callback plants an inf in one step's gradients. The table
shows the loss falling, the planted step skipped with the learning rate held (as the
Trainer's own fp16 does), and the scale from `state.log_history`. Then a run resumes
from the checkpoint written right after the skip and matches the uninterrupted one.

    python examples/hf_trainer_amp.py [--quick]
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch
import transformers

from mpfunc_torch.transformers import AmpTrainer

PLANT = 2
# naive starts at 2**16, a scale this model never overflows at, so that the planted inf
# is the only skipped step (from the default 2**32 the warm start skips 2 or 3 more).
MODES = [("torch", {}), ("apex", {"opt_level": "O2", "verbosity": 0}),
         ("naive", {"initial_scale": 2.0**16}), ("bf16", {}), ("fp8", {})]
logging.getLogger("transformers").setLevel(logging.ERROR)


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def dataset(n=64):
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(1, 128, (8, 32), generator=g).repeat(n // 8, 1)
    return [{"input_ids": s, "labels": s} for s in seqs]


class PlantInf(transformers.TrainerCallback):
    """An inf in the embedding's gradient at step PLANT; records whether it changed."""

    hook = before = None

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step == PLANT:
            self.before = [p.detach().clone() for p in model.parameters()]
            self.hook = model.transformer.wte.weight.register_hook(lambda g: g * float("inf"))

    def on_step_end(self, args, state, control, model=None, **kw):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
            self.unchanged = all(torch.equal(a, b)
                                 for a, b in zip(self.before, model.parameters()))


def arguments(out, steps, **kw):
    kw = {"save_strategy": "no", **kw}
    return transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
        max_grad_norm=1.0, logging_steps=1, report_to=[], disable_tqdm=True,
        log_level="error", dataloader_pin_memory=torch.cuda.is_available(), **kw)


def quiet(trainer):
    """The trainer, without the callback that prints every log line."""
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    return trainer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    steps = 8 if args.quick else 40
    print(f"| mode | first loss | last loss | step {PLANT + 1} (inf planted) | learning rate "
          "around it | skipped | loss scale |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode, cfg in MODES:
        with tempfile.TemporaryDirectory() as out:
            plant = PlantInf()
            trainer = quiet(AmpTrainer(model=gpt2(), args=arguments(out, steps),
                                       train_dataset=dataset(), callbacks=[plant],
                                       amp_mode=mode, amp_config=cfg))
            trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        lrs = " -> ".join(f"{h['learning_rate']:.2e}" for h in logs[PLANT - 1:PLANT + 2])
        name = mode + (f" {cfg['opt_level']}" if "opt_level" in cfg else "")
        print(f"| {name} | {logs[0]['loss']:.3f} | {logs[-1]['loss']:.3f} | "
              f"{'skipped, params unchanged' if plant.unchanged else 'params CHANGED'} | "
              f"{lrs} | {logs[-1]['skipped_steps']} | {logs[-1]['loss_scale']:g} |")

    with tempfile.TemporaryDirectory() as out:
        full = quiet(AmpTrainer(model=gpt2(), train_dataset=dataset(), callbacks=[PlantInf()],
                                args=arguments(out, steps, save_strategy="steps",
                                               save_steps=PLANT + 1),
                                amp_mode="naive", amp_config={"initial_scale": 2.0**16}))
        full.train()
        resumed = quiet(AmpTrainer(model=gpt2(), args=arguments(out, steps),
                                   train_dataset=dataset(), amp_mode="naive",
                                   amp_config={"initial_scale": 2.0**16}))
        resumed.train(resume_from_checkpoint=f"{out}/checkpoint-{PLANT + 1}")
    same = all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(),
                                                full.model.parameters()))
    a, b = (t.scale_metrics(as_python=True) for t in (resumed, full))
    print(f"\nresumed from checkpoint-{PLANT + 1} (naive): params as the uninterrupted run: "
          f"{same}; scale {a['loss_scale']:g} vs {b['loss_scale']:g}; skipped "
          f"{a['skipped_steps']} vs {b['skipped_steps']}")


if __name__ == "__main__":
    main()
