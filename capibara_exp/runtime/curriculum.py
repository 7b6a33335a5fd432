"""A staged curriculum: tasks or mixtures trained in order, each for its steps, in one run.

The local engine's own feature (T5X has none): `train_script.train.curriculum` is a list of
{'mixture_or_task_name', 'steps'[, 'module']}. The global step says which stage a batch
belongs to and how far into it, so a resume mid-stage continues with the stage's next batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from capibara_exp.runtime import inputs
from capibara_exp.runtime.config import DatasetConfig

_WHERE = "train_script.train.curriculum"


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: a task or mixture and how many steps it trains for."""

    mixture_or_task_name: str
    steps: int
    module: str | None = None


def parse_stages(stages: Sequence[Mapping], total_steps: int) -> list[Stage]:
    """Stages from gin/YAML dicts; their steps must add up to total_steps."""
    if not stages:
        raise ValueError(f"{_WHERE} is empty: give at least one stage")
    fields = {f.name for f in dataclasses.fields(Stage)}
    parsed = []
    for i, stage in enumerate(stages):
        unknown = set(stage) - fields
        if unknown or "mixture_or_task_name" not in stage or "steps" not in stage:
            raise ValueError(f"{_WHERE}[{i}] = {dict(stage)!r}: a stage has keys "
                             "mixture_or_task_name, steps and optionally module"
                             + (f" (unknown: {sorted(unknown)})" if unknown else ""))
        if int(stage["steps"]) <= 0:
            raise ValueError(f"{_WHERE}[{i}].steps must be positive, got {stage['steps']}")
        parsed.append(Stage(str(stage["mixture_or_task_name"]), int(stage["steps"]),
                            stage.get("module")))
    total = sum(s.steps for s in parsed)
    if total != total_steps:
        raise ValueError(f"{_WHERE}: the stages' steps add up to {total} "
                         f"({' + '.join(str(s.steps) for s in parsed)}), but "
                         f"train_script.train.total_steps={total_steps}")
    return parsed


def stage_at(stages: Sequence[Stage], step: int) -> tuple[int, int]:
    """(stage index, steps already done in it) for the batch of global step `step`."""
    start = 0
    for i, stage in enumerate(stages):
        if step < start + stage.steps:
            return i, step - start
        start += stage.steps
    return len(stages) - 1, stages[-1].steps


def batches(stages: Sequence[Stage], cfg: DatasetConfig, feature_converter_cls: type,
            seed: int | None, start_step: int) -> Iterator[dict[str, np.ndarray]]:
    """The run's train batches from `start_step` on, stage after stage."""
    first, done = stage_at(stages, start_step)
    for i in range(first, len(stages)):
        stage = stages[i]
        modules = [m for m in (cfg.module, stage.module) if m]
        stage_cfg = dataclasses.replace(cfg, mixture_or_task_name=stage.mixture_or_task_name,
                                        module=modules or None)
        skip = done if i == first else 0
        it = inputs.batches(stage_cfg, feature_converter_cls, seed, skip_batches=skip)
        for _ in range(stage.steps - skip):
            yield next(it)
