"""Input pipeline: SeqIO task or mixture -> packing -> numpy batches.

With `pack` and a kernel packer (capibara_exp/data/packing.py: 'first_fit', the default,
or 'next_fit'), tf.data only reads, preprocesses and trims the examples, in chunks; the
Cython kernel packs each chunk and numpy forms seqio's decoder features, on a producer
thread ahead of the train step. 'seqio' (or `pack=False`) uses seqio's feature converter.
"""

from __future__ import annotations

import importlib
import queue
import threading
from collections.abc import Iterator

import numpy as np
import seqio
import tensorflow as tf

from capibara_exp.data import packing
from capibara_exp.runtime.config import DatasetConfig

INPUT_THREADS = 1
# Examples per kernel call with first-fit (next-fit uses seqio's chunk, the row length).
FIRST_FIT_CHUNK = 1024
PREFETCH_BATCHES = 4


def import_modules(cfg: DatasetConfig) -> None:
    """Import the modules that register the config's tasks (T5X: DatasetConfig.module)."""
    modules = [cfg.module] if isinstance(cfg.module, str) else list(cfg.module or [])
    for name in modules:
        importlib.import_module(name)


def _options() -> tf.data.Options:
    # Input work runs beside the jitted step on the same cores: one thread is enough to
    # keep ahead of it, and more only oversubscribe the cores XLA is computing on.
    options = tf.data.Options()
    options.threading.private_threadpool_size = INPUT_THREADS
    options.threading.max_intra_op_parallelism = 1
    return options


def batches(
    cfg: DatasetConfig,
    feature_converter_cls: type,
    seed: int | None,
    skip_batches: int = 0,
    repeat: bool = True,
    packer: packing.Packer | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches of a data set, deterministic for a seed; `skip_batches` resumes mid-stream.

    A converter class made by packing.carrying_labels adds its label feature per token."""
    import_modules(cfg)
    packer = packer or packing.configured_packer()
    label_feature = packing.label_feature_of(feature_converter_cls)
    if cfg.pack and packer.strategy != "seqio" and list(cfg.task_feature_lengths) == ["targets"]:
        return _kernel_batches(cfg, packer, seed, skip_batches, repeat, label_feature)
    if label_feature:
        raise ValueError(
            f"{cfg.mixture_or_task_name}: the model asks for the task feature '{label_feature}' "
            "per token (moe_models.MoeDecoderOnlyModel.router_label_feature), which only the "
            f"local engine's kernel packer carries; got pack={cfg.pack}, packing strategy "
            f"'{packer.strategy}', features {sorted(cfg.task_feature_lengths)}: set "
            "data.pack=true and data.packing=first_fit or next_fit (conf/data/)")
    ds = seqio.get_dataset(
        cfg.mixture_or_task_name,
        cfg.task_feature_lengths,
        feature_converter=feature_converter_cls(pack=cfg.pack),
        dataset_split=cfg.split,
        use_cached=False,
        shuffle=cfg.shuffle,
        num_epochs=None if repeat else 1,
        seed=seed,
        trim_output_features=cfg.trim_output_features,
    )
    ds = ds.batch(cfg.batch_size, drop_remainder=True)
    if skip_batches:
        ds = ds.skip(skip_batches)
    return ds.with_options(_options()).prefetch(2).as_numpy_iterator()


def example_chunks(
    cfg: DatasetConfig, seed: int | None, repeat: bool, chunk: int,
    label_feature: str | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """(flat int32 tokens, lengths, labels or None) of `chunk` consecutive trimmed examples.

    The examples are those seqio.get_dataset feeds its feature converter: same task
    call, shuffle and seed, trimmed to the feature length. With `label_feature`, each
    example's value of that integer task feature comes along.
    """
    length = cfg.task_feature_lengths["targets"]
    task = seqio.get_mixture_or_task(cfg.mixture_or_task_name)
    # A mixture keeps only its output features unless told to pass more through (which
    # changes nothing else: the same examples come in the same order).
    keep = {"passthrough_features": [label_feature]} if label_feature and isinstance(
        task, seqio.Mixture) else {}
    ds = task.get_dataset(
        cfg.task_feature_lengths,
        split=cfg.split,
        use_cached=False,
        shuffle=cfg.shuffle,
        seed=seed,
        num_epochs=None if repeat else 1,
        trim_output_features=cfg.trim_output_features,
        **keep,
    )
    if label_feature:
        _check_label_feature(cfg, ds.element_spec, label_feature)
        ds = ds.map(lambda ex: {"targets": tf.cast(ex["targets"][:length], tf.int32),
                                "label": tf.cast(ex[label_feature], tf.int32)})
    else:
        ds = ds.map(lambda ex: {"targets": tf.cast(ex["targets"][:length], tf.int32)})
    for chunk_ex in ds.ragged_batch(chunk).with_options(_options()).prefetch(2):
        ragged = chunk_ex["targets"]
        labels = chunk_ex["label"].numpy() if label_feature else None
        yield ragged.flat_values.numpy(), ragged.row_lengths().numpy(), labels


def _check_label_feature(cfg: DatasetConfig, spec: dict, feature: str) -> None:
    """The label feature must be one integer per example of the task or mixture."""
    where = (f"{cfg.mixture_or_task_name}: moe_models.MoeDecoderOnlyModel.router_label_feature="
             f"'{feature}'")
    if feature not in spec:
        raise ValueError(f"{where}: the examples have no such feature (features: {sorted(spec)})")
    if spec[feature].shape.rank != 0 or not spec[feature].dtype.is_integer:
        raise ValueError(f"{where}: must be one integer per example, got {spec[feature].dtype.name} "
                         f"of shape {spec[feature].shape}")


def _packed_batches(
    cfg: DatasetConfig, packer: packing.Packer, seed: int | None, repeat: bool,
    label_feature: str | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    length = cfg.task_feature_lengths["targets"]
    chunk = FIRST_FIT_CHUNK if packer.strategy == "first_fit" else length * max(1, 1024 // length)
    pending: list[dict[str, np.ndarray]] = []
    have = 0
    for tokens, lengths, labels in example_chunks(cfg, seed, repeat, chunk, label_feature):
        pending.append(packing.decoder_features(*packer.pack(tokens, lengths, length)))
        if label_feature:
            pending[-1][packing.label_batch_feature(label_feature)] = packer.pack_labels(
                tokens, lengths, labels, length)
        have += len(pending[-1]["decoder_target_tokens"])
        if have < cfg.batch_size:
            continue
        rows = {k: np.concatenate([p[k] for p in pending]) for k in pending[0]}
        n_full = have // cfg.batch_size * cfg.batch_size
        for start in range(0, n_full, cfg.batch_size):
            yield {k: v[start : start + cfg.batch_size] for k, v in rows.items()}
        pending = [{k: v[n_full:] for k, v in rows.items()}]
        have -= n_full


def _kernel_batches(
    cfg: DatasetConfig, packer: packing.Packer, seed: int | None, skip_batches: int, repeat: bool,
    label_feature: str | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Kernel-packed batches made on a producer thread, PREFETCH_BATCHES ahead.

    Closing (or dropping) the iterator stops the producer, so a run that stops reading
    an endless stream (eval batches, the end of training, a sweep's next job) leaves no
    thread or tf.data pipeline behind.
    """
    out: queue.Queue = queue.Queue(maxsize=PREFETCH_BATCHES)
    stop = threading.Event()
    done = object()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            batches = _packed_batches(cfg, packer, seed, repeat, label_feature)
            for i, batch in enumerate(batches):
                if i >= skip_batches and not put(batch):
                    return
        except BaseException as err:  # re-raised in the consumer, where the run can report it
            put(err)
        put(done)

    threading.Thread(target=produce, name="capibara-input", daemon=True).start()
    try:
        while True:
            item = out.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
