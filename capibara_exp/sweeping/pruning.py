"""A T5X action that reports a run's eval metric to its Optuna trial and stops it if pruned."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna

from capibara_exp.runtime.trainer import BaseAction
from capibara_exp.sweeping.study import PRUNED_AT, PRUNER_OPTIONS, make_pruner, make_storage


class OptunaPruning(BaseAction):
    """After each evaluation: trial.report(metric, step); True (stop) when the pruner says so."""

    def __init__(self, storage: str, study_name: str, number: int, metric: str, pruner: str):
        self.study = optuna.load_study(study_name=study_name, storage=make_storage(storage),
                                       pruner=make_pruner(pruner))
        trial_id = self.study._storage.get_trial_id_from_study_id_trial_number(
            self.study._study_id, number)
        self.trial = optuna.trial.Trial(self.study, trial_id)
        # The sweep's pruner keywords travel with the trial, not in the job's overrides.
        options = self.study._storage.get_trial(trial_id).user_attrs.get(PRUNER_OPTIONS)
        if options:
            self.study.pruner = make_pruner(pruner, options)
        self.metric = metric

    def run(self, train_state: Any, metrics_by_task: Mapping[str, Mapping[str, float]]) -> bool:
        if not metrics_by_task:
            return False
        metrics = next(iter(metrics_by_task.values()))
        step = int(train_state.step)
        self.trial.report(float(metrics[self.metric]), step)
        if self.trial.should_prune():
            self.trial.set_user_attr(PRUNED_AT, step)
            return True
        return False
