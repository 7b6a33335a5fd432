"""How fast a sweep recovers from faults, on a real PostgreSQL server (Debian's binaries).

    python -m bench.sweep_faults        # from the checkout's root (it uses tests' helpers)

Three workers (the same command, seed 0), heartbeat 1 s, grace period 3 s, 1 s jobs: the
server is stopped for about 10 s mid-sweep, then a worker whose trial is made to look like
another machine's is killed (only its heartbeat can tell), then a worker of this host
(its pid tells). Prints each delay and its ratio to the bound it should stay within.
"""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

import optuna

from capibara_exp.base import optuna_study
from tests.test_sweeper_faults import lines, start_workers, wait_for
from tests.test_sweeper_workers import PostgresServer, serve_postgres

GRACE_S, WATCH_S = 3.0, 0.5  # the workers' grace period; their dead-trial check's period


def running(sweep_dir: Path, but: set[str]) -> tuple[str, str, str]:
    ends = lines(sweep_dir, "end")
    return [(p, n, x) for p, n, x in lines(sweep_dir, "start")
            if [p, n] not in ends and p not in but][-1]


def killed_until_failed(url: str, procs: list, sweep_dir: Path, but: set[str],
                        elsewhere: bool) -> tuple[str, float, float]:
    opened = optuna_study.load(optuna_study.open_storage(url), "faults")
    while True:
        pid, number, x = running(sweep_dir, but)
        try:  # another machine's trial: this host's pid check cannot see it die
            if elsewhere:
                opened.storage.set_trial_user_attr(opened.trial_id(int(number)), "host",
                                                   "elsewhere")
            break
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # it finished meanwhile: take the next running one
    next(p for p in procs if p.pid == int(pid)).send_signal(signal.SIGKILL)
    start = time.monotonic()
    wait_for(lambda: opened.trial(int(number)).state.is_finished(), "the kill's FAIL")
    failed = time.monotonic() - start
    wait_for(lambda: [xx for _, _, xx in lines(sweep_dir, "start")].count(x) >= 2, "its retry")
    return pid, failed, time.monotonic() - start


def measure(pg: PostgresServer, sweep_dir: Path) -> None:
    procs = start_workers(pg.url, sweep_dir, n=3, n_trials=16, sleep_s=1.0)
    wait_for(lambda: len(lines(sweep_dir, "end")) >= 2, "two finished trials")
    pg.stop()
    stopped, before = time.monotonic(), len(lines(sweep_dir, "start"))
    time.sleep(10)
    pg.start()
    up = time.monotonic()
    wait_for(lambda: len(lines(sweep_dir, "start")) > before, "a trial after the restart")
    print(f"database away {up - stopped:.1f} s; next trial started {time.monotonic() - up:.2f}"
          " s after the server was up (backoff cap 2 s)")
    pid, failed, retried = killed_until_failed(pg.url, procs, sweep_dir, set(), True)
    print(f"dead machine: FAIL {failed:.1f} s after SIGKILL = {failed / GRACE_S:.2f} x the "
          f"grace period (bound: grace + last beat 1 s + check {WATCH_S} s = 1.5 x); "
          f"its retry started {retried:.1f} s after")
    _, failed, retried = killed_until_failed(pg.url, procs, sweep_dir, {pid}, False)
    print(f"dead process on this host: FAIL {failed:.1f} s after SIGKILL; its retry "
          f"started {retried:.1f} s after")
    for proc in procs:
        proc.kill()
        proc.wait()


def main() -> None:
    for pg in serve_postgres():
        measure(pg, Path(tempfile.mkdtemp(prefix="sweep-faults-")))


if __name__ == "__main__":
    main()
