"""An Optuna study driven by Hydra jobs: ask, launch one job, tell; resumable from storage.

Every worker (this process, the `n_workers - 1` it starts, and any other process pointed at
the same storage) pulls trials until the study holds `n_trials` finished or running ones,
so re-running the same command continues a study, and trials are never rerun. A trial left
RUNNING by a process of this host that no longer exists, or (on a storage with heartbeats:
PostgreSQL, MySQL) by any machine that stopped sending its heartbeat, is marked FAIL before
new trials start.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from capibara_exp import optuna_study
from capibara_exp.errors import ConfigError
from capibara_exp.sweeping import space as space_lib

# The study's storage and results live in their own modules; their names are this
# module's too (the sweeper, the pruning action and tests use them from here).
from capibara_exp.sweeping.results import NOT_RUN, RESULTS, counted, summary, write_results
from capibara_exp.sweeping.storage import (
    ERROR,
    HEARTBEAT_S,
    ORPHANED,
    STALE,
    fail_orphans,
    fail_stale,
    heartbeat_interval,
    storage_url,
)

__all__ = ["ERROR", "HEARTBEAT_S", "NOT_RUN", "ORPHANED", "RESULTS", "STALE", "SweepSettings",
           "counted", "fail_orphans", "fail_stale", "heartbeat_interval", "open_study", "run",
           "storage_url", "summary", "write_results"]

log = logging.getLogger(__name__)

PRUNED_AT = "pruned_at_step"
PRUNER_OPTIONS = "pruner_options"  # a trial's job rebuilds its sweep's pruner with these
MIN_FINISHED = 5  # finished trials before max_failure_rate applies (fewer if n_trials is less)
CACHE_KEY = "compilation_cache_dir"
STORAGE_ENV = "CAPIBARA_SWEEP_STORAGE"
SAMPLER_KEY, PRUNER_KEY = "hydra.sweeper.sampler", "hydra.sweeper.pruner"  # named in errors
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


@dataclass
class SweepSettings:
    """hydra.sweeper.* of conf/hydra/sweeper/capibara_optuna.yaml."""

    study_name: str
    storage: str | None = None
    direction: str | list[str] = "minimize"
    metric: str | list[str] = "loss"
    sampler: str = "tpe"
    seed: int | None = None
    n_trials: int = 8
    max_failure_rate: float = 0.5
    pruner: str = "none"
    n_workers: int = 1
    compile_cache: bool = True  # trials share XLA's compilation cache in the sweep dir
    worker_index: int = 0  # set on the processes a sweep starts; 0 is the one you started
    params: dict[str, str] = field(default_factory=dict)
    # More keywords of the Optuna sampler and pruner. null in the YAML (a {} there would be
    # a struct node that refuses `hydra.sweeper.pruner_options={n_warmup_steps: 40}`).
    sampler_options: dict[str, Any] | None = None
    pruner_options: dict[str, Any] | None = None
    heartbeat_interval: int | None = None  # None: HEARTBEAT_S on non-SQLite RDB; 0: off
    grace_period: int | None = None  # None: twice the heartbeat interval

    @property
    def directions(self) -> list[str]:
        return [self.direction] if isinstance(self.direction, str) else list(self.direction)

    @property
    def metrics(self) -> list[str]:
        return [self.metric] if isinstance(self.metric, str) else list(self.metric)

    def __post_init__(self) -> None:
        self.sampler_options = dict(self.sampler_options or {})
        self.pruner_options = dict(self.pruner_options or {})
        if len(self.directions) != len(self.metrics):
            raise ConfigError(f"hydra.sweeper: {len(self.directions)} direction(s) but "
                              f"{len(self.metrics)} metric(s); give one direction per metric")
        if self.n_workers < 1:
            raise ConfigError(f"hydra.sweeper.n_workers must be >= 1, got {self.n_workers}")
        if self.n_trials < 1:
            raise ConfigError(f"hydra.sweeper.n_trials must be >= 1, got {self.n_trials}")
        if not 0.0 <= self.max_failure_rate <= 1.0:
            raise ConfigError("hydra.sweeper.max_failure_rate must be in [0, 1], "
                              f"got {self.max_failure_rate}")
        if self.heartbeat_interval is not None and self.heartbeat_interval < 0:
            raise ConfigError("hydra.sweeper.heartbeat_interval must be >= 0 (0: off) or null, "
                              f"got {self.heartbeat_interval}")
        if self.grace_period is not None and self.grace_period < 1:
            raise ConfigError("hydra.sweeper.grace_period must be >= 1 or null, "
                              f"got {self.grace_period}")


def grid_done(study: optuna.Study, space: space_lib.SearchSpace) -> bool:
    """Whether every point of the grid has a trial (finished or running)."""
    grid = space.grid()
    seen = {tuple(t.params.get(k) for k in grid) for t in study.get_trials(deepcopy=False)}
    return set(itertools.product(*grid.values())) <= seen


def open_study(settings: SweepSettings, url: str,
               space: space_lib.SearchSpace) -> optuna_study.OpenStudy:
    """The sweep's study on its storage, made if new, with its sampler and pruner."""
    storage = optuna_study.open_storage(url, heartbeat_interval(settings, url),
                                        settings.grace_period)
    pruner = optuna_study.make_pruner(settings.pruner, settings.pruner_options, key=PRUNER_KEY)
    opened = optuna_study.create_or_load(storage, settings.study_name, settings.directions,
                                         pruner=pruner)
    seed = optuna_study.sampler_seed(settings.seed, len(opened.study.get_trials(deepcopy=False)),
                                     settings.worker_index)
    opened.study.sampler = optuna_study.make_sampler(
        settings.sampler, seed, settings.sampler_options, key=SAMPLER_KEY, grid=space.grid,
        multi_objective=len(settings.directions) > 1)
    return opened


def values_of(result: Any, metrics: Sequence[str]) -> list[float]:
    """The objective values from a job's return value (a mapping of final metrics)."""
    if not isinstance(result, dict):
        raise ConfigError(f"the job returned {result!r}, not a mapping of metrics")
    missing = [m for m in metrics if m not in result]
    if missing:
        raise ConfigError(f"the job's metrics have no {missing} (it has {sorted(result)})")
    return [float(result[m]) for m in metrics]


Launch = Callable[[list[str], int], Any]  # (overrides, trial number) -> the job's return value


def run(settings: SweepSettings, launch: Launch, sweep_dir: Path, arguments: Sequence[str] = (),
        on_open: Callable[[], Any] | None = None, groups: Sequence[str] = (),
        write: bool = True, report: Callable[[str], None] | None = None) -> optuna.Study:
    """Run trials until the study has n_trials; return the study.

    `arguments` are the sweep's task overrides (they win over `settings.params`); `groups`
    the composed config's groups, for the best-trial file (see best.write). `on_open` runs
    once the study exists in its storage (the sweeper starts its workers there, so they
    find the study made). `write`: write the results at the end (write_results). `report`
    gets a line per finished trial, and one when the study already holds n_trials."""
    report = report or (lambda line: None)
    space = search_space(settings, arguments)
    if not space.distributions:
        raise ConfigError("hydra.sweeper.params and the command line define no search dimension "
                          "(use choice(...), range(...), interval(...))")
    url = storage_url(settings.storage, sweep_dir)
    opened = open_study(settings, url, space)
    study = opened.study
    fail_orphans(opened)
    fail_stale(opened)
    if on_open:
        on_open()
    pruning = settings.pruner != "none" and len(settings.directions) == 1
    if settings.pruner != "none" and not pruning:
        log.warning("hydra.sweeper.pruner=%s is off: Optuna prunes single-objective studies "
                    "only, and this one has %d directions", settings.pruner,
                    len(settings.directions))
    if len(counted(study)) >= settings.n_trials:
        report(f"study '{settings.study_name}' already holds n_trials={settings.n_trials} "
               f"trials ({sweep_dir}): nothing to run; raise hydra.sweeper.n_trials for more")
    while len(counted(study)) < settings.n_trials:
        if settings.sampler == "grid" and grid_done(study, space):
            break  # every point once, never twice
        fail_stale(opened)  # a machine that died while this one ran its last trial
        trial = _ask(opened, space)
        if _lost_race(study, trial, settings.n_trials):
            break
        overrides = _trial_overrides(study, trial, space, settings, url, pruning, sweep_dir)
        with optuna_study.heartbeat(opened, trial.number):
            _run_trial(opened, trial, launch, overrides, settings.metrics)
        report(outcome(study, trial.number, settings.metrics))
        _check_failure_rate(study, settings.max_failure_rate,
                            min(settings.n_trials, MIN_FINISHED))
    if write:
        write_results(study, settings, sweep_dir, space.fixed, groups)
    return study


def _trial_overrides(study: optuna.Study, trial: optuna.Trial, space: space_lib.SearchSpace,
                     settings: SweepSettings, url: str, pruning: bool,
                     sweep_dir: Path) -> list[str]:
    """The trial's job overrides (with its pruning hook and the shared compile cache)."""
    # pid before host: a peer's orphan check reads a trial with our host as ours, so its pid
    # must already be there (else the peer takes the live trial for a dead one's).
    trial.set_user_attr("pid", os.getpid())
    trial.set_user_attr("host", socket.gethostname())
    overrides = job_overrides(space, trial.params)
    if pruning:
        if settings.pruner_options:
            trial.set_user_attr(PRUNER_OPTIONS, dict(settings.pruner_options))
        overrides.append(trial_override(url, settings, trial.number))
    if settings.compile_cache and not any(f.startswith(CACHE_KEY + "=") for f in space.fixed):
        cache = str(sweep_dir.absolute() / "xla_cache")
        overrides.append(space_lib.to_override(CACHE_KEY, cache))
    return overrides


def outcome(study: optuna.Study, number: int, metrics: Sequence[str]) -> str:
    """One line for a finished trial: its value, 'pruned at step N', or its error."""
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in trial.params.items())
    if trial.state == TrialState.PRUNED:
        value = f"; {metrics[0]} {trial.value:.6g}" if trial.value is not None else ""
        return f"trial {number} pruned at step {trial.user_attrs.get(PRUNED_AT)}{value} ({params})"
    if trial.state == TrialState.FAIL:
        error = str(trial.user_attrs.get(ERROR, "unknown error")).splitlines()[0][:300]
        return f"trial {number} failed: {error}"
    if trial.state == TrialState.COMPLETE:
        values = ", ".join(f"{m} {v:.6g}" for m, v in zip(metrics, trial.values, strict=False))
        return f"trial {number}: {values} ({params})"
    return f"trial {number}: {trial.state.name.lower()}"


def job_overrides(space: space_lib.SearchSpace, params: dict[str, Any]) -> list[str]:
    """A trial's Hydra overrides: the sweep's fixed ones, then the trial's sampled values."""
    return [*space.fixed, *(space_lib.to_override(k, v) for k, v in params.items())]


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


def trial_override(url: str, settings: SweepSettings, number: int) -> str:
    """The `sweep_trial` override through which a job reports to its trial (pruning).

    The storage URL may hold a password: the job reads it from this process's environment,
    so run dirs (overrides.yaml, config.yaml) record only the variable's name."""
    os.environ[STORAGE_ENV] = url
    # The pruner is not kept in the storage: the job rebuilds the same one from its name.
    return (f"sweep_trial={{storage:'${{oc.env:{STORAGE_ENV}}}',"
            f"study_name:'{settings.study_name}',number:{number},"
            f"metric:{settings.metrics[0]},pruner:{settings.pruner}}}")


def _run_trial(opened: optuna_study.OpenStudy, trial: optuna.Trial, launch: Launch,
               overrides: list[str], metrics: Sequence[str]) -> None:
    study, error, values = opened.study, None, None
    try:
        values = values_of(launch(overrides, trial.number), metrics)
    except Exception as err:  # a failing job is a FAIL trial, never the end of the sweep
        error = f"{type(err).__name__}: {err}"[:2000]
    frozen = opened.trial(trial.number)  # as the job and the other workers left it
    if frozen.state.is_finished():  # another worker failed it: its heartbeat came too late
        log.warning("trial %d was failed by another worker while it ran (%s); its result is "
                    "dropped: raise hydra.sweeper.grace_period if heartbeats can be that late",
                    trial.number, frozen.user_attrs.get(ERROR, "no reason recorded"))
    elif error is not None:
        optuna_study.tell(study, trial, state=TrialState.FAIL, attrs={ERROR: error})
    elif PRUNED_AT in frozen.user_attrs:
        optuna_study.tell(study, trial, state=TrialState.PRUNED)
    elif not all(math.isfinite(v) for v in values):
        optuna_study.tell(study, trial, state=TrialState.FAIL,
                          attrs={ERROR: f"non-finite objective {values}"})
    else:
        optuna_study.tell(study, trial, values)


def _check_failure_rate(study: optuna.Study, max_rate: float, min_finished: int) -> None:
    """Stop the sweep when more than max_rate of its finished trials failed, judged once
    min_finished trials have finished (one early failure is no rate)."""
    # A trial whose sweep was killed under it did not fail on its own: it does not count.
    finished = [t for t in counted(study)
                if t.state in FINISHED and t.user_attrs.get(ERROR) not in (ORPHANED, STALE)]
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
