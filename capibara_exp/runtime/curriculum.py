"""A staged curriculum: stages trained in order, each for its steps, in one run, each with
its own settings.

The local engine's own feature (T5X has none): `train_script.train.curriculum` is a list
of stages, each {'steps'} and any of:
  mixture_or_task_name  the task or mixture (default: the run's)
  module                a module that registers it
  mixture_rates         {task or its suffix: rate}: the mixture with these rates (tasks not
                        named are left out), e.g. {easy: 1, medium: 1} for
                        capibara_routing_by_difficulty
  batch_size            the stage's batch size (default: the run's)
  learning_rate         the schedule's base learning rate in this stage
  schedule              other numbers of the run's schedule (warmup_steps, decay_factor,
                        steps_per_decay, steps_per_cycle, min_learning_rate) in this stage;
                        restart: true starts it again at the stage's first step
  frozen                parameters that do not train in this stage: regular expressions
                        matched in full against their paths (layers_0/mlp/wi/kernel)
The global step says which stage a batch belongs to and how far into it, so a resume
mid-stage continues with the stage's next batch and the stage's settings
(runtime/stages.py applies the learning rate and frozen modules).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from capibara_exp.runtime import inputs
from capibara_exp.runtime.utils import DatasetConfig

_WHERE = "train_script.train.curriculum"
SCHEDULE_NUMBERS = ("warmup_steps", "decay_factor", "steps_per_decay", "steps_per_cycle",
                    "min_learning_rate", "restart")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: how many steps, on what data, with which settings."""

    mixture_or_task_name: str | None  # None: the run's
    steps: int
    module: str | None = None
    mixture_rates: Mapping[str, float] | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
    schedule: Mapping[str, Any] | None = None
    frozen: tuple[str, ...] = ()

    @property
    def has_optimizer_settings(self) -> bool:
        return self.learning_rate is not None or bool(self.schedule) or bool(self.frozen)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(stage: Mapping, where: str) -> str | None:
    """What is wrong with a stage's settings, in words (None: nothing)."""
    steps, batch = stage.get("steps"), stage.get("batch_size")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        return f"{where}.steps must be an integer > 0, got {steps!r}"
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        return f"{where}.batch_size must be an integer >= 1, got {batch!r}"
    lr = stage.get("learning_rate")
    if lr is not None and not (_number(lr) and lr > 0):
        return f"{where}.learning_rate must be a finite number > 0, got {lr!r}"
    schedule = stage.get("schedule") or {}
    bad = [k for k, v in dict(schedule).items() if k not in SCHEDULE_NUMBERS or (
        k == "restart" and not isinstance(v, bool)) or (k != "restart" and not _number(v))]
    if bad:
        return (f"{where}.schedule: {bad[0]}={dict(schedule)[bad[0]]!r} is not one of "
                f"{', '.join(SCHEDULE_NUMBERS)} with a finite number (restart: true/false)")
    rates = stage.get("mixture_rates")
    if rates is not None and (not isinstance(rates, Mapping) or not all(
            _number(r) and r >= 0 for r in rates.values()) or not any(
            r > 0 for r in rates.values())):
        return f"{where}.mixture_rates must map tasks to rates >= 0, one > 0, got {rates!r}"
    for pattern in stage.get("frozen") or ():
        try:
            re.compile(pattern)
        except (re.error, TypeError) as err:
            return f"{where}.frozen: {pattern!r} is not a regular expression ({err})"
    return None


def parse_stages(stages: Sequence[Mapping], total_steps: int) -> list[Stage]:
    """Stages from gin/YAML dicts; their steps must add up to total_steps."""
    if not stages:
        raise ValueError(f"{_WHERE} is empty: give at least one stage")
    fields = {f.name for f in dataclasses.fields(Stage)}
    parsed = []
    for i, stage in enumerate(stages):
        unknown = set(stage) - fields
        if unknown or "steps" not in stage:
            raise ValueError(f"{_WHERE}[{i}] = {dict(stage)!r}: a stage has keys steps and "
                             f"optionally {', '.join(sorted(fields - {'steps'}))}"
                             + (f" (unknown: {sorted(unknown)})" if unknown else ""))
        problem = _check(stage, f"{_WHERE}[{i}]")
        if problem:
            raise ValueError(problem)
        parsed.append(Stage(**{"mixture_or_task_name": None, **dict(stage),
                               "frozen": tuple(stage.get("frozen") or ())}))
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


def stage_start(stages: Sequence[Stage], index: int) -> int:
    return sum(s.steps for s in stages[:index])


def with_rates(name: str, rates: Mapping[str, float]) -> str:
    """A registered mixture of `name`'s tasks with these rates (keys: a task's name or
    the suffix after its last '_'-joined prefix, e.g. `easy` for ..._difficulty_easy);
    tasks not named are left out."""
    import seqio

    tasks = [t.name for t in seqio.get_mixture_or_task(name).tasks]
    chosen = {}
    for key, rate in rates.items():
        found = [t for t in tasks if t == key or t.endswith(f"_{key}")]
        if len(found) != 1:
            raise ValueError(f"{_WHERE}: mixture_rates key {key!r} names "
                             f"{'no' if not found else 'more than one'} task of {name} "
                             f"(its tasks: {', '.join(tasks)})")
        chosen[found[0]] = float(rate)
    tag = hashlib.sha256(json.dumps([name, chosen], sort_keys=True).encode()).hexdigest()[:8]
    variant = f"{name}_stage_{tag}"
    if variant not in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.add(variant, [(t, r) for t, r in chosen.items() if r > 0])
    return variant


def stage_dataset(stage: Stage, cfg: DatasetConfig) -> DatasetConfig:
    """The run's train data set as this stage reads it."""
    modules = [m for m in (cfg.module, stage.module) if m]
    stage_cfg = dataclasses.replace(
        cfg, mixture_or_task_name=stage.mixture_or_task_name or cfg.mixture_or_task_name,
        module=modules or None, batch_size=stage.batch_size or cfg.batch_size)
    if stage.mixture_rates:
        inputs.import_modules(stage_cfg)
        stage_cfg = dataclasses.replace(stage_cfg, mixture_or_task_name=with_rates(
            stage_cfg.mixture_or_task_name, stage.mixture_rates))
    return stage_cfg


def batches(stages: Sequence[Stage], cfg: DatasetConfig, feature_converter_cls: type,
            seed: int | None, start_step: int) -> Iterator[dict[str, np.ndarray]]:
    """The run's train batches from `start_step` on, stage after stage."""
    first, done = stage_at(stages, start_step)
    for i in range(first, len(stages)):
        stage = stages[i]
        skip = done if i == first else 0
        it = inputs.batches(stage_dataset(stage, cfg), feature_converter_cls, seed,
                            skip_batches=skip)
        for _ in range(stage.steps - skip):
            yield next(it)
