"""An Optuna study driven by Hydra jobs: ask, launch a batch of jobs, tell; resumable from
storage, and outliving its workers and its database's restarts.

Every worker (this process, the `n_workers - 1` it starts, and any other process pointed at
the same storage, on any machine) pulls trials until the study holds `n_trials` counted
ones, so re-running the same command continues a study, and trials are never rerun. The
sampler is seeded per trial from the study (sampler.py), so workers running the same
command sample distinct points. Trials of dead processes (this host, by pid) and of machines
that stopped their heartbeat (PostgreSQL, MySQL) are failed by a background check and
retried (recovery.py); a worker whose trials are done waits for its peers' running ones,
so that every worker ends with the whole study and writes the same results.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from capibara_exp.base import optuna_study
from capibara_exp.base.errors import ConfigError
from capibara_exp.sweeping import recovery
from capibara_exp.sweeping import search_space as space_lib
from capibara_exp.sweeping import trials as trials_lib
from capibara_exp.sweeping.recovery import (
    ERROR,
    ORPHANED,
    PREEMPTED,
    STALE,
    fail_orphans,
    fail_stale,
)
from capibara_exp.sweeping.results import (
    NOT_RUN,
    RESULTS,
    RETRIED,
    counted,
    summary,
    write_results,
)
from capibara_exp.sweeping.sampler import PerTrialSeedSampler
from capibara_exp.sweeping.settings import (
    CACHE_KEY,
    PRUNED_AT,
    PRUNER_KEY,
    PRUNER_OPTIONS,
    SAMPLER_KEY,
    STORAGE_ENV,
    SweepSettings,
)
from capibara_exp.sweeping.storage import HEARTBEAT_S, heartbeat_interval, storage_url
from capibara_exp.sweeping.storage import open_storage as _open_storage
from capibara_exp.sweeping.trials import job_overrides, trial_override

__all__ = ["CACHE_KEY", "ERROR", "HEARTBEAT_S", "NOT_RUN", "ORPHANED", "PREEMPTED", "PRUNED_AT",
           "PRUNER_KEY", "PRUNER_OPTIONS", "RESULTS", "RETRIED", "STALE", "STORAGE_ENV",
           "SweepSettings",
           "counted", "fail_orphans", "fail_stale", "heartbeat_interval", "job_overrides",
           "open_study", "run", "storage_url", "summary", "trial_override", "write_results"]

log = logging.getLogger(__name__)

MIN_FINISHED = 5  # finished trials before max_failure_rate applies (fewer if n_trials is less)
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def grid_done(study: optuna.Study, space: space_lib.SearchSpace) -> bool:
    """Whether every point of the grid has a trial (finished or running)."""
    grid = space.grid()
    seen = {tuple(t.params.get(k) for k in grid) for t in study.get_trials(deepcopy=False)}
    return set(itertools.product(*grid.values())) <= seen


def open_study(settings: SweepSettings, url: str,
               space: space_lib.SearchSpace) -> optuna_study.OpenStudy:
    """The sweep's study on its storage, made if new, with its sampler and pruner."""
    storage = _open_storage(url, settings)
    pruner = optuna_study.make_pruner(settings.pruner, settings.pruner_options, key=PRUNER_KEY)
    opened = optuna_study.create_or_load(storage, settings.study_name, settings.directions,
                                         pruner=pruner)

    def build(seed: int | None) -> optuna.samplers.BaseSampler:
        return optuna_study.make_sampler(settings.sampler, seed, settings.sampler_options,
                                         key=SAMPLER_KEY, grid=space.grid,
                                         multi_objective=len(settings.directions) > 1)

    # The grid sampler is already the study's: trial n takes point n of a grid shuffled by
    # the seed (the same on every worker); reseeding it per trial would reshuffle the grid.
    opened.study.sampler = (build(settings.seed) if settings.sampler == "grid"
                            else PerTrialSeedSampler(build, settings.seed))
    return opened


Launch = Callable[[list[str], int], Any]  # (overrides, trial number) -> the job's return value
# [(overrides, trial number)] -> each job's return value or the exception it raised
LaunchBatch = Callable[[list[tuple[list[str], int]]], list[Any]]


@dataclass
class _Sweep:
    """What the loop's steps share."""

    settings: SweepSettings
    opened: optuna_study.OpenStudy
    space: space_lib.SearchSpace
    url: str
    sweep_dir: Path
    pruning: bool
    launch: LaunchBatch
    report: Callable[[str], None]


def run(settings: SweepSettings, launch: Launch, sweep_dir: Path, arguments: Sequence[str] = (),
        on_open: Callable[[], Any] | None = None, groups: Sequence[str] = (),
        write: bool = True, report: Callable[[str], None] | None = None,
        batch: int = 1, launch_batch: LaunchBatch | None = None) -> optuna.Study:
    """Run trials until the study has n_trials and no peer runs one; return the study.

    `arguments` are the sweep's task overrides (they win over `settings.params`); `groups`
    the composed config's groups, for the best-trial file (see best.write). `on_open` runs
    once the study exists in its storage (the sweeper starts its workers there, so they
    find the study made). `write`: write the results at the end (write_results). `report`
    gets a line per finished trial, and one when the study already holds n_trials. Up to
    `batch` trials are launched at once through `launch_batch` (a Hydra launcher that runs
    jobs in parallel); without it, one by one through `launch`."""
    space = search_space(settings, arguments)
    if not space.distributions:
        raise ConfigError("hydra.sweeper.params and the command line define no search dimension "
                          "(use choice(...), range(...), interval(...))")
    url = storage_url(settings.storage, sweep_dir)
    opened = open_study(settings, url, space)
    recovery.flush(opened, sweep_dir)  # results a worker kept while the database was away
    recovery.check_dead(opened, settings.max_retries, opened.storage.outage)
    if on_open:
        on_open()
    pruning = settings.pruner != "none" and len(settings.directions) == 1
    if settings.pruner != "none" and not pruning:
        log.warning("hydra.sweeper.pruner=%s is off: Optuna prunes single-objective studies "
                    "only, and this one has %d directions", settings.pruner,
                    len(settings.directions))
    sweep = _Sweep(settings, opened, space, url, sweep_dir, pruning,
                   launch_batch or (lambda jobs: _one_by_one(launch, jobs)),
                   report or (lambda line: None))
    if len(counted(opened.study)) >= settings.n_trials:
        sweep.report(f"study '{settings.study_name}' already holds n_trials={settings.n_trials} "
                     f"trials ({sweep_dir}): nothing to run; raise hydra.sweeper.n_trials for more")
    heartbeats = optuna_study.heartbeat_s(opened.storage)
    period = recovery.watch_period_s(heartbeats)
    with recovery.watching(opened, settings.max_retries, period, opened.storage.outage):
        _loop(sweep, batch, period, bool(heartbeats))
    if write:
        write_results(opened.study, settings, sweep_dir, space.fixed, groups)
    return opened.study


def _loop(sweep: _Sweep, batch: int, period_s: float, heartbeats: bool) -> None:
    """Ask, launch and tell until the study is full; then wait for the peers' trials (a dead
    peer's trial is failed and maybe retried meanwhile, and then run here)."""
    settings, study = sweep.settings, sweep.opened.study
    while True:
        if settings.sampler == "grid" and grid_done(study, sweep.space):
            return  # every point once, never twice
        todo = settings.n_trials - len(counted(study))
        if todo > 0:
            _run_batch(sweep, _ask_batch(sweep, min(batch, todo)))
        elif recovery.waiting_for(study, heartbeats):
            time.sleep(period_s)
        else:
            return


def _ask_batch(sweep: _Sweep, size: int) -> list[optuna.Trial]:
    asked: list[optuna.Trial] = []
    for _ in range(size):
        trial = _ask(sweep.opened, sweep.space)
        if _lost_race(sweep.opened.study, trial, sweep.settings.n_trials):
            break
        asked.append(trial)
    return asked


def _run_batch(sweep: _Sweep, asked: list[optuna.Trial]) -> None:
    """Launch the asked trials together, each with its heartbeat; tell their results. A
    preempted job's trial is retried, and the preemption then ends this worker (exit 75)."""
    s, opened = sweep.settings, sweep.opened
    jobs = [(trials_lib.overrides(opened.study, t, sweep.space, s, sweep.url, sweep.pruning,
                                  sweep.sweep_dir), t.number) for t in asked]
    if len(jobs) > 1:
        sweep.report(f"trials {', '.join(str(t.number) for t in asked)} launched together")
    with contextlib.ExitStack() as beating:
        for trial in asked:
            beating.enter_context(optuna_study.heartbeat(opened, trial.number))
        outcomes = sweep.launch(jobs) if jobs else []
    for trial, outcome in zip(asked, outcomes, strict=True):
        trials_lib.finish(opened, trial, outcome, s.metrics, sweep.sweep_dir, s.max_retries)
        sweep.report(trials_lib.outcome_line(opened.study, trial.number, s.metrics))
    stop = next((o for o in outcomes if isinstance(o, SystemExit)), None)
    if stop is not None:
        raise stop
    _check_failure_rate(opened.study, s.max_failure_rate, min(s.n_trials, MIN_FINISHED))


def _one_by_one(launch: Launch, jobs: list[tuple[list[str], int]]) -> list[Any]:
    """Each job's return value or exception; a preemption stops the batch there (the rest
    are not started and are retried like it)."""
    outcomes: list[Any] = []
    for overrides, number in jobs:
        try:
            outcomes.append(launch(overrides, number))
        except SystemExit as err:
            if not trials_lib.preempted(err):
                raise
            outcomes += [err] * (len(jobs) - len(outcomes))
            break
        except Exception as err:  # a failing job is a FAIL trial, never the end of the sweep
            outcomes.append(err)
    return outcomes


def _lost_race(study: optuna.Study, trial: optuna.Trial, n_trials: int) -> bool:
    """Whether trial n+1 or later was just asked (workers count, then ask, concurrently).

    Trial numbers come from the storage in order, so the earlier-numbered trials decide:
    the trial runs only when fewer than n_trials counted trials precede it. That decision
    never depends on a later trial, so concurrent workers cannot both overshoot."""
    before = [t for t in counted(study) if t.number < trial.number]
    if len(before) < n_trials:
        return False
    optuna_study.tell(study, trial, state=TrialState.FAIL,
                      attrs={NOT_RUN: f"the study already had n_trials={n_trials}"})
    return True


def _ask(opened: optuna_study.OpenStudy, space: space_lib.SearchSpace) -> optuna.Trial:
    """A new trial, or a clear error when the space conflicts with the study's earlier ones."""
    study = opened.study
    try:
        return optuna_study.ask(study, space.distributions)
    except ValueError as err:
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if "pid" not in trial.user_attrs and not trial.params:  # the half-made trial
                optuna_study.fail(opened, trial.number, {ERROR: str(err)})
        raise ConfigError(f"the search space does not fit study '{study.study_name}': {err} "
                          "(a choice's values cannot change within a study; use a new "
                          "hydra.sweeper.study_name)") from err


def _check_failure_rate(study: optuna.Study, max_rate: float, min_finished: int) -> None:
    """Stop the sweep when more than max_rate of its finished trials failed, judged once
    min_finished trials have finished (one early failure is no rate)."""
    # A trial whose process, machine or sweep died under it did not fail on its own.
    finished = [t for t in counted(study) if t.state in FINISHED
                and t.user_attrs.get(ERROR) not in (ORPHANED, STALE, PREEMPTED)]
    failed = [t for t in finished if t.state == TrialState.FAIL]
    if len(finished) >= min_finished and failed and len(failed) / len(finished) > max_rate:
        last = failed[-1]
        raise ConfigError(
            f"{len(failed)} of {len(finished)} finished trials failed, more than "
            f"max_failure_rate={max_rate}; sweep stopped. Last failure (trial {last.number}): "
            f"{last.user_attrs.get(ERROR, 'unknown error')}")


def search_space(settings: SweepSettings, arguments: Sequence[str]) -> space_lib.SearchSpace:
    """hydra.sweeper.params, then the sweep's task overrides (which win for a shared key)."""
    return space_lib.parse([*(f"{k}={v}" for k, v in settings.params.items()), *arguments])
