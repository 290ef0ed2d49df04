"""Checkpoints for JAX: `convert_checkpoint` (`convert`)."""
