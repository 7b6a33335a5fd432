"""Local worker processes of a sweep: the same command, pulling trials from one storage.

A worker is the sweep's own command line run again with `hydra.sweeper.n_workers=1` and
its own `worker_index`; it shares the study through the storage, not through this
process, exactly as a worker on another machine would.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from capibara_exp.base.errors import ConfigError

_OWN_KEYS = ("hydra.sweeper.n_workers=", "hydra.sweeper.worker_index=", "hydra.sweep.dir=")


def worker_command(argv: Sequence[str], index: int, sweep_dir: Path) -> list[str]:
    """The command of worker `index`: the sweep's arguments with the worker's own settings."""
    kept = [a for a in argv if not a.lstrip("+~").startswith(_OWN_KEYS)]
    quoted = str(sweep_dir.absolute()).replace("\\", "\\\\").replace("'", "\\'")
    return [sys.executable, "-m", "capibara_exp.cli", *kept, "hydra.sweeper.n_workers=1",
            f"hydra.sweeper.worker_index={index}", f"hydra.sweep.dir='{quoted}'"]


def start(argv: Sequence[str], n_workers: int, sweep_dir: Path) -> list[subprocess.Popen]:
    """Start workers 1..n_workers-1, each logging to <sweep_dir>/workers/worker-<i>.log."""
    log_dir = sweep_dir / "workers"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for index in range(1, n_workers):
        log = open(log_dir / f"worker-{index}.log", "w")  # noqa: SIM115 - the child owns it
        procs.append(subprocess.Popen(worker_command(argv, index, sweep_dir), stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()
    return procs


def wait(procs: Sequence[subprocess.Popen], sweep_dir: Path) -> None:
    """Wait for every worker; a worker that failed is an error naming its log."""
    failed = [(i, p.wait()) for i, p in enumerate(procs, start=1)]
    failed = [(i, rc) for i, rc in failed if rc]
    if failed:
        logs = ", ".join(f"{sweep_dir / 'workers' / f'worker-{i}.log'} (exit {rc})"
                         for i, rc in failed)
        raise ConfigError(f"{len(failed)} sweep worker(s) failed: {logs}")


def stop(procs: Sequence[subprocess.Popen]) -> None:
    """Terminate workers still running (the sweep itself failed); their trials become FAIL
    on the next run, as a killed sweep's do."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
