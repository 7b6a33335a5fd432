"""Where a sweep's study lives: the storage (SQLite in the sweep dir, any SQLAlchemy URL,
or a journal file), opened to ride out a database restart, and its heartbeats. Opening
storages, heartbeats and stale trials in general are optuna_study's; what becomes of a dead
trial is recovery.py's."""

from __future__ import annotations

from pathlib import Path

from capibara_exp.base import optuna_study
from capibara_exp.base.errors import ConfigError
from capibara_exp.sweeping import retry
from capibara_exp.sweeping.retry import Outage, RetryingStorage
from capibara_exp.sweeping.settings import SweepSettings

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


def open_storage(url: str, settings: SweepSettings) -> RetryingStorage:
    """The sweep's storage, every call retried while its database is away (retry.py) for up
    to hydra.sweeper.storage_retry_s; opening it too (a worker may start while the server
    restarts)."""
    outage = Outage(redacted(url), settings.storage_retry_s)
    inner = retry.call(outage, lambda: optuna_study.open_storage(
        url, heartbeat_interval(settings, url), settings.grace_period), "opening the storage")
    return RetryingStorage(inner, outage)


def redacted(url: str) -> str:
    """The URL without its password, for messages."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    return f"{scheme}://{credentials.split(':', 1)[0]}@{host}"
