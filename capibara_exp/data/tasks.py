"""SeqIO tasks of the project, registered on import (T5X: DatasetConfig.module).

The data directory comes from $CAPIBARA_DATA_DIR (the CLI sets it from `data_dir`), as
TFDS_DATA_DIR does for TFDS. The tasks only read: a run's data preparation
(experiment.prepare_data, before JAX starts) or `capibara-exp-data` builds what they read,
and a task that finds nothing built fails with one line naming the command that builds it
(NotBuilt, from data/e2b/built.py's read_manifest).
"""

from __future__ import annotations

import os
from pathlib import Path

import seqio
import tensorflow as tf

from capibara_exp.data import corpus, vocabularies

DATA_DIR_ENV = "CAPIBARA_DATA_DIR"
DEFAULT_DATA_DIR = Path.home() / ".cache" / "capibara-exp" / "data"
BYTES_LM = corpus.TASK

VOCABULARY = seqio.ByteVocabulary()
LM_OUTPUT_FEATURES = {"targets": seqio.Feature(vocabulary=VOCABULARY, add_eos=True)}


def data_dir() -> Path:
    return Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


def _corpus_lines(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    del shuffle_files, seed  # one file per split; examples are shuffled by seqio
    corpus.manifest(data_dir())  # NotBuilt: the command that builds it
    path = corpus.corpus_dir(data_dir()) / f"{split}.txt"
    return tf.data.TextLineDataset(str(path)).map(lambda line: {"text": line})


@seqio.map_over_dataset
def _text_to_targets(ex: dict) -> dict:
    return {"targets": ex["text"]}


def split_to_length(
    dataset: tf.data.Dataset, sequence_length: dict, output_features: dict
) -> tf.data.Dataset:
    """Cut tokenized targets longer than the feature length (less the EOS) into pieces.

    Every piece keeps the example's other features (e.g. a routing task's domain label).
    """
    del output_features
    piece = sequence_length["targets"] - 1

    def pieces(ex: dict) -> tf.data.Dataset:
        tokens = ex["targets"]
        others = {k: v for k, v in ex.items() if k != "targets"}
        pad = tf.math.floormod(-tf.size(tokens), piece)
        rows = tf.reshape(tf.pad(tokens, [[0, pad]], constant_values=-1), [-1, piece])
        ragged = tf.RaggedTensor.from_tensor(rows, padding=-1)
        return tf.data.Dataset.from_tensor_slices({"targets": ragged}).map(
            lambda r: {**others, "targets": tf.cast(r["targets"], tokens.dtype)}
        )

    return dataset.flat_map(pieces)


def output_features(vocabulary: seqio.Vocabulary | None = None) -> dict:
    """The LM tasks' one feature, `targets`, in a vocabulary (the byte one by default)."""
    if vocabulary is None or vocabulary == VOCABULARY:
        return LM_OUTPUT_FEATURES
    return {"targets": seqio.Feature(vocabulary=vocabulary, add_eos=True)}


def variant_name(name: str, vocabulary: seqio.Vocabulary | None) -> str:
    """A task's name in a vocabulary: the name itself for the byte vocabulary, else the name
    and the vocabulary's tag (a task's features are fixed when it is registered)."""
    tag = vocabularies.tag(vocabulary) if vocabulary is not None else ""
    return f"{name}_{tag}" if tag else name


def add_task(name: str, dataset_fn, splits: tuple[str, ...],
             vocabulary: seqio.Vocabulary | None = None, preprocessors: tuple = ()) -> str:
    """Register one of the project's language-modelling tasks (once): `dataset_fn`'s
    examples, `preprocessors` giving them `targets` text, tokenized in `vocabulary`, cut to
    the feature length, EOS after each piece. The recipe every such task shares."""
    if name not in seqio.TaskRegistry.names():
        seqio.TaskRegistry.add(
            name,
            source=seqio.FunctionDataSource(dataset_fn=dataset_fn, splits=splits),
            preprocessors=[
                *preprocessors,
                seqio.preprocessors.tokenize,
                split_to_length,
                seqio.preprocessors.append_eos_after_trim,
            ],
            output_features=output_features(vocabulary),
            metric_fns=[],
        )
    return name


def _add_lm_task(name: str, vocabulary: seqio.Vocabulary | None) -> str:
    return add_task(variant_name(name, vocabulary), _corpus_lines, ("train", "validation"),
                    vocabulary, (_text_to_targets,))


def lm_task(name: str = BYTES_LM, vocabulary: seqio.Vocabulary | None = None) -> str:
    """The language-modelling task in the model's vocabulary, registered on first use; gin
    calls it (gin/data/lm.gin), so both engines read the same tokens."""
    if name != BYTES_LM:
        return name  # a task of the user's own module: its features are its own
    return _add_lm_task(name, vocabulary)


def register() -> None:
    """Register the project's tasks in the byte vocabulary (idempotent)."""
    _add_lm_task(BYTES_LM, None)


register()
