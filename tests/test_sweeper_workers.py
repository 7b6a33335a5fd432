"""Parallel sweep workers on one storage: SQLite, a journal file, a real PostgreSQL server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from capibara_exp.base import optuna_study
from capibara_exp.sweeping import study, workers

ROOT = Path(__file__).resolve().parents[1]
N_TRIALS = 12
SLEEP_S = 0.02  # a job's duration


def wait_for_peers(log: str, peers: int, timeout_s: float = 120.0) -> None:
    """Hold a trial until every worker has started one: a worker that imports faster must not
    finish the whole study before its peers pull their first trial."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len({line.split()[0] for line in Path(log).read_text().splitlines()}) >= peers:
            return
        time.sleep(0.01)


def work(url: str, index: int, log: str, peers: int = 1) -> None:
    """One worker: the sweep loop with a job that records which process ran which trial."""

    def job(overrides: list[str], number: int) -> dict:
        with open(log, "a") as f:  # O_APPEND: lines from two processes do not interleave
            f.write(f"{os.getpid()} {number}\n")
        wait_for_peers(log, peers)
        time.sleep(SLEEP_S)
        x = float(dict(o.split("=") for o in overrides)["x"])
        return {"loss": (x - 0.3) ** 2}

    settings = study.SweepSettings(study_name="shared", storage=url, sampler="tpe", seed=0,
                                   n_trials=N_TRIALS, worker_index=index,
                                   params={"x": "interval(0, 1)"})
    study.run(settings, job, Path(log).parent, write=index == 0)  # as the sweeper's workers


def run_workers(url: str, tmp_path: Path, n: int = 2) -> list[tuple[str, int]]:
    log = tmp_path / "ran.log"
    code = ("import sys; from tests.test_sweeper_workers import work; "
            "work(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, url, str(i), str(log), str(n)],
                              cwd=ROOT, stderr=subprocess.PIPE, text=True) for i in range(n)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    return [(pid, int(num)) for pid, num in (line.split() for line in log.read_text().splitlines())]


def assert_no_duplicate_or_lost_trial(url: str, ran: list[tuple[str, int]]) -> None:
    s = optuna.load_study(study_name="shared", storage=optuna_study.open_storage(url))
    done = [t for t in s.trials if study.NOT_RUN not in t.user_attrs]
    assert sorted(t.number for t in done) == sorted(n for _, n in ran)  # each ran trial told
    assert Counter(n for _, n in ran).most_common(1)[0][1] == 1  # no trial ran twice
    assert len(done) == N_TRIALS and all(t.state == TrialState.COMPLETE for t in done)
    assert len({pid for pid, _ in ran}) == 2  # both workers took trials
    assert len({t.params["x"] for t in done}) == N_TRIALS  # seeds differ per worker
    not_run = [t for t in s.trials if study.NOT_RUN in t.user_attrs]
    assert all(t.number > max(d.number for d in done) for t in not_run)


def test_two_workers_share_a_sqlite_study(tmp_path: Path) -> None:
    url = study.storage_url(None, tmp_path)
    assert_no_duplicate_or_lost_trial(url, run_workers(url, tmp_path))


def test_two_workers_share_a_journal_file(tmp_path: Path) -> None:
    url = str(tmp_path / "study.journal")
    assert_no_duplicate_or_lost_trial(url, run_workers(url, tmp_path))


def test_a_sweep_killed_mid_trial_resumes_without_losing_or_rerunning_trials(
        tmp_path: Path) -> None:
    url, log = study.storage_url(None, tmp_path), tmp_path / "ran.log"
    code = ("import sys, tests.test_sweeper_workers as t; t.SLEEP_S = 0.5; "
            "t.work(sys.argv[1], 0, sys.argv[2])")
    proc = subprocess.Popen([sys.executable, "-c", code, url, str(log)], cwd=ROOT)
    try:
        for _ in range(600):  # until the third trial has started
            if log.exists() and len(log.read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
    finally:
        proc.kill()  # SIGKILL: no chance to tell the storage anything
        proc.wait()
    killed = len(log.read_text().splitlines()) - 1  # the one that was running
    work(url, 0, str(log))  # the same command again
    ran = [int(line.split()[1]) for line in log.read_text().splitlines()]
    assert len(ran) == len(set(ran))  # no trial ran twice
    s = optuna.load_study(study_name="shared", storage=optuna_study.open_storage(url))
    assert len(study.counted(s)) == N_TRIALS  # the total is the study's, across both runs
    assert s.trials[killed].state == TrialState.FAIL
    assert s.trials[killed].user_attrs[study.ERROR] == study.ORPHANED
    (retry,) = [t for t in s.trials if t.system_attrs.get("failed_trial") == killed]
    assert retry.params == s.trials[killed].params and retry.number in ran  # it ran again
    assert all(t.state == TrialState.COMPLETE for t in s.trials if t.number != killed)


def test_a_trial_asked_past_n_trials_is_not_run(tmp_path: Path) -> None:
    """The race itself, made deterministic: another worker asked first and still runs."""
    url = study.storage_url(None, tmp_path)
    settings = study.SweepSettings(study_name="s", n_trials=2, params={"x": "interval(0, 1)"})
    space = study.space_lib.parse(["x=interval(0, 1)"])
    s = study.open_study(settings, url, space).study
    s.tell(s.ask(space.distributions), 1.0)
    other = s.ask(space.distributions)  # a live worker's trial, RUNNING
    other.set_user_attr("host", socket.gethostname())
    other.set_user_attr("pid", os.getpid())
    mine = s.ask(space.distributions)  # asked on the same count: one too many
    assert study._lost_race(s, mine, n_trials=2)
    assert not study._lost_race(s, other, n_trials=2)
    calls: list[int] = []
    study.run(settings, lambda o, n: calls.append(n) or {"loss": 0.0}, tmp_path)
    assert calls == []  # two counted trials: nothing left, and the lost one is not rerun


def test_worker_commands_carry_their_own_settings(tmp_path: Path) -> None:
    argv = ["-m", "hydra/sweeper=capibara_optuna", "hydra.sweeper.n_workers=3",
            "hydra.sweep.dir=elsewhere", "x=interval(0, 1)"]
    cmd = workers.worker_command(argv, 2, tmp_path / "it's")
    assert cmd[:3] == [sys.executable, "-m", "capibara_exp.cli"]
    assert cmd[3:] == ["-m", "hydra/sweeper=capibara_optuna", "x=interval(0, 1)",
                       "hydra.sweeper.n_workers=1", "hydra.sweeper.worker_index=2",
                       f"hydra.sweep.dir='{tmp_path.absolute()}/it\\'s'"]


# ----------------------------------------------------------------------------- PostgreSQL


def _pg_servers() -> list[Path]:
    return sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))


def _pg_bin() -> Path:
    """Debian's PostgreSQL server binaries, installed with apt-get when missing (as root, or
    through `sudo -n`, which fails at once rather than ask for a password)."""
    if not _pg_servers():
        assert shutil.which("apt-get"), (
            "PostgreSQL's server is not installed and there is no apt-get to install it: this "
            "test needs a real server (Debian package postgresql)")
        as_root = [] if os.geteuid() == 0 else ["sudo", "-n"]
        for cmd in (["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "--no-install-recommends", "postgresql"]):
            full = [*as_root, "env", "DEBIAN_FRONTEND=noninteractive", *cmd]
            out = subprocess.run(full, capture_output=True, text=True, timeout=900)
            assert out.returncode == 0, (
                f"installing PostgreSQL's server for this test: `{' '.join(full)}` exited "
                f"{out.returncode}:\n{out.stderr[-3000:]}")
    found = _pg_servers()
    assert found, ("`apt-get install postgresql` succeeded but no server binary is under "
                   "/usr/lib/postgresql/*/bin: this test needs a real server")
    return found[-1].parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, f"{' '.join(cmd)}: {out.stderr[-2000:]}"


class PostgresServer:
    """A PostgreSQL server of its own on a loopback port (Debian's binaries), which a test
    may stop and start again (a database restart under a sweep)."""

    def __init__(self) -> None:
        import psycopg2  # noqa: F401  - the driver optuna's URL names (psycopg2-binary, extra test)

        self.bin_dir, self.port = _pg_bin(), _free_port()
        # Not under pytest's tmp dir: that is private to root, and the server refuses to run
        # as root, so where we are root it runs as the postgres user in a dir it owns.
        self.root = Path(tempfile.mkdtemp(prefix="capibara-pg-"))
        self.data = self.root / "data"
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.root, "postgres")
        _run([*self.as_user, str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", "sweep",
              "--auth=trust", "-E", "UTF8"])
        self.server: subprocess.Popen | None = None
        self.url = f"postgresql+psycopg2://sweep@127.0.0.1:{self.port}/optuna"

    def start(self) -> None:
        self.server = subprocess.Popen(
            [*self.as_user, str(self.bin_dir / "postgres"), "-D", str(self.data), "-p",
             str(self.port), "-h", "127.0.0.1", "-k", str(self.root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(300):
            if subprocess.run([str(self.bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p",
                               str(self.port)], capture_output=True).returncode == 0:
                return
            assert self.server.poll() is None, self.server.stderr.read()
            time.sleep(0.1)
        raise AssertionError(f"PostgreSQL did not start on port {self.port}")

    def stop(self) -> None:
        """A fast shutdown (SIGINT; SIGTERM is PostgreSQL's smart shutdown, which waits for
        the clients to leave): the server closes every client's connection, as a restart does."""
        if self.server is not None and self.server.poll() is None:
            # To the postmaster itself (its pid is the first line of postmaster.pid): runuser,
            # where it runs as the postgres user, does not pass SIGINT on.
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, signal.SIGINT)
            self.server.wait(timeout=60)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def serve_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server with an `optuna` database (a fixture's body), removed afterwards."""
    server = PostgresServer()
    try:
        server.start()
        _run([str(server.bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(server.port),
              "-U", "sweep", "optuna"])
        yield server
    finally:
        server.close()


@pytest.fixture()
def postgres_url() -> Iterator[str]:
    for server in serve_postgres():
        yield server.url


def test_two_workers_share_a_postgresql_study(postgres_url: str, tmp_path: Path) -> None:
    assert_no_duplicate_or_lost_trial(postgres_url, run_workers(postgres_url, tmp_path))


# ----------------------------------------------------------------------------- the real CLI


@pytest.mark.slow
def test_n_workers_runs_a_real_sweep_in_two_processes(tmp_path: Path, data_dir: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "capibara_exp.cli", "-m", "hydra/sweeper=capibara_optuna",
           "hydra.sweeper.n_workers=2", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler=random",
           "debug=fast", "trainer.train_steps=2", "model.emb_dim=32", "model.mlp_dim=64",
           "data.batch_size=4", f"data_dir={data_dir}", f"hydra.sweep.dir={sweep_dir}",
           "schedule.base_learning_rate=tag(log, interval(1e-3, 1e-2))"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    s = optuna.load_study(study_name="dense_tiny_lm",
                          storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    done = [t for t in s.trials if study.NOT_RUN not in t.user_attrs]
    assert len(done) == 3 and all(t.state == TrialState.COMPLETE for t in done)
    pids = {t.user_attrs["pid"] for t in done}
    assert len(pids) == 2, (pids, (sweep_dir / "workers" / "worker-1.log").read_text()[-2000:])
    for t in done:  # each trial trained in its own job dir
        assert (sweep_dir / str(t.number) / "config.gin").exists()
    # Three learning rates, one train-step program: the rate is optimizer state, not a constant.
    assert len({t.params["schedule.base_learning_rate"] for t in done}) == 3
    assert len(list((sweep_dir / "xla_cache").glob("jit__step-*"))) == 1
