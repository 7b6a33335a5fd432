"""One build per data dir: while `capibara-exp-data` builds, a second build of the same
data dir is refused at once (exit 2, one line with the pid and host holding it, nothing
written); a build killed with -9 leaves a stale lock that the next build takes over with a
note. Two real builds, in two processes (the first stopped with SIGSTOP while it holds the
lock, so the second certainly finds it held)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capibara_exp.base import run_lock
from capibara_exp.data.e2b import build
from tests.snapshots import snapshot

BUILD = ["collect.sources=[sqlite_statements]", "collect.max_per_source=30"]


def _start(data_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "capibara_exp.cli.data",
                             f"data_dir={data_dir}", *BUILD, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _holding(proc: subprocess.Popen, data_dir: Path) -> None:
    """Wait until `proc` holds the build's lock, then stop it there (SIGSTOP)."""
    lock = build.dataset_dir(data_dir) / run_lock.LOCK_NAME
    while not lock.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)
    assert run_lock._read(lock)["pid"] == proc.pid


def _run(data_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "capibara_exp.cli.data",
                           f"data_dir={data_dir}", *BUILD, *extra],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_second_build_of_a_data_dir_is_refused_with_the_holders_pid_and_host(
        tmp_path: Path) -> None:
    first = _start(tmp_path / "data")
    try:
        _holding(first, tmp_path / "data")
        before = snapshot(tmp_path)
        second = _run(tmp_path / "data", "force=true")
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert lines[0].startswith(f"capibara-exp-data: configuration error: "
                                   f"data_dir={tmp_path / 'data'}: in use by pid {first.pid} "
                                   f"on host {socket.gethostname()}"), lines
        assert snapshot(tmp_path) == before  # the refused build wrote nothing
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=600)
        assert first.returncode == 0, err[-3000:]
    finally:
        first.send_signal(signal.SIGCONT)
        first.kill()
        first.wait()
    lock = build.dataset_dir(tmp_path / "data") / run_lock.LOCK_NAME
    assert not lock.exists()  # released when the build ended
    assert (build.dataset_dir(tmp_path / "data") / "manifest.json").is_file()


@pytest.mark.slow
def test_a_killed_builds_stale_lock_is_taken_over_with_a_note(tmp_path: Path) -> None:
    killed = _start(tmp_path / "data")
    try:
        _holding(killed, tmp_path / "data")
    finally:
        killed.kill()  # kill -9: the lock stays behind
        killed.wait()
    lock = build.dataset_dir(tmp_path / "data") / run_lock.LOCK_NAME
    assert run_lock._read(lock)["pid"] == killed.pid
    after = _run(tmp_path / "data")
    assert after.returncode == 0, after.stderr[-3000:]
    note = (f"e2b_routing: took over the stale lock of {build.dataset_dir(tmp_path / 'data')} "
            f"(pid {killed.pid} on {socket.gethostname()} is gone)")
    assert note in after.stderr.splitlines(), after.stderr[-3000:]
    assert not lock.exists()
    assert (build.dataset_dir(tmp_path / "data") / "manifest.json").is_file()


def test_a_run_reading_the_data_waits_for_the_build_in_progress(tmp_path: Path) -> None:
    """A training run only reads the data: it waits for the build another process holds
    (as a sweep's runs wait for the first that builds), then takes the lock in turn."""
    import threading

    out = build.dataset_dir(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from capibara_exp.base import run_lock\n"
         f"run_lock.hold({str(out)!r}); print('held', flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        taken = []
        waiter = threading.Thread(target=lambda: taken.append(
            run_lock.hold(out, "data_dir", wait=True)))
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive() and not taken  # the holder lives: still waiting
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
        waiter.join(timeout=60)
        assert taken == [None]  # released by its holder: no stale lock to take over
        assert run_lock._read(out / run_lock.LOCK_NAME)["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()
        run_lock.release(out / run_lock.LOCK_NAME)
