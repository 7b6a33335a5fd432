"""The sweep's sampler, seeded per trial from the study: workers on many machines running
the same command (the same `hydra.sweeper.seed`) never sample the same parameters.

A sampler seeded once per process draws the same sequence in every process that starts
with the same seed and study: three machines sampled 2 distinct points of 3. The trial's
number is handed out once per study by the storage, so the sampler is rebuilt for each
trial with the configured seed mixed with that number: distinct across workers, and the
same points again for the same seed on a new study.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from capibara_exp.base import optuna_study


class PerTrialSeedSampler(optuna.samplers.BaseSampler):
    """`build(seed)` makes the real sampler; each trial gets one seeded with its number."""

    def __init__(self, build: Callable[[int | None], optuna.samplers.BaseSampler],
                 seed: int | None):
        self._build, self._seed = build, seed
        self._sampler = build(seed)  # checks the settings before the first trial

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._sampler = self._build(optuna_study.sampler_seed(self._seed, trial.number))
        self._sampler.before_trial(study, trial)

    def infer_relative_search_space(self, study: optuna.Study,
                                    trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self._sampler.infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return self._sampler.sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self._sampler.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Any) -> None:
        self._sampler.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._sampler.reseed_rng()
