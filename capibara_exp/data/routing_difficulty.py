"""Easy-to-hard routing tasks: the routing data split by its `difficulty` feature.

`capibara_routing_difficulty_<easy|medium|hard>` holds every domain's examples of that
difficulty (the features of the routing tasks: targets, domain, domain_id, difficulty),
and the mixture `capibara_routing_by_difficulty` holds the three, each at rate 1. A
curriculum goes from easy to hard by giving its stages this mixture with rates per stage
(conf/curriculum/easy_to_hard.yaml: easy alone, then easy and medium, then all three).
Registered on import; the tasks read the data built under $CAPIBARA_DATA_DIR (never build
them: data/e2b/built.py).
"""

from __future__ import annotations

import json

import seqio
import tensorflow as tf

from capibara_exp.data import routing
from capibara_exp.data.e2b import built
from capibara_exp.data.routing_tasks import examples
from capibara_exp.data.tasks import add_task, data_dir

TASK_PREFIX = "capibara_routing_difficulty_"
MIXTURE = "capibara_routing_by_difficulty"


def difficulty_task(difficulty: str) -> str:
    return TASK_PREFIX + difficulty


def _rows(difficulty: str, split: str) -> list[dict]:
    built.manifest(data_dir())  # NotBuilt: the command that builds them
    root = built.dataset_dir(data_dir()) / "routing"
    rows = []
    for domain in routing.DOMAINS:
        path = root / domain / f"{split}.jsonl"
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                rows += [r for r in map(json.loads, f) if r["difficulty"] == difficulty]
    if not rows:
        raise ValueError(f"{difficulty_task(difficulty)}: the built routing data have no "
                         f"{difficulty!r} example in split {split!r}; rebuild with more logs "
                         "(capibara-exp-data)")
    return rows


def _dataset_fn(difficulty: str):
    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        del shuffle_files, seed  # one list per split; seqio shuffles the examples
        return examples(_rows(difficulty, split))

    return dataset_fn


def register() -> None:
    """Register the three tasks and the mixture (idempotent)."""
    for difficulty in routing.DIFFICULTIES:
        add_task(difficulty_task(difficulty), _dataset_fn(difficulty), routing.SPLITS)
    if MIXTURE not in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.add(MIXTURE, [(difficulty_task(d), 1.0)
                                            for d in routing.DIFFICULTIES])


register()
