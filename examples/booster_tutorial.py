"""Colossal-AI's "Auto Mixed Precision Training" tutorial (the Booster API), on mpfunc_torch.

Steps 3 to 5 of the tutorial, line for line where possible. What changed:

- The ViT-B/16 and Caltech101 become a small MLP and synthetic 3x16x16 "images" whose
  labels a fixed random teacher assigns (no download; runs on a CPU).
- No ``colossalai.launch_from_torch`` and no ``TorchDDPPlugin``: mpfunc does the mixed
  precision only, so the dataloader is a plain ``torch.utils.data.DataLoader`` (use
  torch's ``DistributedSampler``/DDP for data parallel).
- ``booster = Booster(mixed_precision=...)`` then ``booster.boost(...)`` is one call,
  ``mpfunc_torch.boost(..., mixed_precision=...)``; ``booster.backward(loss, optimizer)``
  is ``mpfunc_torch.backward(loss, optimizer)``.
- ``LinearWarmupLR`` (colossalai.nn.lr_scheduler) is written below with torch's
  ``LambdaLR``, with Colossal's formula.
- Step 5 as printed in the tutorial iterates ``enumerate(train_dataloader)`` (which
  would bind ``img`` to the batch index) and leaves out ``optimizer.zero_grad()``,
  ``optimizer.step()`` and ``lr_scheduler.step()``; here they are in. ``.cuda()`` is
  ``.to(device)``.

    python examples/booster_tutorial.py [--quick] [--mixed-precision fp16 ...]
"""

from __future__ import annotations

import argparse

import torch

import mpfunc_torch
from mpfunc_torch import FP16TorchMixedPrecision

NUM_CLASSES, IMAGE = 10, (3, 16, 16)


def LinearWarmupLR(optimizer, warmup_steps, total_steps):  # noqa: N802 - Colossal's name
    """colossalai.nn.lr_scheduler.LinearWarmupLR: linear warmup, then linear decay to 0."""
    def factor(epoch):
        if epoch < warmup_steps:
            return (epoch + 1) / (warmup_steps + 1)
        return (total_steps - epoch) / (total_steps - warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def synthetic_dataset(n, seed=0):
    """Images from N(0, 1); labels from a fixed random linear teacher (learnable)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, *IMAGE, generator=g)
    teacher = torch.randn(images[0].numel(), NUM_CLASSES, generator=torch.Generator().manual_seed(99))
    labels = (images.flatten(1) @ teacher).argmax(1)
    return torch.utils.data.TensorDataset(images, labels)


def small_model():
    """Stands in for ``vit_base_patch16_224(drop_rate=0.1)``."""
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(IMAGE[0] * IMAGE[1] * IMAGE[2], 128),
        torch.nn.LayerNorm(128), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(128, NUM_CLASSES),
    )


def train(mixed_precision, NUM_EPOCHS=4, BATCH_SIZE=32, n_samples=512, device="cpu"):  # noqa: N803
    torch.manual_seed(0)
    # -- Step 3. Create training components -------------------------------------------
    # build model
    model = small_model().to(device)

    # build dataloader
    train_dataset = synthetic_dataset(n_samples)

    # build optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, weight_decay=0.1)

    # build loss
    criterion = torch.nn.CrossEntropyLoss()

    # lr_scheduler
    lr_scheduler = LinearWarmupLR(optimizer, warmup_steps=2, total_steps=NUM_EPOCHS)

    # -- Step 4. Inject AMP Feature ------------------------------------------------------
    train_dataloader = torch.utils.data.DataLoader(train_dataset, batch_size=BATCH_SIZE,
                                                   shuffle=True, drop_last=True)

    # boost model, optimizer, criterion, dataloader, lr_scheduler
    model, optimizer, criterion, train_dataloader, lr_scheduler = mpfunc_torch.boost(
        model, optimizer, criterion, train_dataloader, lr_scheduler,
        mixed_precision=mixed_precision)

    # -- Step 5. Train with Booster ------------------------------------------------------
    history = []
    for epoch in range(NUM_EPOCHS):
        losses, lr = [], lr_scheduler.get_last_lr()[0]
        for img, label in train_dataloader:
            img = img.to(device)
            label = label.to(device)
            optimizer.zero_grad()
            output = model(img)
            loss = criterion(output, label)
            mpfunc_torch.backward(loss, optimizer)
            optimizer.step()
            losses.append(loss.detach())
        lr_scheduler.step()
        metrics = optimizer.scale_metrics(as_python=True)
        history.append(dict(epoch=epoch, loss=float(torch.stack(losses).float().mean()),
                            lr=lr, **metrics))
    return history


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 epochs (the test's run)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--mixed-precision", nargs="*",
                        default=["fp16", "fp16_apex", "fp16_naive", "bf16", "object"],
                        help="Booster names; 'object' = the tutorial's FP16TorchMixedPrecision")
    args = parser.parse_args()
    epochs = 4 if args.quick else args.epochs
    for name in args.mixed_precision:
        if name == "object":
            # if you need to customize the config, do like this (the tutorial's values)
            mixed_precision = FP16TorchMixedPrecision(
                init_scale=2.**16,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=2000)
        else:
            mixed_precision = name
        history = train(mixed_precision, NUM_EPOCHS=epochs)
        print(f"== mixed_precision={mixed_precision!r}")
        for h in history:
            print(f"Epoch {h['epoch']} - train loss: {h['loss']:.5}, lr: {h['lr']:.5g}, "
                  f"loss scale: {h['loss_scale']:g}, skipped steps: {h['skipped_steps']}")
        print(f"result {name}: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}, "
              f"lrs {[round(h['lr'], 6) for h in history]}, "
              f"skipped {history[-1]['skipped_steps']}")


if __name__ == "__main__":
    main()
