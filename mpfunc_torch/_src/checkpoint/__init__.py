"""Checkpoints for PyTorch: the optimizer's state (`optimizer_state`), the model's load
(`model_load`), ``torch.distributed.checkpoint`` (`dcp`) and `convert_checkpoint`
(`convert`, with the storages without float32 masters in `storage`)."""
