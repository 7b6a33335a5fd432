"""Where a sweep's study lives: the storage (SQLite in the sweep dir, any SQLAlchemy URL,
or a journal file), the heartbeats of running trials, and failing the trials of processes
or machines that died."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import optuna
import sqlalchemy
from optuna.trial import TrialState

from capibara_exp.errors import ConfigError

if TYPE_CHECKING:
    from capibara_exp.sweeping.study import SweepSettings

ERROR = "error"
ORPHANED = "its process died"
STALE = "no heartbeat within the grace period: its machine or process died"
HEARTBEAT_S = 60  # heartbeat interval on RDB storages other than SQLite, unless configured


def storage_url(storage: str | None, sweep_dir: Path) -> str:
    """The configured storage, or SQLite in the sweep dir."""
    if storage:
        return storage
    sweep_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(sweep_dir / 'optuna.db').absolute()}"


def _is_journal(url: str) -> bool:
    return url.endswith((".log", ".journal")) and "://" not in url


def heartbeat_interval(settings: SweepSettings, url: str) -> int | None:
    """Seconds between a running trial's heartbeats in the storage; None: no heartbeat.

    On by default where workers may run on other machines (an RDB storage other than
    SQLite): a trial whose machine died is then failed once its heartbeat is older than the
    grace period. On this host, the pid check (fail_orphans) finds dead processes at once."""
    if settings.heartbeat_interval is not None:
        if settings.heartbeat_interval and _is_journal(url):
            raise ConfigError(f"hydra.sweeper.heartbeat_interval: the journal storage {url} "
                              "keeps no heartbeats; use an RDB storage (PostgreSQL) or 0")
        return settings.heartbeat_interval or None
    if _is_journal(url) or url.startswith("sqlite"):
        return None
    return HEARTBEAT_S


def make_storage(url: str, heartbeat_s: int | None = None,
                 grace_period_s: int | None = None) -> optuna.storages.BaseStorage:
    """An Optuna storage for a SQLAlchemy URL or a journal file path (*.log, *.journal)."""
    if _is_journal(url):
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))
    # Local workers write one SQLite file at once: wait for its lock instead of failing.
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
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


def fail_orphans(study: optuna.Study) -> list[int]:
    """Mark FAIL the RUNNING trials of dead processes on this host (a killed sweep)."""
    host, failed = socket.gethostname(), []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        attrs = trial.user_attrs
        if attrs.get("host") == host and not _alive(int(attrs.get("pid", -1))):
            study._storage.set_trial_user_attr(trial._trial_id, ERROR, ORPHANED)
            study.tell(trial.number, state=TrialState.FAIL)
            failed.append(trial.number)
    return failed


def fail_stale(study: optuna.Study) -> list[int]:
    """Mark FAIL the RUNNING trials whose heartbeat is older than the grace period (a dead
    machine's, or a dead process's anywhere); nothing on a storage without heartbeats."""
    storage = study._storage
    if not getattr(storage, "get_heartbeat_interval", lambda: None)():
        return []
    failed = []
    # Optuna's fail_stale_trials does this too, but fails first: then the reason can no
    # longer be recorded on the trial (the storage refuses to change a finished trial).
    for trial_id in storage._get_stale_trial_ids(study._study_id):
        try:
            storage.set_trial_user_attr(trial_id, ERROR, STALE)
            if storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                failed.append(storage.get_trial(trial_id).number)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker failed it first
    return failed


@contextlib.contextmanager
def heartbeat(study: optuna.Study, trial: optuna.Trial) -> Iterator[None]:
    """Record the trial's heartbeat in the storage every interval while the block runs."""
    storage = study._storage
    interval = getattr(storage, "get_heartbeat_interval", lambda: None)()
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            storage.record_heartbeat(trial._trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
