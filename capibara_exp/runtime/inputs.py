"""Input pipeline: SeqIO task or mixture -> packing -> numpy batches.

With `pack` and a kernel packer (capibara_exp/data/packing.py: 'first_fit', the default,
or 'next_fit'), tf.data only reads, preprocesses and trims the examples, in chunks; the
Cython kernel packs each chunk and numpy forms seqio's decoder features, on a producer
thread ahead of the train step. 'seqio' (or `pack=False`) uses seqio's feature converter.

A process running several runs on the same data (a sweep's trials) can keep the batches it
made and replay them (share_across_runs): the same data set, seed and packer give the same
stream, so later runs skip building a tf.data pipeline for what an earlier run already read.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import queue
import threading
from collections.abc import Callable, Iterator

import numpy as np
import seqio
import tensorflow as tf

from capibara_exp.data import packing
from capibara_exp.runtime.utils import DatasetConfig

INPUT_THREADS = 1
# Examples per kernel call with first-fit (next-fit uses seqio's chunk, the row length).
FIRST_FIT_CHUNK = 1024
PREFETCH_BATCHES = 4
# Replayed streams (share_across_runs): bytes kept per stream, and streams kept at most (the
# oldest go first). A trial's train stream and its train-eval batches are two streams.
KEPT_BYTES_PER_STREAM = 64 << 20
KEPT_STREAMS = 4
# The project's tasks read their files under this directory (data/tasks.py), so the same
# task name over another data dir is another stream.
DATA_DIR_ENV = "CAPIBARA_DATA_DIR"


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


@dataclasses.dataclass
class _Kept:
    """The first batches of a stream, as made, and whether they are the whole stream."""

    batches: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    complete: bool = False


_kept: dict[tuple, _Kept] | None = None  # None: nothing is shared (share_across_runs)


def share_across_runs(on: bool = True) -> None:
    """Keep the batches runs in this process make, and replay them to later runs that read
    the same stream (data set, split, seed, lengths, batch, packer, data dir).

    For the trials of a sweep run in one process (experiment.run turns it on in a multirun):
    their data is the same, so from the second trial on the train batches an earlier trial
    already read and the train-eval batches come from memory, and a pipeline is built only
    for batches past them. Off by default (a process that changes a data set's files between
    runs must not be served the old batches); `on=False` turns it off and drops what is kept."""
    global _kept
    if not on:
        _kept = None
    elif _kept is None:
        _kept = {}


def _kernel_packs(cfg: DatasetConfig, packer: packing.Packer) -> bool:
    """Whether the kernel packer makes this data set's batches (else seqio's converter)."""
    return bool(cfg.pack) and packer.strategy != "seqio" and list(
        cfg.task_feature_lengths) == ["targets"]


def _stream_key(cfg: DatasetConfig, feature_converter_cls: type, seed: int | None,
                repeat: bool, packer: packing.Packer) -> tuple:
    # seqio's converter shapes the batches on its path; the kernel path uses only the label
    # feature a converter class names (carrying_labels makes a new class per call).
    label = packing.label_feature_of(feature_converter_cls)
    converter = (label, None if label else feature_converter_cls)
    modules = (cfg.module,) if isinstance(cfg.module, str) else tuple(cfg.module or ())
    return (cfg.mixture_or_task_name, tuple(sorted(cfg.task_feature_lengths.items())),
            cfg.split, cfg.batch_size, cfg.shuffle, cfg.pack, cfg.trim_output_features,
            modules, seed, repeat, packer, converter, os.environ.get(DATA_DIR_ENV))


def batches(
    cfg: DatasetConfig,
    feature_converter_cls: type,
    seed: int | None,
    skip_batches: int = 0,
    repeat: bool = True,
    packer: packing.Packer | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches of a data set, deterministic for a seed; `skip_batches` resumes mid-stream.

    `packer`: how to pack (default: the data set's `cfg.packer`, else packing.Packer()).
    A converter class made by packing.carrying_labels adds its label feature per token.
    With share_across_runs on, the stream's batches are kept (read-only) and replayed."""
    import_modules(cfg)
    packer = packer or cfg.packer or packing.Packer()
    label_feature = packing.label_feature_of(feature_converter_cls)
    if label_feature and not _kernel_packs(cfg, packer):
        raise ValueError(
            f"{cfg.mixture_or_task_name}: the model asks for the task feature '{label_feature}' "
            "per token (moe_models.MoeDecoderOnlyModel.router_label_feature), which only the "
            f"local engine's kernel packer carries; got pack={cfg.pack}, packing strategy "
            f"'{packer.strategy}', features {sorted(cfg.task_feature_lengths)}: set "
            "data.pack=true and data.packing=first_fit or next_fit (conf/data/)")

    def live(skip: int) -> Iterator[dict[str, np.ndarray]]:
        return _live_batches(cfg, feature_converter_cls, seed, skip, repeat, packer)

    if _kept is None or (cfg.shuffle and seed is None):  # unseeded: no two streams alike
        return live(skip_batches)
    key = _stream_key(cfg, feature_converter_cls, seed, repeat, packer)
    kept = _kept.pop(key, None) or _Kept()
    _kept[key] = kept  # the most recently used last
    while len(_kept) > KEPT_STREAMS:
        del _kept[next(iter(_kept))]
    return _replay(kept, live, skip_batches)


def _replay(kept: _Kept, live: Callable[[int], Iterator[dict[str, np.ndarray]]],
            skip: int) -> Iterator[dict[str, np.ndarray]]:
    """kept's batches from `skip` on, then a live stream from where they end, kept too while
    it continues them and the stream is under KEPT_BYTES_PER_STREAM."""
    i = skip
    while i < len(kept.batches):
        yield kept.batches[i]
        i += 1
    if kept.complete:
        return
    stream = live(i)
    try:
        for batch in stream:
            size = sum(v.nbytes for v in batch.values())
            if i == len(kept.batches) and kept.nbytes + size <= KEPT_BYTES_PER_STREAM:
                for v in batch.values():
                    v.setflags(write=False)  # shared by later runs: nobody may change it
                kept.batches.append(batch)
                kept.nbytes += size
            i += 1
            yield batch
        kept.complete = i == len(kept.batches)  # a finite stream read to its end, all kept
    finally:
        close = getattr(stream, "close", None)
        if close:
            close()


def _live_batches(
    cfg: DatasetConfig,
    feature_converter_cls: type,
    seed: int | None,
    skip_batches: int,
    repeat: bool,
    packer: packing.Packer,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches from a new pipeline (tf.data, and the kernel packer on its own thread)."""
    label_feature = packing.label_feature_of(feature_converter_cls)
    if _kernel_packs(cfg, packer):
        return _kernel_batches(cfg, packer, seed, skip_batches, repeat, label_feature)
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
        raise ValueError(f"{where}: must be one integer per example, got "
                         f"{spec[feature].dtype.name} "
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


def eval_batches(cfg, model, eval_steps: int) -> list[dict]:
    """The same eval_steps batches for every evaluation, so curves compare like with like."""
    if cfg is None or eval_steps <= 0:
        return []
    it = batches(cfg, model.FEATURE_CONVERTER_CLS, cfg.seed, repeat=True)
    return [next(it) for _ in range(eval_steps)]
