"""Where a sweep's study lives: the storage (SQLite in the sweep dir, any SQLAlchemy URL,
or a journal file), its heartbeats, and failing the trials of processes or machines that
died. Opening storages, heartbeats and stale trials in general are optuna_study's."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from optuna.trial import TrialState

from capibara_exp import optuna_study
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


def heartbeat_interval(settings: SweepSettings, url: str) -> int | None:
    """Seconds between a running trial's heartbeats in the storage; None: no heartbeat.

    On by default where workers may run on other machines (an RDB storage other than
    SQLite): a trial whose machine died is then failed once its heartbeat is older than the
    grace period. On this host, the pid check (fail_orphans) finds dead processes at once."""
    if settings.heartbeat_interval is not None:
        if settings.heartbeat_interval and optuna_study.is_journal(url):
            raise ConfigError(f"hydra.sweeper.heartbeat_interval: the journal storage {url} "
                              "keeps no heartbeats; use an RDB storage (PostgreSQL) or 0")
        return settings.heartbeat_interval or None
    if optuna_study.is_journal(url) or url.startswith("sqlite"):
        return None
    return HEARTBEAT_S


def fail_orphans(opened: optuna_study.OpenStudy) -> list[int]:
    """Mark FAIL the RUNNING trials of dead processes on this host (a killed sweep)."""
    host, failed = socket.gethostname(), []
    for trial in opened.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        attrs = trial.user_attrs
        if (attrs.get("host") == host and "pid" in attrs and not _alive(int(attrs["pid"]))
                and optuna_study.fail(opened, trial.number, {ERROR: ORPHANED})):
            failed.append(trial.number)
    return failed


def fail_stale(opened: optuna_study.OpenStudy) -> list[int]:
    """Mark FAIL the RUNNING trials whose heartbeat is older than the grace period (a dead
    machine's, or a dead process's anywhere); nothing on a storage without heartbeats."""
    return optuna_study.fail_stale(opened, {ERROR: STALE})


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
