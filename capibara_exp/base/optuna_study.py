"""Optuna for the sweeper (sweeping/) and the mesh planner (tuning/), on its public API:
sampler and pruner factories, opening a storage and a study on it, asking and telling
trials, heartbeats, and failing trials whose process or machine died.

Optuna keeps a study's storage and ids to itself (`Study._storage`, `Trial._trial_id`), so
an OpenStudy keeps the storage it was opened on and reaches a trial through the storage's
public methods by the trial's number. The one private use left is in base/private_apis.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import optuna
import sqlalchemy
from optuna.trial import TrialState

from capibara_exp.base import private_apis
from capibara_exp.base.errors import ConfigError

log = logging.getLogger(__name__)

# Samplers whose Optuna implementation imports a package on first use: (module, how to get it)
SAMPLER_PACKAGES = {"cmaes": ("cmaes", "pip install cmaes"),
                    "gp": ("torch", "pip install 'capibara-exp[gp]' (PyTorch; CPU build will do)")}
SINGLE_OBJECTIVE = ("cmaes",)


class _AskTellGridSampler(optuna.samplers.GridSampler):
    """GridSampler for an ask/tell loop: its end-of-grid `study.stop()` only works inside
    `study.optimize` (and would lose the trial's result); the loop caps trials at the grid."""

    def after_trial(self, study, trial, state, values) -> None:
        del study, trial, state, values


SAMPLER_NAMES = ("tpe", "random", "cmaes", "gp", "grid", "nsgaii")  # make_sampler's


def make_sampler(name: str, seed: int | None, options: Mapping[str, Any] | None = None, *,
                 key: str, grid: Callable[[], dict[str, list]] | None = None,
                 multi_objective: bool = False) -> optuna.samplers.BaseSampler:
    """The named sampler. `options` are more keyword arguments of its Optuna class (over the
    defaults here); `key` is the config key that named it, for errors; `grid` gives the
    grid sampler's lists (called only for name=grid)."""
    kw = {"seed": seed, **(options or {})}
    samplers: dict[str, Callable[[], optuna.samplers.BaseSampler]] = {
        "tpe": lambda: optuna.samplers.TPESampler(**{"multivariate": True, **kw}),
        "random": lambda: optuna.samplers.RandomSampler(**kw),
        "cmaes": lambda: optuna.samplers.CmaEsSampler(**kw),
        "gp": lambda: optuna.samplers.GPSampler(**kw),
        "grid": lambda: _AskTellGridSampler(_grid(grid, key), **kw),
        "nsgaii": lambda: optuna.samplers.NSGAIISampler(**kw),
    }
    if name not in samplers:
        raise ConfigError(f"{key}: '{name}' is not one of {sorted(samplers)}")
    if multi_objective and name in SINGLE_OBJECTIVE:
        raise ConfigError(f"{key}: '{name}' is single-objective; use nsgaii, tpe or random for "
                          "several directions")
    needs = SAMPLER_PACKAGES.get(name)
    if needs and importlib.util.find_spec(needs[0]) is None:
        raise ConfigError(f"{key}={name} needs {needs[0]}, which is not installed: {needs[1]}")
    try:
        return samplers[name]()
    except (TypeError, ValueError) as err:  # an unknown or bad keyword of the sampler
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{key}_options {options} for sampler={name}: {err}") from err


def _grid(grid: Callable[[], dict[str, list]] | None, key: str) -> dict[str, list]:
    if grid is None:
        raise ValueError(f"{key}=grid: the caller gave no grid to search")
    return grid()


def make_pruner(name: str, options: Mapping[str, Any] | None = None, *,
                key: str) -> optuna.pruners.BasePruner:
    """The named pruner; `options` are more keyword arguments of its Optuna class (over the
    defaults here); `key` is the config key that named it, for errors."""
    kw = dict(options or {})
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
        raise ConfigError(f"{key}: '{name}' is not one of {sorted(pruners)}")
    try:
        return pruners[name]()
    except (TypeError, ValueError) as err:  # an unknown or bad keyword of the pruner
        raise ConfigError(f"{key}_options {options} for pruner={name}: {err}") from err


def sampler_seed(seed: int | None, *parts: int) -> int | None:
    """A sampler's seed for one use of it: the configured seed mixed with `parts` (the
    sweeper's: the trial's number, which the storage hands out once per study), so that
    the same seed on every worker and machine still samples each trial anew, a new study
    samples the same points for the same seed, and a continued one does not replay the
    points its predecessors sampled."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, *parts]).generate_state(1)[0])


# ----------------------------------------------------------------------------- storages


def is_journal(url: str) -> bool:
    """Whether `url` names a journal file (a path ending .log or .journal, not a URL)."""
    return url.endswith((".log", ".journal")) and "://" not in url


def open_storage(url: str, heartbeat_s: int | None = None,
                 grace_period_s: int | None = None) -> optuna.storages.BaseStorage:
    """An Optuna storage for a SQLAlchemy URL or a journal file path (*.log, *.journal); on
    an RDB storage, running trials record a heartbeat every `heartbeat_s` (None: none)."""
    if is_journal(url):
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))
    # Local workers write one SQLite file at once: wait for its lock instead of failing.
    # A database server may restart under a sweep: a pooled connection is tested before use
    # (SQLAlchemy's pre-ping) and replaced if the server dropped it.
    kwargs = ({"connect_args": {"timeout": 60}} if url.startswith("sqlite")
              else {"pool_pre_ping": True})
    heartbeat = {"heartbeat_interval": heartbeat_s, "grace_period": grace_period_s}
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **heartbeat)
        except sqlalchemy.exc.SQLAlchemyError:
            # Workers starting together on a new database race to create its tables; the
            # loser finds them made on a second look.
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def heartbeat_s(storage: optuna.storages.BaseStorage) -> int | None:
    """Seconds between a running trial's heartbeats on `storage`; None: it keeps none."""
    interval = getattr(storage, "get_heartbeat_interval", None)  # RDB storages (and wrappers)
    return interval() if interval else None


# ----------------------------------------------------------------------------- studies


@dataclasses.dataclass(frozen=True)
class OpenStudy:
    """A study with the storage it was opened on and its id there."""

    study: optuna.Study
    storage: optuna.storages.BaseStorage
    study_id: int

    def trial_id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def trial(self, number: int) -> optuna.trial.FrozenTrial:
        """Trial `number` as the storage holds it now (another worker may have changed it)."""
        return self.storage.get_trial(self.trial_id(number))


def _opened(study: optuna.Study, storage: optuna.storages.BaseStorage) -> OpenStudy:
    return OpenStudy(study, storage, storage.get_study_id_from_name(study.study_name))


def create_or_load(storage: optuna.storages.BaseStorage, name: str | None,
                   directions: Sequence[str], *,
                   sampler: optuna.samplers.BaseSampler | None = None,
                   pruner: optuna.pruners.BasePruner | None = None) -> OpenStudy:
    """The study `name` on `storage`, made if it does not exist yet (None: a new name)."""
    study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                directions=list(directions), sampler=sampler, pruner=pruner)
    return _opened(study, storage)


def load(storage: optuna.storages.BaseStorage, name: str,
         pruner: optuna.pruners.BasePruner | None = None) -> OpenStudy:
    """The existing study `name` on `storage`."""
    return _opened(optuna.load_study(study_name=name, storage=storage, pruner=pruner), storage)


# ----------------------------------------------------------------------------- ask and tell


def ask(study: optuna.Study, distributions: Mapping[str, Any] | None = None) -> optuna.Trial:
    """study.ask, on a storage that may keep heartbeats (see heartbeat())."""
    with warnings.catch_warnings():
        # Optuna warns that heartbeats are only recorded inside Study.optimize; an ask/tell
        # loop records them itself (heartbeat()), so the warning does not apply here.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be "
                                "used with Study.optimize", category=UserWarning)
        return study.ask(dict(distributions) if distributions is not None else None)


def tell(study: optuna.Study, trial: optuna.Trial, values: float | Sequence[float] | None = None,
         *, state: TrialState | None = None, attrs: Mapping[str, Any] | None = None) -> None:
    """Finish a trial this process asked for: its user attributes `attrs`, then its
    values or state."""
    for key, value in (attrs or {}).items():
        trial.set_user_attr(key, value)
    study.tell(trial, values, state=state)


def fail(opened: OpenStudy, number: int, attrs: Mapping[str, Any] | None = None) -> bool:
    """Mark FAIL a running trial this process holds no Trial of (a dead process's, or one
    whose ask failed half-way), with user attributes `attrs` saying why; False when it had
    finished already (another worker failed it first)."""
    trial_id = opened.trial_id(number)
    try:
        for key, value in (attrs or {}).items():
            opened.storage.set_trial_user_attr(trial_id, key, value)
        opened.study.tell(number, state=TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    return True


# ----------------------------------------------------------------------------- heartbeats


@contextlib.contextmanager
def repeating(fn: Callable[[], object], period_s: float, name: str,
              first_now: bool = False) -> Iterator[None]:
    """Call fn() in a thread every period_s seconds (and at once if first_now) while the
    block runs; the thread is stopped and joined when it ends. fn handles its own errors."""
    stop = threading.Event()

    def loop() -> None:
        if first_now:
            fn()
        while not stop.wait(period_s):
            fn()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def heartbeat(opened: OpenStudy, number: int) -> Iterator[None]:
    """Record trial `number`'s heartbeat every interval while the block runs (nothing on a
    storage without heartbeats); a failing beat (the database away) is tried again."""
    interval = heartbeat_s(opened.storage)
    if not interval:
        yield
        return
    storage, trial_id, failing = opened.storage, opened.trial_id(number), [False]

    def beat() -> None:
        try:  # a database away (or anything else) must not end the heartbeats
            storage.record_heartbeat(trial_id)
            failing[0] = False
        except Exception as err:
            if not failing[0]:
                log.warning("trial %d: heartbeat not recorded (%s: %s); trying again",
                            number, type(err).__name__, str(err).splitlines()[0][:200])
            failing[0] = True

    with repeating(beat, interval, f"heartbeat-{number}", first_now=True):
        yield


def grace_period_s(storage: optuna.storages.BaseStorage) -> int | None:
    """Seconds without a heartbeat before a running trial is stale; None: no heartbeats."""
    interval = heartbeat_s(storage)
    if not interval:
        return None
    return getattr(storage, "grace_period", None) or 2 * interval


def stale_trials(opened: OpenStudy) -> list[optuna.trial.FrozenTrial]:
    """The RUNNING trials whose heartbeat is older than the storage's grace period (nothing
    on a storage without heartbeats), as the storage holds them now."""
    storage = opened.storage
    if not heartbeat_s(storage):
        return []
    # Optuna's public fail_stale_trials finds them too, but fails them first: then the reason
    # can no longer be recorded on the trial (the storage refuses to change a finished one).
    stale = getattr(storage, "stale_trial_ids", None)  # a wrapper's (sweeping/retry.py)
    ids = stale(opened.study_id) if stale else private_apis.stale_trial_ids(storage,
                                                                            opened.study_id)
    return [storage.get_trial(trial_id) for trial_id in ids]
