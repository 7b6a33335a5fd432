"""An Optuna study driven by Hydra jobs: ask, launch one job, tell; resumable from storage.

Every worker (this process, the `n_workers - 1` it starts, and any other process pointed at
the same storage) pulls trials until the study holds `n_trials` finished or running ones,
so re-running the same command continues a study, and trials are never rerun. A trial left
RUNNING by a process of this host that no longer exists, or (on a storage with heartbeats:
PostgreSQL, MySQL) by any machine that stopped sending its heartbeat, is marked FAIL before
new trials start.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import math
import os
import socket
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

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
    heartbeat,
    heartbeat_interval,
    make_storage,
    storage_url,
)

__all__ = ["ERROR", "HEARTBEAT_S", "NOT_RUN", "ORPHANED", "RESULTS", "STALE", "SweepSettings",
           "counted", "fail_orphans", "fail_stale", "heartbeat", "heartbeat_interval",
           "make_pruner", "make_sampler", "make_storage", "open_study", "run", "storage_url",
           "summary", "write_results"]

log = logging.getLogger(__name__)

PRUNED_AT = "pruned_at_step"
PRUNER_OPTIONS = "pruner_options"  # a trial's job rebuilds its sweep's pruner with these
MIN_FINISHED = 5  # finished trials before max_failure_rate applies (fewer if n_trials is less)
CACHE_KEY = "compilation_cache_dir"
STORAGE_ENV = "CAPIBARA_SWEEP_STORAGE"
# Samplers whose Optuna implementation imports a package on first use: (module, how to get it)
SAMPLER_PACKAGES = {"cmaes": ("cmaes", "pip install cmaes"),
                    "gp": ("torch", "pip install 'capibara-exp[gp]' (PyTorch; CPU build will do)")}
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


class _AskTellGridSampler(optuna.samplers.GridSampler):
    """GridSampler for an ask/tell loop: its end-of-grid `study.stop()` only works inside
    `study.optimize` (and would lose the trial's result); the loop caps trials at the grid."""

    def after_trial(self, study, trial, state, values) -> None:
        del study, trial, state, values


def grid_done(study: optuna.Study, space: space_lib.SearchSpace) -> bool:
    """Whether every point of the grid has a trial (finished or running)."""
    grid = space.grid()
    seen = {tuple(t.params.get(k) for k in grid) for t in study.get_trials(deepcopy=False)}
    return set(itertools.product(*grid.values())) <= seen


def make_sampler(name: str, seed: int | None, space: space_lib.SearchSpace,
                 multi_objective: bool, options: dict[str, Any] | None = None
                 ) -> optuna.samplers.BaseSampler:
    """The named sampler; `options` are more keyword arguments of its Optuna class
    (hydra.sweeper.sampler_options, e.g. {n_startup_trials: 5})."""
    kw = {"seed": seed, **(options or {})}
    samplers: dict[str, Callable[[], optuna.samplers.BaseSampler]] = {
        "tpe": lambda: optuna.samplers.TPESampler(**{"multivariate": True, **kw}),
        "random": lambda: optuna.samplers.RandomSampler(**kw),
        "cmaes": lambda: optuna.samplers.CmaEsSampler(**kw),
        "gp": lambda: optuna.samplers.GPSampler(**kw),
        "grid": lambda: _AskTellGridSampler(space.grid(), **kw),
        "nsgaii": lambda: optuna.samplers.NSGAIISampler(**kw),
    }
    if name not in samplers:
        raise ConfigError(f"hydra.sweeper.sampler: '{name}' is not one of {sorted(samplers)}")
    if multi_objective and name in ("cmaes",):
        raise ConfigError(f"hydra.sweeper.sampler: '{name}' is single-objective; use nsgaii, tpe "
                          "or random for several directions")
    needs = SAMPLER_PACKAGES.get(name)
    if needs and importlib.util.find_spec(needs[0]) is None:
        raise ConfigError(f"hydra.sweeper.sampler={name} needs {needs[0]}, which is not "
                          f"installed: {needs[1]}")
    try:
        return samplers[name]()
    except (TypeError, ValueError) as err:  # an unknown or bad keyword of the sampler
        raise ConfigError(f"hydra.sweeper.sampler_options {options} for sampler={name}: "
                          f"{err}") from err


def make_pruner(name: str, options: dict[str, Any] | None = None) -> optuna.pruners.BasePruner:
    """The named pruner; `options` are more keyword arguments of its Optuna class
    (hydra.sweeper.pruner_options, e.g. {n_warmup_steps: 40})."""
    kw = options or {}
    pruners: dict[str, Callable[[], optuna.pruners.BasePruner]] = {
        "none": lambda: optuna.pruners.NopPruner(**kw),
        "median": lambda: optuna.pruners.MedianPruner(
            **{"n_startup_trials": 2, "n_warmup_steps": 0, **kw}),
        "percentile": lambda: optuna.pruners.PercentilePruner(
            **{"percentile": 25.0, "n_startup_trials": 2, **kw}),
        "successive_halving": lambda: optuna.pruners.SuccessiveHalvingPruner(**kw),
        "hyperband": lambda: optuna.pruners.HyperbandPruner(**kw),
    }
    if name not in pruners:
        raise ConfigError(f"hydra.sweeper.pruner: '{name}' is not one of {sorted(pruners)}")
    try:
        return pruners[name]()
    except (TypeError, ValueError) as err:  # an unknown or bad keyword of the pruner
        raise ConfigError(f"hydra.sweeper.pruner_options {options} for pruner={name}: "
                          f"{err}") from err


def open_study(settings: SweepSettings, url: str, space: space_lib.SearchSpace) -> optuna.Study:
    multi = len(settings.directions) > 1
    storage = make_storage(url, heartbeat_interval(settings, url), settings.grace_period)
    study = optuna.create_study(
        study_name=settings.study_name, storage=storage, load_if_exists=True,
        directions=settings.directions, pruner=make_pruner(settings.pruner,
                                                           settings.pruner_options))
    seed = sampler_seed(settings.seed, len(study.get_trials(deepcopy=False)),
                        settings.worker_index)
    study.sampler = make_sampler(settings.sampler, seed, space, multi, settings.sampler_options)
    return study


def sampler_seed(seed: int | None, trials_so_far: int, worker_index: int) -> int | None:
    """The sampler's seed for this invocation: the configured seed mixed with how many trials
    the study already holds and the worker's index. A new study's first invocation samples
    the same points for the same seed; one that continues a study (or another worker)
    does not replay the points its predecessors sampled, as re-seeding with the bare seed
    would (trial 0's parameters again)."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, trials_so_far, worker_index]).generate_state(1)[0])


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
    study = open_study(settings, url, space)
    fail_orphans(study)
    fail_stale(study)
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
        fail_stale(study)  # a machine that died while this one ran its last trial
        trial = _ask(study, space)
        if _lost_race(study, trial, settings.n_trials):
            break
        overrides = _trial_overrides(study, trial, space, settings, url, pruning, sweep_dir)
        with heartbeat(study, trial):
            _run_trial(study, trial, launch, overrides, settings.metrics)
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
    trial.set_user_attr("host", socket.gethostname())
    trial.set_user_attr("pid", os.getpid())
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
    trial.set_user_attr(NOT_RUN, f"the study already had n_trials={n_trials}")
    study.tell(trial, state=TrialState.FAIL)
    return True


def _ask(study: optuna.Study, space: space_lib.SearchSpace) -> optuna.Trial:
    """study.ask, or a clear error when the space conflicts with the study's earlier trials."""
    try:
        with warnings.catch_warnings():
            # Optuna warns that heartbeats are only recorded inside Study.optimize; this loop
            # records them itself (heartbeat()), so the warning does not apply here.
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be "
                                    "used with Study.optimize", category=UserWarning)
            return study.ask(space.distributions)
    except ValueError as err:
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if "pid" not in trial.user_attrs and not trial.params:  # the half-made trial
                study._storage.set_trial_user_attr(trial._trial_id, ERROR, str(err))
                study.tell(trial.number, state=TrialState.FAIL)
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


def _run_trial(study: optuna.Study, trial: optuna.Trial, launch: Launch, overrides: list[str],
               metrics: Sequence[str]) -> None:
    error = values = None
    try:
        values = values_of(launch(overrides, trial.number), metrics)
    except Exception as err:  # a failing job is a FAIL trial, never the end of the sweep
        error = f"{type(err).__name__}: {err}"[:2000]
    frozen = study._storage.get_trial(trial._trial_id)
    if frozen.state.is_finished():  # another worker failed it: its heartbeat came too late
        log.warning("trial %d was failed by another worker while it ran (%s); its result is "
                    "dropped: raise hydra.sweeper.grace_period if heartbeats can be that late",
                    trial.number, frozen.user_attrs.get(ERROR, "no reason recorded"))
    elif error is not None:
        trial.set_user_attr(ERROR, error)
        study.tell(trial, state=TrialState.FAIL)
    elif PRUNED_AT in frozen.user_attrs:
        study.tell(trial, state=TrialState.PRUNED)
    elif not all(math.isfinite(v) for v in values):
        trial.set_user_attr(ERROR, f"non-finite objective {values}")
        study.tell(trial, state=TrialState.FAIL)
    else:
        study.tell(trial, values)


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
