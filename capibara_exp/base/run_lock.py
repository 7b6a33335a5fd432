"""One process per run dir (and per data build): a lock file naming its holder's pid and host.

`hold(directory)` creates DIRECTORY/.capibara.lock atomically (written beside it, then
hard-linked into place, so a lock is never seen half-written). A second process finds it
and is refused with the holder's pid and host (a ConfigError: exit 2, nothing written). A
lock whose process is gone (same host, no such pid, or the pid now belongs to a process
that started later) is stale: it is taken over, and `hold` returns a note saying so. The
lock is removed when its holder ends (atexit; a killed process leaves a stale one), or
when `held` ends. A holder that only needs what the other holder makes (a run reading the
data another process builds) waits instead of being refused (`wait=True`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from capibara_exp.base.errors import ConfigError

LOCK_NAME = ".capibara.lock"
WAIT_POLL_S = 0.5  # how often a waiting process looks at the lock again


def refuse_if_held(directory: str | Path, what: str = "model_dir",
                   shown: str | Path | None = None) -> None:
    """ConfigError when a live process (not this one) holds the lock of `directory`; takes
    and writes nothing (the command line's checks, before the run's first line). `shown`:
    the path the message names as `what` (default `directory`)."""
    directory = Path(directory)
    holder = _read(directory / LOCK_NAME)
    if holder is not None and _alive(holder) and not _mine(holder):
        raise ConfigError(_in_use(directory, what, holder, shown))


def _mine(holder: dict) -> bool:
    return holder.get("pid") == os.getpid() and holder.get("host") == _host()


def _in_use(directory: Path, what: str, holder: dict, shown: str | Path | None) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("time", 0)))
    return (f"{what}={shown or directory}: in use by pid {holder.get('pid')} on host "
            f"{holder.get('host')} (since {since}); wait for it to end or use "
            f"another dir (if that process is gone, remove {directory / LOCK_NAME})")


@contextlib.contextmanager
def held(directory: str | Path, what: str = "model_dir", shown: str | Path | None = None,
         wait: bool = False) -> Iterator[str | None]:
    """`hold` for the `with` block (its note as the value); released when it ends."""
    note = hold(directory, what, shown, wait)
    try:
        yield note
    finally:
        release(Path(directory) / LOCK_NAME)


def hold(directory: str | Path, what: str = "model_dir", shown: str | Path | None = None,
         wait: bool = False) -> str | None:
    """Take the lock of `directory` (made if missing) for this process; a note when a stale
    lock was taken over, else None. A live holder: ConfigError, or with `wait` the lock is
    taken once that holder releases it (or dies)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    note, tries = None, 0
    while tries < 3:
        # A live holder is refused before this process writes anything there.
        if not path.exists() and _create(path):
            atexit.register(release, path)
            return note
        holder = _read(path)
        if holder is None and not path.exists():
            continue  # released between the two looks
        if holder is not None and _alive(holder):
            if _mine(holder):
                return note  # this process took it already (a second job of one multirun)
            if not wait:
                raise ConfigError(_in_use(directory, what, holder, shown))
            time.sleep(WAIT_POLL_S)
            continue
        tries += 1
        note = (f"took over the stale lock of {directory} (pid {holder.get('pid')} on "
                f"{holder.get('host')} is gone)" if holder else
                f"took over the unreadable lock file {path}")
        _set_aside(path, holder)
    raise ConfigError(f"{what}={shown or directory}: could not take its lock {path} (another "
                      "process keeps taking it)")


def release(path: str | Path) -> None:
    """Remove the lock if this process holds it."""
    path = Path(path)
    holder = _read(path)
    if holder and _mine(holder):
        try:
            path.unlink()
        except OSError:
            pass


def _create(path: Path) -> bool:
    record = {"pid": os.getpid(), "host": _host(), "time": time.time(),
              "start": _start_time(os.getpid())}
    temp = path.with_name(f"{LOCK_NAME}.{_host()}.{os.getpid()}")
    temp.write_text(json.dumps(record))
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    finally:
        temp.unlink(missing_ok=True)


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def _alive(holder: dict) -> bool:
    """Whether the holder may still run: on another host it cannot be told, so yes."""
    if holder.get("host") != _host():
        return True
    pid = holder["pid"]
    if not pid_alive(pid):
        return False
    started = holder.get("start")
    return started is None or _start_time(pid) in (None, started)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs: a killed process that its parent has not
    reaped yet is a zombie, and dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux: the state after the command's closing parenthesis; Z is a zombie
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux): tells a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _set_aside(path: Path, seen: dict | None) -> None:
    """Move the stale lock `seen` out of the way: renamed, then compared, so a taker that
    was quicker (whose fresh lock was renamed instead) gets it back."""
    aside = path.with_name(f"{LOCK_NAME}.stale.{_host()}.{os.getpid()}")
    try:
        path.rename(aside)
    except FileNotFoundError:
        return
    if _read(aside) != seen:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    aside.unlink(missing_ok=True)


def _host() -> str:
    return socket.gethostname()
