"""Checkpoints for JAX: `convert_checkpoint` (`convert`), with the storages without
float32 masters (`storage`)."""
