"""Launching runs beyond one process: jax.distributed settings and TPU VM slices."""
