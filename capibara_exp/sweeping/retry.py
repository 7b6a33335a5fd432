"""A sweep's storage that rides out a database restart: every call is retried with backoff
while the database is away, with one line when it goes and one when it is back.

Optuna's RDBStorage gives up on the first dropped connection (a restarted PostgreSQL server
closes every pooled connection: the next commit fails with "server closed the connection
unexpectedly", which Optuna reports as StorageInternalError). Connections are pre-pinged
(SQLAlchemy's pool_pre_ping, optuna_study.open_storage), so a stale pooled connection is
replaced before use; what fails while the server is down is retried here, every call of
Optuna's storage API alike (ask, tell, report, heartbeats, the stale-trial checks).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import optuna
import sqlalchemy
from optuna.trial import TrialState

from capibara_exp.base import private_apis
from capibara_exp.base.errors import RunError

T = TypeVar("T")
FIRST_WAIT_S, MAX_WAIT_S = 0.5, 2.0  # backoff; short at the top, so heartbeats resume soon
_TRANSIENT = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError,
              sqlalchemy.exc.DisconnectionError, ConnectionError)


class StorageUnavailable(RunError):
    """The study's storage stayed away longer than the configured retry window."""


def transient(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is a lost or refused database connection, or a
    locked SQLite file: worth trying again, unlike bad data or a finished trial."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, _TRANSIENT):
            return True
        if isinstance(seen, sqlalchemy.exc.DBAPIError) and seen.connection_invalidated:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _say(line: str) -> None:
    print(f"capibara-exp: {line}", file=sys.stderr, flush=True)


class Outage:
    """How long the storage has been away, shared by a process's threads, so that the
    outage is reported once, not per call; `back_at` (monotonic) is when it last returned."""

    def __init__(self, what: str, retry_s: float, key: str = "hydra.sweeper.storage_retry_s",
                 say: Callable[[str], None] = _say):
        self.what, self.retry_s, self.key, self.say = what, retry_s, key, say
        self.lock = threading.Lock()
        self.since: float | None = None
        self.back_at: float | None = None  # when it last came back (monotonic)

    def failed(self, err: BaseException) -> None:
        with self.lock:
            if self.since is None:
                self.since = time.monotonic()
                first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
                self.say(f"the study's storage ({self.what}) is unreachable "
                         f"({type(err).__name__}: {first}); retrying for up to "
                         f"{self.retry_s:.0f} s ({self.key})")

    def succeeded(self) -> None:
        if self.since is None:  # the common case, without taking the lock
            return
        with self.lock:
            if self.since is not None:
                self.say(f"the study's storage is back after {time.monotonic() - self.since:.0f} s")
                self.since, self.back_at = None, time.monotonic()

    def back_since_s(self) -> float:
        """Seconds since the storage came back from its last outage (inf: none yet)."""
        return float("inf") if self.back_at is None else time.monotonic() - self.back_at

    def away_s(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since


def call(outage: Outage, fn: Callable[[], T], what: str) -> T:
    """fn(), retried with backoff while it fails for a transient reason, at most the
    outage's retry window (counted from the outage's start, across threads)."""
    wait = FIRST_WAIT_S
    while True:
        try:
            result = fn()
        except Exception as err:
            if not transient(err):
                raise
            outage.failed(err)
            if outage.away_s() >= outage.retry_s:
                raise StorageUnavailable(
                    f"the study's storage ({outage.what}) was unreachable for "
                    f"{outage.away_s():.0f} s while {what}: {type(err).__name__}: "
                    f"{str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
                ) from err
            time.sleep(wait)
            wait = min(2 * wait, MAX_WAIT_S)
            continue
        outage.succeeded()
        return result


def _retried(name: str) -> Callable[..., Any]:
    def method(self: RetryingStorage, *args: Any, **kwargs: Any) -> Any:
        return call(self.outage, lambda: getattr(self.inner, name)(*args, **kwargs), name)

    method.__name__ = name
    method.__doc__ = f"The inner storage's {name}, retried while the database is away."
    return method


class RetryingStorage(optuna.storages.BaseStorage):
    """An Optuna storage whose every call is retried while its database is away."""

    def __init__(self, inner: optuna.storages.BaseStorage, outage: Outage):
        self.inner, self.outage = inner, outage

    create_new_study = _retried("create_new_study")
    delete_study = _retried("delete_study")
    set_study_user_attr = _retried("set_study_user_attr")
    set_study_system_attr = _retried("set_study_system_attr")
    get_study_id_from_name = _retried("get_study_id_from_name")
    get_study_name_from_id = _retried("get_study_name_from_id")
    get_study_directions = _retried("get_study_directions")
    get_study_user_attrs = _retried("get_study_user_attrs")
    get_study_system_attrs = _retried("get_study_system_attrs")
    get_all_studies = _retried("get_all_studies")
    create_new_trial = _retried("create_new_trial")
    set_trial_param = _retried("set_trial_param")
    get_trial_id_from_study_id_trial_number = _retried("get_trial_id_from_study_id_trial_number")
    get_trial_number_from_id = _retried("get_trial_number_from_id")
    set_trial_intermediate_value = _retried("set_trial_intermediate_value")
    set_trial_user_attr = _retried("set_trial_user_attr")
    set_trial_system_attr = _retried("set_trial_system_attr")
    get_trial = _retried("get_trial")
    get_all_trials = _retried("get_all_trials")
    get_n_trials = _retried("get_n_trials")
    # Heartbeats (RDB storages): recorded by optuna_study.heartbeat, read by fail_stale.
    record_heartbeat = _retried("record_heartbeat")

    @property
    def grace_period(self) -> int | None:
        return getattr(self.inner, "grace_period", None)

    def get_heartbeat_interval(self) -> int | None:
        """The inner storage's heartbeat interval (a setting, no database call); None where
        it keeps no heartbeats (SQLite by default, journal files)."""
        interval = getattr(self.inner, "get_heartbeat_interval", None)
        return interval() if interval else None

    def set_trial_state_values(self, trial_id: int, state: TrialState,
                               values: Any = None) -> bool:
        """Retried like every call; a retry that finds its own earlier commit (the
        connection dropped after the server committed) is that commit's success."""
        tries = 0

        def once() -> bool:
            nonlocal tries
            tries += 1
            try:
                return self.inner.set_trial_state_values(trial_id, state, values)
            except optuna.exceptions.UpdateFinishedTrialError:
                if tries > 1 and self.inner.get_trial(trial_id).state == state:
                    return True
                raise

        return call(self.outage, once, "set_trial_state_values")

    def stale_trial_ids(self, study_id: int) -> list[int]:
        """The inner RDB storage's stale trials (private_apis.stale_trial_ids), retried."""
        return call(self.outage, lambda: private_apis.stale_trial_ids(self.inner, study_id),
                    "checking heartbeats")

    def remove_session(self) -> None:
        self.inner.remove_session()
