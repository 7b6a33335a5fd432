"""A curriculum's per-stage optimizer settings in the train loop: the learning rate and
schedule numbers (which the local engine's optimizers keep in their state,
runtime/hyperparams.py, so a stage changes them without compiling the step again) and
frozen modules (a trainer whose optimizer freezes them, runtime/freeze.py, compiled once
per stage that has some). A resume mid-stage gets the stage's settings before its first
step, as an uninterrupted run had them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from capibara_exp.runtime.curriculum import Stage, stage_at, stage_start
from capibara_exp.runtime.hyperparams import HyperparamsState
from capibara_exp.runtime.utils import Schedule

_WHERE = "train_script.train.curriculum"


def _paths(params: Any) -> list[str]:
    return ["/".join(str(getattr(k, "key", k)) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def trainable_mask(params: Any, frozen: Sequence[str], where: str) -> Any:
    """A tree of bools like `params`: False where a pattern of `frozen` matches in full."""
    paths = _paths(params)
    for pattern in frozen:
        if not any(re.fullmatch(pattern, p) for p in paths):
            raise ValueError(f"{where}.frozen: {pattern!r} matches no parameter (they are: "
                             f"{', '.join(paths[:12])}{', ...' if len(paths) > 12 else ''})")
    flags = [not any(re.fullmatch(p, path) for p in frozen) for path in paths]
    return jax.tree.unflatten(jax.tree.structure(params), flags)


def _with_numbers(opt_state: Any, numbers: dict[str, float]) -> Any:
    """opt_state with the schedule numbers of every lifted optimizer set to `numbers`."""
    def set_node(node: Any) -> Any:
        if not isinstance(node, HyperparamsState):
            return node
        hp = dict(node.hyperparams)
        for key, value in hp.items():
            if isinstance(value, dict) and "base_learning_rate" in value:
                hp[key] = {k: jax.device_put(jnp.asarray(numbers.get(k, v), jnp.float32),
                                             v.sharding) for k, v in value.items()}
        return node._replace(hyperparams=hp)

    return jax.tree.map(set_node, opt_state, is_leaf=lambda n: isinstance(n, HyperparamsState))


class StagePlan:
    """Which trainer steps each stage, and the schedule numbers its optimizer state holds."""

    def __init__(self, stages: list[Stage], base: Any, make: Callable[..., Any], params: Any):
        self.stages, self.base, self.make = stages, base, make
        self.schedule = base.learning_rate_fn
        if any(s.learning_rate or s.schedule for s in stages) and \
                not isinstance(self.schedule, Schedule):
            raise ValueError(f"{_WHERE}: a stage's learning_rate or schedule needs the run's "
                             "schedule from utils.create_learning_rate_scheduler")
        self.masks = [trainable_mask(params, s.frozen, f"{_WHERE}[{i}]") if s.frozen else None
                      for i, s in enumerate(stages)]
        self._trainers: dict[int, Any] = {}
        self.current: int | None = None

    def numbers(self, index: int) -> dict[str, float]:
        """The schedule's numbers in stage `index`: the run's, with the stage's."""
        stage = self.stages[index]
        given = dict(stage.schedule or {})
        numbers = dict(self.schedule.hyperparams)
        numbers.update({k: float(v) for k, v in given.items() if k != "restart"})
        if stage.learning_rate is not None:
            numbers["base_learning_rate"] = float(stage.learning_rate)
        if given.get("restart"):
            numbers["step_offset"] = float(stage_start(self.stages, index))
        return numbers

    def trainer_at(self, step: int) -> Any:
        """The trainer of the stage of `step`: the run's, or one with the stage's frozen
        modules and learning rate (for its metrics), compiled once."""
        index = stage_at(self.stages, step)[0]
        stage = self.stages[index]
        if not stage.has_optimizer_settings:
            return self.base
        if index not in self._trainers:
            extra: dict[str, Any] = {"batch": stage.batch_size}
            if self.masks[index] is not None:
                extra["update_mask"] = self.masks[index]
            if stage.learning_rate or stage.schedule:
                numbers = self.numbers(index)
                extra["learning_rate_fn"] = lambda s, n=numbers: self.schedule.at(s, **n)
            self._trainers[index] = self.make(**extra)
        return self._trainers[index]

    def apply(self, state: Any, step: int) -> Any:
        """The state with its stage's schedule numbers (at the stage's first step, and at
        the first step of a run, resumed or not)."""
        index = stage_at(self.stages, step)[0]
        if index == self.current:
            return state
        self.current = index
        if not any(s.learning_rate or s.schedule for s in self.stages):
            return state
        return state.replace(opt_state=_with_numbers(state.opt_state, self.numbers(index)))
