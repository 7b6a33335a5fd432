"""Sweeps under faults: workers started together with one seed, a PostgreSQL server
restarted under three workers, a worker killed with SIGKILL mid-trial, a database away for
longer than a worker waits (its result kept on disk, told by the next run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from capibara_exp.sweeping import recovery, retry, study
from tests.test_sweeper_workers import PostgresServer, serve_postgres

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def postgres() -> Iterator[PostgresServer]:
    yield from serve_postgres()


def worker(url: str, sweep_dir: str, n_trials: int, sleep_s: float) -> None:
    """One worker as the docs' command runs it (seed 0 everywhere): it waits for the file
    `go` (all workers start at once), logs `start PID N X` and `end PID N` around each job,
    and writes the results at its end, as the sweeper's end does."""
    log, go = Path(sweep_dir) / "ran.log", Path(sweep_dir) / "go"
    (Path(sweep_dir) / f"ready-{os.getpid()}").touch()
    while not go.exists():
        time.sleep(0.01)

    def job(overrides: list[str], number: int) -> dict:
        x = float(dict(o.split("=", 1) for o in overrides)["x"])
        with open(log, "a") as f:
            f.write(f"start {os.getpid()} {number} {x!r}\n")
        time.sleep(sleep_s)
        with open(log, "a") as f:
            f.write(f"end {os.getpid()} {number}\n")
        return {"loss": (x - 0.3) ** 2}

    settings = study.SweepSettings(study_name="faults", storage=url, sampler="random", seed=0,
                                   n_trials=n_trials, params={"x": "interval(0, 1)"},
                                   heartbeat_interval=1, grace_period=3, storage_retry_s=120)
    study.run(settings, job, Path(sweep_dir), write=True)


def start_workers(url: str, sweep_dir: Path, n: int, n_trials: int,
                  sleep_s: float) -> list[subprocess.Popen]:
    code = ("import sys; from tests.test_sweeper_faults import worker; "
            "worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, url, str(sweep_dir), str(n_trials),
                               str(sleep_s)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    wait_for(lambda: len(list(sweep_dir.glob("ready-*"))) == n, "every worker at the barrier")
    (sweep_dir / "go").touch()
    return procs


def lines(sweep_dir: Path, kind: str) -> list[list[str]]:
    path = sweep_dir / "ran.log"
    text = path.read_text() if path.exists() else ""
    return [line.split()[1:] for line in text.splitlines() if line.startswith(kind + " ")]


def wait_for(condition, what: str, timeout_s: float = 300.0) -> None:
    """Until condition() holds; a hang fails the test (no timed assertion)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


def test_workers_started_together_with_one_seed_sample_distinct_points(tmp_path: Path) -> None:
    """Three processes, one command, one seed, started by a barrier: a sampler seeded once per
    process drew the same first point in each (2 distinct of 3)."""
    url = study.storage_url(None, tmp_path)
    procs = start_workers(url, tmp_path, n=3, n_trials=6, sleep_s=0.3)
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    xs = [float(x) for _, _, x in lines(tmp_path, "start")]
    assert len(xs) == 6 and len(set(xs)) == 6, xs
    assert len({pid for pid, *_ in lines(tmp_path, "start")}) > 1  # they ran together


@pytest.mark.slow
def test_three_workers_outlive_a_database_restart_and_a_killed_worker(
        postgres: PostgresServer, tmp_path: Path) -> None:
    n_trials = 9
    procs = start_workers(postgres.url, tmp_path, n=3, n_trials=n_trials, sleep_s=1.0)
    wait_for(lambda: len(lines(tmp_path, "end")) >= 2, "two finished trials")
    postgres.stop()  # mid-sweep: jobs run on, their results wait for the server
    time.sleep(8)
    # Counted while the server is away (no trial can start then): a count taken after the
    # restart could already include the trials the workers started at once.
    started_after = len(lines(tmp_path, "start"))
    postgres.start()
    wait_for(lambda: len(lines(tmp_path, "start")) > started_after, "a trial after the restart")
    # Kill a worker in the middle of its trial: SIGKILL, nothing told to anyone.
    running = [(pid, n) for pid, n, _ in lines(tmp_path, "start")
               if [pid, n] not in lines(tmp_path, "end")]
    victim_pid, victim_trial = running[-1]
    victim = next(p for p in procs if p.pid == int(victim_pid))
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    errors = {}
    for proc in procs:
        if proc is not victim:
            _, errors[proc.pid] = proc.communicate(timeout=600)
            assert proc.returncode == 0, errors[proc.pid][-3000:]

    s = optuna.load_study(study_name="faults", storage=postgres.url)
    trials = study.counted(s)
    assert len(trials) == n_trials and all(t.state == TrialState.COMPLETE for t in trials)
    finished = {int(n) for _, n in lines(tmp_path, "end")}
    complete = {t.number for t in s.trials if t.state == TrialState.COMPLETE}
    assert finished <= complete  # no finished trial lost, the restart's included
    killed = s.trials[int(victim_trial)]
    assert killed.state == TrialState.FAIL and killed.user_attrs[study.RETRIED]
    assert killed.user_attrs[study.ERROR] in (study.ORPHANED, study.STALE)
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert retry.params == killed.params
    # No parameters repeated but the retry's, with the same seed on every worker.
    xs = Counter(t.params["x"] for t in trials)
    assert xs.most_common(1)[0][1] == 1, xs
    assert not [t for t in s.trials if t.state == TrialState.RUNNING]
    for err in errors.values():  # each survivor said so while the server was away
        assert "is unreachable" in err and "is back after" in err, err[-3000:]
    results = yaml.safe_load((tmp_path / study.RESULTS).read_text())
    assert results["trials"] == {"complete": n_trials, "pruned": 0, "fail": 0}
    assert results["best_value"] == min(t.value for t in trials)


def test_a_result_outlives_a_database_away_longer_than_the_worker_waits(
        postgres: PostgresServer, tmp_path: Path) -> None:
    """The worker gives up (exit 1, naming the kept file); the next run tells the result."""
    settings = study.SweepSettings(study_name="away", storage=postgres.url, sampler="random",
                                   seed=0, n_trials=2, params={"x": "interval(0, 1)"},
                                   storage_retry_s=3)

    def job(overrides: list[str], number: int) -> dict:
        if number == 0:
            postgres.stop()  # gone while trial 0 trains, and for longer than 3 s
        return {"loss": float(number)}

    with pytest.raises(retry.StorageUnavailable,
                       match="unreachable for .* trial 0's result is kept in .*trial-0.json"):
        study.run(settings, job, tmp_path)
    kept = tmp_path / recovery.OUTBOX / "trial-0.json"
    assert kept.is_file()
    postgres.start()
    s = study.run(settings, job, tmp_path)
    assert [(t.state, t.value) for t in s.trials] == [(TrialState.COMPLETE, 0.0),
                                                       (TrialState.COMPLETE, 1.0)]
    assert not kept.exists()
