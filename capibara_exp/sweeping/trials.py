"""One trial of a sweep: its job's overrides (values, run dir, pruning hook, compile cache),
its result told to the storage (kept on disk until then), and its line on the console."""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from capibara_exp.base import optuna_study
from capibara_exp.base.errors import PREEMPTED_EXIT_CODE, ConfigError
from capibara_exp.sweeping import recovery
from capibara_exp.sweeping import search_space as space_lib
from capibara_exp.sweeping.recovery import ERROR
from capibara_exp.sweeping.retry import StorageUnavailable
from capibara_exp.sweeping.settings import (
    CACHE_KEY,
    PRUNED_AT,
    PRUNER_OPTIONS,
    RUN_DIR,
    STORAGE_ENV,
    SUBDIR_KEY,
    SweepSettings,
)

log = logging.getLogger(__name__)



def values_of(result: Any, metrics: Sequence[str]) -> list[float]:
    """The objective values from a job's return value (a mapping of final metrics)."""
    if not isinstance(result, dict):
        raise ConfigError(f"the job returned {result!r}, not a mapping of metrics")
    missing = [m for m in metrics if m not in result]
    if missing:
        raise ConfigError(f"the job's metrics have no {missing} (it has {sorted(result)})")
    return [float(result[m]) for m in metrics]


def run_dir(trial: optuna.Trial, sweep_dir: Path) -> Path:
    """Where the trial's job runs: its own dir under the sweep dir, or for a retry the dir
    of the trial it retries when that is reachable from here (the job resumes from its
    checkpoints)."""
    inherited = trial.user_attrs.get(RUN_DIR)
    if inherited and Path(inherited).is_dir():
        return Path(inherited)
    return sweep_dir.absolute() / str(trial.number)


def overrides(study: optuna.Study, trial: optuna.Trial, space: space_lib.SearchSpace,
              settings: SweepSettings, url: str, pruning: bool, sweep_dir: Path) -> list[str]:
    """The trial's job overrides (its values, run dir, pruning hook and the shared compile
    cache); records where and by whom it runs on the trial."""
    # pid before host: a peer's orphan check reads a trial with our host as ours, so its pid
    # must already be there (else the peer takes the live trial for a dead one's).
    trial.set_user_attr("pid", os.getpid())
    trial.set_user_attr("host", socket.gethostname())
    where = run_dir(trial, sweep_dir)
    trial.set_user_attr(RUN_DIR, str(where))  # the study knows every trial's files
    result = [*job_overrides(space, trial.params), space_lib.to_override(SUBDIR_KEY, str(where))]
    if pruning:
        if settings.pruner_options:
            trial.set_user_attr(PRUNER_OPTIONS, dict(settings.pruner_options))
        result.append(trial_override(url, settings, trial.number))
    if settings.compile_cache and not any(f.startswith(CACHE_KEY + "=") for f in space.fixed):
        cache = str(sweep_dir.absolute() / "xla_cache")
        result.append(space_lib.to_override(CACHE_KEY, cache))
    return result


def job_overrides(space: space_lib.SearchSpace, params: dict[str, Any]) -> list[str]:
    """A trial's Hydra overrides: the sweep's fixed ones, then the trial's sampled values."""
    return [*space.fixed, *(space_lib.to_override(k, v) for k, v in params.items())]


def trial_override(url: str, settings: SweepSettings, number: int) -> str:
    """The `sweep_trial` override through which a job reports to its trial (pruning).

    The storage URL may hold a password: the job reads it from this process's environment,
    so run dirs (overrides.yaml, config.yaml) record only the variable's name."""
    os.environ[STORAGE_ENV] = url
    # The pruner is not kept in the storage: the job rebuilds the same one from its name.
    return (f"sweep_trial={{storage:'${{oc.env:{STORAGE_ENV}}}',"
            f"study_name:'{settings.study_name}',number:{number},"
            f"metric:{settings.metrics[0]},pruner:{settings.pruner}}}")


def preempted(err: BaseException) -> bool:
    """Whether a job ended by preemption: it saved its step and exits 75 (errors.Preempted)."""
    return isinstance(err, SystemExit) and err.code == PREEMPTED_EXIT_CODE


def result(outcome: Any, metrics: Sequence[str]) -> dict[str, Any]:
    """What a job's `outcome` (its return value, or the exception it raised) tells the
    study: state, values and user attributes, before the storage is asked anything."""

    if isinstance(outcome, BaseException):
        error = f"{type(outcome).__name__}: {outcome}"[:2000]
        return {"state": TrialState.FAIL.name, "values": None, "attrs": {ERROR: error}}
    try:
        values = values_of(outcome, metrics)
    except Exception as err:  # a job that returned no metrics is a failed trial
        error = f"{type(err).__name__}: {err}"[:2000]
        return {"state": TrialState.FAIL.name, "values": None, "attrs": {ERROR: error}}
    if not all(math.isfinite(v) for v in values):
        return {"state": TrialState.FAIL.name, "values": None,
                "attrs": {ERROR: f"non-finite objective {values}"}}
    return {"state": TrialState.COMPLETE.name, "values": values, "attrs": {}}


def finish(opened: optuna_study.OpenStudy, trial: optuna.Trial, outcome: Any,
           metrics: Sequence[str], sweep_dir: Path, max_retries: int) -> None:
    """Tell the storage how the trial's job ended. The result is written to disk first
    (recovery.keep) and stays there until the storage has it; a preempted job's trial is
    retried, not failed."""
    if isinstance(outcome, BaseException) and preempted(outcome):
        frozen = opened.trial(trial.number)
        if not frozen.state.is_finished():
            recovery.fail_and_retry(opened, frozen, recovery.PREEMPTED, max_retries)
        return
    record = result(outcome, metrics)
    kept = recovery.keep(sweep_dir, trial.number, record)
    try:
        frozen = opened.trial(trial.number)  # as the job and the other workers left it
        if frozen.state.is_finished():  # another worker failed it: its heartbeat was late
            log.warning("trial %d was failed by another worker while it ran (%s); its result "
                        "is dropped: raise hydra.sweeper.grace_period if heartbeats can be "
                        "that late", trial.number, frozen.user_attrs.get(ERROR, "no reason"))
        else:
            state, values = recovery.settled(record, frozen)
            optuna_study.tell(opened.study, trial, values, state=state, attrs=record["attrs"])
    except StorageUnavailable as err:
        raise StorageUnavailable(f"{err}; trial {trial.number}'s result is kept in {kept} and "
                                 "told by the next run of this command") from err
    kept.unlink(missing_ok=True)


def outcome_line(study: optuna.Study, number: int, metrics: Sequence[str]) -> str:
    """One line for a finished trial: its value, 'pruned at step N', or its error."""
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in trial.params.items())
    if trial.state == TrialState.PRUNED:
        value = f"; {metrics[0]} {trial.value:.6g}" if trial.value is not None else ""
        return f"trial {number} pruned at step {trial.user_attrs.get(PRUNED_AT)}{value} ({params})"
    if trial.state == TrialState.FAIL:
        error = str(trial.user_attrs.get(ERROR, "unknown error")).splitlines()[0][:300]
        again = "; retried" if trial.user_attrs.get(recovery.RETRIED) else ""
        return f"trial {number} failed: {error}{again}"
    if trial.state == TrialState.COMPLETE:
        values = ", ".join(f"{m} {v:.6g}" for m, v in zip(metrics, trial.values, strict=False))
        return f"trial {number}: {values} ({params})"
    return f"trial {number}: {trial.state.name.lower()}"
