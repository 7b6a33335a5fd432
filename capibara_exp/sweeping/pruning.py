"""A T5X action that reports a run's eval metric to its Optuna trial and stops it if pruned."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import optuna

from capibara_exp.base import optuna_study
from capibara_exp.runtime.trainer import BaseAction
from capibara_exp.sweeping import retry
from capibara_exp.sweeping.settings import PRUNED_AT, PRUNER_KEY, PRUNER_OPTIONS
from capibara_exp.sweeping.storage import redacted

log = logging.getLogger(__name__)
# How long a report waits for a database that is away before training goes on without it:
# the trial's own result is what matters, and it is told (and kept) by the sweeper.
REPORT_RETRY_S = 60.0


class OptunaPruning(BaseAction):
    """After each evaluation: trial.report(metric, step); True (stop) when the pruner says so."""

    def __init__(self, storage: str, study_name: str, number: int, metric: str, pruner: str):
        outage = retry.Outage(redacted(storage), REPORT_RETRY_S, "a pruning report's wait")
        inner = retry.call(outage, lambda: optuna_study.open_storage(storage), "opening it")
        opened = optuna_study.load(retry.RetryingStorage(inner, outage), study_name,
                                   optuna_study.make_pruner(pruner, key=PRUNER_KEY))
        self.study = opened.study
        # The trial the sweep asked for and launched this run as (still RUNNING).
        self.trial = optuna.trial.Trial(self.study, opened.trial_id(number))
        # The sweep's pruner keywords travel with the trial, not in the job's overrides.
        options = opened.trial(number).user_attrs.get(PRUNER_OPTIONS)
        if options:
            self.study.pruner = optuna_study.make_pruner(pruner, options, key=PRUNER_KEY)
        self.metric = metric

    def run(self, train_state: Any, metrics_by_task: Mapping[str, Mapping[str, float]]) -> bool:
        if not metrics_by_task:
            return False
        metrics = next(iter(metrics_by_task.values()))
        step = int(train_state.step)
        try:
            self.trial.report(float(metrics[self.metric]), step)
            if self.trial.should_prune():
                self.trial.set_user_attr(PRUNED_AT, step)
                return True
        except retry.StorageUnavailable as err:  # train on; the next eval reports again
            log.warning("step %d: not reported to the study (%s); training goes on", step, err)
        return False
