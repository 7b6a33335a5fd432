"""Measured mode: train steps timed on the devices present, to check the step-time model.

Here that means N simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N)
sharing the host's cores; on a GPU or TPU host, the real chips. The chip figures for the
model come from measurements in the same process (matmul peak, copy bandwidth), so the
estimate and the timing describe the same machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from capibara_exp.base.topologies import Chip


def copy_bytes_per_s(nbytes: int = 1 << 27, repeats: int = 5) -> float:
    """Device memory bandwidth: bytes read and written by a jitted copy of a large array."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 0.0)
    copy(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _device_memory(device: Any, num_devices: int) -> float:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    with open("/proc/meminfo") as f:  # host devices share the host's memory
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / num_devices
    raise RuntimeError("cannot tell the memory of the local devices")


def local_chip(devices: Sequence[Any], dtype: str) -> Chip:
    """The devices present as a Chip: peak and bandwidth measured now. Simulated CPU devices
    share the host, so each gets 1/N of its peak and bandwidth."""
    from capibara_exp.runtime.metrics import matmul_peak_flops

    n = len(devices)
    share = n if devices[0].platform == "cpu" else 1
    bandwidth = copy_bytes_per_s() / share
    return Chip(devices[0].device_kind, matmul_peak_flops(dtype=dtype) / share,
                _device_memory(devices[0], n), bandwidth, 2 * bandwidth, 1)


def synthetic_batch(shapes: dict[str, Any], vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """A batch of random tokens in the pipeline's layout: one segment per row, no padding."""
    rng = np.random.default_rng(seed)
    batch = {}
    for name, spec in shapes.items():
        rows, length = spec.shape
        if name in ("decoder_target_tokens", "decoder_input_tokens"):
            batch[name] = rng.integers(1, vocab_size, spec.shape, dtype=np.int32)
        elif name == "decoder_positions":
            batch[name] = np.broadcast_to(np.arange(length, dtype=np.int32), spec.shape).copy()
        elif name in ("decoder_segment_ids", "decoder_loss_weights"):
            batch[name] = np.ones(spec.shape, np.int32)
        else:  # labels a model reads (router supervision): none given
            batch[name] = np.full(spec.shape, -1, np.int32)
    return batch


def time_train_steps(bindings: dict[str, Any], steps: int) -> float:
    """Median seconds per train step after a compile step, on the partitioner's devices,
    through the trainer a run uses (same state layout, same jitted step)."""
    import jax

    from capibara_exp.runtime import state as run_state

    model, data = bindings["model"], bindings["train_dataset_cfg"]
    partitioner = bindings["partitioner"]
    length = max(data.task_feature_lengths.values())
    init_rng, rng = jax.random.split(jax.random.PRNGKey(0))
    state, axes = run_state.initial_state(model, init_rng, data.batch_size, length)
    trainer = run_state.make_trainer(
        bindings["trainer_cls"], model, partitioner, state, axes, rng, data.batch_size, None,
        **run_state.trainer_features(bindings))
    state = trainer.prepare_state(state)
    host = synthetic_batch(run_state.batch_shapes(data, model), model.module.config.vocab_size)
    batch = jax.device_put(host, partitioner.data_sharding())
    state, metrics = trainer.train_step(state, batch)  # compile
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Rank correlation of two equally long sequences (no ties expected in timings)."""
    if len(a) < 2:
        return float("nan")
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])
