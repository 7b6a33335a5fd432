"""The paths a command line names, checked before anything is written.

Inputs (run dirs, checkpoints, data dirs a command reads) are read-only: an output may not
be one of them, lie inside one, or hold one. An output is new or an empty directory. An
empty path would mean the current directory, so it is refused by name; so is a path the
file system cannot hold (a component over NAME_MAX, a path over PATH_MAX) and one whose
nearest existing ancestor is a file or cannot be written. Each problem is a ConfigError
naming the key and the path (exit 2, nothing written).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path, PurePath

from capibara_exp.base.errors import ConfigError

NAME_MAX = 255
PATH_MAX = 4096


def given(key: str, value: object) -> Path:
    """A path value as the user gave it: not empty, not longer than the file system allows."""
    text = "" if value is None else str(value)
    if not text.strip():
        raise ConfigError(f"{key}={text}: an empty path (it would mean the current "
                          "directory); name the directory")
    if "\0" in text:
        raise ConfigError(f"{key}: the path holds a NUL character")
    long = next((part for part in PurePath(text).parts if len(part.encode()) > NAME_MAX), None)
    if long is not None:
        raise ConfigError(f"{key}={text[:60]}...: a path component of {len(long.encode())} "
                          f"bytes (the file system allows {NAME_MAX})")
    if len(os.fsencode(os.path.abspath(text))) >= PATH_MAX:
        raise ConfigError(f"{key}={text[:60]}...: the path is longer than the file system "
                          f"allows ({PATH_MAX} bytes)")
    return Path(text)


def existing_input(key: str, value: object) -> Path:
    """A path the command reads: it must exist."""
    path = given(key, value)
    if not path.exists():
        raise ConfigError(f"{key}={path}: no such file or directory")
    return path


def writable_dir(key: str, value: object) -> Path:
    """A directory the command writes into (created if missing, kept if there: a run dir
    that resumes): it is a directory or can be made one, and can be written."""
    path = given(key, value)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={path}: is a file, not a directory")
    _creatable(key, path)
    return path


def dir_or_creatable(key: str, value: object) -> Path:
    """A directory that is read if it is there (a shared data dir may be read-only), or made
    if it is not: an existing one must be a directory; a missing one must be creatable."""
    path = given(key, value)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}={path}: is a file, not a directory")
        return path
    _creatable(key, path)
    return path


def new_output(key: str, value: object, inputs: dict[str, object]) -> Path:
    """An output directory: new or empty, and neither one of `inputs` (key -> path) nor
    inside one nor holding one."""
    path = given(key, value)
    here = _real(path)
    for name, source in inputs.items():
        if source is None or not str(source).strip():
            continue
        there = _real(Path(str(source)))
        if here == there or there in here.parents or here in there.parents:
            raise ConfigError(f"{key}={path}: overlaps the input {name}={source}; inputs are "
                              f"read-only, so write to a new directory")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={path}: exists and is a file; name a new directory")
    if path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"{key}={path}: exists and is not empty; name a new or empty "
                          "directory")
    _creatable(key, path)
    return path


def new_file(key: str, value: object, inputs: dict[str, object]) -> Path:
    """An output file: not a directory, not inside an input, its directory writable."""
    path = given(key, value)
    if path.is_dir():
        raise ConfigError(f"{key}={path}: is a directory; name a file")
    here = _real(path)
    for name, source in inputs.items():
        there = _real(Path(str(source)))
        if here == there:
            raise ConfigError(f"{key}={path}: is the input {name}; name another file")
    _creatable(key, path.parent if str(path.parent) else Path("."))
    return path


def run_name(key: str, value: object) -> str:
    """A name that becomes one part of an output path: no separators that leave it."""
    text = "" if value is None else str(value)
    if not text.strip():
        raise ConfigError(f"{key}={text}: an empty name")
    parts = PurePath(text).parts
    if PurePath(text).is_absolute() or any(p in ("..", ".") for p in parts):
        raise ConfigError(f"{key}={text}: a name may not be absolute or hold '.' or '..' "
                          "(it would leave the outputs directory)")
    return text


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _creatable(key: str, path: Path) -> None:
    """The nearest existing ancestor of `path` is a directory this process can write."""
    probe = Path(os.path.abspath(path))
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
        if probe.is_symlink() and not probe.exists():
            raise ConfigError(f"{key}={path}: {probe} is a broken link")
    if not probe.is_dir():
        raise ConfigError(f"{key}={path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK) or _read_only(probe):
        raise ConfigError(f"{key}={path}: {probe} cannot be written (read-only or no "
                          "permission)")


def _read_only(directory: Path) -> bool:
    """A read-only mount: os.access says writable to root everywhere but there."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


@contextlib.contextmanager
def undone_if_refused(path: object, codes: tuple[int, ...] = (2,)) -> Iterator[None]:
    """A command refused (exit 2, or another of `codes`) after it began writing `path`, a
    directory that was new or empty: what it wrote there goes again, so a refusal leaves
    nothing."""
    target = Path(str(path)).absolute()
    missing = _outermost_missing(target)
    was_empty = target.is_dir() and not any(target.iterdir())
    try:
        yield
    except SystemExit as stop:
        if stop.code in codes and (missing is not None or was_empty):
            _remove(missing if missing is not None else target, keep_root=missing is None)
        raise


def _outermost_missing(path: Path) -> Path | None:
    missing = None
    while not path.exists() and path.parent != path:
        path, missing = path.parent, path
    return missing


def _remove(path: Path, keep_root: bool) -> None:
    if not path.is_dir():
        return
    _descriptors_for_cleanup()
    # A library's writer threads (Orbax's async commit) may still be finishing the files of
    # the failed write while the main thread leaves: remove until nothing comes back.
    # Done when a removal is still complete after a pause (a busy machine slows them).
    for attempt in range(_REMOVE_TRIES):
        _remove_once(path, keep_root)
        time.sleep(min(0.1 * (attempt + 1), 1.0))
        if not (path.exists() and (not keep_root or any(path.iterdir()))):
            return


_REMOVE_TRIES = 20


def _remove_once(path: Path, keep_root: bool) -> None:
    if not keep_root:
        shutil.rmtree(path, ignore_errors=True)
        return
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _descriptors_for_cleanup() -> None:
    """A command that failed for want of descriptors (EMFILE) still removes what it began:
    rmtree opens each directory, so the soft limit goes up to the hard one (a process may)
    on its way out."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
