"""Input pipeline: SeqIO task or mixture -> feature converter -> numpy batches."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import numpy as np
import seqio
import tensorflow as tf

from capibara_exp.runtime.config import DatasetConfig

INPUT_THREADS = 1


def import_modules(cfg: DatasetConfig) -> None:
    """Import the modules that register the config's tasks (T5X: DatasetConfig.module)."""
    modules = [cfg.module] if isinstance(cfg.module, str) else list(cfg.module or [])
    for name in modules:
        importlib.import_module(name)


def batches(cfg: DatasetConfig, feature_converter_cls: type, seed: int | None,
            skip_batches: int = 0, repeat: bool = True) -> Iterator[dict[str, np.ndarray]]:
    """Batches of a data set, deterministic for a seed; `skip_batches` resumes mid-stream."""
    import_modules(cfg)
    ds = seqio.get_dataset(
        cfg.mixture_or_task_name, cfg.task_feature_lengths,
        feature_converter=feature_converter_cls(pack=cfg.pack),
        dataset_split=cfg.split, use_cached=False, shuffle=cfg.shuffle,
        num_epochs=None if repeat else 1, seed=seed,
        trim_output_features=cfg.trim_output_features)
    ds = ds.batch(cfg.batch_size, drop_remainder=True)
    if skip_batches:
        ds = ds.skip(skip_batches)
    # Input work runs beside the jitted step on the same cores: one thread is enough to
    # keep ahead of it, and more only oversubscribe the cores XLA is computing on.
    options = tf.data.Options()
    options.threading.private_threadpool_size = INPUT_THREADS
    options.threading.max_intra_op_parallelism = 1
    return ds.with_options(options).prefetch(2).as_numpy_iterator()
