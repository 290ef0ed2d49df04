"""HuggingFace's Trainer: its own ``fp16=True`` against `AmpTrainer` (naive, and torch /
bf16), on GPT-2 small: peak GPU memory during training and the median step time.

GPT-2 small (HuggingFace's default ``GPT2Config``: 124M params, random init, nothing
downloaded), batch 8 x 1024 tokens on CUDA. Each variant is a fresh model and Trainer
in this process, one after another (the memory is released and the peak counters reset
between them); the peak is ``torch.cuda.max_memory_allocated`` from the end of the
warm-up steps to the end of the run (params, gradients, optimizer state, masters and
activations of the training steps), the step time the median of the timed steps
(``torch.cuda.synchronize`` at each step's start and end). ``--time-budget`` bounds the
whole run: each variant stops early when its share is spent. On CPU (a small config,
``--tiny``) there is no peak counter: the peak is null and only the times are reported.

The issue's target: naive peaks at most 0.85x the memory of ``fp16=True``, at the same
step time or better.

    python benchmarks/hf_trainer.py --device cuda --time-budget 60 --json out.json
    python benchmarks/hf_trainer.py --tiny --steps 4      # CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import tempfile
import time

import torch
import transformers

from mpfunc_torch.transformers import AmpTrainer

VARIANTS = {  # name -> (Trainer precision options, amp_mode, amp_config)
    "Trainer fp16=True": ({"fp16": True}, None, None),
    "AmpTrainer naive": ({}, "naive", {"initial_scale": 2.0**16}),
    "AmpTrainer torch": ({}, "torch", {}),
    "AmpTrainer bf16": ({}, "bf16", {}),
}


class Timer(transformers.TrainerCallback):
    """Step times, the peak after warm-up, and a stop when the time share is spent."""

    def __init__(self, warmup: int, deadline: float, cuda: bool):
        self.warmup, self.deadline, self.cuda = warmup, deadline, cuda
        self.times: list[float] = []
        self.t0 = 0.0

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kw):
        self._sync()
        if state.global_step == self.warmup and self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self._sync()
        if state.global_step > self.warmup:
            self.times.append(time.perf_counter() - self.t0)
        if time.perf_counter() > self.deadline and len(self.times) >= 2:
            control.should_training_stop = True


def model_config(args) -> transformers.GPT2Config:
    if args.tiny:
        return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                       n_positions=args.seq)
    return transformers.GPT2Config(n_positions=max(1024, args.seq))  # GPT-2 small


def run_variant(name, args, deadline) -> dict:
    precision, mode, config = VARIANTS[name]
    cuda = args.device == "cuda"
    torch.manual_seed(0)
    cfg = model_config(args)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (args.batch * (args.steps + 1), args.seq))
    data = [{"input_ids": x, "labels": x} for x in ids]
    timer = Timer(args.warmup, deadline, cuda)
    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
            learning_rate=1e-4, logging_steps=args.steps, save_strategy="no", report_to=[],
            disable_tqdm=True, log_level="error", use_cpu=not cuda,
            dataloader_pin_memory=cuda, **precision)
        kwargs = dict(model=model, args=targs, train_dataset=data, callbacks=[timer])
        if mode is None:
            trainer = transformers.Trainer(**kwargs)
        else:
            trainer = AmpTrainer(**kwargs, amp_mode=mode, amp_config=config)
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.train()
    peak = torch.cuda.max_memory_allocated() if cuda else None
    skipped = trainer.scale_metrics(as_python=True)["skipped_steps"] if mode else None
    row = {"variant": name, "peak_bytes": peak,
           "peak_gib": None if peak is None else peak / 2**30,
           "median_step_ms": 1e3 * statistics.median(timer.times) if timer.times else None,
           "timed_steps": len(timer.times), "skipped_steps": skipped,
           "params": sum(p.numel() for p in model.parameters())}
    del trainer, model, data
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2 (for CPU)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=14, help="steps per variant (at most)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--time-budget", type=float, default=60.0,
                    help="seconds for the whole run; each variant stops at its share")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU")
    if args.tiny:
        args.seq = min(args.seq, 64)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if args.warmup >= args.steps:
        ap.error("--warmup must be below --steps")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    start, rows = time.perf_counter(), []
    for i, name in enumerate(names):
        share = (args.time_budget - (time.perf_counter() - start)) / (len(names) - i)
        rows.append(run_variant(name, args, time.perf_counter() + share))
    base = next((r for r in rows if r["variant"] == "Trainer fp16=True"), None)
    for r in rows:
        if base and base["peak_bytes"] and r["peak_bytes"]:
            r["peak_vs_fp16"] = r["peak_bytes"] / base["peak_bytes"]
        if base and base["median_step_ms"] and r["median_step_ms"]:
            r["step_time_vs_fp16"] = r["median_step_ms"] / base["median_step_ms"]
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    result = {"device": device or platform.machine(), "torch": torch.__version__,
              "transformers": transformers.__version__, "batch": args.batch,
              "seq": args.seq, "tiny": args.tiny, "seconds": time.perf_counter() - start,
              "rows": rows}
    print(f"GPT-2 {'tiny' if args.tiny else 'small'}, batch {args.batch} x {args.seq}, "
          f"{result['device']}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}")
    print("| variant | peak GiB | vs fp16=True | median step ms | vs fp16=True | skipped |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        def fmt(v, spec):
            return "n/a" if v is None else format(v, spec)

        print(f"| {r['variant']} | {fmt(r['peak_gib'], '.2f')} | "
              f"{fmt(r.get('peak_vs_fp16'), '.3f')} | {fmt(r['median_step_ms'], '.1f')} | "
              f"{fmt(r.get('step_time_vs_fp16'), '.3f')} | {fmt(r['skipped_steps'], 'd')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
