"""A sweep's trials outlive the processes and machines that run them.

- Dead trials are found while a worker waits, not at its next ask: a thread checks, every
  few seconds, for RUNNING trials of dead processes on this host (by pid) and of machines
  whose heartbeat is older than the grace period (RDB storages), and fails them.
- A trial failed that way, or preempted (its job exited 75), is retried as Optuna's
  RetryHeartbeatStaleTrialCallback does: a WAITING copy with the same parameters, which the
  next ask runs first, at most `max_retries` times; the copy keeps the trial's run dir, so
  the retry resumes from its last checkpoint. A retried trial does not count toward
  n_trials (results.counted), its retry does.
- A finished trial's result is kept on disk (<sweep dir>/outbox/) until the storage has it:
  a worker that gave up on an absent database leaves it there, and the next run of the
  command tells it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import socket
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from capibara_exp.base import atomic, optuna_study, run_lock
from capibara_exp.sweeping.results import NOT_RUN, RETRIED
from capibara_exp.sweeping.retry import Outage
from capibara_exp.sweeping.settings import PRUNED_AT, PRUNER_OPTIONS, RUN_DIR

log = logging.getLogger(__name__)

ERROR = "error"
ORPHANED = "its process died"
STALE = "no heartbeat within the grace period: its machine or process died"
PREEMPTED = "preempted (its job exited 75)"
# What a retry keeps of its trial's user attributes (Optuna's callback copies them all):
# the run dir to resume, and the pruner's options; not the pid, host or error of the dead.
INHERITED = (RUN_DIR, PRUNER_OPTIONS)
OUTBOX = "outbox"


@contextlib.contextmanager
def _public_experimental() -> Iterator[None]:
    """Optuna marks its retry callback experimental (since 2.8, unchanged since 3.0): that
    notice on every dead trial says nothing to a user of the sweeper, who never calls it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def _retry_history(trial: optuna.trial.FrozenTrial) -> list[int]:
    with _public_experimental():
        return RetryHeartbeatStaleTrialCallback.retry_history(trial)


def fail_and_retry(opened: optuna_study.OpenStudy, trial: optuna.trial.FrozenTrial,
                   error: str, max_retries: int) -> bool:
    """Mark FAIL a running trial this process does not run (a dead one's, or its own
    preempted one), with `error`, and enqueue its retry unless it has had max_retries;
    False when another worker had finished it first."""
    again = len(_retry_history(trial)) < max_retries
    if not optuna_study.fail(opened, trial.number, {ERROR: error, RETRIED: again}):
        return False
    if again:
        clean = copy.deepcopy(trial)
        clean.user_attrs = {k: v for k, v in trial.user_attrs.items() if k in INHERITED}
        with _public_experimental():
            RetryHeartbeatStaleTrialCallback(max_retry=max_retries)(opened.study, clean)
    log.warning("trial %d: %s; %s", trial.number, error,
                "retried" if again else f"not retried (max_retries={max_retries} used)")
    return True


def orphaned(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a RUNNING trial belongs to a process of this host that no longer exists."""
    attrs = trial.user_attrs
    return (attrs.get("host") == socket.gethostname() and "pid" in attrs
            and not run_lock.pid_alive(int(attrs["pid"])))


def fail_orphans(opened: optuna_study.OpenStudy, max_retries: int = 0) -> list[int]:
    """Fail (and retry) the RUNNING trials of dead processes on this host."""
    return [t.number for t in opened.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if orphaned(t) and fail_and_retry(opened, t, ORPHANED, max_retries)]


def fail_stale(opened: optuna_study.OpenStudy, max_retries: int = 0,
               outage: Outage | None = None) -> list[int]:
    """Fail (and retry) the RUNNING trials whose heartbeat is older than the grace period.

    Not while the storage is just back from an outage: every trial's heartbeat went stale
    while it was away, and the live ones need a grace period to beat again."""
    grace = optuna_study.grace_period_s(opened.storage)
    if outage is not None and grace and outage.back_since_s() < grace:
        return []
    stale = optuna_study.stale_trials(opened)
    return [t.number for t in stale if fail_and_retry(opened, t, STALE, max_retries)]


def check_dead(opened: optuna_study.OpenStudy, max_retries: int,
               outage: Outage | None = None) -> list[int]:
    return [*fail_orphans(opened, max_retries), *fail_stale(opened, max_retries, outage)]


@contextlib.contextmanager
def watching(opened: optuna_study.OpenStudy, max_retries: int, period_s: float,
             outage: Outage | None = None) -> Iterator[None]:
    """Check for dead trials every period_s seconds while the block runs (in a thread: the
    block may be a trial's job, or a wait for the peers' trials)."""

    def check() -> None:
        try:
            check_dead(opened, max_retries, outage)
        except Exception as err:  # the storage away, a race with a peer: try again
            log.debug("dead-trial check: %s: %s", type(err).__name__, err)

    with optuna_study.repeating(check, period_s, "sweep-dead-trials"):
        yield


def watch_period_s(heartbeat_s: int | None) -> float:
    """How often to look for dead trials: twice per heartbeat, else (pids only) every 2 s."""
    return max(0.5, heartbeat_s / 2) if heartbeat_s else 2.0


# ----------------------------------------------------------------------------- the outbox


def keep(sweep_dir: Path, number: int, result: Mapping[str, Any]) -> Path:
    """Write a finished trial's result (state, values, attrs) before telling the storage."""
    box = sweep_dir / OUTBOX
    box.mkdir(parents=True, exist_ok=True)
    path = box / f"trial-{number}.json"
    return atomic.write_text(path, json.dumps({"number": number, **result}))


def settled(record: Mapping[str, Any],
            trial: optuna.trial.FrozenTrial) -> tuple[TrialState, Any]:
    """(state, values) to tell for a job's result `record` on `trial` as the storage holds
    it: a job its pruner stopped (PRUNED_AT on the trial) ends PRUNED with its last value."""
    state = TrialState[record["state"]]
    if state == TrialState.COMPLETE and PRUNED_AT in trial.user_attrs:
        return TrialState.PRUNED, None
    return state, record.get("values")


def tell_kept(opened: optuna_study.OpenStudy, record: Mapping[str, Any]) -> str:
    """Tell the storage a kept result; what became of it, in words."""
    trial = opened.trial(record["number"])
    attrs = dict(record.get("attrs") or {})
    if not trial.state.is_finished():
        trial_id = opened.trial_id(trial.number)
        for key, value in attrs.items():
            opened.storage.set_trial_user_attr(trial_id, key, value)
        state, values = settled(record, trial)
        opened.study.tell(trial.number, values, state=state)
        return "told"
    state = TrialState[record["state"]]
    retries = [t for t in opened.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
               if trial.number in _retry_history(t)]
    if state != TrialState.COMPLETE or not retries:
        return f"dropped: the trial is {trial.state.name} and no retry of it waits"
    for retry in retries:  # the retry is no longer needed: the original's result is here
        optuna_study.fail(opened, retry.number, {NOT_RUN: f"trial {trial.number}'s result "
                                                 "arrived from the outbox"})
    opened.study.add_trial(optuna.trial.create_trial(
        params=trial.params, distributions=trial.distributions, values=record["values"],
        user_attrs={**attrs, "result_of": trial.number}))
    return "added as a new trial (the original had been failed while the storage was away)"


def flush(opened: optuna_study.OpenStudy, sweep_dir: Path) -> None:
    """Tell the storage the results a previous run kept in the outbox."""
    box = sweep_dir / OUTBOX
    for path in sorted(box.glob("trial-*.json")) if box.is_dir() else []:
        record = json.loads(path.read_text())
        what = tell_kept(opened, record)
        log.warning("trial %d's kept result (%s): %s", record["number"], path, what)
        path.unlink(missing_ok=True)


def waiting_for(study: optuna.Study, heartbeats: bool) -> Sequence[optuna.trial.FrozenTrial]:
    """The peers' RUNNING trials worth waiting for at the end of a sweep: each either
    finishes or is failed (and maybe retried) by the dead-trial check. On a storage without
    heartbeats only this host's can be checked, so only those are waited for."""
    host, pid = socket.gethostname(), os.getpid()
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if "host" in t.user_attrs and (t.user_attrs["host"], t.user_attrs.get("pid"))
            != (host, pid) and (heartbeats or t.user_attrs["host"] == host)]
